"""Turn a :class:`~slake.eval.sample.Sample` into the text fed to the model.

Two layouts:

* query-aware (default): one string; the question is inside the user turn, after the context.
* question-agnostic: ``(context_part, question_part)`` with ``context_part + question_part`` equal
  to the query-aware string; a runner prefills ``context_part``, compresses the KV cache without
  seeing the question, then feeds ``question_part`` and generates.

With a chat template the user message is ``context + question`` and ``answer_prefix`` follows the
generation prompt (RULER style).  Without one (or for samples with ``use_chat_template=False``,
e.g. LongBench few-shot/code datasets) the prompt is ``context + question + answer_prefix``.
"""

from __future__ import annotations

from typing import Any

from slake.eval.sample import Sample

__all__ = ["build_messages", "build_prompt", "has_chat_template"]


def build_messages(sample: Sample, system: str | None = None) -> list[dict[str, str]]:
    """Chat messages for ``sample``: an optional system turn and one user turn (context, then question)."""
    messages = [] if system is None else [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": sample.context + sample.question})
    return messages


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` can render chat messages: it has ``apply_chat_template`` and a template that is not empty
    (None or ``""``: none, as :func:`slake.engines.transformers.generate.uses_chat_template` reads it, so that
    ``slake eval`` and ``slake generate`` send one tokenizer's prompts alike; a tokenizer without the attribute is
    taken at its method's word)."""
    if not hasattr(tokenizer, "apply_chat_template"):
        return False
    return bool(getattr(tokenizer, "chat_template", "present"))


def _render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(text, str):
        raise TypeError("apply_chat_template(..., tokenize=False) must return a string")
    return text


def _find_split(full: str, context: str, question: str) -> int:
    """Index in ``full`` right after the context, allowing the template to trim the message."""
    head = context.lstrip()
    attempts = [(head, question.rstrip()), (head.rstrip(), question.strip())]
    for ctx, q in attempts:
        if not ctx:
            continue
        start = full.find(ctx + q)
        if start >= 0:
            return start + len(ctx)
    if not head.strip():
        start = full.find(question.strip())
        if start >= 0:
            return start
    raise ValueError("the chat template changed the message text; cannot find the context/question split")


def build_prompt(
    sample: Sample,
    tokenizer: Any = None,
    chat_template: bool = True,
    query_aware: bool = True,
    system: str | None = None,
) -> str | tuple[str, str]:
    """Build the model input text for ``sample``.

    Parameters
    ----------
    sample : Sample
        The sample.
    tokenizer : optional
        A tokenizer with ``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``;
        without one (or without a template) the plain layout is used.
    chat_template : bool
        Use the chat template when available and the sample allows it.
    query_aware : bool
        True: return one string.  False: return ``(context_part, question_part)``.
    system : str, optional
        System message for the chat template.

    Returns
    -------
    str or tuple of str

    Raises
    ------
    ValueError
        When the rendered chat text does not contain the context and question contiguously (a
        template that rewrites message content), so no clean split point exists.
    """
    use_chat = chat_template and sample.use_chat_template and tokenizer is not None and has_chat_template(tokenizer)
    if not use_chat:
        full = sample.context + sample.question + sample.answer_prefix
        split = len(sample.context)
    else:
        full = _render_chat(tokenizer, build_messages(sample, system)) + sample.answer_prefix
        split = _find_split(full, sample.context, sample.question)
    if query_aware:
        return full
    return full[:split], full[split:]
