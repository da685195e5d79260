"""Third audit of the transformers engine's glue (``src/slake/engines/transformers/``): each test failed before the
fix it names."""

from __future__ import annotations

import pytest
import torch

import slake
from slake.engines.base import EvalOptions, EvalRequest
from slake.engines.transformers import evaluate as engine_eval
from tiny_models import random_ids, tiny_model, word_tokenizer


@pytest.fixture(scope="module")
def llama_gqa():
    return tiny_model("llama-gqa")


def _request(pairs: tuple, n: int = 48, key: int = 0) -> EvalRequest:
    ids = random_ids(n, seed=key)[0].tolist()
    return EvalRequest(key=key, prefill_ids=ids, question_ids=[], max_new_tokens=3, group="a", pairs=pairs)


def _count_exact_prefills(monkeypatch) -> list[int]:
    """Patch the evaluation's exact prefill to record each prompt's length; returns the list it appends to."""
    calls: list[int] = []
    real = engine_eval.capture_prefill

    def counting(model, ids, *args, **kwargs):
        calls.append(int(ids.shape[1]))
        return real(model, ids, *args, **kwargs)

    monkeypatch.setattr(engine_eval, "capture_prefill", counting)
    return calls


def test_a_chunked_evaluation_does_not_prefill_the_prompt_exactly_first(llama_gqa, monkeypatch, tmp_path):
    """``slake eval --prefill-chunk`` prefilled every prompt exactly and recorded every layer's queries, keys and
    values before its chunked prefill, even when no pair replayed that record: the memory the chunks bound was not
    bounded (more than a plain prefill's), ``--prefill-cache`` stored captures nothing read, and the rows' ``prefill_s``
    was the unused exact prefill's time."""
    calls = _count_exact_prefills(monkeypatch)
    options = EvalOptions(prefill_chunk=16, prefill_cache=str(tmp_path / "captures"))
    req = _request((("snapkv[window=4]", 20), ("h2o[window=4]", 20)))
    rows = list(engine_eval.evaluate(llama_gqa, [req], options, eos=[]))
    assert calls == []
    assert not list((tmp_path / "captures").glob("*.pt"))
    assert [r.prefill_chunk for r in rows] == [16, 16]
    assert all(r.compressed and r.extra["prefill_cached"] is False for r in rows)
    assert all(len(r.tokens) == 3 for r in rows)


def test_a_chunked_evaluation_with_the_full_pair_still_replays_it(llama_gqa, monkeypatch):
    """The full cache's row is an exact prefill replayed from the capture, also in a chunked run: it is made once,
    and the chunked rows equal a run without the full pair."""
    calls = _count_exact_prefills(monkeypatch)
    options = EvalOptions(prefill_chunk=16)
    pairs = (("full", None), ("snapkv[window=4]", 20))
    both = list(engine_eval.evaluate(llama_gqa, [_request(pairs)], options, eos=[]))
    assert calls == [48]
    alone = list(engine_eval.evaluate(llama_gqa, [_request((("snapkv[window=4]", 20),))], options, eos=[]))
    assert [r.prefill_chunk for r in both] == [None, 16]
    assert both[1].tokens == alone[0].tokens
    full = list(engine_eval.evaluate(llama_gqa, [_request((("full", None),))], EvalOptions(), eos=[]))
    assert both[0].tokens == full[0].tokens


def _words(n: int, seed: int) -> str:
    return " ".join(f"w{i}" for i in random_ids(n, seed=seed)[0].tolist())


@pytest.mark.parametrize(
    ("settings", "method", "do_sample"),
    [
        ({"return_dict_in_generate": True}, "snapkv[window=4]", False),
        ({"num_beams": 2}, "snapkv[window=4]", False),
        ({"num_beams": 2}, "kvzip", False),
        ({"output_hidden_states": True}, "kvzip", False),
        ({"do_sample": True, "num_return_sequences": 2}, "snapkv[window=4]", True),
    ],
)
def test_a_checkpoints_generation_config_does_not_change_what_generate_returns(
    llama_gqa, monkeypatch, settings, method, do_sample
):
    """``slake.generate`` took the search and the output from the model's ``generation_config``: a checkpoint
    with ``return_dict_in_generate=True`` failed in a TypeError ("tuple indices must be integers"), ``num_beams=2``
    silently ran beam search (KVzip: a ValueError about a ``generate`` call the user never made),
    ``output_hidden_states=True`` failed for KVzip, and ``num_return_sequences=2`` with sampling returned two texts
    for one prompt. One sequence per prompt is returned, the same as without those settings."""
    tok = word_tokenizer()
    prompts = [_words(40, 1), _words(25, 2)]
    kw = dict(method=method, budget=16, max_new_tokens=4, chat_template=False, do_sample=do_sample, seed=0)
    plain = slake.generate(llama_gqa, tok, prompts, **kw)
    for name, value in settings.items():
        monkeypatch.setattr(llama_gqa.generation_config, name, value)
    configured = slake.generate(llama_gqa, tok, prompts, **kw)
    assert isinstance(configured.sequences, torch.Tensor)
    assert configured.texts == plain.texts
    assert configured.new_tokens == plain.new_tokens
    assert torch.equal(configured.sequences, plain.sequences)
