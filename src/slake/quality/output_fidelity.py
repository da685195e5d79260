"""Output-level fidelity: how far a compressed cache moves the model's next-token distributions.

``slake fidelity`` measures attention outputs layer by layer (:mod:`slake.quality.fidelity`); this module measures what
the user sees. A prompt is prefilled once (exactly, :func:`slake.engines.transformers.prefill_once.capture_prefill`),
then for the full
cache and for every (method, budget) the same continuation tokens are fed one decode step at a time (teacher-forced),
and at each step the model's next-token distribution is compared with the full cache's:

* ``kl``: the mean over predicted tokens of ``KL(p_full || p_method)`` in nats;
* ``delta_nll``: the mean change of the negative log-likelihood of the continuation's actual next token,
  ``-log p_method(y_t) + log p_full(y_t)`` (positive = the compressed model finds the real text less likely);
* ``top1``: the fraction of steps where both distributions have the same most likely token.

Only predictions that depend on the compressed cache count: the first continuation token is predicted from the
exact prefill's last position, identical for every method, so it is left out. Two kinds of continuation are built:
``"text"``, the real text that follows the prompt (a language-modelling continuation), and ``"answer"``, the full
cache's own greedy answer to the question at the end of a prompt. Both are numbers that still separate methods when
task accuracy is 0 for all of them. The cost per (method, budget) is one replay and ``T - 1`` batched decode
steps (the first prediction is the prefill's).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from slake.budgets.budget import Budget
from slake.engines.transformers.teacher_forcing import distances, teacher_forced_logprobs
from slake.methods.base import Method
from slake.optional_plots import set_log_y

__all__ = [
    "Continuation",
    "OutputReference",
    "teacher_forced_logprobs",
    "distances",
    "prepare_reference",
    "measure_outputs",
    "summary_table",
    "plot_kl_vs_budget",
    "draw_kl_vs_budget",
]


@dataclass
class Continuation:
    """One prompt and the tokens that continue it.

    Attributes
    ----------
    kind : str
        ``"text"`` (the real text after the prompt) or ``"answer"`` (the full cache's greedy answer).
    name : str
        A sample id, e.g. ``"essay-4096-0"``.
    prompt_ids, target_ids : list of int
        Prompt token ids (prefilled) and the continuation (fed one token at a time).
    """

    kind: str
    name: str
    prompt_ids: list[int]
    target_ids: list[int]


@dataclass
class OutputReference:
    """A batch of prompts prefilled once, their continuations, and the full cache's log-probabilities."""

    capture: Any
    targets: torch.Tensor  # (B, T)
    valid: torch.Tensor  # (B, T) bool: positions 1.. of each row's own continuation
    full_lp: torch.Tensor  # (B, T, V)
    continuations: list[Continuation]


def prepare_reference(model: Any, continuations: Sequence[Continuation]) -> OutputReference:
    """Prefill every prompt once (exactly), stack the captures, and compute the full cache's log-probabilities."""
    from slake.engines.transformers.prefill_once import capture_prefill, stack_captures

    if not continuations:
        raise ValueError("no continuation to measure")
    if any(len(c.target_ids) < 2 for c in continuations):
        raise ValueError("every continuation needs at least 2 tokens (the first one is predicted exactly)")
    dev = model.device
    caps = [capture_prefill(model, torch.tensor([c.prompt_ids], device=dev)) for c in continuations]
    capture = stack_captures(caps, release=True)
    T = max(len(c.target_ids) for c in continuations)
    targets = torch.zeros(len(continuations), T, dtype=torch.long, device=dev)
    valid = torch.zeros(len(continuations), T, dtype=torch.bool, device=dev)
    for b, c in enumerate(continuations):
        targets[b, : len(c.target_ids)] = torch.tensor(c.target_ids, device=dev)
        valid[b, 1 : len(c.target_ids)] = True
    full_lp = teacher_forced_logprobs(model, capture, capture.replay("full", 1), targets)
    return OutputReference(capture, targets, valid, full_lp, list(continuations))


def measure_outputs(
    model: Any,
    ref: OutputReference,
    method: str | Method,
    budget: int | float | str,
    label: str | None = None,
    kv_dtype: str | None = None,
    **hyperparameters,
) -> list[dict]:
    """Rows ``{"method", "budget", "kind", "sample", "kl", "delta_nll", "top1", "nll_full", "tokens"}`` of one
    (method, budget) against the full cache, one per continuation.

    ``kv_dtype`` (``"int8"``, ``"fp8_e4m3"``; None or ``"auto"``: the model's dtype) stores the kept entries in 8
    bits; the label then ends in ``@int8`` / ``@fp8_e4m3``, as :func:`slake.quality.fidelity.measure` labels them.
    """
    from slake.cache.quant import parse_kv_dtype
    from slake.methods.base import canonical_method_spec, make_method

    m = make_method(method, **hyperparameters)
    if label is None:
        label = canonical_method_spec(method) if isinstance(method, str) else m.name
    kv_dtype = parse_kv_dtype(kv_dtype)
    if kv_dtype is not None:
        label = f"{label}@{kv_dtype}"
    cache = ref.capture.replay(m, budget, kv_dtype=kv_dtype)
    lp = teacher_forced_logprobs(model, ref.capture, cache, ref.targets)
    d = distances(ref.full_lp, lp, ref.targets, ref.valid)
    return [
        {
            "method": label,
            "budget": Budget(budget).value,
            "kind": c.kind,
            "sample": c.name,
            "kl": d["kl"][b],
            "delta_nll": d["delta_nll"][b],
            "top1": d["top1"][b],
            "nll_full": d["nll_full"][b],
            "tokens": d["tokens"][b],
        }
        for b, c in enumerate(ref.continuations)
    ]


def _groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Rows by (method, linear cache, budget); ``method`` carries the storage (``snapkv@int8``) and a row without a
    ``linear_cache`` entry (:func:`measure_outputs` called directly) counts as the method's own setting (None)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["method"], r.get("linear_cache"), r["budget"]), []).append(r)
    return groups


def _lin(lin: bool | None) -> str:
    return "-" if lin is None else ("yes" if lin else "no")


def mean_distance(rows: list[dict], key: str = "kl") -> float:
    """Token-weighted mean of ``key`` over rows (every predicted token counts once)."""
    tok = sum(r["tokens"] for r in rows)
    return sum(r[key] * r["tokens"] for r in rows if r["tokens"]) / max(tok, 1)


def summary_table(rows: list[dict]) -> str:
    """Markdown: one line per (method, linear cache, budget), token-weighted means per continuation kind and overall.

    The method column carries the storage of kept entries (``snapkv@int8``), as in
    :func:`slake.quality.fidelity.summary_table`; the linear cache column reads ``-`` for rows that do not record it.
    """
    kinds = sorted({r["kind"] for r in rows})
    head = (
        "| method | linear cache | budget | "
        + " | ".join(f"KL {k}" for k in kinds)
        + " | KL all | ΔNLL all (nats/token) | top-1 agreement |"
    )
    lines = [head, "|---|---|---:|" + "---:|" * (len(kinds) + 3)]
    order = sorted(_groups(rows).items(), key=lambda kv: (kv[0][0], _lin(kv[0][1]), float(kv[0][2])))
    for (m, lin, b), rs in order:
        per_kind = [mean_distance([r for r in rs if r["kind"] == k]) for k in kinds]
        lines.append(
            f"| {m} | {_lin(lin)} | {b} | "
            + " | ".join(f"{x:.4f}" for x in per_kind)
            + f" | {mean_distance(rs):.4f} | {mean_distance(rs, 'delta_nll'):+.4f} | "
            f"{mean_distance(rs, 'top1'):.3f} |"
        )
    return "\n".join(lines)


def plot_kl_vs_budget(rows: list[dict], path: str) -> None:
    """KL(full || method) against budget, one line per method, storage and linear cache setting (log scales, a
    linear segment around 0 where some mean is 0: :func:`draw_kl_vs_budget`); saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    draw_kl_vs_budget(rows, ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw_kl_vs_budget(rows: list[dict], ax: Any) -> None:
    """Draw :func:`plot_kl_vs_budget`'s lines on the matplotlib axes ``ax``.

    A mean KL of 0 (the method kept every token, or reproduced the full cache's distributions exactly) is drawn at 0:
    the y axis is then symmetric-log, linear below the smallest positive mean (:func:`slake.optional_plots.set_log_y`),
    where a floor such as 1e-6 on a log axis would draw a made-up value. A NaN mean is left out of its line.
    """
    by_method: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for (m, lin, b), rs in _groups(rows).items():
        by_method.setdefault((m, _lin(lin)), []).append((float(b), mean_distance(rs)))
    markers = "os^vD<>pxh*+"
    for i, ((m, lin), pts) in enumerate(sorted(by_method.items())):
        pts = sorted(p for p in pts if not math.isnan(p[1]))
        label = f"{m} + linear cache" if lin == "yes" else m
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[i % len(markers)], label=label)
    ax.set_xscale("log", base=2)
    set_log_y(ax, [y for pts in by_method.values() for _, y in pts])
    ax.set_xlabel("budget (tokens per layer and KV head)")
    ax.set_ylabel("mean KL(full || compressed), nats/token")
    ax.set_title("Output-level fidelity (teacher-forced next-token distributions)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
