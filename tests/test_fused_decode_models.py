"""The fused decode kernels through a model: a tiny Llama decodes the same tokens with them as with the torch step,
static mode (CUDA graphs) prepares their row table, and ``slake generate --kernels triton`` runs them through Triton's
interpreter on a machine without CUDA. The kernels' step-level equality is in ``tests/test_fused_decode.py``; this
module loads transformers, so ``make test-oldest`` runs it (``tests/test_tiers.py``)."""

from __future__ import annotations

import pytest
import torch

#: where the kernels run: a GPU's compiled kernels where there is one, else the interpreter on CPU tensors
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_the_command_runs_the_kernels_through_the_interpreter_on_a_machine_without_cuda(tmp_path):
    """``slake generate --kernels triton`` in a fresh process with no ``TRITON_INTERPRET`` in its environment: the
    command loads the kernels while checking its arguments, before transformers imports Triton, so on a machine
    without CUDA the interpreter can still be switched on (it was refused after the model had loaded)."""
    import json
    import os
    import subprocess
    import sys

    from tiny_models import save_tiny_model

    save_tiny_model(tmp_path / "model")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    words = " ".join(f"w{i % 250 + 3}" for i in range(60))
    run = subprocess.run(
        [sys.executable, "-m", "slake.cli", "generate", "--model", str(tmp_path / "model"), "--method", "snapkv",
         "--budget", "16", "--set", "window=4", "--prompt", words, "--max-new-tokens", "3", "--kernels", "triton",
         "--json"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout)["kernels"] == "triton"


@pytest.mark.parametrize("name", ["slake", "tova", "criticalkv", "expected-attention"])
def test_a_tiny_model_decodes_the_same_tokens_with_the_fused_kernels(name, llama_gqa):
    """End to end through transformers (the registered attention function, the cache's update, a padded batch of
    two): greedy tokens and kept counts equal the torch step's, and the cache reports which implementation ran."""
    from compiled_decode import decode

    model = llama_gqa.to(DEVICE)
    ref, ref_stats, _ = decode(model, name, 6, static=False, kernels="torch")
    fused, stats, _ = decode(model, name, 6, static=False, kernels="triton")
    assert stats["kernels"] == "triton" and ref_stats["kernels"] == "torch"
    assert torch.equal(fused, ref)
    assert stats["kept_tokens_per_layer"] == ref_stats["kept_tokens_per_layer"]


def test_static_mode_makes_the_kernels_row_table_before_any_captured_step(llama_gqa):
    """The fused kernels' row table of every layer exists once static mode starts and is one of the static tensors:
    made lazily inside the first captured step instead, it was a CUDA graph's output that the next replay overwrote
    (found on an H100 by ``tests/test_cuda.py``)."""
    from compiled_decode import decode

    _, stats, cache = decode(llama_gqa.to(DEVICE), "snapkv", 1, static=True, kernels="triton")
    decoder = cache.compressor.decoder
    static = {id(t) for t in decoder.static_tensors()}
    for store in cache.compressor.layers:
        assert store._row_table is not None and id(store._row_table) in static
    assert stats["kernels"] == "triton"


@pytest.mark.parametrize("static", [True, False])
def test_the_full_cache_decodes_the_same_tokens_with_the_dense_kernels(llama_gqa, static):
    """The full cache with ``kernels="triton"``: a static cache's step (the whole store, masked) and the eager step
    of a batch whose second prompt is padded at the front (its valid slots are not a prefix) run the dense kernels
    that split the keys (:mod:`slake.kernels.triton_dense`) and decode the same tokens as the torch step; the cache
    reports them."""
    from compiled_decode import decode

    model = llama_gqa.to(DEVICE)
    ref, ref_stats, _ = decode(model, "full", 5, static=static, kernels="torch")
    fused, stats, _ = decode(model, "full", 5, static=static, kernels="triton")
    assert torch.equal(fused, ref)
    assert stats["kernels"] == "triton" and ref_stats["kernels"] == "torch"


def test_a_compiled_static_full_cache_captures_the_dense_kernels_in_its_graph(llama_gqa):
    """``torch.compile(fullgraph=True)`` of a static full cache's step with ``kernels="triton"``: the dense kernels
    are one operator in the graph (no break), once per layer and no SDPA beside it, and the compiled steps
    (``aot_eager`` runs the operator) decode the eager steps' tokens."""
    from compiled_decode import decode

    graphs: list[torch.fx.GraphModule] = []

    def recording(gm, example_inputs):  # the graph dynamo captured, then run as aot_eager runs it
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    model = llama_gqa.to(DEVICE)
    torch._dynamo.reset()
    try:
        eager, _, _ = decode(model, "full", 4, static=True, kernels="triton")
        compiled, _, _ = decode(model, "full", 4, static=True, kernels="triton", backend=recording)
    finally:
        torch._dynamo.reset()
    assert torch.equal(compiled, eager)
    assert graphs, "the step was not compiled"
    layers = model.config.num_hidden_layers
    for gm in graphs:
        targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        attention = [t for t in targets if "attention" in t]  # the op's and SDPA's names both say it
        dense = [t for t in attention if "slake.dense_decode_attention" in t]
        assert len(dense) == layers, attention
        assert not [t for t in attention if "scaled_dot_product_attention" in t], attention


@pytest.mark.parametrize(("static", "batch"), [(True, 2), (False, 2), (False, 1)])
def test_an_8bit_full_cache_decodes_the_same_tokens_with_the_dense_kernels(llama_gqa, static, batch):
    """The full cache with int8 kept entries and ``kernels="triton"``: the dense kernels read the codes and scales
    (eager too, a batch of one whose slots are one prefix included, where SDPA would dequantise the whole store
    every layer and step), and decode the torch step's tokens."""
    from compiled_decode import decode

    model = llama_gqa.to(DEVICE)
    ref, _, _ = decode(model, "full", 5, batch=batch, static=static, kernels="torch", kv_dtype="int8")
    fused, stats, _ = decode(model, "full", 5, batch=batch, static=static, kernels="triton", kv_dtype="int8")
    assert torch.equal(fused, ref)
    assert stats["kernels"] == "triton"
