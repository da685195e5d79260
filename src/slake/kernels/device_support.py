"""What the fused kernels need of the GPU they run on, and how they adapt to it.

The kernels are written once, in Triton, and were timed on Hopper (``sm_90``). Compiled ahead of time for other
targets on a machine without a GPU (``tests/kernel_aot.py``, ``tests/test_kernels_compile.py``), two things differ:

* **fp8 e4m3 storage.** Triton converts to and from ``float8e4nv`` only on NVIDIA GPUs from ``sm_89`` (Ada,
  Hopper, Blackwell); before (an A100's ``sm_80``, a T4's ``sm_75``) its compiler refuses the kernels outright, and
  AMD GPUs have no such conversion of their own. There the kernels read and write the same codes through integer
  arithmetic on their bits (``QUANT`` 3, :func:`slake.kernels.triton_slots.e4m3_bits` / ``e4m3_value``): the same
  codes, bit for bit, and the same values (:func:`quant_code`).
* **Half-precision products.** On a T4 (``sm_75``) and a V100 (``sm_70``) the first kernel's products in float16
  or bfloat16 took all 255 registers and spilled about 1 KB per thread (Turing's and Volta's tensor-core layouts);
  in float32 they take 86-96 registers and spill nothing, and Expected Attention's first kernel fits a T4's 64 KB
  of shared memory. Those GPUs multiply in float32 (:func:`half_precision_products`).
* **The current device.** Triton launches a kernel on the current CUDA device, not on its tensors' (torch's own
  operators set the device from their inputs): a layer that a model split over GPUs keeps on its second one
  (``device_map="auto"``) would be launched on the first with the second's memory. Each step's launches run under
  :func:`launch_device`.
* **A layer on the CPU.** Triton's kernels take CUDA tensors only (except in its interpreter): a step on host tensors
  takes the torch step instead (:func:`slake.kernels.host_layer`).
* **Shared memory.** A kernel's pipelined loop stages its tiles in shared memory, and the most one program may use
  differs: 227 KB on Hopper and Blackwell's ``sm_100``, 163 KB on an A100, 99 KB on Ada and consumer Blackwell, 64
  KB on a T4 and on AMD's MI200 and MI300. A launch that does not fit is launched again unpipelined
  (``num_stages=1``), which Triton's error suggests (:func:`slake.kernels.launch_cache.fitting`).

Plain Python over torch; Triton is not imported here.
"""

from __future__ import annotations

import contextlib
import functools

import torch

__all__ = [
    "FP8_BITS", "HALF_DOT_CAPABILITY", "NATIVE_FP8_CAPABILITY", "half_precision_products", "launch_device",
    "native_fp8", "quant_code",
]  # fmt: skip

#: the first NVIDIA compute capability whose conversions Triton compiles for ``float8e4nv``
NATIVE_FP8_CAPABILITY = (8, 9)

#: the kernels' fp8 conversion: None chooses by the device (:func:`native_fp8`); True forces the bit arithmetic,
#: False the GPU's conversion (tests run both through Triton's interpreter, which has either)
FP8_BITS: bool | None = None

#: the first NVIDIA compute capability whose kernels multiply half-precision keys in half precision
HALF_DOT_CAPABILITY = (8, 0)

#: :mod:`slake.cache.quant`'s storage names -> the kernels' ``QUANT`` (fp8 with the GPU's own conversion)
_QUANT = {None: 0, "int8": 1, "fp8_e4m3": 2}


@functools.lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _nvidia_capability(dev: torch.device) -> tuple[int, int] | None:
    """The compute capability of CUDA device ``dev``, or None on an AMD GPU (a ROCm build of torch)."""
    if torch.version.hip is not None:
        return None
    return _capability(dev.index if dev.index is not None else torch.cuda.current_device())


def native_fp8(device: torch.device | str) -> bool:
    """Whether the kernels convert fp8 e4m3 codes with the GPU's own instructions on ``device``: NVIDIA GPUs of
    compute capability 8.9 and later, and Triton's interpreter (a CPU ``device``); not AMD GPUs (ROCm builds of
    torch, whose ``"cuda"`` devices are AMD's) nor older NVIDIA ones. :data:`FP8_BITS` overrides."""
    if FP8_BITS is not None:
        return not FP8_BITS
    dev = torch.device(device)
    if dev.type != "cuda":
        return True
    capability = _nvidia_capability(dev)
    return capability is not None and capability >= NATIVE_FP8_CAPABILITY


def half_precision_products(device: torch.device | str, keys_dtype: torch.dtype) -> bool:
    """Whether the kernels multiply queries by keys and probabilities by values in the keys' half precision (tensor
    cores, float32 accumulation): on a GPU for float16 and bfloat16 keys, but on NVIDIA GPUs before compute
    capability 8.0, where those products spilled the first kernel's registers (float32 products there). Elsewhere
    (Triton's interpreter), and for float32 or 8-bit keys, the products are float32."""
    dev = torch.device(device)
    if dev.type != "cuda" or keys_dtype not in (torch.float16, torch.bfloat16):
        return False
    capability = _nvidia_capability(dev)
    return capability is None or capability >= HALF_DOT_CAPABILITY


def quant_code(quant: str | None, device: torch.device | str) -> int:
    """The kernels' ``QUANT`` for rows stored as ``quant`` (None: the model's dtype; ``"int8"``, ``"fp8_e4m3"``) on
    ``device``: 0, 1, and for fp8 2 (the GPU's conversion) or 3 (the bit arithmetic, :func:`native_fp8`).

    Raises
    ------
    KeyError
        For a storage the kernels do not read (the fused step checks first and falls back to torch).
    """
    code = _QUANT[quant]
    if code == 2 and not native_fp8(device):
        return 3
    return code


_SAME_DEVICE = contextlib.nullcontext()


def launch_device(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """What to launch the kernels of a step on ``tensor``'s device under: ``torch.cuda.device(tensor.device)`` when
    that is a CUDA device other than the current one, else a context that does nothing (one model on one GPU: the
    common case costs one call to ``torch.cuda.current_device``)."""
    dev = tensor.device
    if dev.type != "cuda" or dev.index is None or dev.index == torch.cuda.current_device():
        return _SAME_DEVICE
    return torch.cuda.device(dev)
