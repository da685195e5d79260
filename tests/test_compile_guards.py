"""Which guards a compiled decode step keeps (:mod:`slake.engines.transformers.compile_options`): the cache's and
the tokens' all, the model's modules' none but the top-level tensors' and the model's own, and one compiled function
per model, so that no model runs a graph traced for another."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from compiled_decode import BUDGET, PROMPT
from compiled_decode import hyper as _hyper
from compiled_decode import prompt as _prompt
from slake.engines.transformers import measure
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.compile_options import (
    compile_kwargs,
    decode_guard_filter,
    guard_filter_supported,
)
from slake.engines.transformers.generate import compile_config, prefill
from tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
needs_filter = pytest.mark.skipif(not guard_filter_supported(), reason="this torch has no guard_filter_fn")


def _entry(name: str, guard_type: str, on_module: bool):
    source = SimpleNamespace(is_unspecialized_nn_module=lambda: on_module)
    return SimpleNamespace(name=name, guard_type=guard_type, orig_guard=SimpleNamespace(source=source))


def test_the_filter_keeps_the_cache_and_drops_the_blocks():
    entries = [
        _entry("cache.compressor.state.layers[0].keys", "TENSOR_MATCH", False),
        _entry("cache.layers[0].slot", "EQUALS_MATCH", False),
        _entry("tok", "TENSOR_MATCH", False),
        _entry("model", "TYPE_MATCH", True),
        _entry("model._modules['model']._modules['embed_tokens']._parameters['weight']", "TENSOR_MATCH", True),
        _entry("model._modules['lm_head']._parameters['weight']", "TENSOR_MATCH", True),
        _entry("model._modules['model']._modules['layers']._modules['3']._parameters['weight']", "TENSOR_MATCH", True),
        _entry("model._modules['model']._modules['layers']._modules['3']._forward_hooks", "DICT_LENGTH", True),
        _entry("model._modules['model'].__dict__", "DICT_CONTAINS", True),
        _entry("model.config", "ID_MATCH", True),
    ]
    assert decode_guard_filter(entries) == [True, True, True, True, True, True, False, False, False, False]


def test_compile_kwargs_give_the_mode_as_options_beside_the_filter(monkeypatch):
    cpu = compile_kwargs("cpu")
    assert cpu["fullgraph"] is True and cpu["dynamic"] is False
    if guard_filter_supported():
        assert "mode" not in cpu and cpu["options"] == {"guard_filter_fn": decode_guard_filter}
        cuda = compile_kwargs("cuda")["options"]
        assert cuda["triton.cudagraphs"] is True and cuda["guard_filter_fn"] is decode_guard_filter
    assert compile_kwargs("cuda", lean_guards=False) == {"fullgraph": True, "dynamic": False, "mode": "reduce-overhead"}
    monkeypatch.setattr("slake.engines.transformers.compile_options.guard_filter_supported", lambda: False)
    assert compile_kwargs("cpu") == {"fullgraph": True, "dynamic": False, "mode": "default"}
    cfg = compile_config(torch.device("cpu"), lean_guards=False)
    assert cfg.mode == "default" and cfg.options is None and cfg.fullgraph and cfg.dynamic is False


def test_torch_before_2_9_keeps_every_guard(monkeypatch):
    """torch 2.7 and 2.8 take a guard filter but evaluate each guard's expression for it, and a guard that an
    attribute is absent (``config.decoder`` under transformers 5.24) stopped the compilation with
    ``InternalTorchDynamoError``; there every guard is kept (torch's default), from 2.9 the filter is given."""
    from slake.engines.transformers import compile_options

    monkeypatch.setattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", lambda *a: None, raising=False)
    for release, supported in (("2.7.1+cu126", False), ("2.8.0+cu128", False), ("2.9.0", True), ("2.13.0+cpu", True)):
        monkeypatch.setattr(torch, "__version__", release)
        assert compile_options.guard_filter_supported() is supported, release
        assert ("mode" in compile_kwargs("cuda")) is not supported


def _cache(model, budget: int = BUDGET, steps: int = 8):
    ids, mask = _prompt(1)
    cache = SlakeCache("slake", budget, config=model.config, max_cache_len=PROMPT + steps + 1, **_hyper("slake"))
    with torch.inference_mode():
        tok = prefill(model, cache, ids, mask).argmax(-1, keepdim=True)
    return cache, tok


def _greedy(step, tok, n: int) -> torch.Tensor:
    out = []
    with torch.inference_mode():
        for _ in range(n):
            tok = step(tok)
            out.append(tok)
    return torch.cat(out, 1)


def _eager(model, budget: int = BUDGET, n: int = 6) -> torch.Tensor:
    cache, tok = _cache(model, budget)
    return _greedy(lambda t: measure._step(model, cache, t), tok, n)


@needs_filter
def test_a_compiled_step_guards_the_cache_not_the_models_blocks():
    """On a real decode step: dynamo's guards on the cache and on the top-level weights are kept, the blocks' are
    dropped; the compiled tokens equal the eager ones, and a cache of another budget recompiles."""
    model = tiny_model("llama-gqa", layers=2)
    seen: list[tuple[object, bool]] = []

    def recording(entries):
        keep = decode_guard_filter(entries)
        seen.extend(zip(entries, keep))
        return keep

    counter = CompileCounter()
    kwargs = compile_kwargs("cpu")
    kwargs["options"]["guard_filter_fn"] = recording
    fn = torch.compile(measure._step, backend=counter, **kwargs)
    cache, tok = _cache(model)
    assert torch.equal(_greedy(lambda t: fn(model, cache, t), tok, 6), _eager(model))
    dropped = [e for e, k in seen if not k]
    kept = [e for e, k in seen if k]
    assert dropped and all(e.orig_guard.source.is_unspecialized_nn_module() for e in dropped)
    assert any(e.guard_type == "TENSOR_MATCH" and e.name.startswith("cache") for e in kept)
    assert any(e.guard_type == "TENSOR_MATCH" and "embed_tokens" in e.name for e in kept)
    assert not any("_modules['0']" in e.name for e in kept)
    assert counter.frame_count == 1
    other, tok = _cache(model, budget=BUDGET + 8)  # another shape of the cache: the kept guards catch it
    assert torch.equal(_greedy(lambda t: fn(model, other, t), tok, 6), _eager(model, budget=BUDGET + 8))
    assert counter.frame_count == 2


@needs_filter
def test_each_model_gets_its_own_compiled_step(monkeypatch):
    """Two models alike but for their MLP width pass each other's remaining guards (one compiled function would run
    the first model's graph for the second), so ``compiled_step`` compiles one function per model."""
    a = tiny_model("llama-gqa", layers=2)
    b = tiny_model("llama-gqa", layers=2, seed=1, intermediate_size=96)
    shared = CompileCounter()
    fn = torch.compile(measure._step, backend=shared, **compile_kwargs("cpu"))
    for model in (a, b):
        cache, tok = _cache(model)
        _greedy(lambda t, model=model, cache=cache: fn(model, cache, t), tok, 2)
    assert shared.frame_count == 1  # the hazard: b ran a's graph

    counters: list[CompileCounter] = []

    def compile_step(model):
        counters.append(CompileCounter())
        return torch.compile(measure._step, backend=counters[-1], **compile_kwargs("cpu"))

    monkeypatch.setattr(measure, "_compile_step", compile_step)
    monkeypatch.setattr(measure, "_COMPILED", type(measure._COMPILED)())
    torch._dynamo.reset()
    for model in (a, b):
        cache, tok = _cache(model)
        assert torch.equal(_greedy(measure.compiled_step(model, cache), tok, 6), _eager(model))
    assert [c.frame_count for c in counters] == [1, 1]
