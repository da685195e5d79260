"""What a user who installs slake from its wheel meets (the 2026-11-30, thirty-fifth session's packaging audit).

Without matplotlib (not a required dependency), ``slake bench`` and ``slake fidelity --out`` measured everything,
wrote their rows, then ended in a traceback (exit 1; ``bench --json`` printed nothing); ``slake fidelity`` had no
``--no-plots``. A Chinese LongBench dataset without jieba ended in a traceback instead of the one-line refusal (exit
2). The declared floors of gguf and accelerate could not load the default GGUF model, torch's was below what
transformers accepts, and ``make test-oldest`` tried only transformers' floor. No license file shipped.
"""

from __future__ import annotations

import json
import re
import sys
import tomllib
from pathlib import Path

import pytest

from slake.cli import main
from slake.optional_plots import draw_if_possible
from slake.release import release as _release

ROOT = Path(__file__).parents[1]


@pytest.fixture
def no_matplotlib(monkeypatch):
    """An installation without matplotlib: importing it fails as it would (ModuleNotFoundError naming it)."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_draw_if_possible_skips_only_a_missing_matplotlib(no_matplotlib, capsys):
    def draw():
        import matplotlib  # noqa: F401

        return ["plot.png"]

    assert draw_if_possible("slake test", draw) is None
    err = capsys.readouterr().err
    assert "slake test: no plots" in err and "pip install 'slake[eval]'" in err

    def broken():
        import slake_no_such_module  # noqa: F401

    with pytest.raises(ImportError):  # another missing module is a bug, not an optional plot
        draw_if_possible("slake test", broken)
    assert draw_if_possible("slake test", lambda: 3) == 3


def test_bench_without_matplotlib_succeeds_with_its_rows(no_matplotlib, tmp_path, capsys):
    argv = ["bench", "--methods", "full", "--lengths", "48", "--random-model", "tiny", "--device", "cpu"]
    argv += ["--decode-steps", "1", "--warmup", "0", "--no-progress", "--json", "--out", str(tmp_path / "b")]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1])["rows"]
    assert "slake bench: no plots" in captured.err and "pip install 'slake[eval]'" in captured.err
    assert (tmp_path / "b" / "bench.jsonl").exists() and not list((tmp_path / "b").glob("*.png"))


def test_fidelity_without_matplotlib_writes_its_tables_and_takes_no_plots(no_matplotlib, llama_gqa, tmp_path,
                                                                          monkeypatch, capsys):  # fmt: skip
    from slake.cli.fidelity import cmd_fidelity
    from slake.engines.transformers import models
    from test_fidelity_fixes import _args, _Tokenizer

    monkeypatch.setattr(models, "load_model", lambda *a, **k: (llama_gqa, _Tokenizer()))
    prompt = tmp_path / "doc.txt"
    prompt.write_text(" ".join(f"w{i}" for i in range(100)))
    common = ["--prompt-file", str(prompt), "--methods", "snapkv", "--budgets", "40", "--length", "120"]
    common += ["--steps", "1", "--output-tokens", "2", "--output-samples", "1", "--no-progress"]
    assert cmd_fidelity(_args(*common, "--out", str(tmp_path / "f"))) == 0
    err = capsys.readouterr().err
    assert err.count("slake fidelity: no plots") == 2  # the per-layer plot and the output-level one
    assert (tmp_path / "f" / "fidelity.md").exists() and not list((tmp_path / "f").glob("*.png"))
    assert cmd_fidelity(_args(*common, "--out", str(tmp_path / "g"), "--no-plots")) == 0
    assert "no plots" not in capsys.readouterr().err  # asked for none: nothing to say
    assert (tmp_path / "g" / "fidelity.json").exists()


def test_a_chinese_dataset_without_jieba_is_one_line_and_exit_2(monkeypatch, tmp_path, capsys):
    import slake.eval.metrics as m
    from test_cli_input_refusals import _refused

    monkeypatch.setattr(m, "_jieba", None)
    argv = ["eval", "--suite", "longbench", "--tasks", "multifieldqa_zh", "--methods", "snapkv", "--budgets", "64"]
    argv += ["--longbench-dir", str(tmp_path), "--out", str(tmp_path / "o")]
    monkeypatch.setattr("slake.cli.eval.engine_from_args", lambda args: _NoLoadEngine())
    _refused(argv, "multifieldqa_zh: ", capsys)


class _NoLoadEngine:
    """An engine that accepts every option and never loads a model."""

    name = "transformers"
    unsupported: dict = {}
    tokenizer = None

    def check(self, **options):
        pass

    def check_pair(self, method, budget):
        pass


def _floors() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    out = {}
    for req in project["dependencies"]:
        name, floor = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+).*", req).groups()
        out[name.lower()] = floor
    return out


def _same_release(a: str, b: str) -> bool:
    """``5.17.0`` and ``5.17`` are one release."""
    x, y = list(_release(a)), list(_release(b))
    while x and x[-1] == 0:
        x.pop()
    while y and y[-1] == 0:
        y.pop()
    return x == y


def test_declared_floors_are_the_versions_that_load_the_default_model():
    """gguf below 0.17.1 imports sentencepiece without declaring it; transformers wants accelerate >= 1.1 to load a
    GGUF file and turns torch off below 2.6 (transformers 5.24)."""
    floors = _floors()
    assert _release(floors["gguf"]) >= (0, 17, 1)
    assert _release(floors["accelerate"]) >= (1, 1)
    assert _release(floors["torch"]) >= (2, 6)


def test_the_oldest_environment_pins_every_floor_it_can_install():
    """``make setup-oldest`` installs the declared floors (torch aside: its floor on PyPI is a CUDA build of GBs),
    so that ``make test-oldest`` tries the versions pyproject.toml promises."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    (pins,) = re.findall(r"^OLDEST_PINS \?= (.*)$", makefile, re.M)
    assert "$(OLDEST_PINS)" in makefile[makefile.index("$(OBIN)/.slake-oldest:") :].split("\n\n")[0]
    pinned = dict(pin.split("==") for pin in pins.split())
    for name, floor in _floors().items():
        if name != "torch":
            assert name in pinned, f"setup-oldest does not pin {name}"
            assert _same_release(pinned[name], floor), f"setup-oldest pins {name}=={pinned[name]}, the floor is {floor}"


def test_the_license_the_metadata_names_ships():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
