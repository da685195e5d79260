"""A static append-only layer's free slots tracked on the device (:class:`slake.cache.free_runs.FreeRuns`): each step
takes the first free slot, as the search over the row did, without searching."""

from __future__ import annotations

import pytest
import torch

from compiled_decode import BUDGET, PROMPT
from compiled_decode import prompt as _prompt
from slake.cache.free_runs import FreeRuns
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from slake.engines.transformers.generate import prefill
from tiny_models import tiny_model


def _fill_in_order(valid: torch.Tensor, runs: FreeRuns) -> None:
    """Take every free slot (and two more) and check each against the first free slot of the mask, marking it."""
    W = valid.shape[-1]
    valid = valid.clone()
    for _ in range(int((~valid).sum(-1).max()) + 2):
        free = ~valid
        first = free.to(torch.uint8).argmax(-1, keepdim=True)
        expected = torch.where(free.any(-1, keepdim=True), first, torch.full_like(first, W))
        slots = runs.take()
        assert torch.equal(slots, expected)
        for b, h in (expected < W).squeeze(-1).nonzero().tolist():
            valid[b, h, expected[b, h, 0]] = True


@pytest.mark.parametrize("seed", range(20))
def test_runs_take_the_first_free_slot_at_every_step(seed):
    """Rows padded in front of their prompt or not, rooms of any size (none included), per head."""
    g = torch.Generator().manual_seed(seed)
    B, H, W = 3, 2, 24
    valid = torch.zeros(B, H, W, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            pad = int(torch.randint(0, 6, (), generator=g))
            end = int(torch.randint(pad, W + 1, (), generator=g))
            valid[b, h, pad:end] = True
    runs = FreeRuns.of(valid)
    assert runs is not None
    _fill_in_order(valid, runs)


def test_free_slots_in_three_runs_are_searched():
    """A row whose free slots are not a run and a run to its end (a slot freed inside the prompt) has no runs."""
    valid = torch.ones(1, 1, 10, dtype=torch.bool)
    valid[0, 0, 2] = False
    assert FreeRuns.of(valid) is not None  # one run and the (empty) room: [2, 3)
    valid[0, 0, 5] = False
    assert FreeRuns.of(valid) is None
    valid[0, 0, 8:] = False
    assert FreeRuns.of(valid) is None


@pytest.mark.parametrize("method", ["full", "snapkv[decode_eviction=false]"])
def test_a_static_append_only_step_searches_no_slot(method, monkeypatch):
    """The static full cache's step (and an append-only layer's) takes its slot from the tracked runs: no search over
    the row (an argmax over 128K slots per layer took 0.95 ms of a compiled step's 13.4 ms of kernels on an H200),
    for a left-padded batch, whose padding's slots are taken first; its tokens equal the dynamic cache's."""
    model = tiny_model("llama-gqa", layers=2)
    ids, mask = _prompt(2)
    steps = 14  # past the second row's 9 padding slots

    def run(static: bool) -> torch.Tensor:
        hyper = {} if method == "full" else {"window": 4}
        room = PROMPT + steps if static else None
        cache = SlakeCache(method, BUDGET, config=model.config, max_cache_len=room, **hyper)
        with torch.inference_mode():
            tok = prefill(model, cache, ids, mask).argmax(-1, keepdim=True)
            if static:
                assert all(r is not None for r in cache.compressor.decoder._runs)
                monkeypatch.setattr(torch.Tensor, "argmax", _refused)
            out = []
            for t in range(steps - 1):
                pos = PROMPT + t - (mask == 0).sum(-1, keepdim=True)
                logits = model(input_ids=tok, position_ids=pos, **with_cache(model, cache), use_cache=True).logits
                monkeypatch.undo()
                tok = logits[:, -1].argmax(-1, keepdim=True)
                out.append(tok)
                if static:
                    monkeypatch.setattr(torch.Tensor, "argmax", _refused)
            monkeypatch.undo()
        return torch.cat(out, 1)

    assert torch.equal(run(True), run(False))


def _refused(*args, **kwargs):
    raise AssertionError("a static append-only step searched the row for its free slot")


def test_reordered_rows_take_their_own_free_slots():
    """Beam search reorders a static cache's rows between steps: the tracked slots follow the rows (recomputed)."""
    model = tiny_model("llama-gqa", layers=2)
    ids, mask = _prompt(2)
    cache = SlakeCache("full", BUDGET, config=model.config, max_cache_len=PROMPT + 6)
    with torch.inference_mode():
        prefill(model, cache, ids, mask)
    decoder = cache.compressor.decoder
    before = [r.slot.clone() for r in decoder._runs]
    cache.compressor.select_batch(torch.tensor([1, 0]))
    assert [torch.equal(r.slot, b.flip(0)) for r, b in zip(decoder._runs, before, strict=True)] == [True, True]
