"""8-bit storage of the kept keys and values (``kv_dtype``, :mod:`slake.cache.quant`)."""

from __future__ import annotations

import pytest
import torch

from slake.cache.compressed import CompressedKV
from slake.cache.quant import dequantize_rows, parse_kv_dtype, quantize_rows
from slake.cli import main
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from slake.methods import make_method
from tiny_models import prefill_for_generate, random_ids, tiny_model

GEN = torch.Generator().manual_seed(11)


def test_parse_kv_dtype():
    assert parse_kv_dtype(None) is None and parse_kv_dtype("auto") is None and parse_kv_dtype("none") is None
    assert parse_kv_dtype("INT8") == "int8" and parse_kv_dtype("fp8") == "fp8_e4m3"
    with pytest.raises(ValueError, match="unknown kv_dtype"):
        parse_kv_dtype("int4")


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_bounds(src_dtype):
    x = (torch.randn(4, 3, 50, 64, generator=GEN) * torch.logspace(-3, 3, 50).view(1, 1, 50, 1)).to(src_dtype)
    x[0, 0, 0] = 0.0  # a zero row: scale 0, decodes to zeros
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    codes, scale = quantize_rows(x, "int8")
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (4, 3, 50, 1)
    err = (dequantize_rows(codes, scale) - xf).abs()
    assert bool((err <= amax / 254 * (1 + 1e-5) + 1e-30).all())  # half a quantisation step
    codes, scale = quantize_rows(x, "fp8_e4m3")
    assert codes.element_size() == 1
    deq = dequantize_rows(codes, scale)
    err = (deq - xf).abs()
    # 3 mantissa bits: relative error <= 2^-4 for normal codes, absolute <= 2^-10 * scale for subnormal ones
    assert bool((err <= torch.maximum(xf.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-5) + 1e-30).all())
    assert torch.equal(deq[0, 0, 0], torch.zeros(64)) and bool(torch.isfinite(deq).all())


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_extreme_rows_decode_within_their_bound_and_finite(kind):
    big = torch.finfo(torch.float32).max
    x = torch.tensor(
        [
            [1e-37, -5e-38, 2e-38, 0.0],  # below qmax * float32's smallest normal number (~1.5e-36 for int8)
            [1e-40, -3e-41, 0.0, 0.0],  # subnormal
            [big, -1e38, 1.0, 0.0],  # float32's largest: qmax * (max / qmax) rounds up to inf
            [0.0, 0.0, 0.0, 0.0],
        ]
    )
    codes, scale = quantize_rows(x, kind)
    deq = dequantize_rows(codes, scale)
    assert bool(torch.isfinite(deq).all()) and bool((scale[:3] > 0).all()) and float(scale[3]) == 0.0
    err = (deq - x).abs()
    if kind == "int8":
        assert bool((err <= scale / 2).all())  # the stored scale is the one the codes were computed with
    else:
        assert bool((err <= torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-5)).all())
    assert float(deq[0, 0]) == pytest.approx(1e-37, rel=0.07)  # was 7.1e-39: codes on one scale, another stored
    # +-inf saturates to the largest code (a finite row); a NaN row stays NaN, never silently zeros
    codes, scale = quantize_rows(torch.tensor([[float("inf"), 1.0], [float("nan"), 1.0]]), kind)
    deq = dequantize_rows(codes, scale)
    assert float(deq[0, 0]) == pytest.approx(big, rel=1e-6) and bool(deq[1].isnan().all())


