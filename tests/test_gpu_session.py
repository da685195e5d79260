"""``benchmarks/gpu_session.sh``, the prepared calls of a GPU session (``docs/gpu.md``): what it names exists and is
valid, so that a rare, short session does not lose a measurement to a typo found only on the GPU machine."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from benchmarks.__main__ import parse_variants
from slake.kernels import launch_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_test_the_smoke_step_names_exists():
    """The smoke step runs named tests (``tests/x.py::name``): each file and test function exists."""
    text = SCRIPT.read_text()
    named = re.findall(r"(tests/[\w/]+\.py)::(\w+)", text)
    assert len(named) >= 4
    for path, name in named:
        source = (ROOT / path).read_text()
        assert re.search(rf"^def {name}\(", source, re.M), f"{path}::{name} is not a test there"


def test_every_kernel_tune_variant_is_a_valid_launch_constant():
    """The ``--variants`` of ``kernel-tune`` parse, and ``launch_config.tuned`` accepts each (which it checks)."""
    text = SCRIPT.read_text()
    chunks = re.findall(r'--variants "([^"]+)"', text)
    assert chunks
    for chunk in chunks:
        for variant in parse_variants(chunk):
            with launch_config.tuned(**variant):
                assert all(int(getattr(launch_config, k)) == v for k, v in variant.items())


def _command_lines(text: str) -> list[str]:
    """The script's command lines (continuation lines joined, comments left out)."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_every_command_the_script_runs_parses(tmp_path):
    """Each ``python -m benchmarks ...`` and ``slake bench ...`` line of the script, with its options as written,
    is accepted by its command's parser: an option misspelt or renamed would otherwise be found only on the GPU
    machine, and cost a short session that step."""
    import shlex

    from benchmarks.__main__ import parser as benchmarks_parser
    from slake.cli import build_parser

    text = SCRIPT.read_text()
    bench = re.search(r"^bench=\((.*)\)$", text, re.M)
    assert bench is not None
    bench_args = shlex.split(bench.group(1))
    assert bench_args[:3] == ["$py", "-m", "slake.cli"]
    parsed = {"benchmarks": 0, "bench": 0}
    for line in _command_lines(text):
        m = re.search(r'"\$py" -m benchmarks (.*)', line) or re.search(r'"\$\{bench\[@\]\}" (.*)', line)
        if m is None:
            continue
        words = shlex.split(m.group(1).replace("$out", str(tmp_path)))
        if ">" in words:  # the rows' file
            words = words[: words.index(">")]
        kind = "benchmarks" if "benchmarks" in m.group(0) else "bench"
        try:
            if kind == "benchmarks":
                benchmarks_parser().parse_args(words)
            else:
                build_parser().parse_args(bench_args[3:] + words)
        except SystemExit:
            pytest.fail(f"its parser rejects: {line}")
        parsed[kind] += 1
    assert parsed["benchmarks"] >= 10 and parsed["bench"] >= 8, parsed


def test_the_warm_cache_commands_parse():
    """The script installs Triton's cache built without a GPU and reports on it (``benchmarks/warm_cache.py``): its
    commands, as written, are accepted by that module's parser."""
    import shlex

    from benchmarks.warm_cache import parser

    # the words up to the end of a command substitution, a redirection or the line
    lines = re.findall(r'"\$py" -m benchmarks\.warm_cache ([^)>\n]*)', SCRIPT.read_text())
    assert len(lines) >= 3, lines
    for words in lines:
        try:
            parser().parse_args(shlex.split(words.replace("$TRITON_CACHE_DIR", "/tmp/x")))
        except SystemExit:
            pytest.fail(f"its parser rejects: {words}")


def test_the_sanitize_part_unpacks_the_carried_wheel_and_runs_each_tool(tmp_path):
    """``sanitize`` with a stand-in for NVIDIA's wheel (the tool's layout: ``compute-sanitizer/compute-sanitizer``
    beside its launcher, modes in the zip): unpacked with its modes, run once per tool with the tests it names, and
    each exit status logged. The stand-in records its arguments and environment instead of running the tests."""
    import os
    import zipfile

    fake = "\n".join([
        "#!/bin/sh",
        'echo "$PYTORCH_NO_CUDA_MEMORY_CACHING $*" >> "$SANITIZER_CALLS"',
        '[ "$1" = --version ] && echo "Version 0"',
        "exit 0",
    ])  # fmt: skip
    cache = tmp_path / ".warm-cache"
    cache.mkdir()
    with zipfile.ZipFile(cache / "nvidia_cuda_sanitizer_api-0.0-py3-none-any.whl", "w") as wheel:
        for name, text in (("nvidia/cu13/compute-sanitizer/compute-sanitizer", fake),
                           ("nvidia/cu13/compute-sanitizer/TreeLauncherSubreaper", "#!/bin/sh\n")):  # fmt: skip
            info = zipfile.ZipInfo(name)
            info.external_attr = 0o755 << 16
            wheel.writestr(info, text)
    calls = tmp_path / "calls.txt"
    env = dict(os.environ, SANITIZER_DIR=str(tmp_path / "unpacked"), SANITIZER_CALLS=str(calls), SANITIZE_SECONDS="30")
    run = subprocess.run(["bash", str(SCRIPT), "sanitize", str(tmp_path / "out")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert os.access(tmp_path / "unpacked/nvidia/cu13/compute-sanitizer/TreeLauncherSubreaper", os.X_OK)
    lines = calls.read_text().splitlines()
    assert lines[0].endswith("--version")
    tools = [re.search(r"--tool (\w+)", line).group(1) for line in lines[1:]]
    assert tools == ["memcheck", "initcheck", "synccheck", "racecheck"]
    for line in lines[1:]:
        assert line.startswith("1 ") and "-m pytest" in line  # the caching allocator off, the tests as the target
    assert "test_fused_pool_step_equals_the_torch_pool_step" in lines[1] and "[slake]" in lines[3]
    log = (tmp_path / "out" / "sanitize.log").read_text()
    assert log.count(": exit 0 ") == 4, log
    # without a carried wheel the part says what to carry and fails
    (cache / "nvidia_cuda_sanitizer_api-0.0-py3-none-any.whl").unlink()
    env["SANITIZER_DIR"] = str(tmp_path / "elsewhere")
    run = subprocess.run(["bash", str(SCRIPT), "sanitize", str(tmp_path / "out2")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert run.returncode != 0 and "make sanitizer-wheel" in run.stdout
