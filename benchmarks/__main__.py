"""``python -m benchmarks COMMAND ...``: the micro-benchmarks' one command line (see :mod:`benchmarks`).

* ``pool-cpu``: CPU milliseconds of the plugin's batched decode step for ``--requests`` compressed requests over all
  layers of ``--shape`` (:func:`benchmarks.pool.pool_step_cpu_ms`), per method;
* ``pool-gpu``: on a CUDA device, per batch size, the weights' matrix products and a full cache's attention per
  ``--contexts`` length, then the plugin's step per method, eager and replayed as one CUDA graph, with the graphed
  step's roofline at the copy bandwidth measured first (:func:`benchmarks.pool.pool_step_cuda`,
  :func:`benchmarks.pool.pool_roofline`; ``docs/gpu.md``);
* ``kernel-parts``: on a CUDA device, per method, the plugin's step as one CUDA graph with the fused kernels as they
  are and with each part of the second kernel left out: what each part costs per layer
  (:func:`benchmarks.pool.kernel_parts_cuda`; ``docs/gpu.md``);
* ``kernel-tune``: on a CUDA device, per method, the plugin's step as one CUDA graph with the fused kernels' launch
  constants as they are and with each variant of ``--variants`` (:func:`benchmarks.pool.kernel_tune_cuda`;
  ``docs/gpu.md``);
* ``host-step``: the host's milliseconds per layer of an eager decode step of a small random Llama, the fused
  kernels replaced by stand-ins that launch nothing, with each launch free, bound as Triton binds it for a GPU, or
  through slake's launch cache (:mod:`benchmarks.host_step`; ``docs/gpu.md``);
* ``launch-cost``: the host's microseconds of one launch of each fused kernel, bound as Triton binds it for a GPU
  and through slake's launch cache (the kernels' arguments from one step of the host-step model);
* ``host-profile``: on the device of ``--device`` (CUDA by default), per method, the host's and the wall's milliseconds
  of an eager (with ``--compile``, a compiled) decode step of a random model and the functions with the most own
  time (``cProfile``; :mod:`benchmarks.host_profile`; ``docs/gpu.md``);
* ``compile-guards``: per method, the guards a compiled decode step checks and what one check costs, with torch's
  default guards and with slake's filter, beside the compiled step's host and wall milliseconds
  (:mod:`benchmarks.compile_guards`; ``docs/compile.md``);
* ``vllm-steps``: vLLM's engine steps (prefill, decode-only, mixed) for plain vLLM and each method, in one process
  (:func:`slake.engines.vllm.bench.step_bench`; ``docs/serving.md``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any


def _split(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def _methods_and_transformers(text: str) -> list[str]:
    """:func:`_methods`, where ``transformers`` may also be named: transformers' own ``DynamicCache`` (``host-step``,
    ``host-profile``), put first."""
    names = _split(text)
    rest = ",".join(n for n in names if n != "transformers")
    return ["transformers"] * ("transformers" in names) + (_methods(rest) if rest else [])


def _methods(text: str) -> list[str]:
    """A method list whose specs may hold commas (``snapkv,slake[alpha=0.5,beta=0.4]``), each checked."""
    from slake.methods.base import parse_method_list

    return parse_method_list(text)


def parser() -> argparse.ArgumentParser:
    """The command line of every micro-benchmark."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--methods", default="snapkv,slake", help="comma-separated methods or specs")
    common.add_argument("--budget", type=int, default=128, help="tokens per layer and KV head")
    common.add_argument(
        "--kernels",
        choices=["auto", "torch", "triton"],
        default="auto",
        help="the decode step's implementation (auto: the fused Triton kernels on CUDA, torch elsewhere)",
    )
    shape_help = "a shape name of slake.engines.transformers.shapes (with overrides) or a model folder"

    cpu = sub.add_parser("pool-cpu", parents=[common], help="the plugin's decode step, CPU time")
    cpu.add_argument("--shape", default="smollm2-135m", help=shape_help)
    cpu.add_argument("--requests", type=int, default=8)
    cpu.add_argument("--block-size", type=int, default=32)
    cpu.add_argument("--kept", type=int, default=None, help="slots each layer holds (default: all but one)")
    cpu.add_argument("--cold", action="store_true", help="evict the last-level cache before each layer")
    cpu.add_argument("--steps", type=int, default=10, help="steps timed (median reported)")

    gpu = sub.add_parser("pool-gpu", parents=[common], help="the plugin's decode step on a GPU, eager and graphed")
    gpu.add_argument("--shape", default="llama3-8b", help=shape_help)
    gpu.add_argument("--requests", default="8,32", help="comma-separated batch sizes")
    gpu.add_argument("--contexts", default="2048,8192,32768", help="full cache: comma-separated context lengths")
    gpu.add_argument("--block-size", type=int, default=16, help="vLLM's GPU block size")
    gpu.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    gpu.add_argument("--steps", type=int, default=50)
    gpu.add_argument("--device", default="cuda")

    # the fused kernels' benches: the pool's step at one batch, as one CUDA graph
    graphed = argparse.ArgumentParser(add_help=False, parents=[common])
    graphed.add_argument("--shape", default="llama3-8b", help=shape_help)
    graphed.add_argument("--requests", type=int, default=1)
    graphed.add_argument("--block-size", type=int, default=16, help="vLLM's GPU block size")
    graphed.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    graphed.add_argument("--steps", type=int, default=50)
    graphed.add_argument("--device", default="cuda")
    parts = sub.add_parser(
        "kernel-parts", parents=[graphed], help="what each part of the fused step's second kernel costs on a GPU"
    )
    parts.add_argument("--parts", default=None, help="comma-separated parts to leave out (default: every one)")
    tune = sub.add_parser(
        "kernel-tune", parents=[graphed], help="the fused step with other launch constants, timed on a GPU"
    )
    tune.add_argument(
        "--variants",
        default=None,
        help="';'-separated variants of ','-separated NAME=VALUE (names: launch_config.TUNABLE), e.g. "
        "'COMBINE=8;COMBINE=8,RECOMPUTE_BLOCK=64' (default: benchmarks.pool.TUNE_VARIANTS)",
    )

    host = sub.add_parser("host-step", help="the host's share of an eager decode step (kernels left out)")
    host.add_argument(
        "--methods",
        default="transformers,full,snapkv,slake",
        help="comma-separated methods; 'transformers': transformers' own DynamicCache, the reference",
    )
    host.add_argument("--budget", type=int, default=64)
    host.add_argument("--layers", type=int, default=8)
    host.add_argument("--steps", type=int, default=30, help="steps timed per variant (median reported)")
    host.add_argument("--repeats", type=int, default=3, help="rounds over every variant, alternating")
    host.add_argument(
        "--launches", default="none,triton,cached,afresh", help="comma-separated launch variants (benchmarks.host_step)"
    )

    lc = sub.add_parser("launch-cost", help="host microseconds of one fused-kernel launch: Triton's binding, cached")
    lc.add_argument("--methods", default="snapkv,slake", help="comma-separated methods")
    lc.add_argument("--number", type=int, default=2000, help="launches per timing (the best of three is reported)")

    hp = sub.add_parser("host-profile", help="where a decode step's host time goes (cProfile), per method")
    hp.add_argument(
        "--methods",
        default="transformers,full,cake,slake",
        help="comma-separated methods; 'transformers': transformers' own DynamicCache (eager), the reference",
    )
    hp.add_argument("--budget", type=int, default=1024)
    hp.add_argument("--shape", default="llama3-8b", help="a shape name of slake.engines.transformers.shapes")
    hp.add_argument("--length", type=int, default=8192, help="prompt tokens")
    hp.add_argument("--steps", type=int, default=10, help="steps timed, then as many profiled")
    hp.add_argument("--top", type=int, default=25, help="functions reported per method")
    hp.add_argument("--device", default="cuda")
    hp.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    hp.add_argument("--kernels", choices=["auto", "torch", "triton"], default="auto")
    hp.add_argument("--compile", action="store_true", help="the compiled step (slake bench --compile's), not eager")
    hp.add_argument("--backend", default="inductor", help="torch.compile's backend with --compile (eager: CPU checks)")

    cg = sub.add_parser("compile-guards", help="what dynamo's guards cost a compiled decode step, all and lean")
    cg.add_argument("--methods", default="full,slake", help="comma-separated methods")
    cg.add_argument("--budget", type=int, default=64)
    cg.add_argument(
        "--shape",
        default="llama3-8b:hidden_size=256,intermediate_size=512,num_attention_heads=4,num_key_value_heads=2,"
        "vocab_size=1024,num_hidden_layers=8",
        help="a shape name of slake.engines.transformers.shapes, with overrides",
    )
    cg.add_argument("--length", type=int, default=512, help="prompt tokens")
    cg.add_argument("--steps", type=int, default=10, help="compiled steps timed (median reported)")
    cg.add_argument("--checks", type=int, default=1000, help="guard checks timed")
    cg.add_argument("--variants", default="all,lean", help="comma-separated: all (torch's guards), lean (slake's)")
    cg.add_argument("--device", default="cpu")
    cg.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"])
    cg.add_argument("--backend", default="inductor", help="torch.compile's backend (eager: the same guards, CPU only)")

    steps = sub.add_parser("vllm-steps", parents=[common], help="vLLM's engine steps, plain and with the plugin")
    steps.add_argument("model_dir", help="a model folder vLLM loads")
    steps.add_argument("--requests", type=int, default=8)
    steps.add_argument("--prompt-len", type=int, default=2048)
    steps.add_argument("--decode-steps", type=int, default=16)
    steps.add_argument("--mixed", type=int, default=6, help="mixed steps timed (median reported)")
    return ap


