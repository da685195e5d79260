"""Audit of the attention math (:mod:`slake.attention`) and of the fidelity measures (:mod:`slake.quality`).

Each test reproduces a defect found by the audit: it failed on the code before the fix next to it.
"""

from __future__ import annotations

import math
import re
import signal

import pytest
import torch

from slake.quality import fidelity
from slake.quality.continuations import answer_continuations, text_continuations
from slake.quality.fidelity import Recording


def _late_eviction_recording(seed: int, S: int = 64, d: int = 16, H: int = 2) -> Recording:
    """One layer whose prompt keys 40..55 point away from the last queries, so that a window-8 SnapKV at budget
    ``S - 4`` evicts only tokens after the first of the 32 measured window queries (position ``S - 32``)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H, S, d, generator=g)
    k = torch.randn(1, H, S, d, generator=g) * 3
    v = torch.randn(1, H, S, d, generator=g) * 3
    qm = q[:, :, -8:].mean(2, keepdim=True)
    k[:, :, 40:56] = -4 * qm / qm.norm(dim=-1, keepdim=True) + 0.5 * torch.randn(1, H, 16, d, generator=g)
    return Recording(prompt=[(q, k, v, None, d**-0.5)], steps=[])


@pytest.mark.parametrize("seed", [15, 24, 26])
def test_a_window_query_before_every_eviction_reads_no_linear_term(seed: int) -> None:
    """A window query with every evicted token after it sees none of them (SLAKE section 3.3, PTAA with
    ``n_e = 0`` is exact softmax attention over the kept tokens).

    ``_window_attention`` subtracted those tokens from the layer's linear state, which left ``n_e = 0`` exactly but a
    float32 rounding residue in ``k_sum`` (the fold summed the rows in another order); PTAA then read
    ``mu = residue / 0 = +-inf`` and the window error was ``inf`` for about one seed in four.
    """
    from test_fidelity import _causal_window_errors

    rec = _late_eviction_recording(seed)
    row = fidelity.measure(rec, "snapkv[window=8]", 60, linear_cache=True)[0]
    want, evicted = _causal_window_errors(rec, "snapkv[window=8]", 60, True)
    assert evicted > 0
    assert math.isfinite(row["rel_err_window"])
    assert row["rel_err_window"] == pytest.approx(want[0], rel=1e-3, abs=1e-6)  # float32 against float64


class _WordTokenizer:
    """One token per whitespace-separated word (and per paragraph break), ids given in order of first sight."""

    eos_token_id = None
    chat_template = None

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.words: dict[int, str] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out = []
        for word in re.findall(r"\S+|\n\n", text):
            if word not in self.vocab:
                self.vocab[word] = len(self.vocab)
                self.words[self.vocab[word]] = word
            out.append(self.vocab[word])
        return out

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)


def _numbered_text(words: int = 3000, per_paragraph: int = 100) -> str:
    """Paragraphs of the words ``w00000x.. w02999x..``, 13 characters a word: longer than the 6 characters per token
    the window reader budgets."""
    ws = [f"w{i:05d}xxxxxx" for i in range(words)]
    return "\n\n".join(" ".join(ws[i : i + per_paragraph]) for i in range(0, words, per_paragraph))


def test_text_continuations_are_consecutive_tokens_of_the_text() -> None:
    """A continuation is the text that really follows its prompt (``docs/cli.md``, ``fidelity``'s output level).

    Where the characters read gave too few tokens, the reader appended the text's beginning after a word it had cut
    mid-text, so the prompt ended in a fragment followed by the text's first words.
    """
    tok = _WordTokenizer()
    text = _numbered_text()
    for cont in text_continuations(tok, text, 400, 100, 4, seed=1):
        numbers = [int(tok.words[i][1:6]) for i in cont.prompt_ids + cont.target_ids if tok.words[i] != "\n\n"]
        assert len(numbers) >= 490
        jumps = [(a, b) for a, b in zip(numbers, numbers[1:]) if b != (a + 1) % 3000]
        assert jumps == [], cont.name
        assert all(len(tok.words[i]) in (2, 12) for i in cont.prompt_ids + cont.target_ids)  # no cut word


def test_a_question_the_model_never_answers_does_not_stop_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt answered by an immediate end-of-sequence is replaced by another (``answer_continuations``).

    The search gave up after ``samples + 2 * len(questions)`` prompts in all, answered or not, saying "the model ends
    its answer at once on every prompt": with one question of three never answered, 20 samples stopped after 18.
    """
    import slake.engines.transformers.prefill_once as prefill_once

    tok = _WordTokenizer()
    mute = tok.encode("never-answered?")[0]

    class _Capture:
        def __init__(self, ids: torch.Tensor) -> None:
            self.ids = ids[0].tolist()

        def replay(self, *args: object) -> None:
            return None

    def greedy(model: object, cap: _Capture, cache: None, tokens: int, eos: list[int]) -> list[list[int]]:
        return [[1]] if mute in cap.ids else [[1, 2, 3][:tokens]]

    monkeypatch.setattr(prefill_once, "capture_prefill", lambda model, ids: _Capture(ids))
    monkeypatch.setattr(prefill_once, "greedy_decode", greedy)
    model = type("Model", (), {"device": torch.device("cpu")})()
    questions = ("What?", "never-answered?", "Who?")
    out = answer_continuations(model, tok, _numbered_text(), 64, 3, 20, questions)
    assert len(out) == 20 and all(len(c.target_ids) == 3 for c in out)
    assert all(mute not in c.prompt_ids for c in out)
    with pytest.raises(ValueError, match="at once"):  # a model that answers nothing is still refused
        answer_continuations(model, tok, _numbered_text(), 64, 3, 2, ("never-answered?",))


def test_a_text_the_tokenizer_reads_nothing_of_is_refused_not_looped_on() -> None:
    """A text that gives no token (a tokenizer that drops its characters) made the window reader loop for ever."""

    class _Blind(_WordTokenizer):
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return []

    def stuck(*_: object) -> None:  # the old loop never ends: fail the test rather than hang the suite
        raise TimeoutError("text_continuations still looping after 30 s")

    previous = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(30)
    try:
        with pytest.raises(ValueError, match="fewer than"):
            text_continuations(_Blind(), "some text\n\nmore text", 8, 4, 1)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_recording_without_decode_steps_reports_no_decode_error_rather_than_zero() -> None:
    """``rel_err`` is the mean over the recording's decode steps; with none it was 0.0, a perfect score for what was
    not measured. NaN now; the window error is measured as before."""
    rows = fidelity.measure(_late_eviction_recording(15), "snapkv[window=8]", 60, window=8)
    assert rows and all(math.isnan(r["rel_err"]) for r in rows)
    assert all(math.isfinite(r["rel_err_window"]) for r in rows)
