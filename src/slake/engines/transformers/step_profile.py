"""What a decode step spends its time on: ``torch.profiler`` over a few decode steps, summarised per kernel.

A decode step's time on a GPU is the sum of its kernels (and, eager, of the host's work between them); a median
step time says how long, not where. :func:`profile_decode` runs ``steps`` more decode steps under the profiler and
:func:`summarize` turns them into one dict per configuration (``slake bench --profile-steps N``, the ``step_profile``
field of ``bench.jsonl`` and ``step_profile.md``, :func:`profile_markdown`):

* on CUDA, every kernel the steps ran (those a CUDA graph replays included, as CUPTI reports them), with its calls
  and device milliseconds per step; the device's busy time per step (the kernels' sum) beside the wall time per step,
  whose difference is time the device waited (for the host, eager);
* on a CPU, every operator with its self CPU time per step (Triton kernels run by the interpreter show as the
  Python around them, not as operators);
* the time per step in a few categories read off the kernel names (:func:`category`): slake's fused decode kernels,
  matrix products, attention, and the rest (norms, rotary, element-wise, copies).

The categories come from names (cuBLAS' ``gemv``/``gemm``/``nvjet``, FlashAttention's ``flash``/``fmha``, our
kernels' function names); a kernel no pattern names is ``other``. Nothing here changes what the step computes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from slake.engines.transformers.baselines import holds_every_token

__all__ = ["CATEGORIES", "category", "profile_decode", "profile_markdown", "summarize"]

#: the fused decode step's Triton kernels (:mod:`slake.kernels`)
FUSED_KERNELS = ("_append_logits_kernel", "_evict_attend_kernel", "_value_projection_kernel", "_layer_eviction_kernel")
#: categories of :func:`category`, in report order
CATEGORIES = ("slake fused step", "matmul", "attention", "other")
_MATMUL = ("gemm", "gemv", "nvjet", "cutlass", "xmma", "splitk", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul")
_ATTENTION = ("flash", "fmha", "attention", "sdpa", "efficient_attention")
#: rows of the per-kernel table kept in a summary
TOP = 15


def category(name: str) -> str:
    """The category of a kernel or operator name (:data:`CATEGORIES`)."""
    low = name.lower()
    if any(k in name for k in FUSED_KERNELS) or "slake::" in low:
        return "slake fused step"
    if any(k in low for k in _ATTENTION):  # before matmul: PyTorch's memory-efficient attention is cutlass's fmha
        return "attention"
    if any(k in low for k in _MATMUL):
        return "matmul"
    return "other"


def _device_events(prof: Any, cuda: bool) -> list[tuple[str, int, float]]:
    """``(name, calls, self microseconds)`` of every kernel (CUDA) or operator (CPU) the profiler recorded."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.key_averages():
        if cuda:
            if e.device_type != DeviceType.CUDA or e.self_device_time_total <= 0:
                continue
            out.append((e.key, int(e.count), float(e.self_device_time_total)))
        elif e.device_type == DeviceType.CPU and e.self_cpu_time_total > 0:
            out.append((e.key, int(e.count), float(e.self_cpu_time_total)))
    return out


def summarize(events: list[tuple[str, int, float]], steps: int, wall_ms: float, cuda: bool) -> dict:
    """The profile of ``steps`` decode steps from their ``(name, calls, self microseconds)`` events and the steps'
    total wall milliseconds: a JSON-ready dict (see the module docstring)."""
    if steps < 1:
        raise ValueError(f"a profile needs at least one step, got {steps}")
    total_us = sum(us for _, _, us in events)
    by_cat = dict.fromkeys(CATEGORIES, 0.0)
    launches = dict.fromkeys(CATEGORIES, 0.0)
    for name, calls, us in events:
        by_cat[category(name)] += us / 1e3 / steps
        launches[category(name)] += calls / steps
    top = sorted(events, key=lambda e: -e[2])[:TOP]
    return {
        "steps": steps,
        "clock": "device" if cuda else "cpu",
        "wall_ms_per_step": wall_ms / steps,
        "busy_ms_per_step": total_us / 1e3 / steps,
        "launches_per_step": sum(c for _, c, _ in events) / steps,
        "ms_per_step": by_cat,
        "launches_per_category": launches,
        "top": [
            {
                "name": name,
                "category": category(name),
                "calls_per_step": calls / steps,
                "ms_per_step": us / 1e3 / steps,
                "share": us / total_us if total_us > 0 else 0.0,
            }
            for name, calls, us in top
        ],
    }


