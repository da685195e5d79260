"""The plugin's configuration: which method and budget an engine uses, and what the plugin can honour.

An engine is configured through vLLM's own ``additional_config`` (``--additional-config '{"slake": {...}}'`` on
``vllm serve``, ``additional_config={"slake": {...}}`` for ``vllm.LLM``), or, when that has no ``"slake"`` key,
through the environment variable ``SLAKE_VLLM`` holding the same JSON object (``{"method": "snapkv", "budget":
128}``); a ``"slake"`` key holding ``null`` (or ``false``) states plain vLLM, whatever the variable holds (slake's own
drivers state every configuration so, :func:`slake.engines.vllm.runner.engine_kwargs`). Keys: ``method`` (a name or
spec such as ``snapkv[window=16]``), ``budget`` (an absolute token count), ``set`` (optional hyperparameter
overrides), ``kernels`` (optional: the decode step's implementation, ``"auto"``, ``"torch"`` or ``"triton"``, as the
transformers engine's ``kernels``, :func:`slake.cache.compressed.resolve_kernels`; default ``"auto"``). Without a
configuration (no ``"slake"`` key and no variable, or ``null``/``false`` in either) the plugin changes nothing; a
configuration without ``method`` or ``budget`` is refused, never run as plain vLLM.

The plugin applies the model's hyperparameter profile itself (:func:`slake.methods.profiles.resolve_method`, from
the config of the model vLLM loads, as the transformers engine does from its model), so ``vllm serve`` with a bare
``{"method": "slake", "budget": 128}`` runs what ``slake generate --engine vllm`` runs; values in ``set`` (or in a
method spec) override the profile's.

This module imports nothing of vLLM so that it can be tested and used by the CLI without it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from slake.budgets.budget import Budget
from slake.cache.compressed import KERNELS
from slake.methods.base import Method, make_method
from slake.methods.budget_check import check_method_budget
from slake.methods.profiles import profiles_disabled
from slake.methods.spec import parse_method_spec

ENV_VAR = "SLAKE_VLLM"

#: methods the plugin runs: a uniform head split and no per-query-head visibility, with either uniform layer budgets
#: (every layer keeps the budget) or CAKE's cascading preference budgets capped at ``max_layer_budget`` (cake, and
#: slake with its PTAA linear state), so that the scheduler knows in advance the slots a request's layers can need;
#: methods that read the kept keys at decode (KeyDiff) or the model's rotary embedding and output projection
#: (Expected Attention, CriticalKV: read from vLLM's model, :mod:`slake.engines.vllm.plugin.layer_facts`) included
SUPPORTED_METHODS = (
    "streamingllm", "snapkv", "tova", "h2o", "cake", "slake", "keydiff", "expected-attention", "criticalkv"
)  # fmt: skip
#: methods with per-layer budgets (CAKE's cascade, ``docs/methods/cake.md#cascading-prefill``)
PREFERENCE_METHODS = ("cake", "slake")
#: default ``max_layer_budget`` of preference methods in vLLM, as a multiple of the budget
DEFAULT_LAYER_CAP_FACTOR = 2
_RATIO_REFUSAL = "slake: the vLLM plugin needs an absolute budget in tokens (e.g. 128), not a ratio"


@dataclass(frozen=True)
class SlakeVllmConfig:
    """A validated plugin configuration.

    Attributes
    ----------
    method : Method
        The compression method (built with :func:`slake.methods.make_method`; preference methods always have a
        ``max_layer_budget``).
    budget : int
        Cached tokens per layer and KV head on average (window included), as in ``slake generate --budget``.
    """

    method: Method
    budget: int
    #: the profile entry applied (``{"source", "values", "budget"}``, :func:`slake.methods.profiles.resolve_method`),
    #: or None when none applied
    profile: dict | None = None
    #: the decode step's implementation asked for (one of :data:`slake.cache.compressed.KERNELS`): ``"auto"`` is
    #: Triton's fused kernels on an NVIDIA GPU and the torch step elsewhere (vLLM's CPU backend: torch);
    #: ``"triton"`` on the CPU backend runs them through Triton's interpreter (``TRITON_INTERPRET=1``, tests only).
    #: Resolved when the engine starts (:class:`slake.engines.vllm.plugin.state.PluginState`); a step the kernels
    #: do not cover runs in torch, is logged, and counted in the engine's report
    kernels: str = "auto"
    #: the engine's ``max_model_len`` when known (set by the attention backend, :meth:`for_engine`): no layer of a
    #: request can keep more tokens than that, so it bounds :meth:`slots` (the decode pool's row width)
    max_model_len: int | None = None
    #: the hyperparameters a profile may set (:data:`slake.methods.profiles.SEARCHED`) that the configuration sets
    #: itself, in its method spec or ``set`` (no profile replaces them), named by :meth:`describe_profile`
    user_set: tuple[str, ...] = ()
    #: whether the profiles were off (``SLAKE_NO_PROFILE``, :func:`slake.methods.profiles.profiles_disabled`) when a
    #: profile was looked for, so that :meth:`describe_profile` does not call them missing
    profiles_off: bool = False

    def for_engine(self, max_model_len: int | None) -> SlakeVllmConfig:
        """This configuration bound to an engine whose requests hold at most ``max_model_len`` tokens."""
        return replace(self, max_model_len=None if max_model_len is None else int(max_model_len))

    @property
    def layer_tokens(self) -> int:
        """Most tokens one layer and KV head of a compressed request keeps after a step's eviction: the budget for
        uniform methods, ``max_layer_budget`` for CAKE/SLAKE (vLLM's block table is shared by all layers, so a
        request holds the largest layer's slots in every layer)."""
        cap = getattr(self.method, "max_layer_budget", None)
        return int(cap) if self.method.layer_budgets == "preference" and cap is not None else self.budget

    def compresses(self, prompt_len: int) -> bool:
        """True when a prompt of ``prompt_len`` tokens is compressed (longer than the budget), as in
        :class:`slake.cache.compressed.CompressedKV`."""
        return prompt_len > self.budget

    def slots(self, prompt_len: int | None = None) -> int:
        """Cache slots a compressed request holds per layer and KV head while decoding: what a layer keeps
        (:attr:`layer_tokens`, at most the prompt) plus the slot the newest token is written to before the step's
        eviction (the engine's ``LayerStore`` capacity). Without ``prompt_len``: the bound for any prompt, that is
        ``min(layer_tokens, max_model_len) + 1`` when the engine's :attr:`max_model_len` is known (a CAKE/SLAKE cap
        above it buys nothing: no layer keeps more tokens than a request holds)."""
        kept = self.layer_tokens
        if prompt_len is not None:
            kept = min(kept, int(prompt_len))
        elif self.max_model_len is not None:
            kept = min(kept, self.max_model_len)
        return kept + 1

    def blocks(self, block_size: int, prompt_len: int | None = None) -> int:
        """KV blocks a compressed request of ``prompt_len`` tokens holds from its first decode step on."""
        return math.ceil(self.slots(prompt_len) / block_size)

    def describe(self) -> str:
        """One line for logs: ``snapkv@128 (window=32, ...)``."""
        hp = ", ".join(f"{k}={v}" for k, v in self.method.hyperparameters().items())
        return f"{self.method.name}@{self.budget} ({hp})"

    def describe_profile(self) -> str:
        """One line for logs: which profile entry set which hyperparameters, or why none applied: the configuration
        sets every hyperparameter a profile may set, the profiles are off (``SLAKE_NO_PROFILE``), or no entry
        applies to this model (hyperparameters the configuration sets named as such)."""
        if self.profile is not None:
            values = ", ".join(f"{k}={v}" for k, v in self.profile["values"].items())
            return f"profile {self.profile['source']} (entry at budget {self.profile['budget']}): {values}"
        from slake.methods.profiles import SEARCHED  # a dict: not held in this module's namespace (no plugin state)

        searched = SEARCHED.get(self.method.name, ())
        mine = [k for k in searched if k in self.user_set]
        shown = ", ".join(f"{k}={getattr(self.method, k)}" for k in mine)
        if searched and len(mine) == len(searched):
            return f"the configuration sets {shown} itself: no profile entry is used"
        why = (
            "profiles are off (SLAKE_NO_PROFILE is set)"
            if self.profiles_off
            else "no profile entry applies to this model"
        )
        return f"{why}: the method's own values" + (f", except {shown} (set by the configuration)" if mine else "")


def _raw_from(additional_config: Any) -> dict | None:
    """The raw configuration: ``additional_config["slake"]`` when the key is there (``null`` or ``false``: plain vLLM,
    stated explicitly, whatever ``SLAKE_VLLM`` holds), else the ``SLAKE_VLLM`` variable's (``null`` or ``false``
    there: plain vLLM too), else None."""
    if isinstance(additional_config, dict) and "slake" in additional_config:
        raw = additional_config["slake"]
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f'slake: the "slake" configuration is a string that is not valid JSON ({exc}); give a JSON '
                    f'object such as {{"method": "snapkv", "budget": 128}}'
                ) from None
        return None if raw is None or raw is False else raw
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        try:
            raw = json.loads(env)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f'slake: {ENV_VAR} must hold a JSON object such as {{"method": "snapkv", "budget": 128}}: {exc}'
            ) from None
        return None if raw is None or raw is False else raw  # as a "slake" key holding null or false
    return None


