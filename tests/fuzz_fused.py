"""The fused decode kernels against the torch step on random shapes (a script, run by hand after a kernel change;
``tests/test_fuzz_fused.py`` runs a few cases of each part in ``make test`` so that it keeps working).

``tests/test_fused_decode.py`` and ``tests/test_dense_attention.py`` check chosen cases; this draws many:

* ``step``: the transformers engine's step (:class:`slake.cache.compressed.CompressedKV`) for every method with a
  fused rule and a few variants, at random batch sizes (1-3, a padded row or not), KV heads (1-3), groups (1, 2, 3, 5,
  7 query heads per KV head), head sizes (8 to 40, not only powers of two), prompt lengths (20 to 57, some within the
  budget), budgets, steps (2 to 9), dtypes (float32, bfloat16, float16) and 8-bit storage (int8, fp8 e4m3), half
  of them with the rows read in blocks (the form of rows wider than 16,384 slots, ``slake.kernels.triton_wide``),
  and the evictions across a layer's KV heads (``decode_scope=layer``, ``slake.kernels.triton_layer``);
* ``pool``: the vLLM pool's step (:class:`slake.engines.vllm.plugin.decode_pool.DecodePool`) for every method the
  plugin supports, both paged layouts, block sizes 4 to 16, half of them with the rows read in blocks;
* ``dense``: the full cache's masked attention split over the keys (:mod:`slake.kernels.triton_dense`) against SDPA
  with the validity as its mask, rows of 1 to 700 slots, head sizes 8 to 96, random validity.

In the interpreter every load and store of every kernel is checked to stay within the tensor arguments of its
launch (:mod:`kernel_bounds`), and slake's uninitialised CPU tensors hold NaN and -1 until written
(:mod:`scratch_poison`), as in ``make test``.

Each case prints one line (``ok`` or ``FAIL`` with its configuration, which ``--only`` reruns alone); the exit status
is the number of failed cases (at most 100). A step case whose two paths first differ by evicting two slots whose
scores in the torch step are within the case's tolerance of each other prints ``tie`` with the scores and is not
counted: rounding in another order (an ulp of bfloat16) decides such a tie either way, and from there the two caches
hold different tokens (:func:`step_near_tie`). The kernels run in Triton's interpreter on the CPU, or compiled where
there is a GPU. Usage::

    python tests/fuzz_fused.py step --cases 200 --seed 1
    python tests/fuzz_fused.py dense --only 17
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import traceback
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before Triton is imported: the kernels then run in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import fused_cases as step_tests  # noqa: E402
import kernel_bounds  # noqa: E402
import scratch_poison  # noqa: E402
import test_dense_attention as dense_tests  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":  # every access of every kernel within its arguments (as in make test)
    kernel_bounds.install()
scratch_poison.install()  # slake's uninitialised CPU tensors hold NaN and -1 until written (as in make test)

#: variants beside the methods' defaults: orders of eviction, the linear term, per-head budgets, two stages
VARIANTS = [
    "slake[linear_cache=false]",
    "cake[linear_cache=true]",
    "kvzip[keep_generated=true]",
    "criticalkv[scorer=expected-attention,window=0]",
    "slake[decode_eviction=false]",  # append-only after the prefill: the kernels with no eviction
    "sagekv[decode_eviction=false]",
    # an eviction across a layer's KV heads (the layer kernel, slake.kernels.triton_layer)
    "ada-snapkv[decode_scope=layer]",
    "ada-expected-attention[decode_scope=layer]",
    "ada-criticalkv[decode_scope=layer]",
    "kvzip[decode_scope=layer]",
]
HALF = (torch.bfloat16, torch.float16)


def step_case(r: random.Random, seed: int) -> tuple[str, dict]:
    """A random configuration of the transformers engine's step: ``(method, keyword arguments of _run)``."""
    name = r.choice(step_tests.FUSED + VARIANTS)
    opts = dict(
        B=r.choice([1, 2, 3]), H=r.choice([1, 2, 3]), G=r.choice([1, 2, 3, 5, 7]), D=r.choice([8, 12, 16, 20, 24, 40]),
        S=r.choice([20, 33, 40, 57]), budget=r.choice([8, 13, 16, 24]), steps=r.choice([2, 4, 9]),
        layers=r.choice([1, 2]), pad=r.choice([True, False]), kv_dtype=r.choice([None, None, "int8", "fp8_e4m3"]),
        dtype=r.choice([torch.float32] * 3 + list(HALF)), seed=seed,
    )  # fmt: skip
    if opts["kv_dtype"] is not None:  # 8-bit rows are quantised from float32 keys in these tests
        opts["dtype"] = torch.float32
    if name.startswith("ada-"):  # per-head budgets need room for every head's share
        opts["budget"] = max(opts["budget"], 12)
    # half of the cases read the rows in blocks of 16 (launch_config.WIDE_SLOTS lowered to 8 or 16: the form of
    # rows wider than 16,384 slots on a GPU)
    opts["wide"] = r.choice([None, None, 8, 16])
    return name, opts


