"""Which decode step ran, as the cache, ``slake bench`` and ``slake.generate`` report it (audit of 2026-11-29 on the
choice between the torch step and the fused Triton kernels; each test failed before its fix):

1. compiled decoding recorded nothing and logged nothing, and bench and generate then reported the kernels asked
   for: each layer's implementation is now worked out before the steps are captured (``Decoder.prepare_static``);
2. the uncompressed eager step (one SDPA call over a prefix of slots) recorded nothing, so ``slake bench`` said
   ``triton (interpreter)`` and ``slake.generate`` said ``none``: it is ``sdpa``;
3. a block of several new tokens after the prefill (a later chat turn) ran in torch with no record;
4. ``kernels="auto"`` on a GPU without Triton chose the torch step silently, and none of the three ``auto`` cases that
   choose the torch step on a GPU said why in the report;
5. a fallback's warning came once per cache, not once per process;
7. an ImportError while loading the kernels escaped ``resolve_kernels`` (a RuntimeError was turned into a ValueError);
8. the warm cache's ``report`` left the layer-eviction kernel out, and docs/results/README.md cited a benchmark module
   that no longer exists.

The kernels run through Triton's interpreter on tiny shapes (``tests/conftest.py``), as in
``tests/test_fused_decode.py``."""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import re
from pathlib import Path

import pytest
import torch

import slake.kernels
from slake.cache import compressed, fused_step
from slake.cache.compressed import CompressedKV, resolve_kernels
from slake.methods import make_method
from uncovered_rule import Reversed

ROOT = Path(__file__).resolve().parents[1]
COVER = "fused decode kernels do not cover"


@pytest.fixture
def fresh_log(monkeypatch):
    """No fallback reason said yet in this process (they are said once per process)."""
    monkeypatch.setattr(fused_step, "_LOGGED", set(), raising=False)


def _prefill(method, kernels, *, B=1, H=2, G=2, D=16, S=40, budget=16, layers=1, static_steps=None, dtype=None):
    """A cache with ``layers`` random prefilled layers; ``static_steps``: static (fixed-shape) mode with room for that
    many steps. Returns the cache and a random-tensor maker."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype or torch.float32)

    eng = CompressedKV(method, budget, layers, kernels=kernels)
    if static_steps is not None:
        eng.max_cache_len = S + static_steps
    padding = torch.zeros(B, S, dtype=torch.bool)
    for li in range(layers):
        eng.prefill_layer(li, rnd(B, H * G, S, D), rnd(B, H, S, D), rnd(B, H, S, D), padding, D**-0.5)
    return eng, rnd


def _decode(eng, rnd, steps, *, B=1, H=2, G=2, D=16, n_new=1, step=None):
    for _ in range(steps):
        for li in range(eng.num_layers):
            k, v, q = rnd(B, H, n_new, D), rnd(B, H, n_new, D), rnd(B, H * G, n_new, D)
            if step is None:
                eng.append(li, k, v)
                eng.decode_attention(li, q, D**-0.5)
            else:
                step(li, q, k, v)


def _compiled_steps(eng, rnd, steps):
    """``steps`` single-token steps of every layer through ``torch.compile`` (dynamo traces the step; its graph runs
    as it is)."""

    def one(layer, q, k, v):
        eng.append(layer, k, v)
        return eng.decode_attention(layer, q, 16**-0.5)

    compiled = torch.compile(one, backend="eager", fullgraph=True)
    _decode(eng, rnd, steps, step=compiled)


# ------------------------------------------------------------------------------------------- 1. compiled decoding
def test_a_compiled_step_the_kernels_do_not_cover_is_recorded_and_logged_before_capture(caplog, fresh_log):
    """``kernels="triton"`` under ``torch.compile`` for a rule without a fused form: the torch step runs. It used to
    leave the report at ``none`` and log nothing; the static cache now works out each layer's step before capture."""
    torch._dynamo.reset()
    with caplog.at_level("WARNING", logger="slake.kernels"):
        eng, rnd = _prefill(Reversed(window=4), "triton", layers=2, static_steps=4)
        _compiled_steps(eng, rnd, 2)
    report = eng.decoder.report
    assert report.summary() == "torch (fallback: snapkv's decode rule has no fused form)"
    assert report.planned == {i: ("torch", "snapkv's decode rule has no fused form") for i in range(2)}
    assert sum(COVER in r.message for r in caplog.records) == 1


