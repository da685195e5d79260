"""What a warm-cache build compiles (:mod:`benchmarks.warm_cache`): the decode steps a GPU session runs, each
launched once on CPU tensors while :func:`benchmarks.warm_cache.compile_for_sm90` turns every launch into Triton's
``warmup`` for sm_90. The transformers engine's steps at one row width of every class that compiles differently
(:func:`width_classes`), the vLLM pool's step, the full cache's dense attention, the smoke step's tests, the launch
variants the tuning commands time, and the specializations earlier GPU sessions logged (:data:`PARTS`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

#: the widest row (slots) whose classes the transformers engine's steps are compiled for: per-layer budgets at an
#: average of 1,024 (the benchmarks' budget) put a layer's row anywhere from a few hundred to a few thousand slots
MAX_WIDTH = 8193
#: the narrowest (a narrower row, which the benchmarks' budget of 1,024 is not expected to give a layer, compiles on the
#: device, and the session's compile log brings it to the next build)
MIN_WIDTH = 129
ROOT = Path(__file__).resolve().parents[1]


def width_class(width: int) -> tuple:
    """What decides how the fused kernels compile for rows of ``width`` slots at batch 1 with Llama-3-8B's heads: the
    launch plan's constants and options (powers of two of the width, the pieces' size) and whether the width, which
    the kernels specialize on, is a multiple of 16. The same for SnapKV's, CAKE's and SLAKE's rules (pooled, the new
    token apart)."""
    from slake.kernels import launch_config
    from slake.kernels.step_plan import launch_plan

    flags = (0, 1, 0, 0, 1, 1, 0, 0, 7, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 0)  # SLAKE's: pooled, linear state, evict first
    p = launch_plan(1, 32, 128, 8, width, flags, 0, 0.0)
    return (p.append_constants, p.evict_constants, width % 16 == 0, launch_config.split_size(width, 8))


def width_classes(lo: int = MIN_WIDTH, hi: int = MAX_WIDTH) -> list[int]:
    """One row width of every :func:`width_class` in ``[lo, hi]``: the first width of each."""
    seen: dict[tuple, int] = {}
    for w in range(lo, hi + 1):
        seen.setdefault(width_class(w), w)
    return sorted(seen.values())


def engine_steps(methods: list[str], widths: list[int], static: bool, dtype) -> None:  # noqa: ANN001
    """One decode step of one layer of the transformers engine (``CompressedKV``, what ``SlakeCache`` runs) per
    method and row width, at Llama-3-8B's heads, batch 1; ``static``: in fixed-shape mode (``prepare_static``: a
    compiled step's launches)."""
    import torch

    from slake.cache.compressed import CompressedKV
    from slake.methods import make_method

    B, H, G, D = 1, 8, 4, 128
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    for name in methods:
        for w in widths:
            budget = w - 1  # a row keeps its budget and takes the new token in one more slot
            eng = CompressedKV(make_method(name), budget, 1, kernels="triton")
            n = budget + 40
            no_padding = torch.zeros(B, n, dtype=torch.bool)
            eng.prefill_layer(0, rnd(B, H * G, n, D), rnd(B, H, n, D), rnd(B, H, n, D), no_padding, D**-0.5)
            if static:
                eng.prepare_static(4)
            eng.append(0, rnd(B, H, 1, D), rnd(B, H, 1, D))
            eng.decode_attention(0, rnd(B, H * G, 1, D), D**-0.5)


def pool_steps(methods: list[str], requests: int, budget: int, dtype) -> None:  # noqa: ANN001
    """One step of the vLLM plugin's pool (``benchmarks.pool.random_pool`` as ``pool-gpu`` makes it: FlashAttention's
    layout, blocks of 16, 32 layers of Llama-3-8B's heads) per method."""
    from benchmarks.pool import random_pool
    from slake.engines.vllm.plugin.paged import FlashAttnLayout

    for name in methods:
        heads = dict(layers=32, kv_heads=8, group=4, head_dim=128)
        rp = random_pool(name, **heads, requests=requests, budget=budget, block_size=16, layout=FlashAttnLayout(),
                         device="cpu", dtype=dtype, kernels="triton")  # fmt: skip
        rp.step()


