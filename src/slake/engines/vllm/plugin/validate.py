"""Start-up checks: an engine option the plugin cannot honour fails with one line instead of running uncompressed."""

from __future__ import annotations

import logging

from slake.engines.vllm.plugin.config import SlakeVllmConfig

logger = logging.getLogger("slake")

#: the vLLM release whose scheduler, KV-cache manager and CPU backend internals the plugin was written against
SUPPORTED_VLLM = "0.32."
#: the plugin's methods that score each KV head from what its rank holds (its query group, the rotary embedding,
#: ``o_proj``'s columns of its heads), so that any tensor-parallel size up to the KV heads selects as one rank does
#: (``tests_vllm/test_tensor_parallel.py``); named in the refusals of the others
PER_HEAD_METHODS = "snapkv, h2o, streamingllm, keydiff, expected-attention, criticalkv"


def validate_engine_config(cfg: SlakeVllmConfig, vllm_config, *, warn: bool = True) -> None:
    """Raise ``ValueError`` (one line, starting ``slake:``) for engine options that break compression.

    Parameters
    ----------
    cfg : SlakeVllmConfig
        The plugin configuration.
    vllm_config : vllm.config.VllmConfig
        The engine's configuration.
    warn : bool
        Whether to log what is accepted but worth saying (a budget no request can exceed). An engine validates its
        configuration in its scheduler (one per engine, :mod:`slake.engines.vllm.plugin.scheduler`) and again in
        each attention metadata builder (one per KV-cache group and worker, possibly in other processes), which
        pass False, so that each engine says it once.
    """
    import vllm

    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        raise ValueError(f"slake: the vLLM plugin supports vLLM {SUPPORTED_VLLM}x, found {vllm.__version__}")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise ValueError(
            "slake: the vLLM plugin runs on vLLM's CPU attention backend only (this engine is on "
            f"{current_platform.device_name}); serve without the slake configuration"
        )
    cache = vllm_config.cache_config
    sched = vllm_config.scheduler_config
    if cache.enable_prefix_caching:
        raise ValueError(
            "slake: compressed blocks cannot be shared by prefix caching; add --no-enable-prefix-caching "
            "(enable_prefix_caching=False)"
        )
    if sched.enable_chunked_prefill:
        raise ValueError(
            "slake: compression needs each prompt prefilled in one step; add --no-enable-chunked-prefill "
            "(enable_chunked_prefill=False)"
        )
    if str(cache.cache_dtype) != "auto":
        raise ValueError(f"slake: kv_cache_dtype={cache.cache_dtype} is not supported; use the model dtype (auto)")
    if vllm_config.speculative_config is not None:
        raise ValueError("slake: speculative decoding is not supported with a compressed cache")
    max_len = getattr(vllm_config.model_config, "max_model_len", None)
    if warn and max_len is not None and cfg.budget >= int(max_len):
        # not refused: slake's own drivers size max_model_len to a run's prompts, and a run whose prompts all fit the
        # budget is uncompressed, as in the transformers engine; said once per engine, at start-up, not silently
        logger.warning(
            "slake: budget %d >= max_model_len %d: no request can exceed it, so this engine compresses nothing (it "
            "runs as plain vLLM); use a budget below max_model_len to compress",
            cfg.budget,
            int(max_len),
        )
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise ValueError(
            "slake: pipeline parallelism is not supported by the vLLM plugin (its per-request state assumes one "
            "stage holds every layer); use pipeline_parallel_size=1"
        )
    if vllm_config.parallel_config.tensor_parallel_size > 1 and cfg.method.name == "tova":
        raise ValueError(
            "slake: tova averages attention over all query heads of a layer, which tensor parallelism "
            f"splits across ranks; use tensor_parallel_size=1 or a per-head method ({PER_HEAD_METHODS})"
        )
    par = vllm_config.parallel_config
    if cfg.method.layer_budgets == "preference" and par.tensor_parallel_size > 1:
        raise ValueError(
            f"slake: {cfg.method.name}'s layer budgets come from the preferences of every layer and "
            f"KV head (a cascade over the whole model in one pass), which tensor parallelism splits "
            f"across ranks; use one rank, or a per-head method ({PER_HEAD_METHODS})"
        )
    tp = vllm_config.parallel_config.tensor_parallel_size
    if tp > 1 and tp > vllm_config.model_config.get_total_num_kv_heads():
        raise ValueError(
            f"slake: tensor_parallel_size={tp} exceeds the model's KV heads, so vLLM replicates KV heads "
            f"and a rank would score a KV head from part of its query group; use at most "
            f"{vllm_config.model_config.get_total_num_kv_heads()} ranks"
        )
    if not vllm_config.model_config.is_attention_free and getattr(vllm_config.model_config, "use_mla", False):
        raise ValueError("slake: MLA models are not supported by the vLLM plugin")
    check_layer_types(vllm_config.model_config.hf_text_config)
    from slake.engines.transformers.layer_layout import check_supported_attention

    try:  # what the transformers engine refuses (soft-capping, sinks, ...), which the plugin's steps do not model
        check_supported_attention(vllm_config.model_config.hf_config)
    except ValueError as exc:
        raise ValueError(f"slake: {exc}") from exc


def check_layer_attention(impl) -> None:
    """Refuse, when an attention layer of a slake engine is built, what its compressed steps do not compute: the
    layer's logit soft-capping, ALiBi slopes, learned sinks, sliding window, or a non-decoder attention. vLLM hands
    these to each layer's backend (``CPUAttentionBackendImpl``); its own kernel applies them to plain requests, the
    plugin's prefill scoring and batched decode would drop them (a soft-capped Gemma 2 with every layer full
    decoded without its cap)."""
    from vllm.v1.attention.backend import AttentionType

    found = []
    if getattr(impl, "logits_soft_cap", 0):
        found.append(f"logit soft-capping ({impl.logits_soft_cap})")
    if getattr(impl, "alibi_slopes", None) is not None:
        found.append("ALiBi slopes")
    if getattr(impl, "sinks", None) is not None:
        found.append("learned attention sinks")
    if getattr(impl, "sliding_window", -1) not in (-1, None):
        found.append(f"a sliding window ({impl.sliding_window})")
    if getattr(impl, "attn_type", AttentionType.DECODER) != AttentionType.DECODER:
        found.append(f"{impl.attn_type} attention")
    if found:
        raise ValueError(
            f"slake: this model's attention layers use {', '.join(found)}, which the plugin's compressed steps do "
            f"not compute; serve it without slake"
        )


def check_layer_types(text_config) -> None:
    """Refuse a model with sliding-window or chunked layers: the plugin compresses every attention layer, so it
    would evict from layers that transformers and vLLM bound by their window (the transformers engine compresses
    only the full-attention layers of such a model, ``docs/conventions.md#hybrid-models``)."""
    types = getattr(text_config, "layer_types", None) or []
    bounded = sorted({t for t in types if t != "full_attention"})
    if bounded or getattr(text_config, "sliding_window", None) is not None and not types:
        kinds = ", ".join(bounded) or "sliding_attention"
        raise ValueError(
            f"slake: the vLLM plugin compresses full-attention models only; this model has {kinds} "
            "layers (use --engine transformers, which compresses its full-attention layers)"
        )
