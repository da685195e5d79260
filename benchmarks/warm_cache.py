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
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.warm_key import (
    SUFFIXES,
    device_triton_key,
    invalidating_env,
    key_digest,
    libtriton_hash,
    record_key_suffixes,
    rekey_entries,
    rekey_refusal,
    rekeyed,
    sm90_backend_hash,
)
from benchmarks.warm_parts import (
    PARTS,
    compile_recorded,
    dense_shapes,
    dense_steps,
    engine_steps,
    pool_steps,
    recorded_logs,
    smoke_tests,
    tuning_steps,
    width_classes,
)

#: where the cache is built and, on the device, extracted: Triton's group files name their members by absolute path
CACHE_DIR = "/tmp/slake-triton-sm90"
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


def skip_compiling(seen: set[tuple[str, str]]) -> None:
    """From now on Triton's JIT compiles nothing: each specialization it would compile is added to ``seen`` as
    ``(kernel name, Triton's serialization of the specialization)`` instead (a ``jit_cache_hook``). With
    :func:`compile_for_sm90`, what a GPU would compile, counted without compiling."""
    from triton import knobs

    def record(*, fn: Any, compile: dict, **_: Any) -> bool:
        seen.add((fn.name, compile["specialization_data"]))
        return True  # the compilation is skipped

    knobs.runtime.jit_cache_hook = record


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


#: the parts a parallel build runs after the others (:func:`fill_in_processes`): the static steps compile what the
#: eager ones do (a second after them in one process), and what GPU sessions logged is mostly what the other parts
#: compile; after them, they find it in the cache instead of compiling it a second time side by side
LAST = ("static", "recorded")
#: the parts in the order a parallel build starts them, the longest first; measured on two cores on 2026-12-03 in one
#: process: tuning 536 s, eager 791 (split in pieces, :func:`parallel_tasks`), pool-1x1024 105, pool-8x128 27, smoke
#: 16, dense 2, and after them static 2 and recorded 84
LONGEST_FIRST = ("tuning", "eager", "pool-1x1024", "pool-8x128", "smoke", "dense", "static", "recorded")


def fill(
    key: str,
    methods: list[str],
    widths: list[int],
    parts: tuple[str, ...],
    recorded: list[Path] | None = None,
) -> dict[str, float]:
    """Compile the kernels of ``parts`` (of :data:`PARTS`) for sm_90 into Triton's cache in this process, keyed with
    ``key``: the seconds each part took. The process must have imported Triton with ``TRITON_CACHE_DIR`` set and
    without ``TRITON_INTERPRET``; ``methods``, ``widths`` and ``recorded`` as :func:`build` takes them."""
    if not os.environ.get("TRITON_CACHE_DIR") or os.environ.get("TRITON_INTERPRET"):
        raise RuntimeError("fill needs TRITON_CACHE_DIR and no TRITON_INTERPRET when Triton is imported")
    import torch

    cache_dir = os.environ["TRITON_CACHE_DIR"]
    compile_for_sm90(key, record_keys=True)
    dtype = torch.bfloat16
    steps: dict[str, Callable[[], None]] = {
        "eager": lambda: engine_steps(methods, widths, False, dtype),
        "static": lambda: engine_steps([m for m in methods if m == "slake"], widths, True, dtype),
        "pool-8x128": lambda: pool_steps(methods, 8, 128, dtype),
        "pool-1x1024": lambda: pool_steps(methods, 1, 1024, dtype),
        "dense": lambda: dense_steps(dense_shapes(), dtype),
        "smoke": lambda: smoke_tests(cache_dir, key),
        "tuning": lambda: tuning_steps(dtype),
        "recorded": lambda: compile_recorded(recorded_logs() if recorded is None else recorded),
    }
    took: dict[str, float] = {}
    for part in parts:
        t = time.time()
        steps[part]()
        took[part] = round(time.time() - t, 1)
        print(f"warm-cache: {part} done in {took[part]} s ({len(_entries(Path(cache_dir)))} entries)", flush=True)
    return took


def parallel_tasks(parts: tuple[str, ...], widths: list[int], jobs: int) -> list[tuple[str, str, list[int]]]:
    """What a build of ``parts`` runs in ``jobs`` processes: ``(label, part, widths)`` in the order they start, the
    longest first (:data:`LONGEST_FIRST`), the parts of :data:`LAST` at the end. The ``eager`` part, the longest but
    for ``tuning``, is split into ``2 * jobs`` pieces of every ``2 * jobs``-th width, so that the pieces fill the
    processes around the tuning part: a width class compiles kernels of its own, mostly (the methods at one width
    share theirs), so the pieces seldom compile the same kernel twice."""
    tasks: list[tuple[str, str, list[int]]] = []
    for part in sorted(parts, key=LONGEST_FIRST.index):
        n = min(2 * jobs, len(widths))
        if part == "eager" and jobs > 1 and n > 1:
            tasks += [(f"eager {i + 1}/{n}", part, widths[i::n]) for i in range(n)]
        else:
            tasks.append((part, part, widths))
    return tasks


