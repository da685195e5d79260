"""The host's share of an eager decode step: what Python and torch's dispatch cost per layer, the kernels left out.

On a GPU an eager decode step is bound by its host work when the kernels are short (``docs/gpu.md``): the device
waits for the next launch. This measures that host work on any machine: a small random Llama (transformers, in
process, no download) decodes with ``SlakeCache(kernels="triton")`` while the fused Triton kernels are replaced by
stand-ins that launch nothing, so what is timed is everything around them (the model's own operations, the cache's
Python, the fused step's argument preparation) and, per ``launch`` variant, what a launch costs the host before
Triton's C launcher would take over:

* ``"none"``: nothing (the launch is free);
* ``"triton"``: what Triton 3.6's ``kernel[grid](...)`` does on the host before its C launcher, for the CUDA backend
  of an sm_90 GPU (which runs without one): bind and specialize every argument, look the compiled kernel up by the
  result's key, check the kernel's globals (:class:`TritonBinding`);
* ``"cached"``: what :class:`slake.kernels.launch_cache.CachedLaunch` does instead once a launch's key is known (its
  key, then the compiled kernel's launcher, a stand-in that does nothing here), with each layer's step held
  (:class:`slake.kernels.held_step.HeldStep`: its launch arguments, their part of the key and its scratch made once);
* ``"afresh"``: cached launches with :data:`slake.kernels.launch_config.HELD_STEP` off (every step makes its scratch,
  arguments and whole key again).

Neither counts the C launcher itself (the same in both: it reads the tensors' addresses and calls the driver) or the
device. The full cache runs plain SDPA. One torch thread. Variants alternate within each repetition, so a drift of
the machine's speed affects both sides of a pair alike.
"""

from __future__ import annotations

import inspect
import statistics
import time
from typing import Any

import torch

__all__ = ["LAUNCHES", "TritonBinding", "host_step_ms", "launch_cost_us"]

#: the launch variants :func:`host_step_ms` times, in order
LAUNCHES = ("none", "triton", "cached", "afresh")


class _NoLaunch:
    """A Triton kernel whose launches do nothing (``kernel[grid](...)``)."""

    def __getitem__(self, grid: Any):
        return lambda *args, **kwargs: None


def _params(kernel: Any) -> list:
    """Triton's parameter records of a kernel (compiled or interpreted), from its Python signature."""
    from triton.runtime.jit import KernelParam

    sig = inspect.signature(kernel.fn)
    return [KernelParam(i, p, False, False) for i, p in enumerate(sig.parameters.values())]


class TritonBinding:
    """A kernel whose launches do on the host what Triton 3.6's ``JITFunction.run`` does before its C launcher, for
    the CUDA backend of an sm_90 GPU: the run-time knobs, the argument binding and specialization (the binder
    Triton generates for the kernel), the cache key and its lookup, the check of the kernel's globals, the grid and
    the launch metadata. ``binds`` counts the launches."""

    def __init__(self, kernel: Any) -> None:
        from triton.backends import backends
        from triton.backends.compiler import GPUTarget
        from triton.runtime.jit import create_function_from_signature

        backend = backends["nvidia"].compiler(GPUTarget("cuda", 90, 32))
        self.binder = create_function_from_signature(inspect.signature(kernel.fn), _params(kernel), backend)
        self.key_cache: dict = {}
        self.kernels: dict = {}
        self.launched: tuple = ()
        self.binds = 0

    def __getitem__(self, grid: Any):
        from triton import knobs
        from triton.runtime.jit import compute_cache_key

        def run(*args: Any, **kwargs: Any) -> None:
            kwargs["debug"] = kwargs.get("debug", False) or knobs.runtime.debug
            kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
            bound, specialization, options = self.binder(*args, **kwargs)
            key = compute_cache_key(self.key_cache, specialization, options)
            kernel = self.kernels.get(key)
            if kernel is None:  # Triton compiles here, once per key; the key stands for the compiled kernel
                kernel = self.kernels[key] = key
            grid_xyz = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
            # the launch metadata Triton builds for its (empty) launch hooks, and the arguments it unpacks
            metadata = {"name": "kernel", "function": kernel, "stream": 0, "grid": grid_xyz}
            self.launched = (metadata, *bound.values())
            self.binds += 1

        return run


