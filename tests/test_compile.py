"""Compiled decoding (``docs/compile.md``): a static SlakeCache decodes with fixed shapes and no host read-back, so a
decode step is one ``torch.compile(fullgraph=True)`` graph for every method, compiled once, and gives the eager
tokens, bytes and kept counts.

Most tests trace with dynamo and run the captured graph as it is, through a counting backend (``CompileCounter``, or
``_StepCapture``, which also reads AOT autograd's metadata of mutated and static inputs): they check exactly what
compiled decoding needs (one graph, no break, no recompilation, static mutated inputs) at a fraction of inductor's
compile time; two tests run inductor itself.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from compiled_decode import BUDGET, PROMPT
from compiled_decode import decode as _decode
from compiled_decode import hyper as _hyper
from compiled_decode import prompt as _prompt
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from slake.engines.transformers.generate import prefill
from slake.methods import available_methods
from slake.methods.base import check_compileable, make_method
from slake.methods.snapkv import SnapKV
from tiny_models import tiny_model

#: every method, and the decode eviction across a layer's KV heads (``decode_scope=layer``, one top-k per step)
METHODS = [*available_methods(), "kvzip[decode_scope=layer]"]
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama-gqa", layers=2)


class _StepCapture:
    """A dynamo backend that counts the graphs it is handed and, through AOT autograd, records which of a graph's
    inputs the step updates in place and which are static inputs; it runs the captured graph as it is."""

    def __init__(self) -> None:
        self.frames = 0
        self.mutated: set[int] = set()
        self.static: set[int] = set()
        self.names: list[str] = []

    def __call__(self, gm, example_inputs):
        from torch._functorch.aot_autograd import aot_module_simplified

        self.frames += 1

        def fw(g, inputs):
            meta = torch._guards.TracingContext.get().fw_metadata
            self.mutated = set(meta.mutated_inp_runtime_indices)
            self.static = set(meta.static_input_indices)
            self.names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
            return g

        return aot_module_simplified(gm, example_inputs, fw_compiler=fw)


@pytest.mark.parametrize("method", METHODS)
def test_a_compiled_decode_step_is_one_static_graph_that_decodes_as_eager(model, method):
    """For every method, on a left-padded batch, one capture checks what compiled decoding needs:

    * dynamo captures a whole decode step (model and cache: append, scores, eviction, fold, attention) as one graph
      (``fullgraph=True``: a break raises) and never recompiles over 64 steps (four times the budget: each slot is
      evicted and refilled several times, and every position counter crosses the prompt's and the budget's sizes);
    * the same greedy tokens, kv_bytes and kept counts compiled as eager (static cache), and as the default dynamic
      cache;
    * the condition for inductor's CUDA graphs (``mode="reduce-overhead"``), checked on the CPU: every graph input
      the step updates in place is a static input (a parameter or a tensor marked with ``mark_static_address``, as
      ``prepare_static`` marks the cache's tensors on CUDA); one mutated input that is not makes inductor skip CUDA
      graphs for the whole step. SLAKE failed this on an H100: PTAA's cached views of the linear state entered the
      graph as inputs aliasing the mutated state, and a graph with aliased mutated inputs has no static inputs.

    One capture through AOT autograd serves the three (it was four captures per method, a quarter of the unit tier's
    compile time)."""
    steps = 64
    capture = _StepCapture()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled, stats, cache = _decode(model, method, steps, backend=capture, mark_static=True)
    eager, eager_stats, _ = _decode(model, method, steps)
    dynamic, dyn_stats, _ = _decode(model, method, steps, static=False)
    assert cache.is_compileable and cache.compressor.static
    assert stats["compressed"] == (method != "full")
    assert capture.frames == 1
    assert compiled.shape == (2, steps) and cache.compressor.seen_tokens(0) == PROMPT + steps
    assert torch.equal(eager, dynamic)
    assert torch.equal(compiled, eager)
    assert stats["kept_tokens_per_layer"] == eager_stats["kept_tokens_per_layer"] == dyn_stats["kept_tokens_per_layer"]
    assert stats["kv_bytes"] == eager_stats["kv_bytes"]
    if method != "full":  # evicting layers preallocate one slot only: the same bytes as the dynamic cache
        assert stats["kv_bytes"] == dyn_stats["kv_bytes"]
        assert max(stats["kept_tokens_per_layer"]) <= BUDGET * 2  # every layer stays at its post-prefill size
    assert capture.mutated, "the step updates the cache in place"
    not_static = sorted(capture.names[i] for i in capture.mutated - capture.static)
    assert not not_static, not_static


@pytest.mark.parametrize("method,kv_dtype", [("slake", "int8"), ("cake", "fp8_e4m3")])
def test_compiled_decode_with_8bit_storage(model, method, kv_dtype):
    eager, eager_stats, _ = _decode(model, method, 12, kv_dtype=kv_dtype)
    counter = CompileCounter()
    compiled, stats, _ = _decode(model, method, 12, backend=counter, kv_dtype=kv_dtype)
    assert torch.equal(compiled, eager) and counter.frame_count == 1
    assert stats["kv_bytes"] == eager_stats["kv_bytes"]


@pytest.mark.parametrize("method,batch,steps", [("full", 1, 500), ("slake", 2, 500), ("h2o", 2, 500)])
def test_no_recompilation_over_long_decodes(model, method, batch, steps):
    """Every decode step runs the graph captured at the first step: dynamo never recompiles (it would raise). The
    full cache and two evicting methods on a padded batch decode 500 steps (every method decodes 64 in
    ``test_a_compiled_decode_step_is_one_static_graph_that_decodes_as_eager``)."""
    counter = CompileCounter()
    with torch._dynamo.config.patch(error_on_recompile=True):
        tokens, stats, cache = _decode(model, method, steps, batch=batch, backend=counter)
    assert counter.frame_count == 1
    assert tokens.shape == (batch, steps)
    assert cache.compressor.seen_tokens(0) == PROMPT + steps
    if method != "full":  # every layer stays at its post-prefill size
        kept = stats["kept_tokens_per_layer"]
        assert max(kept) <= BUDGET * 2


def test_inductor_compiled_decode_equals_eager(model):
    """The real compiler (inductor, C++ on CPU) gives the eager tokens and bytes."""
    eager, eager_stats, _ = _decode(model, "slake", 6)
    compiled, stats, _ = _decode(model, "slake", 6, backend="inductor")
    assert torch.equal(compiled, eager)
    assert stats["kv_bytes"] == eager_stats["kv_bytes"]


def test_inductor_writes_the_new_token_into_the_store_in_place(model):
    """Under inductor a step writes its token into a static store in place: no loop over a layer's whole keys or
    values. A ``scatter_`` write compiled into an out-of-place scatter and a copy back, two passes over each
    layer's store per step (16 ms of a 128K-token full-cache step on an H200, ``docs/compile.md``)."""
    from torch._inductor.utils import run_and_get_code

    (_, _, cache), code = run_and_get_code(lambda: _decode(model, "full", 2, backend="inductor"))
    keys = cache.compressor.state.store(0).keys
    assert code, "inductor compiled nothing"
    assert not any(f"{keys.numel()}L" in c for c in code), "a compiled step loops over a layer's whole store"


@pytest.mark.parametrize("lean_guards", [True, False])
def test_transformers_generate_with_compile_config(model, lean_guards):
    """``model.generate(past_key_values=SlakeCache(max_cache_len=...), compile_config=...)`` with slake's
    ``compile_config`` (its guard filter, or every guard) compiles the decode step once (fullgraph) and gives the
    eager tokens, for a padded batch."""
    from slake.engines.transformers.generate import compile_config

    ids, mask = _prompt(2)
    graphs = []

    def backend(gm, example_inputs):  # transformers deep-copies the config: count with a plain function
        graphs.append(gm)
        return gm.forward

    def run(compile_config):
        cache = SlakeCache("slake", BUDGET, config=model.config, max_cache_len=PROMPT + 20, window=4)
        kw = {"compile_config": compile_config} if compile_config else {"disable_compile": True}
        with torch.inference_mode():
            return model.generate(
                input_ids=ids,
                attention_mask=mask,
                **with_cache(model, cache),
                max_new_tokens=16,
                do_sample=False,
                pad_token_id=0,
                **kw,
            )

    cfg = compile_config(torch.device("cpu"), lean_guards=lean_guards)
    cfg.backend = backend
    assert torch.equal(run(cfg), run(None))
    assert len(graphs) == 1


def test_static_cache_refuses_what_it_cannot_serve(model):
    ids, mask = _prompt(1)
    with pytest.raises(ValueError, match="max_cache_len"):
        SlakeCache("snapkv", BUDGET, config=model.config, max_cache_len=1, window=4)
    cache = SlakeCache("snapkv", BUDGET, config=model.config, max_cache_len=PROMPT + 4, window=4)
    with torch.inference_mode():
        prefill(model, cache, ids, mask)
        with pytest.raises(ValueError, match="one token"):
            model(input_ids=ids[:, :2], **with_cache(model, cache), use_cache=True)
    too_short = SlakeCache("full", BUDGET, config=model.config, max_cache_len=PROMPT)
    with torch.inference_mode(), pytest.raises(ValueError, match="no room"):
        prefill(model, too_short, ids, mask)


@pytest.mark.parametrize("method", ["full", "snapkv", "slake", "tova", "criticalkv"])
def test_beam_search_on_a_static_cache_equals_the_dynamic_cache(model, method):
    """Beam search reorders the rows of a static cache (``select_batch``) between steps, its free slots, scores,
    slot orders, slot weights and linear state with them: the same beams as the dynamic cache, for a left-padded
    batch (3 beams each). transformers runs beam search eagerly (``compile_config`` applies to sampling and greedy
    search)."""
    ids, mask = _prompt(2)

    def run(static: bool):
        cache = SlakeCache(
            method, BUDGET, config=model.config, max_cache_len=PROMPT + 10 if static else None, **_hyper(method)
        )
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, **with_cache(model, cache), max_new_tokens=10, num_beams=3,
                do_sample=False, pad_token_id=0, disable_compile=True,
            )  # fmt: skip
        return out, cache.statistics()

    (static, s_stats), (dynamic, d_stats) = run(True), run(False)
    assert torch.equal(static, dynamic)
    assert s_stats["kept_tokens_per_layer"] == d_stats["kept_tokens_per_layer"]


@pytest.mark.parametrize("method, budget", [("full", BUDGET), ("slake", 4 * PROMPT)])
def test_a_static_cache_refuses_more_tokens_than_max_cache_len(model, method, budget):
    """A layer that appends without evicting (the full cache, a prompt within its budget) has the free slots
    ``max_cache_len`` made room for; the step after the last wrote its token into slot 0 of every row, over a kept
    one, and decoding went on from a cache that had lost it (logits off by up to 0.7 on a tiny model)."""
    from slake.engines.transformers.generate import compile_config

    ids, mask = _prompt(1)

    def run(new_tokens, **kw):
        hyper = {} if method == "full" else {"window": 4}
        cache = SlakeCache(method, budget, config=model.config, max_cache_len=PROMPT + 4, **hyper)
        with torch.inference_mode():
            return model.generate(
                input_ids=ids, attention_mask=mask, **with_cache(model, cache), max_new_tokens=new_tokens,
                do_sample=False, pad_token_id=0, **kw,
            )  # fmt: skip

    assert run(4, disable_compile=True).shape[1] == PROMPT + 4  # the prompt's own token and 3 decode steps: room
    with pytest.raises(ValueError, match=r"max_cache_len=\d+: after its prompt of \d+ tokens it has room for"):
        run(8, disable_compile=True)
    cfg = compile_config(torch.device("cpu"))
    cfg.backend = "eager"  # traced as a compiled step (no host count), its captured operations run as they are
    with pytest.raises(RuntimeError, match=r"max_cache_len=\d+: after its prompt of \d+ tokens it has room for"):
        run(8, compile_config=cfg)


def test_every_method_claims_compile_support_and_a_method_can_refuse():
    for name in METHODS:
        check_compileable(make_method(name))

    class Dynamic(SnapKV):
        decode_not_compileable = "its decode rule reads the number of kept tokens back to the host"

    with pytest.raises(ValueError, match="cannot be compiled: its decode rule"):
        SlakeCache(Dynamic(window=4), BUDGET, num_layers=2, max_cache_len=64)
    SlakeCache(Dynamic(window=4), BUDGET, num_layers=2)  # the dynamic cache still serves it


def test_eager_decode_reads_nothing_back(model, monkeypatch):
    """The eager single-token step of the default (dynamic) cache makes no host read-back either: ``.item()``,
    ``.tolist()``, ``bool()`` and ``int()`` of a tensor are refused during decode steps."""
    ids, mask = _prompt(2)
    cache = SlakeCache("slake", BUDGET, config=model.config, window=4)
    with torch.inference_mode():
        tok = prefill(model, cache, ids, mask).argmax(-1, keepdim=True)
        pos = PROMPT - (mask == 0).sum(-1, keepdim=True)
        for t in range(2):  # the first step per layer learns its free slots once
            tok = model(input_ids=tok, position_ids=pos + t, **with_cache(model, cache)).logits[:, -1].argmax(-1, True)
        compressor = cache.compressor
        for layer in range(2):
            store = compressor.layers[layer]
            B, H, _, d = store.keys.shape
            q = torch.randn(B, 4, 1, d)
            k, v = torch.randn(B, H, 1, d), torch.randn(B, H, 1, d)

            def refuse(*a, **k):
                raise AssertionError("host read-back in a decode step")

            with monkeypatch.context() as mp:
                for name in ("item", "tolist", "__bool__", "__int__"):
                    mp.setattr(torch.Tensor, name, refuse)
                compressor.append(layer, k, v)
                compressor.decode_attention(layer, q, d**-0.5)


