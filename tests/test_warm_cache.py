"""Triton's cache of the fused kernels for sm_90, built without a GPU (``benchmarks/warm_cache.py``): the device's key,
the row widths it compiles for, and a small build carried through install and report."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from benchmarks import warm_cache, warm_key, warm_parts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _installed_record() -> str:
    here = Path(triton.__file__).parent
    return next(here.parent.glob(f"triton-{triton.__version__}.dist-info/RECORD")).read_text()


def _wheel(path: Path, record: str, lib: bytes, version: str = triton.__version__) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"triton-{version}.dist-info/RECORD", record)
        z.writestr("triton/_C/libtriton.so", lib)
    return path


def test_the_devices_key_is_this_machines_with_the_wheels_libtriton(tmp_path):
    """Triton's cache key hashes its installation, libtriton's binary included, which differs between Python
    versions: the device's key is this machine's with the wheel's libtriton hash in its place, and a wheel of
    another version, or whose Python files differ from the ones installed here, is refused."""
    from triton.runtime.cache import triton_key

    record = _installed_record()
    key = warm_key.device_triton_key(_wheel(tmp_path / "a.whl", record, b"another build"))
    local = hashlib.sha256((Path(triton.__file__).parent / "_C" / "libtriton.so").read_bytes()).hexdigest()
    assert key == triton_key().replace(local, hashlib.sha256(b"another build").hexdigest())
    assert key != triton_key()
    # a Python file that differs: its hash is in the key too
    line = next(x for x in record.splitlines() if x.startswith("triton/runtime/jit.py,"))
    changed = record.replace(line, "triton/runtime/jit.py,sha256=AAAA,1")
    with pytest.raises(ValueError, match="Python files differ"):
        warm_key.device_triton_key(_wheel(tmp_path / "b.whl", changed, b"x"))
    with pytest.raises(ValueError, match="not a wheel of triton"):
        warm_key.device_triton_key(_wheel(tmp_path / "c.whl", record, b"x", version="0.0.1"))


def _script_row(script: str, *args: str) -> dict:
    """The one JSON line a script of ``tests/`` prints, run in its own process (Triton compiled, not interpreted)."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / script), *args], capture_output=True, text=True, timeout=900, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (row,) = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    return row


def _compilations(case: str, widths: list[int]) -> int:
    budgets = ",".join(str(w - 1) for w in widths)
    return sum(_script_row("kernel_aot.py", "--keys", budgets, "cuda:90", case)["compilations"].values())


def _build(archive: Path, cache: Path, *extra: str, log_to: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m benchmarks.warm_cache build`` into ``cache``, packed into ``archive`` (keyed for this machine's
    Triton), with ``extra`` options; ``log_to``: its compile log. Fails the test if the build fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if log_to is not None:
        env["SLAKE_TRITON_COMPILE_LOG"] = str(log_to)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.warm_cache",
            "build",
            "--out",
            str(archive),
            "--cache-dir",
            str(cache),
            *extra,
        ],  # fmt: skip
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-2000:]
    return run


def test_one_width_of_each_class_compiles_every_width_of_it():
    """The build compiles the transformers engine's step at one row width per class (:func:`width_classes`); any
    other width adds no compilation to theirs (Triton's JIT specializes it as its class's), so a layer of any width
    in the range finds its kernels in the cache."""
    lo, hi = warm_parts.MIN_WIDTH, 1100
    reps = warm_parts.width_classes(lo, hi)
    assert reps[0] == lo and len(reps) < 20
    others = random.Random(0).sample([w for w in range(lo, hi + 1) if w not in reps], 6) + [1024, 1025, 1040]
    for case in ("slake@bfloat16", "cake@bfloat16"):
        assert _compilations(case, reps + others) == _compilations(case, reps)


