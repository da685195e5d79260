"""vLLM's OpenAI-compatible server with the plugin under a mixed load: streaming and plain requests, clients that
disconnect mid-stream or before their first token (also while queued), and bad inputs. Afterwards the server must be
up, answer a normal request with the tokens it gave before the load, hold no KV block and no running or waiting
request, and its memory must be flat. Also ``slake bench --engine vllm --serve`` end to end on the tiny model.

The measured load is ``SLAKE_SERVER_LOAD_REQUESTS`` requests (default 200, the issue's criterion), after a warm-up
load of half as many (not counted: it brings the server's caches to their working size).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import time

import pytest

from slake.engines.vllm.serve.client import make_client, stream_completion
from slake.engines.vllm.serve.metrics import kv_pool_blocks, parse_prometheus, server_state
from slake.engines.vllm.serve.server import ServerConfig, VllmServer

N_REQUESTS = int(os.environ.get("SLAKE_SERVER_LOAD_REQUESTS", "200"))
CONCURRENCY = 8  # client side; the server runs at most MAX_NUM_SEQS, the others wait in its queue
MAX_NUM_SEQS = 4
MAX_MODEL_LEN = 1024
VOCAB = 512  # the tiny model's (conftest.build_tiny)
KV_BLOCKS = 40  # a small pool: an 800-token prefill takes 25 blocks, so long prompts queue for blocks
BLOCK_BYTES = 32 * 2 * 3 * 2 * 32 * 4  # tokens x (K, V) x layers x KV heads x head dim x float32
SLAKE = {"method": "snapkv", "budget": 64}
#: prompt lengths (one below the budget: not compressed) and generation lengths of the load. A few fixed values:
#: vLLM's CPU worker keeps oneDNN matmul primitives per step shape (tokens in the step), so that its RSS grows
#: with every new shape until those caches are full (+140 MiB over 320 sequential requests of 128 different
#: prompt lengths, plain vLLM, none with one length), not with the number of requests; a few lengths (and one
#: prefill's worth of tokens per step) keep the step shapes to a set the warm-up has seen.
PROMPT_LENS = (24, 160, 480, 800)
MAX_TOKENS = (8, 16, 32)
#: how much the server's RSS (three processes) may grow over the measured load; see the test's docstring
RSS_BOUND_MIB = 48
#: for the server: oneDNN's primitive cache (default 1024 primitives, one per matmul shape) kept small, so that the
#: RSS measures what requests leave behind rather than how many step shapes the load happened to produce
SERVER_ENV = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "4"}


def save_word_tokenizer(path: str, vocab: int = VOCAB) -> None:
    """A word-level tokenizer with exactly ``vocab`` ids (``w3`` ... and ``<unk>``, ``<s>``, ``</s>``), so that
    vLLM checks prompt ids against the vocabulary: without a tokenizer (``--skip-tokenizer-init``) vLLM 0.32
    skips that check and an out-of-vocabulary id kills the engine (IndexError in the embedding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)


@pytest.fixture(scope="module")
def served_dir(tiny_dir, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-served") / "model"
    shutil.copytree(tiny_dir, path)
    save_word_tokenizer(str(path))
    return str(path)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def bad_requests(model: str, rng: random.Random) -> list[tuple[str, object]]:
    """(what, body) of requests the server must refuse with a 4xx; a str body is sent as it is (not JSON). (A
    prompt that fits with ``max_tokens`` beyond the context is no error for vLLM 0.32: it stops at
    ``max_model_len``.)"""
    ok = {"model": model, "prompt": _ids(rng, 20), "max_tokens": 4}
    return [
        ("prompt longer than max_model_len", {**ok, "prompt": _ids(rng, MAX_MODEL_LEN + 50)}),
        ("max_tokens over max_model_len", {**ok, "max_tokens": MAX_MODEL_LEN + 1}),
        ("negative max_tokens", {**ok, "max_tokens": -5}),
        ("zero max_tokens", {**ok, "max_tokens": 0}),
        ("unknown model", {**ok, "model": "no-such-model"}),
        ("invalid JSON", json.dumps(ok)[:-9]),
        ("not JSON at all", "hello"),
        ("token id out of vocabulary", {**ok, "prompt": [5, 6, VOCAB]}),
        ("huge token id, streaming", {**ok, "prompt": [5, 99_999_999], "stream": True}),
        ("negative token id", {**ok, "prompt": [5, -1, 7]}),
        ("empty prompt (ids)", {**ok, "prompt": []}),
        ("empty prompt (text)", {**ok, "prompt": ""}),
        ("no prompt", {"model": model, "max_tokens": 4}),
        ("wrong type", {**ok, "max_tokens": "ten"}),
        ("negative temperature", {**ok, "temperature": -1.0}),
    ]


async def _post(session, url: str, body: object) -> tuple[int, str]:
    kw = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, str) else {"json": body}
    async with session.post(url + "/v1/completions", **kw) as resp:
        return resp.status, await resp.text()


