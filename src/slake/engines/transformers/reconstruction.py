"""KVzip's second pass: the model repeats its prompt, and each prompt KV pair scores the attention it receives
(``docs/methods/kvzip.md``; the scoring itself is :func:`slake.methods.kvzip.reconstruction_attention`).

:func:`prefill_with_second_pass` replaces the plain prefill for a method with ``second_pass == "reconstruction"``:

1. the prompt is prefilled exactly, recording every layer's keys and values
   (:func:`slake.engines.transformers.prefill_once.capture_prefill`, without the queries);
2. for each sequence of the batch (left padding removed) and each chunk of its context, the base model reads
   ``repeat prompt + template suffix + chunk`` over a plain transformers cache holding that sequence's prompt, and
   an attention observer (:func:`slake.engines.transformers.attention.observe_attention`) scores the chunk's keys
   in every compressed layer; the cache is rebuilt from the records for every chunk, so each chunk sees the prompt
   only (as in KVzip's code and kvpress);
3. the recorded prefill is replayed into the caller's cache with those scores, which compresses it exactly as a live
   prefill would (cascade included), and the exact last-position logits are returned.

The cost is one more forward over about the prompt's length (chunked), reported as ``cache.second_pass_s``.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from slake.engines.transformers.attention import observe_attention, prepare_model
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from slake.engines.transformers.grad_mode import no_grad_here
from slake.engines.transformers.layer_layout import attention_layout
from slake.engines.transformers.prefill_once import PrefillCapture, capture_prefill
from slake.methods.base import Method
from slake.methods.kvzip import reconstruction_attention

__all__ = ["ReconstructionPrompt", "prefill_with_second_pass", "reconstruction_scores", "run_second_pass"]

REPEAT = "\n\nRepeat the previous context exactly."
CONTINUE = "\n\nRepeat the part of the previous context exactly, starting with"
#: tokens of the previous chunk that end a later chunk's repeat prompt (KVzip's ``prev_postfix_size``)
OVERLAP = 8
#: score of the template prefix's tokens with ``keep_prefix``: above any attention probability
PREFIX_SCORE = 2.0
#: version of the scores a reconstruction pass makes, part of :meth:`ReconstructionPrompt.fingerprint` with
#: :data:`OVERLAP` and :data:`PREFIX_SCORE`: bump it with any change to what the pass computes (this module's
#: chunking, :func:`slake.methods.kvzip.reconstruction_attention`), so that scores stored by older code
#: (``--prefill-cache``) are computed again rather than reused
SCORES_FORMAT = 1


@dataclass(frozen=True)
class ReconstructionPrompt:
    """Token ids of KVzip's reconstruction task for one tokenizer.

    Attributes
    ----------
    repeat_ids : list[int]
        "Repeat the previous context exactly." (first chunk).
    continue_ids : list[int]
        "Repeat the part of the previous context exactly, starting with" (later chunks; the previous chunk's last
        8 tokens follow).
    suffix_ids : list[int]
        What the chat template puts after a user turn (end of turn, start of the assistant's); ``"\\n"`` without one.
    prefix_ids : list[int]
        What the chat template puts before a user turn's content (system prompt); empty without one. A prompt that
        starts with these tokens has its context after them.
    """

    repeat_ids: list[int]
    continue_ids: list[int]
    suffix_ids: list[int]
    prefix_ids: list[int]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> ReconstructionPrompt:
        """The prompt of a tokenizer, its chat template split around a dummy user turn (kvpress's way)."""

        def encode(text: str) -> list[int]:
            return list(tokenizer.encode(text, add_special_tokens=False))

        prefix, suffix = "", "\n"
        if getattr(tokenizer, "chat_template", None):
            dummy = "dummy context"
            separator = "\n" + "#" * len(dummy)
            turn = [{"role": "user", "content": dummy + separator}]
            try:  # templates that think first (Qwen 3) are asked not to, as kvpress does
                text = tokenizer.apply_chat_template(
                    turn, add_generation_prompt=True, tokenize=False, enable_thinking=False
                )
            except TypeError:  # a template function without that keyword
                text = tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
            head, suffix = text.split(separator)
            prefix = head.split(dummy)[0]
        return cls(encode(REPEAT), encode(CONTINUE), encode(suffix), encode(prefix) if prefix else [])

    @classmethod
    def synthetic(cls, vocab_size: int) -> ReconstructionPrompt:
        """Fixed token ids of the usual lengths, for timing a model without a tokenizer (``slake bench`` on random
        prompts): the cost of the pass depends on lengths only."""
        ids = [(7919 * (i + 1)) % max(vocab_size - 3, 1) + 3 for i in range(24)]
        return cls(ids[:8], ids[:12], ids[12:17], [])

    def fingerprint(self) -> str:
        """A short digest of the four token lists and of the scoring's version (:data:`SCORES_FORMAT`,
        :data:`OVERLAP`, :data:`PREFIX_SCORE`): scores stored across runs (``--prefill-cache``) are reused only under
        the same reconstruction prompt and by the same scoring."""
        lists = [self.repeat_ids, self.continue_ids, self.suffix_ids, self.prefix_ids]
        scoring = [SCORES_FORMAT, OVERLAP, PREFIX_SCORE]
        return hashlib.sha256(json.dumps([lists, scoring]).encode()).hexdigest()[:16]

    def prefix_length(self, ids: list[int]) -> int:
        """Tokens of the template prefix at the start of ``ids`` (0 when the prompt does not start with it)."""
        n = len(self.prefix_ids)
        return n if n and ids[:n] == self.prefix_ids else 0


def _context_cache(model: Any, capture: PrefillCapture, row: int, offset: int) -> DynamicCache:
    """A transformers cache holding one sequence's prompt (left padding removed), rebuilt from the records."""
    layout = attention_layout(model.config)
    cache = DynamicCache(config=model.config)
    slot = {layer: s for s, layer in enumerate(layout.compressed)}
    for layer in range(layout.num_layers):
        if layer in slot:
            k, v = capture.records[slot[layer]][1:3]
        else:
            k, v = capture.bounded[layer]
        cache.update(k[row : row + 1, :, offset:], v[row : row + 1, :, offset:], layer)
    return cache


def reconstruction_scores(model: Any, capture: PrefillCapture, method: Method, prompt: ReconstructionPrompt) -> Any:
    """KVzip's ``(L, B, Hkv, S)`` float32 scores of a recorded prefill (``capture`` must hold its ``input_ids``).

    Positions outside a sequence's context (left padding, and the template prefix past the sinks) score 0; with
    ``keep_prefix`` the prefix scores :data:`PREFIX_SCORE`. ``L`` counts the compressed layers.
    """
    if capture.input_ids is None:
        raise ValueError("the reconstruction pass needs the prompt's token ids (capture_prefill records them)")
    layout = attention_layout(model.config)
    slot = {layer: s for s, layer in enumerate(layout.compressed)}
    mask = capture.attention_mask
    B, S = mask.shape
    H = capture.records[0][1].shape[1]
    dev = capture.records[0][1].device
    scores = torch.zeros(len(capture.records), B, H, S, dtype=torch.float32, device=dev)
    base = getattr(model, "base_model", model)
    sinks = int(method.sinks)
    size = int(getattr(method, "chunk_size", 2048))
    keep_prefix = bool(getattr(method, "keep_prefix", False))
    for b in range(B):
        real = int(mask[b].sum())
        off = S - real
        ids = capture.input_ids[b, off:].tolist()
        prefix = prompt.prefix_length(ids)
        if keep_prefix:
            scores[:, b, :, off : off + prefix] = PREFIX_SCORE
        context = ids[prefix:]
        chunks = [context[i : i + size] for i in range(0, len(context), size)]
        start = prefix
        for i, chunk in enumerate(chunks):
            end = start + len(chunk)
            head = prompt.repeat_ids if i == 0 else prompt.continue_ids + chunks[i - 1][-OVERLAP:]
            rep = torch.tensor([head + prompt.suffix_ids + chunk], dtype=torch.long, device=dev)
            sink = prefix if keep_prefix else min(sinks, start)

            def observe(module, query, key, scaling, b=b, off=off, start=start, end=end, sink=sink):
                s = slot.get(getattr(module, "layer_idx", -1))
                if s is not None:
                    scores[s, b, :, off + start : off + end] = reconstruction_attention(
                        query, key, sink, start, end, scaling
                    )[0].to(scores.device)

            pos = torch.arange(real, real + rep.shape[1], device=dev).view(1, -1)
            cache = _context_cache(model, capture, b, off)
            with observe_attention(observe):
                base(input_ids=rep, position_ids=pos, **with_cache(base, cache), use_cache=True)
            start = end
    return scores


def run_second_pass(model: Any, capture: PrefillCapture, method: Method, prompt: ReconstructionPrompt) -> float | None:
    """Compute ``method``'s second-pass scores on a recorded prefill once (stored in ``capture.pass_scores``, which
    :meth:`PrefillCapture.replay` reads); returns the seconds it took, None when the method has no second pass or
    its scores were already there."""
    if method.second_pass is None or method.second_pass_key() in capture.pass_scores:
        return None
    start = time.perf_counter()
    with torch.inference_mode():
        scores = reconstruction_scores(model, capture, method, prompt)
    if scores.is_cuda:
        torch.cuda.synchronize(scores.device)
    capture.pass_scores[method.second_pass_key()] = scores
    return time.perf_counter() - start


def prefill_with_second_pass(
    model: Any, cache: SlakeCache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Prefill ``cache`` for a second-pass method (see the module docstring); returns the ``(B, vocab)`` float32
    logits at the last prompt position (the exact prefill's). ``cache.reconstruction`` holds the
    :class:`ReconstructionPrompt` (``slake.generate`` sets it from the tokenizer)."""
    method = cache.method
    if method.second_pass != "reconstruction":
        raise ValueError(f"{method.name}: no second pass of kind {method.second_pass!r}")
    prompt = getattr(cache, "reconstruction", None)
    if prompt is None:
        raise ValueError(
            f"{method.name} needs its reconstruction prompt: set cache.reconstruction = "
            f"ReconstructionPrompt.from_tokenizer(tokenizer) (slake.generate does)"
        )
    prepare_model(model)
    with torch.inference_mode():
        capture = capture_prefill(model, input_ids, attention_mask, keep_queries=False)
        start = time.perf_counter()
        scores = reconstruction_scores(model, capture, method, prompt)
        if scores.is_cuda:
            torch.cuda.synchronize(scores.device)
        cache.second_pass_s = time.perf_counter() - start
    # the cache's tensors of the kind the caller's later steps can update in place (no inference tensors outside
    # inference mode: a plain model.generate runs under torch.no_grad())
    with no_grad_here():
        capture.replay_into(cache, scores)
    cache.check_routed()
    return capture.last_logits
