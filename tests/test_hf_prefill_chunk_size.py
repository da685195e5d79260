"""transformers' own chunked prefill (``generate(prefill_chunk_size=N)``, or a checkpoint's generation_config) over a
SlakeCache (2026-11-30 audit): transformers fed the prompt in pieces, which the cache took for a short first prompt
and later turns. A first piece within the budget left the whole prompt uncompressed (every token kept, reported
``compressed=False``); a larger one was compressed alone and the rest evicted by the decode rule, and SAGE-KV, which
refuses chunked prefill, was chunked. ``slake.generate`` kept a checkpoint's ``prefill_chunk_size``
(tests/test_hf_generate_fixes.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import GenerationConfig

from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from tiny_models import random_ids, tiny_model

S = 64


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama-gqa", layers=2)


def _cache(model, method: str = "snapkv") -> SlakeCache:
    return SlakeCache(method, 24, config=model.config, **({"window": 8} if method == "snapkv" else {}))


def _generate(model, cache, ids, **kw):
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), **with_cache(model, cache), do_sample=False, pad_token_id=0,
        max_new_tokens=3, min_new_tokens=3, **kw,
    )  # fmt: skip
    return out[:, ids.shape[1] :].tolist()


@pytest.mark.parametrize("chunk", [16, 32, S - 1])
@pytest.mark.parametrize("method", ["snapkv", "sagekv"])
def test_a_chunked_first_prompt_is_refused_before_any_layer_runs(model, method, chunk):
    cache = _cache(model, method)
    with torch.no_grad(), pytest.raises(ValueError, match=f"prefill_chunk_size={chunk}.*{S}-token prompt"):
        _generate(model, cache, random_ids(S, seed=1), prefill_chunk_size=chunk)
    assert cache.get_seq_length() == 0


def test_a_checkpoints_prefill_chunk_size_is_refused_too(model):
    saved = model.generation_config
    model.generation_config = GenerationConfig.from_dict({"eos_token_id": 1, "pad_token_id": 2,
                                                          "prefill_chunk_size": 16})  # fmt: skip
    try:
        with torch.no_grad(), pytest.raises(ValueError, match="prefill_chunk_size=16"):
            _generate(model, _cache(model), random_ids(S, seed=1))
    finally:
        model.generation_config = saved


def test_what_chunking_does_not_change_is_allowed(model):
    """A prompt within one chunk gives the output of no chunking; a plain transformers cache is not checked."""
    ids = random_ids(S, seed=1)
    plain = _generate(model, _cache(model), ids)
    assert _generate(model, _cache(model), ids, prefill_chunk_size=S) == plain
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, max_new_tokens=2,
                       prefill_chunk_size=16)  # fmt: skip


@pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.24"),
    reason="transformers before 5.24 chunks a later turn from token 0 again (a SlakeCache refuses the repeat)",
)
def test_a_later_turn_in_chunks_is_allowed(model):
    """A later turn's tokens are appended one decode step after another, chunked or not."""
    ids = random_ids(S, seed=1)
    turns = []
    for chunk in (None, 4):
        cache = _cache(model)
        first = _generate(model, cache, ids)
        grown = torch.cat([ids, torch.tensor(first), random_ids(12, seed=2)], 1)
        turns.append(_generate(model, cache, grown, prefill_chunk_size=chunk))
    assert turns[0] == turns[1]


def test_copies_check_their_prefill_and_a_prepared_model_still_pickles(model, tmp_path):
    """The check sits on the class: a deep or shallow copy checks too, and a prepared model is saved and loaded
    whole (a method bound in the instance's dict, as first written, did not pickle)."""
    assert "_prefill" not in vars(model)
    for twin in (copy.deepcopy(model), copy.copy(model)):
        with torch.no_grad(), pytest.raises(ValueError, match="prefill_chunk_size=16"):
            _generate(twin, _cache(twin), random_ids(S, seed=1), prefill_chunk_size=16)
    torch.save(model, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    ids = random_ids(S, seed=1)
    assert _generate(loaded, _cache(loaded), ids) == _generate(model, _cache(model), ids)
