"""The plugin's batched decode step on random tensors: a pool of compressed requests (any device), and its GPU timing.

:func:`random_pool` builds the decode pool of ``R`` compressed requests in a paged cache, with no vLLM engine; the
CPU benchmark (:func:`slake.engines.vllm.bench.pool_step_cpu_ms`) and the GPU one below time its step.

``python -m slake.engines.vllm.pool_bench --methods snapkv,slake --requests 8,32 --contexts 2048,8192,32768``
measures, on random tensors and without vLLM (``docs/gpu.md``, "Measured on an H100"):

* the compressed requests' decode work of one step over all layers
  (:meth:`slake.engines.vllm.plugin.decode_pool.DecodePool.decode_layer`
  in vLLM's FlashAttention layout, :class:`slake.engines.vllm.plugin.paged.FlashAttnLayout`), launched eagerly and
  replayed as one
  CUDA graph captured over the whole step; the graph's outputs and kept slots are checked against the eager run's;
* what a full cache's decode costs per step at the same batch: one fused attention call per layer
  (``torch.nn.functional.scaled_dot_product_attention``, FlashAttention or memory-efficient kernel) over a dense cache
  of ``context`` tokens, also replayed as a CUDA graph: a lower bound for vLLM's paged kernel, which reads the same
  bytes through a block table;
* the step's weight reads, as the model's matrix products at this batch (``weights_ms``), the part of a decode step
  that compression does not change.

The default shape is Llama-3-8B's (32 layers, 32 query and 8 KV heads of dimension 128, bf16, vLLM's GPU block size
of 16). Nothing here is used by the plugin; the CPU counterpart is
:func:`slake.engines.vllm.bench.pool_step_cpu_ms`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

from slake.engines.vllm.plugin.decode_pool import DecodePool
from slake.engines.vllm.plugin.paged import CpuAttnLayout, FlashAttnLayout, PagedLayout, slot_blocks

__all__ = ["RandomPool", "full_attention_cuda", "pool_step_cuda", "random_pool", "weights_cuda"]

#: Llama-3-8B: layers, query heads per KV head, KV heads, head dimension, hidden and MLP sizes, vocabulary
LLAMA3_8B = dict(layers=32, group=4, kv_heads=8, head_dim=128, hidden=4096, mlp=14336, vocab=128256)


@dataclass
class RandomPool:
    """A :class:`DecodePool` of ``R`` compressed requests at their kept size, with their paged caches and one
    step's inputs, on random tensors (:func:`random_pool`)."""

    pool: DecodePool
    kv: list[torch.Tensor]
    rows: torch.Tensor
    table: torch.Tensor
    blocks: torch.Tensor
    offsets: torch.Tensor
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    widths: list[int]
    scaling: float

    def newest(self) -> torch.Tensor:
        """The rows' next positions ``(R, 1, 1)``, counted on the device as the plugin's builder does."""
        newest = self.pool.seen.index_select(0, self.rows).view(-1, 1, 1)
        self.pool.seen.index_add_(0, self.rows, torch.ones_like(self.rows))
        return newest

    def layer(self, li: int, newest: torch.Tensor) -> torch.Tensor:
        """Layer ``li``'s decode step for every row: ``(R, Hq, d)`` float32."""
        R = self.rows.shape[0]
        return self.pool.decode_layer(
            li,
            slice(0, R),
            self.table,
            self.blocks,
            self.offsets,
            newest,
            self.query,
            self.key,
            self.value,
            self.kv[li],
            self.scaling,
            self.widths[li],
        )

    def step(self) -> torch.Tensor:
        """One decode step over all layers: ``(layers, R, Hq, d)`` float32."""
        newest = self.newest()
        return torch.stack([self.layer(li, newest) for li in range(len(self.kv))])


