"""The host's share of an eager decode step: what Python and torch's dispatch cost per layer, the kernels left out.

On a GPU an eager decode step is bound by its host work when the kernels are short (``docs/gpu.md``): the device
waits for the next launch. This measures that host work on any machine: a small random Llama (transformers, in
process, no download) decodes with ``SlakeCache(kernels="triton")`` while the two fused Triton kernels are replaced
by launches that do nothing, so what is timed is everything around them (the model's own operations, the cache's
Python, the fused step's argument preparation and dispatch). ``dispatch="op"`` calls the step through its custom
operator (``slake::fused_decode_step``, what ``torch.compile`` captures), ``"direct"`` through the function (what
eager code does); the full cache runs plain SDPA. One torch thread. Variants alternate within each repetition, so
a drift of the machine's speed affects both sides of a pair alike.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

__all__ = ["host_step_ms"]


class _NoLaunch:
    """A Triton kernel whose launches do nothing (``kernel[grid](...)``)."""

    def __getitem__(self, grid: Any):
        return lambda *args, **kwargs: None


def _model(layers: int, hidden: int, heads: int, kv_heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    kw: dict[str, Any] = dict(
        vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=8192,
        attn_implementation="sdpa",
    )  # fmt: skip
    cfg = LlamaConfig(**kw)
    import slake

    model = LlamaForCausalLM(cfg).eval()
    slake.prepare_model(model)
    return model


def host_step_ms(
    methods: list[str],
    *,
    budget: int = 64,
    prompt: int = 300,
    layers: int = 8,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    steps: int = 30,
    repeats: int = 3,
) -> list[dict]:
    """Median host milliseconds per layer and decode step, per method and dispatch, ``repeats`` times each.

    Returns one row per (repeat, method, dispatch): ``{"method", "dispatch", "repeat", "ms_per_layer_step"}``
    (``dispatch`` is ``"sdpa"`` for the full cache)."""
    from slake.engines.transformers.cache import SlakeCache
    from slake.kernels import triton_decode
    from slake.methods import make_method

    torch.set_num_threads(1)  # the host's work is one thread's; more only adds contention on a shared machine
    kernels = (triton_decode._append_logits_kernel, triton_decode._evict_attend_kernel, triton_decode.fused_step)
    direct = triton_decode.fused_step
    model = _model(layers, hidden, heads, kv_heads)
    ids = torch.randint(0, 512, (1, prompt))
    variants = [("full", "sdpa")] if "full" in methods else []
    variants += [(m, d) for m in methods if m != "full" for d in ("op", "direct")]
    rows = []
    try:
        triton_decode._append_logits_kernel = _NoLaunch()
        triton_decode._evict_attend_kernel = _NoLaunch()
        for rep in range(repeats):
            for name, dispatch in variants:
                triton_decode.fused_step = triton_decode.fused_step_op if dispatch == "op" else direct
                kind = "auto" if name == "full" else "triton"
                cache = SlakeCache(make_method(name), budget, model.config, kernels=kind)
                with torch.no_grad():
                    tok = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                    for _ in range(3):  # warm-up
                        model(tok, past_key_values=cache, use_cache=True)
                    times = []
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        model(tok, past_key_values=cache, use_cache=True)
                        times.append(time.perf_counter() - t0)
                ms = statistics.median(times) * 1e3 / layers
                rows.append({"method": name, "dispatch": dispatch, "repeat": rep, "ms_per_layer_step": round(ms, 4)})
    finally:
        triton_decode._append_logits_kernel, triton_decode._evict_attend_kernel, triton_decode.fused_step = kernels
    return rows
