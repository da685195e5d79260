"""The vLLM plugin's batched decode step on random tensors, without vLLM: a pool of compressed requests in a paged
cache (:func:`random_pool`, any device), and what its step costs on a CPU (:func:`pool_step_cpu_ms`) and on a GPU
(:func:`pool_step_cuda`, with :func:`full_attention_cuda` and :func:`weights_cuda`, the parts of a plain step that
compression does or does not change). The commands are ``python -m benchmarks pool-cpu`` and ``python -m benchmarks
pool-gpu`` (:mod:`benchmarks.__main__`); ``docs/serving.md`` and ``docs/gpu.md`` report what they measured.

A model's shape (layers, query and KV heads, head size; for the weights, hidden, MLP and vocabulary sizes) comes from
:func:`model_shape`: a shape name of :mod:`slake.engines.transformers.shapes` (``smollm2-135m``, ``llama3-8b``, with
overrides such as ``llama3-8b:num_hidden_layers=2``) or a model folder's ``config.json``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from slake.budgets.budget import Budget
from slake.engines.vllm.plugin.config import SlakeVllmConfig, with_layer_cap
from slake.engines.vllm.plugin.decode_pool import DecodePool
from slake.engines.vllm.plugin.paged import CpuAttnLayout, FlashAttnLayout, PagedLayout, slot_blocks
from slake.methods import Method, make_method

__all__ = [
    "ModelShape",
    "RandomPool",
    "full_attention_cuda",
    "kernel_parts_cuda",
    "kernel_tune_cuda",
    "model_shape",
    "pool_roofline",
    "pool_shape",
    "pool_step_cpu_ms",
    "pool_step_cuda",
    "random_pool",
    "weights_cuda",
]


@dataclass(frozen=True)
class ModelShape:
    """What the benchmarks need of a model's shape."""

    layers: int
    kv_heads: int
    #: query heads per KV head
    group: int
    head_dim: int
    hidden: int
    mlp: int
    vocab: int

    def attention(self) -> dict[str, int]:
        """The keyword arguments of :func:`random_pool` that describe the attention (layers, heads, head size)."""
        return {"layers": self.layers, "kv_heads": self.kv_heads, "group": self.group, "head_dim": self.head_dim}


def model_shape(spec: str) -> ModelShape:
    """The shape of a model: ``spec`` is a model folder (its ``config.json``) or a shape name of
    :data:`slake.engines.transformers.shapes.SHAPES` with optional overrides (``"llama3-8b:num_hidden_layers=2"``)."""
    if Path(spec, "config.json").is_file():
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(spec)
        cfg = (getattr(c, "text_config", None) or c).to_dict()
    else:
        from slake.engines.transformers.shapes import parse_shape

        cfg = parse_shape(spec)[1]
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    return ModelShape(
        layers=int(cfg["num_hidden_layers"]),
        kv_heads=kv_heads,
        group=heads // kv_heads,
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        hidden=int(cfg["hidden_size"]),
        mlp=int(cfg["intermediate_size"]),
        vocab=int(cfg["vocab_size"]),
    )


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
        """Layer ``li``'s decode step for every row: ``(R, Hq, d)`` (float32 from the torch step, the query's dtype from
        the fused kernels)."""
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
        """One decode step over all layers: ``(layers, R, Hq, d)``, in the dtype of :meth:`layer`'s."""
        newest = self.newest()
        return torch.stack([self.layer(li, newest) for li in range(len(self.kv))])