def pool_shape(method: str, budget: int, block_size: int) -> tuple:
    """The method as the plugin runs it (vLLM's layer cap), the slots ``W`` a request holds per layer (budget + 1;
    CAKE/SLAKE: the cap + 1) and the blocks they take."""
    from slake.budgets.budget import Budget
    from slake.engines.vllm.plugin.config import PREFERENCE_METHODS, with_layer_cap
    from slake.methods import make_method

    m = with_layer_cap(make_method(method), Budget(budget))
    W = (2 * budget if m.name in PREFERENCE_METHODS else budget) + 1  # m.name: a spec "slake[...]" is slake
    return m, W, -(-W // block_size)


def random_pool(
    method: str,
    *,
    requests: int = 8,
    budget: int = 128,
    layers: int = 30,
    kv_heads: int = 3,
    group: int = 3,
    head_dim: int = 64,
    block_size: int = 32,
    kept: int | None = None,
    layout: PagedLayout | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> RandomPool:
    """``requests`` compressed requests of ``method`` at ``budget``, each layer holding ``kept`` slots (default: all
    but one of the ``W`` a request can hold, the widest case) with random keys, values and scores, in a paged cache of
    ``layout`` (default vLLM's CPU layout; :class:`FlashAttnLayout` in its default NHD memory order) on ``device``.

    Every random tensor is drawn on the CPU from ``seed`` and then moved, so two calls with the same arguments give
    the same pool on any device."""
    layout = CpuAttnLayout() if layout is None else layout
    g = torch.Generator().manual_seed(seed)
    m, W, nb = pool_shape(method, budget, block_size)
    n = W - 1 if kept is None else int(kept)
    if not 1 <= n < W:
        raise ValueError(f"kept must be in [1, {W - 1}] for {method} at budget {budget}, got {kept}")
    blocks_total = requests * nb + 1

    def cache() -> torch.Tensor:
        if isinstance(layout, FlashAttnLayout):  # vLLM's default NHD order: a strided (blocks, Hkv, bs, 2d) view
            x = torch.randn(blocks_total, block_size, kv_heads, 2 * head_dim, generator=g)
            return x.to(device=device, dtype=dtype).permute(0, 2, 1, 3)
        x = torch.randn(blocks_total, kv_heads, block_size, 2 * head_dim, generator=g)
        return x.to(device=device, dtype=dtype)

    kv = [cache() for _ in range(layers)]
    pool = DecodePool(m, layers, kv_heads, head_dim, W, block_size, rows=requests, layout=layout, device=device)
    rows = [pool.allocate(16 * budget, budget) for _ in range(requests)]
    pool.valid[:, :, :, :n] = True
    pool.positions[:, :, :, :n] = torch.arange(n, device=device)
    pool.scores[:, :, :, :n] = torch.rand(layers, requests, kv_heads, n, generator=g).to(device)
    pool.target[:] = n
    for r in rows:
        pool.row_widths[r] = [n + 1] * layers
    table = torch.arange(1, requests * nb + 1, device=device).view(requests, nb)
    blocks, offsets = slot_blocks(table, W, block_size)
    return RandomPool(
        pool=pool,
        kv=kv,
        rows=torch.tensor(rows, device=device),
        table=table,
        blocks=blocks,
        offsets=offsets,
        query=torch.randn(requests, kv_heads * group, head_dim, generator=g).to(device=device, dtype=dtype),
        key=torch.randn(requests, kv_heads, head_dim, generator=g).to(device=device, dtype=dtype),
        value=torch.randn(requests, kv_heads, head_dim, generator=g).to(device=device, dtype=dtype),
        widths=pool.layer_widths(rows),
        scaling=head_dim**-0.5,
    )


def _events_ms(fn: Callable[[], object], n: int) -> float:
    """Milliseconds per call of ``fn`` over ``n`` calls, timed with CUDA events (the GPU's time, not the host's)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def _capture(fn: Callable[[], torch.Tensor], warmup: int = 2) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``fn`` run ``warmup`` times on a side stream (as capture requires), then captured: the graph and its output."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def pool_step_cuda(
    method: str,
    *,
    requests: int = 8,
    budget: int = 128,
    steps: int = 50,
    check: int = 8,
    kept: int | None = None,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    block_size: int = 16,
    layers: int = LLAMA3_8B["layers"],
    kv_heads: int = LLAMA3_8B["kv_heads"],
    group: int = LLAMA3_8B["group"],
    head_dim: int = LLAMA3_8B["head_dim"],
) -> dict:
    """GPU milliseconds of one decode step of ``requests`` compressed requests over all layers, eager and replayed
    as one CUDA graph, and whether the graph computes what the eager step does.

    Two identical pools (:func:`random_pool`, FlashAttention layout) each run two warm-up steps; one then runs
    ``steps`` eager steps, the other is captured once and replayed ``steps`` times. The outputs of the first
    ``check`` steps and the kept positions and validity after the last must agree: ``graph_max_abs_diff`` (expected
    0: the same kernels on the same data) and ``graph_same_kept``."""
    shape = dict(
        requests=requests,
        budget=budget,
        layers=layers,
        kv_heads=kv_heads,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        kept=kept,
        layout=FlashAttnLayout(),
        device=device,
        dtype=dtype,
    )
    eager, graphed = random_pool(method, **shape), random_pool(method, **shape)  # type: ignore[arg-type]
    with torch.inference_mode():
        for _ in range(2):
            eager.step()
        outs_e = [eager.step().clone() for _ in range(check)]
        eager_ms = _events_ms(eager.step, steps)
        graph, out = _capture(graphed.step)
        outs_g = []
        for _ in range(check):
            graph.replay()
            outs_g.append(out.clone())
        graph_ms = _events_ms(graph.replay, steps)
    diff = max(float((a - b).abs().max()) for a, b in zip(outs_e, outs_g, strict=True))
    same = bool(
        torch.equal(eager.pool.positions, graphed.pool.positions) and torch.equal(eager.pool.valid, graphed.pool.valid)
    )
    W = eager.pool.width
    kept_bytes = layers * requests * kv_heads * W * 2 * head_dim * torch.finfo(dtype).bits // 8
    return {
        "what": "pool",
        "method": method,
        "budget": budget,
        "requests": requests,
        "slots": W,
        "eager_ms": round(eager_ms, 3),
        "graph_ms": round(graph_ms, 3),
        "graph_us_per_layer": round(graph_ms * 1000 / layers, 1),
        "kept_cache_mb": round(kept_bytes / 1e6, 1),
        "graph_max_abs_diff": diff,
        "graph_same_kept": same,
    }


def full_attention_cuda(
    *,
    requests: int = 8,
    context: int = 2048,
    steps: int = 20,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    layers: int = LLAMA3_8B["layers"],
    kv_heads: int = LLAMA3_8B["kv_heads"],
    group: int = LLAMA3_8B["group"],
    head_dim: int = LLAMA3_8B["head_dim"],
    memory_gb: float = 24.0,
) -> dict:
    """GPU milliseconds of a full cache's decode attention for one step over all layers: one
    ``scaled_dot_product_attention`` per layer (a single query per request over ``context`` dense keys and values),
    captured as one CUDA graph. Layers cycle over as many distinct caches as fit in ``memory_gb`` (at least two,
    each larger than the GPU's L2 at these sizes), so every call reads its cache from memory. ``read_tb_s``: the
    keys' and values' bytes over the time, against the GPU's memory bandwidth."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    per_layer = requests * kv_heads * context * head_dim * 2 * torch.finfo(dtype).bits // 8
    n = max(2, min(layers, int(memory_gb * 1e9 // per_layer)))
    k = [torch.randn(requests, kv_heads, context, head_dim, device=device, dtype=dtype) for _ in range(n)]
    v = [torch.randn(requests, kv_heads, context, head_dim, device=device, dtype=dtype) for _ in range(n)]
    q = torch.randn(requests, kv_heads * group, 1, head_dim, device=device, dtype=dtype)

    def step() -> torch.Tensor:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            outs = [
                torch.nn.functional.scaled_dot_product_attention(q, k[li % n], v[li % n], enable_gqa=True)
                for li in range(layers)
            ]
        return torch.stack(outs)

    with torch.inference_mode():
        graph, _ = _capture(step)
        ms = _events_ms(graph.replay, steps)
    return {
        "what": "full_attention",
        "requests": requests,
        "context": context,
        "graph_ms": round(ms, 3),
        "kv_gb": round(per_layer * layers / 1e9, 2),
        "read_tb_s": round(per_layer * layers / (ms / 1000) / 1e12, 2),
    }


def weights_cuda(
    *,
    requests: int = 8,
    steps: int = 20,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    layers: int = LLAMA3_8B["layers"],
    kv_heads: int = LLAMA3_8B["kv_heads"],
    group: int = LLAMA3_8B["group"],
    head_dim: int = LLAMA3_8B["head_dim"],
    hidden: int = LLAMA3_8B["hidden"],
    mlp: int = LLAMA3_8B["mlp"],
    vocab: int = LLAMA3_8B["vocab"],
) -> dict:
    """GPU milliseconds of a decode step's matrix products at batch ``requests`` (per layer: the fused query/key/value
    projection, the output projection, the fused gate/up projection and the down projection; then the output
    head), captured as one CUDA graph, on distinct random weights per layer: the weight reads that compression does
    not change."""
    qkv = hidden + 2 * kv_heads * head_dim
    w = [
        (
            torch.randn(hidden, qkv, device=device, dtype=dtype),
            torch.randn(kv_heads * group * head_dim, hidden, device=device, dtype=dtype),
            torch.randn(hidden, 2 * mlp, device=device, dtype=dtype),
            torch.randn(mlp, hidden, device=device, dtype=dtype),
        )
        for _ in range(layers)
    ]
    head = torch.randn(hidden, vocab, device=device, dtype=dtype)
    x = torch.randn(requests, hidden, device=device, dtype=dtype)

    def step() -> torch.Tensor:
        h = x
        for wq, wo, wu, wd in w:
            a = h @ wq
            h = a[:, :hidden] @ wo
            u = h @ wu
            h = u[:, :mlp] @ wd
        return h @ head

    with torch.inference_mode():
        graph, _ = _capture(step)
        ms = _events_ms(graph.replay, steps)
    params = sum(t.numel() for layer in w for t in layer) + head.numel()
    return {
        "what": "weights",
        "requests": requests,
        "graph_ms": round(ms, 3),
        "params_b": round(params / 1e9, 2),
        "read_tb_s": round(params * torch.finfo(dtype).bits / 8 / (ms / 1000) / 1e12, 2),
    }


def main(argv: list[str] | None = None) -> None:
    """Print one JSON line per measurement (:func:`weights_cuda`, :func:`full_attention_cuda` per batch and context,
    :func:`pool_step_cuda` per batch and method)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m slake.engines.vllm.pool_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="snapkv,cake,slake")
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--requests", default="8,32", help="comma-separated batch sizes")
    ap.add_argument("--contexts", default="2048,8192,32768", help="full cache: comma-separated context lengths")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("pool_bench: CUDA is not available (this benchmark measures a GPU; see docs/gpu.md)")
    info = {"what": "device", "name": torch.cuda.get_device_name(a.device), "torch": torch.__version__}
    print(json.dumps(info), flush=True)
    for r in (int(x) for x in a.requests.split(",")):
        print(json.dumps(weights_cuda(requests=r, device=a.device)), flush=True)
        torch.cuda.empty_cache()
        for c in (int(x) for x in a.contexts.split(",")):
            print(json.dumps(full_attention_cuda(requests=r, context=c, device=a.device)), flush=True)
            torch.cuda.empty_cache()
        for m in a.methods.split(","):
            row = pool_step_cuda(m, requests=r, budget=a.budget, steps=a.steps, device=a.device)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
