"""Whether a resumed evaluation is the run its results directory was written by: the settings, profiles, metrics
and prompts of the rows already in ``DIR/results.jsonl`` (:mod:`slake.eval.results`) against the run about to add
to them. A resumed run skips every row key already present, so rows of another model file, storage dtype, profile,
metric or prompt under the same keys would be summarised beside the new ones as one experiment; each check raises
``ValueError`` naming what differs instead.
"""

from __future__ import annotations

import json
from typing import Any

from slake.eval.results import ResultsWriter, canonical_budget

__all__ = [
    "PER_MODEL_SETTINGS",
    "RUN_SETTINGS",
    "check_ids_digests",
    "check_metrics",
    "check_profiles",
    "check_run_settings",
    "check_sample_digests",
]

#: A value that rows written before a setting was recorded stand for: unknown, so not compared.
_UNRECORDED = object()

#: The settings one results directory is written with, which :func:`row_key` does not name: row field ->
#: (the command-line option that sets it, its value in rows written before the field existed).
RUN_SETTINGS: dict[str, tuple[str, Any]] = {
    "engine": ("--engine", "transformers"),
    "query_aware": ("--question-agnostic", True),
    "kv_dtype": ("--kv-dtype", None),
    "chat_template": ("--no-chat-template", _UNRECORDED),
    "new_tokens_cap": ("--max-new-tokens", _UNRECORDED),
    "model_dtype": ("--dtype", _UNRECORDED),
    "gguf_file": ("--gguf-file", _UNRECORDED),
    "weights": ("other weights under the same --model name", _UNRECORDED),
}


def check_profiles(store: ResultsWriter, model: str, expected: dict[tuple[str, Any], dict | None]) -> None:
    """Raise ``ValueError`` when ``store`` holds rows of ``model`` at a (method, budget) of ``expected`` made with
    other profile values than ``expected`` gives it (the ``values`` of the entry a pair will run with, None for none:
    :func:`slake.methods.profiles.resolve_method`).

    :func:`row_key` does not name the profile, and ``$SLAKE_NO_PROFILE``, ``$SLAKE_PROFILE_DIR`` or a new
    ``slake calibrate`` change it: a rerun would take the earlier rows for its own and one summary line would mix
    two sets of hyperparameters. Rows that do not record a profile (written before it was recorded) are not compared.
    """
    wanted = {(m, canonical_budget(b)): None if p is None else p.get("values") for (m, b), p in expected.items()}
    differ: dict[tuple[str, Any], set[str]] = {}
    for r in store.scan.rows:
        pair = (str(r.get("method")), canonical_budget(r.get("budget")))
        if str(r.get("model")) != model or pair not in wanted or "profile" not in r:
            continue
        stored = None if r["profile"] is None else r["profile"].get("values")
        if stored != wanted[pair]:
            differ.setdefault(pair, set()).add(json.dumps(stored, sort_keys=True))
    if differ:
        parts = [
            f"{m} at {b}: {' and '.join(sorted(old))} where this run applies "
            f"{json.dumps(wanted[(m, b)], sort_keys=True)}"
            for (m, b), old in sorted(differ.items(), key=str)
        ]
        raise ValueError(
            f"{store.path} holds rows made with other profile values ({'; '.join(parts)}; null: no profile). The "
            "resume key does not name the profile ($SLAKE_NO_PROFILE, $SLAKE_PROFILE_DIR and slake calibrate change "
            "it), so this run would take those rows for its own: write it to its own --out directory"
        )


def check_metrics(store: ResultsWriter, model: str, metrics: dict[tuple[str, str, int], str]) -> None:
    """Raise ``ValueError`` when ``store`` holds rows of ``model`` for a sample of ``metrics`` (``{(task, sample_id,
    length): metric}``) scored with another metric (a plain ``--suite ruler`` run, then ``--protocol kvpress``, which
    scores the same samples with kvpress's cleaning, in the same directory). Rows without a metric are not compared.
    """
    for r in _rows_differing(store, model, "metric", metrics):
        key = _sample_key(r)
        raise ValueError(
            f"{store.path} holds rows of {key[1]} scored with the metric {r['metric']!r}, where this run scores it "
            f"with {metrics[key]!r}; the resume key does not name the metric, so this run would take those rows for "
            "its own: write it to its own --out directory"
        )