def pool_shape(method: str, budget: int, block_size: int) -> tuple[Method, int, int]:
    """The method as the plugin runs it (vLLM's layer cap), the slots ``W`` a request holds per layer
    (:meth:`SlakeVllmConfig.slots`: budget + 1; CAKE/SLAKE: the cap + 1) and the blocks they take."""
    m = with_layer_cap(make_method(method), Budget(budget))
    W = SlakeVllmConfig(method=m, budget=budget).slots()
    return m, W, -(-W // block_size)


def random_pool(
    method: str,
    *,
    layers: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    requests: int = 8,
    budget: int = 128,
    block_size: int = 32,
    kept: int | None = None,
    layout: PagedLayout | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    kernels: str = "auto",
) -> RandomPool:
    """``requests`` compressed requests of ``method`` at ``budget`` in a model of ``layers`` layers, ``kv_heads`` KV
    heads of ``group`` query heads and head size ``head_dim`` (:meth:`ModelShape.attention`), each layer holding
    ``kept`` slots (default: all but one of the ``W`` a request can hold, the widest case) with random keys, values
    and scores, in a paged cache of ``layout`` (default vLLM's CPU layout; :class:`FlashAttnLayout` in its default NHD
    memory order) on ``device``.

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
    pool = DecodePool(
        m, layers, kv_heads, head_dim, W, block_size, rows=requests, layout=layout, device=device, kernels=kernels
    )
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
    layers: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    requests: int = 8,
    budget: int = 128,
    steps: int = 50,
    check: int = 8,
    kept: int | None = None,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    block_size: int = 16,
    kernels: str = "auto",
    bandwidth: float | None = None,
) -> dict:
    """GPU milliseconds of one decode step of ``requests`` compressed requests over all layers, eager and replayed
    as one CUDA graph, and whether the graph computes what the eager step does.

    Two identical pools (:func:`random_pool`, FlashAttention layout) each run two warm-up steps; one then runs
    ``steps`` eager steps, the other is captured once and replayed ``steps`` times. The outputs of the first
    ``check`` steps and the kept positions and validity after the last must agree: ``graph_max_abs_diff`` (expected
    0: the same kernels on the same data) and ``graph_same_kept``. With ``bandwidth`` (bytes per second, e.g.
    :func:`slake.engines.transformers.roofline.copy_bandwidth`), the row also has the graphed step's roofline
    (:func:`pool_roofline`)."""
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
        kernels=kernels,
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
    roofline = {} if bandwidth is None else pool_roofline(eager.pool, requests, dtype, graph_ms, bandwidth)
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
        "kernels": eager.pool.report.summary(),
        **roofline,
    }


def kernel_parts_cuda(method: str, parts: list[str] | None = None, **pool: object) -> list[dict]:
    """What each part of the fused step's second kernel costs: :func:`pool_step_cuda` with the fused kernels as
    they are, then once with each of ``parts`` (default: every name of
    :data:`slake.kernels.launch_config.SKIP_PARTS`) left out (:func:`slake.kernels.launch_config.leaving_out`).

    A step without a part computes something else (its rows' outputs and kept slots are not the method's); what it
    tells is time: ``part_us_per_layer``, the step as it is less the step without the part, per layer (CUDA-graph
    replays of every layer, ``pool``: :func:`pool_step_cuda`'s keywords, ``kernels`` forced to ``"triton"``)."""
    from slake.kernels import launch_config

    names = list(launch_config.SKIP_PARTS) if parts is None else list(parts)
    pool = {**pool, "kernels": "triton"}
    whole = pool_step_cuda(method, **pool)  # type: ignore[arg-type]
    rows = [{"what": "kernel_parts", "method": method, "left_out": None, **_step_times(whole)}]
    for part in names:
        with launch_config.leaving_out(part):
            without = pool_step_cuda(method, **pool)  # type: ignore[arg-type]
        rows.append(
            {
                "what": "kernel_parts",
                "method": method,
                "left_out": part,
                **_step_times(without),
                "part_us_per_layer": round(whole["graph_us_per_layer"] - without["graph_us_per_layer"], 1),
            }
        )
    return rows


#: the launch constants ``kernel-tune`` tries by default (:func:`slake.kernels.launch_config.tuned`), one change
#: from the constants as they are at a time, then the two that read more at once together: the pieces the second
#: kernel combines per round of loads, the slots per block of the victim piece's second sum, 16 warps for wide rows
#: (28 bytes spilled at sm_90), and the first kernel's split of a row (more or fewer pieces for the second to combine);
#: then the positional pooling as it was before 2026-11-27's last change (int64 sort keys, through memory, both), to
#: time what that change gained
TUNE_VARIANTS: list[dict[str, int]] = [
    {"COMBINE": 8},
    {"RECOMPUTE_BLOCK": 32},
    {"RECOMPUTE_BLOCK": 64},
    {"COMBINE": 8, "RECOMPUTE_BLOCK": 64},
    {"WIDE_WARPS": 16},
    {"TARGET_PROGRAMS": 128},
    {"TARGET_PROGRAMS": 512},
    {"MIN_SPLIT": 128},
    {"SHORT_KEYS": 0},
    {"POOL_GATHER": 0},
    {"POOL_GATHER": 0, "SHORT_KEYS": 0},
    {"HELD_ORDER": 0},
    {"NEW_TOKEN_APART": 0},
]


def kernel_tune_cuda(method: str, variants: list[dict[str, int]] | None = None, **pool: object) -> list[dict]:
    """The fused step with other launch constants: :func:`pool_step_cuda` with the constants as they are, then with
    each of ``variants`` (default :data:`TUNE_VARIANTS`; :func:`slake.kernels.launch_config.tuned`). The constants
    change how the work is cut, not what is computed (``tests/test_fused_decode_launches.py`` holds the step with other
    constants equal to the torch step); each row keeps its graph's check against its eager step
    (``graph_same_kept``). ``vs_as_is``: the variant's graphed step over the step as it is (below 1: faster).
    ``pool``: :func:`pool_step_cuda`'s keywords, ``kernels`` forced to ``"triton"``."""
    from slake.kernels import launch_config

    pool = {**pool, "kernels": "triton"}
    whole = pool_step_cuda(method, **pool)  # type: ignore[arg-type]
    rows = [{"what": "kernel_tune", "method": method, "variant": {}, **_step_times(whole)}]
    for variant in TUNE_VARIANTS if variants is None else variants:
        with launch_config.tuned(**variant):
            row = pool_step_cuda(method, **pool)  # type: ignore[arg-type]
        rows.append(
            {
                "what": "kernel_tune",
                "method": method,
                "variant": dict(variant),
                **_step_times(row),
                "graph_same_kept": row["graph_same_kept"],
                "vs_as_is": round(row["graph_us_per_layer"] / whole["graph_us_per_layer"], 3),
            }
        )
    return rows


def _step_times(row: dict) -> dict:
    return {k: row[k] for k in ("budget", "requests", "slots", "graph_ms", "graph_us_per_layer", "kernels")}


def pool_roofline(pool: DecodePool, requests: int, dtype: torch.dtype, step_ms: float, bandwidth: float) -> dict:
    """The memory roofline of one decode step of ``requests`` rows of ``pool`` over all its layers: the bytes the
    step must read (every slot's key and value, in ``dtype``; the slots' metadata, positions, validity, scores, the
    slot weights of a two-stage rule and the fused step's slot order; SLAKE's linear state) at ``bandwidth`` bytes
    per second.

    Returns ``step_mb_per_layer``, ``bandwidth_gbs``, ``roofline_us_per_layer`` and ``vs_roofline`` (``step_ms``
    over the roofline; 1.0 is the memory's floor: a step far above it is bound by its kernels' latency and launches,
    not by what it reads)."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    if requests < 1:
        raise ValueError(f"requests must be >= 1, got {requests}")
    L, H, W, d = pool.num_layers, pool.kv_heads, pool.width, pool.head_dim
    meta, linear = pool.row_bytes()
    kv = L * H * W * 2 * d * torch.finfo(dtype).bits // 8
    per_layer = requests * (kv + meta + linear) / L
    floor_us = per_layer / bandwidth * 1e6
    return {
        "step_mb_per_layer": round(per_layer / 1e6, 3),
        "bandwidth_gbs": round(bandwidth / 1e9, 2),
        "roofline_us_per_layer": float(f"{floor_us:.4g}"),
        "vs_roofline": round(step_ms * 1e3 / L / floor_us, 2),
    }


def full_attention_cuda(
    *,
    layers: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    requests: int = 8,
    context: int = 2048,
    steps: int = 20,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    memory_gb: float = 24.0,
    impl: str = "sdpa",
) -> dict:
    """GPU milliseconds of a full cache's decode attention for one step over all layers: one
    ``scaled_dot_product_attention`` per layer (a single query per request over ``context`` dense keys and values),
    captured as one CUDA graph. Layers cycle over as many distinct caches as fit in ``memory_gb`` (at least two,
    each larger than the GPU's L2 at these sizes), so every call reads its cache from memory. ``read_tb_s``: the
    keys' and values' bytes over the time, against the GPU's memory bandwidth.

    ``impl="dense"``: the full cache's static step instead (:func:`slake.kernels.triton_dense.dense_attention`, the
    two kernels that split the keys, with a validity mask over a store 64 slots wider than ``context``), the
    attention a compiled full cache runs since 2026-11-28."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if impl not in ("sdpa", "dense"):
        raise ValueError(f"impl must be 'sdpa' or 'dense', got {impl!r}")
    width = context + (64 if impl == "dense" else 0)
    per_layer = requests * kv_heads * context * head_dim * 2 * torch.finfo(dtype).bits // 8
    n = max(2, min(layers, int(memory_gb * 1e9 // per_layer)))
    k = [torch.randn(requests, kv_heads, width, head_dim, device=device, dtype=dtype) for _ in range(n)]
    v = [torch.randn(requests, kv_heads, width, head_dim, device=device, dtype=dtype) for _ in range(n)]
    q = torch.randn(requests, kv_heads * group, 1, head_dim, device=device, dtype=dtype)
    valid = torch.zeros(requests, kv_heads, width, dtype=torch.bool, device=device)
    valid[..., :context] = True
    if impl == "dense":
        from slake.cache.compressed import resolve_kernels

        resolve_kernels("triton", device)
        from slake.kernels.triton_dense import dense_attention

        q3 = q.reshape(requests, kv_heads * group, head_dim)

        def step() -> torch.Tensor:
            scale = head_dim**-0.5
            none = valid.new_empty(0, dtype=torch.float32)
            return torch.stack(
                [dense_attention(q3, k[li % n], v[li % n], valid, none, none, scale) for li in range(layers)]
            )

    else:

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
        "what": "full_attention" if impl == "sdpa" else "full_attention_dense",
        "requests": requests,
        "context": context,
        "graph_ms": round(ms, 3),
        "kv_gb": round(per_layer * layers / 1e9, 2),
        "read_tb_s": round(per_layer * layers / (ms / 1000) / 1e12, 2),
    }


def weights_cuda(
    shape: ModelShape,
    *,
    requests: int = 8,
    steps: int = 20,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
) -> dict:
    """GPU milliseconds of a decode step's matrix products at batch ``requests`` for a model of ``shape`` (per layer:
    the fused query/key/value projection, the output projection, the fused gate/up projection and the down
    projection; then the output head), captured as one CUDA graph, on distinct random weights per layer: the weight
    reads that compression does not change."""
    layers, kv_heads, group, head_dim = shape.layers, shape.kv_heads, shape.group, shape.head_dim
    hidden, mlp, vocab = shape.hidden, shape.mlp, shape.vocab
    q_out = kv_heads * group * head_dim  # the hidden size for most shapes, not for all
    qkv = q_out + 2 * kv_heads * head_dim
    w = [
        (
            torch.randn(hidden, qkv, device=device, dtype=dtype),
            torch.randn(q_out, hidden, device=device, dtype=dtype),
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
            h = a[:, :q_out] @ wo
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


def pool_step_cpu_ms(method: str, *, steps: int = 10, cold: bool = False, **pool: object) -> float:
    """CPU milliseconds (``time.process_time``, this process) of the plugin's batched decode work for one step of
    compressed requests over all layers, on random tensors in vLLM's CPU layout: the plugin's own cost, free of
    vLLM's scheduling and of other processes' wall-clock noise (run with ``OMP_NUM_THREADS=1`` for one core's cost).

    ``pool``: :func:`random_pool`'s keyword arguments (the model's :meth:`ModelShape.attention`, ``requests``,
    ``budget``, ``block_size``, ``kept``). ``method`` may be a spec (``"slake[linear_cache=false]"``). Each layer is
    read at its width as the plugin does (:meth:`DecodePool.layer_widths`). ``cold``: before each layer, write a
    buffer larger than a server's last-level cache (outside the timed part), as the plugin finds its data inside
    vLLM, where each layer's weights pass through the cache in between; otherwise the pool's data may stay cached
    from one step to the next, which favours smaller pools. The median of ``steps`` steps, after two warm-up steps.
    """
    rp = random_pool(method, **pool)  # type: ignore[arg-type]
    flush = torch.zeros(64 * 2**20 // 4) if cold else None  # 64 MiB
    times = []
    for _ in range(steps + 2):
        newest = rp.newest()
        spent = 0.0
        for li in range(len(rp.kv)):
            if flush is not None:
                flush.add_(1.0)
            t0 = time.process_time()
            rp.layer(li, newest)
            spent += time.process_time() - t0
        times.append(spent)
    return statistics.median(times[2:]) * 1000