def run_step(name: str, opts: dict) -> str:
    """One step case; raises AssertionError where the kernels differ from the torch step. Returns which ran."""
    from slake.kernels import launch_config

    method = step_tests._method(name)
    opts = dict(opts)
    wide = opts.pop("wide", None)
    ref, ref_out = step_tests._run(method, "torch", **opts)
    blocks = launch_config.tuned(WIDE_SLOTS=wide, WIDE_BLOCK=16) if wide else launch_config.tuned()
    with blocks:
        fused, fused_out = step_tests._run(method, "triton", **opts)
    ran = fused.decoder.report.summary()
    # a batch whose prompts all fit the budget takes the full cache's step (one SDPA call over an unpadded prefix,
    # reported "sdpa"); the rest must be the kernels
    assert ran in ("triton", "sdpa", "sdpa+triton") and "torch" not in fused.decoder.report.steps, ran
    fused.decoder.report.summary = lambda: "triton"  # type: ignore[method-assign]
    step_tests._assert_same(ref, ref_out, fused, fused_out, 1e-5 if opts["dtype"] == torch.float32 else 2e-2)
    return ran


def _kept(layer) -> list[list[set[int]]]:
    """The positions each row and KV head of a layer's store keeps."""
    held = layer.positions.masked_fill(~layer.valid, -1).tolist()
    return [[{p for p in head if p >= 0} for head in row] for row in held]


def step_near_tie(name: str, opts: dict) -> str | None:
    """Where a failed step case's kept slots first differ, whether the two paths evicted slots whose scores in the
    torch step differ by at most the case's tolerance (relative): a near tie that rounding turns either way (in
    bfloat16 a projected norm summed in another order moves by an ulp, 0.4%), after which the two caches hold
    different tokens and every later step differs. Returns a description of the tie, or None when the first
    difference is not one (then the case is a failure)."""
    from slake.kernels import launch_config

    opts = dict(opts)
    wide = opts.pop("wide", None)
    tol = 1e-5 if opts["dtype"] == torch.float32 else 2e-2
    for steps in range(1, opts["steps"] + 1):
        run = dict(opts, steps=steps)
        method = step_tests._method(name)
        calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        scores = method.decode_scores

        def recording(inputs, scores=scores, calls=calls):
            out = scores(inputs)
            calls.append((inputs.positions.clone(), out.detach().float().clone()))
            return out

        method.decode_scores = recording  # the torch step calls the method's rule once per layer and step
        ref, ref_out = step_tests._run(method, "torch", **run)
        with launch_config.tuned(WIDE_SLOTS=wide, WIDE_BLOCK=16) if wide else launch_config.tuned():
            fused, fused_out = step_tests._run(step_tests._method(name), "triton", **run)
        if all(_kept(a) == _kept(b) for a, b in zip(ref.layers, fused.layers, strict=True)):
            fused.decoder.report.summary = lambda: "triton"  # type: ignore[method-assign]
            try:  # the same tokens kept so far: everything else must be equal too
                step_tests._assert_same(ref, ref_out, fused, fused_out, tol)
            except AssertionError:
                return None
            continue
        for li, (a, b) in enumerate(zip(ref.layers, fused.layers, strict=True)):
            kept_ref, kept_fused = _kept(a), _kept(b)
            if kept_ref == kept_fused:
                continue
            if len(calls) != steps * opts["layers"]:
                return None  # a layer that scored nothing at some step: the call of this one is not known
            positions, step_scores = calls[(steps - 1) * opts["layers"] + li]
            for r, (row_ref, row_fused) in enumerate(zip(kept_ref, kept_fused)):
                evicted = [(h, p) for h in range(len(row_ref)) for p in row_ref[h] ^ row_fused[h]]
                if not evicted:
                    continue
                values = []
                for h, p in evicted:
                    slot = (positions[r, h] == p).nonzero()
                    if slot.numel() != 1:
                        return None
                    values.append(float(step_scores[r, h, int(slot)]))
                spread = max(values) - min(values)
                if spread > tol * max(abs(v) for v in values):
                    return None
                return (
                    f"near tie at step {steps}, layer {li}, row {r}: (head, position) {evicted} scored {values} "
                    f"in the torch step ({spread / max(abs(v) for v in values):.2%} apart, tolerance {tol:.0e})"
                )
    return None  # the same tokens kept at every step: the failure was not a tie


def pool_case(r: random.Random, seed: int) -> tuple[str, dict]:
    """A random configuration of the vLLM pool's step."""
    from slake.engines.vllm.plugin.config import SUPPORTED_METHODS

    names = [n for n in step_tests.FUSED if n in SUPPORTED_METHODS]
    name = r.choice(names)
    return name, dict(
        BS=r.choice([4, 8, 16]), H=r.choice([1, 2, 3]), G=r.choice([1, 2, 3, 7]), D=r.choice([8, 12, 16, 24, 40]),
        BUDGET=r.choice([12, 24, 30]), flash=r.choice([True, False]),
        wide=r.choice([None, None, 8, 16]),
    )  # fmt: skip