def fill_in_processes(
    key: str,
    methods: list[str],
    widths: list[int],
    parts: tuple[str, ...],
    recorded: list[Path] | None,
    cache_dir: str,
    jobs: int,
) -> dict[str, float]:
    """:func:`fill` split into :func:`parallel_tasks`, each in its own process (``python -m benchmarks.warm_cache
    fill``), at most ``jobs`` at a time, the parts of :data:`LAST` after all the others have finished: Triton
    compiles one kernel at a time, about 8 s each on one core, so a build on two cores takes about half the time.
    The processes share the cache directory (Triton writes each entry whole, under a temporary name) and the key
    suffixes' file (one write per line). The seconds each task took, its process's start included; RuntimeError
    naming the tasks that failed."""
    import concurrent.futures

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=cache_dir, SLAKE_WARM_KEY=key)

    def run(task: tuple[str, str, list[int]]) -> float:
        label, part, ws = task
        cmd = [sys.executable, "-m", "benchmarks.warm_cache", "fill", "--part", part, "--methods", ",".join(methods),
               "--widths", ",".join(map(str, ws))]  # fmt: skip
        if recorded is not None:
            cmd += ["--recorded", ",".join(map(str, recorded))]
        t = time.time()
        done = subprocess.run(cmd, cwd=ROOT, env=env, check=False)
        if done.returncode:
            raise RuntimeError(f"warm-cache: {label} failed (exit status {done.returncode})")
        return round(time.time() - t, 1)

    tasks = parallel_tasks(parts, widths, jobs)
    took: dict[str, float] = {}
    failed = []
    for group in ([t for t in tasks if t[1] not in LAST], [t for t in tasks if t[1] in LAST]):
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(run, task): task[0] for task in group}
            for future in concurrent.futures.as_completed(futures):
                try:
                    took[futures[future]] = future.result()
                except RuntimeError as e:
                    failed.append(str(e))
        if failed:
            raise RuntimeError("; ".join(failed))
    return took


def build(
    wheel: Path | str | None,
    archive: Path,
    methods: list[str],
    cache_dir: str = CACHE_DIR,
    widths: list[int] | None = None,
    parts: tuple[str, ...] = PARTS,
    recorded: list[Path] | None = None,
    jobs: int = 1,
) -> dict:
    """Fill ``cache_dir`` with the kernels a GPU session compiles (module docstring), keyed for the Triton of
    ``wheel`` (a path: the device's wheel; a string: the device's key itself, as ``key`` printed it there; None: the
    Triton installed here), and pack it into ``archive``; the manifest. ``widths``: the row
    widths of the transformers engine's steps (default :func:`width_classes`); ``parts``: which of :data:`PARTS`;
    ``recorded``: the compile logs of the ``recorded`` part (default :func:`recorded_logs`); ``jobs``: processes
    compiling side by side (1: this one, :func:`fill`; more: :func:`fill_in_processes`). With
    ``SLAKE_TRITON_COMPILE_LOG`` set, what the build compiles is logged there too (:mod:`slake.kernels.compile_log`).
    Run in a process whose Triton was imported with ``TRITON_CACHE_DIR=cache_dir`` and without ``TRITON_INTERPRET``
    (``main`` starts one)."""
    if os.environ.get("TRITON_CACHE_DIR") != cache_dir or os.environ.get("TRITON_INTERPRET"):
        raise RuntimeError(f"build needs TRITON_CACHE_DIR={cache_dir} and no TRITON_INTERPRET when Triton is imported")
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    import triton
    import triton.runtime.cache as triton_cache

    if isinstance(wheel, str):  # the device's key itself (``key`` on the device, ``--key-file``)
        key = wheel
    else:
        key = device_triton_key(wheel) if wheel is not None else triton_cache.triton_key()
    widths = width_classes() if widths is None else list(widths)
    started = time.time()
    if jobs == 1:
        took = fill(key, methods, widths, parts, recorded)
    else:
        took = fill_in_processes(key, methods, widths, parts, recorded, cache_dir, jobs)
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
        "env_vars": invalidating_env(),
        "cache_dir": cache_dir,
        "commit": commit,
        "methods": methods,
        "widths": widths,
        "entries": _entries(cache),
        "suffixes": {entry: suffixes[entry] for entry in _entries(cache) if entry in suffixes},
        "seconds": round(time.time() - started, 1),
        "parts": took,
        "jobs": jobs,
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
            refusal = rekey_refusal(manifest, key, libtriton_hash(), backend)
            if refusal is None:
                wanted = rekeyed(manifest, key)
            else:
                why.append(
                    f"Triton's key differs (triton {triton.__version__} here, the archive's {manifest['triton']}), "
                    f"and it cannot be re-keyed: {refusal}"
                )
        elif manifest.get("backend_hash", backend) != backend:  # every entry's key holds ptxas's version
            why.append(f"the CUDA backend differs (ptxas {backend} here, {manifest['backend_hash']} in the archive)")
        if manifest.get("env_vars", {}) != invalidating_env():
            why.append(f"Triton's compiler switches in the environment differ ({invalidating_env()})")
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
        rekey_entries(target, manifest, wanted)
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
    """The command line: ``build``, ``install``, ``key``, ``report`` (module docstring), and ``fill``, what
    ``build --jobs`` runs in each of its processes."""
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
    b.add_argument("--jobs", type=int, default=1,
                   help="processes compiling side by side (default 1; `make warm-cache`: the CPUs)")  # fmt: skip
    f = sub.add_parser("fill", help="one task of a build with --jobs, in its own process (the key in SLAKE_WARM_KEY)")
    f.add_argument("--part", required=True, choices=PARTS)
    f.add_argument("--methods", required=True)
    f.add_argument("--widths", required=True)
    f.add_argument("--recorded", default=None)
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
        if a.jobs < 1:
            ap.error(f"--jobs must be at least 1, got {a.jobs}")
        build(keyed, a.out, [m for m in a.methods.split(",") if m], a.cache_dir, widths, parts, logs, a.jobs)
        return 0
    if a.command == "fill":
        key = os.environ.get("SLAKE_WARM_KEY")
        if not key:
            ap.error("fill is run by build --jobs, which sets SLAKE_WARM_KEY to the build's Triton key")
        logs = None if a.recorded is None else [Path(p) for p in a.recorded.split(",") if p]
        widths = [int(w) for w in a.widths.split(",") if w]
        fill(key, [m for m in a.methods.split(",") if m], widths, (a.part,), logs)
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