def profile_decode(step: Callable[[torch.Tensor], torch.Tensor], tok: torch.Tensor, steps: int,
                   device: torch.device) -> tuple[dict, torch.Tensor]:  # fmt: skip
    """Run ``steps`` decode steps ``tok = step(tok)`` under ``torch.profiler`` (CPU, and CUDA activity on a CUDA
    device); return their :func:`summarize` dict and the last token."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            tok = step(tok)
        if cuda:
            torch.cuda.synchronize(device)
        wall_ms = (time.perf_counter() - start) * 1e3
    return summarize(_device_events(prof, cuda), steps, wall_ms, cuda), tok


def _label(row: dict) -> str:
    return (
        row["method"]
        + ("" if holds_every_token(row["method"]) else f"@{row['budget']}")
        + (f" {row['kv_dtype']}" if row.get("kv_dtype") else "")
        + f", {row['length']} tokens, batch {row['batch']}"
        + (", compiled" if row.get("compile") else ", eager")
        + f", kernels {row.get('kernels', '?')}"
    )


def profile_markdown(rows: list[dict]) -> str:
    """``step_profile.md``: per profiled row, the time per step by category and its most expensive kernels."""
    lines = ["# slake bench: where a decode step's time goes", ""]
    profiled = [r for r in rows if r.get("step_profile")]
    if not profiled:
        return "\n".join(lines + ["No configuration was profiled.", ""])
    lines += [
        "| configuration | clock | wall ms/step | busy ms/step | launches/step | "
        + " | ".join(f"{c} ms" for c in CATEGORIES)
        + " |",
        "|" + "---|" * (5 + len(CATEGORIES)),
    ]
    for r in profiled:
        p = r["step_profile"]
        lines.append(
            f"| {_label(r)} | {p['clock']} | {p['wall_ms_per_step']:.3f} | {p['busy_ms_per_step']:.3f} | "
            f"{p['launches_per_step']:.0f} | " + " | ".join(f"{p['ms_per_step'][c]:.3f}" for c in CATEGORIES) + " |"
        )
    for r in profiled:
        p = r["step_profile"]
        lines += ["", f"## {_label(r)}", "", "| kernel | category | calls/step | ms/step | share |"]
        lines.append("|---|---|---|---|---|")
        for k in p["top"]:
            name = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."
            lines.append(
                f"| `{name}` | {k['category']} | {k['calls_per_step']:.1f} | {k['ms_per_step']:.4f} | "
                f"{100 * k['share']:.1f}% |"
            )
        if p["clock"] == "device" and not p["top"]:
            lines.append("| (the profiler recorded no kernel: CUPTI unavailable?) | | | | |")
    lines += [
        "",
        f"- {profiled[0]['step_profile']['steps']} profiled decode steps per configuration, after its timed steps; "
        "device: kernels' self time (CUPTI, CUDA-graph replays included); cpu: operators' self CPU time",
        "- busy ms/step: the sum of the kernels (device) or operators (cpu); wall ms/step: the steps' elapsed time "
        "under the profiler, which adds its own overhead to eager steps; launches/step: kernels (device) or "
        "operators with self time, wrappers included (cpu)",
        "- categories are read off the names (slake.engines.transformers.step_profile.category)",
        "",
    ]
    return "\n".join(lines)
