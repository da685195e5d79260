"""The transformers engine's benchmark: prefill time, time to first token, decode latency, peak memory and KV bytes
per method, budget and context length (``slake bench``).

Every configuration is measured by :func:`slake.engines.transformers.measure.measure` on random token prompts;
rows are appended to ``OUT/bench.jsonl``, and ``OUT/bench.md`` and the plots are written from this run's rows; with
``profile_steps`` also ``OUT/step_profile.md``, where each configuration's decode step spends its time
(:mod:`slake.engines.transformers.step_profile`).
With ``isolate`` each configuration runs in a fresh process (exact per-configuration peak memory, at the cost of
reloading the model; with ``compile`` its eager and compiled runs share one, in that order, as in one process). Every
row names its run (``run_id``), seed and warm-up, so that runs appended to one ``bench.jsonl`` can be told apart.
On CPU, and on CUDA for eager configurations whose caches fit in the GPU together (:func:`group_interleaved`), the
decode steps of the configurations of one length are timed again in turn (``decode_timing``,
:func:`slake.engines.transformers.measure.time_decode_interleaved`), so that comparisons between methods do not
depend on when each one ran.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from slake.engines.base import BenchPlan, BenchReport, ModelSpec, load_avg
from slake.engines.transformers.baselines import holds_every_token
from slake.engines.transformers.compile_options import make_room_for_graphs
from slake.engines.transformers.measure import BenchConfig
from slake.engines.transformers.roofline import (
    copy_bandwidth,
    cpu_copy_bandwidth_apart,
    decode_weight_bytes,
    roofline_fields,
)
from slake.optional_plots import draw_if_possible

if TYPE_CHECKING:
    import torch

__all__ = ["configs", "device_bandwidth", "run_bench"]


def configs(plan: BenchPlan) -> list[BenchConfig]:
    """The plan's configurations, length by length (the full cache and transformers' own once per length, at the
    first budget)."""
    out = []
    for n in plan.lengths:
        for m in plan.methods:
            for kvd in plan.kv_dtypes:
                for b in plan.budgets[:1] if holds_every_token(m) else plan.budgets:
                    for compiled in (False, True) if plan.compile else (False,):  # eager and compiled, paired
                        out.append(
                            BenchConfig(
                                method=m,
                                budget=getattr(b, "value", b),
                                length=n,
                                batch=plan.batch,
                                decode_steps=plan.decode_steps,
                                warmup=plan.warmup,
                                prefill_chunk=plan.prefill_chunk,
                                seed=plan.seed,
                                kv_dtype=kvd,
                                compile=compiled,
                                kernels=plan.kernels,
                                profile_steps=plan.profile_steps,
                            )
                        )
    return out


def _isolated(spec: ModelSpec, plan: BenchPlan, cfg: BenchConfig) -> list[dict]:
    """Measure ``cfg`` in a fresh process (``slake bench`` of this one configuration); its rows, in the order of
    :func:`configs`: with ``plan.compile`` the eager row and the compiled one, which the child measures one after the
    other, paired as in one process (``cfg`` is then the eager configuration; its compiled twin is not run apart)."""
    argv = [
        sys.executable,
        "-m",
        "slake.cli",
        "bench",
        "--methods",
        cfg.method,
        "--budget",
        str(cfg.budget),
        *(["--compile"] if plan.compile else []),
        "--lengths",
        str(cfg.length),
        "--batch",
        str(cfg.batch),
        "--decode-steps",
        str(cfg.decode_steps),
        "--warmup",
        str(cfg.warmup),
        "--seed",
        str(plan.seed),
        "--no-plots",
        "--no-progress",
        "--json",
        "--kv-dtype",
        cfg.kv_dtype or "auto",
        "--kernels",
        cfg.kernels,
        "--profile-steps",
        str(cfg.profile_steps),
        "--decode-timing",  # isolated rows are timed in their own runs, as --help says (the child interleaved)
        "sequential",
        "--out",
        str(plan.out / "isolated"),
    ]
    model = None if spec.random else spec.name
    for flag, value in (
        ("--prefill-chunk", plan.prefill_chunk),
        ("--model", model),
        ("--random-model", spec.random),
        ("--gguf-file", spec.gguf_file),
        ("--device", spec.device),
        ("--dtype", spec.dtype),
        ("--threads", plan.threads),
    ):
        if value is not None:
            argv += [flag, str(value)]
    res = subprocess.run(argv, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"isolated run of {cfg} failed:\n{res.stderr[-2000:]}")
    rows = json.loads(res.stdout.strip().splitlines()[-1])["rows"]
    expected = [False, True] if plan.compile else [False]
    if [bool(r.get("compile")) for r in rows] != expected or any(
        (r["method"], r["length"], r.get("kv_dtype")) != (cfg.method, cfg.length, cfg.kv_dtype) for r in rows
    ):
        got = [_label_compiled(r) for r in rows]
        raise RuntimeError(f"isolated run of {cfg} returned other rows than its own: {got}")
    return rows


def run_bench(plan: BenchPlan, spec: ModelSpec, model_name: str, load: Callable[[], Any]) -> BenchReport:
    """Measure every configuration of ``plan`` (see the module docstring); write ``bench.jsonl``, ``bench.md`` and
    the plots under ``plan.out``. ``load()`` gives the model (not called with ``isolate``: each configuration's
    process loads ``spec`` itself); ``model_name`` names it in the rows."""
    import torch

    from slake.engines.transformers.measure import measure, time_decode_interleaved
    from slake.engines.transformers.report import markdown_table, plot_rows
    from slake.engines.transformers.step_profile import profile_markdown

    if plan.threads:
        torch.set_num_threads(plan.threads)
    cfgs = configs(plan)
    groups = length_groups(cfgs)
    if any(cfg.compile for cfg in cfgs):  # one graph per compiled configuration's cache shape, and some to spare
        make_room_for_graphs(2 * sum(cfg.compile for cfg in cfgs))
    out = plan.out
    out.mkdir(parents=True, exist_ok=True)
    model = None if plan.isolate else load()
    if model is not None:
        _check_windows(model, cfgs)
    interleave = interleaved_timing(plan, model)  # a group's rows wait for its interleaved timing, if it runs one
    bar = None
    if plan.progress:
        from tqdm.auto import tqdm

        # a configuration's own run, then, in a length that is timed interleaved, its share of that timing (one more
        # prefill and the decode steps of each configuration): one unit each
        work = len(cfgs) + (sum(len(g) for g in groups if len(g) > 1) if interleave else 0)
        bar = tqdm(total=work, desc="slake bench", unit="run", file=sys.stderr)
    env = {
        "run_id": time.strftime("%Y%m%dT%H%M%SZ-", time.gmtime()) + uuid.uuid4().hex[:8],  # the rows of one run
        "model": model_name,
        "device": str(model.device) if model is not None else (spec.device or "auto"),
        "dtype": str(model.dtype).replace("torch.", "") if model is not None else (spec.dtype or "auto"),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_avg_1m": load_avg(),
    }
    floor = None  # the roofline's terms (roofline.py): weights read per step, the device's copy bandwidth
    if model is not None:
        floor = decode_weight_bytes(model, plan.batch), device_bandwidth(model.device)
        if model.device.type == "cuda":
            torch.cuda.empty_cache()
    rows = []
    with open(out / "bench.jsonl", "a", encoding="utf-8") as f:
        for group in groups:
            group_rows = []
            for cfg in group:
                if plan.isolate and cfg.compile:
                    continue  # measured by its eager twin's process, right after it (_isolated)
                if bar is not None:
                    bar.set_postfix_str(f"{cfg.method} {cfg.length}")
                # isolated: its own roofline, and with --compile the eager and the compiled row
                measured = _isolated(spec, plan, cfg) if plan.isolate else [measure(model, cfg)]
                for row in measured:
                    row.update({k: v for k, v in env.items() if k not in row})
                    row["run_id"] = env["run_id"]  # an isolated row's own process had its own
                    row["load_avg_1m_after"] = load_avg()
                    group_rows.append(row)
                    if not interleave:
                        _pair_sequential(row, group_rows)
                        _add_roofline(row, floor)
                        f.write(json.dumps(row) + "\n")
                        f.flush()
                if bar is not None:
                    bar.update(len(measured))
            if interleave and len(group) > 1:
                if group_interleaved(plan, model, group, group_rows):
                    if bar is not None:
                        bar.set_postfix_str(f"interleaved decode timing, length {group[0].length}")
                    apply_interleaved(group_rows, time_decode_interleaved(model, group, plan.decode_steps, plan.warmup))
                if bar is not None:
                    bar.update(len(group))
            if interleave:
                for row in group_rows:
                    _pair_sequential(row, group_rows)
                    _add_roofline(row, floor)
                    f.write(json.dumps(row) + "\n")
                f.flush()
            rows += group_rows
    if bar is not None:
        bar.close()
    timings = {r.get("decode_timing") for r in rows}
    notes = [
        f"model {env['model']}, device {env['device']}, dtype {env['dtype']}, {env['threads']} torch threads, "
        f"torch {env['torch']}, load average at start {env['load_avg_1m']}",
        f"batch {plan.batch}, {plan.decode_steps} timed decode steps after {plan.warmup} warm-up steps; "
        f"prompts are random token ids of seed {plan.seed}; run {env['run_id']} (run_id in bench.jsonl)",
        "decode ms/token: "
        + (
            "medians of steps timed in turn across the configurations of each length "
            "(interleaved; the medians of each configuration's own run are "
            "decode_ms_sequential in bench.jsonl); decode vs first: median over those "
            "rounds of the step-time ratio to the length's first configuration, the "
            "number to compare methods by"
            if timings == {"interleaved"}
            else "medians of each configuration's own run (sequential)"
            if timings <= {"sequential"}
            else "interleaved where the rows' decode_timing says so (lengths whose caches fit together), else "
            "sequential; decode vs first compares the interleaved rows of a length"
        ),
        "peak memory: " + _peak_note(rows, plan.isolate),
    ]
    if any("vs_roofline" in r for r in rows):
        r0 = next(r for r in rows if "vs_roofline" in r)
        notes.append(
            "x roofline: decode ms/token over the memory's floor, the bytes a step must read (the weights, the input "
            "embedding's looked-up rows only, plus the kept keys and values, the linear state and a hybrid model's "
            "sliding-window layers) at the device's "
            f"measured copy bandwidth ({r0['bandwidth_gbs']} GB/s; roofline_ms in bench.jsonl)"
        )
    (out / "bench.md").write_text(markdown_table(rows, "slake bench", notes), encoding="utf-8")
    files = [out / "bench.jsonl", out / "bench.md"]
    if plan.profile_steps:
        (out / "step_profile.md").write_text(profile_markdown(rows), encoding="utf-8")
        files.append(out / "step_profile.md")
    if plan.plots and rows:
        draw_if_possible("slake bench", lambda: plot_rows(rows, str(out)))  # matplotlib is optional
    keys = ("method", "budget", "length", "batch", "prefill_s", "decode_ms_per_token", "peak_mem_bytes", "kv_bytes")
    ordered = [{**{k: r[k] for k in keys}, **{k: v for k, v in r.items() if k not in keys}} for r in rows]
    return BenchReport(rows=ordered, table=markdown_table(rows), files=files)


def _check_windows(model: Any, cfgs: list) -> None:
    """Refuse, before any row is measured, a configuration whose cache would outgrow a model whose every layer is
    bounded (a sliding window or a chunk): slake compresses full-attention layers only, and the attention function
    refused the step that crossed the window, after the lengths' earlier rows had been timed and without writing that
    length's rows. The tokens counted are the fewest a row takes (its prompt, the warm-up and timed steps)."""
    from slake.engines.transformers.baselines import TRANSFORMERS
    from slake.engines.transformers.generate import check_sliding_window

    for cfg in cfgs:
        if cfg.method == TRANSFORMERS:
            continue  # transformers' own cache: any length
        try:
            check_sliding_window(model.config, cfg.length, cfg.warmup + cfg.decode_steps + 1)
        except ValueError as err:
            raise ValueError(
                f"--lengths {cfg.length} with --warmup {cfg.warmup} and --decode-steps {cfg.decode_steps}: {err}"
            ) from None


