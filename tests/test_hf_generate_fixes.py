"""A SlakeCache driven by transformers' own ``model.generate`` and forwards, as a user drives it (2026-11-29 audit):

* ``prefill`` ran under ``torch.inference_mode()``, so a plain ``model.generate`` (``torch.no_grad()``) after it died
  with torch's "Inplace update to inference tensor outside InferenceMode"; a cache filled inside inference mode and
  continued outside it now says so;
* a continuation of another batch size than the cache holds (the best beam of a beam search) died in an index or
  reshape error deep in slake;
* ``slake.generate`` failed on a checkpoint whose generation_config sets ``cache_implementation`` or
  ``use_cache=False``; ``use_cache=False`` with a SlakeCache blamed "an earlier prompt";
* ``Cache.crop`` (assisted decoding) died in an AttributeError;
* a cache built with ``prefill_chunk`` and handed the whole prompt by ``model.generate`` prefilled it in one piece,
  its memory bound silently not applied."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GenerationConfig

import slake
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from slake.engines.transformers.generate import prefill
from slake.engines.transformers.reconstruction import ReconstructionPrompt
from tiny_models import random_ids, tiny_model, word_tokenizer

S = 64


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama-gqa", layers=2)


def _generate(model, cache, ids, **kw):
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), **with_cache(model, cache), do_sample=False, pad_token_id=0, **kw
    )
    return out[:, ids.shape[1] :].tolist()


@pytest.mark.parametrize(
    "method, kw", [("snapkv", {"window": 8}), ("snapkv", {"window": 8, "prefill_chunk": 16}), ("kvzip", {"window": 8})]
)
def test_prefill_then_a_plain_model_generate(model, method, kw):
    """The documented way to take a prompt in chunks or through KVzip's pass, then ``model.generate``, gives what the
    same calls inside ``torch.inference_mode()`` give."""
    ids = random_ids(S, seed=1)
    outs = []
    for inference in (False, True):
        cache = SlakeCache(method, 24, config=model.config, **kw)
        if method == "kvzip":
            cache.reconstruction = ReconstructionPrompt(
                repeat_ids=[5, 6, 7], continue_ids=[8, 9], suffix_ids=[10], prefix_ids=[]
            )
        mode = torch.inference_mode() if inference else torch.no_grad()
        with mode:
            prefill(model, cache, ids[:, :-1], trailing_tokens=1)
            outs.append(_generate(model, cache, ids, max_new_tokens=6))
    assert outs[0] == outs[1]


@pytest.mark.parametrize("method", ["snapkv", "kvzip"])
def test_model_generate_continues_from_a_whole_prompt_prefill(model, method):
    """``prefill`` of the whole prompt, then ``model.generate`` of that prompt: transformers sliced
    ``input_ids[:, -0:]`` and read the whole prompt again over the filled cache. The first token now comes from the
    prefill's exact logits, and the tokens equal ``model.generate``'s own prefill (snapkv); KVzip, whose pass only
    ``prefill`` runs, takes the same first token as the full cache."""
    ids = random_ids(S, seed=1)
    want = _generate(model, SlakeCache("snapkv", 24, config=model.config, window=8), ids, max_new_tokens=6)
    with torch.no_grad():
        first = int(model(ids).logits[0, -1].argmax())  # the full cache's first token
    cache = SlakeCache(method, 24, config=model.config, window=8)
    cache.reconstruction = ReconstructionPrompt(
        repeat_ids=[5, 6, 7], continue_ids=[8, 9], suffix_ids=[10], prefix_ids=[]
    )
    with torch.no_grad():
        prefill(model, cache, ids)
        got = _generate(model, cache, ids, max_new_tokens=6)
    assert got[0][0] == first
    if method == "snapkv":
        assert got == want
    assert cache.prefilled_logits is None  # used once


def test_a_forward_after_the_prefill_drops_its_logits(model):
    """The prefill's logits predict the token after the prompt: after a forward of that token by hand, a
    ``model.generate`` of exactly what the cache then holds must not answer from them (a stale first token); it is
    refused as a prompt that does not continue the cache, and one more token continues it."""
    ids = random_ids(S, seed=1)
    cache = SlakeCache("snapkv", 24, config=model.config, window=8)
    with torch.no_grad():
        first = prefill(model, cache, ids).argmax(-1, keepdim=True)
        second = model(first, **with_cache(model, cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        with pytest.raises(ValueError, match="does not continue it"):
            _generate(model, cache, torch.cat([ids, first], 1), max_new_tokens=1)
        assert len(_generate(model, cache, torch.cat([ids, first, second], 1), max_new_tokens=2)[0]) == 2


def test_prefill_logits_go_only_to_a_generate_of_the_same_rows(model):
    """The prefill's logits were handed to any generate of the same shape: another prompt of the prompt's length,
    and the prompt's rows after ``batch_select_indices`` reordered the cache, got the old rows' first tokens. Both are
    refused as a new prompt now, as before the hand-over existed."""
    a, b = random_ids(40, seed=1), random_ids(40, seed=2)
    with torch.no_grad():
        cache = SlakeCache("snapkv", 24, config=model.config, window=8)
        prefill(model, cache, a)
        with pytest.raises(ValueError, match="does not continue it"):
            _generate(model, cache, b, max_new_tokens=2)
        cache = SlakeCache("snapkv", 24, config=model.config, window=8)
        ids = torch.cat([a, b])
        prefill(model, cache, ids)
        cache.batch_select_indices(torch.tensor([1, 0]))
        assert cache.prefilled_logits is None
        with pytest.raises(ValueError, match="does not continue it"):
            _generate(model, cache, ids[[1, 0]], max_new_tokens=2)


def test_editing_the_returned_logits_leaves_generate_alone(model):
    ids = random_ids(40, seed=1)
    cache = SlakeCache("snapkv", 24, config=model.config, window=8)
    with torch.no_grad():
        logits = prefill(model, cache, ids)
        first = int(logits.argmax())
        logits[:, (first + 1) % logits.shape[-1]] = 1e9  # the caller's tensor, not the cache's
        assert _generate(model, cache, ids, max_new_tokens=1) == [[first]]


def test_hidden_states_of_a_prefill_run_before_generate_are_refused(model):
    ids = random_ids(40, seed=1)
    cache = SlakeCache("snapkv", 24, config=model.config, window=8)
    with torch.no_grad():
        prefill(model, cache, ids)
        with pytest.raises(ValueError, match=r"output_hidden_states=True\) after slake's prefill"):
            _generate(model, cache, ids, max_new_tokens=2, return_dict_in_generate=True, output_hidden_states=True)


def test_a_prefilled_prompt_expanded_by_generate_is_refused(model):
    ids = random_ids(S, seed=1)
    cache = SlakeCache("snapkv", 24, config=model.config, window=8)
    with torch.no_grad():
        prefill(model, cache, ids)
        with pytest.raises(ValueError, match=r"prefilled prompt of 1 row\(s\).*num_return_sequences"):
            _generate(model, cache, ids, max_new_tokens=2, num_beams=2, num_return_sequences=2)


def test_a_cache_filled_in_inference_mode_is_refused_outside_it(model):
    ids = random_ids(S, seed=1)
    cache = SlakeCache("snapkv", 24, config=model.config, window=8)
    with torch.inference_mode():
        model(ids, **with_cache(model, cache), use_cache=True)
    with torch.no_grad(), pytest.raises(ValueError, match=r"filled under torch.inference_mode\(\)"):
        model(random_ids(1, seed=2), **with_cache(model, cache), use_cache=True)
    with torch.inference_mode():  # inside it, the cache continues
        model(random_ids(1, seed=2), **with_cache(model, cache), use_cache=True)


def _cache(model, method: str) -> SlakeCache:
    return SlakeCache(method, 24, config=model.config, **({} if method == "full" else {"window": 8}))


@pytest.mark.parametrize("method", ["snapkv", "full"])
def test_a_continuation_of_another_batch_size_is_refused(model, method):
    """The best of 3 beams continued alone: refused, naming both sizes; selected first, it continues."""
    ids = random_ids(S, seed=1)
    cache = _cache(model, method)
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), **with_cache(model, cache), max_new_tokens=4, num_beams=3,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
        more = torch.cat([out[:1], random_ids(3, seed=4)], 1)
        with pytest.raises(ValueError, match=r"holds 3 sequence\(s\) but the input has 1"):
            _generate(model, cache, more, max_new_tokens=2)
    with torch.no_grad():
        assert len(_generate(model, _cache(model, method), ids.repeat(2, 1), max_new_tokens=2))
    one = _cache(model, method)
    with torch.no_grad():
        _generate(model, one, ids.repeat(2, 1), max_new_tokens=2)
        one.batch_select_indices(torch.tensor([0]))
        grown = torch.cat([ids, torch.tensor([_generate(model, _cache(model, method), ids,
                                                         max_new_tokens=2)[0]])], 1)  # fmt: skip
        assert len(_generate(model, one, grown, max_new_tokens=2)[0]) == 2


@pytest.mark.parametrize(
    "config",
    [{"cache_implementation": "static"}, {"use_cache": False}, {"prefill_chunk_size": 16}],
    ids=lambda c: str(c),
)
def test_slake_generate_over_a_checkpoints_own_cache_choice(model, config):
    """A generation_config that asks for its own cache, for none, or for transformers' chunked prefill (which fed the
    prompt in pieces, taken for turns: nothing compressed, 2026-11-30) does not stop ``slake.generate``: its cache is
    the SlakeCache, compressed."""
    saved = model.generation_config
    model.generation_config = GenerationConfig.from_dict({"eos_token_id": 1, "pad_token_id": 2, **config})
    try:
        prompt = " ".join(f"w{i}" for i in random_ids(S, seed=1)[0].tolist())
        res = slake.generate(model, word_tokenizer(), prompt, method="snapkv", budget=24, window=8, max_new_tokens=3,
                             chat_template=False)  # fmt: skip
    finally:
        model.generation_config = saved
    assert res.compressed and max(res.kept_tokens_per_layer) <= 24 and len(res.texts) == 1


def test_use_cache_false_with_a_slake_cache_says_so(model):
    ids = random_ids(S, seed=1)
    cache = SlakeCache("snapkv", 24, config=model.config, window=8)
    with torch.no_grad(), pytest.raises(ValueError, match="use_cache=False with a SlakeCache"):
        _generate(model, cache, ids, max_new_tokens=2, use_cache=False)


def test_crop_is_refused_with_a_clear_error(model):
    ids = random_ids(S, seed=1)
    cache = SlakeCache("snapkv", 24, config=model.config, window=8)
    with torch.no_grad():
        _generate(model, cache, ids, max_new_tokens=2)
    cache.crop(0)  # removes nothing: allowed
    cache.layers[0].crop(0)
    held = cache.get_seq_length()
    for crop in (cache.crop, cache.layers[0].crop):
        with pytest.raises(ValueError, match="cannot be cropped"):
            crop(-2)
    assert cache.get_seq_length() == held


def test_prefill_chunk_not_applied_by_model_generate_is_refused(model):
    ids = random_ids(S, seed=1)
    cache = SlakeCache("snapkv", 24, config=model.config, window=8, prefill_chunk=16)
    with torch.no_grad(), pytest.raises(ValueError, match="built with prefill_chunk=16"):
        _generate(model, cache, ids, max_new_tokens=2)
    assert cache.compressor.layers[0] is None  # refused before any layer ran
    with torch.no_grad():  # what the refusal advises: prefill() in chunks, then generate of the same prompt continues
        prefill(model, cache, ids)
        assert len(_generate(model, cache, ids, max_new_tokens=2)[0]) == 2
    assert cache.statistics()["compressed"]
    exact = SlakeCache("snapkv", 24, config=model.config, window=8, prefill_chunk=16)
    with torch.no_grad():  # an exact prefill asked of prefill(): not refused
        prefill(model, exact, ids, prefill_chunk=S)
    tok = word_tokenizer()
    prompt = " ".join(f"w{i}" for i in random_ids(20, seed=1)[0].tolist())
    for chunk in (20, 64):  # slake.generate with a chunk the prompt fits: model.generate prefills it whole
        res = slake.generate(model, tok, prompt, method="snapkv", budget=8, window=4, prefill_chunk=chunk,
                             max_new_tokens=2, chat_template=False)  # fmt: skip
        assert len(res.texts) == 1


def test_a_decode_loops_1d_position_ids_are_checked_as_its_2d_ones(model):
    """A user's own decode loop may give one token's position as ``torch.tensor([pos])``, which transformers reads as
    the row ``[[pos]]``: a position taken from the kept entries (the store's ``keys.shape[-2]``) instead of the whole
    sequence put the token at a wrong rotary position, silently, where the 2D form was refused (2026-12 audit)."""
    ids = random_ids(S, seed=1)
    cache = SlakeCache("snapkv", 24, config=model.config, window=8)
    with torch.no_grad():
        token = model(ids, **with_cache(model, cache)).logits[:, -1].argmax(-1, keepdim=True)
        kept = cache.layers[0].keys.shape[-2]
        assert kept < S == cache.get_seq_length()
        for wrong in (torch.tensor([kept]), torch.tensor([[kept]])):
            with pytest.raises(ValueError, match="does not continue it"):
                model(token, position_ids=wrong, **with_cache(model, cache))
        assert cache.get_seq_length() == S  # refused before any layer ran
        logits = [model(token, position_ids=p, **with_cache(model, copy.deepcopy(cache))).logits
                  for p in (torch.tensor([[S]]), None)]  # fmt: skip
        try:  # the right 1-D position passes the check; later transformers read it as its row
            row = torch.tensor([S])
            logits.append(model(token, position_ids=row, **with_cache(model, copy.deepcopy(cache))).logits)
        except IndexError:  # transformers 5.17's rotary embedding indexes position_ids as 2-D (make test-oldest)
            pass
    assert all(torch.equal(logits[0], other) for other in logits[1:])


def test_keys_and_values_follow_the_rows_after_a_batch_is_reordered_selected_or_repeated(model):
    """``cache.layers[i].keys`` / ``values`` (transformers' cache interface) kept the tensors of before a beam
    search's reorder, a selection or a repeat of the rows: the wrong rows and row count, and the old storage held alive
    until the next forward (2026-12 audit)."""
    ids = random_ids(S, seed=1, batch=3)
    cache = SlakeCache("snapkv", 24, config=model.config, window=8)
    with torch.no_grad():
        model(ids, **with_cache(model, cache))
    for op, arg, rows in [("reorder_cache", torch.tensor([2, 0, 0]), 3), ("batch_select_indices", torch.tensor([1]), 1),
                          ("batch_repeat_interleave", 2, 2)]:  # fmt: skip
        getattr(cache, op)(arg)
        for layer in cache.layers:
            store = cache.compressor.layers[layer.slot]
            assert layer.keys is store.keys and layer.values is store.values, op
            assert layer.keys.shape[0] == layer.values.shape[0] == rows, op
    out = model.generate(ids[:1], attention_mask=torch.ones_like(ids[:1]), num_beams=3, max_new_tokens=4,
                         do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                         **with_cache(model, SlakeCache("snapkv", 24, config=model.config, window=8)))  # fmt: skip
    beams = out.get("cache", out.get("past_key_values"))
    assert all(layer.keys is beams.compressor.layers[layer.slot].keys for layer in beams.layers)
