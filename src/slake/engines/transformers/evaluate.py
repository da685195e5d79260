"""The transformers engine's evaluation: each prompt prefilled once, every (method, budget) pair replayed from it.

For each request the prompt is prefilled ONCE with :func:`slake.engines.transformers.prefill_once.capture_prefill`;
every pair is then
replayed from that capture and decoded greedily. Compression does not change prefill outputs, and cascading equals
one-shot eviction, so the replayed cache is the cache live compression would have built (``docs/conventions.md``,
"Prefill once, compress many"; a test compares the two). Chunked prefill (``prefill_chunk``) is measured live
instead: each chunk attends over the compressed past, so it cannot be replayed.

Batches (``batch_size > 1``): consecutive requests of one group, generation length and pending pairs are prefilled
one by one, their captures left-padded into one batch (:func:`slake.engines.transformers.prefill_once.stack_captures`),
and every
pair decodes the whole batch, which amortises a decode step's weight reads.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from slake.engines.base import EvalOptions, EvalOutput, EvalRequest
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.generate import prefill
from slake.engines.transformers.prefill_once import PrefillCapture, capture_prefill, greedy_decode, stack_captures
from slake.methods.base import make_method
from slake.methods.profiles import resolve_method

__all__ = ["evaluate", "batches"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batches(requests: Sequence[EvalRequest], size: int) -> list[list[EvalRequest]]:
    """Group consecutive requests of the same group, generation length and pending pairs, ``size`` at most."""
    out: list[list[EvalRequest]] = []
    for req in requests:
        if out:
            head = out[-1][0]
            if (
                len(out[-1]) < size
                and head.pairs == req.pairs
                and head.group == req.group
                and head.max_new_tokens == req.max_new_tokens
            ):
                out[-1].append(req)
                continue
        out.append([req])
    return out


def _method_for(model: Any, method: str, budget: int | float | None) -> tuple[Any, dict | None]:
    """The method of a pair with the model's profile applied (:mod:`slake.methods.profiles`)."""
    if budget is None:
        return method, None
    return resolve_method(method, budget, model)


def _second_pass(model: Any, capture: PrefillCapture, method: Any, reconstruction: Any) -> float | None:
    """Run a second-pass method's pass (KVzip's reconstruction) on ``capture`` once per method configuration; the
    replay picks its scores up. Returns the seconds it took (None when the method has no pass or it was done)."""
    built = make_method(method)
    if built.second_pass is None:
        return None
    from slake.engines.transformers.reconstruction import ReconstructionPrompt, run_second_pass

    if reconstruction is None:
        reconstruction = ReconstructionPrompt.synthetic(int(model.config.vocab_size))
    return run_second_pass(model, capture, built, reconstruction)


def evaluate(
    model: Any, requests: Sequence[EvalRequest], options: EvalOptions, eos: list[int], reconstruction: Any = None
) -> Iterator[EvalOutput]:
    """Every pending pair of every request (see the module docstring); one :class:`EvalOutput` each.

    ``reconstruction``: the tokenizer's :class:`slake.engines.transformers.reconstruction.ReconstructionPrompt` for
    second-pass methods (KVzip); without one, fixed token ids of the usual lengths stand in.

    Raises
    ------
    ValueError
        For an empty prompt, or ``batch_size > 1`` with chunked prefill or question-agnostic prompts.
    """
    if options.batch_size > 1 and (options.prefill_chunk is not None or not options.query_aware):
        raise ValueError(
            "batch_size > 1 needs query-aware prompts and exact prefill (no prefill_chunk): the "
            "question of a question-agnostic run and chunked prefill are fed per sample"
        )
    for req in requests:
        if not req.prefill_ids:
            raise ValueError(f"request {req.key} has an empty prompt")
    device = next(model.parameters()).device
    for batch in batches(requests, options.batch_size):
        if len(batch) == 1:
            yield from _run_one(model, batch[0], options, eos, device, reconstruction)
        else:
            yield from _run_batch(model, batch, options, eos, device, reconstruction)


