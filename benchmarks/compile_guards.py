"""What dynamo's guards cost a compiled decode step, with every guard and with slake's filter.

Every call of a compiled function checks its guards before it runs the compiled code (or replays the CUDA graph):
this is host time in front of every compiled decode step, and it grows with the model's modules
(:mod:`slake.engines.transformers.compile_options`). Per method and variant (``all``: torch's default guards;
``lean``: :func:`~slake.engines.transformers.compile_options.decode_guard_filter`), this compiles the bench's decode
step (:func:`slake.engines.transformers.measure._step`, ``compile_kwargs``) for a static cache of a random model,
then reports the guards the step checks, the microseconds of one check (the guard manager called alone, median of
``checks`` calls in blocks of 100), and the compiled step's milliseconds, host (until it returns) and wall (device
synchronised), medians of ``steps`` steps. The check reads dynamo's compiled-code cache
(``torch._dynamo.eval_frame._debug_get_cache_entry_list``), a debugging interface of torch: a benchmark may use it,
the library does not.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

__all__ = ["guard_costs"]

VARIANTS = ("all", "lean")


def guard_costs(
    methods: list[str],
    *,
    shape: str,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    length: int = 512,
    budget: int = 64,
    steps: int = 10,
    checks: int = 1000,
    variants: tuple[str, ...] = VARIANTS,
    backend: str = "inductor",
) -> list[dict[str, Any]]:
    """One row per method and variant: ``{"method", "variant", "guards", "guard_check_us", "compile_s", "host_ms",
    "wall_ms"}``.

    Parameters
    ----------
    methods : list[str]
        Method specs (``full`` for the uncompressed cache).
    shape : str
        A random model's shape (:func:`slake.engines.transformers.shapes.random_model`, overrides allowed).
    device, dtype : str, torch.dtype
        Where the model runs, and its weights' dtype.
    length, budget : int
        The prompt's tokens, and the budget per layer and KV head.
    steps, checks : int
        Compiled steps timed, and guard checks timed.
    variants : tuple[str, ...]
        ``"all"`` and/or ``"lean"``.
    backend : str
        ``torch.compile``'s backend. The guards are dynamo's whatever the backend, so ``"eager"`` measures the same
        checks without inductor's compile time (on the CPU only: on CUDA the step's options are inductor's).
    """
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from benchmarks.host_profile import _sync, timed_steps
    from slake.engines.transformers.compile_options import compile_kwargs, guard_filter_supported
    from slake.engines.transformers.generate import prefill
    from slake.engines.transformers.measure import BenchConfig, _new_cache, _prompt, _step, stepper_of
    from slake.engines.transformers.shapes import random_model

    unknown = set(variants) - set(VARIANTS)
    if unknown or steps < 1 or checks < 100:
        raise ValueError(f"variants must be among {VARIANTS}, steps >= 1 and checks >= 100 (got {sorted(unknown)})")
    if backend != "inductor" and torch.device(device).type == "cuda":
        raise ValueError("on CUDA the compiled step is inductor's (CUDA graphs); other backends are for CPU checks")
    if "lean" in variants and not guard_filter_supported():
        raise SystemExit("compile-guards: this torch has no guard filter (torch.compile's guard_filter_fn, 2.7+)")
    model = random_model(shape, device=device, dtype=dtype)
    dev = model.device
    rows = []
    for method in methods:
        for variant in variants:
            torch._dynamo.reset()  # one compiled entry for _step: this variant's
            cfg = BenchConfig(method, budget, length, decode_steps=steps, compile=True)
            cache = _new_cache(model, cfg)
            ids = _prompt(model, cfg)
            kwargs = compile_kwargs(dev, lean_guards=variant == "lean")
            step = stepper_of(torch.compile(_step, backend=backend, **kwargs), model, cache)
            with torch.inference_mode():
                tok = prefill(model, cache, ids, torch.ones_like(ids)).argmax(-1, keepdim=True)
                t0 = time.perf_counter()
                tok = step(tok)
                _sync(dev)
                compile_s = time.perf_counter() - t0
                for _ in range(2):  # CUDA graphs: recorded at the second call, replayed from the third
                    tok = step(tok)
                tok, host, wall = timed_steps(step, tok, steps, dev)
                entries = _debug_get_cache_entry_list(_step.__code__)
                if len(entries) != 1:
                    raise RuntimeError(f"expected one compiled entry for the decode step, found {len(entries)}")
                guards = entries[0].guard_manager
                frame = {"model": model, "cache": cache, "tok": tok}
                if not guards.check(frame):
                    raise RuntimeError("the compiled step's guards fail on the step's own inputs")
                per_block = []
                for _ in range(checks // 100):
                    t0 = time.perf_counter()
                    for _ in range(100):
                        guards.check(frame)
                    per_block.append((time.perf_counter() - t0) * 1e4)  # µs per check
                count = guards.check_verbose(frame).num_guards_executed
            rows.append(
                {
                    "method": method,
                    "variant": variant,
                    "guards": count,
                    "guard_check_us": round(statistics.median(per_block), 1),
                    "compile_s": round(compile_s, 1),
                    "host_ms": round(statistics.median(host), 3),
                    "wall_ms": round(statistics.median(wall), 3),
                }
            )
            del cache, step
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    torch._dynamo.reset()
    return rows