def parse_config(additional_config: Any, model: Any = None) -> SlakeVllmConfig | None:
    """The plugin configuration of an engine, or None when slake is not configured.

    Parameters
    ----------
    additional_config : dict | Any
        vLLM's ``VllmConfig.additional_config``; its ``"slake"`` entry wins over the ``SLAKE_VLLM`` variable
        (``None`` there: plain vLLM, the variable ignored).
    model : transformers config, optional
        The config of the model the engine loads (vLLM's ``model_config.hf_config``): its profile fills the
        hyperparameters that the configuration does not set (:func:`slake.methods.profiles.resolve_method`). None
        applies no profile.

    Raises
    ------
    ValueError
        With one line starting ``slake:`` for anything the plugin cannot honour (unknown keys, a method outside
        :data:`SUPPORTED_METHODS`, options that change the kept-set size, a ratio budget, ``kernels`` other than
        ``auto``, ``torch`` or ``triton``).
    """
    raw = _raw_from(additional_config)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"slake: the configuration must be a JSON object, got {raw!r}")
    unknown = sorted(set(raw) - {"method", "budget", "set", "kernels"})
    if unknown:
        raise ValueError(f"slake: unknown configuration key(s) {', '.join(unknown)}; use method, budget, set, kernels")
    if "method" not in raw or "budget" not in raw:
        raise ValueError(
            'slake: the configuration needs "method" and "budget", e.g. {"method": "snapkv", "budget": 128}'
        )
    overrides = raw.get("set")
    if overrides is None:  # null or absent: no overrides; any other value that is not an object is refused
        overrides = {}
    if not isinstance(overrides, dict):
        raise ValueError(f'slake: "set" must be an object of hyperparameters, e.g. {{"window": 16}}, got {overrides!r}')
    if not isinstance(raw["method"], str):
        raise ValueError(f'slake: "method" must be a string (a name or spec, e.g. "snapkv"), got {raw["method"]!r}')
    kernels = check_kernels(raw.get("kernels", "auto"))
    from slake.methods.profiles import resolve_method

    try:
        budget = Budget(raw["budget"])
        method, profile = resolve_method(raw["method"], budget, model, **overrides)
    except ValueError as exc:
        raise ValueError(f"slake: {exc}") from None
    check_protected(method, budget)
    method = with_layer_cap(method, budget)
    check_supported(method, budget)
    from slake.methods.profiles import SEARCHED  # a dict: not held in this module's namespace (no plugin state)

    searched = SEARCHED.get(method.name, ())
    user_set = set(parse_method_spec(raw["method"])[1]) | set(overrides)  # the spec parsed once already: valid
    return SlakeVllmConfig(
        method=method,
        budget=int(budget.value),
        profile=profile,
        kernels=kernels,
        user_set=tuple(k for k in searched if k in user_set),
        profiles_off=model is not None and bool(searched) and profiles_disabled(),
    )


