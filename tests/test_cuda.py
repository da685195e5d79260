"""On a CUDA GPU (skipped elsewhere): compiled decoding replays as CUDA graphs and gives the eager tokens, in float32
and bfloat16, and the vLLM plugin's batched decode step replays as one CUDA graph with the eager step's results.

``docs/compile.md`` and ``docs/gpu.md`` say why each of these should hold; these tests check it on a real device.
"""

from __future__ import annotations

import pytest
import torch

from compiled_decode import BUDGET, PROMPT, decode
from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.generate import prefill
from tiny_models import random_ids, tiny_model

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("fresh_dynamo"),
]


def _decode(model, method: str, steps: int, compile_kw: dict | None, **kw) -> tuple[torch.Tensor, dict]:
    """:func:`compiled_decode.decode` on a left-padded batch of two (``compile_kw``: its ``backend``/``mode``);
    returns (tokens, statistics)."""
    tokens, stats, _ = decode(model, method, steps, **(compile_kw or {}), **kw)
    return tokens, stats


@pytest.mark.parametrize(
    "method",
    ["snapkv", "h2o", "tova", "cake", "slake", "lava", "ahakv", "sagekv", "slake[decode_eviction=false]",
     "ada-snapkv[decode_scope=layer]", "kvzip[keep_generated=true,decode_scope=layer]"],
)  # fmt: skip
def test_fused_kernels_give_the_torch_steps_tokens(method):
    """On CUDA the decode step runs as the fused Triton kernels by default (``kernels="auto"``): compiled for the GPU,
    not interpreted as in ``make test``. Eager, float32: the torch step's tokens and kept counts; for SLAKE set not to
    evict at decode, the kernels of a layer that keeps every slot (``KEEP_ALL``); across a layer's KV heads, the
    third kernel (``slake.kernels.triton_layer``)."""
    model = tiny_model("llama-gqa", layers=2).cuda()
    ref, ref_stats = _decode(model, method, 24, None, kernels="torch", static=False)
    fused, stats = _decode(model, method, 24, None, kernels="triton", static=False)
    assert stats["kernels"] == "triton" and ref_stats["kernels"] == "torch"
    assert torch.equal(fused, ref)
    assert stats["kept_tokens_per_layer"] == ref_stats["kept_tokens_per_layer"]


@pytest.mark.parametrize(
    "method", ["snapkv", "h2o", "tova", "cake", "slake", "keydiff", "kvzip[decode_scope=layer]", "criticalkv",
               "ada-snapkv[decode_scope=layer]"]
)  # fmt: skip
def test_rows_read_in_blocks_give_the_torch_steps_tokens(method, monkeypatch):
    """Rows wider than the second kernel's vectors are read in blocks (``slake.kernels.triton_wide``); with the
    threshold lowered to 16 slots and blocks of 16, the tiny model's rows take that form on the GPU (its barriers
    between the blocks' reads and writes first met there): the torch step's tokens and kept counts."""
    from slake.kernels import launch_config

    monkeypatch.setattr(launch_config, "WIDE_SLOTS", 16)
    monkeypatch.setattr(launch_config, "WIDE_BLOCK", 16)
    model = tiny_model("llama-gqa", layers=2).cuda()
    ref, ref_stats = _decode(model, method, 24, None, kernels="torch", static=False)
    fused, stats = _decode(model, method, 24, None, kernels="triton", static=False)
    assert stats["kernels"] == "triton"
    assert torch.equal(fused, ref)
    assert stats["kept_tokens_per_layer"] == ref_stats["kept_tokens_per_layer"]


@pytest.mark.parametrize("method", ["snapkv", "slake", "criticalkv"])
def test_cached_launches_give_the_tokens_of_launches_through_triton(method, monkeypatch):
    """On a GPU the fused kernels are launched through :mod:`slake.kernels.launch_cache` (Triton binds a launch's
    arguments once per key): eager decoding of a left-padded batch (rows that are views at offsets) gives the
    tokens and kept counts of launches that all go through ``kernel[grid](...)``, and most launches skipped the
    binding. CriticalKV adds the third kernel."""
    from slake.kernels import launch_cache, launch_config

    model = tiny_model("llama-gqa", layers=2).cuda()
    monkeypatch.setattr(launch_config, "CACHED_LAUNCH", False)
    ref, ref_stats = _decode(model, method, 24, None, kernels="triton", static=False)
    monkeypatch.setattr(launch_config, "CACHED_LAUNCH", True)
    hits = sum(launcher.hits for _, launcher in launch_cache._launchers.values())
    fused, stats = _decode(model, method, 24, None, kernels="triton", static=False)
    assert stats["kernels"] == "triton" and ref_stats["kernels"] == "triton"
    assert torch.equal(fused, ref)
    assert stats["kept_tokens_per_layer"] == ref_stats["kept_tokens_per_layer"]
    launches = sum(launcher.hits + launcher.misses for _, launcher in launch_cache._launchers.values())
    assert launches > 0 and sum(launcher.hits for _, launcher in launch_cache._launchers.values()) - hits > 24