def _emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def _random_model_run(a: argparse.Namespace) -> dict:
    """The random model, prompt and steps of a command that decodes one (``host-profile``, ``compile-guards``)."""
    import torch

    return dict(
        shape=a.shape,
        device=a.device,
        dtype=getattr(torch, a.dtype),
        length=a.length,
        budget=a.budget,
        steps=a.steps,
    )


def compile_guards(a: argparse.Namespace) -> None:
    import torch

    from benchmarks.compile_guards import guard_costs
    from slake.engines.base import load_avg

    for row in guard_costs(
        _methods(a.methods),
        **_random_model_run(a),
        checks=a.checks,
        variants=tuple(_split(a.variants)),
        backend=a.backend,
    ):
        meta = {"shape": a.shape, "device": a.device, "backend": a.backend, "torch": torch.__version__}
        _emit({**row, **meta, "load_avg_1m": load_avg()})


def pool_cpu(a: argparse.Namespace) -> None:
    from benchmarks.pool import model_shape, pool_step_cpu_ms
    from slake.engines.base import load_avg

    shape = model_shape(a.shape)
    for m in _methods(a.methods):
        ms = pool_step_cpu_ms(
            m,
            steps=a.steps,
            cold=a.cold,
            requests=a.requests,
            budget=a.budget,
            block_size=a.block_size,
            kept=a.kept,
            kernels=a.kernels,
            **shape.attention(),
        )
        _emit(
            {
                "method": m,
                "budget": a.budget,
                "requests": a.requests,
                "shape": a.shape,
                "kept": a.kept,
                "cold": a.cold,
                "kernels": a.kernels,
                "cpu_ms_per_step": round(ms, 2),
                "us_per_request_layer": round(ms * 1000 / (a.requests * shape.layers), 1),
                "load_avg_1m": load_avg(),
            }
        )


