"""Audit fixes of the load benchmark (``slake bench --engine vllm --serve``), without vLLM: the request's latency
ends at its last token (``vllm bench serve``'s definition), a stream without tokens is a failed request, the
server columns of a level whose ``/metrics`` scrapes failed are unknown rather than 0, and the run's table is
written after every level, marked incomplete until the run ends and when it stops, with a note for the rows whose
requests failed. Fake clients, fake clocks and a fake server: no timing is asserted."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from slake.engines.base import BenchPlan, ServePlan
from slake.engines.vllm.serve import client, report, run
from slake.engines.vllm.serve.metrics import MetricsWatch
from slake.engines.vllm.serve.report import RequestResult, level_stats

# --------------------------------------------------------------------------------------------------- the client


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _Stream:
    """An ``openai`` completion stream whose chunks arrive at given (fake) times; closing takes until ``closed``."""

    def __init__(self, clock: _Clock, chunks: list[tuple[float, object]], closed: float) -> None:
        self.clock, self.chunks, self.closed = clock, list(chunks), closed

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> object:
        if not self.chunks:
            raise StopAsyncIteration
        t, chunk = self.chunks.pop(0)
        self.clock.now = t
        return chunk

    async def close(self) -> None:
        self.clock.now = self.closed


def _tok(n: int) -> object:
    return SimpleNamespace(choices=[SimpleNamespace(token_ids=list(range(n)), text="x")], usage=None)


def _usage(n: int) -> object:
    return SimpleNamespace(choices=[], usage=SimpleNamespace(completion_tokens=n))


def _fake_client(stream: _Stream) -> object:
    async def create(**kwargs: object) -> _Stream:
        return stream

    return SimpleNamespace(completions=SimpleNamespace(create=create))


def test_latency_ends_at_the_last_token_not_at_the_usage_chunk_or_the_close(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(client, "time", clock)
    # sent at 0; tokens at 2, 3 and 4 (two); the usage chunk at 9, the connection closed at 12
    stream = _Stream(clock, [(2.0, _tok(1)), (3.0, _tok(1)), (4.0, _tok(2)), (9.0, _usage(4))], closed=12.0)
    r = asyncio.run(client.stream_completion(_fake_client(stream), "m", [1, 2, 3], 4))
    assert r.ok and r.output_tokens == 4
    assert r.ttft_s == 2.0 and r.latency_s == 4.0  # was 12.0: the usage chunk and the close counted
    assert r.tpot_s == pytest.approx((4.0 - 2.0) / 3)


def test_a_stream_that_carries_no_token_is_a_failed_request(monkeypatch):
    """The usage says every token came, but no chunk carried one: no time to first token. As completed, the
    request counted in the throughput and was silently left out of the TTFT and TPOT percentiles."""
    clock = _Clock()
    monkeypatch.setattr(client, "time", clock)
    empty = SimpleNamespace(choices=[SimpleNamespace(token_ids=None, text="")], usage=None)
    stream = _Stream(clock, [(1.0, empty), (2.0, empty), (3.0, _usage(2))], closed=3.0)
    r = asyncio.run(client.stream_completion(_fake_client(stream), "m", [1, 2], 2))
    assert not r.ok and "no chunk" in (r.error or "")
    assert level_stats([r], 3.0)["completed"] == 0


# --------------------------------------------------------------------------------------------------- /metrics

_METRICS = (
    "vllm:num_requests_running {running}\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc {usage}\n"
    "vllm:num_preemptions_total {pre}\nvllm:generation_tokens_total {gen}\n"
)


def _fake_httpx(outcomes: list[str | None]) -> ModuleType:
    """An ``httpx`` whose ``AsyncClient.get`` answers the scrapes in turn: a text, or None for a failed scrape
    (the last outcome repeats)."""
    mod = ModuleType("httpx")

    class AsyncClient:
        def __init__(self, **kwargs: object) -> None:
            pass

        async def __aenter__(self) -> AsyncClient:
            return self

        async def __aexit__(self, *exc: object) -> None:
            return None

        async def get(self, url: str) -> object:
            text = outcomes.pop(0) if len(outcomes) > 1 else outcomes[0]
            if text is None:
                raise ConnectionError("metrics scrape refused")
            return SimpleNamespace(text=text, raise_for_status=lambda: None)

    mod.AsyncClient = AsyncClient  # type: ignore[attr-defined]
    return mod


def _level_with_scrapes(monkeypatch, outcomes: list[str | None]) -> dict:
    monkeypatch.setitem(sys.modules, "httpx", _fake_httpx(outcomes))

    async def instant_level(cl, model, prompts, *, concurrency, max_tokens, on_done=None):
        results = [RequestResult(True, len(p), max_tokens, 0.1, 0.2) for p in prompts]
        return client.LevelRun(results=results, duration_s=1.0)

    monkeypatch.setattr(client, "run_level", instant_level)
    server = SimpleNamespace(url="http://fake")
    return asyncio.run(
        run.run_level_watched(server, None, "m", [[1] * 8] * 4, concurrency=4, max_tokens=6, pool_blocks=100)
    )


BEFORE = _METRICS.format(running=0, usage=0.0, pre=1, gen=100)
AFTER = _METRICS.format(running=3, usage=0.5, pre=3, gen=124)


@pytest.mark.parametrize(
    ("outcomes", "growth"),
    [
        ([BEFORE, AFTER], (2, 24)),
        ([None, AFTER], (None, None)),  # no baseline: was 0 preemptions and 0 tokens (AFTER less itself)
        ([BEFORE, None], (None, None)),  # the level's end not seen: was 0 and 0 (BEFORE less itself)
    ],
)
def test_counter_growth_needs_the_baseline_and_the_final_scrape(monkeypatch, outcomes, growth):
    row = _level_with_scrapes(monkeypatch, list(outcomes))
    assert (row["preemptions"], row["server_generation_tokens"]) == growth
    assert row["metrics_errors"] == outcomes.count(None)


def test_server_maxima_are_unknown_when_every_scrape_failed(monkeypatch):
    row = _level_with_scrapes(monkeypatch, [None])
    assert row["metrics_samples"] == 0 and row["metrics_errors"] >= 2
    # were 0 running, 0 waiting and 0 KV blocks held (of 100): numbers the server never said
    assert row["max_running"] is None and row["max_waiting"] is None
    assert row["max_kv_usage"] is None and row["max_kv_blocks"] is None
    assert "| - (of 100) |" in report.markdown_table([{"label": "x", "concurrency": 4, **row}])


def test_a_watch_that_never_scraped_reports_no_maximum():
    s = MetricsWatch(pool_blocks=10).summary()  # no scrape attempted: no number the server reported (before: 0)
    assert s["max_kv_blocks"] is None and s["max_running"] is None and s["preemptions"] is None


# --------------------------------------------------------------------------------------------------- the table


def _plan(tmp_path: Path) -> BenchPlan:
    sp = ServePlan(concurrency=(1, 2), requests=4, prompt_lens=(10, 20), max_tokens=3, kv_memory_gib=0.1)
    return BenchPlan(
        methods=("full",), budgets=(), lengths=(10, 20), out=tmp_path / "out", plots=False, progress=False, serve=sp
    )


class _FakeServer:
    def __init__(self, cfg: object) -> None:
        self.cfg = cfg

    def __enter__(self) -> _FakeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def plugin_lines(self) -> list[str]:
        return []


def _bench(tmp_path, monkeypatch, sweep) -> BenchPlan:
    plan = _plan(tmp_path)
    monkeypatch.setattr(run, "model_limits", lambda d: (512, None))
    monkeypatch.setattr(run, "VllmServer", _FakeServer)
    monkeypatch.setattr(run, "_sweep", sweep)
    return plan


def _stats(failed: int = 0) -> dict:
    results = [RequestResult(True, 10, 3, 0.5, 1.0)] * (4 - failed)
    results += [RequestResult(False, 10, error="APIError: engine dead")] * failed
    return {**level_stats(results, 4.0), **MetricsWatch(pool_blocks=10).summary()}


def test_failed_requests_get_a_note_under_the_table(tmp_path, monkeypatch):
    async def sweep(server, plan, sp, prompts, label, emit):
        emit(1, _stats(), 0, None)
        emit(2, _stats(failed=1), 0, None)

    plan = _bench(tmp_path, monkeypatch, sweep)
    rep = run.run_serve_bench(plan, str(tmp_path), "float32", "tiny", lambda m, b: None)
    md = (plan.out / report.TABLE).read_text()
    note = "plain vLLM at concurrency 2: 1 of 4 requests failed (first: APIError: engine dead)"
    assert note in md and note in rep.table
    assert "concurrency 1:" not in md and "Incomplete" not in md


def test_the_table_is_this_runs_and_says_incomplete_while_it_runs_and_when_it_stops(tmp_path, monkeypatch):
    seen: list[str] = []

    async def sweep(server, plan, sp, prompts, label, emit):
        emit(1, _stats(), 0, None)
        seen.append((plan.out / report.TABLE).read_text())
        raise RuntimeError("plain vLLM: vLLM's server died at concurrency 2; its log ends:\nTraceback ...")

    plan = _bench(tmp_path, monkeypatch, sweep)
    plan.out.mkdir(parents=True)
    (plan.out / report.TABLE).write_text("an earlier run's table, complete-looking\n")
    with pytest.raises(RuntimeError, match="server died"):
        run.run_serve_bench(plan, str(tmp_path), "float32", "tiny", lambda m, b: None)
    assert "Incomplete: the run is going on or stopped (1 of 2 levels finished)" in seen[0]
    assert "| plain vLLM | 1 |" in seen[0]
    md = (plan.out / report.TABLE).read_text()
    assert "earlier run" not in md and "| plain vLLM | 1 |" in md
    assert "stopped before its end (1 of 2 levels finished): RuntimeError: plain vLLM: vLLM's server died" in md
