"""The evaluation runner: samples x (full reference + methods x budgets), on any engine, resumable.

:func:`evaluate_suite` encodes every sample's prompt (:func:`encode_sample`: chat template, question last), skips the
(sample, method, budget) rows already in ``DIR/results.jsonl`` (:func:`slake.eval.results.row_key`), hands the rest to
the engine (:meth:`slake.engines.base.Engine.evaluate`), scores what comes back and appends one row per output
(:func:`build_row`, the one builder of result rows), flushed as soon as it is scored. How the engine generates is
its own affair: the transformers engine prefills each sample once and replays every pair from it; the vLLM engine
runs every sample of a pair as one batch.

Query-aware (default): the question is at the end of the prompt, inside the prefill and the observation window.
Question-agnostic: the context alone is prefilled and compressed, then the question is fed and the answer generated.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slake.budgets.budget import Budget
from slake.engines.base import EvalOptions, EvalOutput, EvalRequest, Pair
from slake.engines.context import check_context
from slake.eval.encoding import encode_sample, ids_digest
from slake.eval.metrics import score_prediction
from slake.eval.progress import TimeLeft
from slake.eval.provenance import code_version, describe_other_code, rows_of_other_code
from slake.eval.results import FULL_METHOD, ResultsWriter, row_key
from slake.eval.resume_checks import (
    check_ids_digests,
    check_metrics,
    check_profiles,
    check_run_settings,
    check_sample_digests,
)
from slake.eval.sample import Sample, sample_digest
from slake.methods.budget_check import check_budget_at_length, check_method_budget

if TYPE_CHECKING:
    from slake.engines.base import Engine

__all__ = [
    "build_row",
    "check_pairs",
    "check_requests_fit",
    "check_results_directory",
    "decode_text",
    "encode_sample",
    "evaluate_suite",
    "parse_budgets",
    "repeated_samples",
    "resolve_methods",
    "run_settings",
    "run_suite",
    "target_length",
]


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
    from slake.methods import available_methods
    from slake.methods.base import canonical_method_spec
    from slake.methods.spec import parse_method_spec, split_method_list

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
    """Raise ValueError now for a (method, budget) pair the compressor would refuse (e.g. a budget below the
    method's observation window), rather than in the middle of a run."""
    for method in methods:
        for budget in budgets:
            check_method_budget(method, budget)


def target_length(sample: Sample) -> int:
    """The length a sample was generated for (``metadata["target_length"]``), else its achieved length."""
    return int(sample.metadata.get("target_length", sample.length))


def decode_text(tokenizer: Any, tokens: list[int], eos: list[int]) -> str:
    """The prediction of a generation: trailing end-of-sequence ids dropped, special tokens skipped, and nothing else
    removed. LongBench scores the text as generated (its ``pred.py`` does not strip it): a code line's indentation is
    part of what ``code_sim_score`` compares with the answer (lcc, repobench-p), and each metric takes what it needs
    (the first line, normalised words)."""
    while tokens and tokens[-1] in eos:
        tokens = tokens[:-1]
    return str(tokenizer.decode(tokens, skip_special_tokens=True))


def build_row(
    sample: Sample,
    out: EvalOutput,
    *,
    prediction: str,
    suite: str,
    model_name: str,
    seed: int,
    settings: dict[str, Any],
    ids: str | None = None,
) -> dict[str, Any]:
    """The result row of one (sample, method, budget), whatever the engine: the fields of
    :data:`slake.eval.results.ROW_FIELDS`, the run's settings (:data:`slake.eval.resume_checks.RUN_SETTINGS`:
    ``engine``, ``query_aware``, ``kv_dtype``, ``chat_template``, ``new_tokens_cap``, ``model_dtype``, ``gguf_file``,
    ``weights``), the sample's digest (``sample_digest``: :func:`slake.eval.sample.sample_digest`), the code that
    made the row (``code_version``: :func:`slake.eval.provenance.code_version`), the digest of the prompt's token ids
    where given (``ids_digest``: ``ids``, :func:`slake.eval.encoding.ids_digest`), the output's accounting, and the
    engine's own fields (``out.extra``)."""
    row: dict[str, Any] = {
        "suite": suite,
        "task": sample.task,
        "sample_id": sample.sample_id,
        "model": model_name,
        "method": out.method,
        "budget": out.budget,
        "length": target_length(sample),
        "prompt_tokens": out.prompt_tokens,
        "prediction": prediction,
        "answers": list(sample.answers),
        "score": float(score_prediction(sample, prediction)),
        "prefill_s": out.prefill_s,
        "decode_s": out.decode_s,
        "seed": seed,
        "query_aware": settings["query_aware"],
        "compressed": out.compressed,
        "new_tokens": len(out.tokens),
        "max_new_tokens": out.max_new_tokens,
        "depth": sample.depth,
        "metric": sample.metric,
        "kv_bytes": out.kv_bytes,
        "prefill_chunk": out.prefill_chunk,
        "batch_size": out.batch_size,
        "profile": out.profile,
        "sample_digest": sample_digest(sample),
        "code_version": code_version(),
    }
    if ids is not None:
        row["ids_digest"] = ids
    row.update(settings)
    if out.hyperparameters is not None:
        row["hyperparameters"] = out.hyperparameters
    row.update(out.extra)
    return row


def run_settings(
    engine: Engine, options: EvalOptions, *, chat_template: bool, max_new_tokens: int | None
) -> dict[str, Any]:
    """The settings a run writes into its rows and a results directory must agree on
    (:data:`slake.eval.resume_checks.RUN_SETTINGS`, :func:`slake.eval.resume_checks.check_run_settings`)."""
    return {
        "engine": engine.name,
        "query_aware": options.query_aware,
        "kv_dtype": options.kv_dtype,
        "chat_template": chat_template,
        "new_tokens_cap": max_new_tokens,
        "model_dtype": engine.model_dtype,
        "gguf_file": Path(engine.model_spec.gguf_file).name if engine.model_spec.gguf_file else None,
        "weights": engine.weights_digest,
    }


def check_results_directory(
    store: ResultsWriter,
    engine: Engine,
    *,
    name: str,
    settings: dict[str, Any],
    pairs: Sequence[Pair],
    samples: Sequence[Sample],
) -> None:
    """Raise ``ValueError`` when the results directory ``store`` holds rows this run would take for its own but
    that were made otherwise: with other :data:`slake.eval.resume_checks.RUN_SETTINGS` (weights and GGUF file
    compared with the rows of model ``name``: :func:`slake.eval.resume_checks.check_run_settings`), other profile
    values for one of ``pairs`` (:func:`slake.eval.resume_checks.check_profiles`, where the engine knows them before
    running: :meth:`slake.engines.base.Engine.profile_for`), or another metric or another prompt for one of ``samples``
    (:func:`slake.eval.resume_checks.check_metrics`, :func:`slake.eval.resume_checks.check_sample_digests`).
    :func:`evaluate_suite` calls it before running, and ``slake eval --protocol`` before it writes the kvpress side's
    requests."""
    check_run_settings(store, settings, model=name)
    profiles = {pair: engine.profile_for(*pair) for pair in pairs}
    check_profiles(store, name, {pair: p for pair, (known, p) in profiles.items() if known})
    check_metrics(store, name, {(s.task, s.sample_id, target_length(s)): s.metric for s in samples})
    check_sample_digests(store, name, {(s.task, s.sample_id, target_length(s)): sample_digest(s) for s in samples})


def check_requests_fit(requests: Sequence[EvalRequest], samples: Sequence[Sample], limit: int | None) -> None:
    """Raise ValueError, before anything runs, when a request's prompt plus its new tokens reach past the model's
    context ``limit`` (:mod:`slake.engines.context`): its scores would measure the model beyond what it was trained
    on, not the method. The message names the longest such sample and how many there are."""
    if limit is None:
        return
    over = [r for r in requests if len(r.prefill_ids) + len(r.question_ids) + r.max_new_tokens > limit]
    if not over:
        return
    worst = max(over, key=lambda r: len(r.prefill_ids) + len(r.question_ids) + r.max_new_tokens)
    others = f" ({len(over)} of the {len(requests)} samples to run are)" if len(over) > 1 else ""
    sample = samples[worst.key]
    check_context(
        limit,
        len(worst.prefill_ids) + len(worst.question_ids),
        worst.max_new_tokens,
        what=f"sample {sample.sample_id!r} (length {target_length(sample)}){others} has",
    )


def _run_key(sample: Sample, method: str, budget: Any, name: str, prefill_chunk: int | None) -> Any:
    """The resume key of the row this run would write for ``sample`` and (``method``, ``budget``)."""
    return row_key(
        {
            "task": sample.task,
            "sample_id": sample.sample_id,
            "method": method,
            "budget": budget,
            "length": target_length(sample),
            "model": name,
            "prefill_chunk": None if budget is None else prefill_chunk,
        }
    )


def check_fidelity_rows(
    store: ResultsWriter, name: str, pairs: Sequence[Pair], samples: Sequence[Sample], prefill_chunk: int | None
) -> None:
    """Raise ``ValueError`` when a run with ``fidelity`` would resume compressed rows written without it: they have
    no distance to the full cache (``kl``, ``kl_tokens``), and the run would end with none for them and without a
    word (the fidelity table then leaves them out). Rows of pairs or samples this run does not ask for are not
    looked at."""
    without = {row_key(r) for r in store.scan.rows if r.get("budget") is not None and "kl_tokens" not in r}
    if not without:
        return
    hits = [
        (s, m, b)
        for s in samples
        for m, b in pairs
        if b is not None and _run_key(s, m, b, name, prefill_chunk) in without
    ]
    if hits:
        s, m, b = hits[0]
        raise ValueError(
            f"--fidelity: {len(hits)} compressed row(s) in {store.path} this run would resume were written without "
            f"--fidelity (e.g. {m} at budget {b}, sample {s.sample_id!r}) and have no distance to the full cache; use "
            f"another --out, or remove those rows to measure them again"
        )


def check_ratio_budgets(requests: Sequence[EvalRequest]) -> None:
    """Raise ValueError, before anything runs, where a ratio budget of the shortest prompt that asks for it leaves
    fewer tokens than the method protects (:func:`slake.methods.budget_check.check_budget_at_length`): the prefill
    would refuse it after the rows before it ran. A prompt's length here is its prefill and question tokens."""
    shortest: dict[tuple[str, float], int] = {}
    for r in requests:
        length = len(r.prefill_ids) + len(r.question_ids)
        for m, b in r.pairs:
            if isinstance(b, float):
                shortest[(m, b)] = min(length, shortest.get((m, b), length))
    for (method, ratio), length in shortest.items():
        check_budget_at_length(method, ratio, length)


def repeated_samples(samples: Sequence[Sample]) -> set[int]:
    """Indices of the samples that repeat an earlier one of ``samples``: the same task, sample id and target length
    (a row's key, with the method and budget) and the same prompt (:func:`slake.eval.sample.sample_digest`). A run
    runs such a sample once; its rows would be the first's.

    Raises
    ------
    ValueError
        When two samples share a task, sample id and target length but ask different things: only the first one's
        rows could be written (the results store keeps one row per key), and the other's outputs would be computed
        and dropped without a word. The message names the id; give each sample its own id.
    """
    seen: dict[tuple[str, str, int], str] = {}
    repeats: set[int] = set()
    for i, s in enumerate(samples):
        key, digest = (s.task, s.sample_id, target_length(s)), sample_digest(s)
        if key not in seen:
            seen[key] = digest
        elif seen[key] == digest:
            repeats.add(i)
        else:
            raise ValueError(
                f"two samples of task {s.task!r} at length {key[2]} share the sample id {s.sample_id!r} but ask "
                "different things: a row's key names the sample by its id, so only one of them could be scored; "
                "give each sample its own id"
            )
    return repeats


def _pairs(methods: Sequence[str], budgets: Sequence[int | float], include_full: bool) -> list[Pair]:
    pairs: list[Pair] = [(FULL_METHOD, None)] if include_full else []
    return pairs + [(m, b) for m in methods for b in budgets]


def evaluate_suite(
    engine: Engine,
    samples: Sequence[Sample],
    methods: str | Sequence[str],
    budgets: str | Sequence[int | float | str],
    out_dir: str | os.PathLike[str],
    *,
    suite: str = "custom",
    model_name: str | None = None,
    seed: int = 0,
    max_new_tokens: int | None = None,
    chat_template: bool = True,
    include_full: bool = True,
    progress: bool = True,
    options: EvalOptions | None = None,
) -> list[dict[str, Any]]:
    """Evaluate ``samples`` with the full cache and every (method, budget) pair on ``engine``; append rows to
    ``DIR/results.jsonl``.

    Parameters
    ----------
    engine : slake.engines.base.Engine
        What generates (its tokenizer encodes the prompts).
    samples : sequence of Sample
        The suite; the row's ``length`` is the sample's target length (:func:`target_length`). A sample given twice
        runs once; two samples of one task, id and target length that ask different things are refused
        (:func:`repeated_samples`).
    methods : str or sequence of str
        Method names or ``"all"`` (see :func:`resolve_methods`); ``"full"`` or an empty list runs the full-cache
        reference alone.
    budgets : str or sequence
        Token budgets (int) or ratios (float in (0, 1)). A budget at or above the prompt length is still run; no
        eviction happens and the row says ``compressed: false``.
    out_dir : path-like
        Output directory (created); rows go to ``results.jsonl``. One directory holds one engine's rows.
    suite : str
        Suite name stored in the rows (``needle``, ``ruler``, ``longbench`` ...).
    model_name : str, optional
        Model identifier stored in the rows (part of the resume key); the engine's model name by default.
    seed : int
        The run's seed, stored in the rows.
    max_new_tokens : int, optional
        Global cap on each sample's ``max_new_tokens``.
    chat_template : bool
        Use the tokenizer's chat template when it has one (and the sample allows it).
    include_full : bool
        Run the full-cache reference row (method ``full``, budget None).
    progress : bool
        Show a tqdm progress bar over the generations, with the estimated time left
        (:class:`slake.eval.progress.TimeLeft`).
    options : EvalOptions, optional
        Question-agnostic prompts, chunked prefill, batch size, 8-bit storage, a prefill cache, fidelity rows,
        prompts beyond the model's context (:class:`EvalOptions`: without ``allow_long_context``, a prompt whose
        tokens plus its new ones exceed :attr:`~slake.engines.base.Engine.context_limit` is refused before anything
        runs, :func:`check_requests_fit`); the engine refuses what it cannot honour
        (:meth:`slake.engines.base.Engine.check`). The resume key does not name the run's settings (engine,
        query-aware prompts, ``kv_dtype``, ``chat_template``, ``max_new_tokens``, the model's dtype): a directory
        holding rows of other settings is refused (:func:`slake.eval.resume_checks.check_run_settings`). Rows resumed
        from a run without ``fidelity`` have no distance fields. Resumed rows that another code version wrote
        (:func:`slake.eval.provenance.rows_of_other_code`) are kept, with a warning on the ``slake`` logger.

    Returns
    -------
    list of dict
        The rows written by this call (rows already present are skipped, never duplicated).
    """
    from tqdm.auto import tqdm

    from slake.cache.quant import parse_kv_dtype

    opts = options or EvalOptions()
    opts = dataclasses.replace(opts, kv_dtype=parse_kv_dtype(opts.kv_dtype))
    # an empty list is what resolve_methods returns for ``--methods full``: the reference alone
    method_names = resolve_methods(methods) if isinstance(methods, str) or methods else []
    budget_values = parse_budgets(budgets) if method_names else []
    for m in method_names:
        for b in budget_values:
            engine.check_pair(m, b)
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if opts.prefill_chunk is not None and (opts.prefill_chunk < 1 or not opts.query_aware):
        raise ValueError("prefill_chunk must be >= 1 and is only supported with query-aware prompts")
    if not isinstance(opts.batch_size, int) or opts.batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {opts.batch_size!r}")
    if opts.batch_size > 1 and (opts.prefill_chunk is not None or not opts.query_aware):
        raise ValueError(
            "batch_size > 1 needs query-aware prompts and exact prefill (no prefill_chunk): the "
            "question of a question-agnostic run and chunked prefill are fed per sample"
        )
    if opts.fidelity and (opts.prefill_chunk is not None or not opts.query_aware):
        raise ValueError("fidelity needs query-aware prompts and exact prefill (no prefill_chunk)")
    engine.check(
        prefill_chunk=opts.prefill_chunk,
        question_agnostic=not opts.query_aware,
        kv_dtype=opts.kv_dtype,
        prefill_cache=opts.prefill_cache,
        fidelity=opts.fidelity,
        allow_long_context=opts.allow_long_context,
    )
    repeats = repeated_samples(samples)
    pairs = _pairs(method_names, budget_values, include_full)
    name = model_name or engine.model_name
    tokenizer = engine.tokenizer
    eos = engine.eos_token_ids()
    written: list[dict[str, Any]] = []
    with ResultsWriter(out_dir) as store:
        settings = run_settings(engine, opts, chat_template=chat_template, max_new_tokens=max_new_tokens)
        check_results_directory(store, engine, name=name, settings=settings, pairs=pairs, samples=samples)
        if opts.fidelity:
            check_fidelity_rows(store, name, pairs, samples, opts.prefill_chunk)
        resumed = {_run_key(s, m, b, name, opts.prefill_chunk) for s in samples for m, b in pairs} & store.done
        if other := rows_of_other_code(store.scan.rows, resumed, code_version()):
            logging.getLogger("slake").warning(describe_other_code(other, code_version(), store.path))
        requests: list[EvalRequest] = []
        encoded: dict[int, str] = {}  # the ids digest of every sample this run adds rows to
        for i, s in enumerate(samples):
            if i in repeats:
                continue
            todo = tuple((m, b) for m, b in pairs if _run_key(s, m, b, name, opts.prefill_chunk) not in store)
            if not todo:
                continue
            prefill_ids, question_ids = encode_sample(
                s, tokenizer, query_aware=opts.query_aware, chat_template=chat_template
            )
            if not prefill_ids:
                raise ValueError(f"sample {s.sample_id!r} has an empty prompt")
            encoded[i] = ids_digest(prefill_ids, question_ids)
            cap = s.max_new_tokens if max_new_tokens is None else min(s.max_new_tokens, max_new_tokens)
            requests.append(
                EvalRequest(
                    key=i,
                    prefill_ids=prefill_ids,
                    question_ids=question_ids,
                    max_new_tokens=cap,
                    group=s.task,
                    pairs=todo,
                )
            )
        keys = {(samples[i].task, samples[i].sample_id, target_length(samples[i])): d for i, d in encoded.items()}
        check_ids_digests(store, name, keys)
        if not opts.allow_long_context:
            check_requests_fit(requests, samples, engine.context_limit)
        check_ratio_budgets(requests)
        left = TimeLeft(requests, whole_prompts=getattr(engine, "prefills_once", False))
        bar = tqdm(
            total=sum(len(r.pairs) for r in requests),
            desc=f"eval {suite} ({engine.name})",
            unit="run",
            disable=not progress,
            dynamic_ncols=True,
            # the time left comes from TimeLeft (work weighted by prompt tokens), not from tqdm's count of outputs
            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} runs [{elapsed}{postfix}]",
        )
        bar.set_postfix_str(left.describe(), refresh=True)
        for out in engine.evaluate(requests, opts):
            sample = samples[out.key]
            row = build_row(
                sample,
                out,
                prediction=decode_text(tokenizer, list(out.tokens), eos),
                suite=suite,
                model_name=name,
                seed=seed,
                settings=settings,
                ids=encoded[out.key],
            )
            if store.write(row):
                written.append(row)
            left.update(out.key)
            pair = f"{out.method} {'full' if out.budget is None else out.budget}"
            bar.set_postfix_str(f"{left.describe()}, {pair}", refresh=False)
            bar.update(1)
        bar.close()
    return written