def check_kernels(kernels: Any) -> str:
    """``kernels`` when it names a decode-step implementation (:data:`slake.cache.compressed.KERNELS`; None:
    ``"auto"``), else a one-line ``ValueError`` naming the accepted ones. Whether the choice can run here (Triton
    installed, a GPU or the interpreter) is checked when the engine starts
    (:class:`slake.engines.vllm.plugin.state.PluginState`)."""
    if kernels is None:  # null: the default, as a null "set" is no overrides
        return "auto"
    if not isinstance(kernels, str) or kernels not in KERNELS:
        raise ValueError(f'slake: unknown "kernels" {kernels!r}; use one of {", ".join(KERNELS)}')
    return kernels


def check_protected(method: Method, budget: Budget) -> None:
    """Refuse protected tokens (window + sinks) over an absolute budget, in one ``slake:`` line naming the budget
    given: checked before :func:`with_layer_cap`, whose cap (derived from the budget) CAKE/SLAKE would otherwise
    refuse naming ``max_layer_budget``, a hyperparameter the user never set."""
    try:
        check_method_budget(method, budget)  # the transformers engine's check and message
    except ValueError as exc:
        raise ValueError(f"slake: {exc}") from None


def with_layer_cap(method: Method, budget: Budget) -> Method:
    """``method`` with ``max_layer_budget`` set for CAKE/SLAKE when the user set none: ``DEFAULT_LAYER_CAP_FACTOR``
    times the budget (the cap binds only where a layer's preference share exceeds it; the transformers engine gives
    the same tokens with ``--set max_layer_budget=<that>``). Other methods are returned unchanged."""
    if method.name in PREFERENCE_METHODS and getattr(method, "max_layer_budget", None) is None and not budget.is_ratio:
        cap: dict[str, Any] = {"max_layer_budget": DEFAULT_LAYER_CAP_FACTOR * int(budget.value)}  # CAKE/SLAKE only
        return replace(method, **cap)
    return method


