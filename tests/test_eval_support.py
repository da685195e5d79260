"""Shared helpers for the evaluation tests: a tiny tokenizer and synthetic corpora.

Other ``test_eval_*`` files import this module; its own tests check the helpers.
"""

from __future__ import annotations

import random
import re

from slake.eval.data_sources import QARecord
from slake.eval.vocab import BASIC_WORDS

_PIECE = re.compile(r"\w+|[^\w\s]|\s+")


class WordTokenizer:
    """Word/punctuation tokenizer with a growing vocabulary; whitespace runs are tokens too,
    so ``decode(encode(text)) == text`` exactly.  ``chat=True`` adds a toy chat template."""

    def __init__(self, chat: bool = False) -> None:
        self._ids: dict[str, int] = {}
        self._pieces: list[str] = []
        self.chat = chat
        self.chat_template = "toy" if chat else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out = []
        for piece in _PIECE.findall(text):
            if piece not in self._ids:
                self._ids[piece] = len(self._pieces)
                self._pieces.append(piece)
            out.append(self._ids[piece])
        return out

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self._pieces[i] for i in ids)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        if not self.chat:
            raise ValueError("no chat template")
        text = "".join(f"<|{m['role']}|>\n{m['content'].strip()}<|end|>\n" for m in messages)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")


def fake_essays(n_essays: int = 12, sentences: int = 120, seed: int = 0) -> list[str]:
    """Deterministic essay-like texts made of simple sentences."""
    rng = random.Random(seed)
    essays = []
    for _ in range(n_essays):
        sents = []
        for _ in range(sentences):
            words = rng.sample(BASIC_WORDS, rng.randint(5, 14))
            sents.append(" ".join(words).capitalize() + rng.choice([".", ".", ".", "?", "!"]))
        essays.append(" ".join(sents))
    return essays


def fake_qa_records(n: int = 60, paragraphs: int = 1, seed: int = 0) -> list[QARecord]:
    """Deterministic QA records; each answer is a sentence fragment of its first paragraph."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        paras = []
        for _ in range(paragraphs):
            sents = [" ".join(rng.sample(BASIC_WORDS, 10)).capitalize() + "." for _ in range(6)]
            paras.append(" ".join(sents))
        answer = " ".join(paras[0].split()[3:5])
        out.append(
            QARecord(
                f"q{i}", f"Which two words follow the third word in record {i}?", (answer,), tuple(paras), (0,), "fake"
            )
        )
    return out


def test_word_tokenizer_round_trip():
    tok = WordTokenizer()
    text = "Hello,  world!\nA second line."
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(tok.encode("one two three")) == 5  # words and the spaces between them


def test_fake_corpora_are_deterministic():
    assert fake_essays(seed=3) == fake_essays(seed=3)
    assert fake_qa_records(seed=1) == fake_qa_records(seed=1)
    rec = fake_qa_records(3)[0]
    assert rec.answers[0] in rec.paragraphs[0]