def pool_gpu(a: argparse.Namespace) -> None:
    import torch

    from benchmarks.pool import full_attention_cuda, model_shape, pool_step_cuda, weights_cuda

    if not torch.cuda.is_available():
        raise SystemExit("pool-gpu: CUDA is not available (this benchmark measures a GPU; see docs/gpu.md)")
    from slake.engines.transformers.roofline import copy_bandwidth

    shape = model_shape(a.shape)
    dtype = getattr(torch, a.dtype)
    _emit({"what": "device", "name": torch.cuda.get_device_name(a.device), "torch": torch.__version__})
    bandwidth = copy_bandwidth(a.device)  # the pool rows' roofline: their bytes at what a copy moves
    _emit({"what": "bandwidth", "copy_gbs": round(bandwidth / 1e9, 2)})
    _emit({"what": "shape", "shape": a.shape, **asdict(shape)})
    for r in (int(x) for x in _split(a.requests)):
        _emit(weights_cuda(shape, requests=r, device=a.device, dtype=dtype))
        torch.cuda.empty_cache()
        for c in (int(x) for x in _split(a.contexts)):
            heads: dict[str, Any] = shape.attention()
            _emit(full_attention_cuda(requests=r, context=c, device=a.device, dtype=dtype, **heads))
            torch.cuda.empty_cache()
            if a.kernels == "triton":  # the full cache's static step (the compiled full cache's attention) beside it
                _emit(full_attention_cuda(requests=r, context=c, device=a.device, dtype=dtype, impl="dense", **heads))
                torch.cuda.empty_cache()
        for m in _methods(a.methods):
            _emit(
                pool_step_cuda(
                    m,
                    requests=r,
                    budget=a.budget,
                    steps=a.steps,
                    device=a.device,
                    dtype=dtype,
                    block_size=a.block_size,
                    kernels=a.kernels,
                    bandwidth=bandwidth,
                    **shape.attention(),
                )
            )
            torch.cuda.empty_cache()


