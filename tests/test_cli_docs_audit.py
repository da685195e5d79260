"""The documentation covers what a user can call: every option of every ``slake`` subcommand is documented under that
command in ``docs/cli.md`` (its synopsis lines in the ``## Commands`` block, or its ``* **`command`**`` paragraph;
the shared model options in the page's opening paragraph), and every name of ``slake.__all__`` is named in the README
or ``docs/`` and, where it is a class or function, has a docstring, as has every class and function a module of slake
exports and each public method of those classes (a docstring inherited from a base class counts).

The other direction (every flag the docs name exists, every documented command parses) is
``tests/test_docs_commands.py``'s; nothing here loads a model."""

from __future__ import annotations

import argparse
import inspect
import re
from pathlib import Path

import pytest

import slake
from public_docs import undocumented
from slake.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
CLI_MD = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")

SUBPARSERS: dict[str, argparse.ArgumentParser] = next(
    a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
).choices
#: options every model-loading command shares, documented once at the top of docs/cli.md
SHARED = ("--model", "--gguf-file", "--device", "--dtype")


def _mentions(text: str, flag: str) -> bool:
    return re.search(re.escape(flag) + r"(?![\w-])", text) is not None


def command_text(doc: str, sub: str) -> str:
    """What ``doc`` (docs/cli.md) says under ``sub``: its synopsis lines and its paragraph."""
    block = doc.split("## Commands", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    synopsis, current = [], None
    for line in block.splitlines():
        m = re.match(r"slake ([\w-]+)", line)
        if m:
            current = m.group(1)
        if current == sub:
            synopsis.append(line)
    m = re.search(rf"^\* \*\*`{re.escape(sub)}`\*\*(.*?)(?=^\S)", doc, re.S | re.M)
    return "\n".join(synopsis) + "\n" + (m.group(1) if m else "")


def undocumented_options(doc: str) -> list[str]:
    """``sub --flag`` for every long option of a subcommand that ``doc`` does not name under that subcommand."""
    intro = doc.split("## Commands", 1)[0]
    missing = [f"(intro) {flag}" for flag in SHARED if not _mentions(intro, flag)]
    for sub, parser in SUBPARSERS.items():
        text = command_text(doc, sub)
        for action in parser._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help" and flag not in SHARED and not _mentions(text, flag):
                    missing.append(f"{sub} {flag}")
    return missing


def test_every_option_is_documented_under_its_command():
    missing = undocumented_options(CLI_MD)
    assert not missing, f"options docs/cli.md does not document under their command: {missing}"


def test_the_check_notices_a_removed_option():
    """The check above is not vacuous: dropping one option's mention from a command's synopsis is caught."""
    doc = CLI_MD.replace("[--decode-steps 32] ", "", 1)
    assert doc != CLI_MD
    assert undocumented_options(doc) == ["bench --decode-steps"]


def _docs_text() -> str:
    docs = ROOT / "docs"
    paths = [ROOT / "README.md", *sorted(docs.glob("*.md")), *sorted((docs / "methods").glob("*.md"))]
    return "\n".join(p.read_text(encoding="utf-8") for p in paths if p.name != "gpu-log.md")


@pytest.mark.parametrize("name", slake.__all__)
def test_public_name_is_documented(name: str):
    assert re.search(rf"`(?:slake\.)?{re.escape(name)}[`(.\[]", _docs_text()), f"slake.{name} is named in no doc"
    value = getattr(slake, name)
    if inspect.isclass(value) or inspect.isfunction(value):
        assert inspect.getdoc(value), f"slake.{name} has no docstring"


def test_every_exported_name_and_public_method_has_a_docstring():
    # the transformers cache layers' overrides of CacheLayerMixin (whose own methods have none) had no docstring; the
    # vLLM plugin's modules import vLLM and are checked by tests_vllm/test_plugin_docs.py
    assert not undocumented("slake.", leave_out=(".vllm.plugin", "__main__"))
