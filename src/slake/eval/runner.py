"""The evaluation runner: samples x (full reference + methods x budgets) on one model, prefilled once per sample.

For each sample the prompt is built (:func:`slake.eval.prompts.build_prompt`), tokenised and prefilled ONCE with
:func:`slake.hf.prefill_once.capture_prefill`; every (method, budget) pair is then replayed from that capture and
decoded greedily (ARCHITECTURE.md section 4: compression does not change prefill outputs, so the replayed cache is
the cache live compression would have built). Each row is appended to ``DIR/results.jsonl`` and flushed as soon as it
is scored; a rerun skips the rows already there and does not even prefill a sample whose rows are all present.

Query-aware (default): the question is at the end of the prompt, inside the prefill and the observation window.
Question-agnostic: the context alone is prefilled and compressed, then the question is fed (``extra_ids``) and the
answer generated.
"""

from __future__ import annotations

import os
import time
from typing import Any, Iterator, Sequence

import torch

from ..budget_spec import Budget
from ..hf.cache import SlakeCache
from ..hf.generate import prefill
from ..hf.prefill_once import PrefillCapture, capture_prefill, greedy_decode, stack_captures
from .metrics import score_prediction
from .prompts import build_prompt, has_chat_template
from .results import FULL_METHOD, ResultsWriter, check_engine_dir, row_key
from .sample import Sample

__all__ = ["run_suite", "resolve_methods", "parse_budgets", "check_pairs", "encode_sample", "eos_token_ids", "target_length"]

Pair = tuple[str, "int | float | None"]


def resolve_methods(methods: str | Sequence[str]) -> list[str]:
    """Validate method names or specs; ``"all"`` means every registered method except ``full``.

    ``full`` is dropped from the result (the full-cache reference row is always run separately). A spec such as
    ``slake[vabs=false]`` (:mod:`slake.methods.spec`) runs a variant beside its base method; it is validated here
    (unknown hyperparameters and wrongly typed values fail before any model work) and returned in canonical form,
    which is the ``method`` value of its rows.

    Parameters
    ----------
    methods : str or sequence of str
        ``"snapkv,h2o"``, ``["snapkv", "slake[vabs=false]"]`` or ``"all"``. In a string, commas inside ``[...]``
        separate hyperparameters, not methods.

    Returns
    -------
    list of str
        Distinct canonical specs in the given order (registration order for ``all``).

    Raises
    ------
    ValueError
        For an unknown name (the message lists the registered methods), a bad spec, hyperparameters on ``full``
        or an empty list.
    """
    from ..methods import available_methods
    from ..methods.spec import canonical_method_spec, parse_method_spec, split_method_list

    registered = list(available_methods())
    names = split_method_list(methods) if isinstance(methods, str) else [str(m).strip() for m in methods]
    names = [n for n in names if n]
    if not names:
        raise ValueError("no method given; use e.g. --methods snapkv,h2o or --methods all")
    out: list[str] = []
    for name in names:
        if name.strip().lower() == "all":
            expanded = [m for m in registered if m != FULL_METHOD]
        else:
            base, overrides = parse_method_spec(name)
            if base not in registered:
                raise ValueError(f"unknown method {base!r}; registered methods: {', '.join(registered)}, or 'all'")
            if base == FULL_METHOD and overrides:
                raise ValueError(f"{name!r}: the full-cache reference takes no hyperparameters")
            expanded = [canonical_method_spec(name)]  # unknown or mistyped hyperparameters fail here
        for m in expanded:
            if m != FULL_METHOD and m not in out:
                out.append(m)
    return out


def parse_budgets(budgets: str | Sequence[int | float | str]) -> list[int | float]:
    """Validate budgets (``"128,256"`` or a list): integers >= 1 are token budgets, floats in (0, 1) ratios.

    Raises
    ------
    ValueError
        For a budget that is neither, or an empty list.
    """
    items = [b.strip() for b in budgets.split(",")] if isinstance(budgets, str) else list(budgets)
    items = [b for b in items if b != ""]
    if not items:
        raise ValueError("no budget given; use e.g. --budgets 128,256 or ratios such as 0.25")
    out: list[int | float] = []
    for b in items:
        value = Budget(b).value
        if value not in out:
            out.append(value)
    return out