def refusal_code(status: int, text: str) -> int:
    """The HTTP code a request was refused with: the status, or for a stream that vLLM opened (200) the code of
    an error event that comes first. vLLM 0.32 checks prompt token ids against the vocabulary only when the request
    reaches the engine client, after a streaming response's headers are sent: such a request gets 200 and then
    ``data: {"error": {..., "code": 400}}`` and ``data: [DONE]`` (every other bad input is a 4xx status)."""
    if status != 200 or not text.startswith("data: "):
        return status
    first = json.loads(text.split("\n", 1)[0][len("data: ") :])
    return int(first["error"]["code"]) if "error" in first else status


async def _greedy_tokens(session, url: str, model: str, prompt: list[int], n: int) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True}
    status, text = await _post(session, url, {**body, "return_token_ids": True})
    assert status == 200, text
    return json.loads(text)["choices"][0]["token_ids"]


async def _disconnect_after(session, url: str, body: dict, chunks: int) -> int:
    """Stream ``body`` and close the connection after ``chunks`` token chunks; the chunks read."""
    seen = 0
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                seen += 1
                if seen >= chunks:
                    resp.close()  # drop the connection mid-stream
                    break
    return seen


async def _disconnect_early(session, url: str, body: dict, after_s: float) -> None:
    """Send ``body`` streaming and give up after ``after_s`` seconds (before or during its prefill or in the
    queue): the task is cancelled, which closes the connection."""
    task = asyncio.ensure_future(_post(session, url, {**body, "stream": True}))
    await asyncio.sleep(after_s)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


async def mixed_load(url: str, model: str, n: int, seed: int) -> dict:
    """``n`` mixed requests, at most CONCURRENCY in flight; returns the failures by kind (empty when all is well)
    and what was sent."""
    import aiohttp

    rng = random.Random(seed)
    bad = bad_requests(model, rng)
    kinds = rng.choices(["stream", "plain", "disconnect", "early", "bad"], weights=[35, 15, 15, 10, 25], k=n)
    client = make_client(url)
    sem = asyncio.Semaphore(CONCURRENCY)
    problems: list[str] = []
    sent: dict[str, int] = {}

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def one(i: int, kind: str) -> None:
            r = random.Random(seed * 100_003 + i)
            prompt = _ids(r, r.choice(PROMPT_LENS))
            max_tokens = r.choice(MAX_TOKENS)
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
            body["ignore_eos"] = True
            async with sem:
                if kind == "stream":
                    res = await stream_completion(client, model, prompt, max_tokens)
                    if not res.ok or res.output_tokens != max_tokens:
                        problems.append(f"stream #{i}: {res}")
                elif kind == "plain":
                    status, text = await _post(session, url, body)
                    got = json.loads(text)["usage"]["completion_tokens"] if status == 200 else None
                    if got != max_tokens:
                        problems.append(f"plain #{i}: {status} {text[:200]}")
                elif kind == "disconnect":
                    await _disconnect_after(session, url, {**body, "max_tokens": 32}, r.randint(1, 3))
                elif kind == "early":
                    await _disconnect_early(session, url, body, r.uniform(0.0, 0.3))
                else:
                    what, bad_body = bad[i % len(bad)]
                    status, text = await _post(session, url, bad_body)
                    if not 400 <= refusal_code(status, text) < 500:
                        problems.append(f"bad input '{what}' #{i}: {status} {text[:200]}")
                    kind = f"bad: {what}"
            sent[kind] = sent.get(kind, 0) + 1

        await asyncio.gather(*(one(i, k) for i, k in enumerate(kinds)))
    await client.close()
    return {"problems": problems, "sent": sent}


def _idle_state(server: VllmServer, timeout: float = 60.0):
    """The server's /metrics once no request runs or waits (aborted requests leave at the next engine step)."""
    deadline = time.monotonic() + timeout
    while True:
        state = server_state(parse_prometheus(server.get("/metrics")[1]))
        if (state.running == 0 and state.waiting == 0) or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


