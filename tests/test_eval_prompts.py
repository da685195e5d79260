"""Prompt building: chat template, query-aware and question-agnostic layouts."""

from __future__ import annotations

import pytest

from slake.eval.prompts import build_messages, build_prompt
from slake.eval.sample import Sample

try:
    from test_eval_support import WordTokenizer
except ImportError:  # pragma: no cover
    from tests.test_eval_support import WordTokenizer


def sample(**kw) -> Sample:
    base = dict(
        task="t",
        context="Instruction.\n\nLong text here.\n\n",
        question="What is it?",
        answers=["x"],
        metric="all",
        max_new_tokens=8,
        answer_prefix=" Answer:",
    )
    base.update(kw)
    return Sample(**base)


def test_plain_layout():
    s = sample()
    assert build_prompt(s, None) == s.context + s.question + s.answer_prefix
    assert build_prompt(s, WordTokenizer(chat=False)) == s.context + s.question + s.answer_prefix
    ctx, q = build_prompt(s, None, query_aware=False)
    assert ctx == s.context and q == s.question + s.answer_prefix


def test_chat_layout_and_split():
    tok = WordTokenizer(chat=True)
    s = sample()
    full = build_prompt(s, tok)
    assert full == "<|user|>\nInstruction.\n\nLong text here.\n\nWhat is it?<|end|>\n<|assistant|>\n Answer:"
    ctx, q = build_prompt(s, tok, query_aware=False)
    assert ctx + q == full
    assert ctx.endswith("Long text here.\n\n") and q.startswith("What is it?")
    assert build_prompt(s, tok, chat_template=False) == s.context + s.question + s.answer_prefix


def test_chat_split_with_empty_question_and_system():
    tok = WordTokenizer(chat=True)
    s = sample(question="", answer_prefix="")
    ctx, q = build_prompt(s, tok, query_aware=False, system="Be brief.")
    assert ctx.startswith("<|system|>\nBe brief.<|end|>\n<|user|>\nInstruction.")
    assert ctx.endswith("Long text here.") and q == "<|end|>\n<|assistant|>\n"
    assert build_messages(s, "Be brief.")[0] == {"role": "system", "content": "Be brief."}


def test_template_that_rewrites_content_is_rejected():
    class Upper(WordTokenizer):
        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            return messages[-1]["content"].upper()

    with pytest.raises(ValueError):
        build_prompt(sample(), Upper(chat=True), query_aware=False)