@pytest.mark.parametrize("method", ["snapkv", "slake", "criticalkv"])
def test_held_steps_give_the_tokens_of_steps_made_afresh(method, monkeypatch):
    """Eager decoding on a GPU holds each layer's fused step (:class:`slake.kernels.held_step.HeldStep`): its launch
    arguments made once, CUDA tensors passed to Triton's launcher as their addresses, the scratch shared by the
    layers. A left-padded batch decodes the tokens and kept counts of steps that make all of it afresh
    (``HELD_STEP`` off), with the launches cached in both."""
    from slake.kernels import launch_config

    model = tiny_model("llama-gqa", layers=2).cuda()
    monkeypatch.setattr(launch_config, "HELD_STEP", False)
    ref, ref_stats = _decode(model, method, 24, None, kernels="triton", static=False)
    monkeypatch.setattr(launch_config, "HELD_STEP", True)
    held, stats = _decode(model, method, 24, None, kernels="triton", static=False)
    assert stats["kernels"] == "triton" and ref_stats["kernels"] == "triton"
    assert torch.equal(held, ref)
    assert stats["kept_tokens_per_layer"] == ref_stats["kept_tokens_per_layer"]


@pytest.mark.parametrize(
    "method", ["full", "snapkv", "h2o", "cake", "slake", "lava", "ahakv", "sagekv", "ada-snapkv[decode_scope=layer]"]
)
def test_decode_replayed_as_cuda_graphs_equals_eager(method):
    """Dynamo's CUDA-graph backend (no code generation: what a graph needs, static addresses and no host read-back)
    replays the decode step with the eager tokens and kept counts."""
    model = tiny_model("llama-gqa", layers=2).cuda()
    eager, eager_stats = _decode(model, method, 24, None)
    graphed, stats = _decode(model, method, 24, {"backend": "cudagraphs"})
    assert torch.equal(graphed, eager)
    assert stats["kept_tokens_per_layer"] == eager_stats["kept_tokens_per_layer"]


def test_slake_reduce_overhead_equals_eager():
    """What ``--compile`` runs on CUDA (inductor with CUDA graphs, ``mode="reduce-overhead"``) gives SLAKE's eager
    tokens in float32."""
    model = tiny_model("llama-gqa", layers=2).cuda()
    eager, eager_stats = _decode(model, "slake", 16, None)
    compiled, stats = _decode(model, "slake", 16, {"mode": "reduce-overhead"})
    assert torch.equal(compiled, eager)
    assert stats["kv_bytes"] == eager_stats["kv_bytes"]


@pytest.mark.parametrize("method", ["full", "cake", "slake"])
def test_bfloat16_decode_replayed_as_cuda_graphs_equals_eager(method):
    """In bfloat16 the fold upcasts the victims' rows to the float32 linear state inside the graph: replayed as CUDA
    graphs (no code generation) the step gives the eager tokens. The full cache's static step runs the dense
    kernels over its whole store (:mod:`slake.kernels.triton_dense`), captured and replayed alike."""
    model = tiny_model("llama-gqa", layers=2).to("cuda", torch.bfloat16)
    eager, eager_stats = _decode(model, method, 24, None)
    graphed, stats = _decode(model, method, 24, {"backend": "cudagraphs"})
    assert torch.equal(graphed, eager)
    assert stats["kept_tokens_per_layer"] == eager_stats["kept_tokens_per_layer"]


def test_a_hybrid_models_decode_replayed_as_cuda_graphs_equals_eager():
    """Gemma 3's sliding-window layers as rings (``WindowLayer``) in CUDA graphs (dynamo's backend: no code
    generation, so seconds): 24 steps wrap the 16-slot windows; the dynamic cache's tokens, with the fused kernels
    in the compressed layers."""
    from hybrid_models import hybrid_model

    model = hybrid_model("gemma3").cuda()
    eager, _ = _decode(model, "slake", 24, None, static=False)
    graphed, _ = _decode(model, "slake", 24, {"backend": "cudagraphs"})
    assert torch.equal(graphed, eager)


