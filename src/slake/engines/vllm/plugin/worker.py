"""The plugin in vLLM's worker outside the attention backend: the model runner's request events, and what drivers
read back.

**Request events.** The plugin's per-request state (:class:`slake.engines.vllm.plugin.state.PluginState`) is keyed
by vLLM's request id, and must hear when a request finishes (to free its pool row) or is preempted (to save its
kept cache while its blocks are still intact). vLLM 0.32 gives these events, and the request ids of a step's batch
rows, only to the model runner (``GPUModelRunner._update_states(scheduler_output)``, which the CPU runner
inherits): the attention-metadata builder sees block tables and lengths, not request ids. The only other worker-side
channel is a KV connector, which the user configures (``--kv-transfer-config``), of which an engine has one (it
would take the place of the connectors that serving users run, such as LMCache or NIXL), and which changes the
runner's path. So :func:`install` wraps that one method, and nothing else of the runner:

* before vLLM updates its batch: the scheduler's ``finished_req_ids`` and ``preempted_req_ids`` go to the states of
  the runner's slake builders (a preempted request's block ids are read from the runner's request table, which
  still holds them);
* after: the request ids of the step's rows (``input_batch.req_ids``, in the order the builder sees the rows) and
  their prompts' lengths (the compress decision is the prompt's, also when a preempted request is recomputed);
* and, once, the model facts that some methods read (Expected Attention's rotary embedding, CriticalKV's output
  projection) go from the runner's model to the state (:meth:`PluginState.attach_model`).

The wrapper holds no state of its own: it finds the runner's states through the runner's attention groups
(:func:`runner_states`), so it does nothing for a runner without a slake configuration, and two engines in one
process each update their own. ``tests_vllm/`` runs it against the pinned vLLM.

**Drivers** read a worker's state with vLLM's ``LLM.collective_rpc``, which calls a function with the worker in
every worker process (:func:`configure`, :func:`report`); only plain data crosses the process boundary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from slake.engines.vllm.plugin.state import PluginState

__all__ = ["configure", "install", "kv_cache_heads", "report", "runner_states"]


def runner_states(runner: Any) -> list[PluginState]:
    """The plugin states of a model runner's attention-metadata builders (empty without a slake configuration).

    Raises
    ------
    RuntimeError
        When the runner has more than one slake builder (several KV-cache groups or micro-batches): the plugin's
        cascade and decode pool span all the model's layers, so it needs one builder per engine.
    """
    out: list[PluginState] = []
    for groups in getattr(runner, "attn_groups", None) or ():
        for group in groups:
            for builder in group.metadata_builders:
                st = getattr(builder, "slake_state", None)
                if st is not None and all(st is not o for o in out):
                    out.append(st)
    if len(out) > 1:
        raise RuntimeError(
            "slake: this engine has several attention-metadata builders (KV-cache groups or micro-batches); the "
            "plugin needs one for all layers"
        )
    return out


def _prompt_len(req: Any) -> int:
    """A request's prompt length from the runner's request table (vLLM's ``CachedRequestState``); 0 when unknown."""
    return int(getattr(req, "num_prompt_tokens", 0) or 0)


def _wrap_update_states(original: Callable) -> Callable:
    def _update_states(self, scheduler_output):
        states = runner_states(self)
        for st in states:
            if st.needs_model:  # once: the model facts a method reads (rotary, o_proj)
                st.attach_model(self.get_model())
            for rid in scheduler_output.finished_req_ids:
                st.request_finished(rid)
            for rid in scheduler_output.preempted_req_ids or ():
                req = self.requests.get(rid)
                st.request_preempted(rid, list(req.block_ids[0]) if req is not None and req.block_ids else None)
        out = original(self, scheduler_output)
        if states:
            req_ids = list(self.input_batch.req_ids)
            prompt_lens = [_prompt_len(self.requests.get(rid)) for rid in req_ids]
            for st in states:
                st.step_req_ids = req_ids
                st.step_prompt_lens = prompt_lens
        return out

    _update_states._slake = True  # type: ignore[attr-defined]
    _update_states.__wrapped__ = original  # type: ignore[attr-defined]
    _update_states.__doc__ = original.__doc__
    return _update_states


def _wrap_initialize_kv_cache(original: Callable) -> Callable:
    def initialize_kv_cache(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        # the builders (and their plugin states) exist from here on: the model facts a method reads are read now, so
        # that a model the method cannot read (an interleaved rotary for Expected Attention, ...) stops the engine
        # while it starts, not at its first request
        for st in runner_states(self):
            if st.needs_model:
                st.attach_model(self.get_model())
        return out

    initialize_kv_cache._slake = True  # type: ignore[attr-defined]
    initialize_kv_cache.__wrapped__ = original  # type: ignore[attr-defined]
    initialize_kv_cache.__doc__ = original.__doc__
    return initialize_kv_cache


def install() -> None:
    """Wrap ``GPUModelRunner._update_states`` and ``initialize_kv_cache`` (idempotent: vLLM may load the plugin
    several times per process)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not getattr(GPUModelRunner.initialize_kv_cache, "_slake", False):
        GPUModelRunner.initialize_kv_cache = _wrap_initialize_kv_cache(GPUModelRunner.initialize_kv_cache)
    if getattr(GPUModelRunner._update_states, "_slake", False):
        return
    GPUModelRunner._update_states = _wrap_update_states(GPUModelRunner._update_states)


# ---------------------------------------------------------------------------------------------------------------
# For LLM.collective_rpc: each receives the worker (vLLM's worker wrapper, which forwards to the worker).


def _worker_states(worker: Any) -> list[PluginState]:
    return runner_states(getattr(worker, "model_runner", None))


def configure(
    worker: Any,
    *,
    record_runs: bool | None = None,
    timing: bool | None = None,
    clear: bool = False,
    run_log_max: int | None = None,
) -> int:
    """Turn the run log (``record_runs``) and the step timings (``timing``) on or off, and with ``clear`` empty
    both, in this worker's engine. ``run_log_max``: the most requests the run log keeps (one record per request id;
    a driver that reads back the records of ``N`` requests sets at least ``N``, so that none is dropped; default
    :attr:`PluginState.run_log_max`). Returns the number of plugin states changed (0 for plain vLLM)."""
    states = _worker_states(worker)
    for st in states:
        if record_runs is not None:
            st.record_runs = record_runs
        if run_log_max is not None:
            st.run_log_max = int(run_log_max)
        if timing is not None:
            st.timing = timing
        if clear:
            st.runs.clear()
            st.step_times.clear()
    return len(states)


def report(worker: Any) -> dict | None:
    """This worker's :meth:`PluginState.report`, or None for plain vLLM."""
    states = _worker_states(worker)
    return states[0].report() if states else None


def kv_cache_heads(worker: Any) -> tuple[int, int] | None:
    """``(KV heads, head size)`` of the cache this worker allocated (its first KV-cache group's spec: the heads of
    its attention layers as vLLM built them, this rank's share), or None before the cache exists. The model
    config's count can differ: a ``num_key_value_heads`` key an MHA architecture ignores (GPT-2, OPT)."""
    config = getattr(getattr(worker, "model_runner", None), "kv_cache_config", None)
    groups = getattr(config, "kv_cache_groups", None) or []
    for group in groups:
        spec = group.kv_cache_spec
        if hasattr(spec, "num_kv_heads") and hasattr(spec, "head_size"):
            return int(spec.num_kv_heads), int(spec.head_size)
    return None
