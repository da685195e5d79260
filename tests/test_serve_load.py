"""The pure parts of the load benchmark through vLLM's server (``slake bench --engine vllm --serve``), without vLLM:
percentiles, the Prometheus text of ``/metrics``, a level's row, the table and the plot, the prompts, the command
line, and the server's process handling (start, readiness, stop on exit, exception and SIGTERM) on a fake server.
The real server is exercised in ``tests_vllm/test_server_load.py``."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from slake.cli import main
from slake.engines.vllm.serve import report
from slake.engines.vllm.serve.metrics import (
    MetricsWatch,
    ServerState,
    kv_pool_blocks,
    parse_prometheus,
    server_state,
    total,
)
from slake.engines.vllm.serve.report import RequestResult, level_stats, markdown_table, percentile
from slake.engines.vllm.serve.run import prompt_set
from slake.engines.vllm.serve.server import (
    PLUGIN_LOG_LINE,
    ServerConfig,
    VllmServer,
    process_tree,
    server_command,
    server_env,
    tree_pss_bytes,
    tree_rss_bytes,
)

# --------------------------------------------------------------------------------------------------- percentiles


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101])
def test_percentile_matches_numpy_linear(n):
    xs = np.random.default_rng(n).exponential(size=n).tolist()
    for q in (0, 1, 25, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12, abs=1e-15)


def test_percentile_edges():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # order does not matter
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    with pytest.raises(ValueError, match="percentile"):
        percentile([1.0], 101)


# --------------------------------------------------------------------------------------------------- /metrics

METRICS = textwrap.dedent(
    """\
    # HELP vllm:num_requests_running Number of requests in model execution batches.
    # TYPE vllm:num_requests_running gauge
    vllm:num_requests_running{engine="0",model_name="/m"} 3.0
    vllm:num_requests_waiting{engine="0",model_name="/m"} 2.0
    vllm:kv_cache_usage_perc{engine="0",model_name="/m"} 0.25
    vllm:num_preemptions_total{engine="0",model_name="/m"} 1.0
    vllm:generation_tokens_total{engine="0",model_name="/m"} 120.0
    vllm:request_num_preemptions_bucket{engine="0",le="+Inf",model_name="/m"} 4.0
    vllm:odd{path="a\\\\b",quote="say \\"hi\\"",nl="x\\ny"} NaN 1712345678000
    vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="1365",num_cpu_blocks="None"} 1.0

    process_resident_memory_bytes 1.5e+09
    """
)


def test_prometheus_text_is_parsed_with_labels_escapes_and_special_values():
    samples = parse_prometheus(METRICS)
    assert len(samples) == 9
    by = {s.name: s for s in samples}
    assert by["vllm:num_requests_running"].labels == {"engine": "0", "model_name": "/m"}
    assert by["vllm:request_num_preemptions_bucket"].labels["le"] == "+Inf"
    odd = by["vllm:odd"]
    assert odd.labels == {"path": "a\\b", "quote": 'say "hi"', "nl": "x\ny"} and np.isnan(odd.value)
    assert by["process_resident_memory_bytes"].value == 1.5e9 and by["process_resident_memory_bytes"].labels == {}
    assert total(samples, "vllm:num_requests_running") == 3.0
    assert total(samples, "vllm:odd") is None  # NaN only
    assert total(samples, "missing") is None
    assert kv_pool_blocks(samples) == 1364  # less vLLM's null block
    assert server_state(samples) == ServerState(
        running=3.0, waiting=2.0, kv_usage=0.25, preemptions=1.0, generation_tokens=120.0
    )


def test_prometheus_sums_engines_and_refuses_garbage():
    two = parse_prometheus(
        'vllm:num_requests_running{engine="0"} 1\nvllm:num_requests_running{engine="1"} 2\n'
        'vllm:kv_cache_usage_perc{engine="0"} 0.2\nvllm:kv_cache_usage_perc{engine="1"} 0.4\n'
        'vllm:cache_config_info{engine="0",num_gpu_blocks="11"} 1\n'
        'vllm:cache_config_info{engine="1",num_gpu_blocks="11"} 1'
    )
    st = server_state(two)
    assert st.running == 3 and st.kv_usage == pytest.approx(0.3) and kv_pool_blocks(two) == 20
    assert kv_pool_blocks(parse_prometheus('vllm:cache_config_info{num_gpu_blocks="None"} 1')) is None
    assert server_state([]) == ServerState(0.0, 0.0, 0.0, 0.0, 0.0)
    for bad in ("no value here", 'x{a="1"} notanumber', "x{a=1} 2"):
        with pytest.raises(ValueError):
            parse_prometheus(bad)


def test_metrics_watch_keeps_maxima_and_counter_growth():
    w = MetricsWatch(pool_blocks=1000)
    assert w.summary()["preemptions"] is None and w.summary()["max_kv_blocks"] is None  # no sample yet
    for running, usage, pre, gen in ((0, 0.0, 5, 100), (4, 0.1234, 5, 140), (2, 0.05, 7, 180), (0, 0.0, 7, 200)):
        w.add(ServerState(running, 1.0, usage, pre, gen))
    s = w.summary()
    assert s["max_running"] == 4 and s["max_waiting"] == 1 and s["max_kv_usage"] == 0.1234
    assert s["max_kv_blocks"] == 123 and s["kv_pool_blocks"] == 1000
    assert s["preemptions"] == 2 and s["server_generation_tokens"] == 100 and s["metrics_samples"] == 4
    assert MetricsWatch(pool_blocks=10).summary()["max_kv_blocks"] is None  # no sample taken: no maximum
    assert MetricsWatch().summary()["max_running"] is None  # (before: 0, a number the server never reported)


# --------------------------------------------------------------------------------------------------- rows, table, plot


def test_level_stats_follow_vllm_bench_definitions():
    results = [
        RequestResult(ok=True, prompt_len=100, output_tokens=11, ttft_s=1.0, latency_s=2.0),  # tpot 100 ms
        RequestResult(ok=True, prompt_len=300, output_tokens=11, ttft_s=3.0, latency_s=5.0),  # tpot 200 ms
        RequestResult(ok=True, prompt_len=200, output_tokens=1, ttft_s=0.5, latency_s=0.5),  # no tpot
        RequestResult(ok=False, prompt_len=50, error="HTTP 500"),
    ]
    s = level_stats(results, duration_s=10.0)
    assert s["requests"] == 4 and s["completed"] == 3 and s["failed"] == 1 and s["first_error"] == "HTTP 500"
    assert s["request_per_s"] == 0.3 and s["output_tok_s"] == 2.3 and s["total_tok_s"] == 62.3
    assert s["ttft_p50_s"] == 1.0 and s["tpot_p50_ms"] == 150.0 and s["tpot_p99_ms"] == 199.0
    assert s["latency_p50_s"] == 2.0 and s["prompt_tokens_mean"] == 162.5
    empty = level_stats([], 0.0)
    assert empty["completed"] == 0 and empty["output_tok_s"] is None and empty["ttft_p50_s"] is None


def _row(label, c, tok_s, **kw):
    return {"label": label, "concurrency": c, "output_tok_s": tok_s, **kw}


def test_markdown_table_has_one_line_per_row_and_dashes_for_unknowns():
    rows = [
        _row("plain vLLM", 1, 10.5, request_per_s=0.1, ttft_p50_s=1.2, ttft_p99_s=2.0, tpot_p50_ms=50.0,
             tpot_p99_ms=60.0, max_running=1, max_kv_blocks=130, kv_pool_blocks=726, preemptions=0, failed=0),
        _row("snapkv@128", 4, None, failed=4),
    ]  # fmt: skip
    table = markdown_table(rows)
    lines = table.strip().splitlines()
    assert len(lines) == 4 and lines[0].startswith("| engine | concurrency |")
    assert lines[2] == "| plain vLLM | 1 | 0.1 | 10.5 | 1.2 / 2.0 | 50.0 / 60.0 | 1 | 130 (of 726) | 0 | 0 |"
    assert lines[3] == "| snapkv@128 | 4 | - | - | - / - | - / - | - | - (of -) | - | 4 |"
    assert report.engine_label("full", None) == "plain vLLM" and report.engine_label("slake", 512) == "slake@512"


def test_plot_writes_a_png(tmp_path):
    rows = [_row("plain vLLM", c, 10.0 * c) for c in (1, 4, 16)] + [_row("snapkv@128", c, 12.0 * c) for c in (1, 4)]
    path = report.plot_throughput(rows, tmp_path / "sub" / report.PLOT)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prompt_set_is_seeded_and_in_range():
    a = prompt_set(20, (50, 80), vocab=512, seed=3)
    assert a == prompt_set(20, (50, 80), vocab=512, seed=3) and a != prompt_set(20, (50, 80), vocab=512, seed=4)
    assert all(50 <= len(p) <= 80 for p in a) and len({len(p) for p in a}) > 1
    assert all(10 <= t < 512 for p in a for t in p)
    assert all(len(p) == 7 for p in prompt_set(3, (7, 7), vocab=50_000, seed=0))
    assert max(t for p in prompt_set(5, (100, 100), vocab=50_000, seed=0) for t in p) < 1000


# --------------------------------------------------------------------------------------------------- command line


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--concurrency", "2"], "--concurrency belong(s) to the load benchmark: add --serve"),
        (["--requests", "2", "--kv-memory", "1"], "--requests, --kv-memory belong(s) to the load benchmark"),
        (["--serve", "--engine", "vllm", "--batch", "2"], "--serve does not use --batch"),
        (["--serve", "--engine", "vllm", "--decode-timing", "sequential"], "--serve does not use --decode-timing"),
        (["--serve", "--engine", "vllm", "--lengths", "600-500"], "need 1 <= LO <= HI"),
        (["--serve", "--engine", "vllm", "--lengths", "512,1024"], "one length or a range LO-HI"),
        (["--serve", "--engine", "vllm", "--concurrency", "4,0"], "--concurrency: every level must be >= 1"),
        (["--serve", "--engine", "vllm", "--kv-memory", "0"], "--kv-memory must be > 0 GiB"),
        (["--serve", "--engine", "vllm", "--max-tokens", "0"], "--requests and --max-tokens must be >= 1"),
        (["--serve", "--engine", "vllm", "--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
        (["--serve"], "--engine transformers does not support --serve"),
        (["--lengths", "2048-4096"], "--lengths: every length must be an integer >= 2"),
    ],
)
def test_bench_serve_command_line_errors_are_one_line(argv, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_bench_plan_of_serve_defaults_and_options():
    from slake.cli import build_parser
    from slake.cli.bench import bench_plan

    args = build_parser().parse_args(["bench", "--engine", "vllm", "--serve", "--out", "o"])
    plan = bench_plan(args)
    sp = plan.serve
    assert sp is not None and sp.prompt_lens == (2048, 6144) and sp.concurrency == (1, 4, 16)
    assert sp.requests == 32 and sp.max_tokens == 128 and sp.kv_memory_gib == 1.0 and sp.max_num_seqs is None
    argv = ["bench", "--engine", "vllm", "--serve", "--lengths", "4096", "--concurrency", "2,8", "--requests", "5"]
    argv += ["--max-tokens", "16", "--kv-memory", "0.5", "--max-num-seqs", "4", "--budget", "128,512", "--out", "o"]
    plan = bench_plan(build_parser().parse_args(argv))
    assert plan.serve.prompt_lens == (4096, 4096) and plan.serve.concurrency == (2, 8) and plan.serve.requests == 5
    assert plan.serve.max_tokens == 16 and plan.serve.kv_memory_gib == 0.5 and plan.serve.max_num_seqs == 4
    assert [b.value for b in plan.budgets] == [128, 512]
    plain = bench_plan(build_parser().parse_args(["bench", "--out", "o"]))
    assert plain.serve is None and plain.lengths == (1024, 2048, 4096, 8192)
    assert (plain.batch, plain.decode_steps, plain.warmup) == (1, 32, 3)


# --------------------------------------------------------------------------------------------------- server process


def _cfg(tmp_path: Path, **kw) -> ServerConfig:
    base = dict(
        model_dir="/models/m", log_path=tmp_path / "server.log", slake=None, kv_memory_bytes=2**30,
        max_model_len=4096, max_num_seqs=8, startup_timeout_s=60.0,
    )  # fmt: skip
    base.update(kw)
    return ServerConfig(**base)


def test_server_command_and_environment(tmp_path):
    cmd = server_command(_cfg(tmp_path, slake={"method": "snapkv", "budget": 128, "set": {}}), 8123)
    joined = " ".join(cmd)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    for flag in (
        "--model /models/m", "--host 127.0.0.1", "--port 8123", "--kv-cache-memory-bytes 1073741824",
        "--block-size 32", "--dtype float32", "--max-model-len 4096", "--max-num-seqs 8",
        "--max-num-batched-tokens 4096", "--no-enable-chunked-prefill", "--no-enable-prefix-caching",
    ):  # fmt: skip
        assert flag in joined, flag
    assert cmd[-2:] == ["--additional-config", '{"slake": {"method": "snapkv", "budget": 128, "set": {}}}']
    plain = server_command(_cfg(tmp_path, skip_tokenizer_init=True, max_model_len=512), 1)
    assert "--additional-config" not in plain and "--skip-tokenizer-init" in plain
    assert plain[plain.index("--max-num-batched-tokens") + 1] == "2048"
    env = server_env(
        {"VLLM_CPU_KVCACHE_SPACE": "", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "SLAKE_VLLM": "{}", "A": "1"}
    )
    assert env == {"A": "1"}


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="the kernel gives no smaps_rollup")
def test_the_pss_of_a_tree_counts_the_pages_its_processes_share_once():
    """Before: the rows gave the summed RSS only, which counts every page a forked process shares with its parent
    (vLLM's engine core and API server share torch's libraries) once per process."""
    shared = bytearray(os.urandom(1)) * (256 * 2**20)  # 256 MiB, touched: resident in this process
    child = os.fork()
    if child == 0:  # the child maps the same pages, copy-on-write, and never writes them
        time.sleep(30)
        os._exit(0)
    try:
        time.sleep(0.5)
        me = os.getpid()
        rss, pss = tree_rss_bytes(me), tree_pss_bytes(me)
        assert pss is not None and rss > 0
        assert rss - pss > 200 * 2**20  # the 256 MiB counted twice in the RSS, once in the PSS
        assert tree_pss_bytes(child) < tree_rss_bytes(child) - 100 * 2**20
        assert tree_pss_bytes(2**22 + 12345) is None
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    del shared


def test_process_tree_and_rss_of_this_process():
    assert process_tree(os.getpid())[0] == os.getpid()
    assert tree_rss_bytes(os.getpid()) > 10 * 2**20
    assert process_tree(2**22 + 12345) == [] and tree_rss_bytes(2**22 + 12345) == 0


FAKE_SERVER = textwrap.dedent(
    """\
    # A stand-in for vLLM's API server: one child process (its "engine"), /health and /metrics on --port.
    import http.server, os, subprocess, sys, time
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    mode = open(sys.argv[0] + ".mode").read().strip()
    print("fake server starting", os.environ.get("SLAKE_TEST_ENV"), flush=True)
    if mode == "exit":
        print("boom: no KV memory", flush=True)
        sys.exit(3)
    if mode == "plugin":
        print("(Worker) slake: compressing the KV cache with snapkv@128", flush=True)
        print("(Worker) slake: no profile entry applies to this model: the method's own values", flush=True)
        print("(Worker) slake: compressing the KV cache with snapkv@128", flush=True)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"child {child.pid}", flush=True)

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'vllm:cache_config_info{num_gpu_blocks="9"} 1.0\\n' if self.path == "/metrics" else b""
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