def dense_steps(shapes: list[tuple[int, int]], dtype) -> None:  # noqa: ANN001
    """The full cache's masked attention (:func:`slake.kernels.triton_dense.dense_attention`) over ``(rows, width)``
    stores of Llama-3-8B's heads."""
    import torch

    from slake.kernels.triton_dense import dense_attention

    H, G, D = 8, 4, 128
    for R, W in shapes:
        keys = torch.zeros(R, H, W, D, dtype=dtype)
        valid = torch.ones(R, H, W, dtype=torch.bool)
        none = torch.empty(0)
        dense_attention(torch.zeros(R, H * G, D, dtype=dtype), keys, keys, valid, none, none, D**-0.5)


def dense_shapes() -> list[tuple[int, int]]:
    """The dense attention's stores in a GPU session: the compiled full cache at 128K (its store is the prompt plus
    the steps the bench takes, a width in (131072, 131200]: both classes of a multiple of 16 or not), and
    ``pool-gpu``'s ``full_attention_dense`` rows (64 slots past the context) at 8 x 2K, 1 x 8K and 1 x 128K."""
    return [(1, 131073), (1, 131088), (8, 2048 + 64), (1, 8192 + 64), (1, 131072 + 64)]


def smoke_selection(script: Path = ROOT / "benchmarks" / "gpu_session.sh") -> tuple[list[str], str]:
    """The tests of ``tests/test_fused_decode.py`` that ``gpu_session.sh``'s smoke step names, and its ``-k``
    expression, read from the script (``tests/test_cuda.py``, which it runs too, needs a GPU to run at all)."""
    text = script.read_text()
    start = text.index("        smoke)")
    block = text[start : text.index(";;", start)]
    nodes = re.findall(r"tests/test_fused_decode\.py::\w+", block)
    k = re.search(r'-k "([^"]+)"', block)
    if not nodes or k is None:
        raise ValueError(f"{script}: the smoke step names no test_fused_decode tests or no -k expression")
    return nodes, " ".join(k.group(1).replace("\\\n", " ").split())


def smoke_tests(cache_dir: str, key: str) -> None:
    """The smoke step's tests of ``tests/test_fused_decode.py`` (:func:`smoke_selection`), run under the
    :mod:`benchmarks.warm_smoke` plugin: each launch compiled into ``cache_dir`` for sm_90, nothing run (the tests
    fail: their kernels computed nothing)."""
    nodes, k = smoke_selection()
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=cache_dir, SLAKE_WARM_KEY=key)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "benchmarks.warm_smoke", *nodes]
        + ["-k", k],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    summary = run.stdout.strip().splitlines()[-1:] or ["(no output)"]
    if "failed" not in summary[0] and "passed" not in summary[0]:
        raise RuntimeError(f"the smoke tests did not run: {run.stdout[-2000:]}{run.stderr[-2000:]}")
    print(f"warm-cache: smoke tests (expected to fail, their kernels ran nothing): {summary[0]}", flush=True)


def tuning_runs(script: Path = ROOT / "benchmarks" / "gpu_session.sh") -> list[tuple[str, int, int, str, tuple]]:
    """The pool steps that ``gpu_session.sh``'s ``kernel-tune`` and ``kernel-parts`` commands time, read from the
    script with their own parser: ``(method, requests, budget, kind, variant)``, ``kind`` ``"tuned"`` (``variant``:
    a dict of launch constants, :func:`slake.kernels.launch_config.tuned`) or ``"leaving_out"`` (``variant``: the
    parts, :func:`slake.kernels.launch_config.leaving_out`; each of ``SKIP_PARTS`` alone by default)."""
    import shlex

    from benchmarks.__main__ import _methods, parse_variants
    from benchmarks.__main__ import parser as benchmarks_parser
    from benchmarks.pool import TUNE_VARIANTS
    from slake.kernels import launch_config

    text = re.sub(r"\\\n\s*", " ", script.read_text())
    runs: list[tuple[str, int, int, str, tuple]] = []
    for line in text.splitlines():
        m = re.search(r'"\$py" -m benchmarks (kernel-tune|kernel-parts) ([^>]*)', line.split("#")[0])
        if m is None:
            continue
        a = benchmarks_parser().parse_args([m.group(1), *shlex.split(m.group(2))])
        variants: list[tuple[str, tuple]]
        if m.group(1) == "kernel-tune":
            chosen = TUNE_VARIANTS if a.variants is None else parse_variants(a.variants)
            variants = [("tuned", tuple(sorted(v.items()))) for v in chosen]
        else:
            names = launch_config.SKIP_PARTS if a.parts is None else a.parts.split(",")
            variants = [("leaving_out", (p,)) for p in names]
        for method in _methods(a.methods):
            runs += [(method, a.requests, a.budget, kind, v) for kind, v in variants]
    return runs


