"""Where the host's time goes in an eager decode step, function by function (``cProfile``), per method.

On the H200 (``docs/gpu.md``, 2026-11-27) eager decoding of a random Llama-3-8B was bound by its host: the kernels of
a compressed step were busy 7-9 ms of a 38-73 ms step, and CAKE's step took 61-70 ms where SLAKE's, with the same
kernels and launches, took 36-56. ``host-step`` (:mod:`benchmarks.host_step`) leaves the launches out, so it cannot
say what Triton's launcher or a device wait costs there; this runs the real step on the real device. Per method: a
fresh cache prefilled with a random prompt, ``warmup`` untimed steps, then ``steps`` steps each timed twice over:
the host's time until the step returns (the kernels queued, not finished) and the wall time once the device is
synchronised; then the same steps again under ``cProfile``, which reports the functions with the most own time per
step (the profiler slows Python down, so its milliseconds are shares, not timings).

With ``compile=True`` the step is the compiled one of ``slake bench --compile`` (one CUDA graph per step on CUDA):
what the host does around a replay (dynamo's guards, the CUDA-graph tree's bookkeeping, the token's copy), which
on the H200 was 1.3-1.4 ms of compiled SLAKE's 9.1-9.5 ms step at 128K.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time
from typing import Any

import torch

__all__ = ["host_profile", "timed_steps"]


def _where(func: tuple[str, int, str]) -> str:
    """``file:line(function)`` with the file's path cut to its last two parts."""
    path, line, name = func
    short = "/".join(path.replace("\\", "/").split("/")[-2:])
    return f"{short}:{line}({name})" if line else name


#: the packages whose own time :func:`host_profile` adds up (``by_package``), matched in a function's file path
PACKAGES = ("slake", "transformers", "triton", "torch")


def _package(path: str) -> str:
    """The first of :data:`PACKAGES` named in ``path``'s folders, ``"builtins"`` for C functions, else ``"other"``."""
    parts = path.replace("\\", "/").split("/")
    for name in PACKAGES:
        if name in parts[:-1]:
            return name
    return "builtins" if path == "~" else "other"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(step, tok: torch.Tensor, steps: int, device: torch.device) -> tuple[torch.Tensor, list, list]:
    """``steps`` calls of ``step`` (``tok -> next tok``), each timed twice over in milliseconds: the host's time until
    it returns, and the wall's once the device is synchronised; returns the last token and the two lists."""
    host, wall = [], []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        tok = step(tok)
        t1 = time.perf_counter()
        _sync(device)
        host.append((t1 - t0) * 1e3)
        wall.append((time.perf_counter() - t0) * 1e3)
    return tok, host, wall


