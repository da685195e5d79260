"""vLLM's ``/metrics`` endpoint: the Prometheus text format parsed, and a watcher that samples it during a level.

vLLM 0.32 (``vllm/v1/metrics/loggers.py``) exports, per engine: the gauges ``vllm:num_requests_running``,
``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc`` (a fraction in [0, 1] despite the name: used blocks
over the pool's blocks less the null block, ``BlockPool.get_usage``), the counters ``vllm:num_preemptions_total``
and ``vllm:generation_tokens_total``, and the info gauge ``vllm:cache_config_info`` whose labels include
``num_gpu_blocks`` (the pool's size, also on CPU) and ``block_size``. The gauges are updated after every engine
step, so sampling a few times a second sees every step of a CPU server.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = [
    "MetricsWatch",
    "Sample",
    "ServerState",
    "kv_pool_blocks",
    "parse_prometheus",
    "server_state",
    "total",
]

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
CACHE_INFO = "vllm:cache_config_info"

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = MappingProxyType({"\\\\": "\\", '\\"': '"', "\\n": "\n"})


@dataclass(frozen=True)
class Sample:
    """One line of the Prometheus text format: metric name, labels, value."""

    name: str
    labels: dict[str, str]
    value: float


def _labels(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    pos = 0
    while pos < len(text):
        m = _LABEL.match(text, pos)
        if m is None:
            raise ValueError(f"malformed labels: {text!r}")
        out[m.group(1)] = re.sub(r"\\[\\\"n]", lambda e: _UNESCAPE[e.group(0)], m.group(2))
        pos = m.end()
    return out


def parse_prometheus(text: str) -> list[Sample]:
    """The samples of a Prometheus text exposition (version 0.0.4): comments and blank lines skipped, label
    values unescaped, ``+Inf``/``-Inf``/``NaN`` parsed, an optional timestamp ignored. A line that is not a sample
    raises ValueError naming it."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            raise ValueError(f"not a Prometheus sample: {line!r}")
        name, labels, value = m.groups()
        try:
            v = float(value)  # float() reads +Inf, -Inf and NaN
        except ValueError:
            raise ValueError(f"not a Prometheus sample value: {line!r}") from None
        out.append(Sample(name, _labels(labels) if labels else {}, v))
    return out


def total(samples: list[Sample], name: str) -> float | None:
    """The sum of ``name`` over its label sets (engines), or None when the server does not export it."""
    values = [s.value for s in samples if s.name == name and not math.isnan(s.value)]
    return sum(values) if values else None


def kv_pool_blocks(samples: list[Sample]) -> int | None:
    """The KV blocks usage is a fraction of: ``num_gpu_blocks`` of ``vllm:cache_config_info`` less vLLM's null
    block (``BlockPool.get_usage``), summed over engines; None when the label is missing."""
    blocks = [s.labels.get("num_gpu_blocks") for s in samples if s.name == CACHE_INFO]
    known = [int(b) - 1 for b in blocks if b not in (None, "None", "")]
    return sum(known) if known else None


@dataclass(frozen=True)
class ServerState:
    """What one ``/metrics`` sample says about the server."""

    running: float
    waiting: float
    kv_usage: float
    preemptions: float
    generation_tokens: float


def server_state(samples: list[Sample]) -> ServerState:
    """The state of :class:`ServerState` from parsed samples (absent metrics read as 0; the usage is averaged over
    engines, a fraction in [0, 1])."""
    usage = [s.value for s in samples if s.name == KV_USAGE]
    return ServerState(
        running=total(samples, RUNNING) or 0.0,
        waiting=total(samples, WAITING) or 0.0,
        kv_usage=sum(usage) / len(usage) if usage else 0.0,
        preemptions=total(samples, PREEMPTIONS) or 0.0,
        generation_tokens=total(samples, GENERATION_TOKENS) or 0.0,
    )


@dataclass
class MetricsWatch:
    """The extremes of a series of :class:`ServerState` samples and the counters' growth since the first.

    ``pool_blocks`` converts the usage fraction into blocks held (rounded to the nearest block). A failed scrape is
    recorded with :meth:`miss`: the counters' growth is only known when the first scrape (the baseline, taken
    before the level's first request) and the last one (after its last request) succeeded, and the maxima only
    when some scrape did.
    """

    pool_blocks: int | None = None
    first: ServerState | None = None
    last: ServerState | None = None
    max_running: float = 0.0
    max_waiting: float = 0.0
    max_kv_usage: float = 0.0
    samples: int = 0
    errors: list[str] = field(default_factory=list)
    #: the first scrape failed (no baseline before the level) / the latest one did
    missed_first: bool = False
    missed_last: bool = False

    def add(self, state: ServerState) -> None:
        """Record one sample."""
        if self.first is None:
            self.first = state
        self.last = state
        self.samples += 1
        self.missed_last = False
        self.max_running = max(self.max_running, state.running)
        self.max_waiting = max(self.max_waiting, state.waiting)
        self.max_kv_usage = max(self.max_kv_usage, state.kv_usage)

    def miss(self, error: str) -> None:
        """Record a failed scrape (``error`` says why)."""
        self.errors.append(error)
        if self.samples == 0:
            self.missed_first = True
        self.missed_last = True

    def summary(self) -> dict:
        """``max_running``, ``max_waiting``, ``max_kv_usage``, ``max_kv_blocks`` (None without the pool size, and
        all four None when no scrape succeeded), ``kv_pool_blocks``, ``preemptions`` and
        ``server_generation_tokens`` (growth between the first and the last sample; None when either scrape
        failed), ``metrics_samples`` and ``metrics_errors`` (scrapes that failed)."""
        grown: dict[str, int | None] = {"preemptions": None, "server_generation_tokens": None}
        if self.first is not None and self.last is not None and not (self.missed_first or self.missed_last):
            grown = {
                "preemptions": int(self.last.preemptions - self.first.preemptions),
                "server_generation_tokens": int(self.last.generation_tokens - self.first.generation_tokens),
            }
        unknown = self.samples == 0  # not one sample (failed, or never taken): no maximum to report
        blocks = None if self.pool_blocks is None or unknown else round(self.max_kv_usage * self.pool_blocks)
        return {
            "max_running": None if unknown else int(self.max_running),
            "max_waiting": None if unknown else int(self.max_waiting),
            "max_kv_usage": None if unknown else round(self.max_kv_usage, 4),
            "max_kv_blocks": blocks,
            "kv_pool_blocks": self.pool_blocks,
            **grown,
            "metrics_samples": self.samples,
            "metrics_errors": len(self.errors),
        }
