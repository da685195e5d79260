"""Evaluation protocols: one ``slake eval --protocol NAME`` flag sets the suite, length, ratios, scoring and prompt
layout of a published leaderboard, so that our methods and the leaderboard's own are run the same way.

``kvpress`` is NVIDIA kvpress's leaderboard (``evaluation/leaderboard.sh``, first loop): RULER at 4096 tokens,
question-agnostic compression (the context is compressed without the question, which is fed afterwards), compression
ratios 0.25, 0.5, 0.75 and 0.875, each task scored by kvpress's ``calculate_metrics`` (the prediction stripped and
its control characters removed, then ``string_match_part`` for the ``qa`` tasks and ``string_match_all`` for the
others, in percent) and the tasks averaged.

kvpress's ``compression_ratio`` is the fraction of the context's KV pairs REMOVED (``n_kept = int(S * (1 -
ratio))``); slake's ratio budget is the fraction KEPT (``ceil(budget * S)``). The protocol runs our methods at
``budget = 1 - compression_ratio``: 0.75, 0.5, 0.25 and 0.125 of the context kept. The two roundings differ by at
most one token per layer and head.

kvpress's presses run in their own environment (``tools/kvpress_protocol/kvpress_side.py``) on the very token ids
our side prefills: :func:`write_requests` writes them next to the results, the kvpress side writes its generations,
and :func:`merge_outputs` turns them into result rows (method ``kvpress:<press>``) beside ours, scored by the same
function (:mod:`slake.eval.protocol_outputs`).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from slake.eval.metrics import kvpress_ruler_metric
from slake.eval.sample import Sample

__all__ = [
    "PROTOCOLS",
    "REQUESTS_FILE",
    "Protocol",
    "budget_of_ratio",
    "ratio_of_budget",
    "resolve_protocol_args",
    "model_location",
    "protocol_samples",
    "read_requests",
    "write_requests",
]

#: the file :func:`write_requests` writes into the results folder, read by the kvpress side
REQUESTS_FILE = "kvpress_requests.json"

#: the fields of the requests file, and of each of its requests, that the merge and the kvpress side read
_FILE_FIELDS = ("protocol", "model", "requests")
_REQUEST_FIELDS = ("task", "sample_id", "length", "prefill_ids", "question_ids", "max_new_tokens", "answers", "metric")


@dataclass(frozen=True)
class Protocol:
    """What a protocol fixes.

    Attributes
    ----------
    name : str
        The ``--protocol`` value.
    suite : str
        The ``slake eval`` suite.
    length : int
        The context length in tokens.
    compression_ratios : tuple of float
        The leaderboard's ratios, as the leaderboard states them (fraction removed).
    question_agnostic : bool
        Whether the context is compressed without the question.
    source : str
        Where the protocol is defined.
    """

    name: str
    suite: str
    length: int
    compression_ratios: tuple[float, ...]
    question_agnostic: bool
    source: str

    @property
    def budgets(self) -> list[float]:
        """slake's ratio budgets (fraction kept), in the order of :attr:`compression_ratios`."""
        return [budget_of_ratio(r) for r in self.compression_ratios]

    def metric(self, task: str) -> str:
        """The metric of a task under this protocol (:func:`slake.eval.metrics.score_sample` names)."""
        return kvpress_ruler_metric(task)


PROTOCOLS: dict[str, Protocol] = {
    "kvpress": Protocol(
        name="kvpress",
        suite="ruler",
        length=4096,
        compression_ratios=(0.25, 0.5, 0.75, 0.875),
        question_agnostic=True,
        source="NVIDIA/kvpress evaluation/leaderboard.sh (first loop) and evaluation/benchmarks/ruler/"
        "calculate_metrics.py",
    )
}


def budget_of_ratio(compression_ratio: float) -> float:
    """slake's ratio budget (fraction kept) for kvpress's ``compression_ratio`` (fraction removed), in (0, 1).

    Raises
    ------
    ValueError
        For a ratio outside (0, 1): 0 is the full cache (no budget), 1 would keep nothing.
    """
    r = float(compression_ratio)
    if not 0.0 < r < 1.0:
        raise ValueError(f"a compression ratio must lie strictly between 0 and 1, got {compression_ratio!r}")
    return round(1.0 - r, 12)