@pytest.mark.gpu_compile
def test_a_build_installs_where_it_was_built_and_reports_what_the_device_compiled(tmp_path):
    """A small build (SnapKV's eager step at one width, keyed for this machine's Triton) packs metadata and cubins
    only; installed for an sm_90 GPU it lands where it was built, for another GPU it is refused; the report counts
    the fused kernels that were not in it."""
    cache = tmp_path / "cache"
    archive = tmp_path / "warm.tgz"
    _build(archive, cache, "--methods", "snapkv", "--widths", "129", "--parts", "eager")
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    kernels = {n.rsplit("/", 1)[-1] for n in names if n.endswith((".cubin", ".ptx", ".llir"))}
    assert kernels == {"_append_logits_kernel.cubin", "_evict_attend_kernel.cubin"}, names
    assert warm_cache.install(archive, capability=(8, 0)) == 1
    import shutil

    shutil.rmtree(cache)
    assert warm_cache.install(archive, capability=(9, 0)) == 0
    manifest = json.loads((cache / warm_cache.MANIFEST).read_text())
    assert sorted(manifest["entries"].values()) == ["_append_logits_kernel", "_evict_attend_kernel"]
    for entry in manifest["entries"]:
        group = json.loads(next((cache / entry).glob("__grp__*.json")).read_text())
        assert all(Path(p).exists() and Path(p).parent == cache / entry for p in group["child_paths"].values())
    assert warm_cache.report(cache) == {"held": 2, "compiled_on_device": {}}
    extra = cache / "NEWENTRY"
    extra.mkdir()
    (extra / "__grp___evict_attend_kernel.json").write_text("{}")
    assert warm_cache.report(cache)["compiled_on_device"] == {"_evict_attend_kernel": 1}
    # a second call on the same machine keeps the directory, with what the device compiled into it
    assert warm_cache.install(archive, capability=(9, 0)) == 0
    assert (extra / "__grp___evict_attend_kernel.json").exists()
    # an archive keyed for another Triton (the device's wheel) is refused here
    manifest["triton_key_sha256"] = "0" * 64
    (cache / warm_cache.MANIFEST).write_text(json.dumps(manifest))
    other = tmp_path / "other.tgz"
    with tarfile.open(other, "w:gz") as tar:
        tar.add(cache, arcname=cache.name)
    assert warm_cache.install(other, capability=(9, 0)) == 1


def test_the_smoke_tests_it_compiles_are_the_ones_the_session_runs():
    """The build's smoke part runs the tests of ``tests/test_fused_decode.py`` that ``gpu_session.sh``'s smoke step
    names, with its ``-k`` expression, read from the script: each named test exists, and the expression selects
    some of them."""
    nodes, k = warm_parts.smoke_selection()
    assert len(nodes) >= 4 and all(n.startswith("tests/test_fused_decode.py::test_") for n in nodes)
    assert "slake" in k and "\\" not in k and "  " not in k
    source = (ROOT / "tests" / "test_fused_decode.py").read_text()
    for node in nodes:
        assert f"def {node.split('::')[1]}(" in source, node


@pytest.mark.gpu_compile
def test_the_smoke_part_compiles_the_fused_and_the_probe_kernels(tmp_path):
    """The smoke part (the :mod:`benchmarks.warm_smoke` plugin over the smoke step's tests) leaves the fused kernels
    and the tests' probe kernels compiled for sm_90 in the cache, though every test fails (nothing ran)."""
    archive = tmp_path / "smoke.tgz"
    run = _build(archive, tmp_path / "cache", "--parts", "smoke")
    assert "failed" in run.stdout
    with tarfile.open(archive) as tar:
        cubins = {n.rsplit("/", 1)[-1] for n in tar.getnames() if n.endswith(".cubin")}
    assert {"_append_logits_kernel.cubin", "_evict_attend_kernel.cubin", "order_kernel.cubin"} <= cubins, cubins
    manifest = json.loads((tmp_path / "cache" / warm_cache.MANIFEST).read_text())
    assert set(manifest["suffixes"]) == set(manifest["entries"])  # recorded in the tests' own process too


