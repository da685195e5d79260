"""Launching the fused kernels without Triton's per-call argument binding, where nothing it decides has changed.

``kernel[grid](*args)`` in Triton 3.6 (``JITFunction.run``) binds every argument by name and specializes each one
(a tensor's dtype and whether its address is a multiple of 16; an integer's width, whether it is 1 and whether it
is a multiple of 16; ``native_specialize_impl``), hashes the result to find the compiled kernel, and only then
hands the arguments to the C launcher. SLAKE's fused step passes its two kernels 77 and 104 arguments (strides,
placeholders, constants) and two launch options, and that binding is the larger part of their host time: on this
project's two-core CPU, with Triton's CUDA binder (which runs without a GPU; ``benchmarks.host_step.TritonBinding``),
56 and 78 µs per launch, before the C launcher reads the 23 and 27 tensors' addresses again (about 10 µs). A cached
launch took 31 and 39 µs (``python -m benchmarks launch-cost``). In eager decoding on a GPU the host is the
bottleneck (``docs/gpu.md``), and a 32-layer model makes 64 such launches per token.

:class:`CachedLaunch` keys a launch on what decides the compiled kernel, in a form that costs a fraction of the
binding: every runtime argument's type and value (an integer's value decides its specialization; a float's
does not, so only its type counts), every tensor's dtype and 16-byte alignment, the constants and launch options,
the current device, and Triton's two run-time knobs that enter its own cache key (``debug`` and the
instrumentation mode). The first launch with a key goes through Triton (which binds, compiles or finds the kernel,
launches it and returns it); later launches with the same key call that compiled kernel's launcher directly, with
the arguments in the order Triton passes them. The key is at least as fine as the specialization of Triton's CUDA
backend (two launches with one key are specialized alike: ``tests/test_launch_cache.py`` holds it against Triton's
own binder; AMD's backend specializes on more, and there launches are not cached, :func:`cached`), so a cached
kernel is never launched with arguments Triton would have compiled differently.
The fused step makes its kernels' constants once per launch plan (:class:`Constants`, launched with
:func:`launch`), so that their part of the key is hashed once, not at every launch. In eager decoding a layer's step
also holds the runs of its runtime arguments that stay the same from step to step (:class:`Fixed`, launched with
:func:`launch_parts`; :mod:`slake.kernels.held_step`): their part of the key is worked out once and stands in
each launch's key as one int, and their CUDA tensors reach the compiled kernel's launcher as their addresses.

A launch through Triton whose compiled kernel needs more shared memory than the GPU has (Triton's
``OutOfResources`` before anything runs) is launched again unpipelined, ``num_stages=1``, and its constants are
launched so from then on (:func:`fitting`): the kernels were sized on Hopper's 227 KB, and an MI300 has 64 KB
(``slake.kernels.device_support``).

Where Triton would do more than bind and launch, the launch goes through Triton: a launch hook set (a profiler's,
``knobs.runtime.launch_enter_hook``), a pre-run hook on the kernel, a global variable the kernel reads changed since
it was compiled (Triton raises then), or the interpreter (``TRITON_INTERPRET=1``, where kernels are not
:class:`~triton.runtime.jit.JITFunction`). :data:`slake.kernels.launch_config.CACHED_LAUNCH` turns the cache off.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from slake.kernels import launch_config

__all__ = [
    "MAX_ENTRIES", "MAX_TOKENS", "CachedLaunch", "Constants", "Fixed", "cached", "fitting", "launch", "launch_key",
    "launch_parts",
]  # fmt: skip

logger = logging.getLogger("slake.kernels")

#: compiled kernels one :class:`CachedLaunch` keeps (the fused step's launches take a handful of keys: one per
#: layer shape and dtype); past it the cache is emptied and refilled, never grown without bound
MAX_ENTRIES = 64

_MISSING = object()
_TENSOR = torch.Tensor


def launch_key(args: Sequence[Any]) -> tuple:
    """What decides how Triton specializes ``args`` (a launch's runtime arguments, in order), as a hashable tuple:
    per tensor its dtype and its address modulo 16 (Triton asks whether it is a multiple of 16); per float its type
    only (Triton does not specialize float arguments); per other value its type and the value itself (an integer's
    specialization - its width, whether it is 1, whether a multiple of 16 - is a function of its value; the type
    keeps ``True`` apart from ``1``). Equal keys mean equal specializations; the converse need not hold (two strides
    of 32 and 48 specialize alike and key apart), which only costs a second pass through Triton."""
    parts: list[Any] = []
    add = parts.append
    for a in args:  # the common classes by identity first: this loop is most of a cached launch's host time
        c = a.__class__
        if c is int or c is bool:
            add(c)
            add(a)
        elif c is float:
            add(c)
        elif c is _TENSOR or isinstance(a, _TENSOR):
            add(a.dtype)
            add(a.data_ptr() & 15)
        else:
            add(c)
            add(a)
    return tuple(parts)


class Constants:
    """A launch's constants and launch options (``num_warps``, ``maxnreg``), made once and passed to many launches
    (:func:`launch`): their part of :class:`CachedLaunch`'s key is hashed once, when it is made, not at every
    launch (a launch of the fused step's second kernel names 37 of them). Treat ``kwargs`` as read-only."""

    __slots__ = ("_hash", "items", "kwargs")

    def __init__(self, kwargs: Mapping[str, Any]) -> None:
        self.kwargs = dict(kwargs)
        self.items = tuple(self.kwargs.items())
        self._hash = hash(self.items)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Constants) and self.items == other.items

    def __repr__(self) -> str:
        return f"Constants({self.kwargs!r})"


def _triton() -> tuple[Any, Any]:
    """``triton.knobs`` and Triton's driver configuration (``triton.runtime.driver.driver``), imported on first use
    (this module loads without Triton)."""
    global _TRITON
    if _TRITON is None:
        from triton import knobs
        from triton.runtime.driver import driver

        _TRITON = (knobs, driver)
    return _TRITON


_TRITON: tuple[Any, Any] | None = None


def _hooked(hook: Any) -> bool:
    """Whether a launch hook of Triton's is set: in Triton 3.6 a ``HookChain``, set when it holds a call."""
    return hook is not None and bool(getattr(hook, "calls", True))


class CachedLaunch:
    """A Triton kernel launched through its compiled kernel once Triton has bound a launch of the same key
    (:func:`launch_key`; the module's docstring says what the key holds and when a launch still goes through
    Triton). ``launcher[grid](*args, **constants)`` launches as ``kernel[grid](*args, **constants)`` would: runtime
    arguments positional, constants and options (``num_warps``, ``maxnreg``) by name.

    ``driver``: where the current device and stream come from (Triton's active driver unless given; tests pass a
    stand-in). ``hits`` and ``misses`` count the launches that skipped Triton's binding and those that went through
    it."""

    def __init__(self, kernel: Any, driver: Any = None) -> None:
        self.kernel = kernel
        self._driver = driver
        self.entries: dict[tuple, tuple[Any, tuple]] = {}
        self.hits = 0
        self.misses = 0
        self._names = list(kernel.arg_names)
        self._defaults = {p.name: p.default for p in kernel.params if p.has_default}

    def __getitem__(self, grid: Sequence[int]) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _through_triton(self, grid: Sequence[int], args: tuple, kwargs: Mapping[str, Any]) -> Any:
        self.misses += 1
        return fitting(self.kernel, grid, args, kwargs)

    def launch(self, grid: Sequence[int], args: tuple, kwargs: Mapping[str, Any] | Constants) -> None:
        """Launch the kernel on ``grid`` (one to three program counts) with runtime ``args`` and named ``kwargs``
        (a dict, or :class:`Constants` made once for many launches)."""
        self._launch(grid, args, (), kwargs)

    def launch_parts(
        self, grid: Sequence[int], parts: Sequence[tuple | Fixed], kwargs: Mapping[str, Any] | Constants
    ) -> None:
        """Launch the kernel with the runtime arguments ``parts`` hold, in order: tuples made for this launch and
        :class:`Fixed` runs made once, whose part of the key is not worked out again and whose CUDA tensors reach
        the compiled kernel's launcher as their addresses."""
        self._launch(grid, None, parts, kwargs)

    def _launch(
        self,
        grid: Sequence[int],
        args: tuple | None,
        parts: Sequence[tuple | Fixed],
        kwargs: Mapping[str, Any] | Constants,
    ) -> None:
        """:meth:`launch` (``args``, ``parts`` empty) or :meth:`launch_parts` (``parts``, ``args`` None)."""
        if isinstance(kwargs, Constants):
            named: Any = kwargs  # hashed when it was made
            kwargs = kwargs.kwargs
        else:
            named = tuple(kwargs.items())
        knobs, drivers = _triton()
        runtime = knobs.runtime
        if _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook) or self.kernel.pre_run_hooks:
            self._through_triton(grid, _joined(parts, True) if args is None else args, kwargs)
            return
        driver = self._driver
        if driver is None:  # Triton's active driver, read at each launch as Triton does (it can be swapped)
            driver = drivers.active
        device = driver.get_current_device()
        key = (
            device,
            runtime.debug,
            getattr(knobs.compilation, "instrumentation_mode", None),  # in Triton's key since 3.6; absent before
            named,
            launch_key(args) if args is not None else _parts_key(parts),
        )
        try:
            entry = self.entries.get(key)
        except TypeError:  # an argument that cannot be hashed (none of slake's): Triton binds it as it can
            self._through_triton(grid, _joined(parts, True) if args is None else args, kwargs)
            return
        if entry is not None:
            for (name, _), (value, where) in self.kernel.used_global_vals.items():
                if where.get(name, _MISSING) != value:  # Triton raises for this: let it
                    entry = None
                    break
        if entry is None:
            real = _joined(parts, True) if args is None else args
            compiled = self._through_triton(grid, real, kwargs)
            if compiled is not None:
                if len(self.entries) >= MAX_ENTRIES:
                    self.entries.clear()
                # the constants in the order of the kernel's signature, after the runtime arguments: Triton passes
                # every parameter to the launcher, which skips the constants
                tail = tuple(kwargs[n] if n in kwargs else self._defaults[n] for n in self._names[len(real) :])
                self.entries[key] = (compiled, tail)
            return
        compiled, tail = entry
        self.hits += 1
        g0 = grid[0]
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = driver.get_current_stream(device)
        fast = _joined(parts, False) if args is None else args
        compiled.run(g0, g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None, *fast, *tail)