def host_profile(
    methods: list[str],
    *,
    shape: str = "llama3-8b",
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    length: int = 8192,
    budget: int = 1024,
    steps: int = 10,
    warmup: int = 3,
    top: int = 25,
    kernels: str = "auto",
    compile: bool = False,
    backend: str = "inductor",
) -> list[dict[str, Any]]:
    """One row per method: its host and wall milliseconds per decode step and its ``top`` functions by own time.

    Parameters
    ----------
    methods : list[str]
        Method specs (``full`` for the uncompressed cache), or ``transformers``: transformers' own ``DynamicCache``
        (eager only), the step a user has without slake, beside slake's full cache.
    shape : str
        A random model's shape (:func:`slake.engines.transformers.shapes.random_model`).
    device, dtype : str, torch.dtype
        Where the model runs, and its weights' dtype.
    length, budget : int
        The prompt's tokens, and the budget per layer and KV head.
    steps, warmup : int
        Decode steps timed (and then profiled), and untimed steps before them.
    top : int
        Functions reported per method.
    kernels : str
        The cache's decode step (``SlakeCache``'s ``kernels``).
    compile : bool
        Profile the compiled step (:func:`slake.engines.transformers.measure.compiled_step`, on a static cache)
        instead of the eager one; its compilation happens in the warm-up steps (at least two).
    backend : str
        ``torch.compile``'s backend with ``compile``: inductor's (what ``slake bench --compile`` runs) or another,
        for checks on a CPU (``"eager"``: dynamo's guards and graph without code generation).

    Returns
    -------
    list[dict]
        ``{"method", "compile", "kernels", "host_ms", "wall_ms", "profiled_ms", "by_package", "functions": [{"function",
        "calls", "own_ms", "cumulative_ms"}, ...]}``: medians over the steps, per-step figures for the functions;
        ``by_package`` adds up the profiled own time per step of every function by the package its file is in
        (:data:`PACKAGES`; ``builtins`` for C functions, which include torch's operators called from Python).
    """
    from slake.engines.transformers.compile_options import compile_kwargs
    from slake.engines.transformers.generate import prefill
    from slake.engines.transformers.measure import BenchConfig, _new_cache, _prompt, _step, compiled_step, stepper_of
    from slake.engines.transformers.shapes import random_model

    if steps < 1 or warmup < 0 or top < 1:
        raise ValueError("steps and top must be >= 1, warmup >= 0")
    if compile and backend != "inductor" and torch.device(device).type == "cuda":
        raise ValueError("on CUDA the compiled step is inductor's (CUDA graphs); other backends are for CPU checks")
    if compile and "transformers" in methods:
        raise ValueError("'transformers' (transformers' DynamicCache) is profiled eager only")
    from transformers import DynamicCache

    model = random_model(shape, device=device, dtype=dtype)
    dev = model.device
    if compile:
        warmup = max(warmup, 2)  # the first call compiles, the second replays (CUDA graphs record at the first)
    rows = []
    for method in methods:
        # timed and profiled steps: a static cache holds every step it will take
        plain = method == "transformers"
        cfg = BenchConfig("full" if plain else method, budget, length, decode_steps=2 * steps, warmup=warmup,
                          kernels=kernels, compile=compile)  # fmt: skip
        cache: Any = DynamicCache(config=model.config) if plain else _new_cache(model, cfg)
        ids = _prompt(model, cfg)
        if not compile:
            step = lambda t, cache=cache: _step(model, cache, t)  # noqa: E731
        elif backend == "inductor":
            step = compiled_step(model, cache)
        else:
            torch._dynamo.reset()
            step = stepper_of(torch.compile(_step, backend=backend, **compile_kwargs(dev)), model, cache)
        with torch.inference_mode():
            if plain:
                tok = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            else:
                tok = prefill(model, cache, ids, torch.ones_like(ids)).argmax(-1, keepdim=True)
            for _ in range(warmup):
                tok = step(tok)
            tok, host, wall = timed_steps(step, tok, steps, dev)
            prof = cProfile.Profile()
            profiled = []
            for _ in range(steps):
                t0 = time.perf_counter()
                prof.enable()
                tok = step(tok)
                prof.disable()
                _sync(dev)
                profiled.append((time.perf_counter() - t0) * 1e3)
        stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
        ranked = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
        by_package: dict[str, float] = {}
        for (path, _, _), (_, _, own, _, _) in stats.items():
            name = _package(path)
            by_package[name] = by_package.get(name, 0.0) + own * 1e3 / steps
        functions = [
            {
                "function": _where(func),
                "calls": round(calls / steps, 1),
                "own_ms": round(own * 1e3 / steps, 3),
                "cumulative_ms": round(cum * 1e3 / steps, 3),
            }
            for func, (_, calls, own, cum, _) in ranked
        ]
        rows.append(
            {
                "method": method,
                "compile": compile,
                "kernels": "transformers' DynamicCache" if plain else cache.statistics()["kernels"],
                "host_ms": round(statistics.median(host), 3),
                "wall_ms": round(statistics.median(wall), 3),
                "profiled_ms": round(statistics.median(profiled), 3),
                "by_package": {k: round(v, 3) for k, v in sorted(by_package.items(), key=lambda kv: -kv[1])},
                "functions": functions,
            }
        )
        del cache
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows
