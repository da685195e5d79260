"""Fifth audit of the transformers engine's glue (``slake.engines.transformers``, ``slake.engines``): each test failed
before its fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from slake import Budget
from slake.engines.base import BenchPlan
from slake.engines.transformers import TransformersEngine
from tiny_models import tiny_model


def _tiny_engine() -> TransformersEngine:
    model = tiny_model("llama-gqa", layers=2)
    return TransformersEngine(loader=lambda spec: (model, None))


@pytest.mark.parametrize(
    ("option", "flag"),
    [
        ({"kv_dtypes": (None, "int8")}, "--kv-dtype"),
        ({"prefill_chunk": 8}, "--prefill-chunk"),
        ({"compile": True}, "--compile"),
    ],
)
def test_the_python_bench_refuses_what_transformers_own_cache_cannot_be_timed_with(tmp_path, option, flag):
    """``Engine.bench`` (the Python API, without the command's ``engine.check``) measured transformers' own
    ``DynamicCache`` in the model's dtype and unchunked, and wrote rows that said ``kv_dtype: int8`` or
    ``prefill_chunk: 8`` (the same bytes as the plain row): it refuses them, as ``slake bench`` does, before any
    row is measured."""
    plan = BenchPlan(
        methods=("transformers", "full"),
        budgets=(Budget(16),),
        lengths=(32,),
        out=Path(tmp_path),
        decode_steps=1,
        warmup=0,
        plots=False,
        progress=False,
        decode_timing="sequential",
        **option,
    )
    with pytest.raises(ValueError, match=flag):
        _tiny_engine().bench(plan)
    assert not (Path(tmp_path) / "bench.jsonl").exists()


@pytest.mark.parametrize("how", ["from_model", "loader"])
def test_an_isolated_bench_of_an_engine_holding_its_own_model_is_refused(tmp_path, monkeypatch, how):
    """With ``isolate`` each configuration runs in a fresh process that loads the engine's ``ModelSpec``: an engine
    made over a model in memory (``from_model``, or a ``loader``) has the default spec, so its isolated rows measured
    the packaged default model (smollm2) while the table's notes named the engine's model. It is refused before any
    child process starts."""
    from slake.engines.transformers import bench

    started = []
    monkeypatch.setattr(bench, "_isolated", lambda spec, plan, cfg: started.append(spec) or [])
    model = tiny_model("llama-gqa", layers=2)
    if how == "from_model":
        engine = TransformersEngine.from_model(model, None, name="mine")
    else:
        engine = TransformersEngine(loader=lambda spec: (model, None))
    plan = BenchPlan(
        methods=("full",), budgets=(Budget(16),), lengths=(32,), out=Path(tmp_path), isolate=True, plots=False,
        progress=False, decode_timing="sequential",
    )  # fmt: skip
    with pytest.raises(ValueError, match="isolate"):
        engine.bench(plan)
    assert started == []


@pytest.mark.parametrize("batch_size", [1, 2])
def test_the_full_row_of_an_8bit_evaluation_with_fidelity_decodes_its_own_8bit_cache(monkeypatch, batch_size):
    """``--kv-dtype`` applies to every row, the full cache's too (docs/conventions.md); with ``--fidelity`` the full
    row took its tokens (and decode time) from the fidelity reference, the full cache at the model's dtype, while its
    ``kv_bytes`` were the 8-bit cache's: adding ``--fidelity`` changed what the full row measured. Its tokens now come
    from its own 8-bit cache (the reference, as in ``slake fidelity``, stays the unquantised full cache)."""
    from slake.engines.base import EvalOptions, EvalRequest
    from slake.engines.transformers import evaluate as ev
    from tiny_models import random_ids

    decoded: list[tuple[str, str | None]] = []
    real = ev.greedy_decode

    def spy(model, capture, cache, *args, **kwargs):
        decoded.append((cache.method.name, cache.compressor.kv_dtype))
        return real(model, capture, cache, *args, **kwargs)

    monkeypatch.setattr(ev, "greedy_decode", spy)
    model = tiny_model("llama-gqa", layers=2)
    pairs = (("full", None), ("snapkv[window=4]", 12))
    requests = [
        EvalRequest(key=k, prefill_ids=random_ids(20 + 5 * k, seed=k)[0].tolist(), question_ids=[],
                    max_new_tokens=3, group="g", pairs=pairs)
        for k in range(batch_size)
    ]  # fmt: skip
    options = EvalOptions(kv_dtype="int8", fidelity=True, batch_size=batch_size)
    rows = list(ev.evaluate(model, requests, options, []))
    assert {r.method for r in rows} == {"full", "snapkv[window=4]"}
    assert ("full", None) in decoded  # the fidelity reference
    assert ("full", "int8") in decoded  # the full row's own answer


def test_generating_text_with_a_random_model_shape_says_it_has_no_tokenizer() -> None:
    """A random model shape (benchmarks) has no tokenizer: ``generate`` said ``'NoneType' object is not callable``
    from inside the chat template, not what was missing."""
    from slake.engines import make_engine
    from slake.engines.base import ModelSpec

    engine = make_engine("transformers", ModelSpec(random="tiny:num_hidden_layers=1", device="cpu", dtype="float32"))
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.generate("hello", method="snapkv", budget=8, max_new_tokens=2)
