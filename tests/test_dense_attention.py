"""The full cache's masked decode attention split over the keys (:mod:`slake.kernels.triton_dense`, through Triton's
interpreter on the CPU) against SDPA with the validity as its mask, and the layer step that chooses it
(:mod:`slake.cache.dense_step`): a static store's whole width, or rows padded at the front. Through a model:
``tests/test_fused_decode_models.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slake.cache.compressed import CompressedKV, resolve_kernels
from slake.cache.dense_step import dense_kernel_reason, masked_dense_attention
from slake.cache.fused_step import KernelReport
from slake.kernels import launch_config

#: runs the same under any transformers (none is loaded here): ``make test-oldest`` skips it (tests/test_tiers.py)
pytestmark = pytest.mark.transformers_free

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: the scales' argument of rows at the model's dtype (not read)
_NONE = torch.empty(0, device=DEVICE)


def _kernels():
    resolve_kernels("triton", DEVICE)  # switches the interpreter on where there is no GPU, then loads the kernels
    from slake.kernels import triton_dense

    return triton_dense


def _reference(query, keys, values, valid, scaling):
    R, Hq, d = query.shape
    H = keys.shape[1]
    q = query.reshape(R, H, Hq // H, d).float()
    out = F.scaled_dot_product_attention(q, keys.float(), values.float(), attn_mask=valid[:, :, None, :], scale=scaling)
    return out.reshape(R, Hq, d)


@pytest.mark.parametrize(
    ("R", "Hq", "H", "W", "d", "dtype", "tol"),
    [
        (2, 8, 2, 300, 32, torch.float32, 1e-5),  # GQA, rows of five pieces of 64 slots
        (1, 4, 4, 70, 16, torch.float32, 1e-5),  # MHA, a last piece of 6 slots
        (3, 6, 2, 129, 24, torch.bfloat16, 2e-2),  # a head size that is not a power of two, bfloat16 storage
        (1, 2, 1, 40, 16, torch.float16, 2e-2),  # one piece
    ],
)
def test_the_dense_attention_equals_sdpa_with_the_validity_as_its_mask(R, Hq, H, W, d, dtype, tol):
    """Random validity (each row and KV head keeps at least its first slot, one row has a whole piece empty): the
    output equals masked SDPA's, in the keys' dtype, and the launch splits each row over several programs."""
    triton_dense = _kernels()
    g = torch.Generator().manual_seed(W)
    query = torch.randn(R, Hq, d, generator=g).to(DEVICE, dtype)
    keys, values = (torch.randn(R, H, W, d, generator=g).to(DEVICE, dtype) for _ in range(2))
    valid = (torch.rand(R, H, W, generator=g) > 0.3).to(DEVICE)
    valid[..., 0] = True
    valid[0, 0, 1:65] = False  # a piece with no valid slot adds nothing (no NaN from its -inf logits)
    out = triton_dense.dense_attention(query, keys, values, valid, _NONE, _NONE, 0.3)
    assert out.dtype == dtype and out.shape == (R, Hq, d)
    torch.testing.assert_close(out.float(), _reference(query, keys, values, valid, 0.3), rtol=tol, atol=tol)
    if W > 64:
        assert launch_config.split_size(W, R * H) < W  # more than one piece per row: the partials are combined


def test_the_dense_attention_reads_a_store_through_its_strides():
    """Keys and values that are views with other strides (a store's slots up to its width, a transposed layout)
    give the same output as contiguous copies."""
    triton_dense = _kernels()
    g = torch.Generator().manual_seed(3)
    R, Hq, H, W, d = 2, 4, 2, 100, 16
    query = torch.randn(R, Hq, d, generator=g).to(DEVICE)
    wide = torch.randn(R, H, W + 20, d, generator=g).to(DEVICE)
    keys = wide[:, :, :W]
    values = torch.randn(R, W, H, d, generator=g).to(DEVICE).transpose(1, 2)
    valid = torch.ones(R, H, W, dtype=torch.bool, device=DEVICE)
    valid[1, :, :30] = False  # a row padded at the front
    out = triton_dense.dense_attention(query, keys, values, valid, _NONE, _NONE, 0.25)
    ref = triton_dense.dense_attention(query, keys.contiguous(), values.contiguous(), valid, _NONE, _NONE, 0.25)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(out, _reference(query, keys, values, valid, 0.25), rtol=1e-5, atol=1e-5)


def test_torch_compile_captures_the_dense_attention_as_one_operator():
    """Under ``torch.compile(fullgraph=True)`` the kernels are one opaque operator (no graph break); the compiled
    call (``aot_eager`` runs the operator, here in Triton's interpreter) equals the eager one."""
    triton_dense = _kernels()
    g = torch.Generator().manual_seed(5)
    query = torch.randn(1, 4, 16, generator=g).to(DEVICE)
    keys, values = (torch.randn(1, 2, 90, 16, generator=g).to(DEVICE) for _ in range(2))
    valid = torch.ones(1, 2, 90, dtype=torch.bool, device=DEVICE)
    valid[..., 80:] = False  # a static store's slots after the newest token

    def step(q, k, v, m):
        return triton_dense.dense_attention_op(q, k, v, m, _NONE, _NONE, 0.25) * 2

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(query, keys, values, valid), step(query, keys, values, valid))
    torch._dynamo.reset()


def test_the_layer_step_runs_the_kernels_where_they_read_the_store_and_says_why_not_elsewhere():
    """A full cache's static step with ``kernels="triton"`` (every slot of the store, masked) runs the dense kernels
    and records it, with 8-bit kept entries too (their codes and scales read as they are); with ``kernels="torch"``
    it records the torch step. Each equals the torch step's output."""
    _kernels()
    B, H, G, D, S = 2, 2, 2, 16, 40

    def build(kernels, kv_dtype=None):
        eng = CompressedKV("full", 16, 1, kernels=kernels, kv_dtype=kv_dtype)
        g = torch.Generator().manual_seed(0)
        eng.max_cache_len = S + 8
        q, k, v = (torch.randn(B, n, S, D, generator=g).to(DEVICE) for n in (H * G, H, H))
        eng.prefill_layer(0, q, k, v, None, D**-0.5)
        eng.prepare_static(4)  # the fixed-shape step: attention over the whole store, masked
        return eng

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, n, 1, D, generator=g).to(DEVICE) for n in (H * G, H, H))
    outs = {}
    for kernels, kv_dtype in (("torch", None), ("triton", None), ("triton", "int8"), ("torch", "int8")):
        eng = build(kernels, kv_dtype)
        eng.append(0, k, v)
        outs[kernels, kv_dtype] = eng.decode_attention(0, q, D**-0.5)
        assert eng.decoder.report.summary() == kernels
    torch.testing.assert_close(outs["triton", None], outs["torch", None], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["triton", "int8"], outs["torch", "int8"], rtol=1e-5, atol=1e-5)