def check_pairs(methods: Sequence[str], budgets: Sequence[int | float]) -> None:
    """Raise ValueError now for a (method, budget) pair the engine would refuse (e.g. a budget below the method's
    observation window), rather than in the middle of a run."""
    from ..hf.cache import SlakeCache

    for method in methods:
        for budget in budgets:
            SlakeCache(method, budget, 1)


def target_length(sample: Sample) -> int:
    """The length a sample was generated for (``metadata["target_length"]``), else its achieved length."""
    return int(sample.metadata.get("target_length", sample.length))


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """End-of-sequence ids from the tokenizer and the model's generation config."""
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    for src in (getattr(tokenizer, "eos_token_id", None), getattr(gen, "eos_token_id", None)):
        for i in src if isinstance(src, (list, tuple)) else [src]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


def encode_sample(sample: Sample, tokenizer: Any, *, query_aware: bool = True,
                  chat_template: bool = True) -> tuple[list[int], list[int]]:
    """Token ids of the prompt: ``(prefill_ids, question_ids)``.

    Query-aware: the whole prompt is prefilled and ``question_ids`` is empty. Question-agnostic: the context part
    is prefilled, the question part (with the chat template's closing tokens) is fed after compression. Special
    tokens (BOS) are added only when no chat template is used (the template writes its own).
    """
    use_chat = chat_template and sample.use_chat_template and has_chat_template(tokenizer)
    built = build_prompt(sample, tokenizer, chat_template=chat_template, query_aware=query_aware)
    if isinstance(built, str):
        return list(tokenizer.encode(built, add_special_tokens=not use_chat)), []
    context, question = built
    return (list(tokenizer.encode(context, add_special_tokens=not use_chat)),
            list(tokenizer.encode(question, add_special_tokens=False)) if question else [])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _model_name(model: Any) -> str:
    return str(getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__)


def _pairs(methods: Sequence[str], budgets: Sequence[int | float], include_full: bool) -> list[Pair]:
    pairs: list[Pair] = [(FULL_METHOD, None)] if include_full else []
    return pairs + [(m, b) for m in methods for b in budgets]


def _decode_text(tokenizer: Any, tokens: list[int], eos: list[int]) -> str:
    while tokens and tokens[-1] in eos:
        tokens = tokens[:-1]
    return str(tokenizer.decode(tokens, skip_special_tokens=True)).strip()