#: the most distinct :class:`Fixed` keys :func:`_token` remembers; past it the table is emptied (tokens already
#: handed out stay unique: the counter goes on), never grown without bound
MAX_TOKENS = 4096
_tokens: dict[tuple, int] = {}
_next_token = itertools.count(1)


def _token(key: tuple) -> int:
    """One int per distinct ``key`` (a :class:`Fixed` run's :func:`launch_key`): equal keys get the same int while the
    table holds them, and two different keys never do, so a launch's key can hold the int in the key's place: a few
    bytes to hash and compare at every launch instead of the run's whole key (a hundred-odd values for the fused
    step's second kernel). After the table is emptied an equal key gets a new int, which costs one more pass
    through Triton, never a wrong kernel."""
    token = _tokens.get(key)
    if token is None:
        if len(_tokens) >= MAX_TOKENS:
            _tokens.clear()
        token = _tokens[key] = next(_next_token)
    return token


class Fixed:
    """A run of a launch's runtime arguments made once and passed to many launches (:func:`launch_parts`): the same
    objects every time, tensors included, which must keep their memory (slake never resizes a tensor in place).

    ``key`` is the run's :func:`launch_key`, worked out once, and ``token`` the int that stands for it in
    :class:`CachedLaunch`'s key (:func:`_token`: equal keys, equal tokens). ``fast`` is the
    run as the compiled kernel's launcher gets it: each CUDA tensor as its address (``addresses``: which tensors;
    default those on CUDA). Triton 3.6's C launcher takes an integer for a pointer parameter as the address itself;
    for a tensor it calls ``data_ptr()`` and asks the CUDA driver for the device pointer (``cuPointerGetAttribute``),
    at every launch, for each of the fused step's 20-odd tensors. Launches that go through Triton get ``args``,
    the tensors themselves."""

    __slots__ = ("args", "fast", "key", "token")

    def __init__(self, args: Sequence[Any], *, addresses: bool | None = None) -> None:
        self.args = tuple(args)
        self.key = launch_key(self.args)
        self.token = _token(self.key)

        def fast(a: Any) -> Any:
            if isinstance(a, _TENSOR) and (a.is_cuda if addresses is None else addresses):
                return a.data_ptr()
            return a

        self.fast = tuple(map(fast, self.args))

    def __repr__(self) -> str:
        return f"Fixed({len(self.args)} arguments)"


