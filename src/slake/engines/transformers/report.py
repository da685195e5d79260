"""Benchmark outputs: the markdown table and the PNG plots (latency and peak memory vs context length)."""

from __future__ import annotations

from collections import defaultdict

from slake.engines.transformers.baselines import holds_every_token

__all__ = ["KV_PARTS", "markdown_table", "plot_rows", "series_label"]

_MIB = 1024 * 1024


def series_label(row: dict, rows: list[dict]) -> str:
    """Legend label of a row: the method, plus budget / batch / chunk where the run has several."""
    label = row["method"] + (f" {row['kv_dtype']}" if row.get("kv_dtype") else "")
    if row.get("compile"):
        label += " compiled"
    if len({r["budget"] for r in rows}) > 1 and not holds_every_token(row["method"]):
        label += f"@{row['budget']}"
    if len({r["batch"] for r in rows}) > 1:
        label += f" b{row['batch']}"
    if row.get("prefill_chunk"):
        label += f" chunk{row['prefill_chunk']}"
    return label


def _pipelined(row: dict) -> str:
    """The back-to-back cell: ms per token, and the host's share until the last step was issued where known."""
    ms = row.get("decode_ms_pipelined")
    if ms is None:
        return "- | "
    host = row.get("decode_ms_pipelined_host")
    return f"{ms:.1f} (host {host:.1f}) | " if host is not None else f"{ms:.1f} | "


#: the parts of a row's ``kv_bytes`` (``kv_bytes_detail``) in the table's KV column, in its order, and their headings
KV_PARTS = {
    "kept": "kept",
    "padding": "padding",
    "slack": "slack",
    "metadata": "metadata",
    "linear_state": "linear",
    "sliding": "sliding",
}


def _kv_parts(rows: list[dict]) -> list[str]:
    """The parts of ``kv_bytes`` the KV column shows: every part of :data:`KV_PARTS` but ``sliding`` (a hybrid
    model's sliding-window layers) where no row has it, then any part it does not know, so that the parts shown always
    add up to the total."""
    held = {k for r in rows for k in r.get("kv_bytes_detail", {})}
    known = [k for k in KV_PARTS if k != "sliding" or k in held]
    return known + sorted(held - set(KV_PARTS))


def _kernels(row: dict) -> str:
    """Which implementation ran the decode steps, with how the fused kernels were launched where they were
    (``triton (interpreter)``: Triton's interpreter on a CPU, hundreds of times slower than the torch step there)."""
    ran = str(row.get("kernels") or "-")
    launch = row.get("triton_launch")
    return f"{ran} ({launch})" if launch else ran


def markdown_table(rows: list[dict], title: str | None = None, notes: list[str] | None = None) -> str:
    """A markdown table of the rows, one line per configuration.

    The KV column is every byte the cache holds at the end of the timed steps (``kv_bytes``) and, after ``=``, its
    parts in MiB (:func:`_kv_parts`: kept entries, padding up to a layer's longest head, slack allocated for the
    next tokens, slot metadata, SLAKE's linear state, and a hybrid model's sliding-window layers); ``kernels`` is
    the decode step's implementation that ran (:func:`_kernels`)."""
    paired = any("decode_vs_first" in r for r in rows)
    compiled = any(r.get("compile") for r in rows)
    second = any(r.get("second_pass_s") is not None for r in rows)  # KVzip's reconstruction pass, inside prefill s
    roof = any(r.get("vs_roofline") is not None for r in rows)  # the memory's floor (roofline.py)
    piped = any(r.get("decode_ms_pipelined") is not None for r in rows)  # steps back to back (CUDA)
    parts = _kv_parts(rows)
    head = (
        "| method | budget | length | batch | chunk | prefill s | "
        + ("of which 2nd pass s | " if second else "")
        + "TTFT s | decode ms/token (min-max) | "
        + ("back to back ms/token | " if piped else "")
        + ("x roofline | " if roof else "")
        + ("decode vs first | " if paired else "")
        + ("compiled vs eager | compile s | " if compiled else "")
        + "kernels | peak MiB | KV MiB held = "
        + " + ".join(KV_PARTS.get(k, k) for k in parts)
        + " |"
    )
    lines = [f"# {title}", ""] if title else []
    lines += [head, "|" + "---|" * (11 + second + piped + roof + paired + 2 * compiled)]
    for r in rows:
        kv = r.get("kv_bytes_detail", {})
        vs = ""
        if piped:
            vs = _pipelined(r)
        if roof:
            vs += f"{r['vs_roofline']:.2f} | " if r.get("vs_roofline") is not None else "- | "
        if paired:
            vs += f"{r['decode_vs_first']:.3f} × {r['decode_first']} | " if "decode_vs_first" in r else "- | "
        if compiled:
            vs += f"{r['decode_vs_eager']:.3f} | " if r.get("decode_vs_eager") is not None else "- | "
            vs += f"{r['compile_s']:.1f} | " if r.get("compile_s") is not None else "- | "
        label = (
            r["method"] + (f" {r['kv_dtype']}" if r.get("kv_dtype") else "") + (" compiled" if r.get("compile") else "")
        )
        pass_s = ""
        if second:
            pass_s = f"{r['second_pass_s']:.2f} | " if r.get("second_pass_s") is not None else "- | "
        lines.append(
            f"| {label} | {'-' if holds_every_token(r['method']) else r['budget']} | {r['length']} | "
            f"{r['batch']} | {r.get('prefill_chunk') or '-'} | "
            f"{r['prefill_s']:.2f} | {pass_s}{r['ttft_s']:.2f} | {r['decode_ms_per_token']:.1f} "
            f"({r['decode_ms_min']:.1f}-{r['decode_ms_max']:.1f}) | {vs}{_kernels(r)} | "
            f"{r['peak_mem_bytes'] / _MIB:.0f} | {r['kv_bytes'] / _MIB:.2f} = "
            + " + ".join(f"{kv.get(k, 0) / _MIB:.2f}" for k in parts)
            + " |"
        )
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def plot_rows(rows: list[dict], out_dir: str) -> list[str]:
    """``decode_latency.png`` and ``peak_memory.png``: one line per method (and budget / batch / chunk) vs length.

    Returns the written paths.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        series[series_label(r, rows)].append(r)
    written = []
    for key, ylabel, fname, scale in (
        ("decode_ms_per_token", "decode ms / token (median)", "decode_latency.png", 1.0),
        ("peak_mem_bytes", "peak memory (MiB)", "peak_memory.png", 1.0 / _MIB),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, rs in series.items():
            rs = sorted(rs, key=lambda r: r["length"])
            ax.plot([r["length"] for r in rs], [r[key] * scale for r in rs], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = f"{out_dir}/{fname}"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