def test_bfloat16_reduce_overhead_keeps_the_eager_budget():
    """Inductor fuses bfloat16 operations and rounds their intermediates differently from eager (each eager
    operation rounds its output to bfloat16), so compiled bfloat16 tokens may part from eager ones after a few steps
    (they did at the 8th token on an H100), as with any compiled bfloat16 model. What must hold: the first token (one
    step from the same cache) and the cache's sizes."""
    model = tiny_model("llama-gqa", layers=2).to("cuda", torch.bfloat16)
    eager, eager_stats = _decode(model, "slake", 16, None)
    compiled, stats = _decode(model, "slake", 16, {"mode": "reduce-overhead"})
    assert torch.equal(compiled[:, :1], eager[:, :1])
    assert stats["kv_bytes"] == eager_stats["kv_bytes"]
    assert stats["kept_tokens_per_layer"] == eager_stats["kept_tokens_per_layer"]


def test_bench_compiled_step_feeds_its_token_back():
    """``slake bench --compile`` on CUDA: each step's token is the next step's input. Before the fix, the second
    replay raised "accessing tensor output of CUDAGraphs that has been overwritten" (found on an H100)."""
    from slake.engines.transformers.measure import _step, compiled_step

    model = tiny_model("llama-gqa", layers=2).cuda()
    ids = random_ids(PROMPT, seed=1).cuda()

    def run(compiled: bool) -> torch.Tensor:
        cache = SlakeCache("slake", BUDGET, config=model.config, max_cache_len=PROMPT + 8, window=4)
        with torch.inference_mode():
            tok = prefill(model, cache, ids, torch.ones_like(ids)).argmax(-1, keepdim=True)
            step = compiled_step(model, cache) if compiled else (lambda t: _step(model, cache, t))
            tokens = []
            for _ in range(6):
                tok = step(tok)
                tokens.append(tok)
        return torch.cat(tokens, 1)

    assert torch.equal(run(True), run(False))


@pytest.mark.parametrize("method", ["streamingllm", "snapkv", "tova", "h2o", "cake", "slake"])
def test_pool_step_replays_as_one_cuda_graph(method):
    """The vLLM plugin's batched decode step over all layers, captured once as a CUDA graph and replayed, computes
    exactly what the eager step computes (same kernels, same data) and keeps the same slots."""
    from benchmarks.pool import pool_step_cuda

    row = pool_step_cuda(
        method, requests=3, budget=24, steps=2, check=6, layers=2, kv_heads=2, group=2, head_dim=16, block_size=16
    )
    assert row["graph_max_abs_diff"] == 0.0
    assert row["graph_same_kept"]


def test_unmasked_decode_attention_runs_without_cudnn():
    """The eager full cache's unmasked step (``sdpa_step`` with ``valid=None``, its slots one prefix) runs with
    cuDNN's backend off: on an H200 PyTorch picked cuDNN's flash forward, which does not split the keys and builds a
    plan for every new key length (104 ms per token at 8K against the masked call's 44). Batch 1, Llama-3-8B's
    heads, bfloat16: no cuDNN kernel runs, the output is the masked call's over the same slots, and cuDNN is enabled
    again after the call."""
    from torch.profiler import ProfilerActivity, profile

    from slake.cache.decode_step import sdpa_step

    torch.manual_seed(0)
    R, H, g, n, d = 1, 8, 4, 4096, 128
    query = torch.randn(R, H * g, d, device="cuda")
    keys = torch.randn(R, H, n + 64, d, device="cuda", dtype=torch.bfloat16)  # free slots after the prefix
    values = torch.randn(R, H, n + 64, d, device="cuda", dtype=torch.bfloat16)
    valid = torch.zeros(R, H, n + 64, dtype=torch.bool, device="cuda")
    valid[..., :n] = True
    before = torch.backends.cuda.cudnn_sdp_enabled()
    sdpa_step(query, keys[:, :, :n], values[:, :, :n], None, d**-0.5)  # warm-up: kernels load outside the profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = sdpa_step(query, keys[:, :, :n], values[:, :, :n], None, d**-0.5)
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages()]
    assert names and not [k for k in names if "cudnn" in k.lower()], names
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    masked = sdpa_step(query, keys, values, valid, d**-0.5)
    torch.testing.assert_close(out, masked, rtol=2e-2, atol=2e-2)