@pytest.mark.gpu_compile
def test_a_logged_compilation_is_compiled_again_by_the_recorded_part(tmp_path):
    """``SLAKE_TRITON_COMPILE_LOG`` logs each compilation of slake's kernels (:mod:`slake.kernels.compile_log`, as a
    GPU session does); the build's ``recorded`` part compiles the logged specializations again (Triton's
    ``preload``) into the very cache entries the launches made, and a log naming a kernel that is gone is said and
    left out."""
    log = tmp_path / "compiles.jsonl"

    def build(name: str, *extra: str, log_to: Path | None = None) -> subprocess.CompletedProcess:
        return _build(tmp_path / f"{name}.tgz", tmp_path / name, *extra, log_to=log_to)

    build("launched", "--methods", "cake", "--widths", "200", "--parts", "eager", log_to=log)
    entries = sorted(json.loads(x)["name"] for x in log.read_text().splitlines())
    assert entries == ["_append_logits_kernel", "_evict_attend_kernel"]
    with log.open("a") as f:  # a kernel that no longer exists
        f.write(json.dumps({"module": "slake.kernels.triton_decode", "name": "_gone_kernel", "specialization": "{}"}))
        f.write("\n")
    run = build("preloaded", "--parts", "recorded", "--recorded", str(log))
    assert "2 logged specializations compiled, 1 left out" in run.stdout
    launched = {p.name for p in (tmp_path / "launched").iterdir() if p.is_dir()}
    preloaded = {p.name for p in (tmp_path / "preloaded").iterdir() if p.is_dir()}
    assert launched == preloaded and len(launched) == 2
    # each entry's key suffix was recorded however it compiled (a launch, Triton's preload): install can re-key it
    for name in ("launched", "preloaded"):
        manifest = json.loads((tmp_path / name / warm_cache.MANIFEST).read_text())
        assert set(manifest["suffixes"]) == set(manifest["entries"]) == launched, name


def test_the_compile_log_keeps_slakes_kernels_once_each(tmp_path, monkeypatch):
    """:func:`slake.kernels.compile_log.record` logs the compilations of slake's kernels (and the tests' probes), not
    others' (inductor's, a user's), and :func:`~slake.kernels.compile_log.read` gives each distinct entry once."""
    from types import SimpleNamespace

    from slake.kernels import compile_log

    monkeypatch.setattr(compile_log, "_path", tmp_path / "log.jsonl")
    for module in ("slake.kernels.triton_decode", "torch._inductor.x", "slake.kernels.triton_decode"):
        compile_log.record(fn=SimpleNamespace(module=module, name="k"), compile={"specialization_data": "{}"}, key=1)
    assert compile_log.read(tmp_path / "log.jsonl") == [
        {"module": "slake.kernels.triton_decode", "name": "k", "specialization": "{}"}
    ]


@pytest.mark.gpu_compile  # the warm cache's tooling, as its builds: 48 s of the unit tier on a two-core host
def test_the_builds_steps_specialize_the_kernels_as_a_models_decode_does():
    """The build runs the engine's steps directly (``CompressedKV`` at Llama-3-8B's heads), not a model: every
    specialization of the fused kernels that a random model with those heads makes when it decodes through
    ``SlakeCache`` as ``slake bench`` does (eager, static and compiled with ``torch.compile``; SnapKV's, CAKE's and
    SLAKE's per-layer widths) is one the build's steps make at the widths' classes (``tests/warm_paths.py``:
    compiling skipped, the JIT's specializations compared). A glue that passed the kernels other strides or dtypes
    would make the cache miss on the GPU, silently but for the session's report."""
    row = _script_row("warm_paths.py", "snapkv,cake,slake")
    assert row["model"] >= 6 and len(row["widths"]) >= 3, row
    assert row["missed"] == [], row


def test_the_tuning_part_compiles_the_variants_the_session_times():
    """``kernel-tune`` and ``kernel-parts`` in ``gpu_session.sh`` time the pool's step with other launch constants
    and with parts of the second kernel left out, each a compilation of its own on the GPU: the build reads their
    commands from the script with their own parser, and every variant they name is one it steps."""
    from slake.kernels import launch_config

    runs = warm_parts.tuning_runs()
    kinds = {kind for *_, kind, _ in runs}
    assert kinds == {"tuned", "leaving_out"}
    parts = {v[0] for *_, kind, v in runs if kind == "leaving_out"}
    assert parts == set(launch_config.SKIP_PARTS)
    tuned = [dict(v) for *_, kind, v in runs if kind == "tuned"]
    assert {"HELD_ORDER": 0} in tuned and {"RECOMPUTE_BLOCK": 32} in tuned
    assert {(m, r, b) for m, r, b, *_ in runs} == {("slake", 1, 1024), ("slake", 8, 128)}


