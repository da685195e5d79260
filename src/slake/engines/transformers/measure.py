"""Latency and memory of compressed-cache generation, one configuration at a time.

A configuration is (method, budget, context length, batch). For each one :func:`measure` builds a fresh
:class:`~slake.engines.transformers.cache.SlakeCache`, prefills a prompt of random token ids (latency does not depend
on content) with
:func:`slake.engines.transformers.generate.prefill` (exact or chunked), then decodes greedily: ``warmup`` steps that
are not timed,
then ``decode_steps`` timed steps (each synchronised on CUDA). Reported: prefill time, time to first token (prefill +
picking the first token), decode milliseconds per token (median, min, max over the timed steps; on CUDA also the
mean of ``decode_steps`` more steps issued back to back, :func:`time_pipelined`), peak memory
(:class:`~slake.engines.transformers.memory.MemoryMeter`) and the cache's bytes after the timed steps (kept entries,
padding, slack, metadata, linear state, a hybrid model's sliding-window layers), both read before any profiled step
(``profile_steps``).

Decode timings taken one configuration after another drift with the machine (on a shared 2-core CPU, medians of the
same configuration differ by a few percent from minute to minute), which is enough to flip comparisons between
methods. :func:`time_decode_interleaved` therefore re-opens the configurations of one context length together and
times their decode steps in turn (A, B, B, A, ...), so that every configuration sees the same machine; ``slake bench``
reports those medians by default on CPU (``--decode-timing``).
"""

from __future__ import annotations

import statistics
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from slake.cache.chunked import first_chunk_end
from slake.engines.transformers.baselines import TRANSFORMERS
from slake.engines.transformers.bounded_layers import held_bytes
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from slake.engines.transformers.compile_options import compile_kwargs, make_room_for_graphs
from slake.engines.transformers.generate import prefill, refuse_uncompilable
from slake.engines.transformers.layer_layout import text_config
from slake.engines.transformers.memory import MemoryMeter
from slake.engines.transformers.step_profile import profile_decode

__all__ = [
    "BenchConfig",
    "compiled_step",
    "measure",
    "pipelined_steps",
    "stepper_of",
    "time_decode_interleaved",
    "time_pipelined",
]


@dataclass
class BenchConfig:
    """One benchmark configuration."""

    method: str
    budget: int | float
    length: int
    batch: int = 1
    decode_steps: int = 32
    warmup: int = 3
    prefill_chunk: int | None = None
    seed: int = 0
    kv_dtype: str | None = None
    compile: bool = False  # decode steps through torch.compile(fullgraph=True) on a static SlakeCache
    kernels: str = "auto"  # the decode step's implementation (SlakeCache's kernels)
    profile_steps: int = 0  # decode steps profiled after the timed ones (step_profile.profile_decode)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompt(model, cfg: BenchConfig) -> torch.Tensor:
    """The configuration's random prompt ``(batch, length)`` (same ids for every method of a seed)."""
    vocab = text_config(model.config).vocab_size
    g = torch.Generator().manual_seed(cfg.seed)
    return torch.randint(min(3, vocab - 1), vocab, (cfg.batch, cfg.length), generator=g).to(model.device)


def pipelined_steps(model, cfg: BenchConfig) -> int:
    """Decode steps :func:`measure` times back to back after the synchronised ones: ``decode_steps`` on CUDA, where
    the host can run ahead of the device; none elsewhere (a CPU step is synchronous: the number would repeat the
    median's)."""
    return cfg.decode_steps if model.device.type == "cuda" else 0