def test_dense_attention_compiled_for_the_gpu_equals_masked_sdpa():
    """The full cache's masked step over a static store (:func:`slake.kernels.triton_dense.dense_attention`),
    compiled for the GPU with half-precision dot products, at Llama-3-8B's heads and batch 1 (rows split over
    programs): the output of SDPA with the validity as its mask, in float32, within bfloat16's rounding."""
    from slake.cache.compressed import resolve_kernels

    resolve_kernels("triton", "cuda")
    from slake.kernels.triton_dense import dense_attention

    torch.manual_seed(0)
    R, H, g, n, d = 1, 8, 4, 4096 + 64, 128
    query = torch.randn(R, H * g, d, device="cuda", dtype=torch.bfloat16)
    keys = torch.randn(R, H, n, d, device="cuda", dtype=torch.bfloat16)
    values = torch.randn(R, H, n, d, device="cuda", dtype=torch.bfloat16)
    valid = torch.zeros(R, H, n, dtype=torch.bool, device="cuda")
    valid[..., :4001] = True  # a static store's slots after the newest token are empty
    none = torch.empty(0, device="cuda")
    out = dense_attention(query, keys, values, valid, none, none, d**-0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        query.float().reshape(R, H, g, d), keys.float(), values.float(), attn_mask=valid[:, :, None, :], scale=d**-0.5
    ).reshape(R, H * g, d)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_the_full_attention_benchmark_times_the_dense_kernels_beside_sdpa():
    """``python -m benchmarks pool-gpu --kernels triton`` times the full cache's static attention (the dense kernels)
    beside plain SDPA, each captured as one CUDA graph: both rows come out, with the same bytes read."""
    from benchmarks.pool import full_attention_cuda

    shape = dict(layers=2, kv_heads=2, group=2, head_dim=64, requests=1, context=4096, steps=2)
    sdpa = full_attention_cuda(**shape, impl="sdpa")
    dense = full_attention_cuda(**shape, impl="dense")
    assert sdpa["what"] == "full_attention" and dense["what"] == "full_attention_dense"
    assert dense["kv_gb"] == sdpa["kv_gb"] and dense["graph_ms"] > 0
    with pytest.raises(ValueError, match="impl"):
        full_attention_cuda(**shape, impl="flash")


@pytest.mark.parametrize("method", ["full", "h2o", "slake"])
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_8bit_rows_give_the_torch_steps_tokens_with_the_kernels(method, kv_dtype):
    """8-bit kept entries on CUDA: the fused step's first kernel runs unpipelined for them (no register spill on
    sm_90), and the full cache's dense kernels read their codes and scales; eager, float32, a left-padded batch:
    the torch step's tokens and kept counts."""
    model = tiny_model("llama-gqa", layers=2).cuda()
    ref, ref_stats = _decode(model, method, 16, None, kernels="torch", static=False, kv_dtype=kv_dtype)
    fused, stats = _decode(model, method, 16, None, kernels="triton", static=False, kv_dtype=kv_dtype)
    assert stats["kernels"] == "triton" and ref_stats["kernels"] == "torch"
    assert torch.equal(fused, ref)
    assert stats["kept_tokens_per_layer"] == ref_stats["kept_tokens_per_layer"]


@pytest.mark.parametrize("method", ["full", "slake"])
def test_fp8_rows_through_their_bits_give_the_conversions_tokens(method, monkeypatch):
    """The fp8 path of GPUs without Triton's e4m3 conversion (an A100's: ``QUANT`` 3, integer arithmetic on the
    codes' bits, ``slake.kernels.device_support``), run on this GPU: the same tokens and kept counts as the torch
    step, as the conversion's path gives."""
    from slake.kernels import device_support

    monkeypatch.setattr(device_support, "FP8_BITS", True)
    model = tiny_model("llama-gqa", layers=2).cuda()
    ref, ref_stats = _decode(model, method, 16, None, kernels="torch", static=False, kv_dtype="fp8_e4m3")
    fused, stats = _decode(model, method, 16, None, kernels="triton", static=False, kv_dtype="fp8_e4m3")
    assert stats["kernels"] == "triton"
    assert torch.equal(fused, ref)
    assert stats["kept_tokens_per_layer"] == ref_stats["kept_tokens_per_layer"]


