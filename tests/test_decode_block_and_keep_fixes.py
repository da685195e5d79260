"""Regressions of three audited bugs.

* A multi-token decode block (several tokens appended at once after the prefill, a later chat turn) attends causally
  and is evicted back to its targets only after its output, for every method: a method that evicts before the output
  at a single-token step (SLAKE's Algorithm 1) used to evict tokens chosen from all the block's queries first, so that
  earlier queries saw later tokens through the linear state and lost slots the later ones chose to drop
  (:meth:`slake.cache.decoding.Decoder.decode_attention`).
* A row whose keep count is 0 keeps nothing (its one slot is empty) and folds exactly its dropped tokens; it used to
  keep one slot and fold it too (:meth:`slake.cache.layer_store.LayerStore.keep`).
* ``Budget(1.0)`` / ``"1.0"`` is refused instead of silently meaning one token (:class:`slake.budgets.budget.Budget`).
"""

from __future__ import annotations

import pytest
import torch

from slake.attention.linear_state import LinearState
from slake.budgets.budget import Budget
from slake.cache.compressed import CompressedKV
from slake.cache.layer_store import LayerStore
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from slake.engines.transformers.generate import prefill
from slake.methods import make_method
from tiny_models import random_ids, tiny_model

# ====================================================================== multi-token decode blocks
BLOCK_METHODS = [
    "slake",
    "slake[linear_cache=false]",
    "cake",
    "cake[linear_cache=true]",
    "snapkv",
    "h2o",
    "tova",
]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama-gqa")


@pytest.mark.parametrize("method", BLOCK_METHODS)
def test_a_decode_block_s_earlier_logits_ignore_its_later_tokens(model, method):
    """Engine level: a 24-token continuation on a compressed cache; changing only its tokens 12.. leaves the logits
    of positions 0..11 exactly as they were (before the fix SLAKE's changed by 3e-2, without its linear cache by
    9e-2), and the block is still evicted back to the layer targets."""
    L = model.config.num_hidden_layers
    prompt = random_ids(96, seed=1)
    block = random_ids(24, seed=2)
    changed = block.clone()
    changed[0, 12:] = (changed[0, 12:] + 91) % 256
    logits = []
    for ids in (block, changed):
        cache = SlakeCache(method, 32, L, **({} if method == "tova" else {"window": 8}))  # TOVA's window is 1
        prefill(model, cache, prompt)
        with torch.inference_mode():
            out = model(
                ids,
                attention_mask=torch.ones(1, 96 + 24, dtype=torch.long),
                **with_cache(model, cache),
                use_cache=True,
            )
        logits.append(out.logits[0, :12])
        eng = cache.compressor
        for i, store in enumerate(eng.layers):  # the block was evicted (after its output) down to the targets
            target = eng.targets[i]
            assert target is not None and bool((target >= 0).all())
            assert torch.equal(store.counts(), target)
            if store.linear is not None:  # every token is kept or folded, once
                assert torch.equal(store.linear.count + store.counts(), torch.full_like(target, 96 + 24))
    assert torch.equal(logits[0], logits[1])


B, HQ, HKV, S, D, C, N = 1, 4, 2, 64, 8, 16, 12


def _block_engine(spec: str, perturb: bool = False):
    """A prefilled one-layer engine (budget ``C``) with an ``N``-token block appended; ``perturb`` changes the keys
    and values of the block's tokens 6.. (the queries are the same). Returns the engine and the block's queries."""
    g = torch.Generator().manual_seed(0)
    eng = CompressedKV(make_method(spec), C, 1, kernels="torch")
    q, k, v = (
        torch.randn(B, HQ, S, D, generator=g),
        torch.randn(B, HKV, S, D, generator=g),
        torch.randn(B, HKV, S, D, generator=g),
    )
    eng.prefill_layer(0, q, k, v, None, D**-0.5)
    kn, vn, qn = (
        torch.randn(B, HKV, N, D, generator=g),
        torch.randn(B, HKV, N, D, generator=g),
        torch.randn(B, HQ, N, D, generator=g),
    )
    if perturb:
        kn[:, :, 6:] = 3.0 * torch.randn(B, HKV, N - 6, D, generator=g)
        vn[:, :, 6:] += 100.0
    eng.append(0, kn, vn)
    return eng, qn


@pytest.mark.parametrize(
    "spec", ["slake[window=4]", "slake[window=4,linear_cache=false]", "cake[window=4]", "h2o[window=4]"]
)
def test_a_decode_block_s_output_is_the_cache_before_its_eviction(spec):
    """Compressor level: the block's output equals read-only causal attention over the layer as the block found it
    (kept slots, the block's own tokens up to each query, the linear state before the block); then the layer is
    evicted to its target and the evicted tokens folded, once. Changing the block's later keys and values changes
    none of its earlier outputs."""
    eng, qn = _block_engine(spec)
    ref_eng, _ = _block_engine(spec)
    qpos = torch.arange(S, S + N)
    reference = ref_eng.decoder.attention(0, qn, qpos, D**-0.5)  # no eviction
    store = eng.layers[0]
    folded_before = None if store.linear is None else store.linear.count.clone()
    kept_before = store.counts().clone()
    out = eng.decode_attention(0, qn, D**-0.5)
    torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-6)
    assert torch.equal(store.counts(), eng.targets[0])
    assert bool((store.counts() < kept_before).all())  # the block did evict
    if store.linear is not None:
        folded = store.linear.count - folded_before
        assert torch.equal(folded, (kept_before - store.counts()).float())
    changed, qn2 = _block_engine(spec, perturb=True)
    out2 = changed.decode_attention(0, qn2, D**-0.5)
    assert torch.equal(out[:, :, :6], out2[:, :, :6])
    assert not torch.equal(out[:, :, 6:], out2[:, :, 6:])


