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

``prefill_cache``: captures are read from and written to a
:class:`~slake.engines.transformers.prefill_once.CaptureStore`, so a prompt prefilled by an earlier run (another
method list, an interrupted run, a survey of the full cache) is not prefilled again; rows say ``prefill_cached``.
KVzip's reconstruction scores are stored there too (per prompt, pass configuration and reconstruction prompt), and
rows whose scores were read say ``second_pass_cached``.

``fidelity``: the full cache's greedy answer is the reference continuation of each prompt; every compressed pair is
also replayed and teacher-forced along it, and its row gets the output-level distance to the full cache over the
answer's tokens after the first (which the exact prefill predicts identically for every method): ``kl`` (mean
KL(full ‖ method) in nats per token), ``delta_nll`` (mean change of the reference tokens' negative log-likelihood),
``top1`` (share of steps with the same most likely token) and ``kl_tokens`` (how many steps count), as ``slake
fidelity`` measures them (:mod:`slake.engines.transformers.teacher_forcing`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from slake.cache.quant import parse_kv_dtype
from slake.engines.base import EvalOptions, EvalOutput, EvalRequest
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.generate import prefill
from slake.engines.transformers.layer_layout import text_config
from slake.engines.transformers.prefill_once import (
    CaptureStore,
    PrefillCapture,
    capture_prefill,
    greedy_decode,
    stack_captures,
)
from slake.engines.transformers.teacher_forcing import distances, teacher_forced_logprobs
from slake.methods.base import make_method
from slake.methods.profiles import resolve_method

__all__ = ["batches", "check_options", "evaluate", "method_for_pair"]


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


def method_for_pair(model: Any, method: str, budget: int | float | None) -> tuple[Any, dict | None]:
    """The method of a pair with the model's profile applied (:mod:`slake.methods.profiles`)."""
    if budget is None:
        return method, None
    return resolve_method(method, budget, model)


def _second_pass(
    model: Any,
    capture: PrefillCapture,
    method: Any,
    reconstruction: Any,
    store: CaptureStore | None = None,
    rows: list[list[int]] | None = None,
) -> tuple[float | None, bool]:
    """Run a second-pass method's pass (KVzip's reconstruction) on ``capture`` once per method configuration; the
    replay picks its scores up.

    With a ``store`` (``--prefill-cache``) and the token ids of the capture's sequences (``rows``, in batch order),
    each sequence's scores are read from the store when every sequence has them, and written to it after a pass.

    Returns
    -------
    (float or None, bool)
        The seconds the pass took (None when the method has no pass or it was done on this capture already; for
        stored scores the seconds of the run that computed them, split over a batch's sequences by length), and
        whether the scores came from the store.
    """
    built = make_method(method)
    if built.second_pass is None or built.second_pass_key() in capture.pass_scores:
        return None, False
    from slake.engines.transformers.reconstruction import ReconstructionPrompt, run_second_pass

    if reconstruction is None:
        reconstruction = ReconstructionPrompt.synthetic(int(text_config(model.config).vocab_size))
    key = built.second_pass_key()
    stored_key = f"{key} prompt={reconstruction.fingerprint()}"
    S = capture.prompt_len
    if store is not None and rows:
        found = [store.load_pass_scores(ids, stored_key) for ids in rows]
        stored = [f for f in found if f is not None]
        if len(stored) == len(rows):
            capture.pass_scores[key] = torch.cat(
                [torch.nn.functional.pad(scores, (S - scores.shape[-1], 0)) for scores, _ in stored], dim=1
            )
            return sum(seconds for _, seconds in stored), True
    seconds = run_second_pass(model, capture, built, reconstruction)
    if store is not None and rows and seconds is not None:
        scores = capture.pass_scores[key]
        total = sum(len(ids) for ids in rows)
        for b, ids in enumerate(rows):  # left padding dropped: the file holds the prompt's own scores
            store.save_pass_scores(ids, stored_key, scores[:, b : b + 1, :, S - len(ids) :], seconds * len(ids) / total)
    return seconds, False


def check_options(options: EvalOptions) -> None:
    """Raise ValueError for options that cannot be combined (before any model work).

    ``batch_size > 1`` and ``fidelity`` need query-aware prompts and exact prefill: the question of a
    question-agnostic run and chunked prefill are fed per sample, and chunked prefill cannot be replayed.
    """
    if options.batch_size > 1 and (options.prefill_chunk is not None or not options.query_aware):
        raise ValueError(
            "batch_size > 1 needs query-aware prompts and exact prefill (no prefill_chunk): the "
            "question of a question-agnostic run and chunked prefill are fed per sample"
        )
    if options.fidelity and (options.prefill_chunk is not None or not options.query_aware):
        raise ValueError(
            "fidelity needs query-aware prompts and exact prefill (no prefill_chunk): the full cache's answer is "
            "teacher-forced through a cache replayed from the prompt's prefill"
        )


def evaluate(
    model: Any, requests: Sequence[EvalRequest], options: EvalOptions, eos: list[int], reconstruction: Any = None
) -> Iterator[EvalOutput]:
    """Every pending pair of every request (see the module docstring); one :class:`EvalOutput` each.

    ``reconstruction``: the tokenizer's :class:`slake.engines.transformers.reconstruction.ReconstructionPrompt` for
    second-pass methods (KVzip); without one, fixed token ids of the usual lengths stand in.

    Raises
    ------
    ValueError
        For an empty prompt, or options that cannot be combined (:func:`check_options`).
    """
    check_options(options)
    for req in requests:
        if not req.prefill_ids:
            raise ValueError(f"request {req.key} has an empty prompt")
    device = next(model.parameters()).device
    store = CaptureStore(options.prefill_cache, model) if options.prefill_cache else None
    for batch in batches(requests, options.batch_size):
        if len(batch) == 1:
            yield from _run_one(model, batch[0], options, eos, device, store, reconstruction)
        else:
            yield from _run_batch(model, batch, options, eos, device, store, reconstruction)


def _capture(model: Any, ids: list[int], device: torch.device, store: CaptureStore | None) -> PrefillCapture:
    """The prefill capture of one prompt: from the store when it holds it, else prefilled (and stored)."""
    capture = store.load(ids) if store is not None else None
    if capture is None:
        t = torch.tensor([ids], dtype=torch.long, device=device)
        capture = capture_prefill(model, t, torch.ones_like(t))
        if store is not None:
            store.save(ids, capture)
    return capture


@dataclass
class _Reference:
    """The full cache's greedy answers of a batch, and the log-probabilities each token was chosen from."""

    tokens: list[list[int]]
    decode_s: float
    targets: torch.Tensor  # (B, T) the answers, padded
    valid: torch.Tensor  # (B, T) positions 1.. of each answer
    full_lp: torch.Tensor  # (B, T, vocab)


def _reference(model: Any, capture: PrefillCapture, cap: int, eos: list[int], device: torch.device) -> _Reference:
    start = time.perf_counter()
    lps: list[torch.Tensor] = []
    tokens = greedy_decode(model, capture, capture.replay("full", capture.prompt_len), cap, eos, logprobs=lps)
    _sync(device)
    decode_s = time.perf_counter() - start
    tokens = [t[:cap] for t in tokens]
    T = max(len(t) for t in tokens)
    targets = torch.zeros(len(tokens), T, dtype=torch.long, device=device)
    valid = torch.zeros(len(tokens), T, dtype=torch.bool, device=device)
    for b, t in enumerate(tokens):
        targets[b, : len(t)] = torch.tensor(t, dtype=torch.long, device=device)
        valid[b, 1 : len(t)] = True
    return _Reference(tokens, decode_s, targets, valid, torch.stack(lps[:T], 1))


def _fidelity(model: Any, capture: PrefillCapture, ref: _Reference, method: Any, budget: Any, kv_dtype) -> list[dict]:
    """Per sequence: the output-level distance of (method, budget) to the full cache along the reference answers."""
    cache = capture.replay(method, budget, kv_dtype=kv_dtype)
    lp = teacher_forced_logprobs(model, capture, cache, ref.targets)
    d = distances(ref.full_lp, lp, ref.targets, ref.valid)
    out = []
    for b in range(len(ref.tokens)):
        n = int(d["tokens"][b])
        out.append(
            {
                "kl": _finite(d["kl"][b]) if n else None,
                "delta_nll": _finite(d["delta_nll"][b]) if n else None,
                "top1": _finite(d["top1"][b]) if n else None,
                "kl_tokens": n,
            }
        )
    return out


def _finite(x: float) -> float | None:
    return round(float(x), 6) if math.isfinite(x) else None


def _run_batch(
    model: Any,
    batch: list[EvalRequest],
    options: EvalOptions,
    eos: list[int],
    device: torch.device,
    store: CaptureStore | None,
    reconstruction: Any = None,
) -> Iterator[EvalOutput]:
    """Prefill each request once, stack the captures, then decode every pair for the whole batch."""
    captures = [_capture(model, req.prefill_ids, device, store) for req in batch]
    prefill_s = [c.prefill_s for c in captures]
    cached = [c.cached for c in captures]
    capture = stack_captures(captures, release=True)  # peak memory: one batch of records, not two
    captures.clear()
    cap = batch[0].max_new_tokens
    ref = _reference(model, capture, cap, eos, device) if _wants_reference(options, batch[0]) else None
    for method, budget in batch[0].pairs:
        start = time.perf_counter()
        built, profile = method_for_pair(model, method, budget)
        second, second_cached = _second_pass(
            model, capture, built, reconstruction, store, [req.prefill_ids for req in batch]
        )
        cache = capture.replay(built, capture.prompt_len if budget is None else budget, kv_dtype=options.kv_dtype)
        _sync(device)
        compress_s = time.perf_counter() - start
        cache.check_routed()
        compressor = cache.compressor
        assert compressor.info is not None  # set by the replay's prefill
        compressed = compressor.info.compress.tolist()
        kv_bytes = [cache.byte_counts(i) for i in range(len(batch))]  # after compression, before decoding
        # the reference is the full cache's own greedy decode, at the model's dtype: with 8-bit storage the full
        # row decodes its own 8-bit cache (kv_dtype applies to every row; its kv_bytes are that cache's)
        if budget is None and ref is not None and parse_kv_dtype(options.kv_dtype) is None:
            all_tokens, decode_s = ref.tokens, ref.decode_s
        else:
            start = time.perf_counter()
            all_tokens = greedy_decode(model, capture, cache, cap, eos)
            _sync(device)
            decode_s = time.perf_counter() - start
        del cache
        fid = (
            _fidelity(model, capture, ref, built, budget, options.kv_dtype)
            if ref is not None and budget is not None
            else None
        )
        for i, req in enumerate(batch):
            extra: dict[str, Any] = {"compress_s": round(compress_s, 5), "prefill_cached": cached[i]}
            if second is not None:
                extra["second_pass_s"] = round(second, 5)
                extra["second_pass_cached"] = second_cached
            if fid is not None:
                extra.update(fid[i])
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
                extra=extra,
            )


def _wants_reference(options: EvalOptions, req: EvalRequest) -> bool:
    """Fidelity rows are asked for and some pair is compressed (the full pair alone needs no reference)."""
    return options.fidelity and any(budget is not None for _, budget in req.pairs)


def _run_one(
    model: Any,
    req: EvalRequest,
    options: EvalOptions,
    eos: list[int],
    device: torch.device,
    store: CaptureStore | None,
    reconstruction: Any = None,
) -> Iterator[EvalOutput]:
    """Prefill one request once, then decode every pending pair from it.

    The exact prefill's capture is made only when a pair replays it (an exact prefill: the full cache, or every pair
    without ``prefill_chunk``) or fidelity rows need the reference: a pair with ``prefill_chunk`` is prefilled live,
    in chunks, and its row's ``prefill_s`` is that chunked prefill's (compression included, as in
    :func:`slake.generate`). A chunked run never records the whole prompt's queries, keys and values, whose memory
    the chunks are there to bound.
    """
    ids = torch.tensor([req.prefill_ids], dtype=torch.long, device=device)
    extra_ids = torch.tensor([req.question_ids], dtype=torch.long, device=device) if req.question_ids else None
    replayed = options.prefill_chunk is None or any(budget is None for _, budget in req.pairs)
    capture = _capture(model, req.prefill_ids, device, store) if replayed or _wants_reference(options, req) else None
    ref = None
    if capture is not None and _wants_reference(options, req):
        ref = _reference(model, capture, req.max_new_tokens, eos, device)
    for method, budget in req.pairs:
        start = time.perf_counter()
        chunk = None if budget is None else options.prefill_chunk
        built, profile = method_for_pair(model, method, budget)
        second, second_cached = None, False
        if chunk is None:
            assert capture is not None  # made above for every pair that replays it
            second, second_cached = _second_pass(model, capture, built, reconstruction, store, [req.prefill_ids])
            cache = capture.replay(built, len(req.prefill_ids) if budget is None else budget, kv_dtype=options.kv_dtype)
            source = capture
        else:  # chunked prefill is measured live: each chunk attends over the compressed past
            assert budget is not None  # the full cache is never chunked
            cache = SlakeCache(built, budget, config=model.config, prefill_chunk=chunk, kv_dtype=options.kv_dtype)
            logits = prefill(model, cache, ids, torch.ones_like(ids), prefill_chunk=chunk)
            _sync(device)
            source = PrefillCapture(
                records=[],
                attention_mask=torch.ones_like(ids),
                last_logits=logits.float(),
                prefill_s=time.perf_counter() - start,
            )
        _sync(device)
        compress_s = time.perf_counter() - start
        stats = cache.statistics()
        # the reference is the full cache's own greedy decode, at the model's dtype: with 8-bit storage the full
        # row decodes its own 8-bit cache (kv_dtype applies to every row; its kv_bytes are that cache's)
        if budget is None and ref is not None and parse_kv_dtype(options.kv_dtype) is None:
            tokens, decode_s = ref.tokens[0], ref.decode_s
        else:
            start = time.perf_counter()
            tokens = greedy_decode(model, source, cache, req.max_new_tokens, eos, extra_ids=extra_ids)[0]
            _sync(device)
            decode_s = time.perf_counter() - start
        del cache
        extra: dict[str, Any] = {"compress_s": round(compress_s, 5), "prefill_cached": source.cached}
        if second is not None:
            extra["second_pass_s"] = round(second, 5)
            extra["second_pass_cached"] = second_cached
        if ref is not None and budget is not None and capture is not None:
            extra.update(_fidelity(model, capture, ref, built, budget, options.kv_dtype)[0])
        yield EvalOutput(
            key=req.key,
            method=method,
            budget=budget,
            tokens=tokens,
            prompt_tokens=len(req.prefill_ids) + len(req.question_ids),
            prefill_s=round(source.prefill_s, 5),
            decode_s=round(decode_s, 5),
            compressed=bool(stats["compressed"]),
            kv_bytes=stats["kv_bytes"],
            max_new_tokens=req.max_new_tokens,
            prefill_chunk=chunk,
            profile=profile,
            extra=extra,
        )