def test_a_compiled_step_the_kernels_cover_is_planned_as_triton():
    """The same under compile for SnapKV, whose rule the kernels cover (and the dense kernels for a static full cache):
    the plan says ``triton`` and names no fallback."""
    torch._dynamo.reset()
    eng, rnd = _prefill(make_method("snapkv", window=4), "triton", static_steps=3)
    _compiled_steps(eng, rnd, 1)
    assert eng.decoder.report.summary() == "triton" and not eng.decoder.report.fallbacks
    full, _ = _prefill(make_method("full"), "triton", static_steps=3)
    assert full.decoder.report.summary() == "triton"
    torch_full, _ = _prefill(make_method("full"), "torch", static_steps=3)
    assert torch_full.decoder.report.summary() == "torch"


def test_a_static_full_cache_whose_keys_the_dense_kernels_do_not_read_plans_the_torch_step(fresh_log):
    """The dense step's fallback (float64 keys) is planned too: it was reported as ``triton`` under compile."""
    eng, _ = _prefill(make_method("full"), "triton", static_steps=3, dtype=torch.float64)
    assert eng.decoder.report.summary() == "torch (fallback: torch.float64 keys in the dense attention)"


def test_generate_compiled_reports_the_planned_fallback_not_the_kernels_asked_for(monkeypatch):
    """``slake.generate(compile=True, kernels="triton")`` with a rule the kernels do not cover reported ``triton``
    (the report said ``none`` and generate put the choice in its place)."""
    import slake
    from slake.engines.transformers import generate as gen
    from slake.engines.transformers.shapes import random_model
    from tiny_models import word_tokenizer

    real = gen.compile_config

    def config(device, **kw):
        cfg = real(device, **kw)
        cfg.backend = "eager"  # dynamo traces the step as in a real compile; its graph runs as it is
        return cfg

    torch._dynamo.reset()
    monkeypatch.setattr(gen, "compile_config", config)
    model = random_model("tiny", seed=0)
    prompt = " ".join(f"w{3 + (7 * i) % 250}" for i in range(60))
    res = slake.generate(model, word_tokenizer(), prompt, method=Reversed(window=4), budget=40, max_new_tokens=3,
                         chat_template=False, compile=True, kernels="triton")  # fmt: skip
    assert res.extra["kernels"] == "torch (fallback: snapkv's decode rule has no fused form)"


def test_bench_compiled_row_reports_the_planned_fallback_not_the_kernels_asked_for(monkeypatch):
    """``slake bench --compile --kernels triton``: a float64 full cache, whose keys the dense kernels do not read,
    was reported as ``triton`` (``measure`` put the choice in place of the report's ``none``)."""
    from slake.engines.transformers import measure
    from slake.engines.transformers.compile_options import compile_kwargs
    from slake.engines.transformers.shapes import random_model

    torch._dynamo.reset()
    compiled = torch.compile(measure._step, backend="eager", **compile_kwargs("cpu"))
    monkeypatch.setattr(measure, "_compile_step", lambda model: compiled)
    model = random_model("tiny:num_hidden_layers=2", seed=0, dtype=torch.float64)
    cfg = measure.BenchConfig("full", 64, 48, decode_steps=1, warmup=0, compile=True, kernels="triton")
    row = measure.measure(model, cfg)
    assert row["kernels"] == "torch (fallback: torch.float64 keys in the dense attention)"
    assert row["triton_launch"] is None


# ------------------------------------------------------------------------------- 2. the uncompressed eager step
def test_the_uncompressed_eager_step_is_recorded_as_sdpa(caplog):
    """A full cache (an unpadded batch: its slots are a prefix) decodes with one SDPA call per layer and step; the
    report said ``none`` for it."""
    for kernels in ("triton", "torch"):
        with caplog.at_level("WARNING", logger="slake.kernels"):
            eng, rnd = _prefill(make_method("full"), kernels, layers=2)
            _decode(eng, rnd, 3)
        assert eng.decoder.report.steps == {"sdpa": 6}
        assert eng.decoder.report.summary() == "sdpa"
        assert not any(COVER in r.message for r in caplog.records)


