"""Triton's on-disk cache of the fused kernels for an H100 or H200 (``sm_90``), built on a machine without a GPU.

A GPU session starts on a fresh machine, and the first launch of each specialization of the fused step's kernels
compiles it there: on the H200 of 2026-11-28 about 200 of a 15-minute session's seconds went to compiling (SLAKE's
first eager configuration 133 s, CAKE's 55 s), before anything was timed. Triton keeps what it compiled in a cache on
disk, keyed by a hash of everything that decides the machine code: its own build, the kernel's source and the
specialization of the launch, the target and the options. Nothing in that key needs the GPU, so the cache can be
filled here and carried to the device.

``python -m benchmarks.warm_cache build --wheel TRITON_WHEEL`` runs, on CPU tensors, the decode steps a GPU session
runs (``benchmarks/gpu_session.sh``: the transformers engine's eager and static steps at Llama-3-8B's heads, batch 1,
in bfloat16, at one row width of every class that compiles differently up to :data:`MAX_WIDTH`; the vLLM pool's step
at 8 rows of budget 128 and at 1 row of budget 1024; the full cache's dense attention at the benchmarks' widths;
the smoke step's tests of ``tests/test_fused_decode.py``, through :mod:`benchmarks.warm_smoke`; every specialization
an earlier GPU session logged, :mod:`slake.kernels.compile_log`), with Triton's active driver replaced by one that
reports an ``sm_90`` target (:func:`sm90_driver`) and every launch
replaced by Triton's own ``warmup`` (its JIT specializes and compiles the launch exactly as it would on the GPU, and
launches nothing; the steps' outputs are garbage and not read). The cache is written to :data:`CACHE_DIR` (Triton's
groups record absolute paths, so the device extracts it to the same place), its entries reduced to what loading a
kernel reads (metadata and cubin), and packed with a manifest into ``.warm-cache/triton-sm90.tgz``.

Triton's key begins with a hash of its own installation, libtriton's binary included, and that binary differs
between Python versions: the device runs Python 3.12, this machine 3.11. ``--wheel`` is the device's Triton wheel
(the same version for Python 3.12, ``pip download triton==3.6.0 --no-deps --python-version 3.12
--only-binary=:all: --platform manylinux_2_27_x86_64``); the build checks that every Python file of the wheel is
the one installed here and takes the wheel's libtriton in the key (:func:`device_triton_key`).

A GPU session also writes the device's own key (``python -m benchmarks.warm_cache key``, ``OUT/triton_key.txt``):
a later build given it (``--key-file``) needs no wheel and no assumption about where the device's Triton came from.

On the device, ``python -m benchmarks.warm_cache install ARCHIVE`` checks that the device's own Triton key and GPU
match the manifest's, extracts the cache and prints the directory to set as ``TRITON_CACHE_DIR`` (exit status 1 and
nothing extracted if they do not: every kernel then compiles as before), and ``report`` counts, at the end of the
session, the fused kernels Triton compiled anyway (entries the archive did not hold: a specialization it missed).
Where the device's Triton is another build of the same release (its key differs from the manifest's only in
libtriton's hash, and its ptxas is the same), ``install`` re-keys the entries for it: the build recorded each
compilation's cache key less Triton's own key (:func:`record_key_suffixes`), so each entry's name under the device's
key is known (:func:`rekeyed`).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: where the cache is built and, on the device, extracted: Triton's group files name their members by absolute path
CACHE_DIR = "/tmp/slake-triton-sm90"
#: the widest row (slots) whose classes the transformers engine's steps are compiled for: per-layer budgets at an
#: average of 1,024 (the benchmarks' budget) put a layer's row anywhere from a few hundred to a few thousand slots
MAX_WIDTH = 8193
#: the narrowest (a narrower row, which the benchmarks' budget of 1,024 is not expected to give a layer, compiles on the
#: device, and the session's compile log brings it to the next build)
MIN_WIDTH = 129
#: the fused kernels, by module; what ``report`` counts
KERNELS = {
    "slake.kernels.triton_attend": ("_append_logits_kernel",),
    "slake.kernels.triton_decode": ("_evict_attend_kernel",),
    "slake.kernels.triton_rules": ("_value_projection_kernel",),
    "slake.kernels.triton_dense": ("_dense_partials_kernel", "_dense_combine_kernel"),
    "slake.kernels.triton_layer": ("_layer_eviction_kernel",),
}
#: what a cached entry needs for a launch: its metadata and its binary (the IRs and PTX are for inspection only)
KEPT_SUFFIXES = (".json", ".cubin")
ARCHIVE = Path(".warm-cache") / "triton-sm90.tgz"
ROOT = Path(__file__).resolve().parents[1]
MANIFEST = "slake-warm-cache.json"


# ------------------------------------------------------------------ Triton's key for the device


def _record_hashes(record: str) -> dict[str, str]:
    """A wheel's ``RECORD`` (or an installation's) as ``{path: sha256=...}``."""
    return {row[0]: row[1] for row in csv.reader(io.StringIO(record)) if len(row) >= 2}


def device_triton_key(wheel: Path) -> str:
    """``triton.runtime.cache.triton_key()`` as the device computes it, from its Triton ``wheel``: this machine's
    key with the wheel's libtriton in place of the one installed here. Raises ``ValueError`` if the wheel is not
    the installed version or any Python file of the two differs (the key hashes them too)."""
    import triton
    from triton.runtime.cache import triton_key

    here = Path(triton.__file__).parent
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        record_name = next((n for n in names if n.endswith(".dist-info/RECORD")), None)
        if record_name is None or f"triton-{triton.__version__}.dist-info/RECORD" != record_name:
            raise ValueError(f"{wheel}: not a wheel of triton {triton.__version__} ({record_name})")
        theirs = _record_hashes(z.read(record_name).decode())
        lib = z.read("triton/_C/libtriton.so")
    installed = next(here.parent.glob(f"triton-{triton.__version__}.dist-info/RECORD"), None)
    if installed is None:
        raise ValueError(f"no RECORD of triton {triton.__version__} beside {here}")
    ours = _record_hashes(installed.read_text())
    differ = sorted(
        p
        for p in set(theirs) | set(ours)
        if p.startswith("triton/") and p.endswith(".py") and theirs.get(p) != ours.get(p)
    )
    if differ:
        raise ValueError(f"{wheel}: {len(differ)} Python files differ from the installed triton's, e.g. {differ[:3]}")
    local_lib = _libtriton_hash()
    key = triton_key()
    if local_lib not in key:
        raise ValueError("the installed libtriton's hash is not in triton_key(): this Triton builds its key otherwise")
    return key.replace(local_lib, hashlib.sha256(lib).hexdigest())


def _invalidating_env() -> dict[str, str]:
    """The environment variables that enter Triton's cache key (compiler debug switches), as set now."""
    from triton._C.libtriton import get_cache_invalidating_env_vars

    return dict(get_cache_invalidating_env_vars())


