"""Greedy decoding on a static SlakeCache, eager or through ``torch.compile``: shared by ``test_compile.py`` (CPU,
dynamo backends) and ``test_cuda.py`` (CUDA graphs)."""

from __future__ import annotations

import torch

from slake.engines.transformers.cache import SlakeCache
from slake.engines.transformers.cache_kwarg import with_cache
from slake.engines.transformers.generate import prefill
from tiny_models import random_ids, second_pass_ready

PROMPT = 40
BUDGET = 16


def hyper(method: str) -> dict:
    """tova and sagekv fix their own windows; the others get one small enough for a budget of 16."""
    return {} if method in ("tova", "sagekv", "full") else {"window": 4}


def prompt(batch: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` random prompts of ``PROMPT`` tokens; with two or more, the second is left-padded by 9 tokens."""
    ids = random_ids(PROMPT, seed=1, batch=batch).to(device)
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[1, :9] = 0
    return ids, mask


def decode(
    model,
    method: str,
    steps: int,
    batch: int = 2,
    backend=None,
    static: bool = True,
    kv_dtype=None,
    budget: int = BUDGET,
    mode: str | None = None,
    kernels: str = "auto",
    mark_static: bool = False,
):
    """Greedy decode ``steps`` tokens after the prompt, on the model's device; ``backend`` or ``mode``: run each step
    through ``torch.compile(fullgraph=True, dynamic=False, backend=..., mode=...)``; ``mark_static``: the cache's
    tensors marked as static inputs after the prefill, as ``prepare_static`` marks them on CUDA. Returns (tokens,
    statistics, cache)."""
    ids, mask = prompt(batch, model.device)
    cache = SlakeCache(
        method,
        budget,
        config=model.config,
        kv_dtype=kv_dtype,
        max_cache_len=PROMPT + steps + 1 if static else None,
        kernels=kernels,
        **hyper(method),
    )
    second_pass_ready(model, cache)
    with torch.inference_mode():
        tok = prefill(model, cache, ids, mask).argmax(-1, keepdim=True)
    if mark_static:
        for t in cache.compressor.static_tensors():
            torch._dynamo.mark_static_address(t)
    first_real = (mask == 0).sum(-1, keepdim=True)

    def step(tok, pos):
        out = model(input_ids=tok, position_ids=pos, **with_cache(model, cache), use_cache=True)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    if backend is None and mode is None:
        fn = step
    else:
        kw = {"backend": backend} if backend is not None else {}
        fn = torch.compile(step, fullgraph=True, dynamic=False, mode=mode, **kw)
    out = []
    with torch.inference_mode():
        for t in range(steps):
            tok = fn(tok, PROMPT + t - first_real).clone()  # a CUDA graph's output is overwritten by the next replay
            out.append(tok)
    return torch.cat(out, 1), cache.statistics(), cache
