"""What the fused kernels adapt to the GPU they run on (:mod:`slake.kernels.device_support`): fp8 e4m3 codes through
integer arithmetic where Triton has no e4m3 conversion (an A100, a T4, AMD GPUs), checked here on every code
through Triton's interpreter and through the whole fused step against the torch step; the choice of conversion per
device; and a launch that does not fit a GPU's shared memory launched again unpipelined."""

from __future__ import annotations

import pytest
import torch

from slake.kernels import device_support

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from slake.cache.quant import quantize_rows  # noqa: E402
from slake.kernels.triton_slots import e4m3_bits, e4m3_value, store_row  # noqa: E402

#: runs the same under any transformers (none is loaded here): ``make test-oldest`` skips it (tests/test_tiers.py)
pytestmark = pytest.mark.transformers_free

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _roundtrip(codes_ptr, values_ptr, back_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < n
    c = tl.load(codes_ptr + i, mask=m, other=0)
    v = e4m3_value(c)
    tl.store(values_ptr + i, v, mask=m)
    tl.store(back_ptr + i, e4m3_bits(v).to(tl.uint8), mask=m)


@triton.jit
def _store(x_ptr, codes_ptr, scales_ptr, D: tl.constexpr, QUANT: tl.constexpr):
    r = tl.program_id(0)
    dd = tl.arange(0, D)
    x = tl.load(x_ptr + r * D + dd)
    store_row(codes_ptr + r * D, scales_ptr + r, x, dd, dd < D, QUANT)


def _finite_codes() -> torch.Tensor:
    """Every float8 e4m3fn code but its two NaNs (0x7F, 0xFF), as uint8."""
    codes = torch.arange(256, dtype=torch.int32)
    return codes[(codes & 0x7F) != 0x7F].to(torch.uint8)


def test_every_e4m3_code_decodes_and_encodes_as_torch_does():
    """``e4m3_value`` gives torch's float8_e4m3fn value of every finite code (subnormals and both zeros included),
    and ``e4m3_bits`` gives each such value its code back, bit for bit."""
    codes = _finite_codes().to(DEVICE)
    values = torch.empty(codes.numel(), dtype=torch.float32, device=DEVICE)
    back = torch.empty_like(codes)
    _roundtrip[(1,)](codes, values, back, codes.numel(), BLOCK=256)
    expected = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(values.view(torch.int32), expected.view(torch.int32))  # the sign of zero too
    assert torch.equal(back, codes)


def test_the_bits_code_rounded_values_as_the_gpus_conversion_does():
    """Codes written through the bits (``store_row`` with ``QUANT`` 3) equal those of the conversion (``QUANT`` 2) and
    of :func:`slake.cache.quant.quantize_rows` for rows that hit every binade, subnormals, ties and the clamp."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 128, generator=g) * torch.logspace(-8, 3, 64)[:, None]
    rows[0, :8] = torch.tensor([448.0, -448.0, 0.0, -0.0, 1e-30, -1e-30, 3.0, -5.0])
    rows[1] = torch.linspace(-448, 448, 128)  # ties across a binade after scaling
    rows = rows.to(DEVICE)
    codes = {}
    for quant in (2, 3):
        out = torch.empty(rows.shape, dtype=torch.uint8, device=DEVICE)
        scales = torch.empty(rows.shape[0], dtype=torch.float32, device=DEVICE)
        _store[(rows.shape[0],)](rows, out, scales, D=128, QUANT=quant)
        codes[quant] = (out.cpu(), scales.cpu())
    ref_codes, ref_scales = quantize_rows(rows.cpu(), "fp8_e4m3")
    assert torch.equal(codes[3][0], codes[2][0])
    assert torch.equal(codes[3][0], ref_codes.view(torch.uint8))
    assert torch.equal(codes[3][1], ref_scales.reshape(-1))


def test_the_conversion_is_chosen_by_the_device(monkeypatch):
    """fp8 takes the GPU's conversion on NVIDIA GPUs from compute capability 8.9 and in the interpreter, the bits on
    an A100 (8.0), a T4 (7.5) and AMD GPUs; int8 and the model's dtype are the same everywhere; FP8_BITS overrides."""
    monkeypatch.setattr(device_support, "FP8_BITS", None)
    assert device_support.quant_code("fp8_e4m3", "cpu") == 2
    assert device_support.quant_code("int8", "cpu") == 1 and device_support.quant_code(None, "cpu") == 0
    for capability, code in (((7, 5), 3), ((8, 0), 3), ((8, 6), 3), ((8, 9), 2), ((9, 0), 2), ((12, 0), 2)):
        monkeypatch.setattr(device_support, "_capability", lambda index, c=capability: c)
        monkeypatch.setattr(torch.version, "hip", None)
        assert device_support.quant_code("fp8_e4m3", "cuda:0") == code, capability
        assert device_support.quant_code("int8", "cuda:0") == 1
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert device_support.quant_code("fp8_e4m3", "cuda:0") == 3
    monkeypatch.setattr(device_support, "FP8_BITS", False)
    assert device_support.quant_code("fp8_e4m3", "cuda:0") == 2
    monkeypatch.setattr(device_support, "FP8_BITS", True)
    assert device_support.quant_code("fp8_e4m3", "cpu") == 3
    with pytest.raises(KeyError):
        device_support.quant_code("int4", "cpu")