def ratio_of_budget(budget: float) -> float:
    """kvpress's ``compression_ratio`` (fraction removed) of slake's ratio budget (fraction kept)."""
    b = float(budget)
    if not 0.0 < b < 1.0:
        raise ValueError(f"only a ratio budget in (0, 1) has a compression ratio, got {budget!r}")
    return round(1.0 - b, 12)


def resolve_protocol_args(args: argparse.Namespace, budgets_required: bool = True) -> Protocol | None:
    """Fill ``args.suite``, ``args.lengths``, ``args.budgets`` and ``args.question_agnostic`` from ``--protocol``.

    Without ``--protocol``, ``--suite`` and ``--budgets`` are required (``--budgets`` not when
    ``budgets_required`` is False: a run of the full cache alone). With it, the options it sets may be left out
    (or repeat the protocol's values); any other value is refused, as are the options the protocol's question-agnostic
    prompts exclude.

    Parameters
    ----------
    args : argparse.Namespace
        ``slake eval``'s parsed arguments; the protocol's values are written into it.
    budgets_required : bool
        Whether the run needs budgets: False when the full cache, which keeps every token, is the only method.

    Returns
    -------
    Protocol or None
        The protocol, or None when ``--protocol`` is not given.

    Raises
    ------
    ValueError
        For a missing ``--suite``/``--budgets`` without a protocol, or an option that contradicts the protocol.
    """
    name = getattr(args, "protocol", None)
    if name is None:
        for option in ("suite", "budgets") if budgets_required else ("suite",):
            if getattr(args, option, None) is None:
                raise ValueError(f"--{option} is required (or --protocol, which sets it)")
        return None
    if name not in PROTOCOLS:
        raise ValueError(f"unknown protocol {name!r}; known: {', '.join(PROTOCOLS)}")
    p = PROTOCOLS[name]
    if args.suite not in (None, p.suite):
        raise ValueError(f"--protocol {name} runs the {p.suite} suite; drop --suite {args.suite}")
    if args.lengths is not None and [s.strip() for s in str(args.lengths).split(",") if s.strip()] != [str(p.length)]:
        raise ValueError(f"--protocol {name} runs at {p.length} tokens; drop --lengths {args.lengths}")
    if args.budgets is not None:
        ratios = ", ".join(f"{r:g}" for r in p.compression_ratios)
        kept = ", ".join(f"{b:g}" for b in p.budgets)
        raise ValueError(
            f"--protocol {name} sets the budgets (compression ratios {ratios}: {kept} kept); drop --budgets"
        )
    for option, default in (
        ("prefill_chunk", None),
        ("batch_size", 1),
        ("fidelity", False),
        ("no_chat_template", False),
    ):
        if getattr(args, option, default) != default:
            flag = "--" + option.replace("_", "-")
            raise ValueError(
                f"--protocol {name} compresses question-agnostic prompts with the chat template; drop {flag}"
            )
    args.suite = p.suite
    args.lengths = str(p.length)
    args.budgets = ",".join(f"{b:g}" for b in p.budgets)
    args.question_agnostic = p.question_agnostic
    return p


def model_location(name: str, gguf_file: str | None = None) -> tuple[str, str | None]:
    """Where another environment loads ``--model`` from: ``(directory or hub id, GGUF file name or None)``; a
    packaged model's GGUF file is located (or assembled) here (:func:`slake.engines.transformers.models.resolve_model`).
    """
    from slake.engines.transformers.models import resolve_model

    return resolve_model(name, gguf_file)


def protocol_samples(
    samples: Sequence[Sample], protocol: Protocol, *, max_new_tokens: int | None = None
) -> list[Sample]:
    """The samples with the protocol's metric (the rows are then scored as the protocol scores them), and their
    generation length capped at ``max_new_tokens`` when given (``--max-new-tokens``, so that the kvpress side
    generates as many tokens as ours)."""
    cap = (lambda n: n) if max_new_tokens is None else (lambda n: min(n, max_new_tokens))
    return [replace(s, metric=protocol.metric(s.task), max_new_tokens=cap(s.max_new_tokens)) for s in samples]


