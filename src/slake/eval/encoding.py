"""A sample's prompt as token ids: one prompt (query-aware) or a context part and a question part
(question-agnostic), :func:`encode_sample`. The runner (:mod:`slake.eval.runner`) and the kvpress protocol's
requests (:mod:`slake.eval.protocol`) both encode with it."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from slake.eval.prompts import build_prompt, has_chat_template
from slake.eval.sample import Sample

__all__ = ["encode_sample", "ids_digest"]


def encode_sample(
    sample: Sample, tokenizer: Any, *, query_aware: bool = True, chat_template: bool = True
) -> tuple[list[int], list[int]]:
    """Token ids of the prompt: ``(prefill_ids, question_ids)``.

    Query-aware: the whole prompt is prefilled and ``question_ids`` is empty. Question-agnostic: the context part
    is prefilled, the question part (with the chat template's closing tokens) is fed after compression. Special
    tokens (BOS) are added only when no chat template is used (the template writes its own).

    The two parts of a question-agnostic prompt are encoded separately, as kvpress's pipeline encodes them, so the
    ids can segment the text at the split otherwise than the query-aware ids do: SmolLM2 encodes a context's
    trailing blank line as one token alone and as two before the question (every RULER and needle prompt), Qwen2.5
    merges a context's final punctuation with a question part that starts with newlines (LongBench's prompts). The
    text is the same; the token count differs by one. Where encoding the question part alone would change the text
    itself (a SentencePiece dummy prefix, as in Llama 2, Mistral and Phi-3, puts a space before the question), the
    parts are cut from the whole prompt's ids instead, after the longest prefix they share with the context's own
    ids: they then spell the query-aware prompt exactly, and a token across the split goes to the question part, so
    the compressed part holds no character of the question.

    Parameters
    ----------
    sample : Sample
        The sample.
    tokenizer : Any
        The model's tokenizer: ``encode(text, add_special_tokens=...)``, and ``decode`` for the check above.
    query_aware : bool
        One prompt (True) or a context part and a question part (False).
    chat_template : bool
        Use the tokenizer's chat template where it has one and the sample allows it.

    Returns
    -------
    tuple of (list of int, list of int)
        The ids to prefill and the ids fed after compression (empty when query-aware).
    """
    use_chat = chat_template and sample.use_chat_template and has_chat_template(tokenizer)
    built = build_prompt(sample, tokenizer, chat_template=chat_template, query_aware=query_aware)
    if isinstance(built, str):
        return list(tokenizer.encode(built, add_special_tokens=not use_chat)), []
    context, question = built
    context_ids = list(tokenizer.encode(context, add_special_tokens=not use_chat))
    if not question:
        return context_ids, []
    question_ids = list(tokenizer.encode(question, add_special_tokens=False))
    full = list(tokenizer.encode(context + question, add_special_tokens=not use_chat))
    if context_ids + question_ids == full or not hasattr(tokenizer, "decode"):
        return context_ids, question_ids
    if tokenizer.decode(context_ids + question_ids) == tokenizer.decode(full):
        return context_ids, question_ids  # the same text, segmented otherwise at the split (kvpress's ids)
    shared = 0
    while shared < min(len(context_ids), len(full)) and context_ids[shared] == full[shared]:
        shared += 1
    if shared == 0:
        return context_ids, question_ids
    return full[:shared], full[shared:]


def ids_digest(prefill_ids: Sequence[int], question_ids: Sequence[int]) -> str:
    """16 hex digits of SHA-256 over a prompt's token ids (:func:`encode_sample`'s two lists, told apart).

    :func:`slake.eval.sample.sample_digest` names a sample's text; the same text gives other ids under another
    tokenizer (a transformers release that changed it, another tokenizer file under the same model name) or another
    way of encoding it. Result rows record this digest (``ids_digest``), and a run refuses to add rows to a sample
    whose earlier rows were made from other ids (:func:`slake.eval.resume_checks.check_ids_digests`): one sample's
    methods would otherwise be compared on two different prompts.
    """
    payload = ",".join(map(str, prefill_ids)) + "|" + ",".join(map(str, question_ids))
    return hashlib.sha256(payload.encode("ascii")).hexdigest()[:16]
