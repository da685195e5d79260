"""A layer's fused decode step in eager decoding, with everything but the step's query, key, value and output made
once (``docs/gpu.md``).

On a GPU an eager decode step at batch 1 costs what its host spends. :func:`slake.kernels.triton_decode.fused_step`
makes, at every call, the step's scratch buffers (five to nine ``torch.empty``), the kernels' 70-odd runtime
arguments (strides read off every tensor), and each launch's key over all of them
(:func:`~slake.kernels.launch_cache.launch_key`, most of a cached launch's host time); and Triton's C launcher asks
the CUDA driver for the device pointer of each of the 20-odd tensors at every launch. In eager decoding a layer's
slots and storage stay the same objects from step to step (``Decoder.step`` checks it by identity), so
:class:`HeldStep` makes all of that once per layer:

* the runs of arguments that do not depend on the step's query, key, value and output, as
  :class:`~slake.kernels.launch_cache.Fixed` runs (their part of the key worked out once, CUDA tensors passed to the
  launcher as their addresses);
* the scratch, carved out of a :class:`ScratchArena` that the layers of one cache share: they run one after the
  other on one stream, and a step writes its scratch before it reads it (:class:`slake.kernels.step_plan.Scratch`),
  so one layer's scratch at a time is what the allocator held before, now without allocating it.

What stays per step: the launch plan's lookup (the launch configuration can change between steps), the output
tensor (returned to the model, so never reused), the four varying arguments' part of the key, and the launches.
Under ``torch.compile`` the step is the custom operator (``fused_step_op``), not this.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from slake.kernels import launch_cache, step_plan
from slake.kernels import triton_decode as decode

__all__ = ["Afresh", "HeldStep", "ScratchArena"]

#: where each of :func:`~slake.kernels.triton_decode.fused_step`'s parameters after the query, key and value is in
#: the arguments a :class:`HeldStep` holds
_AT = {name: i for i, name in enumerate(list(inspect.signature(decode.fused_step).parameters)[3:])}
_WIDTH, _OUT_PROJ, _RATIO, _FLAGS, _OUT_DTYPE = (_AT[n] for n in ("width", "out_proj", "ratio", "flags", "out_dtype"))
# step_plan.launch_runs takes the parameters up to the two stages' epsilon, the width as an int
assert list(_AT)[_WIDTH + 1 : _RATIO] == ["scaling", "window", "sinks", "pinned", "epsilon", "two_stage_epsilon"]

#: each buffer carved from the arena starts on a multiple of this many float32 elements (128 bytes): Triton
#: specializes a pointer on 16-byte alignment, and wider starts keep the kernels' vector loads aligned
_ALIGN = 32


class ScratchArena:
    """One float32 buffer per device out of which the fused step's scratch is carved (:meth:`carve`), shared by the
    layers of one cache: as large as the largest layer's scratch. It grows (to at least twice its size) when a layer
    needs more; ``generation`` counts the growths, and the scratch carved before one is carved again
    (:class:`HeldStep` checks it at every step), so the old buffer is freed once every layer has moved on."""

    def __init__(self) -> None:
        self._flat: dict[torch.device, torch.Tensor] = {}
        self.generation = 0

    def carve(self, specs: tuple[tuple[tuple[int, ...], torch.dtype] | None, ...], device: torch.device) -> tuple:
        """Views of the arena, one per spec (``(shape, dtype)``, a 4-byte dtype; None stays None), that do not
        overlap; valid until the arena grows (``generation`` changes)."""
        sizes: list[tuple[int, int, tuple[int, ...], torch.dtype] | None] = []
        total = 0
        for spec in specs:
            if spec is None:
                sizes.append(None)
                continue
            shape, dtype = spec
            if torch.empty((), dtype=dtype).element_size() != 4:
                raise ValueError(f"slake: the scratch arena holds 4-byte elements, not {dtype}")
            n = 1
            for s in shape:
                n *= int(s)
            sizes.append((total, n, shape, dtype))
            total += -(-max(n, 1) // _ALIGN) * _ALIGN
        flat = self._flat.get(device)
        if flat is None or flat.numel() < total:
            grown = max(total, 2 * flat.numel()) if flat is not None else total
            flat = torch.empty(grown, dtype=torch.float32, device=device)
            self._flat[device] = flat
            self.generation += 1
        out: list[torch.Tensor | None] = []
        for size in sizes:
            if size is None:
                out.append(None)
                continue
            start, n, shape, dtype = size
            view = flat[start : start + n]
            out.append((view if dtype == torch.float32 else view.view(dtype)).view(shape))
        return tuple(out)

    def nbytes(self) -> int:
        """The bytes the arena holds, over every device."""
        return sum(t.numel() * t.element_size() for t in self._flat.values())


class HeldStep:
    """A layer's fused step for the arguments :func:`slake.cache.fused_step.fused_arguments` made (what
    :func:`~slake.kernels.triton_decode.fused_step` takes after the query, key and value), called as
    ``held(query, key, value)`` and computing what ``fused_step(query, key, value, *arguments)`` does.

    The caller keeps it only while every object the arguments were made from is the same (``Decoder.step``): the
    launch runs hold those tensors and, on CUDA, their addresses. Its runs are made again when the launch plan
    changes (another batch or launch configuration) or the arena has grown."""

    __slots__ = ("_made", "_plan_facts", "arena", "arguments")

    def __init__(self, arguments: tuple, arena: ScratchArena) -> None:
        self.arguments = arguments
        self.arena = arena
        self._made: tuple | None = None
        flags = tuple(arguments[_FLAGS])
        # what the launch plan takes besides the step's shape: the width, the flags, W_o's rows, the ratio
        self._plan_facts = (
            int(arguments[_WIDTH]),
            flags,
            arguments[_OUT_PROJ].shape[0] if flags[16] else 0,
            arguments[_RATIO],
        )

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The step: ``(R, Hq, d)`` in the arguments' output dtype."""
        R, Hq, d = query.shape
        H = key.shape[1]
        p = step_plan.launch_plan(R, Hq, d, H, *self._plan_facts)
        made = self._made
        if made is None or made[0] is not p or made[1] != self.arena.generation:
            made = self._make(p, R, Hq, H, d, query.device)
        out = torch.empty(R, Hq, d, dtype=self.arguments[_OUT_DTYPE], device=query.device)
        decode.launch_step(p, query, key, value, out, *made[2])
        return out

    def _make(self, p: Any, R: int, Hq: int, H: int, d: int, device: torch.device) -> tuple:
        """The plan's launch runs, with scratch carved from the arena, kept as ``(plan, generation, runs)``."""
        a = self.arguments
        W = int(a[_WIDTH])
        scratch = step_plan.Scratch.of(self.arena.carve(step_plan.scratch_specs(p, R, Hq, H, W, d), device))
        runs = step_plan.launch_runs(p, scratch, H, (*a[:_WIDTH], W, *a[_WIDTH + 1 : _RATIO]))
        made = (p, self.arena.generation, tuple(launch_cache.Fixed(run) for run in runs))
        self._made = made
        return made


class Afresh:
    """A layer's fused step that makes its scratch, launch arguments and keys at every call
    (:func:`~slake.kernels.triton_decode.fused_step`), for the same arguments as :class:`HeldStep`: what eager
    decoding runs with :data:`~slake.kernels.launch_config.HELD_STEP` off."""

    __slots__ = ("arguments",)

    def __init__(self, arguments: tuple) -> None:
        self.arguments = arguments

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The step: ``(R, Hq, d)`` in the arguments' output dtype."""
        return decode.fused_step(query, key, value, *self.arguments)