def _engine(kv_dtype, method="slake", d=64, seed=0, steps=12):
    g = torch.Generator().manual_seed(seed)
    L, B, HQ, HKV, S = 2, 2, 6, 2, 160
    eng = CompressedKV(make_method(method), 64, L, kv_dtype=kv_dtype)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, :9] = True
    for layer in range(L):
        q = torch.randn(B, HQ, S, d, generator=g)
        k = torch.randn(B, HKV, S, d, generator=g) + 0.5
        v = torch.randn(B, HKV, S, d, generator=g)
        eng.prefill_layer(layer, q, k, v, pad, d**-0.5)
    outs = []
    for _ in range(steps):
        for layer in range(L):
            eng.append(layer, torch.randn(B, HKV, 1, d, generator=g) + 0.5, torch.randn(B, HKV, 1, d, generator=g))
            outs.append(eng.decode_attention(layer, torch.randn(B, HQ, 1, d, generator=g), d**-0.5))
    return eng, torch.stack(outs)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_bytes_accounting_counts_codes_and_scales(kv_dtype):
    eng, _ = _engine(kv_dtype, steps=3)
    ref, _ = _engine(None, steps=3)
    kept = sum(int(s.valid.sum()) for s in eng.layers)
    d = 64
    assert eng.byte_counts()["kept"] == kept * 2 * (d + 4)  # d one-byte codes + one fp32 scale, for K and for V
    assert ref.byte_counts()["kept"] == kept * 2 * d * 4  # the same kept tokens at fp32
    bf16_equivalent = kept * 2 * d * 2
    assert eng.byte_counts()["kept"] <= 0.55 * bf16_equivalent
    for s in eng.layers:
        assert s.keys.element_size() == 1 and s.values.element_size() == 1
        assert s.k_scale.shape == s.keys.shape[:3] + (1,) and s.linear.aug.dtype == torch.float32


@pytest.mark.parametrize("kv_dtype, tol", [("int8", 0.02), ("fp8_e4m3", 0.08)])
@pytest.mark.parametrize("method", ["slake", "snapkv"])
def test_decode_with_8bit_close_to_unquantised(kv_dtype, tol, method):
    eng, out = _engine(kv_dtype, method)
    _, ref = _engine(None, method)
    assert bool(torch.isfinite(out).all())
    rel = (out - ref).flatten(2).norm(dim=-1) / ref.flatten(2).norm(dim=-1)
    assert float(rel.mean()) < tol
    # the linear state summarises the dequantised evicted rows and stays float32
    if method == "slake":
        assert all(s.linear.aug.dtype == torch.float32 and float(s.linear.count.min()) > 0 for s in eng.layers)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_every_method_generates_with_8bit(kv_dtype):
    from slake.methods import available_methods

    model = tiny_model("llama-gqa", layers=2)
    ids = random_ids(120)
    for name in available_methods():
        cache = SlakeCache(name, 48, model.config.num_hidden_layers, kv_dtype=kv_dtype)
        prefill_for_generate(model, cache, ids)  # KVzip's second pass, as slake.generate runs it
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), **with_cache(model, cache), max_new_tokens=4, do_sample=False
            )
        stats = cache.statistics()
        assert out.shape[1] == ids.shape[1] + 4 and stats["kv_dtype"] == kv_dtype, name
        assert all(layer.keys.element_size() == 1 for layer in cache.compressor.layers), name
    # beam search reorders / repeats batch rows: codes and scales move together
    cache = SlakeCache("slake", 48, model.config.num_hidden_layers, kv_dtype=kv_dtype)
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        **with_cache(model, cache),
        max_new_tokens=3,
        num_beams=2,
        do_sample=False,
    )
    for s in cache.compressor.layers:
        assert s.k_scale.shape[:3] == s.keys.shape[:3] and s.v_scale.shape[:3] == s.values.shape[:3]


def test_cli_rejects_unknown_kv_dtype(capsys):
    assert main(["generate", "--prompt", "hello", "--kv-dtype", "int4"]) == 2
    assert "unknown kv_dtype" in capsys.readouterr().err


def test_charged_linear_state_counts_8bit_slots():
    from slake.cache.compressed import linear_state_slots

    # (64 + 1)^2 fp32 numbers = 16,900 bytes = 124.3 8-bit K+V slots of 2 * (64 + 4) bytes (33.01 fp32, 66.02 bf16)
    assert linear_state_slots(64, 4) == 34 and linear_state_slots(64, 2) == 67
    assert linear_state_slots(64, (64 + 4) / 64) == 125