@pytest.fixture()
def fake_python(tmp_path):
    """An executable that stands in for ``python -m vllm.entrypoints.openai.api_server`` (FAKE_SERVER)."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    exe = tmp_path / "python"
    exe.write_text(f'#!/bin/sh\nshift 2\nexec {sys.executable} {script} "$@"\n')
    exe.chmod(0o755)

    def make(mode: str) -> str:
        (tmp_path / "fake_server.py.mode").write_text(mode)
        return str(exe)

    return make


def _children_of_log(log: Path) -> list[int]:
    return [int(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("child ")]


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True  # a zombie left for its (dead) parent's reaper: not running
        except OSError:
            return True
        time.sleep(0.1)
    return False


def test_server_is_ready_then_stopped_with_its_children(tmp_path, fake_python):
    cfg = _cfg(tmp_path, python=fake_python("ok"), env={"SLAKE_TEST_ENV": "set"})
    with VllmServer(cfg) as server:
        assert server.healthy() and server.get("/metrics")[0] == 200
        pid, kids = server.pid, _children_of_log(cfg.log_path)
        assert len(kids) == 1 and set(kids) <= set(process_tree(pid)) and server.rss_bytes() > 0
    assert server.proc is None and _gone(pid) and _gone(kids[0])
    assert "fake server starting set" in cfg.log_path.read_text()  # ServerConfig.env reaches the server


@pytest.mark.parametrize("how", ["exception", "sigterm"])
def test_server_is_stopped_on_an_exception_and_on_sigterm(tmp_path, fake_python, how):
    cfg = _cfg(tmp_path, python=fake_python("ok"))
    before = signal.getsignal(signal.SIGTERM)
    server = VllmServer(cfg)
    with pytest.raises(SystemExit if how == "sigterm" else KeyboardInterrupt):
        with server:
            pid, kids = server.pid, _children_of_log(cfg.log_path)
            if how == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises before this ends
            raise KeyboardInterrupt
    assert _gone(pid) and _gone(kids[0])
    assert signal.getsignal(signal.SIGTERM) == before


def test_server_that_exits_at_start_up_is_reported_with_its_log(tmp_path, fake_python):
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3 during start-up.*boom: no KV memory"):
        with VllmServer(_cfg(tmp_path, python=fake_python("exit"))):
            pass


def test_a_plugin_configuration_needs_the_plugin_in_the_server_log(tmp_path, fake_python):
    slake = {"method": "snapkv", "budget": 128}
    server = VllmServer(_cfg(tmp_path, python=fake_python("ok"), slake=slake))
    with pytest.raises(RuntimeError, match="started without the slake plugin"):
        with server:
            pass
    assert server.proc is None and _gone(int(_children_of_log(server.cfg.log_path)[0]))
    with VllmServer(_cfg(tmp_path, python=fake_python("plugin"), slake=slake)) as server:
        assert PLUGIN_LOG_LINE in server.log_tail()
        # what the plugin logged at start-up, each line once, for the benchmark's rows
        assert server.plugin_lines() == [
            "slake: compressing the KV cache with snapkv@128",
            "slake: no profile entry applies to this model: the method's own values",
        ]