def tuning_steps(dtype) -> None:  # noqa: ANN001
    """One pool step per run of :func:`tuning_runs`, under its launch constants or with its parts left out."""
    from slake.kernels import launch_config

    for method, requests, budget, kind, variant in tuning_runs():
        if kind == "tuned":
            with launch_config.tuned(**dict(variant)):
                pool_steps([method], requests, budget, dtype)
        else:
            with launch_config.leaving_out(*variant):
                pool_steps([method], requests, budget, dtype)


def recorded_logs() -> list[Path]:
    """The compile logs GPU sessions brought back (``docs/results/**/triton_compiles.jsonl``,
    :mod:`slake.kernels.compile_log`)."""
    return sorted((ROOT / "docs" / "results").glob("**/triton_compiles.jsonl"))


def local_extern_libs(specialization: str) -> str:
    """``specialization`` (a compile log's serialized specialization) with each external library (libdevice) that is
    not at its recorded path read from this Triton's own copy of the same name: a log records the device's path
    (``/opt/torch/.venv/...``), which does not exist here. Triton keys a compilation by each library's contents, not
    its path, and the two copies come with the same Triton, so the cache key is the device's."""
    import triton

    spec = json.loads(specialization)
    options = spec.get("options") or {}
    here = Path(triton.__file__).parent / "backends" / "nvidia" / "lib"
    if options.get("extern_libs"):
        options["extern_libs"] = [
            [name, path if Path(path).exists() else str(here / Path(path).name)]
            for name, path in options["extern_libs"]
        ]
    return json.dumps(spec)


def compile_recorded(logs: list[Path]) -> None:
    """Compile each specialization the ``logs`` name, of the kernel as it is now (``JITFunction.preload``, Triton's
    own way to compile a serialized specialization): what a GPU session compiled, the next one finds. A kernel no
    longer there, or whose parameters changed since, is counted and left out."""
    import importlib

    done = skipped = 0
    for log in logs:
        from slake.kernels import compile_log

        for entry in compile_log.read(log):
            fn = getattr(importlib.import_module(entry["module"]), entry["name"], None)
            try:
                if fn is None:
                    raise LookupError(f"{entry['module']}.{entry['name']} is gone")
                fn.preload(local_extern_libs(entry["specialization"]))
                done += 1
            except Exception as e:  # noqa: BLE001  (a kernel changed since the log: left out, and said)
                skipped += 1
                print(f"warm-cache: {log.name}: {entry['name']} left out ({type(e).__name__}: {e})"[:300], flush=True)
    print(f"warm-cache: {done} logged specializations compiled, {skipped} left out, from {len(logs)} logs", flush=True)


#: the parts of a build, in order (``--parts``): the transformers engine's eager and static steps, the pool's step
#: at 8 rows of budget 128 and at 1 row of budget 1,024, the dense attention, the smoke step's tests of
#: ``tests/test_fused_decode.py`` (:func:`smoke_tests`), the variants ``kernel-tune`` and ``kernel-parts`` time
#: (:func:`tuning_runs`), and the specializations GPU sessions logged (:func:`compile_recorded`)
PARTS = ("eager", "static", "pool-8x128", "pool-1x1024", "dense", "smoke", "tuning", "recorded")