def run_pool(name: str, opts: dict) -> str:
    from slake.engines.vllm.plugin.paged import CpuAttnLayout, FlashAttnLayout
    from slake.kernels import launch_config

    shape = {k: opts[k] for k in ("BS", "H", "G", "D", "BUDGET")}
    layout = FlashAttnLayout() if opts["flash"] else CpuAttnLayout()
    ref, ref_cache, ref_out = step_tests._pool_run(name, "torch", layout, opts["flash"], **shape)
    wide = opts.get("wide")  # rows read in blocks of 16 (half of the cases)
    with launch_config.tuned(WIDE_SLOTS=wide, WIDE_BLOCK=16) if wide else launch_config.tuned():
        fused, cache, out = step_tests._pool_run(name, "triton", layout, opts["flash"], **shape)
    assert fused.report.summary() == "triton", fused.report.summary()
    for a, b in zip(ref_out, out, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert torch.equal(ref.valid, fused.valid) and torch.equal(ref.positions, fused.positions), "the kept slots"
    torch.testing.assert_close(fused.scores, ref.scores, rtol=1e-5, atol=1e-5)
    assert torch.equal(ref_cache, cache), "the paged cache"
    if ref.linear is not None:
        torch.testing.assert_close(fused.linear, ref.linear, rtol=1e-5, atol=1e-5)
    return "triton"


def dense_case(r: random.Random, seed: int) -> tuple[str, dict]:
    """A random call of the dense attention."""
    return "dense", dict(
        R=r.choice([1, 2, 3]), H=r.choice([1, 2, 3]), G=r.choice([1, 2, 3, 5, 7]), W=r.randint(1, 700),
        d=r.choice([8, 12, 20, 40, 80, 96]), dtype=r.choice([torch.float32, *HALF]), empty=round(r.random(), 2),
        seed=seed,
    )  # fmt: skip


def run_dense(_: str, o: dict) -> str:
    g = torch.Generator().manual_seed(o["seed"])
    device = dense_tests.DEVICE
    query = torch.randn(o["R"], o["H"] * o["G"], o["d"], generator=g).to(device, o["dtype"])
    keys, values = (torch.randn(o["R"], o["H"], o["W"], o["d"], generator=g).to(device, o["dtype"]) for _ in "kv")
    valid = torch.rand(o["R"], o["H"], o["W"], generator=g) > o["empty"]
    valid[..., int(torch.randint(o["W"], (1,), generator=g))] = True  # every row keeps a slot (the new token)
    valid = valid.to(device)
    out = dense_tests._kernels().dense_attention(query, keys, values, valid, dense_tests._NONE, dense_tests._NONE, 0.3)
    tol = 1e-5 if o["dtype"] == torch.float32 else 2e-2
    assert out.dtype == o["dtype"]
    torch.testing.assert_close(out.float(), dense_tests._reference(query, keys, values, valid, 0.3), rtol=tol, atol=tol)
    return "triton"


PARTS = {"step": (step_case, run_step), "pool": (pool_case, run_pool), "dense": (dense_case, run_dense)}


def fuzz(part: str, cases: int, seed: int = 0, only: int | None = None, out=sys.stdout) -> list[int]:
    """Run ``cases`` random cases of ``part`` (case ``i`` is drawn from ``seed * 100_000 + i``; ``only``: that case
    alone); print a line per case and return the failed cases' numbers."""
    draw, run = PARTS[part]
    failed = []
    for i in [only] if only is not None else range(cases):
        name, opts = draw(random.Random(seed * 100_000 + i), i)
        try:
            ran = run(name, opts)
            print(f"ok {i} {name} {ran} {opts}", file=out, flush=True)
        except Exception as exc:  # noqa: BLE001 - every failure is reported with its case, then counted
            tie = step_near_tie(name, opts) if part == "step" and isinstance(exc, AssertionError) else None
            if tie is not None:
                print(f"tie {i} {name} {opts}: {tie}", file=out, flush=True)
                continue
            failed.append(i)
            print(f"FAIL {i} {name} {opts}: {type(exc).__name__}: {exc}", file=out, flush=True)
            if only is not None:
                traceback.print_exc()
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=sorted(PARTS))
    parser.add_argument("--cases", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", type=int, default=None, help="run case ONLY alone, with its traceback")
    args = parser.parse_args(argv)
    if args.cases < 1:
        parser.error("--cases must be at least 1")
    failed = fuzz(args.part, args.cases, args.seed, args.only)
    print(f"{len(failed)} of {1 if args.only is not None else args.cases} cases failed: {failed}")
    return min(len(failed), 100)


if __name__ == "__main__":
    sys.exit(main())