def test_a_kernel_beyond_the_gpus_shared_memory_runs_unpipelined():
    """The full cache's dense attention over float32 rows of 256 dims (Gemma 3's heads) takes 282,688 bytes of
    shared memory pipelined for ``sm_90`` (``tests/kernel_aot.py``), beyond an H100's 232,448: Triton refuses the
    launch (``out of resource: shared memory``), and :func:`slake.kernels.launch_cache.fitting` launches it again
    unpipelined, from then on. The output equals masked SDPA's."""
    import torch.nn.functional as F

    from slake.cache.compressed import resolve_kernels
    from slake.kernels import launch_cache

    resolve_kernels("triton", "cuda")
    from slake.kernels import triton_dense

    g = torch.Generator(device="cuda").manual_seed(0)
    R, Hq, H, W, d = 1, 8, 2, 4136, 256
    query = torch.randn(R, Hq, d, device="cuda", generator=g)
    keys, values = (torch.randn(R, H, W, d, device="cuda", generator=g) for _ in range(2))
    valid = torch.rand(R, H, W, device="cuda", generator=g) > 0.1
    empty = torch.empty(0, device="cuda")
    for _ in range(2):  # the second launch takes the unpipelined constants at once
        out = triton_dense.dense_attention(query, keys, values, valid, empty, empty, d**-0.5)
    q = query.reshape(R, H, Hq // H, d)
    ref = F.scaled_dot_product_attention(q, keys, values, attn_mask=valid[:, :, None, :], scale=d**-0.5)
    torch.testing.assert_close(out, ref.reshape(R, Hq, d), rtol=1e-4, atol=1e-4)
    refitted = launch_cache._refitted.get(id(triton_dense._dense_partials_kernel), {})
    assert [c["num_stages"] for c in refitted.values()] == [1]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("method", ["full", "slake"])
def test_a_model_on_the_second_gpu_decodes_with_the_kernels(method):
    """A model on ``cuda:1`` while ``cuda:0`` is current (a layer a split model keeps on its second GPU): Triton
    launches on the current device, so each step's launches run under the layer's own
    (``slake.kernels.device_support.launch_device``); the torch step's tokens."""
    assert torch.cuda.current_device() == 0
    model = tiny_model("llama-gqa", layers=2).to("cuda:1")
    ref, _ = _decode(model, method, 16, None, kernels="torch", static=False, kv_dtype="int8")
    fused, stats = _decode(model, method, 16, None, kernels="triton", static=False, kv_dtype="int8")
    assert stats["kernels"] == "triton"
    assert torch.equal(fused, ref)


def _split_decode(method: str, kernels: str, devices: list[str], steps: int = 6):
    """Prefill and decode a :class:`~slake.cache.compressed.CompressedKV` whose layer ``i`` is on ``devices[i]`` (a
    model split over devices), on random tensors; returns (the outputs on the CPU, the kernel report's summary,
    the kept tokens per layer)."""
    from slake.cache.compressed import CompressedKV

    B, Hq, H, S, d = 2, 4, 2, 80, 16
    g = torch.Generator().manual_seed(0)
    cache = CompressedKV(method, 48, num_layers=len(devices), kernels=kernels)
    for layer, dev in enumerate(devices):
        q, k, v = (torch.randn(B, n, S, d, generator=g).to(dev) for n in (Hq, H, H))
        cache.prefill_layer(layer, q, k, v, None, d**-0.5)
    outs = []
    for _ in range(steps):
        for layer, dev in enumerate(devices):
            q, k, v = (torch.randn(B, n, 1, d, generator=g).to(dev) for n in (Hq, H, H))
            cache.append(layer, k, v)
            outs.append(cache.decode_attention(layer, q, d**-0.5).float().cpu())
    return torch.stack(outs), cache.decoder.report.summary(), cache.kept_tokens_per_layer()


@pytest.mark.parametrize("method", ["snapkv", "slake"])
def test_auto_runs_the_kernels_on_the_gpu_layers_of_a_model_whose_first_layer_is_on_the_cpu(method):
    """``kernels="auto"`` chooses again at the first layer on a GPU (``CompressedKV.kernel_choice_due``): with the
    first layer's cache on the CPU and the second's on the GPU, the GPU layer runs the fused kernels and the CPU one
    the torch step, which says why; the outputs and kept counts of the torch step everywhere."""
    ref, ref_summary, ref_kept = _split_decode(method, "torch", ["cpu", "cuda"])
    out, summary, kept = _split_decode(method, "auto", ["cpu", "cuda"])
    assert ref_summary == "torch"
    assert summary == "torch+triton (fallback: a layer on the cpu (the kernels launch on GPUs))"
    assert kept == ref_kept
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_model_split_over_two_gpus_decodes_with_the_kernels():
    """Layers on ``cuda:0`` and ``cuda:1``: each reads its own copy of the prefill facts, and the fused steps give
    the torch step's outputs."""
    ref, _, ref_kept = _split_decode("slake", "torch", ["cuda:0", "cuda:1"])
    out, summary, kept = _split_decode("slake", "triton", ["cuda:0", "cuda:1"])
    assert summary == "triton" and kept == ref_kept
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