def _peak_note(rows: list[dict], isolate: bool) -> str:
    """What ``bench.md`` says the peak column is: CUDA's reset peak, or the CPU's high-water mark, reset per
    configuration only where every row says so (``peak_mem_reset``; where it cannot be reset the mark only grows over
    the run, or over each configuration's own process with ``isolate``)."""
    if rows and rows[0]["peak_mem_kind"].startswith("cuda"):
        return "CUDA max_memory_allocated (reset per configuration)"
    if all(r.get("peak_mem_reset") for r in rows):
        return (
            "process RSS high-water mark (VmHWM, reset per configuration via /proc/self/clear_refs; includes the "
            "model weights)"
        )
    where = (
        "since the start of each configuration's own process (--isolate)"
        if isolate
        else "over the whole run, so a row's peak includes the earlier configurations' (--isolate gives each its own "
        "process)"
    )
    return (
        "process RSS high-water mark, which could not be reset here (peak_mem_reset false in bench.jsonl): the most "
        f"the process held {where}; includes the model weights"
    )


def device_bandwidth(device: torch.device) -> float:
    """The copy bandwidth of the roofline, measured where its buffers leave the rows' peak memory alone: in this
    process, but in a child on a CPU whose high-water mark cannot be reset per configuration (not Linux; the mark
    would keep the copy's 512 MiB for every row, ``--isolate``'s rows included)."""
    from slake.engines.transformers.memory import MemoryMeter

    if device.type == "cpu" and not MemoryMeter.available():
        return cpu_copy_bandwidth_apart()
    return copy_bandwidth(device)


