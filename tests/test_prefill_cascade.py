"""The prefill cascade's storage (``PrefillCompressor.evict_to``, ``LayerStore.keep``) against a plain reference.

Intermediate cascade stages leave a layer's kept slots in score order and later stages drop a suffix of each row; the
final stage re-packs them in position order (``docs/methods/cake.md#cascading-prefill``). Whatever the layout in
between, the final cache must be one-shot eviction with the final budgets, computed here with a per-row loop: the
top-scored slots (ties to the earlier position) in position order, the linear state the float64 fold of every dropped
token, and at every stage the layer must hold exactly its stage's top-k (the memory bound of the cascade).
"""

from __future__ import annotations

import pytest
import torch

from slake.attention.linear_state import LinearState
from slake.cache.compressed import CompressedKV
from slake.cache.layer_store import LayerStore
from slake.cache.prefill import PrefillCompressor
from slake.methods import make_method
from slake.methods.base import PrefillInputs

L, B, HQ, HKV, S, D = 6, 3, 4, 2, 150, 16


def _data(seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for layer in range(L):
        q = torch.randn(B, HQ, S, D, generator=g) * (0.5 + layer)  # flat to peaked: uneven layer budgets
        k = torch.randn(B, HKV, S, D, generator=g) * 2
        v = torch.randn(B, HKV, S, D, generator=g)
        k[:, :, 20:30] = k[:, :, 20:21]  # tied scores
        out.append((q, k, v))
    return out


def _padding():
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, :40] = True  # compressed, shorter
    pad[2, : S - 30] = True  # 30 real tokens: within the budget, not compressed
    return pad


CASES = [
    ("cake", {}, None),
    ("slake", {}, None),
    ("slake", {"max_layer_budget": 50}, None),
    ("slake", {"vabs_split": "uniform"}, "int8"),
    ("slake", {"window": 1}, None),
    ("lava", {}, None),
]


@pytest.mark.parametrize("name,hyper,kv_dtype", CASES)
def test_cascade_equals_a_one_shot_reference(name, hyper, kv_dtype):
    method = make_method(name, **hyper)
    pad = _padding()
    data = _data(1)
    eng = CompressedKV(method, 36, L, kv_dtype=kv_dtype)
    stage_sets: list[dict] = []
    for layer, (q, k, v) in enumerate(data):
        eng.prefill_layer(layer, q, k, v, pad, D**-0.5)
        for store in eng.layers[: layer + 1]:  # dropped slots are released at every stage
            assert store.capacity == max(int(store.counts().max()), 1)
        stage_sets.append(
            {(i, b, h): _kept(eng.layers[i], b, h) for i in range(layer + 1) for b in range(B) for h in range(HKV)}
        )
    final = eng.info.layer_budgets
    for layer, (q, k, v) in enumerate(data):
        scores = _protected_scores(eng, method, q, k, v, pad, layer)
        store = eng.layers[layer]
        ref_aug = torch.zeros(B, HKV, D + 1, D + 1, dtype=torch.float64)
        for b in range(B):
            for h in range(HKV):
                keep = _reference_keep(scores[b, h], int(final[b, layer]), bool(eng.info.compress[b]))
                if name == "lava":  # its own split of the layer budget over heads: the top-k of this head's count
                    count = int(store.counts()[b, h])
                    keep = torch.sort(torch.sort(scores[b, h], descending=True, stable=True).indices[:count]).values
                got = store.positions[b, h][store.valid[b, h]]
                assert got.tolist() == keep.tolist(), (layer, b, h)  # the same slots, in position order
                assert bool((store.positions[b, h][~store.valid[b, h]] == -1).all())
                n = len(keep)
                assert bool(store.valid[b, h, :n].all()) and not bool(store.valid[b, h, n:].any())
                torch.testing.assert_close(store.scores[b, h, :n], scores[b, h, keep], rtol=0, atol=0)
                kq, vq = _dense(store)
                kk, vv = _stored(eng, k, v)
                assert torch.equal(kq[b, h, :n], kk[b, h, keep]) and torch.equal(vq[b, h, :n], vv[b, h, keep])
                dropped = torch.ones(S, dtype=torch.bool)
                dropped[keep] = False
                dropped &= ~pad[b]
                kp = torch.cat([kk[b, h, dropped].double(), torch.ones(int(dropped.sum()), 1).double()], -1)
                vp = torch.cat([vv[b, h, dropped].double(), torch.ones(int(dropped.sum()), 1).double()], -1)
                ref_aug[b, h] = kp.T @ vp
        if store.linear is not None:
            torch.testing.assert_close(store.linear.aug.double(), ref_aug, rtol=1e-5, atol=1e-4)
    # a later stage's kept set is a subset of an earlier one's (budgets only shrink), and some stage shrank a layer
    # that an earlier stage had already evicted (the re-eviction of a layer left in score order is exercised)
    last: dict = {}
    shrunk = 0
    for stage in stage_sets:
        for key, kept in stage.items():
            if key in last:
                assert kept <= last[key], key
                shrunk += len(kept) < len(last[key]) < S
            last[key] = kept
    assert shrunk > 0