def _run_batch(
    model: Any,
    batch: list[EvalRequest],
    options: EvalOptions,
    eos: list[int],
    device: torch.device,
    reconstruction: Any = None,
) -> Iterator[EvalOutput]:
    """Prefill each request once, stack the captures, then decode every pair for the whole batch."""
    captures: list[PrefillCapture] = []
    for req in batch:
        ids = torch.tensor([req.prefill_ids], dtype=torch.long, device=device)
        captures.append(capture_prefill(model, ids, torch.ones_like(ids)))
    prefill_s = [c.prefill_s for c in captures]
    capture = stack_captures(captures, release=True)  # peak memory: one batch of records, not two
    captures.clear()
    cap = batch[0].max_new_tokens
    for method, budget in batch[0].pairs:
        start = time.perf_counter()
        built, profile = _method_for(model, method, budget)
        second = _second_pass(model, capture, built, reconstruction)
        cache = capture.replay(built, capture.prompt_len if budget is None else budget, kv_dtype=options.kv_dtype)
        _sync(device)
        compress_s = time.perf_counter() - start
        cache.check_routed()
        compressor = cache.compressor
        assert compressor.info is not None  # set by the replay's prefill
        compressed = compressor.info.compress.tolist()
        kv_bytes = [cache.byte_counts(i) for i in range(len(batch))]  # after compression, before decoding
        start = time.perf_counter()
        all_tokens = greedy_decode(model, capture, cache, cap, eos)
        _sync(device)
        decode_s = time.perf_counter() - start
        for i, req in enumerate(batch):
            yield EvalOutput(
                key=req.key,
                method=method,
                budget=budget,
                tokens=all_tokens[i][:cap],
                prompt_tokens=len(req.prefill_ids),
                prefill_s=round(prefill_s[i], 5),
                decode_s=round(decode_s, 5),
                compressed=bool(compressed[i]),
                kv_bytes=kv_bytes[i],
                max_new_tokens=cap,
                batch_size=len(batch),
                profile=profile,
                extra=_extra(compress_s, second),
            )


def _extra(compress_s: float, second_pass_s: float | None) -> dict:
    out = {"compress_s": round(compress_s, 5)}
    if second_pass_s is not None:
        out["second_pass_s"] = round(second_pass_s, 5)
    return out


def _run_one(
    model: Any,
    req: EvalRequest,
    options: EvalOptions,
    eos: list[int],
    device: torch.device,
    reconstruction: Any = None,
) -> Iterator[EvalOutput]:
    """Prefill one request once, then decode every pending pair from it."""
    ids = torch.tensor([req.prefill_ids], dtype=torch.long, device=device)
    extra = torch.tensor([req.question_ids], dtype=torch.long, device=device) if req.question_ids else None
    capture = capture_prefill(model, ids, torch.ones_like(ids))
    for method, budget in req.pairs:
        start = time.perf_counter()
        chunk = None if budget is None else options.prefill_chunk
        built, profile = _method_for(model, method, budget)
        second = None
        if chunk is None:
            second = _second_pass(model, capture, built, reconstruction)
            cache = capture.replay(built, len(req.prefill_ids) if budget is None else budget, kv_dtype=options.kv_dtype)
            source = capture
        else:  # chunked prefill is measured live: each chunk attends over the compressed past
            assert budget is not None  # the full cache is never chunked
            cache = SlakeCache(built, budget, config=model.config, prefill_chunk=chunk, kv_dtype=options.kv_dtype)
            logits = prefill(model, cache, ids, torch.ones_like(ids), prefill_chunk=chunk)
            source = PrefillCapture(
                records=[],
                attention_mask=torch.ones_like(ids),
                last_logits=logits.float(),
                prefill_s=time.perf_counter() - start,
            )
        _sync(device)
        compress_s = time.perf_counter() - start
        stats = cache.statistics()
        start = time.perf_counter()
        tokens = greedy_decode(model, source, cache, req.max_new_tokens, eos, extra_ids=extra)[0]
        _sync(device)
        decode_s = time.perf_counter() - start
        yield EvalOutput(
            key=req.key,
            method=method,
            budget=budget,
            tokens=tokens,
            prompt_tokens=len(req.prefill_ids) + len(req.question_ids),
            prefill_s=round(capture.prefill_s, 5),
            decode_s=round(decode_s, 5),
            compressed=bool(stats["compressed"]),
            kv_bytes=stats["kv_bytes"],
            max_new_tokens=req.max_new_tokens,
            prefill_chunk=chunk,
            profile=profile,
            extra=_extra(compress_s, second),
        )