def _add_roofline(row: dict, floor: tuple[int, float] | None) -> None:
    """Put the roofline fields (:func:`~slake.engines.transformers.roofline.roofline_fields`) into a measured row,
    from ``floor`` = (weight bytes per step, copy bandwidth); a row from an isolated run brought its own."""
    if floor is not None:
        row.update(roofline_fields(row["decode_ms_per_token"], floor[0], row["kv_bytes_detail"], floor[1]))
        if row.get("decode_ms_pipelined") is not None and row["roofline_ms"] > 0:  # the steps issued back to back
            row["pipelined_vs_roofline"] = round(row["decode_ms_pipelined"] / row["roofline_ms"], 3)


def interleaved_timing(plan: BenchPlan, model: Any) -> bool:
    """Whether decode steps may be timed interleaved (``decode_timing``; auto: on CPU and CUDA without ``isolate``,
    each length's group then decided by :func:`group_interleaved`)."""
    mode = plan.decode_timing
    if mode == "interleaved" and plan.isolate:
        raise ValueError("--decode-timing interleaved needs the configurations in one process; drop --isolate")
    if mode == "auto":
        return not plan.isolate and model is not None and model.device.type in ("cpu", "cuda")
    return mode == "interleaved"


#: the share of the GPU's free memory an automatically interleaved group's caches may take together
INTERLEAVE_MEMORY_SHARE = 0.8


