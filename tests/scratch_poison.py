"""Every uninitialised tensor slake allocates, filled with bytes no computation should see, in the tests.

On a GPU ``torch.empty`` returns memory the caching allocator hands back from an earlier tensor: a kernel or a torch
step that reads scratch before writing it gets that tensor's bytes, and is right only by chance. On a CPU the same
call often returns zeros (a large allocation is fresh pages from the operating system), which hide such a read:
zero scores, zero sums and zero counts look like answers. :func:`install` wraps ``torch.empty``, ``empty_like``,
``empty_strided`` and ``Tensor.new_empty`` so that, when the caller is one of slake's own modules, the new tensor's
bytes are set to ``0xFF`` before it is returned: NaN in every floating type (float32, bfloat16, float16, fp8 e4m3),
-1 in signed integers (an index out of every tensor, which the interpreter's bounds check stops), 255 in ``uint8``;
booleans get ``True``. The bytes are written with ``memset``, outside torch's dispatcher, so that the tests that
count a step's operations count the same. Only CPU tensors with storage are filled (not meta or fake tensors, not
tensors a compiled graph allocates, and not an ``out=`` argument's)."""

from __future__ import annotations

import ctypes
import sys

import torch

_PACKAGE = "slake"


def _ours(depth: int) -> bool:
    name = sys._getframe(depth).f_globals.get("__name__", "")
    return name == _PACKAGE or name.startswith(_PACKAGE + ".")


def poison(tensor: torch.Tensor) -> torch.Tensor:
    """Fill ``tensor``'s bytes as described above (in place, outside the dispatcher); returns it."""
    if type(tensor) is not torch.Tensor or tensor.device.type != "cpu" or tensor.numel() == 0:
        return tensor
    try:
        address = tensor.data_ptr()
    except RuntimeError:  # no storage (a functional or fake tensor)
        return tensor
    if address == 0:
        return tensor
    extent = (sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride())) + 1) * tensor.element_size()
    ctypes.memset(address, 1 if tensor.dtype == torch.bool else 0xFF, extent)
    return tensor


def install() -> bool:
    """Wrap the allocators (idempotent); True once installed."""
    if getattr(torch.empty, "_slake_poison", False):
        return True
    empty, empty_like, empty_strided, new_empty = (
        torch.empty,
        torch.empty_like,
        torch.empty_strided,
        torch.Tensor.new_empty,
    )

    def wrap(allocate):
        def allocating(*args, **kwargs):
            tensor = allocate(*args, **kwargs)
            if torch.compiler.is_compiling() or "out" in kwargs or not _ours(2):
                return tensor
            return poison(tensor)

        allocating._slake_poison = True  # type: ignore[attr-defined]
        allocating.__name__ = allocate.__name__
        allocating.__doc__ = allocate.__doc__
        return allocating

    torch.empty = wrap(empty)
    torch.empty_like = wrap(empty_like)
    torch.empty_strided = wrap(empty_strided)
    torch.Tensor.new_empty = wrap(new_empty)
    return True