def time_pipelined(stepper, tok: torch.Tensor, steps: int, device: torch.device) -> tuple[float, float, torch.Tensor]:
    """Milliseconds per token of ``steps`` decode steps issued back to back, each step's token fed to the next on
    the device, with one synchronisation at the end: the host prepares step ``t + 1`` while the device runs step
    ``t``, as a generation loop that does not read each token back (a server's, or one that checks for the end of
    its sequences every few tokens) runs. Where the host's work per step is less than the device's, this is the
    device's time per step; the synchronised median adds the host's on top. Returns ``(ms per token, the host's ms
    per token until the last step was issued, last token)``: where the two are close the host bounds the loop,
    where the first is larger the device does."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    _sync(device)
    s = time.perf_counter()
    for _ in range(steps):
        tok = stepper(tok)
    issued = time.perf_counter()
    _sync(device)
    return (time.perf_counter() - s) * 1e3 / steps, (issued - s) * 1e3 / steps, tok


def _launch_mode() -> str:
    from slake.kernels import launch_mode

    return launch_mode()


def _new_cache(model, cfg: BenchConfig) -> Any:
    """The configuration's empty cache: a :class:`SlakeCache`, or transformers' ``DynamicCache`` for
    :data:`TRANSFORMERS`."""
    if cfg.method == TRANSFORMERS:
        from transformers import DynamicCache

        return DynamicCache(config=model.config)
    # a compiled configuration preallocates its append-only layers for every step it will take
    steps = max(cfg.warmup, 2) + cfg.decode_steps + pipelined_steps(model, cfg) + cfg.profile_steps
    max_len = cfg.length + steps + 2 if cfg.compile else None
    cache = SlakeCache(
        cfg.method,
        cfg.budget,
        config=model.config,
        prefill_chunk=cfg.prefill_chunk,
        kv_dtype=cfg.kv_dtype,
        profile_model=model,
        max_cache_len=max_len,
        kernels=cfg.kernels,
    )
    # an eager append-only layer holds room for the steps run before the cache's statistics are read, not 256 (the
    # profiled ones, after them, grow it again)
    cache.compressor.expect_decode_steps(max(cfg.warmup + cfg.decode_steps + pipelined_steps(model, cfg), 1))
    if cache.method.second_pass is not None:  # random prompts: the pass's cost depends on lengths only
        from slake.engines.transformers.reconstruction import ReconstructionPrompt

        cache.reconstruction = ReconstructionPrompt.synthetic(int(text_config(model.config).vocab_size))
    return cache


def _prefill(model, cache: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The prompt into ``cache``; the last position's ``(batch, vocab)`` logits. A :class:`SlakeCache` through
    :func:`~slake.engines.transformers.generate.prefill`; transformers' own cache through the model's forward, as
    ``generate`` prefills it (the prompts are unpadded)."""
    if isinstance(cache, SlakeCache):
        with torch.inference_mode():  # as the decode steps: every tensor of the cache an inference tensor
            return prefill(model, cache, ids, mask)
    with torch.inference_mode():
        out = model(ids, attention_mask=mask, **with_cache(model, cache), use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].float()


def _statistics(cache: Any) -> dict:
    """What :func:`measure` reports of a cache: :meth:`SlakeCache.statistics`, or for transformers' own cache its
    keys' and values' bytes (``kv_bytes`` ``{"kept": ...}``: it holds every token) and tokens per layer, counted as
    a SlakeCache counts them: the full-attention layers in ``kept`` and ``kept_tokens_per_layer``, a hybrid model's
    sliding-window layers in ``sliding`` (a full cache's row and this one then compare part by part)."""
    if isinstance(cache, SlakeCache):
        return cache.statistics()
    layers = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None and layer.keys.numel()]
    full = [layer for layer in layers if not getattr(layer, "is_sliding", False)]
    sliding = [layer for layer in layers if getattr(layer, "is_sliding", False)]
    # the storage each layer holds, as a SlakeCache counts it: a sliding layer's view keeps the prompt's whole tensor
    kv_bytes = {"kept": held_bytes([t for layer in full for t in (layer.keys, layer.values)])}
    if sliding:
        kv_bytes["sliding"] = held_bytes([t for layer in sliding for t in (layer.keys, layer.values)])
    return {
        "kernels": "sdpa",
        "compressed": False,
        "kv_bytes": kv_bytes,
        "kept_tokens_per_layer": [int(layer.keys.shape[-2]) for layer in full],
    }


def _step(model, cache: SlakeCache, tok: torch.Tensor) -> torch.Tensor:
    """One greedy decode step; returns the next tokens ``(batch, 1)``."""
    out = model(tok, **with_cache(model, cache), use_cache=True)
    return out.logits[:, -1].argmax(-1, keepdim=True)


