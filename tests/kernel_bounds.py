"""A bounds check of every memory access the fused kernels make in Triton's interpreter.

On a GPU a load or store outside the tensor it was meant for either stops the process ("an illegal memory access")
or, more often, silently reads another buffer's bytes or overwrites them: the caching allocator packs tensors next
to each other. Triton's interpreter (3.6.0) reads and writes host memory through raw addresses and checks nothing,
so a kernel whose mask lets one element past its row passes its equality tests here whenever the bytes it reads
happen to be masked out later, or whenever what it overwrites is not compared.

:func:`install` wraps the interpreter's memory operations (its builder's masked load and store, atomic add and
compare-and-swap; an unmasked load or store, a block pointer's and a tensor descriptor's are masked ones with their
lanes worked out) and its launches. A launch records
the span of bytes of each tensor argument (from its first element to one past its last, by its sizes and strides),
and every access of that launch must fall, with all of its active lanes, inside the span of one argument, at an
address aligned to its element's size. An access that does not stops the launch before it touches memory, with the
kernel's name, the operation, the addresses against the nearest argument and the lanes outside it.

What it cannot see: an access that lands inside another argument's span (one operation's lanes are checked against
the one argument holding its lowest address, so lanes that start in one tensor and run into the next one are
caught, but a wrong base pointer that lands wholly in another argument is not), and reads of memory no one wrote
(a ``torch.empty`` read before it is written). It applies only to launches whose tensors are all on the CPU, i.e.
in the interpreter, which is where the tests run the kernels."""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Span:
    """The bytes ``[start, end)`` of one tensor argument of a launch."""

    name: str
    start: int
    end: int
    itemsize: int


class OutOfBounds(RuntimeError):
    """A kernel's load or store left every tensor argument of its launch, or was misaligned."""


_state = threading.local()


def tensor_span(name: str, tensor) -> Span:
    """The bytes of ``tensor``'s elements, from its first to one past its last (non-negative strides)."""
    start = int(tensor.data_ptr())
    itemsize = tensor.element_size()
    if tensor.numel() == 0:
        return Span(name, start, start, itemsize)
    if any(s < 0 for s in tensor.stride()):
        raise ValueError(f"argument {name!r} has a negative stride; the bounds check does not handle it")
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
    return Span(name, start, start + (last + 1) * itemsize, itemsize)


def launch_spans(names, values) -> list[Span] | None:
    """The spans of a launch's tensor arguments (tuples of tensors included), or None when one is not on the CPU."""
    spans: list[Span] = []

    def add(name, value) -> bool:
        if isinstance(value, tuple):
            return all(add(f"{name}[{i}]", v) for i, v in enumerate(value))
        base = getattr(value, "base", None)  # a tensor descriptor: its loads and stores address its base tensor
        if not hasattr(value, "data_ptr") and hasattr(base, "data_ptr"):
            value = base
        if not hasattr(value, "data_ptr") or not hasattr(value, "stride"):
            return True
        if value.device.type != "cpu":
            return False
        spans.append(tensor_span(name, value))
        return True

    for name, value in zip(names, values):
        if not add(name, value):
            return None
    return spans


def _distance(address: int, span: Span) -> int:
    """Bytes from ``span`` to ``address`` (0 inside it)."""
    if span.start <= address < span.end:
        return 0
    return min(abs(address - span.start), abs(address - span.end))


def _describe(addrs: np.ndarray, lo: int, hi: int, spans: list[Span]) -> str:
    if not spans:
        return "the launch has no tensor argument"
    nearest = min(spans, key=lambda s: _distance(lo, s))
    outside = addrs[(addrs < nearest.start) | (addrs >= nearest.end)]
    return (
        f"bytes {lo - nearest.start}..{hi - nearest.start} relative to argument {nearest.name!r} "
        f"({nearest.end - nearest.start} bytes, elements of {nearest.itemsize}); "
        f"{outside.size} of {addrs.size} active lanes outside it, first at byte "
        f"{int(outside.min()) - nearest.start if outside.size else 0}"
    )


def check_access(op: str, ptrs: np.ndarray, mask: np.ndarray | None, itemsize: int) -> None:
    """Raise :class:`OutOfBounds` when an access of the current launch leaves its arguments' spans."""
    launch = getattr(_state, "launch", None)
    if launch is None:
        return
    kernel, spans = launch
    addrs = np.asarray(ptrs, dtype=np.uint64)
    if mask is not None:
        addrs = addrs[np.broadcast_to(np.asarray(mask, dtype=bool), addrs.shape)]
    else:
        addrs = addrs.reshape(-1)
    if addrs.size == 0:
        return
    addrs = addrs.astype(np.int64)
    lo = int(addrs.min())
    hi = int(addrs.max()) + itemsize
    for span in spans:
        if span.start <= lo and hi <= span.end:
            if itemsize > 1 and ((addrs - span.start) % itemsize).any():
                raise OutOfBounds(f"{kernel}: {op} of {itemsize}-byte elements misaligned in argument {span.name!r}")
            return
    raise OutOfBounds(f"{kernel}: {op} of {itemsize}-byte elements out of bounds: {_describe(addrs, lo, hi, spans)}")


def _itemsize(handle) -> int:
    return max(1, handle.get_element_ty().primitive_bitwidth // 8)


def install() -> bool:
    """Wrap Triton's interpreter (3.6.0) so that every launch's accesses are checked; True when installed.

    Idempotent. Does nothing (False) when the interpreter is not importable or not the version it was read from."""
    try:
        import triton
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if triton.__version__ != "3.6.0" or builder is None or executor is None:
        return False
    if getattr(executor, "_slake_bounds", False):
        return True

    masked_load = builder.create_masked_load
    masked_store = builder.create_masked_store
    atomic_rmw = builder.create_atomic_rmw
    atomic_cas = builder.create_atomic_cas
    call = executor.__call__

    def checked_load(self, ptrs, mask, other, *rest, **named):
        check_access("load", ptrs.data, mask.data, _itemsize(ptrs))
        return masked_load(self, ptrs, mask, other, *rest, **named)

    def checked_store(self, ptrs, value, mask, *rest, **named):
        check_access("store", ptrs.data, mask.data, _itemsize(ptrs))
        return masked_store(self, ptrs, value, mask, *rest, **named)

    def checked_rmw(self, rmw_op, ptr, val, mask, *rest, **named):
        check_access("atomic", ptr.data, mask.data, _itemsize(ptr))
        return atomic_rmw(self, rmw_op, ptr, val, mask, *rest, **named)

    def checked_cas(self, ptr, cmp, val, *rest, **named):
        check_access("atomic_cas", ptr.data, None, _itemsize(ptr))
        return atomic_cas(self, ptr, cmp, val, *rest, **named)

    def checked_call(self, *args, **kwargs):
        named = inspect.getfullargspec(self.fn).args  # as GridExecutor.__call__ drops Triton's launch options
        bound = inspect.getcallargs(self.fn, *args, **{k: v for k, v in kwargs.items() if k in named})
        spans = launch_spans(list(bound), list(bound.values()))
        outer = getattr(_state, "launch", None)
        _state.launch = None if spans is None else (getattr(self.fn, "__name__", "kernel"), spans)
        try:
            return call(self, *args, **kwargs)
        finally:
            _state.launch = outer

    builder.create_masked_load = checked_load
    builder.create_masked_store = checked_store
    builder.create_atomic_rmw = checked_rmw
    builder.create_atomic_cas = checked_cas
    executor.__call__ = checked_call
    executor._slake_bounds = True
    return True