def key_digest(key: str) -> str:
    """A short, comparable form of a Triton key (the manifest's ``triton_key_sha256``)."""
    return hashlib.sha256(key.encode()).hexdigest()


# ------------------------------------------------------------------ compiling without a GPU


def sm90_driver() -> object:
    """A Triton driver that reports an ``sm_90`` CUDA target (an H100 or H200) and launches nothing: enough for
    ``JITFunction.run(..., warmup=True)``, which specializes and compiles a launch as the GPU's driver would."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class Sm90Driver(DriverBase):
        @classmethod
        def is_active(cls) -> bool:
            return False

        def map_python_to_cpp_type(self, ty: str) -> str:
            return ty

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

        def get_benchmarker(self):  # noqa: ANN201
            raise NotImplementedError("Sm90Driver compiles only")

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

    return Sm90Driver()


def compile_for_sm90(key: str | None = None, record_keys: bool = False) -> None:
    """Make this process compile the kernels it launches for sm_90 instead of running them: Triton's driver reports
    an sm_90 target (:func:`sm90_driver`), every ``kernel[grid](...)`` is Triton's own ``warmup`` of that launch (its
    JIT specializes and compiles it into the cache as it would on the GPU, and launches nothing; the outputs are
    garbage), slake's launch cache is off (it would call a compiled kernel's launcher), and half-precision keys take
    the low-precision products, as on a GPU. ``key``: Triton's key for the cache (:func:`device_triton_key`; None:
    this machine's). The fused kernels and the tests' probe kernels are imported compiled, then ``TRITON_INTERPRET``
    is set so that ``slake.kernels.load`` returns them as they are. With ``SLAKE_TRITON_COMPILE_LOG`` set, what
    compiles is logged there (:mod:`slake.kernels.compile_log`). Call it before anything imports
    ``triton.language`` with ``TRITON_INTERPRET`` set. ``record_keys``: each compilation's cache key, less Triton's
    key, is recorded in the cache directory (:func:`record_key_suffixes`), for ``install`` to re-key the entries for
    a device whose libtriton is another build of the same Triton."""
    import torch
    import triton.runtime.cache as triton_cache
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    if os.environ.get("TRITON_INTERPRET"):
        raise RuntimeError("compile_for_sm90 needs Triton imported without TRITON_INTERPRET")
    if key is not None:
        triton_cache.triton_key = lambda: key  # every cache key from now on is the device's
    if record_keys:
        record_key_suffixes()
    driver.set_active(sm90_driver())
    JITFunction.__getitem__ = lambda self, grid: lambda *a, **k: self.run(*a, grid=grid, warmup=True, **k)
    sys.path.insert(0, str(ROOT / "tests"))
    import kernel_probes  # noqa: F401  (the tests' probe kernels, compiled)
    from slake.cache import fused_step
    from slake.kernels import compile_log, launch_config, triton_decode, triton_dense  # noqa: F401  (compiled)

    launch_config.CACHED_LAUNCH = False
    fused_step.half_precision_dots = lambda device, keys_dtype: keys_dtype in (torch.float16, torch.bfloat16)
    triton_dense.half_precision_dots = fused_step.half_precision_dots
    if os.environ.get(compile_log.ENV):
        compile_log.install(os.environ[compile_log.ENV])
    os.environ["TRITON_INTERPRET"] = "1"


#: where :func:`record_key_suffixes` writes, in the cache directory (one JSON line per compilation)
SUFFIXES = "slake-key-suffixes.jsonl"


def entry_of(key: str) -> tuple[str, str]:
    """The cache entry of a compilation whose cache key is ``key``: ``(its directory's name, the hash its metadata
    records)``, as Triton names them (the SHA-256 of the key, in base 32 for the directory)."""
    import base64

    digest = hashlib.sha256(key.encode("utf-8"))
    return base64.b32encode(digest.digest()).decode("utf-8").rstrip("="), digest.hexdigest()


def record_key_suffixes() -> None:
    """From now on each compilation in this process appends ``{"entry", "suffix"}`` to :data:`SUFFIXES` in Triton's
    cache directory: the entry's directory name (the SHA-256 of its cache key) and the key less its first part,
    Triton's own key. Triton's cache key is ``triton_key()`` followed by the hashes of the kernel's source and
    specialization, of the backend (ptxas's version and the target) and of the options, and the compiler switches
    set in the environment, none of which depends on libtriton's binary: with the suffix, an entry's name under
    another Triton key is :func:`entry_of` ``(other_key + suffix)`` (:func:`rekeyed`)."""
    import triton.compiler.compiler as triton_compiler
    import triton.runtime.cache as triton_cache
    from triton import knobs

    original = triton_compiler.get_cache_key

    def recording(src: Any, backend: Any, backend_options: Any, env_vars: Any) -> str:
        key = original(src, backend, backend_options, env_vars)
        prefix = triton_cache.triton_key()
        if not key.startswith(prefix):
            raise RuntimeError("Triton's cache key no longer begins with triton_key(): re-keying cannot work")
        entry = entry_of(key)[0]
        cache = Path(knobs.cache.dir)
        cache.mkdir(parents=True, exist_ok=True)  # before the first compilation, Triton has not made it yet
        with open(cache / SUFFIXES, "a") as f:
            f.write(json.dumps({"entry": entry, "suffix": key[len(prefix) :]}) + "\n")
        return key

    triton_compiler.get_cache_key = recording


def skip_compiling(seen: set[tuple[str, str]]) -> None:
    """From now on Triton's JIT compiles nothing: each specialization it would compile is added to ``seen`` as
    ``(kernel name, Triton's serialization of the specialization)`` instead (a ``jit_cache_hook``). With
    :func:`compile_for_sm90`, what a GPU would compile, counted without compiling."""
    from triton import knobs

    def record(*, fn: Any, compile: dict, **_: Any) -> bool:
        seen.add((fn.name, compile["specialization_data"]))
        return True  # the compilation is skipped

    knobs.runtime.jit_cache_hook = record


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


def _engine_steps(methods: list[str], widths: list[int], static: bool, dtype) -> None:  # noqa: ANN001
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


def _pool_steps(methods: list[str], requests: int, budget: int, dtype) -> None:  # noqa: ANN001
    """One step of the vLLM plugin's pool (``benchmarks.pool.random_pool`` as ``pool-gpu`` makes it: FlashAttention's
    layout, blocks of 16, 32 layers of Llama-3-8B's heads) per method."""
    from benchmarks.pool import random_pool
    from slake.engines.vllm.plugin.paged import FlashAttnLayout

    for name in methods:
        heads = dict(layers=32, kv_heads=8, group=4, head_dim=128)
        rp = random_pool(name, **heads, requests=requests, budget=budget, block_size=16, layout=FlashAttnLayout(),
                         device="cpu", dtype=dtype, kernels="triton")  # fmt: skip
        rp.step()


def _dense_steps(shapes: list[tuple[int, int]], dtype) -> None:  # noqa: ANN001
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


def _dense_shapes() -> list[tuple[int, int]]:
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


def _smoke_tests(cache_dir: str, key: str) -> None:
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


def _tuning_steps(dtype) -> None:  # noqa: ANN001
    """One pool step per run of :func:`tuning_runs`, under its launch constants or with its parts left out."""
    from slake.kernels import launch_config

    for method, requests, budget, kind, variant in tuning_runs():
        if kind == "tuned":
            with launch_config.tuned(**dict(variant)):
                _pool_steps([method], requests, budget, dtype)
        else:
            with launch_config.leaving_out(*variant):
                _pool_steps([method], requests, budget, dtype)


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


def _recorded(logs: list[Path]) -> None:
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


def _slim(cache: Path) -> int:
    """Reduce each cache entry to what loading a kernel reads (its metadata and cubin, :data:`KEPT_SUFFIXES`),
    rewriting its group file to list only those; the entries' count."""
    count = 0
    for group in cache.glob("*/__grp__*.json"):
        data = json.loads(group.read_text())
        kept = {k: v for k, v in data["child_paths"].items() if k.endswith(KEPT_SUFFIXES)}
        for k, v in data["child_paths"].items():
            if k not in kept:
                Path(v).unlink(missing_ok=True)
        group.write_text(json.dumps({**data, "child_paths": kept}))
        count += 1
    return count


def _entries(cache: Path) -> dict[str, str]:
    """``{entry directory: kernel name}`` of a Triton cache (from each entry's group file)."""
    out = {}
    for group in cache.glob("*/__grp__*.json"):
        out[group.parent.name] = group.name[len("__grp__") : -len(".json")]
    return out


def _recorded_suffixes(cache: Path) -> dict[str, str]:
    """``{entry: key suffix}`` from the build's :data:`SUFFIXES` file (:func:`record_key_suffixes`), which is then
    removed (the manifest holds what the archive needs)."""
    path = cache / SUFFIXES
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        out[row["entry"]] = row["suffix"]
    path.unlink()
    return out


def sm90_backend_hash() -> str:
    """What Triton's CUDA backend puts in the cache key for an sm_90 target (ptxas's version and the target)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    return make_backend(GPUTarget("cuda", 90, 32)).hash()


#: the parts of a build, in order (``--parts``): the transformers engine's eager and static steps, the pool's step
#: at 8 rows of budget 128 and at 1 row of budget 1,024, the dense attention, the smoke step's tests of
#: ``tests/test_fused_decode.py`` (:func:`_smoke_tests`), the variants ``kernel-tune`` and ``kernel-parts`` time
#: (:func:`tuning_runs`), and the specializations GPU sessions logged (:func:`_recorded`)
PARTS = ("eager", "static", "pool-8x128", "pool-1x1024", "dense", "smoke", "tuning", "recorded")


def build(
    wheel: Path | str | None,
    archive: Path,
    methods: list[str],
    cache_dir: str = CACHE_DIR,
    widths: list[int] | None = None,
    parts: tuple[str, ...] = PARTS,
    recorded: list[Path] | None = None,
) -> dict:
    """Fill ``cache_dir`` with the kernels a GPU session compiles (module docstring), keyed for the Triton of
    ``wheel`` (a path: the device's wheel; a string: the device's key itself, as ``key`` printed it there; None: the
    Triton installed here), and pack it into ``archive``; the manifest. ``widths``: the row
    widths of the transformers engine's steps (default :func:`width_classes`); ``parts``: which of :data:`PARTS`;
    ``recorded``: the compile logs of the ``recorded`` part (default :func:`recorded_logs`). With
    ``SLAKE_TRITON_COMPILE_LOG`` set, what the build compiles is logged there too (:mod:`slake.kernels.compile_log`).
    Run in a process whose Triton was imported with ``TRITON_CACHE_DIR=cache_dir`` and without ``TRITON_INTERPRET``
    (``main`` starts one)."""
    if os.environ.get("TRITON_CACHE_DIR") != cache_dir or os.environ.get("TRITON_INTERPRET"):
        raise RuntimeError(f"build needs TRITON_CACHE_DIR={cache_dir} and no TRITON_INTERPRET when Triton is imported")
    import torch
    import triton
    import triton.runtime.cache as triton_cache

    if isinstance(wheel, str):  # the device's key itself (``key`` on the device, ``--key-file``)
        key = wheel
    else:
        key = device_triton_key(wheel) if wheel is not None else triton_cache.triton_key()
    compile_for_sm90(key, record_keys=True)
    dtype = torch.bfloat16
    widths = width_classes() if widths is None else list(widths)
    started = time.time()
    took: dict[str, float] = {}

    def timed(name: str, fn: Callable[[], None]) -> None:
        t = time.time()
        fn()
        took[name] = round(time.time() - t, 1)
        print(f"warm-cache: {name} done in {took[name]} s ({len(_entries(Path(cache_dir)))} entries)", flush=True)

    steps: dict[str, Callable[[], None]] = {
        "eager": lambda: _engine_steps(methods, widths, False, dtype),
        "static": lambda: _engine_steps([m for m in methods if m == "slake"], widths, True, dtype),
        "pool-8x128": lambda: _pool_steps(methods, 8, 128, dtype),
        "pool-1x1024": lambda: _pool_steps(methods, 1, 1024, dtype),
        "dense": lambda: _dense_steps(_dense_shapes(), dtype),
        "smoke": lambda: _smoke_tests(cache_dir, key),
        "tuning": lambda: _tuning_steps(dtype),
        "recorded": lambda: _recorded(recorded_logs() if recorded is None else recorded),
    }
    for part in parts:
        timed(part, steps[part])
    cache = Path(cache_dir)
    entries = _slim(cache)
    suffixes = _recorded_suffixes(cache)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    manifest = {
        "triton": triton.__version__,
        "triton_key_sha256": key_digest(key),
        "triton_key": key,
        "backend_hash": sm90_backend_hash(),
        "target": "cuda:90",
        "env_vars": _invalidating_env(),
        "cache_dir": cache_dir,
        "commit": commit,
        "methods": methods,
        "widths": widths,
        "entries": _entries(cache),
        "suffixes": {entry: suffixes[entry] for entry in _entries(cache) if entry in suffixes},
        "seconds": round(time.time() - started, 1),
        "parts": took,
    }
    (cache / MANIFEST).write_text(json.dumps(manifest, indent=1))
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(cache, arcname=cache.name)
    print(f"warm-cache: {entries} kernels, {archive} ({archive.stat().st_size / 2**20:.1f} MiB)", flush=True)
    return manifest


# ------------------------------------------------------------------ on the device


def _manifest_of(tar: tarfile.TarFile) -> dict | None:
    """The manifest packed in an archive (the one member named :data:`MANIFEST`), or None."""
    for member in tar.getmembers():
        if Path(member.name).name == MANIFEST and member.isfile():
            f = tar.extractfile(member)
            return None if f is None else json.loads(f.read())
    return None


def _libtriton_hash() -> str:
    """The SHA-256 of this machine's libtriton binary (the part of ``triton_key()`` that differs between builds)."""
    import sysconfig

    import triton

    ext = sysconfig.get_config_var("EXT_SUFFIX").split(".")[-1]
    digest = hashlib.sha256()
    with open(Path(triton.__file__).parent / "_C" / f"libtriton.{ext}", "rb") as f:
        for chunk in iter(lambda: f.read(2**24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def rekey_refusal(manifest: dict, key: str, lib_hash: str, backend_hash: str) -> str | None:
    """Why an archive keyed otherwise cannot be re-keyed for a machine whose Triton key is ``key`` (None: it can).

    It can when the two keys differ only in libtriton's hash, and that is ``lib_hash``, this machine's (the same
    Triton version, every Python file the same: another build of the same release, as PyPI's and PyTorch's indexes
    may serve), and the build's CUDA backend hash (ptxas's version) is ``backend_hash``. The kernels were compiled here
    by yet another build of that release anyway (Python 3.11's; the device's is 3.12's): re-keying adds no
    assumption that the build does not already make."""
    theirs = manifest.get("triton_key")
    if theirs is None or "suffixes" not in manifest:
        return "the archive records no key suffixes (built before re-keying existed)"
    ours_parts, theirs_parts = key.split("-"), theirs.split("-")
    if len(ours_parts) != len(theirs_parts):
        return "Triton's key has another form here (another version)"
    differ = [i for i, (a, b) in enumerate(zip(ours_parts, theirs_parts, strict=True)) if a != b]
    if len(differ) != 1 or ours_parts[differ[0]] != lib_hash:
        return f"Triton's key differs in {len(differ)} of its parts, not only in libtriton's hash"
    if manifest.get("backend_hash") != backend_hash:
        return f"the CUDA backend differs (ptxas {backend_hash} here, {manifest.get('backend_hash')} in the archive)"
    return None


def rekeyed(manifest: dict, key: str) -> dict:
    """The manifest of ``manifest``'s archive re-keyed for Triton key ``key``: each entry's directory renamed to
    :func:`entry_of` ``key`` followed by its key suffix (Triton's own naming, :func:`record_key_suffixes`); an entry
    without a recorded suffix is left out."""
    names = {}
    suffixes = {}
    for entry, name in manifest["entries"].items():
        suffix = manifest["suffixes"].get(entry)
        if suffix is None:
            continue
        new = entry_of(key + suffix)[0]
        names[new] = name
        suffixes[new] = suffix
    return {
        **manifest,
        "triton_key_sha256": key_digest(key),
        "triton_key": key,
        "entries": names,
        "suffixes": suffixes,
        "rekeyed_from": manifest["triton_key_sha256"],
    }


def _rekey_entries(cache: Path, old: dict, new: dict) -> None:
    """Rename the entries of ``old`` (extracted in ``cache``) to those of ``new`` (:func:`rekeyed`): each directory,
    the absolute paths its group file lists, and the ``hash`` its metadata records; an entry ``new`` left out is
    removed."""
    key = new["triton_key"]
    for entry in old["entries"]:
        suffix = old["suffixes"].get(entry)
        if suffix is None:
            shutil.rmtree(cache / entry)
            continue
        target, digest = entry_of(key + suffix)
        (cache / entry).rename(cache / target)
        for group in (cache / target).glob("__grp__*.json"):
            data = json.loads(group.read_text())
            paths = {k: str(cache / target / Path(v).name) for k, v in data["child_paths"].items()}
            group.write_text(json.dumps({**data, "child_paths": paths}))
            for child, path in paths.items():
                if child.endswith(".json"):
                    meta = json.loads(Path(path).read_text())
                    if "hash" in meta:
                        meta["hash"] = digest
                        Path(path).write_text(json.dumps(meta))


def install(archive: Path, capability: tuple[int, int] | None = None) -> int:
    """On the GPU machine: extract ``archive`` to the directory it was built in (its manifest's ``cache_dir``) if
    the manifest's Triton key is the device's and the GPU (``capability``, default the current device's) is sm_90;
    print that directory (for ``TRITON_CACHE_DIR``) and return 0; else say why on stderr and return 1. An archive
    keyed for another build of the same Triton (only libtriton's hash differs, :func:`rekey_refusal`) is re-keyed for
    this one (:func:`rekeyed`). A directory that already holds this archive (a later call on a still-warm machine)
    is kept as it is, with the kernels the device compiled into it."""
    import torch
    import triton
    from triton.runtime.cache import triton_key

    if capability is None and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
    with tarfile.open(archive) as tar:
        manifest = _manifest_of(tar)
        if manifest is None:
            print(f"warm-cache: {archive} has no manifest", file=sys.stderr)
            return 1
        why = []
        wanted = manifest
        key = triton_key()
        backend = sm90_backend_hash()
        if manifest["triton_key_sha256"] != key_digest(key):
            refusal = rekey_refusal(manifest, key, _libtriton_hash(), backend)
            if refusal is None:
                wanted = rekeyed(manifest, key)
            else:
                why.append(
                    f"Triton's key differs (triton {triton.__version__} here, the archive's {manifest['triton']}), "
                    f"and it cannot be re-keyed: {refusal}"
                )
        elif manifest.get("backend_hash", backend) != backend:  # every entry's key holds ptxas's version
            why.append(f"the CUDA backend differs (ptxas {backend} here, {manifest['backend_hash']} in the archive)")
        if manifest.get("env_vars", {}) != _invalidating_env():
            why.append(f"Triton's compiler switches in the environment differ ({_invalidating_env()})")
        if tuple(capability or ()) != (9, 0):
            why.append(f"the GPU is not sm_90 (capability {capability})")
        if why:
            print(f"warm-cache: not used: {'; '.join(why)}", file=sys.stderr)
            return 1
        target = Path(manifest["cache_dir"])
        here = target / MANIFEST
        if here.exists() and json.loads(here.read_text()) == wanted:
            # installed by an earlier call on this machine: keep it, with what the device compiled since
            print(target)
            return 0
        if target.exists():
            shutil.rmtree(target)
        tar.extractall(target.parent, filter="data")
    if wanted is not manifest:
        _rekey_entries(target, manifest, wanted)
        here.write_text(json.dumps(wanted, indent=1))
        print(f"warm-cache: re-keyed {len(wanted['entries'])} of {len(manifest['entries'])} kernels for this "
              f"machine's libtriton (the archive's was another build of triton {manifest['triton']})",
              file=sys.stderr)  # fmt: skip
    print(target)
    print(f"warm-cache: {len(wanted['entries'])} kernels of {manifest['commit'][:7]} in {target}", file=sys.stderr)
    return 0


def report(cache: Path = Path(CACHE_DIR)) -> dict:
    """The fused kernels in ``cache`` that its archive did not hold (compiled on the device: a specialization the
    build missed, or a kernel changed since), per kernel, beside the number it held."""
    manifest = json.loads((cache / MANIFEST).read_text())
    fused = {n for names in KERNELS.values() for n in names}
    missed: dict[str, int] = {}
    for entry, name in _entries(cache).items():
        if name in fused and entry not in manifest["entries"]:
            missed[name] = missed.get(name, 0) + 1
    return {"held": len(manifest["entries"]), "compiled_on_device": missed}


def parser() -> argparse.ArgumentParser:
    """The command line: ``build``, ``install``, ``report`` (module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.warm_cache", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="fill and pack the cache (no GPU needed)")
    b.add_argument(
        "--wheel",
        type=Path,
        default=None,
        help="the device's Triton wheel (Python 3.12); default: key the cache for the Triton installed here",
    )
    b.add_argument("--key-file", type=Path, default=None,
                   help="the device's Triton key as `key` printed it there (instead of --wheel)")  # fmt: skip
    b.add_argument("--out", type=Path, default=ARCHIVE, help="the archive to write")
    b.add_argument("--methods", default="snapkv,cake,slake", help="the transformers engine's and the pool's methods")
    b.add_argument("--cache-dir", default=CACHE_DIR, help="where to build (the device extracts to the same path)")
    b.add_argument("--widths", default=None, help="comma-separated row widths (default: one per class)")
    b.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")  # fmt: skip
    b.add_argument("--recorded", default=None,
                   help="comma-separated compile logs (default: docs/results/**/triton_compiles.jsonl)")  # fmt: skip
    i = sub.add_parser("install", help="on the GPU machine: extract the cache if it is for this Triton and GPU")
    i.add_argument("archive", type=Path, nargs="?", default=ARCHIVE)
    sub.add_parser("key", help="this machine's Triton key (on the GPU machine: for a later build's --key-file)")
    r = sub.add_parser("report", help="on the GPU machine: the fused kernels compiled there anyway")
    r.add_argument("--cache-dir", default=CACHE_DIR)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the command line (:func:`parser`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = parser()
    a = ap.parse_args(argv)
    if a.command == "build":
        parts = tuple(p for p in a.parts.split(",") if p)
        unknown = set(parts) - set(PARTS)
        if unknown:
            ap.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
        if os.environ.get("TRITON_CACHE_DIR") != a.cache_dir or os.environ.get("TRITON_INTERPRET"):
            # Triton reads both when it is imported: build in a process started with them right
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            env["TRITON_CACHE_DIR"] = a.cache_dir
            shutil.rmtree(a.cache_dir, ignore_errors=True)
            return subprocess.run([sys.executable, "-m", "benchmarks.warm_cache", *argv], env=env,
                                  check=False).returncode  # fmt: skip
        widths = None if a.widths is None else [int(w) for w in a.widths.split(",") if w]
        logs = None if a.recorded is None else [Path(p) for p in a.recorded.split(",") if p]
        if a.key_file is not None and a.wheel is not None:
            ap.error("give --wheel or --key-file, not both")
        keyed = a.key_file.read_text().strip() if a.key_file is not None else a.wheel
        build(keyed, a.out, [m for m in a.methods.split(",") if m], a.cache_dir, widths, parts, logs)
        return 0
    if a.command == "install":
        return install(a.archive)
    if a.command == "key":
        from triton.runtime.cache import triton_key

        print(triton_key())
        return 0
    print(json.dumps(report(Path(a.cache_dir))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
