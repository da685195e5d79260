"""The load client: streaming ``/v1/completions`` requests of token-id prompts through the ``openai`` package
(installed with vLLM), at most C in flight.

Each request asks for exactly ``max_tokens`` tokens (``ignore_eos``), greedily, streamed, with vLLM's
``return_token_ids`` so that every chunk says how many tokens it carries. Times are taken as ``vllm bench serve``
takes them: time to first token from sending to the first chunk with a token, latency from sending to the last
chunk with a token (not to the usage chunk, ``[DONE]`` or the connection's close after it), time per output token
``(latency - ttft) / (tokens - 1)``. A request whose stream carries no token fails (it has no time to first token,
and counting it as completed would leave it out of the percentiles but in the throughput).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from slake.engines.vllm.serve.report import RequestResult

__all__ = ["make_client", "run_level", "stream_completion"]


def make_client(base_url: str, timeout_s: float = 3600.0) -> Any:
    """An ``openai.AsyncOpenAI`` client for the server at ``base_url`` (``http://127.0.0.1:PORT``): no retries
    (a failure is a result), a long read timeout (a queued 6K-token prefill on a CPU takes minutes), enough
    connections for any concurrency."""
    import httpx
    from openai import AsyncOpenAI

    return AsyncOpenAI(
        base_url=base_url.rstrip("/") + "/v1",
        api_key="EMPTY",
        max_retries=0,
        timeout=httpx.Timeout(timeout_s, connect=30.0),
        http_client=httpx.AsyncClient(
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            timeout=httpx.Timeout(timeout_s, connect=30.0),
        ),
    )


def _tokens_in(choice: Any) -> int:
    ids = getattr(choice, "token_ids", None)
    if ids is None and getattr(choice, "model_extra", None):
        ids = choice.model_extra.get("token_ids")
    if ids is not None:
        return len(ids)
    return 1 if getattr(choice, "text", "") else 0


async def stream_completion(
    client: Any, model: str, prompt: Sequence[int], max_tokens: int, *, stop_after: int | None = None
) -> RequestResult:
    """Send one streaming completion request; never raises for a failed request (``ok`` False, ``error`` says
    why). ``stop_after``: close the stream after that many tokens (a client that disconnects)."""
    n_tokens, ttft, usage_tokens = 0, None, None
    t_last: float | None = None  # when the last chunk with a token arrived
    t0 = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model,
            prompt=list(prompt),
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        try:
            async for chunk in stream:
                if chunk.choices:
                    k = _tokens_in(chunk.choices[0])
                    if k:
                        t_last = time.perf_counter()
                        if ttft is None:
                            ttft = t_last - t0
                    n_tokens += k
                if getattr(chunk, "usage", None) is not None:
                    usage_tokens = chunk.usage.completion_tokens
                if stop_after is not None and n_tokens >= stop_after:
                    break
        finally:
            await stream.close()
    except Exception as e:  # noqa: BLE001 - the load test records every failure and goes on
        return RequestResult(
            ok=False, prompt_len=len(prompt), output_tokens=n_tokens, ttft_s=ttft, error=f"{type(e).__name__}: {e}"
        )
    latency = None if t_last is None else t_last - t0
    tokens = usage_tokens if usage_tokens is not None else n_tokens
    if stop_after is None and ttft is None:
        return RequestResult(
            ok=False,
            prompt_len=len(prompt),
            output_tokens=tokens,
            error=f"no chunk of the stream carried a token ({tokens} tokens by the usage)",
        )
    if stop_after is None and tokens != max_tokens:
        return RequestResult(
            ok=False,
            prompt_len=len(prompt),
            output_tokens=tokens,
            ttft_s=ttft,
            latency_s=latency,
            error=f"{tokens} tokens instead of {max_tokens}",
        )
    return RequestResult(ok=True, prompt_len=len(prompt), output_tokens=tokens, ttft_s=ttft, latency_s=latency)


@dataclass
class LevelRun:
    """What :func:`run_level` returns: one result per prompt (in prompt order) and the wall time of the level."""

    results: list[RequestResult]
    duration_s: float


async def run_level(
    client: Any,
    model: str,
    prompts: Sequence[Sequence[int]],
    *,
    concurrency: int,
    max_tokens: int,
    on_done: Callable[[RequestResult], None] | None = None,
) -> LevelRun:
    """Send every prompt, at most ``concurrency`` in flight (the next starts when one ends, in prompt order);
    the duration runs from the first request sent to the last one finished."""
    sem = asyncio.Semaphore(concurrency)

    async def one(p: Sequence[int]) -> RequestResult:
        async with sem:
            r = await stream_completion(client, model, p, max_tokens)
        if on_done is not None:
            on_done(r)
        return r

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    return LevelRun(results=list(results), duration_s=time.perf_counter() - t0)