class _CompiledStandIn:
    """A compiled kernel whose launcher does nothing."""

    function = packed_metadata = None

    def run(self, *args: Any) -> None:
        return None


class _KernelStandIn:
    """What :class:`~slake.kernels.launch_cache.CachedLaunch` reads of a kernel (its parameters, hooks and
    globals), whose first launch per key hands back a :class:`_CompiledStandIn`."""

    def __init__(self, kernel: Any) -> None:
        self.params = _params(kernel)
        self.arg_names = [p.name for p in self.params]
        self.pre_run_hooks: list = []
        self.used_global_vals: dict = {}

    def __getitem__(self, grid: Any):
        return lambda *args, **kwargs: _CompiledStandIn()


class _Driver:
    """The current device and stream, as Triton's active driver gives them on a GPU."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0


def _stand_ins(launch: str, kernels: tuple) -> tuple:
    from slake.kernels.launch_cache import CachedLaunch

    if launch == "none":
        return tuple(_NoLaunch() for _ in kernels)
    if launch == "triton":
        return tuple(TritonBinding(k) for k in kernels)
    return tuple(CachedLaunch(_KernelStandIn(k), driver=_Driver()) for k in kernels)  # "cached", "afresh"


def _model(layers: int, hidden: int, heads: int, kv_heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    kw: dict[str, Any] = dict(
        vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=8192,
        attn_implementation="sdpa",
    )  # fmt: skip
    cfg = LlamaConfig(**kw)
    import slake

    model = LlamaForCausalLM(cfg).eval()
    slake.prepare_model(model)
    return model


def host_step_ms(
    methods: list[str],
    *,
    budget: int = 64,
    prompt: int = 300,
    layers: int = 8,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    steps: int = 30,
    repeats: int = 3,
    launches: tuple[str, ...] = LAUNCHES,
) -> list[dict]:
    """Median host milliseconds per layer and decode step, per method and launch variant (:data:`LAUNCHES`),
    ``repeats`` times each.

    ``methods`` may name ``"transformers"``: transformers' own ``DynamicCache`` on the same model (slake's
    attention function passes it through to SDPA), the host work a user's decode has without slake.

    Returns one row per (repeat, method, launch): ``{"method", "launch", "repeat", "ms_per_layer_step"}``
    (``launch`` is ``"sdpa"`` for the full cache and transformers' own)."""
    from slake.engines.transformers.cache import SlakeCache
    from slake.kernels import launch_config, triton_decode
    from slake.methods import make_method

    held = launch_config.HELD_STEP
    unknown = set(launches) - set(LAUNCHES)
    if unknown:
        raise ValueError(f"unknown launch variants {sorted(unknown)}; known: {list(LAUNCHES)}")
    from transformers import DynamicCache

    torch.set_num_threads(1)  # the host's work is one thread's; more only adds contention on a shared machine
    names = ("_append_logits_kernel", "_value_projection_kernel", "_evict_attend_kernel")
    kernels = tuple(getattr(triton_decode, n) for n in names)
    model = _model(layers, hidden, heads, kv_heads)
    ids = torch.randint(0, 512, (1, prompt))
    plain = {"full", "transformers"}
    variants: list[tuple[str, str]] = [(m, "sdpa") for m in ("transformers", "full") if m in methods]
    variants += [(m, launch) for m in methods if m not in plain for launch in launches]
    rows = []
    try:
        for rep in range(repeats):
            for name, launch in variants:
                for n, k in zip(names, _stand_ins("none" if launch == "sdpa" else launch, kernels), strict=True):
                    setattr(triton_decode, n, k)
                launch_config.HELD_STEP = launch != "afresh"
                cache: Any
                if name == "transformers":  # transformers' own cache: the reference a user compares with
                    cache = DynamicCache(config=model.config)
                else:
                    kind = "auto" if name == "full" else "triton"
                    cache = SlakeCache(make_method(name), budget, model.config, kernels=kind)
                with torch.no_grad():
                    tok = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                    for _ in range(3):  # warm-up (and the cached launches' first pass through Triton)
                        model(tok, past_key_values=cache, use_cache=True)
                    times = []
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        model(tok, past_key_values=cache, use_cache=True)
                        times.append(time.perf_counter() - t0)
                ms = statistics.median(times) * 1e3 / layers
                rows.append({"method": name, "launch": launch, "repeat": rep, "ms_per_layer_step": round(ms, 4)})
    finally:
        for n, k in zip(names, kernels, strict=True):
            setattr(triton_decode, n, k)
        launch_config.HELD_STEP = held
    return rows


class _Recorder:
    """A kernel whose launches are recorded, not run: ``launched`` holds ``(kernel, grid, args, kwargs)``."""

    def __init__(self, kernel: Any, launched: list) -> None:
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, grid: Any):
        return lambda *args, **kwargs: self.launched.append((self.kernel, grid, args, kwargs))


