"""Per-request results summed up into one row per (configuration, concurrency), the markdown table and the
throughput-vs-concurrency plot of ``slake bench --engine vllm --serve``.

Definitions (those of ``vllm bench serve``): requests/s and output tokens/s count completed requests over the
level's wall time (first request sent to last one finished); TTFT is the time from sending a request to its first
token, latency to its last token; TPOT, time per output token after the first, is ``(latency - ttft) / (tokens -
1)`` per request; p50/p99 are percentiles over the completed requests with linear interpolation
(``numpy.percentile``'s default).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "JSONL",
    "PLOT",
    "TABLE",
    "RequestResult",
    "engine_label",
    "level_stats",
    "markdown_table",
    "percentile",
    "plot_throughput",
    "table_notes",
]

JSONL = "bench_serve.jsonl"
TABLE = "bench_serve.md"
PLOT = "serve_throughput.png"


@dataclass
class RequestResult:
    """One request of a level: completed (``ok``) or not (``error``), with its timings in seconds."""

    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None for fewer than two tokens."""
        if self.ttft_s is None or self.latency_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks (``numpy.percentile``'s
    default); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must lie in [0, 100], got {q}")
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _r(x: float | None, nd: int) -> float | None:
    return None if x is None else round(x, nd)


def level_stats(results: Sequence[RequestResult], duration_s: float) -> dict:
    """The client-side columns of one level's row (see the module docstring): ``requests``, ``completed``,
    ``failed``, ``first_error``, ``duration_s``, ``request_per_s``, ``output_tok_s``, ``total_tok_s`` (prompt
    and output tokens of completed requests), ``ttft_{p50,p99}_s``, ``tpot_{p50,p99}_ms``,
    ``latency_{p50,p99}_s``, ``prompt_tokens_mean``."""
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    tpot = [t * 1000 for r in done if (t := r.tpot_s) is not None]
    lat = [r.latency_s for r in done if r.latency_s is not None]
    rate = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: None)
    return {
        "requests": len(results),
        "completed": len(done),
        "failed": len(failed),
        "first_error": failed[0].error if failed else None,
        "duration_s": round(duration_s, 2),
        "request_per_s": _r(rate(len(done)), 4),
        "output_tok_s": _r(rate(out_tokens), 2),
        "total_tok_s": _r(rate(out_tokens + in_tokens), 1),
        "ttft_p50_s": _r(percentile(ttft, 50), 3),
        "ttft_p99_s": _r(percentile(ttft, 99), 3),
        "tpot_p50_ms": _r(percentile(tpot, 50), 1),
        "tpot_p99_ms": _r(percentile(tpot, 99), 1),
        "latency_p50_s": _r(percentile(lat, 50), 2),
        "latency_p99_s": _r(percentile(lat, 99), 2),
        "prompt_tokens_mean": round(sum(r.prompt_len for r in results) / len(results), 1) if results else None,
    }


def engine_label(method: str, budget: int | None) -> str:
    """``plain vLLM`` for the full cache, ``snapkv@128`` for the plugin."""
    return "plain vLLM" if method == "full" or budget is None else f"{method}@{budget}"


def _fmt(x: object) -> str:
    return "-" if x is None else str(x)


def markdown_table(rows: Sequence[dict]) -> str:
    """The rows as a markdown table: per engine and concurrency, throughput, TTFT and TPOT percentiles, the most
    requests the server ran at once, the most KV blocks held (of the pool), preemptions and failed requests."""
    head = (
        "| engine | concurrency | requests/s | output tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) "
        "| max running | max KV blocks held (of pool) | preemptions | failed |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        blocks = f"{_fmt(r.get('max_kv_blocks'))} (of {_fmt(r.get('kv_pool_blocks'))})"
        lines.append(
            f"| {r['label']} | {r['concurrency']} | {_fmt(r.get('request_per_s'))} | {_fmt(r.get('output_tok_s'))} "
            f"| {_fmt(r.get('ttft_p50_s'))} / {_fmt(r.get('ttft_p99_s'))} "
            f"| {_fmt(r.get('tpot_p50_ms'))} / {_fmt(r.get('tpot_p99_ms'))} | {_fmt(r.get('max_running'))} "
            f"| {blocks} | {_fmt(r.get('preemptions'))} | {r.get('failed', 0)} |"
        )
    return "\n".join(lines) + "\n"


def table_notes(rows: Sequence[dict]) -> str:
    """What the table's numbers leave out, one bullet per affected row (empty when nothing is): requests that
    failed (the row's throughput counts only the completed ones, its percentiles are over them) with the first
    error, and ``/metrics`` scrapes that failed (the server columns cover the other samples)."""
    notes = []
    for r in rows:
        where = f"{r['label']} at concurrency {r['concurrency']}"
        if r.get("failed"):
            notes.append(
                f"* {where}: {r['failed']} of {r.get('requests', '?')} requests failed (first: "
                f"{r.get('first_error')}); its throughput counts the completed requests only and its percentiles "
                "are over them."
            )
        if r.get("metrics_errors"):
            n = r["metrics_errors"] + (r.get("metrics_samples") or 0)
            notes.append(
                f"* {where}: {r['metrics_errors']} of {n} scrapes of /metrics failed; its server columns come "
                "from the others (- where no sample, or no baseline before the level, was taken)."
            )
    return "\n" + "\n".join(notes) + "\n" if notes else ""


def plot_throughput(rows: Sequence[dict], path: Path) -> Path:
    """Output tokens/s against concurrency, one line per engine (``label``), saved as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    series: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r.get("output_tok_s") is not None:
            series[r["label"]].append(r)
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rs in series.items():
        rs = sorted(rs, key=lambda r: r["concurrency"])
        ax.plot([r["concurrency"] for r in rs], [r["output_tok_s"] for r in rs], marker="o", label=label)
    ax.set_xscale("log", base=2)
    levels = sorted({r["concurrency"] for rs in series.values() for r in rs})
    if levels:
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("requests in flight (client concurrency)")
    ax.set_ylabel("output tokens / s")
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