def _unsupported_reason(method: Method) -> str:
    """Why the plugin's paged pool cannot run ``method`` (the first of its needs that the pool lacks)."""
    if method.second_pass is not None:
        return f"it scores the prompt with a second pass ({method.second_pass}), which the plugin does not run"
    return "it needs per-layer or per-head budgets or a linear state"


def check_supported(method: Method, budget: Budget) -> None:
    """Raise a one-line ``ValueError`` when the vLLM plugin cannot run ``method`` at ``budget`` faithfully."""
    name = method.name
    if method.keeps_everything:
        raise ValueError(
            f"slake: method {name!r} keeps the whole cache, which is plain vLLM: leave out the slake configuration "
            f'(or give "slake": null) instead'
        )
    if name not in SUPPORTED_METHODS:
        raise ValueError(
            f"slake: method {name!r} is not supported by the vLLM plugin ({_unsupported_reason(method)}); "
            f"supported: {', '.join(SUPPORTED_METHODS)}"
        )
    if getattr(method, "linear_cache", False) and name not in PREFERENCE_METHODS:
        raise ValueError(
            f"slake: {name} with linear_cache=true (PTAA) is not supported by the vLLM plugin "
            f"(only slake, and cake[linear_cache=true], keep a linear state there)"
        )
    if not getattr(method, "decode_eviction", True):
        raise ValueError(
            f"slake: {name} with decode_eviction=false is not supported by the vLLM plugin "
            f"(the cache must stay bounded at the budget)"
        )
    if method.layer_budgets not in ("uniform", "preference"):
        raise ValueError(f"slake: {name} with {method.layer_budgets} layer budgets is not supported by the vLLM plugin")
    cap = getattr(method, "max_layer_budget", None)
    if method.layer_budgets == "preference" and not budget.is_ratio and (cap is None or cap < int(budget.value)):
        raise ValueError(
            f"slake: {name} needs max_layer_budget >= the budget {budget.value} in vLLM (its block "
            f"table is shared by all layers), got {cap}"
        )
    if budget.is_ratio:
        raise ValueError(_RATIO_REFUSAL)
    check_protected(method, budget)