def _kept(store: LayerStore, b: int, h: int) -> set[int]:
    return set(store.positions[b, h][store.valid[b, h]].tolist())


def _protected_scores(eng, method, q, k, v, pad, layer):
    res = method.prefill_scores(PrefillInputs(q, k, v, pad, D**-0.5, method.window, layer, L, eng.info.budget))
    pos = torch.arange(S).view(1, 1, S).expand(B, HKV, S)
    return eng.prefill.protect(res.scores.float(), pos, (~pad)[:, None, :].expand(B, HKV, S), newest=S - 1)


def _reference_keep(scores: torch.Tensor, selectable: int, compress: bool) -> torch.Tensor:
    """Positions kept by one-shot eviction: every protected slot, the ``selectable`` best candidates (stable:
    ties to the earlier position), in position order."""
    real = scores > float("-inf")
    if not compress:
        return torch.nonzero(real).view(-1)
    order = torch.sort(scores, descending=True, stable=True).indices
    n = int(torch.isposinf(scores).sum()) + min(selectable, int((real & torch.isfinite(scores)).sum()))
    return torch.sort(order[:n]).values


def _dense(store: LayerStore):
    return store.dense_keys(), store.dense_values()


def _stored(eng, k, v):
    """The prompt's keys/values as the store holds them (8-bit codes dequantised)."""
    st = LayerStore(k, v, torch.zeros(B, HKV, S, dtype=torch.long), torch.ones(B, HKV, S, dtype=torch.bool),
                    torch.zeros(B, HKV, S), kv_dtype=eng.kv_dtype)  # fmt: skip
    return st.dense_keys(), st.dense_values()


@pytest.mark.parametrize("positional", [True, False])
def test_keep_in_slot_order_equals_keep_after_a_sort(positional):
    """``keep(None, ...)`` on a store already in score order drops the same slots as ``keep(order, ...)`` with its
    sort order, folds the same rows, and leaves the same layout."""
    g = torch.Generator().manual_seed(4)
    n = 60
    scores = torch.randn(2, 3, n, generator=g).round(decimals=1)  # ties
    valid = torch.rand(2, 3, n, generator=g) < 0.9
    scores = scores.masked_fill(~valid, float("-inf"))
    keys, values = torch.randn(2, 3, n, 8, generator=g), torch.randn(2, 3, n, 8, generator=g)
    positions = torch.arange(n).expand(2, 3, n).masked_fill(~valid, -1)

    def store():
        return LayerStore(keys, values, positions.clone(), valid.clone(), scores.clone(), LinearState.empty(2, 3, 8))

    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    first = torch.randint(20, 40, (2, 3), generator=g)
    second = first - torch.randint(0, 10, (2, 3), generator=g)
    ranked = store()
    ranked.keep(order, first, positional=False)
    ranked.keep(None, second, positional=positional)
    once = store()
    once.keep(order, second, positional=positional)
    assert torch.equal(ranked.valid, once.valid) and torch.equal(ranked.positions, once.positions)
    assert torch.equal(ranked.scores, once.scores)
    assert torch.equal(ranked.keys[ranked.valid], once.keys[once.valid])
    torch.testing.assert_close(ranked.linear.aug, once.linear.aug, rtol=1e-5, atol=1e-5)
    if positional:
        pos = once.positions.masked_fill(~once.valid, 1 << 30)
        assert torch.equal(pos, pos.sort(-1).values)


