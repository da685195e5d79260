"""The transformers engine: slake's reference engine, a transformers model with :class:`slake.SlakeCache`."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from slake.engines.base import BenchPlan, BenchReport, Engine, EvalOptions, EvalOutput, EvalRequest, ModelSpec
from slake.engines.result import GenerationResult
from slake.engines.transformers.baselines import TRANSFORMERS
from slake.engines.transformers.generate import eos_token_ids, generate

__all__ = ["TransformersEngine"]

Loader = Callable[[ModelSpec], tuple[Any, Any]]


def _load(spec: ModelSpec) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a model spec; a random model shape has no tokenizer (None)."""
    from slake.engines.transformers.models import default_device, load_model, parse_dtype

    if spec.random:
        from slake.engines.transformers.shapes import random_model

        device = spec.device or default_device()
        return random_model(spec.random, device=device, dtype=parse_dtype(spec.dtype, device), seed=spec.seed), None
    return load_model(spec.name, device=spec.device, dtype=spec.dtype, gguf_file=spec.gguf_file)


class TransformersEngine(Engine):
    """A transformers causal LM with slake's compressed cache; every method and option is supported.

    Parameters
    ----------
    model : ModelSpec, optional
        The model to load on first use (:func:`slake.load_model`, or
        :func:`slake.engines.transformers.shapes.random_model` for a
        random shape); the packaged default model when omitted.
    loader : callable, optional
        ``loader(spec) -> (model, tokenizer)`` in place of loading the spec (tests pass a tiny model).
    """

    name = "transformers"
    supports_compile = True
    supports_prefill_cache = True
    supports_fidelity = True
    prefills_once = True
    unsupported = {"serve": "the load benchmark runs vLLM's OpenAI-compatible server: use --engine vllm"}
    #: ``slake bench``'s row of transformers' own cache (``DynamicCache``, eager, no slake cache): the decode a user
    #: has without slake, beside slake's full cache (:mod:`slake.engines.transformers.baselines`)
    bench_baselines = (TRANSFORMERS,)

    def __init__(self, model: ModelSpec | None = None, *, loader: Loader | None = None) -> None:
        super().__init__(model)
        self._loader = loader or _load
        self._loaded: tuple[Any, Any] | None = None
        self._name: str | None = None
        self._weights: str | None = None

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, name: str | None = None) -> TransformersEngine:
        """An engine over an already loaded (and prepared) model; rows name it ``name`` or its
        ``config._name_or_path``."""
        engine = cls()
        engine._loaded = (model, tokenizer)
        engine._name = name or str(getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__)
        return engine

    def load(self) -> tuple[Any, Any]:
        """``(model, tokenizer)``, loaded on the first call."""
        if self._loaded is None:
            self._loaded = self._loader(self.model_spec)
        return self._loaded

    @property
    def model(self) -> Any:
        """The transformers model (loads it)."""
        return self.load()[0]

    @property
    def tokenizer(self) -> Any:
        return self.load()[1]

    @property
    def context_limit(self) -> int | None:
        """The loaded model's ``max_position_embeddings`` (loads it)."""
        from slake.engines.context import context_limit

        return context_limit(self.model.config)

    @property
    def model_dtype(self) -> str:
        """The loaded model's floating-point dtype (loads it)."""
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), None)
        return str(dtype).removeprefix("torch.") if dtype is not None else "unknown"

    @property
    def model_name(self) -> str:
        return self._name or self.model_spec.label

    @property
    def weights_digest(self) -> str | None:
        """The first 16 hex digits of :func:`slake.engines.transformers.prefill_once.weights_digest` of the loaded
        model (loads it; one pass over the weights, once); None for a model with offloaded (meta) weights."""
        if self._weights is None:
            from slake.engines.transformers.prefill_once import weights_digest

            digest = weights_digest(self.model)
            self._weights = "" if digest is None else digest[:16]
        return self._weights or None

    def profile_for(self, method: str, budget: Any) -> tuple[bool, dict | None]:
        """The profile entry the pair runs with, from the evaluation's own
        :func:`slake.engines.transformers.evaluate.method_for_pair` (loads the model)."""
        from slake.engines.transformers.evaluate import method_for_pair

        return True, method_for_pair(self.model, method, budget)[1]

    def eos_token_ids(self) -> list[int]:
        model, tokenizer = self.load()
        return eos_token_ids(model, tokenizer)

    def generate(
        self, prompt: str, *, method: Any, budget: Any, max_new_tokens: int, chat_template: bool = True, **options: Any
    ) -> GenerationResult:
        model, tokenizer = self.load()
        if tokenizer is None:  # a random model shape (benchmarks): there is no text to encode the prompt with
            raise ValueError(
                f"{self.model_name} has no tokenizer (a random model shape, for benchmarks): generate text with a "
                "model that has one (random shapes are for slake bench and the pool benchmarks)"
            )
        return generate(
            model,
            tokenizer,
            prompt,
            method=method,
            budget=budget,
            max_new_tokens=max_new_tokens,
            chat_template=chat_template,
            **options,
        )

    def evaluate(self, requests: Sequence[EvalRequest], options: EvalOptions) -> Iterator[EvalOutput]:
        from slake.engines.transformers.evaluate import evaluate
        from slake.engines.transformers.reconstruction import ReconstructionPrompt

        tok = self.tokenizer
        prompt = ReconstructionPrompt.from_tokenizer(tok) if tok is not None else None
        return evaluate(self.model, requests, options, self.eos_token_ids(), reconstruction=prompt)

    def check(self, **options: Any) -> None:
        """:meth:`Engine.check`, and with ``transformers`` among the benchmark's ``methods``: refuse what would time
        something else under its name (it is transformers' own cache, eager, unchunked, in the model's dtype)."""
        super().check(**options)
        if TRANSFORMERS not in (options.get("methods") or ()):
            return
        refused = [
            flag
            for flag, given in (
                ("--compile (it is timed eager only: it is not slake's static cache)", options.get("compile")),
                ("--kv-dtype other than auto", options.get("kv_dtype") not in (None, "auto")),
                ("--prefill-chunk", options.get("prefill_chunk") is not None),
            )
            if given
        ]
        if refused:
            raise ValueError(
                f"--methods {TRANSFORMERS} (transformers' own DynamicCache) cannot run with {', '.join(refused)}"
            )

    def bench(self, plan: BenchPlan) -> BenchReport:
        from slake.engines.transformers.bench import run_bench

        # the plan's own options, as ``slake bench`` checks them before calling this: a Python caller's plan with
        # transformers' own cache and 8-bit storage, chunks or compile was measured as the plain DynamicCache and
        # its rows said kv_dtype, prefill_chunk or compile all the same
        kv_dtypes = [k for k in plan.kv_dtypes if k not in (None, "auto")]
        self.check(
            serve=plan.serve is not None,
            compile=plan.compile,
            kv_dtype=",".join(map(str, kv_dtypes)) or None,
            prefill_chunk=plan.prefill_chunk,
            methods=plan.methods,
        )
        if plan.isolate and (self._name is not None or self._loader is not _load):
            # each isolated configuration's process loads self.model_spec, which is not the model this engine holds
            # (from_model, a loader): its rows measured the default model under this engine's name
            raise ValueError(
                "isolate runs each configuration in a fresh process that loads the engine's ModelSpec, and this "
                "engine holds a model given in memory (from_model or a loader): build the engine from a ModelSpec "
                "(make_engine('transformers', ModelSpec(...))), or benchmark without isolate"
            )
        return run_bench(plan, self.model_spec, self.model_name, lambda: self.model)