def group_interleaved(plan: BenchPlan, model: Any, group: list[BenchConfig], rows: list[dict]) -> bool:
    """Whether one length's configurations (``group``, measured alone as ``rows``) are timed again interleaved.

    Asked for (``interleaved``): always. ``auto``: on the CPU always; on CUDA when no configuration is compiled (two
    compiled caches would replay CUDA graphs in turn over different static inputs) and every cache of the group fits
    in the GPU's free memory at once, with the largest configuration's own peak above its cache beside them
    (:data:`INTERLEAVE_MEMORY_SHARE` of what is free). A GPU host's speed can move by 2x between runs and within one
    (the H200 of 2026-11-28, ``docs/gpu.md``): a ratio of two sequential medians says nothing there, the interleaved
    rounds' ratio does."""
    if plan.decode_timing != "auto":
        return plan.decode_timing == "interleaved"
    if model.device.type == "cpu":
        return True
    if model.device.type != "cuda" or any(cfg.compile for cfg in group):
        return False
    import torch

    dev = model.device
    free = torch.cuda.mem_get_info(dev)[0] + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    caches = sum(int(r["kv_bytes"]) for r in rows)
    working = max(int(r["peak_mem_bytes"]) - int(r["peak_mem_baseline_bytes"]) - int(r["kv_bytes"]) for r in rows)
    return caches + max(working, 0) <= INTERLEAVE_MEMORY_SHARE * free


