"""Prompts with continuations for output-level fidelity (:mod:`slake.quality.output_fidelity`) and calibration.

Two kinds, both from real text:

* ``"text"``: a window of ``length`` tokens of a long text, continued by the ``T`` tokens that really follow it
  (plain language modelling, no chat template);
* ``"answer"``: a window of text followed by a question, in the model's chat template, continued by the full
  cache's own greedy answer (``T`` tokens at most, end-of-sequence included).

Text sources: :func:`evaluation_text` (the Paul Graham essays that the evaluation suites use, for ``slake
fidelity``) and :func:`calibration_text` (the Python language reference shipped with every CPython as
``pydoc_data.topics``: real English prose with code, and text that no evaluation suite of ours uses, so that a
calibration never sees the data it is judged on).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from slake.quality.output_fidelity import Continuation

__all__ = [
    "calibration_text",
    "evaluation_text",
    "text_continuations",
    "answer_continuations",
    "CALIBRATION_QUESTIONS",
    "EVALUATION_QUESTIONS",
]

#: questions appended to calibration prompts (answered by the full cache; its answer is the target)
CALIBRATION_QUESTIONS = (
    "Which Python statements or constructs does the documentation above describe? Name the first three.",
    "Summarize the last section of the documentation above in two sentences.",
    "What does the documentation above say about exceptions? Answer briefly.",
)
#: questions appended to ``slake fidelity``'s answer prompts
EVALUATION_QUESTIONS = (
    "What is the main argument of the essay above? Answer in two sentences.",
    "Which people or companies does the text above mention? List the first three.",
    "Summarize the last paragraph of the text above in one sentence.",
)


def calibration_text() -> str:
    """The Python language reference (``pydoc_data.topics``, part of CPython), topics in sorted order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def evaluation_text() -> str:
    """The essays of the evaluation suites, concatenated (see :mod:`slake.eval.data_sources`)."""
    from slake.eval.data_sources import paul_graham_essays

    return "\n\n".join(paul_graham_essays())


#: tokens read past a window's end, so that a word cut where the text is cut never reaches the window
_CUT_MARGIN = 16


def _window(tokenizer: Any, text: str, rng: random.Random, n_tokens: int) -> list[int]:
    """``n_tokens`` consecutive token ids of ``text`` from a seeded paragraph start (wrapping around the text)."""
    starts = [0] + [i + 2 for i in range(len(text) - 2) if text[i : i + 2] == "\n\n"]
    start = rng.choice(starts[:-1] or starts)
    chars = n_tokens * 6 + 1000  # generous: a token is rarely longer than 6 characters of English/code
    source = text[start:]
    for _ in range(12):  # then over 24,000 characters a token: the tokenizer reads (almost) nothing of the text
        while len(source) < chars:  # past the text's end (or a short text): wrap around to its beginning
            source += "\n\n" + text
        ids = list(tokenizer.encode(source[:chars], add_special_tokens=False))
        # the last few tokens may be a word cut at ``chars``; a shorter encoding reads further along ``source``
        # (appending the text after the cut put its beginning after a word cut mid-text)
        if len(ids) >= n_tokens + _CUT_MARGIN:
            return ids[:n_tokens]
        chars *= 2
    raise ValueError(f"{chars // 2} characters of the text gave {len(ids)} tokens, fewer than {n_tokens}")


def text_continuations(
    tokenizer: Any, text: str, length: int, target_tokens: int, samples: int, *, seed: int = 0, name: str = "text"
) -> list[Continuation]:
    """``samples`` windows of ``length`` tokens of ``text``, each continued by the next ``target_tokens`` tokens.

    Raises
    ------
    ValueError
        For ``length < 1``, ``target_tokens < 2``, ``samples < 1`` or an empty text.
    """
    if length < 1 or target_tokens < 2 or samples < 1:
        raise ValueError(
            f"need length >= 1, target_tokens >= 2 and samples >= 1 (got {length}, {target_tokens}, {samples})"
        )
    if not text.strip():
        raise ValueError("the source text is empty")
    rng = random.Random(f"{name}-{seed}")
    out = []
    for i in range(samples):
        ids = _window(tokenizer, text, rng, length + target_tokens)
        out.append(Continuation("text", f"{name}-{length}-{seed}-{i}", ids[:length], ids[length:]))
    return out


def answer_continuations(
    model: Any,
    tokenizer: Any,
    text: str,
    length: int,
    target_tokens: int,
    samples: int,
    questions: Sequence[str],
    *,
    seed: int = 0,
    name: str = "answer",
) -> list[Continuation]:
    """``samples`` prompts (about ``length`` tokens of ``text`` + a question, in the chat template, or as plain text
    after the tokenizer's BOS when it has none), each continued by the full cache's greedy answer (at most
    ``target_tokens`` tokens, end-of-sequence included).

    A prompt the model answers with an immediate end-of-sequence is replaced by another (the next question).

    Raises
    ------
    ValueError
        For ``length < 64``, ``target_tokens < 2``, ``samples < 1``, no question or an empty text, and when
        ``samples + 2 * len(questions)`` prompts in a row were answered at once (a model that answers nothing).
    """
    from slake.engines.transformers.generate import format_prompt, uses_chat_template
    from slake.engines.transformers.prefill_once import capture_prefill, greedy_decode

    plain = not uses_chat_template(tokenizer)  # a prompt without the chat template gets the tokenizer's BOS

    if length < 64 or target_tokens < 2 or samples < 1 or not questions:
        raise ValueError(
            f"need length >= 64, target_tokens >= 2, samples >= 1 and a question (got {length}, "
            f"{target_tokens}, {samples})"
        )
    if not text.strip():
        raise ValueError("the source text is empty")
    rng = random.Random(f"{name}-{seed}")
    eos = [i for i in (getattr(tokenizer, "eos_token_id", None),) if isinstance(i, int)]
    out: list[Continuation] = []
    tries = silent = 0  # prompts drawn; of them the last ones answered at once, in a row
    while len(out) < samples:
        question = questions[tries % len(questions)]
        tries += 1
        overhead = len(tokenizer.encode(format_prompt(tokenizer, "\n\n" + question), add_special_tokens=plain))
        body = tokenizer.decode(_window(tokenizer, text, rng, max(length - overhead, 16)))
        prompt = format_prompt(tokenizer, body + "\n\n" + question)
        ids = list(tokenizer.encode(prompt, add_special_tokens=plain))
        cap = capture_prefill(model, torch.tensor([ids], device=model.device))
        answer = greedy_decode(model, cap, cap.replay("full", 1), target_tokens, eos)[0]
        if len(answer) >= 2:  # an immediate end-of-sequence says nothing about the cache: draw another prompt
            out.append(Continuation("answer", f"{name}-{length}-{seed}-{len(out)}", ids, answer))
            silent = 0
            continue
        silent += 1  # give up on a model that answers nothing, not on one that skips some question
        if silent >= samples + 2 * len(questions):
            raise ValueError(
                f"the model ended its answer at once on the last {silent} prompts ({len(out)} of {samples} answers "
                f"drawn); use text continuations instead"
            )
    return out