def parse_variants(text: str) -> list[dict[str, int]]:
    """``kernel-tune``'s ``--variants``: ``'A=1,B=2;C=3'`` -> ``[{"A": 1, "B": 2}, {"C": 3}]`` (names and values are
    checked when a variant is applied, :func:`slake.kernels.launch_config.tuned`)."""
    variants = []
    for chunk in text.split(";"):
        if not chunk.strip():
            continue
        variant = {}
        for item in chunk.split(","):
            name, eq, value = item.strip().partition("=")
            if not eq or not name or not value.strip().lstrip("-").isdigit():
                raise SystemExit(f"kernel-tune: a variant's item must be NAME=INTEGER, got {item.strip()!r}")
            variant[name.strip()] = int(value)
        variants.append(variant)
    if not variants:
        raise SystemExit("kernel-tune: --variants names no variant")
    return variants


def _graphed_rows(a: argparse.Namespace, command: str, rows) -> None:
    """Emit, per method of ``a``, the rows of ``rows(method, **pool)`` (``kernel-parts``, ``kernel-tune``: the pool's
    step at ``a``'s shape and batch as one CUDA graph), after the device's row; refuses a machine without CUDA."""
    import torch

    from benchmarks.pool import model_shape

    if not torch.cuda.is_available():
        raise SystemExit(f"{command}: CUDA is not available (this benchmark times GPU kernels; see docs/gpu.md)")
    shape = model_shape(a.shape)
    _emit({"what": "device", "name": torch.cuda.get_device_name(a.device), "torch": torch.__version__})
    pool = dict(requests=a.requests, budget=a.budget, steps=a.steps, device=a.device, dtype=getattr(torch, a.dtype))
    for m in _methods(a.methods):
        for row in rows(m, block_size=a.block_size, **pool, **shape.attention()):
            _emit(row)


def kernel_tune(a: argparse.Namespace) -> None:
    from benchmarks.pool import kernel_tune_cuda

    variants = None if a.variants is None else parse_variants(a.variants)
    _graphed_rows(a, "kernel-tune", lambda m, **pool: kernel_tune_cuda(m, variants, **pool))


def kernel_parts(a: argparse.Namespace) -> None:
    from benchmarks.pool import kernel_parts_cuda

    parts = None if a.parts is None else _split(a.parts)
    _graphed_rows(a, "kernel-parts", lambda m, **pool: kernel_parts_cuda(m, parts, **pool))


def host_step(a: argparse.Namespace) -> None:
    from slake.kernels import load

    load()  # before transformers imports Triton: on a machine without CUDA, through Triton's interpreter
    from benchmarks.host_step import host_step_ms
    from slake.engines.base import load_avg

    rows = host_step_ms(
        _methods_and_transformers(a.methods),
        budget=a.budget,
        layers=a.layers,
        steps=a.steps,
        repeats=a.repeats,
        launches=tuple(_split(a.launches)),
    )
    for row in rows:
        _emit({**row, "load_avg_1m": load_avg()})


def launch_cost(a: argparse.Namespace) -> None:
    from slake.kernels import load

    load()  # before transformers imports Triton: on a machine without CUDA, through Triton's interpreter
    from benchmarks.host_step import launch_cost_us
    from slake.engines.base import load_avg

    for row in launch_cost_us(_methods(a.methods), number=a.number):
        _emit({**row, "load_avg_1m": load_avg()})


def host_profile(a: argparse.Namespace) -> None:
    from slake.kernels import load

    load()  # before transformers imports Triton: on a machine without CUDA, through Triton's interpreter
    from benchmarks.host_profile import host_profile as run
    from slake.engines.base import load_avg

    rows = run(
        _methods_and_transformers(a.methods),
        **_random_model_run(a),
        top=a.top,
        kernels=a.kernels,
        compile=a.compile,
        backend=a.backend,
    )
    for row in rows:
        _emit({**row, "length": a.length, "budget": a.budget, "load_avg_1m": load_avg()})


def vllm_steps(a: argparse.Namespace) -> None:
    from slake.engines.vllm.bench import step_bench

    for row in step_bench(
        a.model_dir,
        requests=a.requests,
        prompt_len=a.prompt_len,
        decode_steps=a.decode_steps,
        methods=[m for m in _methods(a.methods) if m != "full"],
        budget=a.budget,
        mixed=a.mixed,
    ):
        _emit(row)


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` and run the command."""
    a = parser().parse_args(argv)
    commands = {
        "pool-cpu": pool_cpu,
        "pool-gpu": pool_gpu,
        "kernel-parts": kernel_parts,
        "kernel-tune": kernel_tune,
        "host-step": host_step,
        "launch-cost": launch_cost,
        "host-profile": host_profile,
        "compile-guards": compile_guards,
        "vllm-steps": vllm_steps,
    }
    commands[a.command](a)


if __name__ == "__main__":
    main(sys.argv[1:])