def run_suite(
    model: Any,
    tokenizer: Any,
    samples: Sequence[Sample],
    methods: str | Sequence[str],
    budgets: str | Sequence[int | float | str],
    out_dir: str | os.PathLike[str],
    *,
    suite: str = "custom",
    model_name: str | None = None,
    seed: int = 0,
    query_aware: bool = True,
    max_new_tokens: int | None = None,
    chat_template: bool = True,
    include_full: bool = True,
    progress: bool = True,
    prefill_chunk: int | None = None,
    batch_size: int = 1,
    kv_dtype: str | None = None,
) -> list[dict[str, Any]]:
    """Evaluate ``samples`` with the full cache and every (method, budget) pair; append rows to ``DIR/results.jsonl``.

    Parameters
    ----------
    model, tokenizer
        A causal LM prepared for slake (:func:`slake.load_model` or :func:`slake.prepare_model`) and its tokenizer
        (``encode``, ``decode`` and, for chat prompts, ``apply_chat_template``).
    samples : sequence of Sample
        The suite; the row's ``length`` is the sample's target length (:func:`target_length`).
    methods : str or sequence of str
        Method names or ``"all"`` (see :func:`resolve_methods`); any registered method works.
    budgets : str or sequence
        Token budgets (int) or ratios (float in (0, 1)). A budget at or above the prompt length is still run; the
        engine does no eviction and the row says ``compressed: false``.
    out_dir : path-like
        Output directory (created); rows go to ``results.jsonl``.
    suite : str
        Suite name stored in the rows (``needle``, ``ruler``, ``longbench`` ...).
    model_name : str, optional
        Model identifier stored in the rows (part of the resume key); ``config._name_or_path`` by default.
    seed : int
        The run's seed, stored in the rows.
    query_aware : bool
        True: question inside the prefill. False: compress the context, then feed the question.
    max_new_tokens : int, optional
        Global cap on each sample's ``max_new_tokens``.
    chat_template : bool
        Use the tokenizer's chat template when it has one (and the sample allows it).
    include_full : bool
        Run the full-cache reference row (method ``full``, budget None).
    progress : bool
        Show a tqdm progress bar over samples (with the time left).
    prefill_chunk : int, optional
        Measure chunked prefill instead of exact prefill: every compressed pair prefills the prompt live in chunks
        of this many tokens (:func:`slake.hf.generate.prefill`), so prefill-once does not apply to them. The
        full-cache row is unaffected (chunking changes nothing without eviction). Rows record ``prefill_chunk``.
    batch_size : int
        Decode up to this many samples of the same task together. Each sample is still prefilled alone; the
        captures are left-padded into one batch (:func:`slake.hf.prefill_once.stack_captures`) and every
        (method, budget) pair is replayed and decoded for the whole batch, which amortises the weight reads of a
        decode step over the batch (about 5x faster per sample at batch 8 on CPU). Greedy outputs equal those of
        ``batch_size=1`` up to floating-point reassociation in the padded batch. Rows record ``batch_size``; their
        ``decode_s`` and ``compress_s`` are the whole batch's. Query-aware, exact-prefill runs only.
    kv_dtype : str, optional
        ``"int8"`` or ``"fp8_e4m3"``: every pair (the full-cache row included) stores its kept keys and values in 8
        bits (:mod:`slake.cache.quant`). Rows record ``kv_dtype``; it is not part of the resume key, so write runs
        with different ``kv_dtype`` to different directories.

    Returns
    -------
    list of dict
        The rows written by this call (rows already present are skipped, never duplicated).
    """
    from tqdm.auto import tqdm

    from ..cache.quant import parse_kv_dtype

    kv_dtype = parse_kv_dtype(kv_dtype)
    method_names = resolve_methods(methods)
    budget_values = parse_budgets(budgets) if method_names else []
    check_pairs(method_names, budget_values)
    pairs = _pairs(method_names, budget_values, include_full)
    name = model_name or _model_name(model)
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if prefill_chunk is not None and (prefill_chunk < 1 or not query_aware):
        raise ValueError("prefill_chunk must be >= 1 and is only supported with query-aware prompts")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if batch_size > 1 and (prefill_chunk is not None or not query_aware):
        raise ValueError("batch_size > 1 needs query-aware prompts and exact prefill (no prefill_chunk): the "
                         "question of a question-agnostic run and chunked prefill are fed per sample")
    device = next(model.parameters()).device
    eos = eos_token_ids(model, tokenizer)
    written: list[dict[str, Any]] = []
    with ResultsWriter(out_dir) as store:
        check_engine_dir(store, "transformers")

        def todo(sample: Sample) -> list[Pair]:
            return [(m, b) for m, b in pairs if row_key({"task": sample.task, "sample_id": sample.sample_id,
                                                          "method": m, "budget": b, "length": target_length(sample),
                                                          "model": name,
                                                          "prefill_chunk": None if b is None else prefill_chunk})
                    not in store]

        pending = [(s, todo(s)) for s in samples]
        pending = [(s, p) for s, p in pending if p]
        batches = _batches(pending, batch_size)
        bar = tqdm(total=len(pending), desc=f"eval {suite}", unit="sample", disable=not progress,
                   dynamic_ncols=True)
        for batch, batch_pairs in batches:
            if len(batch) == 1:
                rows = _run_sample(model, tokenizer, batch[0], batch_pairs, device=device, eos=eos, suite=suite,
                                   model_name=name, seed=seed, query_aware=query_aware, cap=max_new_tokens,
                                   chat_template=chat_template, bar=bar, prefill_chunk=prefill_chunk,
                                   kv_dtype=kv_dtype)
            else:
                rows = _run_batch(model, tokenizer, batch, batch_pairs, device=device, eos=eos, suite=suite,
                                  model_name=name, seed=seed, cap=max_new_tokens, chat_template=chat_template,
                                  bar=bar, kv_dtype=kv_dtype)
            for row in rows:
                if store.write(row):
                    written.append(row)
            bar.update(len(batch))
        bar.close()
    return written


