"""Review of 2026-12-01's commits; each test failed before its fix.

* The time left (:class:`slake.eval.progress.TimeLeft`) was given once one output of every prompt was done, which
  stands for the rest only on an engine that runs each pair over every prompt (vLLM). The transformers engine
  prefills a prompt (or a batch of them) once and replays every pair from it, so where one batch covers every pending
  prompt (``batch_size`` >= the prompts, or a run of one prompt) its first outputs carry every prefill and the
  estimate was several times too long, the error the readiness rule was meant to end. Now an engine that prefills
  once (``Engine.prefills_once``) gets an estimate only once a whole prompt is done.
"""

from __future__ import annotations

import pytest

from slake.engines.base import EvalRequest
from slake.eval import runner
from slake.eval.needle import needle_grid
from slake.eval.progress import TimeLeft
from slake.eval.runner import run_suite
from test_eval_runner import ESSAYS, TinyTokenizer


class _Recording(TimeLeft):
    """The estimate after every output (None: not given yet)."""

    seen: list[float | None] = []

    def update(self, key: int) -> None:
        super().update(key)
        _Recording.seen.append(self.seconds_left())


@pytest.fixture(scope="module")
def tok():
    return TinyTokenizer()


@pytest.mark.parametrize("n_samples, batch_size", [(1, 1), (2, 2)])
def test_time_left_of_the_transformers_engine_waits_for_a_whole_prompt(
    llama_gqa, tok, tmp_path, monkeypatch, n_samples, batch_size
):
    samples = needle_grid(tok, [200], [0, 100], seed=1, essays=ESSAYS, max_new_tokens=2)[:n_samples]
    monkeypatch.setattr(runner, "TimeLeft", _Recording)
    _Recording.seen = []
    kw = dict(suite="needle", model_name="tiny", max_new_tokens=2, progress=False, batch_size=batch_size)
    rows = run_suite(llama_gqa, tok, samples, ["snapkv"], [40, 64], tmp_path, **kw)
    assert len(rows) == 3 * n_samples  # full, snapkv 40, snapkv 64: pair by pair over the batch
    # every output before the last pair's carries a share of the prefill: no estimate from them
    assert _Recording.seen[: 2 * n_samples] == [None] * (2 * n_samples)
    assert _Recording.seen[-1] == 0.0


def test_time_left_of_an_engine_that_runs_pairs_over_all_prompts_is_unchanged():
    now = [0.0]
    reqs = [
        EvalRequest(key=k, prefill_ids=[1] * 100, question_ids=[], max_new_tokens=1, group="a", pairs=(("a", 1),) * 2)
        for k in range(2)
    ]
    left = TimeLeft(reqs, clock=lambda: now[0])
    now[0] = 10.0
    left.update(0)
    left.update(1)
    assert left.seconds_left() == pytest.approx(10.0)
    whole = TimeLeft(reqs, clock=lambda: now[0], whole_prompts=True)
    whole.update(0)
    whole.update(1)
    assert whole.seconds_left() is None
    whole.update(0)
    assert whole.seconds_left() is not None
