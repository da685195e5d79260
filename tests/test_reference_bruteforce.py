"""Methods without public code (SLAKE's VABS, AhaKV, SAGE-KV): brute-force transcriptions of the papers' equations,
written as plain loops over heads, rows and keys on tiny tensors, against our vectorised code (issue 22, item 4).
PTAA's own transcription is in ``tests/test_ptaa.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

from slake.cache.compressed import CompressedKV
from slake.methods import make_method
from slake.methods.ahakv import ahakv_gain
from slake.methods.base import PrefillInputs
from slake.methods.common import window_logits
from slake.methods.slake import vabs_preference


def _qkv(seed, hq=4, hkv=2, s=20, d=8):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, hq, s, d, generator=g),
        torch.randn(1, hkv, s, d, generator=g),
        torch.randn(1, hkv, s, d, generator=g),
    )


def _logit(q, k, h, row, j, scaling):
    """Scaled logit of query ``row`` of query head ``h`` on key ``j`` (``None`` if ``j`` is in the future)."""
    g = q.shape[1] // k.shape[1]
    if j > row:
        return None
    return float(sum(float(q[0, h, row, t]) * float(k[0, h // g, j, t]) for t in range(q.shape[-1]))) * scaling


# ---------------------------------------------------------------------------------------------------- VABS
def vabs_bruteforce(q, k, v, indicator, sel_budget, w, alpha, beta, gamma_v, split):
    """SLAKE paper Eqs. 15-18 as transcribed in spec 8.4, one (head, window row, key) at a time."""
    _, Hq, S, d = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    sc = 1 / math.sqrt(d)
    n_sel = S - w
    k0 = min(sel_budget, n_sel)
    tvva, ents = [], []
    for h in range(Hq):
        kv = h // g
        ranked = sorted(range(n_sel), key=lambda j: (-float(indicator[0, kv, j]), j))
        keep0 = set(ranked[:k0])
        vn = [math.sqrt(sum(float(x) ** 2 for x in v[0, kv, j])) for j in range(S)]
        omega = [x / sum(vn) for x in vn]
        for i in range(w):
            row = S - w + i
            x = [_logit(q, k, h, row, j, sc) for j in range(S)]
            vis = [j for j in range(S) if x[j] is not None]
            mx = max(x[j] for j in vis)
            z = sum(math.exp(x[j] - mx) for j in vis)
            a = [math.exp(x[j] - mx) / z if x[j] is not None else 0.0 for j in range(S)]
            if split == "uniform":
                ev = [j for j in range(n_sel) if j not in keep0]
            elif split == "window":
                ev = list(range(n_sel))
            else:  # "taylor": every visible key
                ev = vis
            mu = sum(x[j] for j in ev) / len(ev)
            kept = [j for j in vis if j not in ev]
            m = max([x[j] for j in kept] + [mu])
            wts = [0.0] * S
            for j in vis:
                if j in ev:
                    wts[j] = math.exp(mu - m) * (1 + x[j] - mu)
                else:
                    wts[j] = math.exp(x[j] - m)
            tot = sum(wts)
            err = [abs(wts[j] / tot - a[j]) for j in range(S)]
            tv = 0.5 * sum(err)
            va = max(sum(omega[j] * err[j] for j in range(S)), 1e-12) ** gamma_v
            ent = -sum(a[j] * math.log(a[j] + 1e-10) for j in range(n_sel))
            tvva.append(tv * va)
            ents.append(ent)
    return max(sum(tvva) / len(tvva), 1e-12) ** alpha * max(sum(ents) / len(ents), 1e-12) ** beta


@pytest.mark.parametrize("split", ["uniform", "window", "taylor"])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2)])
def test_vabs_matches_paper_equations(split, hq, hkv):
    q, k, v = _qkv(11, hq, hkv)
    S, w, d = q.shape[2], 5, q.shape[3]
    ind = torch.rand(1, hkv, S - w, generator=torch.Generator().manual_seed(3))
    logits = window_logits(q, k, w, 1 / math.sqrt(d))
    probs = torch.softmax(logits, -1)
    ours = float(vabs_preference(logits, probs, v, ind, 6, w, 0.5, 0.4, 0.1, split=split)[0])
    ref = vabs_bruteforce(q, k, v, ind, 6, w, 0.5, 0.4, 0.1, split)
    assert ours == pytest.approx(ref, rel=2e-4)


# ---------------------------------------------------------------------------------------------------- AhaKV
def ahakv_bruteforce(q, k, v, r, budget, kernel=7, gqa="mean"):
    """AhaKV (guide 2.3-2.5): SG-softmax with gain c = sqrt(2 ln(N/B)) on the last r rows, recent accumulation,
    value prior gbar = avgpool7(||v||^2) / max (padding not counted), max-pool 7."""
    _, Hq, S, d = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    c = math.sqrt(2 * math.log(max(S, budget + 1) / budget))
    sc = 1 / math.sqrt(d)
    F = [[0.0] * S for _ in range(Hq)]
    for h in range(Hq):
        for row in range(S - r, S):
            x = [_logit(q, k, h, row, j, sc) for j in range(S)]
            vis = [j for j in range(S) if x[j] is not None]
            mx = max(c * x[j] for j in vis)
            z = sum(math.exp(c * x[j] - mx) for j in vis)
            for j in vis:
                F[h][j] += math.exp(c * x[j] - mx) / z
    out = torch.zeros(1, Hkv, S, dtype=torch.float64)
    for kv in range(Hkv):
        heads = [F[kv * g + t] for t in range(g)]
        f = [(sum(hh[j] for hh in heads) / g) if gqa == "mean" else max(hh[j] for hh in heads) for j in range(S)]
        nu = [sum(float(x) ** 2 for x in v[0, kv, j]) for j in range(S)]
        gam = [
            sum(nu[t] for t in range(max(0, j - kernel // 2), min(S, j + kernel // 2 + 1)))
            / (min(S, j + kernel // 2 + 1) - max(0, j - kernel // 2))
            for j in range(S)
        ]
        gbar = [x / max(gam) for x in gam]
        f = [f[j] * gbar[j] for j in range(S)]
        for j in range(S):
            out[0, kv, j] = max(f[t] for t in range(max(0, j - kernel // 2), min(S, j + kernel // 2 + 1)))
    return out, c


@pytest.mark.parametrize("gqa", ["mean", "max"])
def test_ahakv_scale_and_score_match_paper_equations(gqa):
    q, k, v = _qkv(5, s=24)
    S, r, budget = 24, 6, 10
    method = make_method(f"ahakv[window={r},gqa={gqa}]")
    inputs = PrefillInputs(
        queries=q,
        keys=k,
        values=v,
        key_padding=torch.zeros(1, S, dtype=torch.bool),
        scaling=1 / math.sqrt(q.shape[-1]),
        window=r,
        layer_idx=0,
        num_layers=1,
        budget=torch.tensor([budget]),
    )
    ours = method.prefill_scores(inputs).scores
    ref, c = ahakv_bruteforce(q, k, v, r, budget, gqa=gqa)
    assert float(ahakv_gain(S, budget)) == pytest.approx(c, rel=1e-12)
    torch.testing.assert_close(ours.double(), ref, rtol=2e-5, atol=1e-7)


def test_ahakv_gain_is_one_at_n_equals_b_sqrt_e():
    """SG-softmax's gain crosses 1 at N = B e^{1/2} (guide 2.3): the paper's 'no change' point."""
    assert float(ahakv_gain(64 * math.exp(0.5), 64)) == pytest.approx(1.0, rel=1e-12)
    assert float(ahakv_gain(4096, 128)) == pytest.approx(math.sqrt(2 * math.log(32)), rel=1e-12)


# ---------------------------------------------------------------------------------------------------- SAGE-KV
def sagekv_bruteforce(q, k, budget, sink_fraction=0.25):
    """SAGE-KV (guide 3.3-3.4): sink S = floor(B/4), k = B // (2G) per query head by the last token's logit over the
    evictable region, recent = B - S - G k newest tokens; query head h sees sink + its own top-k + recent."""
    _, Hq, N, d = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    sink = int(math.floor(budget * sink_fraction))
    kk = budget // (2 * G)
    recent = budget - sink - G * kk
    evictable = [j for j in range(sink, N - recent)]
    sc = 1 / math.sqrt(d)
    visible = torch.zeros(1, Hkv, G, N, dtype=torch.bool)
    kept = torch.zeros(1, Hkv, N, dtype=torch.bool)
    for h in range(Hq):
        logits = {j: _logit(q, k, h, N - 1, j, sc) for j in evictable}
        top = sorted(evictable, key=lambda j: (-logits[j], j))[:kk]
        for j in list(range(sink)) + top + list(range(N - recent, N)):
            visible[0, h // G, h % G, j] = True
            kept[0, h // G, j] = True
    return visible, kept


@pytest.mark.parametrize("hq,hkv,budget", [(4, 2, 16), (4, 4, 12), (6, 2, 24)])
def test_sagekv_selection_matches_paper(hq, hkv, budget):
    q, k, v = _qkv(7, hq, hkv, s=40)
    S = q.shape[2]
    method = make_method("sagekv")
    inputs = PrefillInputs(
        queries=q,
        keys=k,
        values=v,
        key_padding=torch.zeros(1, S, dtype=torch.bool),
        scaling=1 / math.sqrt(q.shape[-1]),
        window=method.window,
        layer_idx=0,
        num_layers=1,
        budget=torch.tensor([budget]),
    )
    res = method.prefill_scores(inputs)
    visible, kept = sagekv_bruteforce(q, k, budget)
    assert torch.equal(res.head_visible, visible)
    eng = CompressedKV(method, budget, num_layers=1)
    eng.prefill_layer(0, q, k, v, None, 1 / math.sqrt(q.shape[-1]))
    store = eng.layers[0]
    ours = torch.zeros_like(kept)
    for h in range(hkv):
        ours[0, h, store.positions[0, h][store.valid[0, h]]] = True
    assert torch.equal(ours, kept)