def _batches(pending: list[tuple[Sample, list[Pair]]], size: int) -> list[tuple[list[Sample], list[Pair]]]:
    """Group consecutive samples of the same task, generation length and pending pairs, ``size`` at most."""
    out: list[tuple[list[Sample], list[Pair]]] = []
    for sample, pairs in pending:
        if out:
            batch, batch_pairs = out[-1]
            head = batch[0]
            if (len(batch) < size and batch_pairs == pairs and head.task == sample.task
                    and head.max_new_tokens == sample.max_new_tokens):
                batch.append(sample)
                continue
        out.append(([sample], pairs))
    return out


def _method_for(model: Any, method: str, budget: int | float | None) -> tuple[Any, dict | None]:
    """The method of a (method, budget) pair with the model's profile applied (:mod:`slake.profiles`)."""
    from ..profiles import resolve_method

    if budget is None:
        return method, None
    return resolve_method(method, budget, model)


def _run_batch(model: Any, tokenizer: Any, samples: Sequence[Sample], pairs: Sequence[Pair], *,
               device: torch.device, eos: list[int], suite: str, model_name: str, seed: int, cap: int | None,
               chat_template: bool, bar: Any, kv_dtype: str | None = None) -> Iterator[dict[str, Any]]:
    """Prefill each sample once, stack the captures, then decode every (method, budget) pair for the batch."""
    captures: list[PrefillCapture] = []
    lengths: list[int] = []
    for sample in samples:
        prefill_ids, _ = encode_sample(sample, tokenizer, query_aware=True, chat_template=chat_template)
        if not prefill_ids:
            raise ValueError(f"sample {sample.sample_id!r} has an empty prompt")
        bar.set_postfix_str(f"prefill {sample.sample_id}", refresh=True)
        ids = torch.tensor([prefill_ids], dtype=torch.long, device=device)
        captures.append(capture_prefill(model, ids, torch.ones_like(ids)))
        lengths.append(len(prefill_ids))
    prefill_s = [c.prefill_s for c in captures]
    capture = stack_captures(captures, release=True)  # peak memory: one batch of records, not two
    captures.clear()
    caps = [s.max_new_tokens if cap is None else min(s.max_new_tokens, cap) for s in samples]
    max_new = max(caps)
    for method, budget in pairs:
        bar.set_postfix_str(f"{method} {'full' if budget is None else budget} x{len(samples)}", refresh=True)
        start = time.perf_counter()
        built, profile = _method_for(model, method, budget)
        cache = capture.replay(built, capture.prompt_len if budget is None else budget, kv_dtype=kv_dtype)
        _sync(device)
        compress_s = time.perf_counter() - start
        cache.check_routed()
        engine = cache.engine
        compressed = engine.info.compress.tolist()
        kv_bytes = [engine.byte_counts(i) for i in range(len(samples))]
        start = time.perf_counter()
        all_tokens = greedy_decode(model, capture, cache, max_new, eos)
        _sync(device)
        decode_s = time.perf_counter() - start
        for i, sample in enumerate(samples):
            tokens = all_tokens[i][:caps[i]]
            prediction = _decode_text(tokenizer, tokens, eos)
            yield {
                "suite": suite, "task": sample.task, "sample_id": sample.sample_id, "model": model_name,
                "method": method, "budget": budget, "length": target_length(sample), "prompt_tokens": lengths[i],
                "prediction": prediction, "answers": list(sample.answers),
                "score": float(score_prediction(sample, prediction)),
                "prefill_s": round(prefill_s[i], 5), "decode_s": round(decode_s, 5),
                "seed": seed, "query_aware": True, "compressed": bool(compressed[i]),
                "compress_s": round(compress_s, 5), "new_tokens": len(tokens), "max_new_tokens": caps[i],
                "depth": sample.depth, "metric": sample.metric, "kv_bytes": kv_bytes[i],
                "prefill_chunk": None, "batch_size": len(samples), "profile": profile, "kv_dtype": kv_dtype,
            }


