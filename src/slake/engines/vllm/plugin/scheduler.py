"""Scheduler side of the plugin: compressed requests give their surplus KV blocks back to vLLM's block pool.

vLLM 0.32 has no public hook for a request's block list, so this module wraps two methods at plugin load
(:func:`install`), both inert unless the engine is configured for slake:

* ``Scheduler.__init__``: reads the engine's slake configuration, validates the engine options
  (:func:`slake.engines.vllm.plugin.validate.validate_engine_config`, whose start-up warnings the scheduler alone
  logs: one per engine) and attaches a :class:`BlockPolicy` to the scheduler's ``KVCacheManager``;
* ``KVCacheManager.allocate_slots``: for a compressed request (prompt longer than the budget) past its prefill, the
  blocks beyond the first ``ceil(slots / block_size)`` are returned to the block pool (once, right after the
  prefill step) and no block is ever allocated again: the worker side (:mod:`slake.engines.vllm.plugin.backend`) keeps
  the request
  in ``slots`` slots per layer and KV head with the method's decode rule. ``slots`` is
  :meth:`SlakeVllmConfig.slots`: ``budget + 1`` for uniform methods, ``min(max_layer_budget, prompt) + 1`` for
  CAKE/SLAKE (whose largest layer sets the slots of all, as vLLM's block table is shared by all layers); when that
  exceeds the prompt's blocks, the first decode step allocates the newest token's block as plain vLLM does.

The decision "compressed or not" is a pure function of the prompt length and the budget, so the scheduler and the
workers agree without exchanging messages. The patches are tested against the pinned vLLM (``tests_vllm/``).
"""

from __future__ import annotations

from vllm.logger import init_logger

from slake.engines.vllm.plugin.config import SlakeVllmConfig, parse_config
from slake.engines.vllm.plugin.validate import validate_engine_config

logger = init_logger(f"vllm.plugins.{__name__}")  # under vLLM's logging configuration


class BlockPolicy:
    """Per-engine block accounting of compressed requests.

    Attributes
    ----------
    config : SlakeVllmConfig
        The engine's slake configuration.
    stats : dict[str, dict[str, int]] | None
        When not None, request id -> ``{"after_prefill": blocks, "end": blocks}`` (blocks held per KV-cache group,
        summed over groups), filled at every decode step; ``slake generate --engine vllm`` reads it.
    """

    def __init__(self, config: SlakeVllmConfig | None) -> None:
        self.config = config
        self.stats: dict[str, dict[str, int]] | None = None

    def compressed(self, request) -> bool:
        """True when the request's prompt is longer than the budget (the worker compresses it)."""
        return self.config is not None and self.config.compresses(int(request.num_prompt_tokens))

    def needs_block(self, manager, request) -> bool:
        """True when the request holds fewer blocks than its decoding needs (``slots(prompt_len)``): a CAKE/SLAKE
        prompt of at most ``max_layer_budget`` tokens may keep every token in a layer, plus the newest token's slot,
        as plain vLLM at its first decode step."""
        cfg = self.config
        assert cfg is not None  # only compressed requests are asked about
        for mgr in manager.coordinator.single_type_managers:
            held = len(mgr.req_to_blocks.get(request.request_id, ()))
            if held < cfg.blocks(mgr.block_size, int(request.num_prompt_tokens)):
                return True
        return False

    def trim(self, manager, request) -> int:
        """Return the request's blocks beyond what its ``slots(prompt_len)`` need to the pool; returns blocks freed."""
        cfg = self.config
        assert cfg is not None  # only compressed requests are trimmed
        freed = 0
        for mgr in manager.coordinator.single_type_managers:
            blocks = mgr.req_to_blocks.get(request.request_id)
            if not blocks:
                continue
            keep = cfg.blocks(mgr.block_size, int(request.num_prompt_tokens))
            if len(blocks) > keep:
                extra = blocks[keep:]
                del blocks[keep:]
                manager.block_pool.free_blocks(reversed(extra))  # tail first, as vLLM frees
                freed += len(extra)
        return freed

    def stats_for(self, output_request_id: str) -> dict[str, int]:
        """Statistics of a request by the id its ``RequestOutput`` carries (the engine core appends ``-<uuid>``)."""
        if not self.stats:
            return {}
        if output_request_id in self.stats:
            return self.stats[output_request_id]
        for key, row in self.stats.items():
            if key.startswith(output_request_id + "-"):
                return row
        return {}

    def record(self, manager, request) -> None:
        """Update the blocks-held statistics of ``request`` (no-op unless :attr:`stats` is a dict)."""
        if self.stats is None:
            return
        held = sum(len(m.req_to_blocks.get(request.request_id, ())) for m in manager.coordinator.single_type_managers)
        row = self.stats.setdefault(request.request_id, {"after_prefill": held, "end": held})
        row["end"] = held


def _wrap_allocate(original):
    def allocate_slots(self, request, num_new_tokens, *args, **kwargs):
        policy: BlockPolicy | None = getattr(self, "slake_policy", None)
        decoding = request.num_computed_tokens >= request.num_prompt_tokens
        if policy is None or not decoding:
            return original(self, request, num_new_tokens, *args, **kwargs)
        if policy.compressed(request):
            if num_new_tokens != 1 or kwargs.get("num_lookahead_tokens", 0):
                raise RuntimeError("slake: a compressed request must decode one token per step")
            if request.num_computed_tokens == request.num_prompt_tokens and policy.needs_block(self, request):
                out = original(self, request, num_new_tokens, *args, **kwargs)  # the first decode token's block
                if out is None:
                    return None  # no free block: vLLM preempts, as it would without the plugin
                policy.record(self, request)
                return out
            policy.trim(self, request)
            policy.record(self, request)
            return self.empty_kv_cache_blocks  # the request stays in its slots(prompt_len)
        out = original(self, request, num_new_tokens, *args, **kwargs)
        if out is not None:
            policy.record(self, request)
        return out

    allocate_slots._slake = True
    allocate_slots.__wrapped__ = original
    allocate_slots.__doc__ = original.__doc__
    return allocate_slots


def _wrap_init(original):
    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        cfg = parse_config(vllm_config.additional_config, vllm_config.model_config.hf_config)
        if cfg is None:
            return
        validate_engine_config(cfg, vllm_config)
        if getattr(vllm_config.scheduler_config, "async_scheduling", False):
            raise ValueError("slake: asynchronous scheduling is not supported; add --no-async-scheduling")
        # bound to the engine as the attention backend binds it: the slots logged are its decode pool's row width (a
        # CAKE/SLAKE cap above max_model_len buys nothing); a request's own blocks, slots(prompt_len), are unchanged
        cfg = cfg.for_engine(getattr(vllm_config.model_config, "max_model_len", None))
        self.kv_cache_manager.slake_policy = BlockPolicy(cfg)
        logger.info("slake: compressed requests keep %d KV slots per layer and head (%s)", cfg.slots(), cfg.describe())
        logger.info("slake: %s", cfg.describe_profile())

    __init__.__wrapped__ = original
    return __init__


def install() -> None:
    """Wrap ``Scheduler.__init__`` and ``KVCacheManager.allocate_slots`` (idempotent: the wrapper is marked)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(KVCacheManager.allocate_slots, "_slake", False):
        return
    KVCacheManager.allocate_slots = _wrap_allocate(KVCacheManager.allocate_slots)
    Scheduler.__init__ = _wrap_init(Scheduler.__init__)
