"""A chunked prefill ended before the prompt given to ``begin_chunked_prefill`` was fed is refused: its budget and
compress decision were the whole prompt's, so the layers were held below their budget without a word. A chunk that
fails still reaches the caller with its own error, not with this refusal."""

from __future__ import annotations

import pytest
import torch

from slake.cache.compressed import CompressedKV
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.generate import prefill
from tiny_models import random_ids, tiny_model

B, HQ, HKV, D = 2, 4, 2, 8


def _qkv(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, HQ, n, D, generator=g), torch.randn(B, HKV, n, D, generator=g),
            torch.randn(B, HKV, n, D, generator=g))  # fmt: skip


def test_a_chunked_prefill_ended_early_is_refused() -> None:
    q, k, v = _qkv(100)
    eng = CompressedKV("snapkv[window=4]", 64, 1, kernels="torch")
    eng.begin_chunked_prefill(torch.zeros(B, 100, dtype=torch.bool))
    eng.prefill_layer(0, q[:, :, :50], k[:, :, :50], v[:, :, :50], None, D**-0.5)
    with pytest.raises(RuntimeError, match="ended after 50 of the 100 prompt tokens"):
        eng.end_chunked_prefill()
    assert not eng.chunked_prefill  # the mode is left all the same


def test_a_chunked_prefill_fed_whole_ends_quietly() -> None:
    q, k, v = _qkv(100)
    eng = CompressedKV("snapkv[window=4]", 64, 1, kernels="torch")
    eng.begin_chunked_prefill(torch.zeros(B, 100, dtype=torch.bool))
    eng.prefill_layer(0, q[:, :, :50], k[:, :, :50], v[:, :, :50], None, D**-0.5)
    eng.append(0, k[:, :, 50:], v[:, :, 50:])
    eng.decode_attention(0, q[:, :, 50:], D**-0.5)
    eng.end_chunked_prefill()
    assert eng.seen[0] == 100


def test_a_failing_chunk_raises_its_own_error() -> None:
    model = tiny_model("llama-gqa", layers=2)
    cache = SlakeCache("snapkv", 24, config=model.config, window=8)
    calls = []

    def fail_second_chunk(module, args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # e.g. Ctrl-C during the second chunk

    handle = model.model.layers[0].register_forward_pre_hook(fail_second_chunk)
    try:
        with pytest.raises(KeyboardInterrupt):
            prefill(model, cache, random_ids(64), prefill_chunk=16)
    finally:
        handle.remove()
    assert not cache.compressor.chunked_prefill


@pytest.mark.parametrize(("method", "first", "told"), [("slake", 48, True), ("slake", 100, False), ("cake", 16, True),
                                                      ("cake", 48, False)])  # fmt: skip
def test_a_first_chunk_that_shows_no_layer_preference_is_told(method, first, told, caplog, monkeypatch) -> None:
    # a layer-preference method's budgets are split by the first chunk alone: a chunk within SLAKE's budget (or
    # CAKE's window) shows no preference in any layer, and the whole generation ran with a uniform split, silently
    import slake.cache.chunked as chunked

    monkeypatch.setattr(chunked, "_told_uniform", set())
    layers = 3
    q, k, v = _qkv(160)
    eng = CompressedKV(method, 64, layers, kernels="torch")
    eng.begin_chunked_prefill(torch.zeros(B, 160, dtype=torch.bool))
    with caplog.at_level("WARNING", logger="slake"):
        for layer in range(layers):
            scale = layer + 1  # layers that differ, so that a chunk past the budget splits it unevenly
            eng.prefill_layer(layer, q[:, :, :first], scale * k[:, :, :first], scale * v[:, :, :first], None, 0.35)
    uniform = bool((eng.info.layer_budgets == eng.info.layer_budgets[:, :1]).all())
    assert uniform == told
    assert ("every layer gets the same budget" in caplog.text) == told


def test_a_prompt_within_the_budget_is_not_told_of_the_split(caplog, monkeypatch) -> None:
    # nothing of such a prompt is evicted, whatever the split (no preference is computed): no warning about it
    import slake.cache.chunked as chunked

    monkeypatch.setattr(chunked, "_told_uniform", set())
    q, k, v = _qkv(60)
    eng = CompressedKV("slake", 64, 2, kernels="torch")
    eng.begin_chunked_prefill(torch.zeros(B, 60, dtype=torch.bool))
    with caplog.at_level("WARNING", logger="slake"):
        for layer in range(2):
            eng.prefill_layer(layer, q[:, :, :40], k[:, :, :40], v[:, :, :40], None, 0.35)
    assert "every layer gets the same budget" not in caplog.text