#: per model, its compiled step (one per model: the guards on the model's modules are filtered out,
#: :mod:`slake.engines.transformers.compile_options`, so a graph must never serve another model); every cache of that
#: model shares it (a cache of the same configuration reuses a graph, another one recompiles)
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compile_step(model):
    """The compiled :func:`_step` for ``model`` (a fresh ``torch.compile``: its graphs serve this model only)."""
    return torch.compile(_step, **compile_kwargs(model.device))


def compiled_step(model, cache: SlakeCache):
    """``tok -> next tok`` for one cache, as one graph (``torch.compile(fullgraph=True, dynamic=False)``; CUDA graphs
    on CUDA; the guard filter of :func:`~slake.engines.transformers.compile_options.compile_kwargs`). The cache must
    be static (built with ``max_cache_len``, prefilled). Compilation happens at the first call; every later call of
    the same cache runs the same graph, and a cache of the same model and configuration reuses it
    (``docs/compile.md``)."""
    refuse_uncompilable(model)  # torch.compile crashes on an offloaded model or one of some quantizations
    # one graph per benchmark configuration: the limit guards a function whose shapes should not change, not this
    make_room_for_graphs()
    fn = _COMPILED.get(model)
    if fn is None:
        fn = _COMPILED[model] = _compile_step(model)
    return stepper_of(fn, model, cache)


def stepper_of(fn, model, cache: SlakeCache):
    """``tok -> next tok`` through ``fn``, a compiled :func:`_step`; on CUDA each call marks a new CUDA-graph step
    and takes the token out of the graph's memory."""
    if model.device.type != "cuda":
        return lambda tok: fn(model, cache, tok)

    def graph_step(tok: torch.Tensor) -> torch.Tensor:
        # CUDA graphs (inductor's cudagraph trees) overwrite a replay's outputs at the next replay, and the token
        # is fed back as the next step's input: mark the step and take the token out of the graph's memory
        torch.compiler.cudagraph_mark_step_begin()
        return fn(model, cache, tok).clone()

    return graph_step


def _stepper(model, cfg: BenchConfig, cache: SlakeCache):
    if cfg.compile:
        return compiled_step(model, cache)
    return lambda tok: _step(model, cache, tok)


def time_decode_interleaved(model, cfgs: list[BenchConfig], steps: int, warmup: int) -> list[list[float]]:
    """Decode milliseconds per step of several configurations, measured in turn on one machine state.

    Every configuration is prefilled (untimed) and decoded for ``warmup`` untimed steps; then ``steps`` rounds
    time one step of each configuration, in forward order on even rounds and reverse order on odd ones (so no
    configuration always follows the same one). All caches are alive together during the timing, so this needs
    the memory of all of them at once; the peak memory of each configuration is measured by :func:`measure`, alone.

    Returns
    -------
    list[list[float]]
        Per configuration (in the order given), its ``steps`` step times in milliseconds.
    """
    device = model.device
    states: list[list[Any]] = []  # [step function, last token, cache] per configuration
    with torch.inference_mode():
        for cfg in cfgs:
            cache = _new_cache(model, cfg)
            ids = _prompt(model, cfg)
            tok = _prefill(model, cache, ids, torch.ones_like(ids)).argmax(-1, keepdim=True)
            step = _stepper(model, cfg, cache)
            for _ in range(max(warmup, 2 if cfg.compile else 0)):  # compiled: the first call compiles
                tok = step(tok)
            states.append([step, tok, cache])
        times: list[list[float]] = [[] for _ in cfgs]
        order = list(range(len(cfgs)))
        for r in range(steps):
            for i in order if r % 2 == 0 else order[::-1]:
                step, tok = states[i][0], states[i][1]
                _sync(device)
                s = time.perf_counter()
                tok = step(tok)
                _sync(device)
                times[i].append((time.perf_counter() - s) * 1e3)
                states[i][1] = tok
    del states
    return times


