"""Methods under a chunked prefill (``prefill_chunk``, :mod:`slake.cache.chunked`): what a chunk shows the method.

* SAGE-KV selects once, by the last token of the whole prompt: a chunked prefill showed its prefill scores the first
  chunk only, whose length decided the compress decision, so a first chunk within the budget selected nothing and the
  method became StreamingLLM. It is refused (``Method.not_chunkable``) at every entry point, before any work.
* AhaKV's gain ``c = sqrt(2 ln(N / B))`` takes the whole prompt's ``N``: the first chunk's scores used the chunk's
  length (c = 0.90 for a 96-token chunk at B = 64) while the later chunks and the decode steps used the prompt's
  (c = 1.67 for N = 256).
"""

from __future__ import annotations

import math

import pytest
import torch

import slake
import slake.methods.ahakv as ahakv_module
from slake.cache.compressed import CompressedKV
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.generate import prefill
from slake.methods import available_methods, make_method
from slake.methods.ahakv import AhaKV
from slake.methods.base import PrefillInputs
from tiny_models import random_ids, tiny_model, word_tokenizer

REFUSED = "sagekv cannot prefill in chunks: its top-k selection is one-shot"
B, HQ, HKV, N, D, C = 2, 4, 2, 256, 8, 64
PAD = 40  # row 1's left padding


def _data(n: int = N):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, h, n, D, generator=g) * 2 for h in (HQ, HKV, HKV))


def _padding(n: int = N) -> torch.Tensor:
    pad = torch.zeros(B, n, dtype=torch.bool)
    pad[1, :PAD] = True
    return pad


# ------------------------------------------------------------------------------------------------ SAGE-KV is refused
def test_the_compressor_refuses_a_chunked_sagekv_prefill_before_anything_is_stored():
    eng = CompressedKV("sagekv", C, 1, kernels="torch")
    with pytest.raises(ValueError, match=REFUSED):
        eng.begin_chunked_prefill(_padding())
    assert not eng.chunked_prefill and eng.info is None and eng.layers == [None]
    q, k, v = _data()
    eng.prefill_layer(0, q, k, v, _padding(), D**-0.5)  # the exact prefill still runs
    assert eng.info is not None and bool(eng.info.compress.all())


def test_only_one_shot_and_second_pass_methods_refuse_a_chunked_prefill():
    refused = []
    for name in available_methods():
        eng = CompressedKV(make_method(name), C, 1, kernels="torch")
        try:
            eng.begin_chunked_prefill(_padding())
        except ValueError as exc:
            assert f"{name} cannot prefill in chunks" in str(exc)
            refused.append(name)
        else:
            assert eng.chunked_prefill
    assert sorted(refused) == ["ada-criticalkv", "kvzip", "sagekv"]


def test_a_slake_cache_with_prefill_chunk_refuses_sagekv_when_it_is_built():
    """Refused when the cache is built, before any prompt (whatever its length), as KVzip is."""
    model = tiny_model("llama-gqa", layers=2)
    for method in ("sagekv", "kvzip"):
        with pytest.raises(ValueError, match="cannot prefill in chunks"):
            SlakeCache(method, 24, config=model.config, prefill_chunk=16)
    exact = SlakeCache("sagekv", 24, config=model.config)
    assert torch.isfinite(prefill(model, exact, random_ids(60, seed=1))).all()


def test_the_command_line_refuses_prefill_chunk_with_unchunkable_methods_before_loading_a_model(monkeypatch):
    """``slake eval``/``bench``/``generate --prefill-chunk`` with KVzip or SAGE-KV among the methods: one message
    naming each, before any model work (a sweep stopped when it reached the first of them)."""
    from slake.cli.validation import refuse_unchunkable

    with pytest.raises(ValueError, match="--prefill-chunk: kvzip cannot prefill in chunks.*; sagekv cannot"):
        refuse_unchunkable(["snapkv", "kvzip", "sagekv"], 16)
    refuse_unchunkable(["snapkv", "kvzip", "sagekv"], None)  # exact prefill: nothing to refuse
    refuse_unchunkable(["snapkv", "ahakv", "slake"], 16)
    from slake.cli import main

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("slake.engines.transformers.models.load_model", no_model)
    assert main(["generate", "--method", "sagekv", "--prefill-chunk", "16", "--prompt", "hi"]) == 2
    out = ["--suite", "needle", "--out", "unused-eval-folder"]
    assert main(["eval", "--methods", "snapkv,kvzip", "--budgets", "64", "--prefill-chunk", "16", *out]) == 2


