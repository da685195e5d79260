"""slake's vLLM plugin: compressed KV caches served by vLLM (optional extra ``slake[vllm]``).

This package is the only place that imports vLLM. :func:`register` is the ``vllm.general_plugins`` entry point:
vLLM calls it in every process (API server, engine core, workers). It registers the attention backend
(:mod:`slake.engines.vllm.plugin.backend`, in place of ``CPU_ATTN``), wraps the scheduler's block allocation
(:mod:`slake.engines.vllm.plugin.scheduler`) and the model runner's batch update, which tells the worker which
requests finished or were preempted (:mod:`slake.engines.vllm.plugin.worker`). All of them do nothing for an engine
without a slake configuration (:mod:`slake.engines.vllm.plugin.config`: ``--additional-config '{"slake": {"method":
"snapkv", "budget": 128}}'`` or the ``SLAKE_VLLM`` environment variable). One check holds for every engine: a
request whose ``extra_args`` name slake options of its own is refused at admission
(:mod:`slake.engines.vllm.plugin.requests`).

Every piece of per-engine state lives in objects that vLLM makes per engine (the scheduler's KV-cache manager, the
attention-metadata builder: :class:`slake.engines.vllm.plugin.state.PluginState`); the plugin's modules hold none,
so two engines in one process do not share anything by accident.
"""

from __future__ import annotations


def register() -> None:
    """The ``vllm.general_plugins`` entry point (idempotent; vLLM may call it several times per process)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from slake.engines.vllm.plugin import requests, scheduler, worker

    scheduler.install()
    requests.install()  # front end: a request naming slake options of its own is refused
    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, "slake.engines.vllm.plugin.backend.SlakeCPUAttentionBackend")
        worker.install()  # worker side: finished / preempted requests, request ids of the step's rows