def check_sample_digests(store: ResultsWriter, model: str, digests: dict[tuple[str, str, int], str]) -> None:
    """Raise ``ValueError`` when ``store`` holds rows of ``model`` for a sample of ``digests`` (``{(task, sample_id,
    length): digest}``, :func:`slake.eval.sample.sample_digest`) made from another prompt under the same id.

    The resume key names the sample by its id, which the text does not enter: rows made from the other essay package,
    a generator whose wording has changed or an edited LongBench file would be taken for this run's and summarised as
    its own. Rows without a digest (written before it was recorded) are not compared.
    """
    if shown := _samples_differing(store, model, "sample_digest", digests):
        raise ValueError(
            f"{store.path} holds rows of {shown} made from another prompt than this run's sample of the same id (other "
            "essays or data installed, or a generator or dataset file that has changed since); the resume key names "
            "the sample by its id, so this run would take those rows for its own: write it to its own --out directory"
        )


def check_ids_digests(store: ResultsWriter, model: str, digests: dict[tuple[str, str, int], str]) -> None:
    """Raise ``ValueError`` when ``store`` holds rows of ``model`` for a sample of ``digests`` (``{(task, sample_id,
    length): digest}``, :func:`slake.eval.encoding.ids_digest`, for the samples this run will add rows to) made from
    other token ids than this run's: the same text tokenized otherwise (another tokenizer under the same model name, a
    transformers release that tokenizes it differently, a change to how prompts are encoded). The new rows would sit
    beside the old ones in one sample's comparisons. Rows without the digest (written before it was recorded) are not
    compared."""
    if shown := _samples_differing(store, model, "ids_digest", digests):
        raise ValueError(
            f"{store.path} holds rows of {shown} made from other token ids than this run's prompt of the same text "
            "(another tokenizer or transformers release, or another way of encoding prompts); this run would add rows "
            "beside them and compare methods on two prompts: write it to its own --out directory"
        )


def _samples_differing(store: ResultsWriter, model: str, field: str, wanted: dict[tuple[str, str, int], str]) -> str:
    """The sample ids of :func:`_rows_differing`'s rows, first five named (``"a, b and 3 more"``); ``""`` for none."""
    differ = list(dict.fromkeys(_sample_key(r)[1] for r in _rows_differing(store, model, field, wanted)))
    return ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")


def _sample_key(row: dict[str, Any]) -> tuple[str, str, int]:
    """``(task, sample_id, length)``: the sample a row answers."""
    return (str(row.get("task")), str(row.get("sample_id")), int(row.get("length", -1)))


def _rows_differing(
    store: ResultsWriter, model: str, field: str, wanted: dict[tuple[str, str, int], Any]
) -> list[dict[str, Any]]:
    """The rows of ``model`` for a sample of ``wanted`` whose ``field`` is recorded and differs from the sample's
    value there (rows without the field, written before it was recorded, are not compared)."""
    return [
        r
        for r in store.scan.rows
        if str(r.get("model")) == model
        and _sample_key(r) in wanted
        and r.get(field) is not None
        and r.get(field) != wanted[_sample_key(r)]
    ]


#: settings of one model's rows: a directory may hold several models (the resume key names the model), each with its
#: own weights and GGUF file
PER_MODEL_SETTINGS = frozenset({"gguf_file", "weights"})


def check_run_settings(store: ResultsWriter, settings: dict[str, Any], model: str | None = None) -> None:
    """Raise ``ValueError`` when ``store`` holds rows written with other :data:`RUN_SETTINGS` than ``settings``.

    :func:`row_key` names the sample, method, budget, length, model and chunked prefill, not these settings: a rerun
    with another value would find the earlier rows under its keys, skip its own as done, and summarise the earlier
    ones as its own. So one directory serves one engine, one kind of prompt (query-aware or not), one storage
    (``--kv-dtype``), one chat-template choice, one cap on new tokens, one model dtype, one GGUF file and one set of
    weights (``weights``: a digest of the weights, where the engine reads them) per model name. Rows that do not
    record a setting (written before it was recorded) are not compared on it; a ``weights`` of None (an engine that
    cannot read its weights) is not compared either. :data:`PER_MODEL_SETTINGS` are compared with the rows of
    ``model`` only (with every row when ``model`` is None).
    """
    differ = []
    for name, value in settings.items():
        if name == "weights" and value is None:
            continue
        flag, unrecorded = RUN_SETTINGS[name]
        rows = store.scan.rows
        if name in PER_MODEL_SETTINGS and model is not None:
            rows = [r for r in rows if str(r.get("model")) == model]
        seen = {json.dumps(r.get(name, unrecorded)) for r in rows if name in r or unrecorded is not _UNRECORDED}
        other = sorted(seen - {json.dumps(value)})
        if other:
            differ.append(f"{name} {' and '.join(other)} where this run has {json.dumps(value)} ({flag})")
    if differ:
        raise ValueError(
            f"{store.path} holds rows written with other settings: {'; '.join(differ)}. The resume key does not name "
            f"them, so this run would take those rows for its own: write it to its own --out directory"
        )