def test_slake_generate_refuses_a_chunked_sagekv_prefill():
    model = tiny_model("llama-gqa", layers=2)
    prompt = " ".join(f"w{3 + (7 * i) % 250}" for i in range(60))
    with pytest.raises(ValueError, match=REFUSED):
        slake.generate(
            model, word_tokenizer(), prompt, method="sagekv", budget=24, max_new_tokens=2, chat_template=False,
            prefill_chunk=16,
        )  # fmt: skip
    res = slake.generate(
        model, word_tokenizer(), prompt, method="sagekv", budget=24, max_new_tokens=2, chat_template=False
    )
    assert res.new_tokens == [2]


# ------------------------------------------------------------------------------------- AhaKV's gain: the whole prompt's
def _gains(monkeypatch) -> list[list[float]]:
    """Record every AhaKV gain computed (per call, one value per sequence)."""
    seen: list[list[float]] = []
    real = ahakv_module.ahakv_gain

    def spy(prompt_len, budget, floor=False):
        c = real(prompt_len, budget, floor)
        seen.append([float(x) for x in torch.as_tensor(c).reshape(-1).tolist()])
        return c

    monkeypatch.setattr(ahakv_module, "ahakv_gain", spy)
    return seen


def _whole_prompt_gain() -> list[float]:
    real = (~_padding()).sum(-1).tolist()  # 256 and 216
    return [math.sqrt(2 * math.log(n / C)) for n in real]


@pytest.mark.parametrize("chunk", [96, 32])
def test_ahakv_scores_the_first_chunk_with_the_whole_prompts_gain(monkeypatch, chunk):
    """Every gain of a chunked prefill, the first chunk's included, is the whole prompt's ``c(N)`` (N = 256 and 216;
    before, the first chunk's scores used ``c(96) = 0.90`` and ``c(56)``: the chunk's real tokens)."""
    gains = _gains(monkeypatch)
    q, k, v = _data()
    pad = _padding()
    eng = CompressedKV(make_method("ahakv", window=8), C, 1, kernels="torch")
    eng.begin_chunked_prefill(pad)
    eng.prefill_layer(0, q[:, :, :chunk], k[:, :, :chunk], v[:, :, :chunk], pad[:, :chunk], D**-0.5)
    first = list(gains)
    for s in range(chunk, N, chunk):
        e = min(s + chunk, N)
        eng.append(0, k[:, :, s:e], v[:, :, s:e])
        eng.decode_attention(0, q[:, :, s:e], D**-0.5)
    eng.end_chunked_prefill()
    want = _whole_prompt_gain()
    assert len(first) == 1, first
    assert first[0] == pytest.approx(want, rel=1e-6)
    assert len(gains) > 1 and all(g == pytest.approx(want, rel=1e-6) for g in gains), gains


def test_ahakv_first_chunk_scores_equal_a_prefill_of_its_tokens_with_the_whole_prompts_length():
    """The kept sets after the first chunk are those of the chunk's tokens scored with the prompt's ``N`` (row 0's
    differ from those of the chunk's own ``N``; row 1 keeps every candidate of its chunk)."""
    q, k, v = _data()
    pad, chunk = _padding(), 96
    m = make_method("ahakv", window=8)
    eng = CompressedKV(m, C, 1, kernels="torch")
    eng.begin_chunked_prefill(pad)
    eng.prefill_layer(0, q[:, :, :chunk], k[:, :, :chunk], v[:, :, :chunk], pad[:, :chunk], D**-0.5)
    whole = make_method("ahakv", window=8)  # the chunk's tokens scored with the gain of the whole prompt's N
    whole.gain = lambda prompt_len, budget: AhaKV.gain(whole, (~pad).sum(-1), budget)
    inputs = PrefillInputs(
        q[:, :, :chunk], k[:, :, :chunk], v[:, :, :chunk], pad[:, :chunk], D**-0.5, 8, 0, 1, budget=torch.tensor([C, C])
    )
    want = whole.prefill_scores(inputs).scores
    assert not torch.equal(want, m.prefill_scores(inputs).scores)  # the chunk's own N gives other scores
    store = eng.layers[0]
    for b in range(B):
        for h in range(HKV):
            keep = store.valid[b, h]
            pos = store.positions[b, h][keep]
            cand = want[b, h, : chunk - 8].masked_fill(pad[b, : chunk - 8], float("-inf"))
            order = torch.sort(cand, descending=True, stable=True).indices  # ties to the earlier position
            top = [j for j in order[: C - 8].tolist() if not pad[b, j]]
            expected = set(top) | set(range(chunk - 8, chunk))
            assert set(pos.tolist()) == expected, (b, h)


def test_an_exact_ahakv_prefill_keeps_its_gain(monkeypatch):
    gains = _gains(monkeypatch)
    q, k, v = _data()
    eng = CompressedKV(make_method("ahakv", window=8), C, 1, kernels="torch")
    eng.prefill_layer(0, q, k, v, _padding(), D**-0.5)
    assert gains == [pytest.approx(_whole_prompt_gain(), rel=1e-6)]