#: ``--dtype`` spellings of the slake CLI -> vLLM dtype names: float32 when unset or ``auto``, as the transformers
#: engine reads them on CPU (:func:`slake.engines.transformers.models.parse_dtype`), the only device ``--engine vllm``
#: runs on; vLLM's own ``auto`` would run bfloat16 there, even for a float32 checkpoint
_VLLM_DTYPES = MappingProxyType(
    {
        "fp32": "float32",
        "fp16": "float16",
        "bf16": "bfloat16",
        "half": "float16",
        "float": "float32",
        None: "float32",
        "auto": "float32",
    }
)


def vllm_dtype(dtype: str | None) -> str:
    """vLLM's name for a slake ``--dtype`` (``fp32``/``fp16``/``bf16``, ``half``, a vLLM name, or None or ``auto``
    for float32, the transformers engine's default on CPU), in any case: one name per dtype (``half`` is
    ``float16``), as result rows record it and the driver counts its bytes."""
    if isinstance(dtype, str):
        dtype = dtype.strip().lower()
    return _VLLM_DTYPES.get(dtype) or str(dtype)


def resolve_plugin_method(
    method: Method | str, budget: Budget, model: Any = None, **hyperparameters: Any
) -> tuple[Method, dict | None]:
    """The method the plugin runs for ``method`` at ``budget``: the profile of ``model`` (a model config; None: no
    profile) applied as in the transformers engine (:func:`slake.methods.profiles.resolve_method`), then vLLM's layer
    cap (:func:`with_layer_cap`), checked (:func:`check_supported`; the full cache needs no check). Returns the method
    and the profile applied. Drivers call it to refuse a configuration before starting vLLM."""
    from slake.methods.profiles import resolve_method

    built, profile = resolve_method(method, budget, model, **hyperparameters)
    if built.keeps_everything:
        return built, profile
    check_protected(built, budget)
    built = with_layer_cap(built, budget)
    check_supported(built, budget)
    return built, profile


def plugin_config(method: Method | str, budget: Budget, *, kernels: str = "auto", **overrides: Any) -> dict | None:
    """The engine's ``additional_config["slake"]`` for ``method`` at ``budget`` (None, plain vLLM, for the full
    cache), as a user of ``vllm serve`` writes it: the method (name or spec), the budget, and in ``set`` only what
    the caller sets (``overrides``), so that the plugin applies the model's profile itself. A built
    :class:`~slake.methods.base.Method` is used exactly as given: all its hyperparameters go into ``set``.
    ``kernels`` other than ``"auto"`` (the plugin's default) goes in as ``"kernels"``. A ratio budget is refused
    (``ValueError``, as the plugin refuses it), except for the full cache."""
    kernels = check_kernels(kernels)
    if (method if isinstance(method, Method) else make_method(method)).keeps_everything:
        return None
    if budget.is_ratio:  # int() of the ratio wrote "budget": 0, which the plugin refused as below one token
        raise ValueError(_RATIO_REFUSAL)
    cfg: dict[str, Any] = {"method": str(method), "budget": int(budget.value)}
    if isinstance(method, Method):
        if overrides:
            raise ValueError("pass hyperparameters either on the Method object or as overrides, not both")
        cfg = {"method": method.name, "budget": int(budget.value), "set": method.hyperparameters()}
    elif overrides:
        cfg["set"] = dict(overrides)
    if kernels != "auto":
        cfg["kernels"] = kernels
    return cfg