@pytest.mark.gpu_compile
def test_a_build_keyed_with_the_devices_own_key_installs_there(tmp_path):
    """A GPU session writes its machine's Triton key (``python -m benchmarks.warm_cache key``); a later build given
    it (``--key-file``) is keyed with it verbatim, no wheel needed: here the key is this machine's, so the archive
    installs here for an sm_90 GPU, and one keyed with another key is refused."""
    key_file = tmp_path / "triton_key.txt"
    run = subprocess.run([sys.executable, "-m", "benchmarks.warm_cache", "key"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=True)  # fmt: skip
    key_file.write_text(run.stdout)
    from triton.runtime.cache import triton_key

    assert run.stdout.strip() == triton_key()
    archive, cache = tmp_path / "k.tgz", tmp_path / "cache"
    _build(archive, cache, "--key-file", str(key_file), "--methods", "snapkv", "--widths", "129", "--parts", "eager")
    assert json.loads((cache / warm_cache.MANIFEST).read_text())["triton_key_sha256"] == warm_key.key_digest(
        triton_key()
    )
    assert warm_cache.install(archive, capability=(9, 0)) == 0
    key_file.write_text("3.6.0-another-machine")
    other = tmp_path / "other.tgz"
    _build(other, tmp_path / "c2", "--key-file", str(key_file), "--methods", "snapkv", "--widths", "129",
           "--parts", "eager")  # fmt: skip
    assert warm_cache.install(other, capability=(9, 0)) == 1


@pytest.mark.gpu_compile
def test_a_build_for_another_libtriton_of_the_same_triton_is_rekeyed_on_install(tmp_path):
    """The device's Triton may be another build of the same release than the one the build keyed for (PyPI's wheel,
    or PyTorch's index's): then only libtriton's hash differs in Triton's key, and install re-keys the archive's
    entries (each one's cache key less Triton's key was recorded at the build). Re-keyed, they are exactly the
    entries a build keyed for this machine makes, directory names and metadata included; a key that differs in
    another part, or a build of another ptxas, is refused."""
    from triton.runtime.cache import triton_key

    lib = warm_key.libtriton_hash()
    assert lib in triton_key()
    small = ("--methods", "snapkv", "--widths", "129", "--parts", "eager")
    here_archive, here_cache = tmp_path / "here.tgz", tmp_path / "here"
    _build(here_archive, here_cache, *small)
    here = json.loads((here_cache / warm_cache.MANIFEST).read_text())

    key_file = tmp_path / "key.txt"
    key_file.write_text(triton_key().replace(lib, "0" * 64))
    other_archive, other_cache = tmp_path / "other.tgz", tmp_path / "other"
    _build(other_archive, other_cache, "--key-file", str(key_file), *small)
    other = json.loads((other_cache / warm_cache.MANIFEST).read_text())
    assert set(other["entries"]).isdisjoint(here["entries"]) and len(other["suffixes"]) == 2
    import shutil

    shutil.rmtree(other_cache)
    assert warm_cache.install(other_archive, capability=(9, 0)) == 0
    installed = json.loads((other_cache / warm_cache.MANIFEST).read_text())
    assert installed["entries"] == here["entries"] and installed["rekeyed_from"] == other["triton_key_sha256"]
    for entry in here["entries"]:
        group = json.loads(next((other_cache / entry).glob("__grp__*.json")).read_text())
        for child, path in group["child_paths"].items():
            assert Path(path) == other_cache / entry / child
            assert Path(path).read_bytes() == (here_cache / entry / child).read_bytes(), child
    # a second call keeps it; the report counts nothing compiled on the device
    assert warm_cache.install(other_archive, capability=(9, 0)) == 0
    assert warm_cache.report(other_cache) == {"held": 2, "compiled_on_device": {}}

    # refused: a key that differs in a Python file's hash too, or a build whose ptxas differs
    parts = triton_key().split("-")
    assert warm_key.rekey_refusal(other, "-".join(parts), lib, warm_key.sm90_backend_hash()) is None
    changed = "-".join([parts[0], "f" * 64, *parts[2:]])
    assert "not only in libtriton" in warm_key.rekey_refusal(other, changed, lib, warm_key.sm90_backend_hash())
    assert "CUDA backend" in warm_key.rekey_refusal(other, triton_key(), lib, "12.0-90")
    assert "no key suffixes" in warm_key.rekey_refusal(
        {k: v for k, v in other.items() if k != "suffixes"}, triton_key(), lib, warm_key.sm90_backend_hash()
    )


@pytest.mark.gpu_compile
def test_an_archive_of_another_ptxas_is_refused_though_the_key_is_the_same(tmp_path):
    """Every entry's cache key holds the CUDA backend's hash (ptxas's version): an archive built with another ptxas
    would install and then miss every kernel; install refuses it and says why."""
    archive, cache = tmp_path / "a.tgz", tmp_path / "cache"
    _build(archive, cache, "--methods", "snapkv", "--widths", "129", "--parts", "eager")
    manifest = json.loads((cache / warm_cache.MANIFEST).read_text())
    assert manifest["backend_hash"] == warm_key.sm90_backend_hash()
    manifest["backend_hash"] = "12.0-90"
    (cache / warm_cache.MANIFEST).write_text(json.dumps(manifest))
    other = tmp_path / "other.tgz"
    with tarfile.open(other, "w:gz") as tar:
        tar.add(cache, arcname=cache.name)
    assert warm_cache.install(other, capability=(9, 0)) == 1
    assert warm_cache.install(archive, capability=(9, 0)) == 0


def test_a_logged_library_path_of_the_device_reads_this_tritons_copy(tmp_path):
    """A GPU session's compile log records libdevice at the device's path (``/opt/torch/.venv/...``); compiling the
    logged specialization here failed on the missing file (all 130 of the fourth H200 session's entries were left
    out). The path becomes this Triton's copy of the same file, which Triton keys by its contents; a path that
    exists is kept, and a specialization without libraries is left as it is."""
    device = "/opt/torch/.venv/lib/python3.12/site-packages/triton/backends/nvidia/lib/libdevice.10.bc"
    spec = {"name": "k", "options": {"extern_libs": [["libdevice", device]], "num_warps": 4}}
    local = json.loads(warm_parts.local_extern_libs(json.dumps(spec)))
    ((name, path),) = local["options"]["extern_libs"]
    assert name == "libdevice" and path != device and Path(path).is_file() and Path(path).name == "libdevice.10.bc"
    assert Path(path).is_relative_to(Path(triton.__file__).parent)
    assert local["options"]["num_warps"] == 4
    kept = tmp_path / "libdevice.10.bc"
    kept.write_bytes(b"bc")
    spec["options"]["extern_libs"] = [["libdevice", str(kept)]]
    assert json.loads(warm_parts.local_extern_libs(json.dumps(spec))) == spec
    assert json.loads(warm_parts.local_extern_libs(json.dumps({"name": "k"}))) == {"name": "k"}


def test_a_parallel_build_splits_the_eager_widths_and_runs_the_logged_part_last():
    widths = [129, 130, 144, 193, 208]
    tasks = warm_cache.parallel_tasks(("recorded", "dense", "static", "eager", "tuning"), widths, 2)
    assert tasks == [
        ("tuning", "tuning", widths),
        ("eager 1/4", "eager", [129, 208]),
        ("eager 2/4", "eager", [130]),
        ("eager 3/4", "eager", [144]),
        ("eager 4/4", "eager", [193]),
        ("dense", "dense", widths),
        ("static", "static", widths),
        ("recorded", "recorded", widths),
    ]
    assert set(warm_cache.LAST) == {"static", "recorded"}  # after the rest: they compile what the rest compiles
    assert [t[0] for t in warm_cache.parallel_tasks(("eager",), [129, 130], 1)] == ["eager"]
    assert [t[0] for t in warm_cache.parallel_tasks(("eager",), [129], 4)] == ["eager"]
    assert set(warm_cache.LONGEST_FIRST) == set(warm_parts.PARTS)


@pytest.mark.gpu_compile
def test_a_build_in_two_processes_packs_what_one_process_packs(tmp_path):
    """``--jobs 2`` compiles the same entries under the same names, each with its key suffix, as one process."""
    small = ("--methods", "snapkv", "--widths", "129,144", "--parts", "eager")
    manifests = {}
    for jobs in ("1", "2"):
        _build(tmp_path / f"{jobs}.tgz", tmp_path / f"cache{jobs}", *small, "--jobs", jobs)
        manifests[jobs] = json.loads((tmp_path / f"cache{jobs}" / warm_cache.MANIFEST).read_text())
    one, two = manifests["1"], manifests["2"]
    assert len(one["entries"]) == 4 and two["entries"] == one["entries"] and two["suffixes"] == one["suffixes"]
    assert set(two["parts"]) == {"eager 1/2", "eager 2/2"} and two["jobs"] == 2  # two widths: two pieces