def run_suite(
    model: Any,
    tokenizer: Any,
    samples: Sequence[Sample],
    methods: str | Sequence[str],
    budgets: str | Sequence[int | float | str],
    out_dir: str | os.PathLike[str],
    *,
    query_aware: bool = True,
    prefill_chunk: int | None = None,
    batch_size: int = 1,
    kv_dtype: str | None = None,
    prefill_cache: str | os.PathLike[str] | None = None,
    fidelity: bool = False,
    allow_long_context: bool = False,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """:func:`evaluate_suite` on a loaded transformers model (the Python API's shortcut).

    ``model`` is prepared for slake (:func:`slake.load_model` or :func:`slake.prepare_model`); the model name of the
    rows is ``model_name`` if given, else ``config._name_or_path``.

    Parameters
    ----------
    model : Any
        A transformers causal LM prepared for slake.
    tokenizer : Any
        Its tokenizer.
    samples, methods, budgets, out_dir
        As in :func:`evaluate_suite`.
    query_aware, prefill_chunk, batch_size, kv_dtype, prefill_cache, fidelity, allow_long_context
        The fields of the run's :class:`EvalOptions`.
    **kwargs
        The other keywords of :func:`evaluate_suite` (``suite``, ``model_name``, ``seed``, ``max_new_tokens``,
        ``chat_template``, ``include_full``, ``progress``).

    Returns
    -------
    list of dict
        As :func:`evaluate_suite`.
    """
    from slake.engines.transformers import TransformersEngine

    engine = TransformersEngine.from_model(model, tokenizer)
    options = EvalOptions(
        query_aware=query_aware,
        prefill_chunk=prefill_chunk,
        batch_size=batch_size,
        kv_dtype=kv_dtype,
        prefill_cache=None if prefill_cache is None else str(prefill_cache),
        fidelity=fidelity,
        allow_long_context=allow_long_context,
    )
    return evaluate_suite(engine, samples, methods, budgets, out_dir, options=options, **kwargs)
