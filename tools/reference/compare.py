"""Compare slake's methods with the reference outputs and write the committed fixtures (runs in slake's env).

Inputs: the captured cases of ``capture.py`` and the ``ref.pt`` of ``reference_side.py``. Outputs:

* ``tests/fixtures/reference/<case>.npz|json``: the tensors of the random cases and of one layer of the default
  model's shortest capture (fp16), the references' kept sets there (bit-packed), their layer budgets and
  preferences of every layer, and the agreement measured now; ``tests/test_reference_fixtures.py`` re-checks it;
* ``tests/fixtures/reference/summary.json``: agreement per reference output over every layer and case (the
  numbers of ``docs/faithfulness.md``).

A ``ref.pt`` in which a reference failed (``reference_side.py`` records the failure and goes on) is refused unless
``--allow-failures`` is given (the fixtures would lack its comparisons), as is a default-model capture other than
``FIXTURE_MODEL``'s (the committed ``model_*`` fixture would be left stale).

Usage: ``PYTHONPATH=src python tools/reference/compare.py --cases /tmp/slake-ref --ref /tmp/slake-ref/ref.pt``
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from reference_ours import (FIXTURES, NEEDS_LAYER, PAIRS, PYRAMID_SINGLE, diff_beyond_ties,  # noqa: E402
                            kvzip_pass_scores, layer_context, ours_keep, ours_kvzip, output_diff, pack, pairs_for,
                            ref_key, set_metrics, spec_for)
from slake.budgets import preference_budgets  # noqa: E402
from slake.methods import make_method  # noqa: E402

KEEP_METRICS = ("jaccard", "equal_heads", "diff_frac", "diff_beyond_ties")

#: the default-model layer whose tensors go into the fixtures (one layer keeps them small)
FIXTURE_MODEL = ("model_731", 14)


def layer_position(l: int, L: int, key: str) -> tuple[int, int]:
    return PYRAMID_SINGLE if (L == 1 and "pyramid" in key) else (l, L)


def budget_metrics(ours: list[int], ref: list[int]) -> dict:
    o, r = np.array(ours), np.array(ref)
    return {"equal_layers": float((o == r).mean()), "abs_diff_frac": float(np.abs(o - r).sum() / max(r.sum(), 1)),
            "ours_total": int(o.sum()), "ref_total": int(r.sum())}


def compare_kvzip(case: dict, res: dict, stem: str, kind: str, agg, fixtures: dict) -> None:
    """KVzip against kvpress on one recorded reconstruction pass (whole model: budgets are global): our scores of the
    recorded (chunk, layer) tensors; our kept sets through the compressor (its cascade rounds each layer to a
    multiple of its heads) and at kvpress's own per-head counts (the scores alone); kvpress's layer counts."""
    K, V = case["keys"], case["values"]
    L, H, S, d = K.shape
    b = res["budget"]
    src = res["kvzip"]
    ours_scores = kvzip_pass_scores(K, case["kvzip"]["chunks"], case["scaling"])
    sinks = make_method("kvzip").sinks  # kvpress gives its sinks amax + 1; ours are protected by the compressor
    agg[(kind, "kvzip")]["score_max_abs_diff"].append(
        float((ours_scores[:, 0, :, sinks:] - src["scores"][..., sinks:]).abs().max()))
    kept, counts = ours_kvzip("kvzip", K, V, ours_scores, b, case["queries"].shape[1])
    ref_counts = [int(x) for x in src["layer_budgets"]]
    for layer in range(L):
        ref_mask = src["kept"][layer]
        sc = ours_scores[layer, 0].clone()
        sc[:, : make_method("kvzip").sinks] = float("inf")
        m = set_metrics(kept[layer], ref_mask)
        m["diff_beyond_ties"] = diff_beyond_ties(kept[layer], ref_mask, sc)
        for name, val in m.items():
            agg[(kind, "kvzip")][name].append(val)
        heads = (ref_mask.sum(-1) - make_method("kvzip").sinks).tolist()
        q = torch.zeros(1, case["queries"].shape[1], S, d)
        mask, _, _, sc2 = ours_keep("kvzip", q, K[layer:layer + 1], V[layer:layer + 1], case["scaling"], heads, b,
                                    layer, L, pass_scores=ours_scores)
        m2 = set_metrics(mask, ref_mask)
        m2["diff_beyond_ties"] = diff_beyond_ties(mask, ref_mask, sc2)
        for name, val in m2.items():
            agg[(kind, "kvzip#scoring")][name].append(val)
    bm = budget_metrics(counts, ref_counts)
    agg[(kind, "kvzip")]["layer_budget_equal"].append(bm["equal_layers"])
    agg[(kind, "kvzip")]["layer_budget_abs_diff_frac"].append(bm["abs_diff_frac"])
    agg[(kind, "kvzip")]["layer_budget_max_abs_diff"].append(
        float(max(abs(a - r) for a, r in zip(counts, ref_counts))))
    if not (stem.startswith("kvzip_") or stem == FIXTURE_MODEL[0]):  # fixtures: the random case and model_731
        return
    fx = fixtures.setdefault(stem, {"arrays": {}, "meta": {"S": S, "scaling": case["scaling"], "num_layers": L,
                                                            "layer": None, "source": case["source"], "budgets": {}}})
    fx["meta"].setdefault("kvzip", {})[str(b)] = {
        "ref_layer_counts": ref_counts, "ours_layer_counts": counts,
        "diff_frac": float(set_metrics(kept, torch.stack(src["kept"]))["diff_frac"]),
        "jaccard": float(set_metrics(kept, torch.stack(src["kept"]))["jaccard"])}
    fx["arrays"][f"kvzip_b{b}__ref"] = pack(torch.stack(src["kept"]))
    if stem.startswith("kvzip_"):  # the random case: everything to recompute our scores in the test
        kz = case["kvzip"]
        fx["arrays"].update(kvzip_keys=K.numpy().astype(np.float16), kvzip_values=V.numpy().astype(np.float16))
        fx["meta"]["kvzip_chunks"] = [{"start": c["start"], "end": c["end"], "sink": c["sink"]} for c in kz["chunks"]]
        fx["meta"]["hq"] = int(case["queries"].shape[1])
        for i, c in enumerate(kz["chunks"]):
            fx["arrays"][f"kvzip_chunk{i}_queries"] = c["queries"].numpy().astype(np.float16)
            fx["arrays"][f"kvzip_chunk{i}_keys"] = c["keys"].numpy().astype(np.float16)
    else:  # the model: our scores (the test checks the selection on them) and the model's keys for the shapes
        fx["arrays"]["kvzip_scores"] = ours_scores[:, 0].numpy().astype(np.float32)
        fx["meta"]["hq"] = int(case["queries"].shape[1])


def check_ref(ref: dict, allow_failures: bool = False) -> None:
    """Refuse a ``ref.pt`` whose fixtures would be silently incomplete or stale.

    Parameters
    ----------
    ref : dict
        ``reference_side.py``'s output: ``versions``, ``failures``, ``cases``.
    allow_failures : bool
        ``--allow-failures``: go on where a reference failed (its comparisons are then missing from the fixtures).

    Raises
    ------
    SystemExit
        Where a reference failed (``reference_side.py`` records the failure and goes on: written as they are, the
        fixtures and ``summary.json`` would drop that reference's comparisons without a word), or where the default
        model's cases do not include :data:`FIXTURE_MODEL`'s capture (the committed ``model_*`` fixture would be left
        as it was while ``summary.json`` describes another capture).
    """
    failures = ref.get("failures") or {}
    if failures and not allow_failures:
        lines = "\n".join(f"  {name}: {str(why).strip().splitlines()[-1] if str(why).strip() else why}"
                          for name, why in failures.items())
        raise SystemExit(f"reference_side.py recorded failures; fix them and run it again (or pass "
                         f"--allow-failures to write the fixtures without those comparisons):\n{lines}")
    stems = {key.split("/")[0] for key in ref.get("cases", {})}
    models = sorted(s for s in stems if s.startswith("model_"))
    if models and FIXTURE_MODEL[0] not in stems:
        raise SystemExit(f"the captured model cases are {', '.join(models)}, not {FIXTURE_MODEL[0]} whose layer "
                         f"{FIXTURE_MODEL[1]} the fixtures hold: the capture changed; set FIXTURE_MODEL in "
                         f"{Path(__file__).name} (and the tests and docs that name it)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=Path, required=True)
    ap.add_argument("--ref", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=FIXTURES)
    ap.add_argument("--allow-failures", action="store_true",
                    help="write the fixtures even where a reference failed (its comparisons are then missing)")
    args = ap.parse_args()
    ref = torch.load(args.ref)
    check_ref(ref, args.allow_failures)
    args.out.mkdir(parents=True, exist_ok=True)
    agg = defaultdict(lambda: defaultdict(list))  # key -> metric -> values (over cases and layers)
    fixtures: dict[str, dict] = {}
    for case_key, res in ref["cases"].items():
        stem, btag = case_key.split("/")
        kind = "model" if stem.startswith("model_") else stem.rsplit("_", 1)[0]
        case = torch.load(args.cases / f"{stem}.pt")
        if "kvzip" in res:
            compare_kvzip(case, res, stem, kind, agg, fixtures)
        if stem.startswith("kvzip_"):
            continue
        Q, K, V, scaling = case["queries"], case["keys"], case["values"], case["scaling"]
        w, b, L = res["window"], res["budget"], res["num_layers"]
        S = Q.shape[2]
        lay = (lambda l: (Q[l:l + 1], K[l:l + 1], V[l:l + 1])) if L > 1 else (lambda l: (Q, K, V))
        fix_layer = FIXTURE_MODEL[1] if stem == FIXTURE_MODEL[0] else (0 if kind != "model" else None)
        fx = fixtures.setdefault(stem, {"arrays": {}, "meta": {"S": S, "scaling": scaling, "num_layers": L,
                                                               "layer": fix_layer, "source": case["source"],
                                                               "budgets": {}}}) if fix_layer is not None else None
        if fx is not None:
            q, k, v = lay(fix_layer)
            fx["arrays"].update(queries=q.numpy().astype(np.float16), keys=k.numpy().astype(np.float16),
                                values=v.numpy().astype(np.float16))
            if "o_proj" in case:
                fx["arrays"]["o_proj"] = case["o_proj"][fix_layer].numpy().astype(np.float16)
            if "inv_freq" in case:
                fx["meta"].update(inv_freq=case["inv_freq"].tolist(), rope_scaling=case["rope_scaling"])
            fmeta = fx["meta"]["budgets"].setdefault(str(b), {"window": w, "pairs": {}})
        # ---------------- per-layer references
        for l, per in res["layers"].items():
            q, k, v = lay(l)
            for rkey, ref_mask in per.items():
                for key in pairs_for(rkey):
                    spec = spec_for(key, w)
                    method = make_method(spec)
                    mode = PAIRS[key][1]
                    if mode == "uniform":
                        sel = b - method.protected
                    elif mode == "ref":
                        sel = int(ref_mask.sum(-1)[0]) - method.protected
                    else:
                        sel = (ref_mask.sum(-1) - method.protected).tolist()
                    pl, pL = layer_position(l, L, key)
                    ctx = None
                    if any(n in key for n in NEEDS_LAYER):
                        ctx = layer_context(case["inv_freq"], case["rope_scaling"],
                                            case["o_proj"][l] if "o_proj" in case else None)
                    mask, counts, _, sc = ours_keep(spec, q, k, v, scaling, sel, b, pl, pL, layer=ctx)
                    m = set_metrics(mask, ref_mask)
                    m["out_diff"] = output_diff(q, k, v, scaling, mask, ref_mask)
                    m["ours_err"] = output_diff(q, k, v, scaling, mask, torch.ones_like(mask))
                    m["kept_ratio"] = float(mask.sum() / ref_mask.sum())
                    m["ref_err"] = output_diff(q, k, v, scaling, ref_mask, torch.ones_like(mask))
                    m["diff_beyond_ties"] = diff_beyond_ties(mask, ref_mask, sc)
                    ref_counts = (ref_mask.sum(-1) - method.protected).tolist()
                    m["head_budget_equal"] = float(counts.tolist() == ref_counts)
                    for name, val in m.items():
                        agg[(kind, key)][name].append(val)
                    if "pyramid" in key:
                        sched = method.pyramid_schedule(pL, b - w, S)
                        agg[(kind, key)]["layer_budget_equal"].append(float(int(sched[pl]) == ref_counts[0]))
                        if fx is not None:
                            lb = fmeta.setdefault("layer_budgets", {}).setdefault(key, {"ref": [None] * L})
                            lb["ref"][int(l)] = int(ref_counts[0])
                    if fx is not None and l == fix_layer:
                        fx["arrays"][f"b{b}__{rkey}"] = pack(ref_mask)
                        fmeta["pairs"][key] = {"spec": spec, "selectable": sel, "layer_idx": pl, "num_layers": pL,
                                               **{n: m[n] for n in KEEP_METRICS},
                                               "head_budget_equal": m["head_budget_equal"]}
        # ---------------- whole-model references (layer budgets)
        for key in [k for k in PAIRS if ref_key(k).split(".")[0] in ("cake", "lava")]:
            src = res.get(ref_key(key).split(".")[0])
            if src is None or not src.get("compressed", True):
                continue
            spec = spec_for(key, w)
            method = make_method(spec)
            ref_budgets = [int(x) for x in src["layer_budgets"]]
            prefs = []
            for l in range(L):
                q, k, v = lay(l)
                ref_mask = src["kept"][l]
                sel = ref_budgets[l]
                mask, counts, pref, sc = ours_keep(spec, q, k, v, scaling, sel, b, l, L)
                if "head_counts" in src:  # LAVa's per-head budgets
                    agg[(kind, key)]["head_budget_equal"].append(
                        float(counts.tolist() == [int(x) for x in src["head_counts"][l]]))
                prefs.append(pref)
                m = set_metrics(mask, ref_mask)
                m["out_diff"] = output_diff(q, k, v, scaling, mask, ref_mask)
                m["kept_ratio"] = float(mask.sum() / ref_mask.sum())
                m["ours_err"] = output_diff(q, k, v, scaling, mask, torch.ones_like(mask))
                m["ref_err"] = output_diff(q, k, v, scaling, ref_mask, torch.ones_like(mask))
                m["diff_beyond_ties"] = diff_beyond_ties(mask, ref_mask, sc)
                for name, val in m.items():
                    agg[(kind, key)][name].append(val)
                agg[(kind, key)]["pref_rel_diff"].append(abs(pref - src["prefs"][l]) / max(abs(src["prefs"][l]), 1e-30))
                if fx is not None and l == fix_layer:
                    fx["arrays"][f"b{b}__{ref_key(key)}"] = pack(ref_mask)
                    fmeta["pairs"][key] = {"spec": spec, "selectable": sel, "layer_idx": l, "num_layers": L,
                                           **{n: m[n] for n in KEEP_METRICS},
                                           "ref_pref": src["prefs"][l], "ours_pref": pref,
                                           "ref_head_counts": [int(x) for x in src.get("head_counts", [[]] * L)[l]]}
            total, cap = (b - w) * L, S - w
            ours_b = preference_budgets(torch.tensor(prefs), total, cap, final=True).tolist()
            same_prefs = preference_budgets(torch.tensor(src["prefs"], dtype=torch.float64), total, cap,
                                            final=True).tolist()
            bm = budget_metrics(ours_b, ref_budgets)
            bm_same = budget_metrics(same_prefs, ref_budgets)
            agg[(kind, key)]["layer_budget_equal"].append(bm["equal_layers"])
            agg[(kind, key)]["layer_budget_abs_diff_frac"].append(bm["abs_diff_frac"])
            agg[(kind, key)]["layer_budget_equal_same_prefs"].append(bm_same["equal_layers"])
            agg[(kind, key)]["layer_budget_abs_diff_frac_same_prefs"].append(bm_same["abs_diff_frac"])
            if fx is not None:
                fmeta.setdefault("layer_budgets", {})[key] = {
                    "ref": ref_budgets, "ref_prefs": [float(x) for x in src["prefs"]], "total": total, "cap": cap,
                    "same_prefs": bm_same}
    summary = {"versions": ref.get("versions", {}), "failures": ref.get("failures", {}), "pairs": {}}
    for (kind, key), metrics in sorted(agg.items()):
        summary["pairs"].setdefault(key, {"spec": PAIRS[key][0]})[kind] = {
            name: {"mean": float(np.mean(vals)), "min": float(np.min(vals)), "n": len(vals)}
            for name, vals in metrics.items()}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    for stem, fx in fixtures.items():
        np.savez_compressed(args.out / f"{stem}.npz", **fx["arrays"])
        (args.out / f"{stem}.json").write_text(json.dumps(fx["meta"], indent=1, sort_keys=True) + "\n")
    for key, d in summary["pairs"].items():
        for kind in ("model", "random_gqa", "random_mha", "kvzip_random"):
            if kind in d:
                x = d[kind]
                print(f"{key:24s} {kind:6s} J={x['jaccard']['mean']:.4f} eq={x['equal_heads']['mean']:.3f} "
                      f"diff={x['diff_frac']['mean']:.4f} nt={x['diff_beyond_ties']['mean']:.4f} "
                      + (f"out={x['out_diff']['mean']:.2e} err ours/ref={x['ours_err']['mean']:.3e}/"
                         f"{x['ref_err']['mean']:.3e}" if "out_diff" in x else "")
                      + (f" lb_eq={x['layer_budget_equal']['mean']:.3f}" if "layer_budget_equal" in x else "")
                      + (f" hb_eq={x['head_budget_equal']['mean']:.3f}" if "head_budget_equal" in x else ""))


if __name__ == "__main__":
    main()