@pytest.mark.parametrize("name", ["cake", "slake"])
def test_nan_scores_fall_back_to_the_general_re_eviction(name, monkeypatch):
    """A NaN score sorts first and is not a candidate of the head split, so the candidate count the batched
    re-eviction carries from stage to stage would be wrong for its layer: that layer is re-evicted through
    ``Method.head_budgets`` on its scores, as every layer is when the compressor does not apply the split itself."""
    data = _data(2)

    def run(own_split: bool):
        method = make_method(name)
        real = method.prefill_scores

        def scores(inputs):
            out = real(inputs)
            if inputs.layer_idx == 2:
                out.scores[0, 1, 5:9] = float("nan")
            return out

        monkeypatch.setattr(method, "prefill_scores", scores)
        monkeypatch.setattr(PrefillCompressor, "_uniform_head_split", lambda self: own_split)
        eng = CompressedKV(method, 36, L)
        for layer, (q, k, v) in enumerate(data):
            eng.prefill_layer(layer, q, k, v, None, D**-0.5)
        return eng

    eng, ref = run(True), run(False)
    assert torch.equal(eng.info.layer_budgets, ref.info.layer_budgets)
    for layer in range(L):
        for name_ in ("positions", "valid", "scores"):
            a, b = getattr(eng.layers[layer], name_), getattr(ref.layers[layer], name_)
            assert torch.equal(a.nan_to_num(), b.nan_to_num()) if a.is_floating_point() else torch.equal(a, b)
        assert torch.equal(eng.targets[layer], ref.targets[layer])
    assert {5, 6, 7, 8} <= _kept(eng.layers[2], 0, 1)  # NaN sorts first: kept, as before


def test_rows_are_picked_from_any_layout_without_copying_the_source():
    """The compaction picks rows with one index_select over a flat view: head-major (contiguous), token-major (the
    engines' ``(B, n, Hkv, d)`` buffers seen as ``(B, Hkv, n, d)``) and any other layout give ``gather``'s rows."""
    from slake.cache.layer_store import _rows

    g = torch.Generator().manual_seed(5)
    idx = torch.stack([torch.randperm(40, generator=g)[:25] for _ in range(6)]).view(2, 3, 25)
    layouts = [
        torch.randn(2, 3, 40, 8, generator=g),
        torch.randn(2, 40, 3, 8, generator=g).transpose(1, 2),
        torch.randn(3, 2, 40, 8, generator=g).transpose(0, 1),
        torch.randn(2, 3, 40, generator=g),
    ]
    for t in layouts:
        expect = t.gather(2, idx.view(2, 3, 25, *([1] * (t.ndim - 3))).expand(2, 3, 25, *t.shape[3:]))
        assert torch.equal(_rows(t, idx), expect)


@pytest.mark.parametrize("name,hyper,kv_dtype", CASES)
def test_deferred_cascade_equals_the_cascade(name, hyper, kv_dtype):
    """``defer_cascade=True`` (the vLLM plugin's prefill) evicts each layer at its own stage and at the final one only,
    and ends with the cascade's cache: the same slots, scores, keys, values, decode targets and layer budgets, and the
    linear state of the same dropped tokens (folded in fewer groups: equal up to float rounding)."""
    method = make_method(name, **hyper)
    pad = _padding()
    data = _data(3)
    eager = CompressedKV(method, 36, L, kv_dtype=kv_dtype)
    deferred = CompressedKV(method, 36, L, kv_dtype=kv_dtype, defer_cascade=True)
    for layer, (q, k, v) in enumerate(data):
        eager.prefill_layer(layer, q, k, v, pad, D**-0.5)
        before = [None if s is None else s.counts().clone() for s in deferred.layers[:layer]]
        deferred.prefill_layer(layer, q, k, v, pad, D**-0.5)
        if layer < L - 1:  # the stages in between leave the earlier layers alone
            for i, counts in enumerate(before):
                assert torch.equal(deferred.layers[i].counts(), counts), (layer, i)
    assert torch.equal(eager.info.layer_budgets, deferred.info.layer_budgets)
    for layer in range(L):
        a, b = eager.layers[layer], deferred.layers[layer]
        for attr in ("positions", "valid", "scores"):
            assert torch.equal(getattr(a, attr), getattr(b, attr)), (layer, attr)
        kept = a.valid  # what empty slots hold is never read
        assert torch.equal(a.dense_keys()[kept], b.dense_keys()[kept])
        assert torch.equal(a.dense_values()[kept], b.dense_values()[kept])
        assert torch.equal(eager.targets[layer], deferred.targets[layer])
        if a.linear is not None:
            torch.testing.assert_close(a.linear.aug, b.linear.aug, rtol=1e-5, atol=1e-4)


def test_deferred_cascade_leaves_other_layer_policies_alone():
    """Methods with static layer budgets evict every layer at its own prefill either way: the option changes nothing."""
    data = _data(5)
    for name in ("snapkv", "pyramidkv"):
        a = CompressedKV(make_method(name), 36, L)
        b = CompressedKV(make_method(name), 36, L, defer_cascade=True)
        for layer, (q, k, v) in enumerate(data):
            a.prefill_layer(layer, q, k, v, None, D**-0.5)
            b.prefill_layer(layer, q, k, v, None, D**-0.5)
            assert torch.equal(a.layers[layer].positions, b.layers[layer].positions)