def _parts_key(parts: Sequence[tuple | Fixed]) -> tuple:
    """The runtime arguments' part of a launch key for ``parts``: per part, a :class:`Fixed` run's token or a tuple's
    :func:`launch_key`. Two launches with one such key have equal :func:`launch_key` over their joined arguments
    (the parts' boundaries are part of it, and an int token is never equal to a tuple), so they specialize alike;
    the same arguments launched as one tuple key apart, which costs one more pass through Triton. Nor can it equal
    a joined key, whose first value is a type or a dtype."""
    key: list[Any] = []
    for p in parts:
        key.append(p.token if isinstance(p, Fixed) else launch_key(p))
    return tuple(key)


def _joined(parts: Sequence[tuple | Fixed], real: bool) -> tuple:
    """The runtime arguments ``parts`` hold, in order: :class:`Fixed` runs as their tensors (``real``) or as the
    compiled kernel's launcher takes them fastest."""
    out: tuple = ()
    for p in parts:
        out += (p.args if real else p.fast) if isinstance(p, Fixed) else p
    return out


#: per kernel (by id), the constants whose launches did not fit the GPU's shared memory pipelined -> the constants
#: they are launched with (``num_stages=1``); a handful at most, one per launch plan that did not fit
_refitted: dict[int, dict[tuple, dict[str, Any]]] = {}


