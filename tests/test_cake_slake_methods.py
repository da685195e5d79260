"""CAKE and SLAKE scoring rules (spec slake-cake.md sections 7.1, 7.4, 7.5, 8.4; invariant 9 of section 12)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from slake.methods.base import DecodeInputs, PrefillInputs, make_method
from slake.methods.cake import Cake, cake_indicator, cake_preference, cake_taus
from slake.methods.common import window_attention, window_logits
from slake.methods.slake import Slake, slake_alpha_beta, vabs_preference

GEN = torch.Generator().manual_seed(2)


def _qkv(B=1, Hq=4, Hkv=2, S=60, d=16):
    q = torch.randn(B, Hq, S, d, generator=GEN)
    k = torch.randn(B, Hkv, S, d, generator=GEN)
    v = torch.randn(B, Hkv, S, d, generator=GEN) * (1 + torch.rand(B, Hkv, S, 1, generator=GEN))
    return q, k, v


def _inputs(q, k, v, window, pad=None):
    pad = torch.zeros(q.shape[0], q.shape[2], dtype=torch.bool) if pad is None else pad
    return PrefillInputs(q, k, v, pad, q.shape[-1] ** -0.5, window, 0, 4)


def _spec_cake_stats(A, w, Hkv, tau1, tau2, gamma=200.0, ksize=5):
    """Spec section 7.6 ``cake_stats`` verbatim (B = 1)."""
    B, Hq, _, S = A.shape
    g = Hq // Hkv
    Ab = A[..., : S - w]
    H = -(Ab * torch.log(Ab + 1e-10)).sum()
    Vv = Ab.var(dim=-2, unbiased=True).sum()
    P = H.clamp_min(1e-12) ** (1 / tau1) * Vv.clamp_min(1e-12) ** (1 / tau2)
    I = Ab.mean(-2) + gamma * Ab.var(-2, unbiased=True)
    I = F.avg_pool1d(I, ksize, stride=1, padding=ksize // 2)
    return P.item(), I.view(B, Hkv, g, -1).mean(2)


def _padded_batch(seqs, S):
    """Left-pad a list of (q, k, v) single sequences to length S with garbage; returns q, k, v, padding."""
    qs, ks, vs, pads = [], [], [], []
    for q, k, v in seqs:
        p = S - q.shape[2]
        qs.append(torch.cat([torch.randn(1, q.shape[1], p, q.shape[3], generator=GEN) * 9, q], 2))
        ks.append(torch.cat([torch.randn(1, k.shape[1], p, k.shape[3], generator=GEN) * 9, k], 2))
        vs.append(torch.cat([torch.randn(1, v.shape[1], p, v.shape[3], generator=GEN) * 9, v], 2))
        pads.append(torch.arange(S) < p)
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), torch.stack(pads)


# ---------------------------------------------------------------------------------------------- CAKE prefill
def test_cake_matches_spec_sketch():
    q, k, v = _qkv()
    w = 8
    A = window_attention(q, k, w, q.shape[-1] ** -0.5)
    P_ref, I_ref = _spec_cake_stats(A, w, 2, 0.9, 2.3)
    abar = A[..., : A.shape[-1] - w]
    assert math.isclose(float(cake_preference(abar, 0.9, 2.3)), P_ref, rel_tol=1e-5)
    torch.testing.assert_close(cake_indicator(abar, 200.0, 5, "avg", 2), I_ref)
    out = Cake(window=w, tau1=0.9, tau2=2.3).prefill_scores(_inputs(q, k, v, w))
    assert out.scores.shape == (1, 2, 60) and out.preference.shape == (1,)
    torch.testing.assert_close(out.scores[..., : 60 - w], I_ref)
    assert torch.equal(out.scores[..., 60 - w :], torch.zeros(1, 2, w))


@pytest.mark.parametrize("block", [None, 7])
def test_row_variance_and_entropy_equal_the_plain_torch_formulas_bit_for_bit(block, monkeypatch):
    """``_row_var`` (float64 two-pass, by column blocks) and ``cake_entropy`` (in place) replace ``abar.var(-2)``
    and ``-(a * log(a + 1e-10)).sum()`` for speed; the indicator ranks tokens on them, so they must agree to the bit,
    on softmax rows of any sharpness, tied columns, zeroed (padded) rows and 2..64 window rows."""
    from slake.methods import cake as cake_module
    from slake.methods.cake import _row_var, cake_entropy

    if block is not None:
        monkeypatch.setattr(cake_module, "_VAR_BLOCK", block)
    g = torch.Generator().manual_seed(11)
    for trial in range(60):
        w = int(torch.randint(2, 65, (), generator=g))
        S = int(torch.randint(w + 1, 700, (), generator=g))
        x = torch.randn(2, 3, w, S, generator=g) * float(torch.rand((), generator=g) * 20)
        if trial % 3 == 0:
            x[..., :7] = 2.5  # tied columns
        a = torch.softmax(x, -1)
        if trial % 4 == 0:
            a[1, :, : w // 2] = 0.0  # padded window rows
        abar = a[..., : S - w]
        assert torch.equal(_row_var(abar), abar.var(dim=-2, correction=1))
        assert torch.equal(cake_entropy(abar), -(abar * torch.log(abar + 1e-10)).sum((1, 2, 3)))
    one = torch.rand(1, 2, 1, 9)
    assert torch.equal(_row_var(one), torch.zeros(1, 2, 9))
    a64 = torch.rand(1, 2, 5, 9, dtype=torch.float64)
    before = a64.clone()
    torch.testing.assert_close(_row_var(a64), before.var(dim=-2), rtol=1e-12, atol=0.0)
    assert torch.equal(a64, before)  # a float64 input is not updated in place


def test_cake_padded_batch_equals_unpadded():
    w, S = 8, 70
    seqs = [_qkv(S=70), _qkv(S=45), _qkv(S=9)]
    q, k, v, pad = _padded_batch(seqs, S)
    out = Cake(window=w, kernel=5).prefill_scores(_inputs(q, k, v, w, pad))
    assert torch.isfinite(out.scores).all() and torch.isfinite(out.preference).all()
    for b, (qb, kb, vb) in enumerate(seqs):
        ref = Cake(window=w).prefill_scores(_inputs(qb, kb, vb, w))
        n = qb.shape[2]
        torch.testing.assert_close(out.scores[b, :, S - n : S - w], ref.scores[0, :, : n - w])
        torch.testing.assert_close(out.preference[b], ref.preference[0], rtol=1e-5, atol=0)
    # a sample shorter than the window: finite, nothing selectable
    q, k, v, pad = _padded_batch([_qkv(S=30), _qkv(S=5)], 30)
    out = Cake(window=8).prefill_scores(_inputs(q, k, v, 8, pad))
    assert torch.isfinite(out.scores).all() and torch.isfinite(out.preference).all()


@pytest.mark.parametrize("S, window", [(5, 8), (8, 8), (20, 1)])
def test_cake_short_prompts_and_tiny_windows(S, window):
    q, k, v = _qkv(B=2, S=S)
    out = Cake(window=window).prefill_scores(_inputs(q, k, v, window))
    assert out.scores.shape == (2, 2, S)
    assert torch.isfinite(out.scores).all() and torch.isfinite(out.preference).all()
    assert bool((out.preference > 0).all())


def test_cake_validation_and_taus():
    for bad in (dict(kernel=4), dict(pooling="min"), dict(tau1=0.0), dict(gamma=-1.0), dict(window=0)):
        with pytest.raises(ValueError):
            Cake(**bad)
    assert cake_taus("meta-llama/Llama-2-7b-chat-hf", 128) == (0.9, 2.3)
    assert cake_taus("meta-llama/Llama-3.1-8B-Instruct", 1024) == (1.6, 0.4)
    assert cake_taus("mistralai/Mistral-7B-Instruct-v0.3", 128) == (1.0, 0.8)
    assert cake_taus("Qwen/Qwen2.5-7B-Instruct", 1024) == (1.5, 0.6)
    assert cake_taus("llama2-13b-chat", 128) == (1.8, 2.0)
    assert cake_taus("meta-llama/Llama-2-70b-chat-hf", 128) == (1.0, 1.0)
    assert cake_taus("meta-llama/Llama-2-7b-chat-hf", 256) == (1.0, 1.0)
    assert make_method("cake").layer_budgets == "preference"


# ---------------------------------------------------------------------------------------------- decode rule
def test_decode_scores_follow_spec_7_5():
    B, Hq, Hkv, n, w = 2, 4, 2, 20, 6
    method = Cake(window=w)
    probs = torch.softmax(torch.randn(B, Hq, 3, n, generator=GEN), -1)
    positions = torch.arange(n).expand(B, Hkv, n).clone()
    valid = torch.ones(B, Hkv, n, dtype=torch.bool)
    s = method.decode_scores(DecodeInputs(probs, positions, valid, torch.zeros(B, Hkv, n)))
    p = probs.mean(2)[..., : n - w]
    ref = F.avg_pool1d(p.reshape(-1, 1, n - w), 5, 1, 2).reshape(B, Hq, n - w).view(B, Hkv, 2, -1).mean(2)
    torch.testing.assert_close(s[..., : n - w], ref)
    # slots stored out of positional order: the same scores, permuted with the slots
    perm = torch.randperm(n, generator=GEN)
    s_perm = method.decode_scores(DecodeInputs(probs[..., perm], positions[..., perm], valid, torch.zeros(B, Hkv, n)))
    torch.testing.assert_close(s_perm, s[..., perm])
    assert torch.equal(Slake(window=w).decode_scores(DecodeInputs(probs, positions, valid, s)), s)


def test_decode_scores_with_the_callers_newest_position_are_the_same():
    """A caller that knows the newest token's position (the vLLM pool) passes it; the scores are bit-identical to
    those that take it from the largest valid position, with slots out of order and empty slots."""
    B, Hq, Hkv, n, w = 2, 6, 3, 24, 5
    probs = torch.softmax(torch.randn(B, Hq, 1, n, generator=GEN), -1)
    positions = torch.stack([torch.randperm(40, generator=GEN)[:n] for _ in range(B * Hkv)]).view(B, Hkv, n)
    valid = torch.rand(B, Hkv, n, generator=GEN) > 0.2
    newest = torch.tensor([50, 61]).view(B, 1, 1)
    slot = torch.randint(0, n, (B, Hkv, 1), generator=GEN)  # every head holds the newest token
    positions.scatter_(-1, slot, newest.expand(B, Hkv, 1))
    valid.scatter_(-1, slot, True)
    positions.masked_fill_(~valid, -1)
    for method in (Cake(window=w), Slake(window=w)):
        base = DecodeInputs(probs, positions, valid, torch.zeros(B, Hkv, n))
        given = DecodeInputs(probs, positions, valid, torch.zeros(B, Hkv, n), newest=newest)
        assert torch.equal(method.decode_scores(given), method.decode_scores(base))


# ---------------------------------------------------------------------------------------------- VABS
def _vabs_reference(logits, probs, values, indicator, selectable, alpha, beta, gamma_v, pad, split="uniform"):
    """Loop-based VABS (spec 8.4, readings of 10-S3) per sample; returns (P, TV values, (Ã >= 0) flags)."""
    B, Hq, w, S = logits.shape
    g = Hq // values.shape[1]
    prefs, tvs, nonneg = [], [], []
    for b in range(B):
        real = [j for j in range(S - w) if not pad[b, j]]
        k0 = min(selectable, len(real))
        if len(real) - k0 == 0:
            prefs.append(1e-12)
            continue
        prod, ents = [], []
        for h in range(Hq):
            kh = h // g
            order = sorted(real, key=lambda j: (-float(indicator[b, kh, j]), j))
            ev = torch.zeros(S, dtype=torch.bool)
            ev[order[0 if split == "window" else k0 :]] = True
            vn = values[b, kh].double().norm(dim=-1) * ~pad[b]
            omega = vn / vn.sum()
            for i in range(w):
                x, a = logits[b, h, i].double(), probs[b, h, i].double()
                if split == "taylor":  # every visible key, window included
                    ev = torch.isfinite(x)
                kept = torch.isfinite(x) & ~ev
                mu = x[ev].mean()
                m = max(x[kept].max(), mu) if bool(kept.any()) else mu
                wt = torch.zeros(S, dtype=torch.float64)
                wt[kept] = torch.exp(x[kept] - m)
                wt[ev] = torch.exp(mu - m) * (1 + x[ev] - mu)
                at = wt / wt.sum()
                err = (at - a).abs()
                tv = 0.5 * err.sum()
                tvs.append(float(tv))
                nonneg.append(bool((at >= 0).all()))
                prod.append(tv * max(float((omega * err).sum()), 1e-12) ** gamma_v)
                ab = a[: S - w]
                ents.append(float(-(ab * torch.log(ab + 1e-10)).sum()))
        prefs.append(max(sum(prod) / len(prod), 1e-12) ** alpha * max(sum(ents) / len(ents), 1e-12) ** beta)
    return torch.tensor(prefs), tvs, nonneg


def test_vabs_matches_loop_reference_and_invariant_9():
    w, S = 6, 40
    seqs = [_qkv(S=40), _qkv(S=31), _qkv(S=12)]
    q, k, v, pad = _padded_batch(seqs, S)
    logits = window_logits(q, k, w, q.shape[-1] ** -0.5, pad)
    probs = torch.softmax(logits, -1)
    ind = cake_indicator(probs[..., : S - w], 200.0, 5, "avg", 2)
    for selectable in (0, 4, 10):
        out = vabs_preference(logits, probs, v, ind, selectable, w, 0.6, 0.5, 0.1)
        ref, tvs, nonneg = _vabs_reference(logits, probs, v, ind, selectable, 0.6, 0.5, 0.1, pad)
        torch.testing.assert_close(out, ref.float(), rtol=2e-4, atol=1e-12)
        explicit = vabs_preference(logits, probs, v, ind, selectable, w, 0.6, 0.5, 0.1, key_padding=pad)
        torch.testing.assert_close(explicit, out)
        assert all(math.isfinite(t) for t in tvs)
        assert all(0 <= t <= 1 + 1e-9 for t, ok in zip(tvs, nonneg) if ok)
    # sample 2 has 12 - 6 = 6 selectable tokens: nothing evicted with C' = 10 -> epsilon
    assert vabs_preference(logits, probs, v, ind, 10, w, 0.6, 0.5)[2] == torch.tensor(1e-12)


@pytest.mark.parametrize("split", ["window", "taylor"])
def test_vabs_splits_match_loop_reference(split):
    """Spec 10-S3 readings (b) provisional budget 0 and (c) the full-Taylor map, against the loop reference."""
    w, S = 6, 40
    q, k, v, pad = _padded_batch([_qkv(S=40), _qkv(S=31), _qkv(S=12)], S)
    logits = window_logits(q, k, w, q.shape[-1] ** -0.5, pad)
    probs = torch.softmax(logits, -1)
    ind = cake_indicator(probs[..., : S - w], 200.0, 5, "avg", 2)
    for selectable in (0, 4, 10):
        out = vabs_preference(logits, probs, v, ind, selectable, w, 0.6, 0.5, 0.1, split=split)
        ref, tvs, _ = _vabs_reference(logits, probs, v, ind, selectable, 0.6, 0.5, 0.1, pad, split=split)
        torch.testing.assert_close(out, ref.float(), rtol=2e-4, atol=1e-12)
        assert all(math.isfinite(t) for t in tvs)
    # neither reading depends on the indicator's ranking (nothing is provisionally kept outside the window)
    shuffled = ind[..., torch.randperm(S - w)]
    torch.testing.assert_close(
        vabs_preference(logits, probs, v, shuffled, 4, w, 0.6, 0.5, split=split),
        vabs_preference(logits, probs, v, ind, 4, w, 0.6, 0.5, split=split),
    )
    # a sample that fits in the budget still evicts nothing: epsilon, as for the uniform split
    assert vabs_preference(logits, probs, v, ind, 10, w, 0.6, 0.5, split=split)[2] == torch.tensor(1e-12)


@pytest.mark.parametrize("split", ["uniform", "window", "taylor"])
def test_vabs_in_row_blocks_equals_one_block(split, monkeypatch):
    """The VABS map is computed a few window rows at a time (bounded memory); any block size gives the same score."""
    from slake.methods import slake as slake_module

    w, S = 6, 40
    q, k, v, pad = _padded_batch([_qkv(S=40), _qkv(S=31), _qkv(S=12)], S)
    logits = window_logits(q, k, w, q.shape[-1] ** -0.5, pad)
    probs = torch.softmax(logits, -1)
    ind = cake_indicator(probs[..., : S - w], 200.0, 5, "avg", 2)
    outs = []
    for block in (1 << 40, 1, 3 * 4 * 4 * S):  # one block; one row at a time; 4 rows (the last block has 2)
        monkeypatch.setattr(slake_module, "_VABS_BLOCK", block)
        outs.append(vabs_preference(logits, probs, v, ind, 4, w, 0.6, 0.5, 0.1, split=split))
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-6, atol=0.0)


def test_vabs_full_taylor_fast_rows_equal_the_general_form_bit_for_bit():
    """The full-Taylor split takes a shortcut (:func:`_taylor_rows`: no exponential, no finiteness masks, visible
    counts and masked keys from the padding and the causal block); it must give the general PTAA-map form's numbers
    exactly, padded and tied rows included."""
    from slake.methods.slake import _taylor_rows, _vabs_rows

    for seed, (S, w, lens) in enumerate([(40, 6, (40, 31, 12, 3)), (300, 32, (300, 20)), (97, 1, (97, 50))]):
        g = torch.Generator().manual_seed(seed)
        seqs = []
        for n in lens:
            q, k, v = (torch.randn(1, h, n, 16, generator=g) * sc for h, sc in ((6, 3.0), (2, 1.0), (2, 1.0)))
            k[:, :, 2:9] = k[:, :, 2:3]  # tied keys
            q[:, :, -2:] = 0.0  # uniform rows
            seqs.append((q, k, v))
        q, k, v, pad = _padded_batch(seqs, S)
        x = window_logits(q, k, w, 0.25, pad)
        a = torch.softmax(x, -1).masked_fill(pad[:, None, S - w :, None], 0.0)
        B = len(lens)
        x5, a5 = x.reshape(B, 2, 3, w, S), a.reshape(B, 2, 3, w, S)
        omega = torch.rand(B, 2, 1, 1, S, generator=g)
        visible = (~pad).cumsum(-1)[:, S - w :].clamp_min(1).float()[:, None, None, :]
        hidden = (torch.ones(w, w, dtype=torch.bool).triu(1), pad[:, None, None, None, :])
        fast = _taylor_rows(x5, a5, visible, hidden, omega, S - w, 0.1)
        general = _vabs_rows(x5, a5, None, None, omega, S - w, 0.1)
        for f, r in zip(fast, general):
            assert torch.equal(f.nan_to_num(), r.nan_to_num()) and torch.equal(f.isnan(), r.isnan())


@pytest.mark.parametrize("split", ["uniform", "window", "taylor"])
def test_vabs_with_a_zero_exponent_skips_its_factor_and_matches_the_reference(split):
    """alpha = 0 or beta = 0 makes a factor exactly 1 (its passes are skipped): the score still equals the loop
    reference, and the other factor is the one computed with both exponents set."""
    w, S = 6, 40
    q, k, v, pad = _padded_batch([_qkv(S=40), _qkv(S=31), _qkv(S=12)], S)
    logits = window_logits(q, k, w, q.shape[-1] ** -0.5, pad)
    probs = torch.softmax(logits, -1)
    ind = cake_indicator(probs[..., : S - w], 200.0, 5, "avg", 2)
    both = vabs_preference(logits, probs, v, ind, 4, w, 1.0, 1.0, split=split)
    for alpha, beta in ((0.6, 0.0), (0.0, 0.5), (0.0, 0.0)):
        out = vabs_preference(logits, probs, v, ind, 4, w, alpha, beta, split=split)
        ref, _, _ = _vabs_reference(logits, probs, v, ind, 4, alpha, beta, 0.1, pad, split=split)
        torch.testing.assert_close(out, ref.float(), rtol=2e-4, atol=1e-12)
    err_only = vabs_preference(logits, probs, v, ind, 4, w, 1.0, 0.0, split=split)
    ent_only = vabs_preference(logits, probs, v, ind, 4, w, 0.0, 1.0, split=split)
    evicting = both > 1e-12
    torch.testing.assert_close(err_only[evicting] * ent_only[evicting], both[evicting], rtol=1e-6, atol=0.0)


def test_vabs_split_option_validated_and_changes_the_score():
    with pytest.raises(ValueError, match="vabs_split"):
        Slake(vabs_split="nosuch")
    w, S = 6, 40
    q, k, v, pad = _padded_batch([_qkv(S=40)], S)
    logits = window_logits(q, k, w, q.shape[-1] ** -0.5, pad)
    probs = torch.softmax(logits, -1)
    ind = cake_indicator(probs[..., : S - w], 200.0, 5, "avg", 2)
    scores = {
        sp: float(vabs_preference(logits, probs, v, ind, 10, w, 0.6, 0.5, split=sp)[0])
        for sp in ("uniform", "window", "taylor")
    }
    assert len(set(scores.values())) == 3, scores
    with pytest.raises(ValueError, match="split"):
        vabs_preference(logits, probs, v, ind, 10, w, 0.6, 0.5, split="nosuch")


def test_vabs_epsilon_when_nothing_evicted_and_padding_invariance():
    q, k, v = _qkv(B=2, S=50)
    w = 8
    method = Slake(window=w, budget_hint=50)
    assert torch.equal(method.prefill_scores(_inputs(q, k, v, w)).preference, torch.full((2,), 1e-12))
    method = Slake(window=w, budget_hint=20, alpha=0.4, beta=0.2)
    seqs = [_qkv(S=50), _qkv(S=37)]
    qp, kp, vp, pad = _padded_batch(seqs, 50)
    batch = method.prefill_scores(_inputs(qp, kp, vp, w, pad)).preference
    for b, (qb, kb, vb) in enumerate(seqs):
        single = method.prefill_scores(_inputs(qb, kb, vb, w)).preference
        torch.testing.assert_close(batch[b], single[0], rtol=1e-4, atol=0)
    assert bool((batch > 1e-12).all())


def test_slake_ablation_switches_and_helpers():
    q, k, v = _qkv(B=2, S=50)
    inp = _inputs(q, k, v, 8)
    cake = Cake(window=8, tau1=0.5, tau2=0.4).prefill_scores(inp)
    for lin in (False, True):
        s = make_method("slake", window=8, tau1=0.5, tau2=0.4, linear_cache=lin, vabs=False)
        out = s.prefill_scores(inp)
        assert torch.equal(out.preference, cake.preference) and torch.equal(out.scores, cake.scores)
        assert s.linear_cache is lin
    full = Slake(window=8, budget_hint=24)
    assert full.linear_cache and full.vabs and full.evict_before_output and not Cake().evict_before_output
    # without the linear cache SLAKE decodes in CAKE's order: evicting first would only drop the victim from the output
    assert not Slake(linear_cache=False).evict_before_output
    assert Slake.layer_budgets == "preference" and Slake.name == "slake"
    assert not torch.equal(full.prefill_scores(inp).preference, cake.preference)
    with pytest.raises(ValueError, match="budget_hint"):
        Slake(window=8).prefill_scores(inp)
    inp.budget = torch.tensor([24, 24])  # the engine's per-sequence budget C stands in for budget_hint
    torch.testing.assert_close(Slake(window=8).prefill_scores(inp).preference, full.prefill_scores(inp).preference)
    inp.budget = torch.tensor([24, 50])  # per-sample C: the second sample has nothing provisionally evicted
    per_sample = Slake(window=8).prefill_scores(inp).preference
    assert per_sample[1] == torch.tensor(1e-12) and per_sample[0] == full.prefill_scores(inp).preference[0]
    for bad in (dict(alpha=-1.0), dict(gamma_v=0.0), dict(budget_hint=-3)):
        with pytest.raises(ValueError):
            Slake(**bad)
    assert slake_alpha_beta("meta-llama/Llama-2-7b-chat-hf", 128) == (0.5, 0.4)
    assert slake_alpha_beta("meta-llama/Llama-3.1-8B-Instruct", 256) == (0.6, 0.5)
    assert slake_alpha_beta("meta-llama/Llama-3.1-8B-Instruct", 100) == (0.4, 0.2)
    assert slake_alpha_beta("mistralai/Mistral-7B-Instruct-v0.3", 1024) == (0.4, 0.2)
    assert slake_alpha_beta("mistralai/Mistral-7B-Instruct-v0.3", 128) == (0.6, 0.5)
    assert slake_alpha_beta("Qwen/Qwen2.5-7B-Instruct", 128) == (0.5, 0.4)


def test_slake_without_ptaa_and_vabs_decodes_as_cake():
    """The paper's ablation row without PTAA and VABS is CAKE (Table 2): the same kept slots and the same outputs at
    every decode step. Before, ``slake[linear_cache=false,vabs=false]`` kept Algorithm 1's order without a linear
    state, dropping each step's victim from that step's output (0.16 off CAKE's output)."""
    from slake.cache.compressed import CompressedKV

    g = torch.Generator().manual_seed(3)
    B, Hq, H, S, D = 2, 4, 2, 48, 8
    q, k, v = (torch.randn(B, h, S, D, generator=g) for h in (Hq, H, H))
    steps = [(torch.randn(B, Hq, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g),
              torch.randn(B, H, 1, D, generator=g)) for _ in range(5)]  # fmt: skip
    runs = []
    for spec in ("cake", "slake[linear_cache=false,vabs=false]"):
        eng = CompressedKV(make_method(spec, window=4, tau1=0.5, tau2=0.4), 12, 1, kernels="torch")
        eng.prefill_layer(0, q, k, v, None, D**-0.5)
        outs = []
        for qn, kn, vn in steps:
            eng.append(0, kn, vn)
            outs.append(eng.decode_attention(0, qn, D**-0.5))
        runs.append((outs, eng.layers[0]))
    (cake_outs, cake_store), (slake_outs, slake_store) = runs
    for a, b in zip(cake_outs, slake_outs, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert torch.equal(cake_store.valid, slake_store.valid) and torch.equal(cake_store.positions, slake_store.positions)


def test_cake_preferences_do_not_underflow_at_small_tau2():
    """With one window row every layer's variance is 0 (clamped at 1e-12), so ``P = H * 1e-12^(1/tau2)``: the layers
    split the budget by their entropies whatever ``tau2``. In float32 ``1e-12 ** 4`` (``tau2 = 0.25``, in ``slake
    calibrate``'s grid) underflowed to 0 for every layer and the split fell back to uniform."""
    from slake.cache.compressed import CompressedKV

    g = torch.Generator().manual_seed(0)
    B, Hq, H, S, D, L = 1, 4, 2, 64, 8, 2
    layers = [(torch.randn(B, Hq, S, D, generator=g) * s, torch.randn(B, H, S, D, generator=g),
               torch.randn(B, H, S, D, generator=g)) for s in (4.0, 0.1)]  # fmt: skip  # sharp, then flat
    budgets = []
    for tau2 in (1.0, 0.25):
        eng = CompressedKV(make_method("cake", window=1, tau1=1.0, tau2=tau2), 16, L, kernels="torch")
        for i, (q, k, v) in enumerate(layers):
            eng.prefill_layer(i, q, k, v, None, D**-0.5)
        budgets.append(eng.state.prefill_info().layer_budgets.tolist())
    assert budgets[0] == budgets[1]
    assert budgets[0][0][0] != budgets[0][0][1]  # the entropies differ: not the uniform split