@pytest.fixture(scope="module")
def server(served_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server-load") / "server.log"
    cfg = ServerConfig(
        model_dir=served_dir,
        log_path=log,
        slake=SLAKE,
        kv_memory_bytes=(KV_BLOCKS + 1) * BLOCK_BYTES,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_MODEL_LEN,
        startup_timeout_s=600,
        env=SERVER_ENV,
    )
    with VllmServer(cfg) as s:
        yield s


def test_mixed_load_with_disconnects_and_bad_inputs_leaves_the_server_up_answering_with_flat_memory(server):
    """The RSS bound: the RSS of the server's three processes (``VmRSS`` of ``/proc/PID/status``) is read after the
    warm-up load and after the measured one, each time once no request runs. Plain vLLM's own worker grew by 19 MiB
    over such 200 requests after 100 of warm-up (measured while writing this test, this server's settings without
    the plugin), the plugin's runs by 10-21 MiB (five runs). A leak of what a compressed request's prefill handles
    (its prompt's keys and values: 0.25-1.2 MB here, 0.74 MB on average, about 100 compressed prefills in the
    measured load) would add over 70 MB, above the 48 MiB bound with room for that drift; smaller per-request state
    (a compressed request's kept slots, 100 KB) is beyond this measurement and is checked in process
    (``test_serving.py``: rows and states released)."""
    import aiohttp

    url, model = server.url, server.model_id()
    assert kv_pool_blocks(parse_prometheus(server.get("/metrics")[1])) == KV_BLOCKS
    ref_prompt = _ids(random.Random(123), 480)  # compressed (> budget 64)

    async def reference() -> list[int]:
        async with aiohttp.ClientSession() as s:
            return await _greedy_tokens(s, url, model, ref_prompt, 24)

    before = asyncio.run(reference())
    assert len(before) == 24
    warm = asyncio.run(mixed_load(url, model, max(N_REQUESTS // 2, 1), seed=1))
    _idle_state(server)
    rss_warm = server.rss_bytes()
    t0 = time.perf_counter()
    load = asyncio.run(mixed_load(url, model, N_REQUESTS, seed=2))
    load_s = time.perf_counter() - t0
    state = _idle_state(server)
    rss_end = server.rss_bytes()
    after = asyncio.run(reference())
    growth = (rss_end - rss_warm) / 2**20
    print(
        f"\n{N_REQUESTS} requests in {load_s:.0f} s: {load['sent']}; RSS after the warm-up {rss_warm / 2**20:.1f} "
        f"MiB, after the load {rss_end / 2**20:.1f} MiB ({growth:+.1f}); preemptions {state.preemptions:.0f}; "
        f"log {server.cfg.log_path}"
    )
    assert not warm["problems"] + load["problems"], warm["problems"] + load["problems"]
    assert server.alive() and server.healthy()
    assert state.running == 0 and state.waiting == 0
    assert state.kv_usage == 0.0, "KV blocks still held after every request ended"
    assert after == before
    assert growth < RSS_BOUND_MIB, f"server RSS grew by {growth:.1f} MiB over {N_REQUESTS} requests"
    log = server.cfg.log_path.read_text(encoding="utf-8", errors="replace")
    assert "EngineDeadError" not in log and "Worker failed" not in log


def test_bench_serve_command_end_to_end(served_dir, tmp_path, capsys):
    from slake.cli import main

    out = tmp_path / "bench"
    argv = ["bench", "--engine", "vllm", "--serve", "--model", served_dir, "--methods", "snapkv", "--budget", "64"]
    argv += ["--lengths", "100-400", "--concurrency", "1,3", "--requests", "4", "--max-tokens", "6"]
    argv += ["--kv-memory", "0.05", "--out", str(out), "--json", "--no-progress"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["label"], r["concurrency"]) for r in rows] == [("snapkv@64", 1), ("snapkv@64", 3)]
    for r in rows:
        assert r["completed"] == 4 and r["failed"] == 0 and r["output_tok_s"] > 0
        assert r["server_generation_tokens"] == 4 * 6 and r["kv_pool_blocks"] > 0
        assert r["slake_config"] == {"method": "snapkv", "budget": 64} and r["ttft_p50_s"] > 0  # as users write it
        assert any(line.startswith("slake: compressing the KV cache with snapkv@64") for line in r["plugin_log"])
        assert any(line.startswith("slake: no profile entry applies") for line in r["plugin_log"])  # a random model
        # the server's memory: its processes' RSS summed, and their PSS (shared pages counted once) below it
        assert 0 < r["server_pss_mib"] < r["server_rss_mib"]
    assert (out / "bench_serve.md").read_text().count("| snapkv@64 |") == 2
    assert (out / "serve_throughput.png").stat().st_size > 0
    assert len((out / "bench_serve.jsonl").read_text().splitlines()) == 2
    assert (out / "server-snapkv-64.log").is_file()


def test_counters_baseline_is_taken_before_the_first_request(monkeypatch):
    """The level's generated tokens are the growth of vLLM's counter from a sample taken before any request is sent
    (the sampler's first scrape used to race with the first requests, and under load it missed their first tokens:
    23 of 24 in a run of the vLLM tests)."""
    import asyncio
    import http.server
    import threading
    from types import SimpleNamespace

    from slake.engines.vllm.serve import client, report, run

    tokens = {"n": 100}

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the handler's API
            body = f"vllm:generation_tokens_total {tokens['n']}\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()

    async def instant_level(cl, model, prompts, *, concurrency, max_tokens, on_done=None):
        tokens["n"] += len(prompts) * max_tokens  # every token generated at once, before any later scrape
        results = [report.RequestResult(True, len(p), max_tokens, 0.1, 0.2) for p in prompts]
        return client.LevelRun(results=results, duration_s=1.0)

    monkeypatch.setattr(client, "run_level", instant_level)
    server = SimpleNamespace(url=f"http://127.0.0.1:{httpd.server_address[1]}")
    try:
        row = asyncio.run(
            run.run_level_watched(server, None, "m", [[1] * 8] * 4, concurrency=4, max_tokens=6, pool_blocks=10)
        )
    finally:
        httpd.shutdown()
    assert row["server_generation_tokens"] == 24
