"""kvpress's generations as result rows: what ``tools/kvpress_protocol/kvpress_side.py`` writes, merged into
``results.jsonl`` beside our methods' rows (one summary, one table, one plot hold both).

The kvpress side writes one JSON object per (sample, press, compression ratio) to ``DIR/kvpress_outputs.jsonl``:
``sample_id``, ``press`` (kvpress's registry name: ``snapkv``, ``expected_attention``, ``no_press``...),
``compression_ratio`` (None for ``no_press``), ``tokens`` (the generated ids, EOS included), ``text`` (decoded with
``skip_special_tokens=True``) and its accounting (``prefill_s``, ``compress_s``, ``decode_s``, ``kept``: the mean
number of context entries a layer and KV head attends to, ``held``: the mean it stores, larger for the presses that
mask instead of evicting, ``kv_bytes``, ``press_repr``, ``versions``).

Each becomes a row of method ``kvpress:<press>`` at budget ``1 - compression_ratio`` (None for ``no_press``),
scored with the request's metric by :func:`slake.eval.metrics.score_sample`, the function that scores our rows. An
output that does not answer the request now in the requests file (more tokens than its ``max_new_tokens``, a ratio
the file does not list, a missing field, a ``sample_digest`` other than the request's) is skipped and reported
(:func:`output_problem`): it was generated for another request, and its row would sit beside ours as if generated
under the same settings. The kvpress side echoes the request's ``sample_digest``
(:func:`slake.eval.sample.sample_digest`) and answers again a request whose outputs do not name it; an output without
one (written before outputs named their prompt) is taken only where no output of the same sample, press and ratio
names the request's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from slake.eval.metrics import score_sample
from slake.eval.protocol import REQUESTS_FILE, budget_of_ratio, read_requests
from slake.eval.results import ResultsWriter

__all__ = ["KVPRESS_PREFIX", "OUTPUTS_FILE", "kvpress_rows", "merge_outputs", "output_problem", "read_outputs"]

#: the file the kvpress side writes into the results folder
OUTPUTS_FILE = "kvpress_outputs.jsonl"

#: the method prefix of kvpress's rows
KVPRESS_PREFIX = "kvpress:"

_ACCOUNTING = ("compress_s", "kept", "held", "press_repr", "versions")


def read_outputs(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The complete lines of a kvpress outputs file (a last line cut by an interrupted write, or a line that is not a
    JSON object, is skipped)."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for line in p.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
    return out


_OUTPUT_FIELDS = ("sample_id", "press", "tokens", "text")


def output_problem(requests: dict[str, Any], request: dict[str, Any], output: dict[str, Any]) -> str:
    """Why ``output`` does not answer ``request`` as the requests file now states it; ``""`` when it does.

    The kvpress side generates at most the request's ``max_new_tokens`` tokens, at the file's compression ratios:
    more tokens, or another ratio, mean the output answers an earlier version of the request (another
    ``--max-new-tokens``), which the file no longer holds; so does an output that names another prompt's digest
    (``sample_digest``, :func:`slake.eval.sample.sample_digest`) than the request's.

    Parameters
    ----------
    requests : dict
        The requests file's content.
    request : dict
        The request of the output's sample.
    output : dict
        One output of the kvpress side.
    """
    missing = [k for k in _OUTPUT_FIELDS if k not in output]
    if missing:
        return f"missing {', '.join(missing)}"
    tokens = output["tokens"]
    if not isinstance(tokens, list):
        return f"tokens is not a list ({tokens!r})"
    cap = int(request["max_new_tokens"])
    if len(tokens) > cap:
        return (
            f"{len(tokens)} tokens where the request allows max_new_tokens {cap}: generated for another version of "
            "the request (another --max-new-tokens)"
        )
    made_from, asked = output.get("sample_digest"), request.get("sample_digest")
    if made_from is not None and asked is not None and made_from != asked:
        return (
            f"made from the prompt of digest {made_from} where the request's prompt now has {asked}: generated for an "
            "earlier version of the sample (other essays or data, or a changed generator)"
        )
    ratio = output.get("compression_ratio")
    ratios = requests.get("compression_ratios")
    if ratio is not None and ratios is not None and float(ratio) not in {float(r) for r in ratios}:
        return f"compression ratio {ratio} is not among the requests' {ratios}"
    return ""


def kvpress_rows(
    requests: dict[str, Any], outputs: Iterable[dict[str, Any]], *, skipped: list[str] | None = None
) -> list[dict[str, Any]]:
    """Result rows (:data:`slake.eval.results.ROW_FIELDS` and more) of the kvpress side's outputs.

    Parameters
    ----------
    requests : dict
        The requests file's content (:func:`slake.eval.protocol.write_requests`): model, protocol, samples.
    outputs : iterable of dict
        The kvpress side's outputs (see the module docstring).
    skipped : list of str, optional
        Receives one line per output skipped because it does not answer its request (:func:`output_problem`):
        the sample, the press, the ratio and why.

    Returns
    -------
    list of dict
        One row per output whose sample is in ``requests`` (others are skipped silently: another run's samples)
        and that answers its request (others are skipped and reported in ``skipped``).
    """
    by_id = {r["sample_id"]: r for r in requests["requests"]}
    outputs = list(outputs)
    # an output that names the request's prompt supersedes one written before outputs named it (the kvpress side
    # answers such a request again): the older one may come from another prompt
    current = {
        (o.get("sample_id"), o.get("press"), o.get("compression_ratio"))
        for o in outputs
        if o.get("sample_digest") is not None
        and o.get("sample_digest") == by_id.get(o.get("sample_id"), {}).get("sample_digest")
    }
    rows = []
    for o in outputs:
        req = by_id.get(o.get("sample_id"))
        if req is None:
            continue
        why = output_problem(requests, req, o)
        if not why and o.get("sample_digest") is None:
            if (o.get("sample_id"), o.get("press"), o.get("compression_ratio")) in current:
                why = "superseded by an output made from the request's prompt (this one names none)"
        if why:
            if skipped is not None:
                skipped.append(
                    f"sample {o['sample_id']} press {o.get('press')} ratio {o.get('compression_ratio')}: {why}"
                )
            continue
        ratio = o.get("compression_ratio")
        prediction = str(o["text"]).strip()
        row: dict[str, Any] = {
            "suite": "ruler",
            "task": req["task"],
            "sample_id": req["sample_id"],
            "model": requests["model"],
            "method": KVPRESS_PREFIX + str(o["press"]),
            "budget": None if ratio is None else budget_of_ratio(ratio),
            "length": int(req["length"]),
            "prompt_tokens": len(req["prefill_ids"]) + len(req["question_ids"]),
            "prediction": prediction,
            "answers": list(req["answers"]),
            "score": float(score_sample(req["metric"], prediction, req["answers"])),
            "prefill_s": o.get("prefill_s"),
            "decode_s": o.get("decode_s"),
            "seed": requests.get("seed", 0),
            "query_aware": False,
            "compressed": ratio is not None,
            "new_tokens": len(o["tokens"]),
            "max_new_tokens": int(req["max_new_tokens"]),
            "depth": req.get("depth"),
            "metric": req["metric"],
            # the prompt the output was made from, as the kvpress side names it (None: written before it did)
            "sample_digest": o.get("sample_digest"),
            "kv_bytes": o.get("kv_bytes"),
            "prefill_chunk": None,
            "batch_size": 1,
            "profile": None,
            "kv_dtype": None,
            # kvpress runs on transformers too; the row key names the method, so the rows share a folder with ours
            "engine": "transformers",
            "runner": "kvpress",
            "compression_ratio": ratio,
            "protocol": requests.get("protocol"),
        }
        row.update({k: o[k] for k in _ACCOUNTING if k in o})
        rows.append(row)
    return rows


def merge_outputs(out_dir: str | os.PathLike[str], *, skipped: list[str] | None = None) -> int:
    """Append the rows of ``DIR/kvpress_outputs.jsonl`` that ``DIR/results.jsonl`` lacks; returns how many.

    Nothing happens (0) when either the requests or the outputs file is absent. A requests file that cannot be read
    raises ValueError naming it (:func:`slake.eval.protocol.read_requests`).

    Parameters
    ----------
    out_dir : path-like
        The results folder.
    skipped : list of str, optional
        Receives one line per output not merged because it does not answer its request now (:func:`output_problem`),
        naming the outputs file and the sample.
    """
    directory = Path(out_dir)
    req_path = directory / REQUESTS_FILE
    out_path = directory / OUTPUTS_FILE
    outputs = read_outputs(out_path)
    if not req_path.is_file() or not outputs:
        return 0
    requests = read_requests(req_path)
    problems: list[str] = []
    rows = kvpress_rows(requests, outputs, skipped=problems)
    if skipped is not None:
        skipped.extend(f"{out_path}: {p}; not merged" for p in problems)
    written = 0
    with ResultsWriter(directory) as store:
        for row in rows:
            written += int(store.write(row))
    return written
