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


@pytest.mark.parametrize("kind, quant", [("int8", 1), ("fp8_e4m3", 2), ("fp8_e4m3", 3)])
def test_extreme_rows_are_stored_as_the_torch_quantiser_stores_them(kind, quant):
    """A row written by the kernels at decode is the row :func:`slake.cache.quant.quantize_rows` stores, at the
    extremes too: below float32's smallest normal scale (coded on that scale, not decoded to a fraction of itself),
    at float32's largest numbers (a scale whose largest code decodes finite), and a zero row (scale 0)."""
    rows = torch.zeros(4, 16)
    rows[0, :4] = torch.tensor([1e-37, -5e-38, 2e-38, 0.0])
    rows[1, :4] = torch.tensor([torch.finfo(torch.float32).max, -1e38, 1.0, 0.0])
    rows[2, :3] = torch.tensor([1e-36, 3.0e-37, -7e-37])
    rows = rows.to(DEVICE)
    dtype = torch.int8 if kind == "int8" else torch.uint8
    out = torch.empty(rows.shape, dtype=dtype, device=DEVICE)
    scales = torch.empty(rows.shape[0], dtype=torch.float32, device=DEVICE)
    _store[(rows.shape[0],)](rows, out, scales, D=16, QUANT=quant)
    ref_codes, ref_scales = quantize_rows(rows.cpu(), kind)
    assert torch.equal(scales.cpu(), ref_scales.reshape(-1))
    assert torch.equal(out.cpu().view(ref_codes.dtype), ref_codes)
    assert torch.isfinite(ref_scales).all() and scales[3] == 0


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


class _OnDevice:
    def __init__(self, device: str) -> None:
        self.device = torch.device(device)


def test_a_step_on_another_gpu_is_launched_on_that_gpu(monkeypatch):
    """Triton launches on the current CUDA device: a layer on a model's second GPU (``device_map="auto"``) is
    launched under ``torch.cuda.device`` of its own; on the current device, or the CPU, nothing is switched."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert device_support.launch_device(_OnDevice("cpu")) is device_support._SAME_DEVICE
    assert device_support.launch_device(_OnDevice("cuda:0")) is device_support._SAME_DEVICE
    switch = device_support.launch_device(_OnDevice("cuda:1"))
    assert isinstance(switch, torch.cuda.device) and switch.idx == 1


def test_every_launch_of_a_step_runs_under_its_device(monkeypatch):
    """The fused step's launches (held or made afresh) and the dense attention's go under :func:`launch_device` of
    the step's query: every kernel launch happens inside it."""
    import contextlib

    import fused_cases as harness
    import slake.kernels.triton_decode as decode
    from slake.kernels import launch_cache, triton_dense

    inside = []
    launched = []

    @contextlib.contextmanager
    def recording(tensor):
        inside.append(tensor.device)
        yield
        inside.pop()

    real = launch_cache.launch_parts, launch_cache.launch
    monkeypatch.setattr(launch_cache, "launch_parts", lambda *a: (launched.append(list(inside)), real[0](*a)))
    monkeypatch.setattr(launch_cache, "launch", lambda *a: (launched.append(list(inside)), real[1](*a)))
    monkeypatch.setattr(decode, "launch_device", recording)
    monkeypatch.setattr(triton_dense, "launch_device", recording)
    harness._run(harness._method("slake"), "triton", steps=2, layers=1)
    g = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(2))
    empty = torch.empty(0)
    triton_dense.dense_attention(torch.randn(1, 4, 16), keys, values, torch.ones(1, 2, 40, dtype=torch.bool), empty,
                                 empty, 0.25)  # fmt: skip
    assert len(launched) >= 6 and all(devices == [torch.device(DEVICE)] for devices in launched)


def test_half_precision_products_from_the_a100_on(monkeypatch):
    """Half-precision keys are multiplied in half precision on NVIDIA GPUs from compute capability 8.0 and on AMD
    GPUs; in float32 on a T4 or a V100 (whose half-precision products spilled the first kernel's registers), in the
    interpreter, and for float32 keys."""
    monkeypatch.setattr(torch.version, "hip", None)
    for capability, half in (((7, 0), False), ((7, 5), False), ((8, 0), True), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(device_support, "_capability", lambda index, c=capability: c)
        assert device_support.half_precision_products("cuda:0", torch.bfloat16) is half
        assert device_support.half_precision_products("cuda:0", torch.float16) is half
        assert device_support.half_precision_products("cuda:0", torch.float32) is False
    assert device_support.half_precision_products("cpu", torch.bfloat16) is False
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    assert device_support.half_precision_products("cuda:0", torch.bfloat16) is True
