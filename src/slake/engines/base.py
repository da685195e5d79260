"""The engine interface: what the commands (``generate``, ``eval``, ``bench``, ``demo``) ask of a backend.

An engine runs a model with a compressed KV cache. Two implement this interface: the transformers engine
(:class:`slake.engines.transformers.TransformersEngine`, the reference) and the vLLM engine
(:class:`slake.engines.vllm.VllmEngine`, vLLM with the slake plugin). A command builds its request, hands it to the
engine and formats what comes back; it never asks which engine it has. An option an engine cannot honour is refused
by :meth:`Engine.check`, in one place, before anything is loaded.

The operations:

* :meth:`Engine.check` - refuse unsupported options (and a missing installation) before any load;
* :meth:`Engine.check_pair` - refuse a (method, budget) pair the engine cannot run;
* :attr:`Engine.tokenizer` - the model's tokenizer (loads it, and for the transformers engine the model);
* :attr:`Engine.context_limit` - the model's context in tokens, beyond which prompts are refused unless allowed;
* :meth:`Engine.generate` - one prompt, one method and budget, a :class:`slake.engines.result.GenerationResult`;
* :meth:`Engine.evaluate` - token-id prompts times (method, budget) pairs, one :class:`EvalOutput` each;
* :meth:`Engine.bench` - a benchmark plan, its rows and a markdown table (files written under the plan's folder);
  a plan with :attr:`BenchPlan.serve` is a load benchmark through the engine's server, where the engine has one.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from slake.engines.result import GenerationResult
from slake.methods.budget_check import check_method_budget

__all__ = [
    "BenchPlan",
    "BenchReport",
    "Engine",
    "EvalOptions",
    "EvalOutput",
    "EvalRequest",
    "ModelSpec",
    "Pair",
    "ServePlan",
    "load_avg",
    "option_flag",
]

#: a (method, budget) pair of an evaluation; budget None is the full-cache reference
Pair = tuple[str, "int | float | None"]


def option_flag(name: str) -> str:
    """The command-line spelling of an option name: ``prefill_chunk`` -> ``--prefill-chunk``."""
    return "--" + name.replace("_", "-")


def load_avg() -> float | None:
    """The 1-minute load average, recorded beside benchmark rows (None where the platform has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


@dataclass(frozen=True)
class ModelSpec:
    """Which model an engine loads: ``--model``, ``--gguf-file``, ``--device``, ``--dtype``.

    Parameters
    ----------
    name : str | None
        ``"smollm2"`` (the packaged default, also for None), another packaged model, a hub id, a local directory or
        a ``.gguf`` file (:func:`slake.load_model`).
    gguf_file : str | None
        A ``.gguf`` file inside the hub repo or directory ``name``.
    device : str | None
        ``"cpu"``, ``"cuda"``, ``"cuda:1"`` ...; the engine's default when None (transformers: ``"cuda"`` when a GPU
        is visible, else ``"cpu"``; vLLM runs on the CPU).
    dtype : str | None
        Model dtype (``"float32"``, ``"bfloat16"`` ...); the device's default when None.
    random : str | None
        A random model shape (:mod:`slake.engines.transformers.shapes`, benchmarks only) loaded instead of ``name``.
    seed : int
        Seed of the random model's weights.
    """

    name: str | None = "smollm2"
    gguf_file: str | None = None
    device: str | None = None
    dtype: str | None = None
    random: str | None = None
    seed: int = 0

    @property
    def label(self) -> str:
        """The model's name in result rows: ``random:<shape>`` or the name given (``smollm2`` by default)."""
        return f"random:{self.random}" if self.random else (self.name or "smollm2")


@dataclass(frozen=True)
class EvalRequest:
    """One prompt of an evaluation, already tokenised, with the (method, budget) pairs still to run on it.

    Attributes
    ----------
    key : int
        The caller's index of the prompt (outputs name it).
    prefill_ids : list[int]
        The prompt's token ids (query-aware: the whole prompt; question-agnostic: the context).
    question_ids : list[int]
        Question-agnostic runs: the question, fed after compression; empty otherwise.
    max_new_tokens : int
        Generation cap of this prompt.
    group : str
        Prompts of different groups (tasks) are never decoded in one batch.
    pairs : tuple of Pair
        The pairs to run, the full cache as ``("full", None)``.
    """

    key: int
    prefill_ids: list[int]
    question_ids: list[int]
    max_new_tokens: int
    group: str
    pairs: tuple[Pair, ...]


@dataclass(frozen=True)
class EvalOptions:
    """How an evaluation runs. Not every engine honours every option (:meth:`Engine.check`)."""

    query_aware: bool = True
    prefill_chunk: int | None = None
    batch_size: int = 1
    kv_dtype: str | None = None
    #: folder of prefill captures kept across runs (``--prefill-cache``; engines with ``supports_prefill_cache``)
    prefill_cache: str | None = None
    #: also measure each compressed pair's output-level distance to the full cache (``--fidelity``; engines with
    #: ``supports_fidelity``)
    fidelity: bool = False
    #: run prompts whose tokens plus the new ones reach past the model's context (``--allow-long-context``), which
    #: are refused otherwise (:mod:`slake.engines.context`)
    allow_long_context: bool = False


@dataclass
class EvalOutput:
    """What an engine returns for one (prompt, method, budget): the generated tokens and their accounting.

    ``tokens`` are the generated ids (a final end-of-sequence id included when one stopped generation);
    ``extra`` holds engine-specific fields that go into the result row as they are (``compress_s``,
    ``kv_blocks_end`` ...).
    """

    key: int
    method: str
    budget: int | float | None
    tokens: list[int]
    prompt_tokens: int
    prefill_s: float | None
    decode_s: float | None
    compressed: bool
    kv_bytes: dict
    max_new_tokens: int
    batch_size: int = 1
    prefill_chunk: int | None = None
    profile: dict | None = None
    hyperparameters: dict | None = None
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ServePlan:
    """A load benchmark through an OpenAI-compatible server (``slake bench --serve``).

    For each configuration a server is started with ``kv_memory_gib`` of KV cache; at each level of ``concurrency``
    ``requests`` streaming completion requests are sent with at most that many in flight, each a prompt of random
    token ids with a length drawn uniformly from ``prompt_lens`` (low, high; inclusive) generating exactly
    ``max_tokens`` tokens. ``max_num_seqs`` caps the requests the server runs at once (None: the largest
    concurrency).
    """

    concurrency: tuple[int, ...]
    requests: int
    prompt_lens: tuple[int, int]
    max_tokens: int
    kv_memory_gib: float
    max_num_seqs: int | None = None


@dataclass(frozen=True)
class BenchPlan:
    """A benchmark: every method x budget x context length (x 8-bit storage), on random token prompts.

    ``methods`` include ``full`` when the full cache is measured; ``budgets`` are :class:`slake.Budget` values;
    ``out`` is the folder the engine writes its rows, table and plots to.
    """

    methods: tuple[str, ...]
    budgets: tuple[Any, ...]
    lengths: tuple[int, ...]
    out: Path
    batch: int = 1
    decode_steps: int = 32
    warmup: int = 3
    seed: int = 0
    prefill_chunk: int | None = None
    kv_dtypes: tuple[str | None, ...] = (None,)
    isolate: bool = False
    decode_timing: str = "auto"
    threads: int | None = None
    plots: bool = True
    progress: bool = True
    #: also measure every configuration with compiled decoding (``--compile``), paired with its eager run
    compile: bool = False
    #: the decode step's implementation (``--kernels``: ``auto``, ``torch`` or ``triton``)
    kernels: str = "auto"
    #: decode steps of every configuration profiled after its timed steps (``--profile-steps``; 0: none)
    profile_steps: int = 0
    #: a load benchmark through the engine's server instead (``--serve``); ``lengths`` then holds its prompt range
    serve: ServePlan | None = None


@dataclass
class BenchReport:
    """What :meth:`Engine.bench` returns: one row per configuration, the markdown table, the files written."""

    rows: list[dict]
    table: str
    files: list[Path] = field(default_factory=list)


class Engine(abc.ABC):
    """A backend that runs a model with a compressed KV cache (see the module docstring).

    Parameters
    ----------
    model : ModelSpec
        The model to load, lazily: nothing is loaded before an operation needs it.
    """

    #: the ``--engine`` name
    name: ClassVar[str]
    #: options this engine cannot honour -> why (refused by :meth:`check`)
    unsupported: ClassVar[Mapping[str, str]] = {}
    #: True when the engine can compile its decode step (``--compile``, ``docs/compile.md``)
    supports_compile: ClassVar[bool] = False
    #: True when the engine keeps prefill captures across evaluation runs (``--prefill-cache``)
    supports_prefill_cache: ClassVar[bool] = False
    #: True when the engine's evaluation can measure the output-level distance to the full cache (``--fidelity``)
    supports_fidelity: ClassVar[bool] = False
    #: True when the engine's evaluation prefills a prompt (or a batch) once and replays every pair from it, so that
    #: its first outputs carry the prefill (the progress bar's time left waits for a whole prompt,
    #: :class:`slake.eval.progress.TimeLeft`)
    prefills_once: ClassVar[bool] = False
    #: names ``slake bench --methods`` takes besides slake's methods: rows of the engine's own baselines (the
    #: transformers engine's ``transformers``, its own cache without slake's); :meth:`check` refuses what they cannot
    #: be timed with, :meth:`check_pair` takes them at any budget
    bench_baselines: ClassVar[tuple[str, ...]] = ()

    def __init__(self, model: ModelSpec | None = None) -> None:
        self.model_spec = model or ModelSpec()

    def check(self, **options: Any) -> None:
        """Refuse, before anything loads, the options this engine cannot honour.

        Every option given a value other than None, False or ``"auto"`` (0 is a value: ``prefill_chunk=0`` is
        refused by an engine that does not chunk, not taken for "not given") that is in :attr:`unsupported` is
        listed in one ``ValueError``, spelled as on the command line (``prefill_chunk`` -> ``--prefill-chunk``), and
        so is ``compile``, ``prefill_cache`` or ``fidelity`` given to an engine whose ``supports_*`` attribute is
        False.
        ``methods`` (the benchmark's, when given) is not an option; engines with :attr:`bench_baselines` read it.
        Engines add their own environment checks (:meth:`check_environment`).
        """
        given = [k for k, v in options.items() if _given(v) and k in self.unsupported and k != "methods"]
        for option in ("compile", "prefill_cache", "fidelity"):
            if options.get(option) and not getattr(self, f"supports_{option}", False) and option not in given:
                given.append(option)
        if given:
            why = "; ".join(
                f"{option_flag(k)}: {self.unsupported.get(k, 'not available in this engine')}" for k in given
            )
            raise ValueError(f"--engine {self.name} does not support {', '.join(map(option_flag, given))} ({why})")
        self.check_environment()

    def check_pair(self, method: Any, budget: Any) -> None:
        """Raise ValueError for a (method, budget) pair this engine cannot run (by default: what the compressor
        refuses, e.g. an observation window larger than the budget); the engine's :attr:`bench_baselines` pass at any
        budget."""
        if method in self.bench_baselines:
            return
        check_method_budget(method, budget)

    def check_environment(self) -> None:  # noqa: B027 (optional hook)
        """Raise ValueError when this engine cannot run here (a missing package, an unsupported device)."""

    @property
    @abc.abstractmethod
    def tokenizer(self) -> Any:
        """The model's tokenizer."""

    @property
    @abc.abstractmethod
    def context_limit(self) -> int | None:
        """The model's context in tokens (its ``max_position_embeddings``), None when its configuration has none;
        :func:`slake.eval.runner.evaluate_suite` refuses prompts beyond it (:mod:`slake.engines.context`)."""

    @property
    @abc.abstractmethod
    def model_dtype(self) -> str:
        """The dtype the model runs in (``"float32"``, ``"bfloat16"`` ...), as result rows record it."""

    @property
    def model_name(self) -> str:
        """The model's name in result rows."""
        return self.model_spec.label

    @property
    def weights_digest(self) -> str | None:
        """A short digest of the weights the engine runs, as result rows record it (``weights``), so that a results
        directory refuses rows of other weights under the same ``--model`` name; None where the engine cannot read
        its weights (not compared)."""
        return None

    def profile_for(self, method: str, budget: Any) -> tuple[bool, dict | None]:
        """``(known, profile)``: the model profile entry a (method, budget) pair will run with
        (``{"source", "values", "budget"}``, None for none: :func:`slake.methods.profiles.resolve_method`), so that a
        results directory refuses a rerun with other profile values; ``known`` is False where the engine learns it
        only when the pair runs (not compared)."""
        return False, None

    @abc.abstractmethod
    def eos_token_ids(self) -> list[int]:
        """The ids that end generation in an evaluation (the tokenizer's and the generation config's)."""

    @abc.abstractmethod
    def generate(
        self, prompt: str, *, method: Any, budget: Any, max_new_tokens: int, chat_template: bool = True, **options: Any
    ) -> GenerationResult:
        """Generate a continuation of ``prompt`` with ``method`` at ``budget``.

        ``options`` are those of :func:`slake.generate` (sampling, ``prefill_chunk``, ``kv_dtype``,
        ``charge_linear_state``, ``allow_long_context``) and the method's hyperparameters.
        """

    @abc.abstractmethod
    def evaluate(self, requests: Sequence[EvalRequest], options: EvalOptions) -> Iterator[EvalOutput]:
        """Run every pending (method, budget) pair of every request, greedily, stopping on :meth:`eos_token_ids`;
        yield one :class:`EvalOutput` per pair and request, in any order, as soon as each is done."""

    @abc.abstractmethod
    def bench(self, plan: BenchPlan) -> BenchReport:
        """Measure the plan's configurations; write rows, table and plots under ``plan.out``."""


def _given(value: Any) -> bool:
    """Whether an option was given: anything but None, False and ``"auto"`` (by identity and type, so that 0, which
    equals False, counts as given)."""
    return not (value is None or value is False or (isinstance(value, str) and value == "auto"))