def launch_cost_us(methods: list[str], *, budget: int = 64, number: int = 2000, repeats: int = 3) -> list[dict]:
    """Host microseconds of one launch of each fused kernel, per method: bound as Triton binds it for a GPU
    (:class:`TritonBinding`), through :class:`~slake.kernels.launch_cache.CachedLaunch` once its key is known (with
    the constants made once, :class:`~slake.kernels.launch_cache.Constants`, as the fused step launches), and
    the cache's key alone (:func:`~slake.kernels.launch_cache.launch_key`), each the best of ``repeats`` means over
    ``number`` launches. The arguments are those of the first layer's launches in one decode step of the host-step
    model (their number and kinds do not depend on the model's size). Neither counts the C launcher.

    Returns one row per (method, kernel): ``{"method", "kernel", "runtime_args", "named_args", "tensors",
    "triton_us", "cached_us", "key_us"}``."""
    import timeit

    from slake.engines.transformers.cache import SlakeCache
    from slake.kernels import triton_decode
    from slake.kernels.launch_cache import CachedLaunch, Constants, launch, launch_key
    from slake.methods import make_method

    names = ("_append_logits_kernel", "_value_projection_kernel", "_evict_attend_kernel")
    kernels = tuple(getattr(triton_decode, n) for n in names)
    model = _model(2, 64, 4, 2)
    ids = torch.randint(0, 512, (1, 300))
    rows = []

    def best(fn, args: tuple, kwargs: dict) -> float:
        """The best of ``repeats`` means over ``number`` calls of ``fn(*args, **kwargs)``, in microseconds (a
        fresh copy of ``kwargs`` per call, as a call site makes it)."""
        return min(timeit.repeat(lambda: fn(*args, **kwargs), number=number, repeat=repeats)) / number * 1e6

    for method in methods:
        launched: list = []
        try:
            for n, k in zip(names, kernels, strict=True):
                setattr(triton_decode, n, _Recorder(k, launched))
            cache = SlakeCache(make_method(method), budget, model.config, kernels="triton")
            with torch.no_grad():
                tok = model(ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                launched.clear()
                model(tok, past_key_values=cache, use_cache=True)
        finally:
            for n, k in zip(names, kernels, strict=True):
                setattr(triton_decode, n, k)
        seen = set()
        for kernel, grid, args, kwargs in launched:
            if id(kernel) in seen:  # the first layer's launches
                continue
            seen.add(id(kernel))
            binding = TritonBinding(kernel)
            cached = CachedLaunch(_KernelStandIn(kernel), driver=_Driver())
            constants = Constants(kwargs)  # made once per launch plan, as the fused step does
            launch(cached, grid, args, constants)  # the first launch of the key goes through (a stand-in of) Triton
            rows.append(
                {
                    "method": method,
                    "kernel": kernel.fn.__name__,
                    "runtime_args": len(args),
                    "named_args": len(kwargs),
                    "tensors": sum(isinstance(a, torch.Tensor) for a in args),
                    "triton_us": round(best(binding[grid], args, dict(kwargs)), 2),
                    "cached_us": round(best(launch, (cached, grid, args, constants), {}), 2),
                    "key_us": round(best(launch_key, (args,), {}), 2),
                }
            )
    return rows