def test_bench_compile_pairs_each_configuration_with_its_eager_run(tmp_path, capsys, monkeypatch):
    """``slake bench --compile``: every configuration eager and compiled, timed in turn, with the paired ratio and
    the compile time (the compiled step is traced by dynamo and run by a counting backend to keep the test fast)."""
    import json

    from slake.cli import main
    from slake.engines.transformers import measure
    from slake.engines.transformers.compile_options import compile_kwargs

    counter = CompileCounter()
    compiled = torch.compile(measure._step, backend=counter, **compile_kwargs("cpu"))
    monkeypatch.setattr(measure, "_compile_step", lambda model: compiled)
    rc = main(
        [
            "bench",
            "--methods",
            "snapkv,slake",
            "--budget",
            "40",
            "--lengths",
            "96",
            "--compile",
            "--random-model",
            "tiny:num_hidden_layers=2",
            "--device",
            "cpu",
            "--decode-steps",
            "3",
            "--warmup",
            "1",
            "--out",
            str(tmp_path),
            "--json",
            "--no-progress",
            "--no-plots",
        ]
    )
    assert rc == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert [(r["method"], r["compile"]) for r in rows] == [
        ("snapkv", False),
        ("snapkv", True),
        ("slake", False),
        ("slake", True),
    ]
    for eager, compiled in (rows[0:2], rows[2:4]):
        assert compiled["decode_vs_eager"] > 0 and compiled["compile_s"] > 0 and "decode_vs_eager" not in eager
        assert compiled["kv_bytes"] == eager["kv_bytes"] and compiled["kept_tokens_mean"] == eager["kept_tokens_mean"]
    assert counter.frame_count == 2  # one graph per configuration: its measured and timed runs share it
    md = (tmp_path / "bench.md").read_text()
    assert "| slake compiled | 40 | 96 |" in md and "compiled vs eager" in md


def test_engines_without_compile_refuse_the_flag():
    from types import SimpleNamespace

    from slake.engines.base import Engine

    engine = SimpleNamespace(unsupported={}, supports_compile=False, name="other", check_environment=lambda: None)
    with pytest.raises(ValueError, match="--compile"):
        Engine.check(engine, compile=True)
    Engine.check(engine, compile=False)


def test_static_cache_builds_where_transformers_cache_has_a_read_only_max_cache_len(monkeypatch):
    """transformers 5.19's ``Cache`` defines ``max_cache_len`` as a read-only property (5.23 does not); the static
    cache must not assign to that name (it failed with "property ... has no setter" under vLLM's transformers)."""
    from transformers.cache_utils import Cache

    from slake import SlakeCache

    monkeypatch.setattr(Cache, "max_cache_len", property(lambda self: -1), raising=False)
    cache = SlakeCache("snapkv", 40, 2, max_cache_len=64)
    assert cache.static_len == 64 and all(layer.is_compileable for layer in cache.layers)