def measure(model, cfg: BenchConfig) -> dict:
    """Run one configuration on ``model`` and return its result row (a JSON-ready dict)."""
    device = model.device
    ids = _prompt(model, cfg)
    mask = torch.ones_like(ids)
    meter = MemoryMeter(device)
    meter.reset()
    cache = _new_cache(model, cfg)
    _sync(device)
    t0 = time.perf_counter()
    logits = _prefill(model, cache, ids, mask)
    _sync(device)
    t1 = time.perf_counter()
    with torch.inference_mode():  # an inference tensor like every later token (a compiled step guards on it)
        tok = logits.argmax(-1, keepdim=True)
    tok.cpu()
    t2 = time.perf_counter()
    times = []
    compile_s = None
    stepper = _stepper(model, cfg, cache)
    warmup = max(cfg.warmup, 2) if cfg.compile else cfg.warmup
    with torch.inference_mode():
        for step in range(warmup + cfg.decode_steps):
            s = time.perf_counter()
            tok = stepper(tok)
            _sync(device)
            if step == 0 and cfg.compile:
                compile_s = time.perf_counter() - s  # tracing, compiling and running the first step
            if step >= warmup:
                times.append((time.perf_counter() - s) * 1e3)
        pipelined = pipelined_host = None
        if pipelined_steps(model, cfg):
            pipelined, pipelined_host, tok = time_pipelined(stepper, tok, pipelined_steps(model, cfg), device)
        # the peak and the cache as the timed steps left them: the profiled steps below (more tokens in a growing
        # cache, the profiler's own buffers) would change both
        peak = meter.peak()
        stats = _statistics(cache)
        step_profile = None
        if cfg.profile_steps:  # after the timed steps, so that the profiler's overhead is in none of them
            step_profile, tok = profile_decode(stepper, tok, cfg.profile_steps, device)
    kv = stats["kv_bytes"]
    second_pass_s = getattr(cache, "second_pass_s", None)
    # which implementation ran the decode steps, as the cache's report says it (a compiled cache's plan, worked out
    # for each layer before the steps were captured; "sdpa" for the uncompressed eager step; "none": no step ran)
    ran = stats["kernels"]
    # where a chunked prefill's first chunk ended (a layer-preference method's reaches past the budget)
    first_chunk = None
    if cfg.prefill_chunk is not None and cfg.prefill_chunk < ids.shape[1]:
        first_chunk = first_chunk_end(cache.method, cache.compressor.budget, mask == 0, cfg.prefill_chunk)
    del cache, logits
    return {
        "method": cfg.method,
        "budget": cfg.budget,
        "length": cfg.length,
        "batch": cfg.batch,
        "kv_dtype": cfg.kv_dtype,
        "compile": cfg.compile,
        "seed": cfg.seed,  # of the random prompt (and, from the command line, of the random weights)
        "warmup": cfg.warmup,  # untimed decode steps asked for (a compiled configuration takes at least 2)
        "profile_steps": cfg.profile_steps,
        "kernels_asked": cfg.kernels,
        "kernels": ran,
        # how the fused kernels were launched (slake.kernels.launch_mode); None where none ran
        "triton_launch": _launch_mode() if "triton" in str(ran).split(" (")[0].split("+") else None,
        "compile_s": compile_s,
        "prefill_chunk": cfg.prefill_chunk,
        "prefill_first_chunk": first_chunk,
        "prefill_s": t1 - t0,
        "second_pass_s": second_pass_s,  # KVzip's reconstruction pass (inside prefill_s); None for others
        "ttft_s": t2 - t0,
        "decode_ms_per_token": statistics.median(times) if times else 0.0,
        "decode_ms_min": min(times) if times else 0.0,
        "decode_ms_max": max(times) if times else 0.0,
        "decode_steps": len(times),
        "decode_timing": "sequential",
        "decode_ms_pipelined": pipelined,  # steps back to back, one synchronisation (CUDA only; None elsewhere)
        "decode_ms_pipelined_host": pipelined_host,  # of which the host's, until the last step was issued
        "peak_mem_bytes": int(peak),
        "peak_mem_baseline_bytes": int(meter.baseline),
        "peak_mem_kind": meter.kind,
        "peak_mem_reset": meter.reset_ok,
        "kv_bytes": int(sum(kv.values())),
        "kv_bytes_detail": {k: int(v) for k, v in kv.items()},
        "compressed": stats["compressed"],
        "kept_tokens_mean": (sum(stats["kept_tokens_per_layer"]) / max(len(stats["kept_tokens_per_layer"]), 1)),
        "step_profile": step_profile,
    }
