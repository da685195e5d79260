"""The model's context, and the refusal of prompts beyond it, for every engine and the evaluation harness.

A prompt plus the tokens generated after it that reach past the model's context (``max_position_embeddings``: the
positions it was trained on) gives answers that degrade, without any error from the model: RoPE extrapolates. A
score measured there says nothing about the method. So ``slake generate`` and ``slake eval``, on either engine,
refuse such a prompt unless the user allows it explicitly (``allow_long_context=True``, ``--allow-long-context``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["check_context", "check_lengths", "context_limit"]


def context_limit(config: Any) -> int | None:
    """The model's context in tokens: ``max_position_embeddings`` of its text configuration, or None without one.

    Parameters
    ----------
    config : transformers.PretrainedConfig or Mapping
        A model's configuration, or its ``config.json`` as a dict; a multimodal configuration's text part is read
        (``get_text_config()``, or the ``text_config`` entry of a dict).
    """
    if isinstance(config, Mapping):
        config = config.get("text_config") or config
        limit = config.get("max_position_embeddings")
    else:
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        limit = getattr(config, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def check_context(
    limit: int | None,
    prompt_tokens: int,
    max_new_tokens: int,
    *,
    allow_long_context: bool = False,
    what: str = "the prompt has",
    can_allow: bool = True,
) -> None:
    """Raise ValueError when ``prompt_tokens + max_new_tokens`` exceeds ``limit`` (the model's context).

    Parameters
    ----------
    limit : int or None
        The model's context (:func:`context_limit`); None passes everything.
    prompt_tokens, max_new_tokens : int
        The prompt's length and the most tokens generated after it.
    allow_long_context : bool
        Pass anyway (the user asked for it).
    what : str
        The message's subject, e.g. ``"sample 'needle-9000-0' has"``.
    can_allow : bool
        The caller takes ``allow_long_context``; the message then says how to allow it.
    """
    if allow_long_context or limit is None or prompt_tokens + max_new_tokens <= limit:
        return
    allow = ", or allow it explicitly (allow_long_context=True, --allow-long-context)" if can_allow else ""
    raise ValueError(
        f"{what} {prompt_tokens} tokens and up to {max_new_tokens} more are generated, beyond the model's context "
        f"of {limit} tokens (max_position_embeddings), where answers degrade; shorten the prompt or lower the "
        f"new tokens{allow}"
    )


def check_lengths(
    limit: int | None,
    lengths: Iterable[int],
    *,
    flag: str,
    allow_long_context: bool = False,
    can_allow: bool = True,
) -> None:
    """Raise ValueError when a requested prompt length alone exceeds ``limit`` (the model's context), before any
    sample of that length is built: building one costs its whole text and tokenization (minutes for a mistyped
    ``--lengths 100000000``) only for :func:`check_context` to refuse it afterwards.

    Parameters
    ----------
    limit : int or None
        The model's context (:func:`context_limit`); None passes everything.
    lengths : iterable of int
        The prompt lengths asked for, in the model's tokens.
    flag : str
        The option that asked for them, named in the message (``"--lengths"``, ``"--length"``).
    allow_long_context : bool
        Pass anyway (the user asked for it).
    can_allow : bool
        The caller takes ``allow_long_context``; the message then says how to allow it.
    """
    over = [n for n in lengths if limit is not None and n > limit]
    if allow_long_context or not over:
        return
    allow = ", or allow it explicitly (--allow-long-context)" if can_allow else ""
    raise ValueError(
        f"{flag} {max(over)} asks for a prompt of {max(over)} tokens, beyond the model's context of {limit} tokens "
        f"(max_position_embeddings), where answers degrade; ask for a shorter one{allow}"
    )