def _short_of_shared_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is Triton's refusal of a compiled kernel that needs more shared memory than the GPU has."""
    from triton.runtime.errors import OutOfResources

    return isinstance(exc, OutOfResources) and exc.name == "shared memory"


def _too_big(kernel: Any, exc: Any) -> RuntimeError:
    name = getattr(kernel, "__name__", repr(kernel))
    return RuntimeError(
        f"slake: the fused kernel {name} needs {exc.required} bytes of shared memory even unpipelined, more than "
        f"this GPU's {exc.limit}; decode with kernels='torch'"
    )


def fitting(kernel: Any, grid: Sequence[int], args: tuple, kwargs: Mapping[str, Any]) -> Any:
    """``kernel[grid](*args, **kwargs)``, returning what Triton's launch returns (the compiled kernel). Where Triton
    refuses the compiled kernel because it needs more shared memory than the GPU has (``OutOfResources``, raised
    before anything runs) and the kernel was pipelined (``num_stages`` other than 1), it is launched again with
    ``num_stages=1``, which stages one tile at a time, and launches with the same constants go so from then on
    (logged once). A kernel that does not fit unpipelined either raises RuntimeError saying so."""
    refitted = _refitted.get(id(kernel))
    if refitted is not None:
        kwargs = refitted.get(tuple(kwargs.items()), kwargs)
    try:
        return kernel[tuple(grid)](*args, **kwargs)
    except Exception as exc:
        if not _short_of_shared_memory(exc):
            raise
        if kwargs.get("num_stages") == 1:
            raise _too_big(kernel, exc) from exc
        unpipelined = {**kwargs, "num_stages": 1}
        try:
            compiled = kernel[tuple(grid)](*args, **unpipelined)
        except Exception as again:
            if not _short_of_shared_memory(again):
                raise
            raise _too_big(kernel, again) from again
        short: Any = exc  # Triton's OutOfResources
        logger.info(
            "slake: the fused kernel %s needs %d bytes of shared memory pipelined, more than this GPU's %d: "
            "launched unpipelined (num_stages=1)", getattr(kernel, "__name__", kernel), short.required, short.limit,
        )  # fmt: skip
        _refitted.setdefault(id(kernel), {})[tuple(kwargs.items())] = unpipelined
        return compiled


