"""slake's vLLM plugin: compressed KV caches served by vLLM (optional extra ``slake[vllm]``).

This package is the only place that imports vLLM. :func:`register` is the ``vllm.general_plugins`` entry point:
vLLM calls it in every process (API server, engine core, workers). It registers the attention backend
(:mod:`slake.engines.vllm.plugin.backend`, in place of ``CPU_ATTN``) and wraps the scheduler's block allocation
(:mod:`slake.engines.vllm.plugin.scheduler`). Both do nothing for an engine without a slake configuration
(:mod:`slake.engines.vllm.plugin.config`: ``--additional-config '{"slake": {"method": "snapkv", "budget": 128}}'`` or
the
``SLAKE_VLLM`` environment variable).
"""

from __future__ import annotations


def register() -> None:
    """The ``vllm.general_plugins`` entry point (idempotent; vLLM may call it several times per process)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from slake.engines.vllm.plugin import scheduler

    scheduler.install()
    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, "slake.engines.vllm.plugin.backend.SlakeCPUAttentionBackend")
        from slake.engines.vllm.plugin.backend import install_runner_hook

        install_runner_hook()  # worker side: finished / preempted requests, request ids of the step's rows