def write_requests(
    out_dir: str | os.PathLike[str],
    samples: Sequence[Sample],
    tokenizer: Any,
    *,
    protocol: Protocol,
    model_name: str,
    model_location: tuple[str, str | None],
    eos_token_ids: Sequence[int],
    seed: int,
) -> Path:
    """Write ``DIR/kvpress_requests.json``: every sample's token ids as our side prefills them, for the kvpress side.

    The ids come from :func:`slake.eval.encoding.encode_sample` with question-agnostic prompts, the function the runner
    uses, so both sides see the same context ids (compressed) and question ids (fed after compression).

    Parameters
    ----------
    out_dir : path-like
        The results folder.
    samples : sequence of Sample
        The protocol's samples.
    tokenizer
        The model's tokenizer.
    protocol : Protocol
        The protocol (its ratios and length are recorded).
    model_name : str
        The ``model`` value of our rows (the kvpress rows get the same).
    model_location : (str, str or None)
        Where the kvpress side loads the model from: a directory or hub id, and a GGUF file name inside it.
    eos_token_ids : sequence of int
        The ids that end a generation (both sides stop on the same ids).
    seed : int
        The samples' seed.

    Returns
    -------
    Path
        The file written, atomically (a temporary file renamed over it). A file of another model or protocol in the
        same folder is refused (ValueError), as is one :func:`read_requests` cannot read.
    """
    from slake.eval.encoding import encode_sample
    from slake.eval.runner import target_length
    from slake.eval.sample import sample_digest

    path = Path(out_dir) / REQUESTS_FILE
    old = read_requests(path) if path.is_file() else None
    if old is not None and (old["model"] != model_name or old["protocol"] != protocol.name):
        raise ValueError(f"{path} holds requests of another model or protocol; use another --out")
    requests = []
    for s in samples:
        prefill_ids, question_ids = encode_sample(s, tokenizer, query_aware=not protocol.question_agnostic)
        requests.append(
            {
                "task": s.task,
                "sample_id": s.sample_id,
                "length": target_length(s),
                "prefill_ids": prefill_ids,
                "question_ids": question_ids,
                "max_new_tokens": s.max_new_tokens,
                "answers": list(s.answers),
                "metric": protocol.metric(s.task),
                "depth": s.depth,
                "sample_digest": sample_digest(s),
            }
        )
    if old is not None:  # keep the samples of earlier runs (other tasks, more samples)
        known = {r["sample_id"] for r in requests}
        requests = [r for r in old["requests"] if r["sample_id"] not in known] + requests
    payload = {
        "protocol": protocol.name,
        "model": model_name,
        "model_path": model_location[0],
        "gguf_file": model_location[1],
        "eos_token_ids": list(eos_token_ids),
        "compression_ratios": list(protocol.compression_ratios),
        "seed": seed,
        "requests": requests,
    }
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    # atomically: the kvpress side and the next run read either the old file or the new one, never a cut one
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(payload) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_requests(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The content of a requests file (:func:`write_requests`), checked.

    Parameters
    ----------
    path : path-like
        The file (``DIR/kvpress_requests.json``).

    Returns
    -------
    dict
        The file's object: ``protocol``, ``model``, ``requests`` (each request with the fields the merge reads) and
        the rest :func:`write_requests` records.

    Raises
    ------
    ValueError
        Naming the file and what is wrong: not UTF-8 or not JSON (a cut file), not an object, a missing field, a
        request that is not an object or lacks a field.
    """
    p = Path(path)
    fix = "remove it (the next slake eval --protocol run writes it again) or use another --out"
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{p} is not a valid requests file (not JSON: {e}); {fix}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{p} is not a valid requests file (not a JSON object); {fix}")
    missing = [k for k in _FILE_FIELDS if k not in data]
    if missing:
        raise ValueError(f"{p} is not a valid requests file (missing {', '.join(missing)}); {fix}")
    if not isinstance(data["requests"], list):
        raise ValueError(f"{p} is not a valid requests file ('requests' is not a list); {fix}")
    for i, r in enumerate(data["requests"]):
        if not isinstance(r, dict):
            raise ValueError(f"{p} is not a valid requests file (request {i} is not an object); {fix}")
        missing = [k for k in _REQUEST_FIELDS if k not in r]
        if missing:
            name = r.get("sample_id", f"number {i}")
            raise ValueError(f"{p} is not a valid requests file (request {name} lacks {', '.join(missing)}); {fix}")
    return data
