"""The attention of a layer's decode step over every valid slot of its dense store, with no score to update (the
full cache; a layer that does not evict at decode), where the valid slots are not a prefix known on the host: a
static cache's (``torch.compile``, CUDA graphs), or rows padded at the front.

With ``kernels="triton"`` the step runs :func:`slake.kernels.triton_dense.dense_attention` (two launches that split
the keys over programs, flash-decoding style; 8-bit rows are read as codes and scales, never dequantised into a copy
of the store); otherwise, or for a store the kernels do not read, SDPA with the validity as its mask over the
(dequantised) store (:func:`slake.cache.decode_step.sdpa_step`), the reason recorded in the
:class:`~slake.cache.fused_step.KernelReport` and logged once, never silently. With 8-bit rows the eager full cache
whose slots are one prefix takes the kernels too (:meth:`slake.cache.decoding.Decoder.step`): SDPA over them would
first dequantise the whole store, every layer and step.
"""

from __future__ import annotations

import torch

from slake.cache.decode_step import sdpa_step
from slake.cache.fused_step import KernelReport, _placeholder
from slake.cache.layer_store import LayerStore
from slake.kernels import host_layer

__all__ = ["dense_kernel_reason", "masked_dense_attention"]

_DOTS = (torch.float32, torch.float16, torch.bfloat16)


def dense_kernel_reason(store: LayerStore) -> str | None:
    """Why :func:`slake.kernels.triton_dense.dense_attention` cannot read ``store`` (None when it can): float32,
    float16 and bfloat16 rows, and 8-bit rows with their scales, it reads, on a GPU (or in Triton's interpreter)."""
    if (on_host := host_layer(store.keys)) is not None:
        return on_host
    if store.kv_dtype is None and store.keys.dtype not in _DOTS:
        return f"{store.keys.dtype} keys in the dense attention"
    if store.kv_dtype is not None and (store.k_scale is None or store.v_scale is None):
        return f"{store.kv_dtype} storage without its scales in the dense attention"
    return None


def masked_dense_attention(
    kernels: str, store: LayerStore, query: torch.Tensor, scaling: float, report: KernelReport | None = None
) -> torch.Tensor:
    """``query`` ``(R, Hq, d)`` over every valid slot of ``store`` (its new token already written): ``(R, Hq, d)`` in
    the store's dtype, as SDPA with the validity as its mask returns.

    ``kernels="triton"`` runs the split-over-the-keys kernels where they read the store; ``report`` records which
    ran, and why the torch step did where the kernels were asked for (not under ``torch.compile``: a side effect per
    step would break the graph)."""
    if report is not None and torch.compiler.is_compiling():
        report = None
    if kernels == "triton":
        reason = dense_kernel_reason(store)
        if reason is None:
            from slake.kernels.triton_dense import dense_attention, dense_attention_op  # loaded by resolve_kernels

            op = dense_attention_op if torch.compiler.is_compiling() else dense_attention
            if report is not None:
                report.record("triton")
            k_scale, v_scale = store.k_scale, store.v_scale
            if k_scale is None or v_scale is None:  # rows at the model's dtype: the scales are not read
                k_scale = v_scale = _placeholder(store.valid.device, torch.float32)
            return op(query, store.keys, store.values, store.valid, k_scale, v_scale, scaling)
        if report is not None:
            report.record("torch", reason)
    elif report is not None:
        report.record("torch")
    return sdpa_step(query, store.dense_keys(), store.dense_values(), store.valid, scaling)