def _run_sample(model: Any, tokenizer: Any, sample: Sample, pairs: Sequence[Pair], *, device: torch.device,
                eos: list[int], suite: str, model_name: str, seed: int, query_aware: bool, cap: int | None,
                chat_template: bool, bar: Any, prefill_chunk: int | None = None,
                kv_dtype: str | None = None) -> Iterator[dict[str, Any]]:
    """Prefill ``sample`` once, then yield one scored row per (method, budget) pair."""
    prefill_ids, question_ids = encode_sample(sample, tokenizer, query_aware=query_aware, chat_template=chat_template)
    if not prefill_ids:
        raise ValueError(f"sample {sample.sample_id!r} has an empty prompt")
    ids = torch.tensor([prefill_ids], dtype=torch.long, device=device)
    extra = torch.tensor([question_ids], dtype=torch.long, device=device) if question_ids else None
    capture = capture_prefill(model, ids, torch.ones_like(ids))
    prompt_tokens = len(prefill_ids) + len(question_ids)
    max_new = sample.max_new_tokens if cap is None else min(sample.max_new_tokens, cap)
    for method, budget in pairs:
        bar.set_postfix_str(f"{method} {'full' if budget is None else budget}", refresh=False)
        start = time.perf_counter()
        chunk = None if budget is None else prefill_chunk
        built, profile = _method_for(model, method, budget)
        if chunk is None:
            cache = capture.replay(built, len(prefill_ids) if budget is None else budget, kv_dtype=kv_dtype)
            source = capture
        else:  # chunked prefill is measured live: each chunk attends over the compressed past
            cache = SlakeCache(built, budget, model.config.num_hidden_layers, prefill_chunk=chunk,
                                kv_dtype=kv_dtype)
            logits = prefill(model, cache, ids, torch.ones_like(ids), prefill_chunk=chunk)
            source = PrefillCapture(records=[], attention_mask=torch.ones_like(ids), last_logits=logits.float(),
                                    prefill_s=time.perf_counter() - start)
        _sync(device)
        compress_s = time.perf_counter() - start
        stats = cache.statistics()
        start = time.perf_counter()
        tokens = greedy_decode(model, source, cache, max_new, eos, extra_ids=extra)[0]
        _sync(device)
        decode_s = time.perf_counter() - start
        prediction = _decode_text(tokenizer, tokens, eos)
        yield {
            "suite": suite, "task": sample.task, "sample_id": sample.sample_id, "model": model_name,
            "method": method, "budget": budget, "length": target_length(sample), "prompt_tokens": prompt_tokens,
            "prediction": prediction, "answers": list(sample.answers), "score": float(score_prediction(sample,
                                                                                                      prediction)),
            "prefill_s": round(capture.prefill_s, 5), "decode_s": round(decode_s, 5), "seed": seed,
            "query_aware": query_aware, "compressed": bool(stats["compressed"]), "compress_s": round(compress_s, 5),
            "new_tokens": len(tokens), "max_new_tokens": max_new, "depth": sample.depth, "metric": sample.metric,
            "kv_bytes": stats["kv_bytes"], "prefill_chunk": chunk, "profile": profile, "kv_dtype": kv_dtype,
        }
