"""Fixes from the 2026-12-02 audit of ``slake bench``'s numbers and notes.

``bench.md``'s peak-memory note said the CPU high-water mark was "reset per configuration via /proc/self/clear_refs"
whatever the rows' ``peak_mem_reset`` said: where the mark cannot be reset (not Linux, no permission) it only grows
over the run, and the note then described a number the table did not hold. Its roofline note listed the bytes a step
reads without the hybrid model's sliding-window layers, which ``roofline_bytes`` counts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from slake.engines.base import BenchPlan, ModelSpec
from slake.engines.transformers import bench
from slake.engines.transformers.memory import MemoryMeter
from slake.engines.transformers.shapes import random_model


def _bench_md(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, reset_ok: bool, shape: str = "tiny") -> str:
    """``bench.md`` of a tiny run whose CPU high-water mark can (``reset_ok``) or cannot be reset.

    Parameters
    ----------
    tmp_path : Path
        The run's output folder.
    monkeypatch : pytest.MonkeyPatch
        Makes the meter's reset fail when ``reset_ok`` is False.
    reset_ok : bool
        Whether the meter's reset works.
    shape : str
        The random model's shape.

    Returns
    -------
    str
        The text of ``bench.md``.
    """
    if not reset_ok:
        original = MemoryMeter.reset

        def failing_reset(self: MemoryMeter) -> None:
            original(self)
            self.reset_ok = False  # as where /proc/self/clear_refs cannot be written

        monkeypatch.setattr(MemoryMeter, "reset", failing_reset)
    model = random_model(shape)
    plan = BenchPlan(
        methods=("full",), budgets=(16,), lengths=(40,), out=tmp_path, decode_steps=1, warmup=0, plots=False,
        progress=False,
    )  # fmt: skip
    report = bench.run_bench(plan, ModelSpec(random=shape), f"random:{shape}", lambda: model)
    assert all(r["peak_mem_reset"] is reset_ok for r in report.rows)
    return (tmp_path / "bench.md").read_text(encoding="utf-8")


def _note(text: str, start: str) -> str:
    """The note of ``bench.md`` that starts with ``start``."""
    return next(line for line in text.splitlines() if line.startswith(f"- {start}"))


def test_the_peak_note_does_not_claim_a_reset_the_rows_did_not_have(tmp_path: Path, monkeypatch) -> None:
    note = _note(_bench_md(tmp_path, monkeypatch, reset_ok=False), "peak memory")
    assert "reset per configuration" not in note
    assert "peak_mem_reset" in note and "--isolate" in note


def test_the_peak_note_says_reset_where_every_row_was_reset(tmp_path: Path, monkeypatch) -> None:
    if not MemoryMeter.available():
        pytest.skip("this machine cannot reset its high-water mark")
    note = _note(_bench_md(tmp_path, monkeypatch, reset_ok=True), "peak memory")
    assert "reset per configuration" in note


def test_the_roofline_note_names_the_sliding_layers_it_counts(tmp_path: Path, monkeypatch) -> None:
    text = _bench_md(tmp_path, monkeypatch, reset_ok=True, shape="tiny-hybrid")
    assert "sliding-window layers" in _note(text, "x roofline")


def test_a_model_whose_every_layer_slides_is_refused_before_any_row(tmp_path: Path) -> None:
    """Every layer of a Mistral with ``sliding_window=16`` slides, and slake compresses full-attention layers only:
    the attention function refused the step that crossed the window, once the ``transformers`` row had been timed,
    and that length's rows were never written. Now refused before any row, naming the options; a length whose rows
    stay within the window runs."""
    shape = "mistral-7b:num_hidden_layers=1,hidden_size=64,intermediate_size=128,num_attention_heads=2,"
    shape += "num_key_value_heads=1,vocab_size=256,sliding_window=16"
    model = random_model(shape)
    measured: list = []
    plan = BenchPlan(
        methods=("transformers", "snapkv[window=4]"), budgets=(8,), lengths=(24,), out=tmp_path, decode_steps=2,
        warmup=1, plots=False, progress=False,
    )  # fmt: skip
    from slake.engines.transformers import measure

    real = measure.measure

    def counting(*args: object, **kwargs: object) -> dict:
        measured.append(args)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(measure, "measure", counting)
        with pytest.raises(ValueError, match="--lengths 24 with --warmup 1 and --decode-steps 2.*full-attention"):
            bench.run_bench(plan, ModelSpec(random=shape), f"random:{shape}", lambda: model)
    assert measured == [] and not (tmp_path / "bench.jsonl").exists()
    short = BenchPlan(
        methods=("snapkv[window=4]",), budgets=(8,), lengths=(12,), out=tmp_path / "short", decode_steps=2, warmup=1,
        plots=False, progress=False,
    )  # fmt: skip
    assert bench.run_bench(short, ModelSpec(random=shape), f"random:{shape}", lambda: model).rows
