"""The Python API at its edges (2026-11-30 audit): a model folder saved without its tokenizer failed in
transformers' message about sentencepiece, naming neither the model nor what was missing; an empty batch selection or
a repeat count of 0 was accepted and broke ``statistics()`` later; a numpy float32 ratio rounded on its widened binary
value (0.07 of 100 tokens kept 8) and a ``Decimal`` budget was refused although the docs accept any real scalar."""

from __future__ import annotations

import decimal
import fractions

import pytest
import torch

import slake
from slake.budgets.budget import Budget
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from slake.engines.transformers.models import load_tokenizer
from tiny_models import random_ids, save_tiny_model, tiny_model


def test_a_model_folder_without_a_tokenizer_says_so(tmp_path):
    model = save_tiny_model(str(tmp_path / "full"))
    weights_only = tmp_path / "weights"
    model.save_pretrained(weights_only)
    for load in (lambda p: slake.load_model(p, device="cpu"), load_tokenizer):
        with pytest.raises(OSError, match=r"the folder .*weights has none of tokenizer\.json"):
            load(str(weights_only))
    assert load_tokenizer(str(tmp_path / "full")) is not None


@pytest.fixture(scope="module")
def filled():
    model = tiny_model("llama-gqa", layers=2)

    def make():
        cache = SlakeCache("snapkv", 16, config=model.config, window=4)
        ids = random_ids(40)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids), **with_cache(model, cache), use_cache=True)
        return cache

    return make


@pytest.mark.parametrize(
    "op, message",
    [
        (lambda c: c.batch_repeat_interleave(0), "integer count >= 1"),
        (lambda c: c.batch_repeat_interleave(1.5), "integer count >= 1"),
        (lambda c: c.batch_select_indices(torch.tensor([], dtype=torch.long)), "non-empty 1-D integer index"),
        (lambda c: c.batch_select_indices(torch.tensor([[0]])), "non-empty 1-D integer index"),
        (lambda c: c.reorder_cache(torch.tensor([0.0])), "non-empty 1-D integer index"),
    ],
)
def test_a_batch_operation_that_would_empty_or_garble_the_cache_is_refused(filled, op, message):
    cache = filled()
    before = cache.statistics()["kv_bytes"]
    with pytest.raises(ValueError, match=message):
        op(cache)
    assert cache.statistics()["kv_bytes"] == before


def test_a_batch_operation_still_takes_a_list_and_numpy_counts(filled):
    np = pytest.importorskip("numpy")
    cache = filled()
    cache.batch_repeat_interleave(np.int64(2))
    cache.batch_select_indices([1])
    assert cache.statistics()["kv_bytes"] == filled().statistics()["kv_bytes"]


def test_a_ratio_is_read_as_written_whatever_its_type():
    np = pytest.importorskip("numpy")
    for ratio in (
        0.07,
        np.float32(0.07),
        np.float64(0.07),
        decimal.Decimal("0.07"),
        fractions.Fraction(7, 100),
        "0.07",
    ):
        assert Budget(ratio).tokens(100) == 7, ratio
    assert Budget(decimal.Decimal("128")).value == 128
    for bad in (decimal.Decimal("NaN"), np.float32("nan"), decimal.Decimal("1.0")):
        with pytest.raises(ValueError):
            Budget(bad)


def test_a_loader_error_is_one_line(tmp_path, monkeypatch):
    import transformers

    def fail(*args, **kwargs):
        raise OSError("We couldn't connect to the hub.\nCheck your connection\n  or the name.")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fail)
    with pytest.raises(OSError) as err:
        load_tokenizer("nosuchorg/nosuchmodel")
    assert "\n" not in str(err.value) and "hub. Check your connection or the name." in str(err.value)