_launchers: dict[int, tuple[Any, CachedLaunch]] = {}
#: the kernels :func:`cached` passes through (the interpreter's, stand-ins), by id
_as_is: dict[int, Any] = {}


def cached(kernel: Any) -> Any:
    """``kernel`` to launch as ``cached(kernel)[grid](...)``: its :class:`CachedLaunch` when it is a compiled Triton
    kernel (one per kernel, made on first use) and :data:`~slake.kernels.launch_config.CACHED_LAUNCH` is on;
    ``kernel`` itself otherwise (the interpreter's kernels, and the stand-ins the benchmarks and the ahead-of-time
    compilation put in the kernels' place), and on AMD GPUs (a ROCm build of torch): Triton's AMD backend also
    specializes a tensor on whether its storage is within 2 GB (its buffer loads take 32-bit offsets), which
    :func:`launch_key` does not hold, so a kernel compiled for a small store could be launched on a larger one and
    read zeros past 2 GB. There every launch goes through Triton's binding."""
    if not launch_config.CACHED_LAUNCH or torch.version.hip is not None:
        return kernel
    hit = _launchers.get(id(kernel))
    if hit is not None and hit[0] is kernel:
        return hit[1]
    if _as_is.get(id(kernel)) is kernel:
        return kernel
    from triton.runtime.jit import JITFunction

    if not isinstance(kernel, JITFunction):
        if len(_as_is) >= MAX_ENTRIES:
            _as_is.clear()
        _as_is[id(kernel)] = kernel  # launched as it is, found so at the next launch without the import
        return kernel
    launcher = CachedLaunch(kernel)
    _launchers[id(kernel)] = (kernel, launcher)
    return launcher


def launch(kernel: Any, grid: Sequence[int], args: tuple, constants: Constants) -> None:
    """``kernel[grid](*args, **constants.kwargs)``, through its :class:`CachedLaunch` where :func:`cached` gives one
    (which then hashes ``constants`` no more)."""
    launcher = cached(kernel)
    if isinstance(launcher, CachedLaunch):
        launcher.launch(grid, args, constants)
    else:
        fitting(launcher, grid, args, constants.kwargs)


def launch_parts(kernel: Any, grid: Sequence[int], parts: Sequence[tuple | Fixed], constants: Constants) -> None:
    """:func:`launch` with the runtime arguments in ``parts`` (tuples, and :class:`Fixed` runs made once), through
    :meth:`CachedLaunch.launch_parts` where :func:`cached` gives a launcher (parts that are all tuples are joined and
    launched as :func:`launch` launches, their key made once over the whole)."""
    for p in parts:
        if p.__class__ is Fixed:
            break
    else:
        launch(kernel, grid, _joined(parts, True), constants)
        return
    launcher = cached(kernel)
    if isinstance(launcher, CachedLaunch):
        launcher.launch_parts(grid, parts, constants)
    else:
        fitting(launcher, grid, _joined(parts, True), constants.kwargs)