# ====================================================================== keep counts of 0
@pytest.mark.parametrize("linear", [False, True])
def test_a_layer_with_a_keep_of_zero_keeps_nothing_and_folds_every_token_once(linear, monkeypatch):
    """PyramidKV's reference schedule, window 0, C=4 over 3 layers: layer budgets 8, 4, 0. The last layer keeps
    nothing (it kept one slot per head, and with the linear cache also folded it: 65 tokens counted of 64), and stays
    consistent through single-token steps and a multi-token block. (PyramidKV's own schedule now raises such a layer
    to 1, ``min_layer``; the cache must still hold a keep of 0, which the unfloored schedule gives.)"""
    from slake.budgets import pyramid_budgets
    from slake.methods.pyramidkv import PyramidKV

    method = make_method(f"pyramidkv[window=0,linear_cache={str(linear).lower()}]")
    assert method.pyramid_schedule(3, 4, 64).tolist() == [7, 4, 1]  # a layer is never emptied by the schedule
    monkeypatch.setattr(
        PyramidKV, "pyramid_schedule", lambda self, n, c, s: pyramid_budgets(n, c, s, self.window, exact=True)
    )
    L, S_ = 3, 64
    g = torch.Generator().manual_seed(0)
    eng = CompressedKV(method, 4, L, kernels="torch")
    for li in range(L):
        qkv = (
            torch.randn(1, HQ, S_, D, generator=g),
            torch.randn(1, HKV, S_, D, generator=g),
            torch.randn(1, HKV, S_, D, generator=g),
        )
        eng.prefill_layer(li, *qkv, None, D**-0.5)
    assert eng.info.layer_budgets.tolist() == [[8, 4, 0]]

    def check(seen: int) -> None:
        for li, store in enumerate(eng.layers):
            assert torch.equal(store.counts(), eng.targets[li])
            if linear:
                assert store.linear.count.tolist() == (seen - eng.targets[li]).float().tolist()
            else:
                assert store.linear is None

    check(S_)
    assert eng.layers[2].counts().tolist() == [[0, 0]]
    for _ in range(3):
        for li in range(L):
            eng.append(li, torch.randn(1, HKV, 1, D, generator=g), torch.randn(1, HKV, 1, D, generator=g))
            assert torch.isfinite(eng.decode_attention(li, torch.randn(1, HQ, 1, D, generator=g), D**-0.5)).all()
    check(S_ + 3)
    for li in range(L):
        eng.append(li, torch.randn(1, HKV, 5, D, generator=g), torch.randn(1, HKV, 5, D, generator=g))
        assert torch.isfinite(eng.decode_attention(li, torch.randn(1, HQ, 5, D, generator=g), D**-0.5)).all()
    check(S_ + 8)


def test_layer_store_keep_zero_then_zero_again_folds_each_token_once():
    """``LayerStore.keep`` with every keep count 0 (a full row, one count for all rows, the fast path) leaves one
    empty slot and folds all ``n`` tokens; a second stage (the cascade's ``order=None`` suffix) folds nothing more."""
    n = 6
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, HKV, n, D, generator=g), torch.randn(1, HKV, n, D, generator=g)
    positions = torch.arange(n).expand(1, HKV, n).clone()
    store = LayerStore(
        keys, values, positions, torch.ones(1, HKV, n, dtype=torch.bool), torch.rand(1, HKV, n, generator=g),
        LinearState.empty(1, HKV, D),
    )  # fmt: skip
    zero = torch.zeros(1, HKV, dtype=torch.int64)
    order = torch.sort(store.scores, dim=-1, descending=True).indices
    store.keep(order, zero, positional=False)
    assert store.counts().tolist() == [[0, 0]] and store.capacity == 1
    assert store.linear.count.tolist() == [[float(n)] * HKV]
    full = LinearState.empty(1, HKV, D)
    full.fold(keys, values, None)
    torch.testing.assert_close(store.linear.aug, full.aug)
    store.keep(None, zero, positional=True)
    assert store.counts().tolist() == [[0, 0]]
    assert store.linear.count.tolist() == [[float(n)] * HKV]
    assert store.positions.tolist() == [[[-1], [-1]]]


# ====================================================================== the float budget 1.0
@pytest.mark.parametrize("value", [1.0, "1.0", " 1.0 ", "1e0"], ids=["float", "str", "padded", "exponent"])
def test_budget_one_point_zero_is_refused(value):
    with pytest.raises(ValueError, match=r"budget 1\.0 is ambiguous.*integer 1.*ratio below 1.*'full'"):
        Budget(value)


def test_budget_integers_ratios_and_whole_floats_keep_their_meaning():
    for one in (1, "1", Budget(1)):
        b = Budget(one)
        assert b.value == 1 and type(b.value) is int and not b.is_ratio and b.tokens(1000) == 1
    half = Budget(0.5)
    assert half.is_ratio and half.value == 0.5 and half.tokens(1000) == 500
    assert Budget("0.5").value == 0.5 and Budget("1024").value == 1024 and Budget(128.0).value == 128