def test_the_dense_kernels_reason_names_what_they_do_not_read():
    """Float32, float16 and bfloat16 rows and 8-bit rows with their scales are read by the dense kernels; integer
    keys that are not 8-bit codes, and codes without scales, are not."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert dense_kernel_reason(_FakeStore(None, dtype)) is None
    assert dense_kernel_reason(_FakeStore("fp8_e4m3", torch.uint8, scaled=True)) is None
    assert (
        dense_kernel_reason(_FakeStore("int8", torch.int8)) == "int8 storage without its scales in the dense attention"
    )
    assert dense_kernel_reason(_FakeStore(None, torch.int16)) == "torch.int16 keys in the dense attention"


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3", "fp8_e4m3-bits"])
def test_the_dense_attention_reads_8bit_rows_as_codes_and_scales(kind, monkeypatch):
    """8-bit rows (int8 codes, or fp8 e4m3 bit patterns as uint8) with a float32 scale per slot: the output equals
    masked SDPA over the dequantised rows, in float32, and no dequantised copy of the store is made. fp8 codes are
    read through the GPU's conversion and through their bits (an A100's path, ``slake.kernels.device_support``)."""
    from slake.cache.quant import dequantize_rows, quantize_rows
    from slake.kernels import device_support

    kind, _, bits = kind.partition("-")
    monkeypatch.setattr(device_support, "FP8_BITS", bool(bits))

    triton_dense = _kernels()
    g = torch.Generator().manual_seed(11)
    R, Hq, H, W, d = 2, 8, 2, 150, 32
    query = torch.randn(R, Hq, d, generator=g).to(DEVICE)
    (kc, ks), (vc, vs) = (quantize_rows(torch.randn(R, H, W, d, generator=g).to(DEVICE), kind) for _ in range(2))
    valid = (torch.rand(R, H, W, generator=g) > 0.2).to(DEVICE)
    valid[..., 0] = True
    out = triton_dense.dense_attention(query, kc, vc, valid, ks, vs, 0.2)
    assert out.dtype == torch.float32
    ref = _reference(query, dequantize_rows(kc, ks), dequantize_rows(vc, vs), valid, 0.2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_the_torch_step_records_itself_and_runs_masked_sdpa():
    """``kernels="torch"`` never loads the dense kernels: masked SDPA over the store, recorded as the torch step."""
    report = KernelReport()
    store = _FakeStore(None, torch.float32)
    g = torch.Generator().manual_seed(2)
    store.keys, store.values = (torch.randn(1, 2, 12, 8, generator=g) for _ in range(2))
    store.valid = torch.ones(1, 2, 12, dtype=torch.bool)
    store.valid[..., 9:] = False
    store.dense_keys = lambda: store.keys
    store.dense_values = lambda: store.values
    query = torch.randn(1, 4, 8, generator=g)
    out = masked_dense_attention("torch", store, query, 0.5, report)
    torch.testing.assert_close(out, _reference(query, store.keys, store.values, store.valid, 0.5))
    assert report.summary() == "torch"


class _FakeStore:
    """The facts :func:`dense_kernel_reason` reads."""

    def __init__(self, kv_dtype, dtype, scaled=False):
        self.kv_dtype = kv_dtype
        self.keys = torch.empty(0, dtype=dtype)
        self.k_scale = self.v_scale = torch.empty(0) if scaled else None