def test_bench_and_generate_say_sdpa_for_the_uncompressed_eager_step(tmp_path, capsys):
    """``slake bench --kernels triton`` said ``triton (interpreter)`` for a full cache whose every step was one SDPA
    call, and ``slake.generate`` said ``none`` for a prompt within the budget."""
    import slake
    from slake.cli import main
    from slake.engines.transformers.shapes import random_model
    from tiny_models import word_tokenizer

    argv = ["bench", "--methods", "full", "--budget", "64", "--lengths", "48", "--random-model", "tiny", "--device"]
    argv += ["cpu", "--decode-steps", "2", "--warmup", "0", "--no-plots", "--no-progress", "--json", "--kernels"]
    assert main([*argv, "triton", "--out", str(tmp_path / "b")]) == 0
    (row,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert (row["kernels"], row["triton_launch"]) == ("sdpa", None)
    assert "| sdpa |" in (tmp_path / "b" / "bench.md").read_text()
    model = random_model("tiny", seed=0)
    res = slake.generate(model, word_tokenizer(), "w3 w4 w5 w6", method="snapkv", budget=4096, max_new_tokens=3,
                         chat_template=False, kernels="triton")  # fmt: skip
    assert not res.compressed and res.extra["kernels"] == "sdpa"


# ----------------------------------------------------------------------------- 3. a multi-token block after prefill
def test_a_multi_token_block_after_the_prefill_is_recorded_as_torch_with_a_reason(caplog, fresh_log):
    """A later chat turn's block is attended, scored and evicted in torch: it is recorded with a reason that names no
    token count (so that it is logged once whatever the block's length), and logged once."""
    with caplog.at_level("WARNING", logger="slake.kernels"):
        eng, rnd = _prefill(make_method("snapkv", window=4), "triton")
        _decode(eng, rnd, 1)
        _decode(eng, rnd, 2, n_new=5)
        _decode(eng, rnd, 1, n_new=3)
    report = eng.decoder.report
    assert report.steps == {"triton": 1, "torch": 3}
    ((reason, count),) = report.fallbacks.items()
    assert count == 3 and "multi-token block" in reason and not re.search(r"\d", reason)
    assert report.summary() == f"torch+triton (fallback: {reason})"
    assert sum(reason in r.message for r in caplog.records) == 1
    ref, rnd = _prefill(make_method("snapkv", window=4), "torch")  # asked for torch: torch, no fallback
    _decode(ref, rnd, 1, n_new=5)
    assert ref.decoder.report.summary() == "torch"


# ----------------------------------------------------------------------------------- 4. auto on a GPU, said why
AUTO_CASES = {
    "missing": ("Triton not installed", "Triton is not installed"),
    "old": ("Triton 3.3.1 is older than 3.4", "need Triton 3.4 or later, and this is 3.3.1"),
    "amd": ("the kernels have not run on an AMD GPU yet", "have not run on an AMD GPU"),
}


@pytest.mark.parametrize("case", list(AUTO_CASES))
def test_auto_choosing_torch_on_a_gpu_is_logged_once_and_said_in_the_report(case, monkeypatch, caplog):
    """``kernels="auto"`` on a GPU where the torch step is chosen (Triton missing, too old, an AMD GPU): logged once
    per process (the missing Triton was not logged at all), and the report and bench row read
    ``torch (auto: why)`` (they read ``torch``). Only the device's type is read, so CPU tensors stand in."""
    why, logged = AUTO_CASES[case]
    for flag in ("_told_missing", "_told_old", "_told_amd"):
        monkeypatch.setattr(compressed, flag, False, raising=False)
    monkeypatch.setattr(torch.version, "hip", "6.4.0" if case == "amd" else None)
    if case == "missing":
        monkeypatch.setattr(slake.kernels, "triton_available", lambda: False)
    if case == "old":
        monkeypatch.setattr(slake.kernels, "triton_version", lambda: (3, 3, 1))
    with caplog.at_level("WARNING", logger="slake.kernels"):
        assert resolve_kernels("auto", "cuda") == "torch"
        assert resolve_kernels("auto", "cuda:1") == "torch"
    assert sum(logged in r.message for r in caplog.records) == 1
    assert compressed.kernel_choice("auto", "cuda") == ("torch", why)
    real = compressed.kernel_choice
    monkeypatch.setattr(compressed, "kernel_choice", lambda kernels, device: real(kernels, "cuda"))
    eng, rnd = _prefill(make_method("snapkv", window=4), "auto")
    _decode(eng, rnd, 2)
    assert eng.decoder.report.summary() == f"torch (auto: {why})"


def test_auto_on_the_cpu_and_the_explicit_choices_carry_no_auto_reason():
    assert compressed.kernel_choice("auto", "cpu") == ("torch", None)
    assert compressed.kernel_choice("torch", "cuda") == ("torch", None)
    assert compressed.kernel_choice("triton", "cpu") == ("triton", None)


# ------------------------------------------------------------------------------------ 5. once per process
def test_a_fallback_is_logged_once_per_process_and_counted_per_cache(caplog, fresh_log):
    """Three caches (three ``generate`` calls, or eval samples) meeting the same reason: one warning (there were
    three), each cache's report counting its own steps."""
    with caplog.at_level("WARNING", logger="slake.kernels"):
        for _ in range(3):
            eng, rnd = _prefill(Reversed(window=4), "triton", layers=2)
            _decode(eng, rnd, 2)
            assert eng.decoder.report.fallbacks == {"snapkv's decode rule has no fused form": 4}
    assert sum(COVER in r.message for r in caplog.records) == 1


# -------------------------------------------------------------------------------- 7. an ImportError under auto
@pytest.mark.parametrize("kernels", ["auto", "triton"])
def test_an_import_error_while_loading_the_kernels_is_a_value_error(kernels, monkeypatch):
    """A broken Triton installation (an ImportError from ``slake.kernels.load``) is refused as clearly as the
    interpreter asked for too late (a RuntimeError): a ValueError, not the ImportError itself."""

    def broken():
        raise ImportError("cannot import name 'jit' from 'triton'")

    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(slake.kernels, "load", broken)
    with pytest.raises(ValueError, match="cannot import name 'jit'"):
        resolve_kernels(kernels, "cuda")


# -------------------------------------------------------------------------------- 8. the warm cache and the docs
def test_the_warm_cache_report_counts_every_fused_kernel():
    """``benchmarks/warm_cache.py``'s ``KERNELS`` (what ``report`` counts as compiled on the device) names every
    Triton kernel of ``slake.kernels``; ``_layer_eviction_kernel`` was left out."""
    from benchmarks.warm_cache import KERNELS

    slake.kernels.load()
    found: dict[str, set[str]] = {}
    for info in pkgutil.iter_modules(slake.kernels.__path__):
        if not info.name.startswith("triton_"):
            continue
        module = importlib.import_module(f"slake.kernels.{info.name}")
        for name, value in vars(module).items():
            fn = getattr(value, "fn", None)  # a @triton.jit function (compiled or interpreted) wraps its Python one
            if name.endswith("_kernel") and fn is not None and getattr(fn, "__module__", None) == module.__name__:
                found.setdefault(module.__name__, set()).add(name)
    assert found["slake.kernels.triton_layer"] == {"_layer_eviction_kernel"}
    assert {m: set(names) for m, names in KERNELS.items()} == found


def test_the_results_readme_cites_only_modules_that_exist():
    """Every ``python -m MODULE`` in docs/results/README.md is a module of the checkout, and every ``python -m
    benchmarks COMMAND`` a command of it (``slake.engines.vllm.pool_bench`` is ``benchmarks pool-gpu`` now)."""
    from benchmarks.__main__ import parser

    text = (ROOT / "docs" / "results" / "README.md").read_text()
    commands = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for module, command in re.findall(r"python3? -m ([\w.]+)(?: ([a-z][\w-]*))?", text):
        path = module.replace(".", "/")
        where = [ROOT / "src" / path, ROOT / path]
        assert any(p.with_suffix(".py").exists() or (p / "__main__.py").exists() for p in where), module
        if module == "benchmarks":
            assert command in commands, command


def test_the_vllm_pool_says_why_auto_chose_torch(monkeypatch):
    """The vLLM pool's report carries ``auto``'s reason as the engine's cache does (it resolved the choice without
    keeping the reason). Only the device's type is read, so a patched choice stands in for a GPU without Triton."""
    from slake.engines.vllm.plugin import decode_pool

    monkeypatch.setattr(decode_pool, "kernel_choice", lambda kernels, device: ("torch", "Triton not installed"))
    pool = decode_pool.DecodePool(make_method("snapkv", window=4), 2, 2, 8, 10, 4, rows=2)
    assert pool.kernels == "torch" and pool.report.auto == "Triton not installed"
    monkeypatch.undo()  # the CPU's own choice: no reason to give
    assert decode_pool.DecodePool(make_method("snapkv", window=4), 2, 2, 8, 10, 4, rows=2).report.auto is None