def length_groups(cfgs: list[BenchConfig]) -> list[list[BenchConfig]]:
    """Consecutive configurations of one context length (the order of :func:`configs`)."""
    groups: list[list[BenchConfig]] = []
    for cfg in cfgs:
        if groups and groups[-1][0].length == cfg.length:
            groups[-1].append(cfg)
        else:
            groups.append([cfg])
    return groups


def apply_interleaved(rows: list[dict], times: list[list[float]]) -> None:
    """Replace each row's decode statistics by its interleaved step times, keeping the sequential median, and add
    ``decode_vs_first``: the median over rounds of the step-time ratio to the length's first configuration.

    A round's steps run back to back, so a slowdown of the machine that lasts longer than a round cancels in its
    ratio; a shorter one makes that round's ratio an outlier up or down, which the median ignores. On a noisy
    machine this ratio is far steadier than the ratio of two medians."""
    ref = times[0]
    eager = {_label(r): t for r, t in zip(rows, times) if not r.get("compile")}
    for row, t in zip(rows, times):
        row["decode_ms_sequential"] = row["decode_ms_per_token"]
        row.update(
            {
                "decode_ms_per_token": statistics.median(t),
                "decode_ms_min": min(t),
                "decode_ms_max": max(t),
                "decode_steps": len(t),
                "decode_timing": "interleaved",
                "decode_vs_first": statistics.median(a / b for a, b in zip(t, ref)),
                "decode_first": _label_compiled(rows[0]),
                "decode_ms_steps": [round(x, 4) for x in t],
            }
        )
        if row.get("compile") and _label(row) in eager:  # the paired ratio: compiled step / eager step, per round
            row["decode_vs_eager"] = statistics.median(a / b for a, b in zip(t, eager[_label(row)]))


def _pair_sequential(row: dict, rows: list[dict]) -> None:
    """A compiled row not timed interleaved with its eager twin (on CUDA a compiled group is never interleaved, nor
    is any under ``--decode-timing sequential``) gets ``decode_vs_eager`` as the ratio of the two rows' own medians,
    which its ``decode_timing`` (``"sequential"``) qualifies: without it the compiled rows had none."""
    if not row.get("compile") or row.get("decode_vs_eager") is not None:
        return
    eager = next((r for r in rows if not r.get("compile") and _label(r) == _label(row)), None)
    if eager is not None and eager.get("decode_ms_per_token") and row.get("decode_ms_per_token") is not None:
        row["decode_vs_eager"] = row["decode_ms_per_token"] / eager["decode_ms_per_token"]


def _label(row: dict) -> str:
    """``method[@budget][ kv_dtype]`` of a result row (names the reference of ``decode_vs_first``); no budget for a
    row that keeps every token (:func:`~slake.engines.transformers.baselines.holds_every_token`)."""
    budget = "" if holds_every_token(row["method"]) else f"@{row['budget']}"
    return f"{row['method']}{budget}" + (f" {row['kv_dtype']}" if row.get("kv_dtype") else "")


def _label_compiled(row: dict) -> str:
    return _label(row) + (" compiled" if row.get("compile") else "")
