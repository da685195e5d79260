"""The engine-agnostic method interface.

A method is a small object holding hyperparameters and pure tensor functions. The compressor (``slake.cache`` and
``slake.engines.transformers``) calls it at two moments:

* **prefill**, once per layer right after the layer's exact attention: :meth:`Method.prefill_scores` receives the
  layer's post-RoPE queries, keys and values and returns a per-token eviction score per KV head and, for methods with
  adaptive layer budgets, a per-sequence layer preference;
* **decode**, at every step past the budget: :meth:`Method.decode_scores` receives the current queries' attention
  probabilities over the cached slots and returns the new per-slot score; the compressor evicts the lowest-scored
  unprotected slot(s).

Protected tokens (the observation window of the ``window`` most recent tokens and ``sinks`` first tokens) are never
scored by the method: the compressor gives them ``+inf``. Padding gets ``-inf`` and is never kept.

Shapes follow the Hugging Face convention: queries ``(B, Hq, n_q, d)``, keys/values ``(B, Hkv, n_k, d)``. All
scores are float32. Methods never see a transformers object.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch

from slake.methods.decode_rule import FusedDecodeRule
from slake.methods.rotary import Rotary
from slake.methods.spec import check_hyperparameters, format_method_spec, parse_method_spec, split_method_list

LAYER_BUDGET_POLICIES = ("uniform", "pyramid", "preference")
#: what an engine can tell a method about a layer of the model (:class:`LayerContext` fields)
LAYER_FACTS = ("rotary", "out_proj")
#: second passes an engine can run for a method before compressing (:attr:`Method.second_pass`)
SECOND_PASSES = ("reconstruction",)


#: the largest float32: a hyperparameter beyond it is infinite in the float32 scores
_FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class LayerContext:
    """What the engine tells a method about one layer of the model, for methods that ask (:meth:`Method.layer_facts`).

    Attributes
    ----------
    rotary : Rotary | None
        The layer's rotary position embedding (inverse frequencies and attention scaling), for methods that move
        queries between positions (Expected Attention).
    out_proj : torch.Tensor | None
        ``(hidden, Hq * d)`` weight of the layer's output projection ``W_o`` (model dtype), for methods that weigh a
        token by what it writes into the residual stream (CriticalKV). Query head ``h`` owns columns
        ``h*d .. (h+1)*d``.
    derived : dict
        Tensors a method derives from these facts once per layer (e.g. :meth:`Method.decode_query_map`'s map),
        keyed by what they depend on; not part of the context's identity.
    """

    rotary: Rotary | None = None
    out_proj: torch.Tensor | None = None
    derived: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass
class PrefillInputs:
    """What a method sees of one layer at the end of its prefill.

    Attributes
    ----------
    queries : torch.Tensor
        ``(B, Hq, S, d)`` post-RoPE queries of the whole prompt (model dtype).
    keys, values : torch.Tensor
        ``(B, Hkv, S, d)`` post-RoPE keys and values (model dtype).
    key_padding : torch.Tensor
        ``(B, S)`` bool, True where the position is left padding.
    scaling : float
        The softmax scale the model uses (usually ``d ** -0.5``).
    window : int
        Observation window ``w`` (number of trailing queries used for scoring).
    layer_idx, num_layers : int
        Position of the layer in the model.
    budget : torch.Tensor | None
        ``(B,)`` int64 average per-layer budget ``C`` (window included) of each sequence, as resolved by the compressor.
    layer : LayerContext | None
        Facts about the layer (rotary embedding, output projection) that the engine fills for methods whose
        :meth:`Method.layer_facts` name them; None otherwise.
    pass_scores : torch.Tensor | None
        ``(L, B, Hkv, S)`` float32 per-token scores of *every* layer from the method's second pass over the prompt
        (:attr:`Method.second_pass`, e.g. KVzip's context reconstruction), filled by the engine; None otherwise.
    prompt_len : torch.Tensor | None
        ``(B,)`` int64 real (unpadded) length of each sequence's *whole* prompt, filled by the compressor (what
        ``DecodeInputs.prompt_len`` holds later). It differs from the count of ``key_padding``'s real positions
        during a chunked prefill (``slake.cache.chunked``), where these inputs hold the first chunk only: a method
        whose score depends on the prompt length ``N`` (AhaKV's gain) reads it here. None when the caller does not
        know it; the real positions of ``key_padding`` are then the whole prompt.
    """

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    key_padding: torch.Tensor
    scaling: float
    window: int
    layer_idx: int
    num_layers: int
    budget: torch.Tensor | None = None
    layer: LayerContext | None = None
    pass_scores: torch.Tensor | None = None
    prompt_len: torch.Tensor | None = None

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.queries.shape[1] // self.keys.shape[1]


@dataclass
class PrefillScores:
    """A method's verdict on one prefilled layer.

    Attributes
    ----------
    scores : torch.Tensor
        ``(B, Hkv, S)`` float32 eviction indicator; higher = keep. Values at protected and padded positions are
        ignored (the compressor overwrites them).
    preference : torch.Tensor | None
        ``(B,)`` float32 or float64 layer preference (CAKE's ``P_l``, in float64; SLAKE's VABS score), > 0, for
        methods whose ``layer_budgets == "preference"``; None otherwise.
    head_visible : torch.Tensor | None
        ``(B, Hkv, g, S)`` bool per-query-head visibility of each prompt token (query head ``h`` is ``(h // g,
        h % g)``), for methods whose query heads of one group see different subsets of the shared KV head
        (SAGE-KV's per-query-head selections). None (the default): every query head sees every kept token.
        Tokens decoded later are visible to every head.
    """

    scores: torch.Tensor
    preference: torch.Tensor | None = None
    head_visible: torch.Tensor | None = None


@dataclass
class DecodeInputs:
    """What a method sees of one layer at a decode step past its budget.

    Attributes
    ----------
    probs : torch.Tensor
        ``(B, Hq, n_q, n)`` float32 softmax of the current queries over the cached slots (invalid slots have 0).
    positions : torch.Tensor
        ``(B, Hkv, n)`` int64 absolute position of the token held in each slot (-1 for an empty slot).
    valid : torch.Tensor
        ``(B, Hkv, n)`` bool, True where the slot holds a token.
    stored : torch.Tensor
        ``(B, Hkv, n)`` float32 per-slot score carried from the previous step (prefill indicator, accumulated
        attention, ...). Methods that accumulate (H2O) add to it; others ignore it.
    prompt_len : torch.Tensor | None
        ``(B,)`` int64 real (unpadded) prompt length of each sequence, when the compressor knows it.
    budget : torch.Tensor | None
        ``(B,)`` int64 average per-layer budget ``C`` (window included) of each sequence, when known.
    newest : torch.Tensor | None
        ``(B, 1, 1)`` or ``(B, Hkv, 1)`` int64 position of the newest token, which every head holds (it was just
        appended), when the caller knows it; otherwise methods that need it take the largest valid position.
    queries : torch.Tensor | None
        ``(B, Hq, n_q, d)`` float32 post-RoPE queries of the step, already multiplied by the model's softmax scale
        (so ``queries . k`` is the logit); filled for methods with :attr:`Method.decode_reads_kv`.
    keys, values : torch.Tensor | None
        ``(B, Hkv, n, d)`` float32 keys and values of the slots (dequantised under 8-bit storage; empty slots hold
        finite values, masked by ``valid``); filled for methods with :attr:`Method.decode_reads_kv`.
    layer : LayerContext | None
        The layer's facts, as at prefill (:attr:`PrefillInputs.layer`); filled for methods that name them.
    weights : torch.Tensor | None
        ``(B, Hkv, n)`` float32 per-slot weights of a method with :attr:`Method.slot_weighted`, kept by the engine
        since each slot was written: exactly :meth:`Method.slot_weights` of the slot's (dequantised) value. None
        where the caller keeps none; the rule then computes them from ``values``.
    target : torch.Tensor | None
        ``(B, Hkv)`` int64 slots each head keeps after this eviction (-1: a row that does not evict), given where
        several tokens are evicted at once (a block of new tokens, a later prompt chunk); None at a single-token
        step, where every evicting row holds one slot over its target.
    """

    probs: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    stored: torch.Tensor
    prompt_len: torch.Tensor | None = None
    budget: torch.Tensor | None = None
    newest: torch.Tensor | None = None
    queries: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    layer: LayerContext | None = None
    weights: torch.Tensor | None = None
    target: torch.Tensor | None = None

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.probs.shape[1] // self.positions.shape[1]


@dataclass
class Method:
    """Base class of every compression method.

    Subclasses are dataclasses whose fields are the method's hyperparameters; class variables describe the method.

    Parameters
    ----------
    window : int
        Observation window ``w``: the most recent ``w`` tokens score the others and are always kept
        (``docs/methods/README.md#observation-window-attention``).
    sinks : int
        Number of initial tokens that are always kept (StreamingLLM's attention sinks); 0 for most methods.
    linear_cache : bool
        Fold every evicted token into a first-order Taylor linear state and let it contribute to attention (PTAA,
        SLAKE section 3.2). Off for plain eviction methods.
    decode_eviction : bool
        Keep the cache at its budget during decoding by evicting one token per step and KV head once over budget.

    Raises
    ------
    ValueError
        For a hyperparameter the class does not have, or a value given to the constructor that is not of its
        field's declared type (:func:`check_hyperparameters`, as :func:`make_method` checks a spec), before the
        method's own checks; or a value out of its domain.
    """

    window: int = 32
    sinks: int = 0
    linear_cache: bool = False
    decode_eviction: bool = True

    #: registry name, e.g. ``"snapkv"``
    name: ClassVar[str] = ""
    #: one-line description shown by ``slake methods``
    summary: ClassVar[str] = ""
    #: the paper the method comes from (title, venue, year)
    paper: ClassVar[str] = ""
    #: how a total budget is split across layers: "uniform", "pyramid" or "preference" (cascading, CAKE-style)
    layer_budgets: ClassVar[str] = "uniform"
    #: True when the method keeps every token (the full cache)
    keeps_everything: ClassVar[bool] = False
    #: True when the newest token may itself be evicted at decode (TOVA); the window is then not protected
    newest_evictable: ClassVar[bool] = False
    #: True when the decode rule adds every step's attention into the stored score (H2O, AhaKV; KVzip's running
    #: max): a block of several tokens fed after the prefill (a later chat turn) and a later prompt chunk of a
    #: chunked prefill (``slake.cache.chunked``) are scored from every one of their queries, as that many decode
    #: steps would add them. False: from its last ``window`` queries (at least one), its observation window, as the
    #: prefill scores the prompt; the mean over every query of a block would favour its earlier tokens, which more
    #: queries see
    decode_accumulates: ClassVar[bool] = False
    #: True when a single-token decode step evicts before its attention output (SLAKE Algorithm 1);
    #: False when the output uses the pre-eviction cache (CAKE reference code, H2O, TOVA). A multi-token block
    #: (a later chat turn) always outputs first (``slake.cache.decoding.Decoder.decode_attention``)
    evict_before_output: ClassVar[bool] = False
    #: True when the per-slot score carried into decoding for the protected prompt tokens (window, sinks) is the
    #: method's own prefill score (AhaKV seeds its running sums with it); False: they carry ``+inf`` (default)
    carry_protected_scores: ClassVar[bool] = False
    #: True when :meth:`prefill_scores` reads ``inputs.budget``; False lets prefill-once replays of one capture
    #: reuse a layer's scores across budgets (worth it for costly scores such as H2O's full attention column sums)
    prefill_scores_use_budget: ClassVar[bool] = True
    #: why the method's decode step cannot run with fixed shapes and no read-back (compiled decoding refuses it
    #: with this reason), or None when it can: its decode rule is a pure tensor function of the step's inputs
    decode_not_compileable: ClassVar[str | None] = None
    #: True when :meth:`decode_scores` reads the slots' keys/values and the step's queries (``DecodeInputs.keys``,
    #: ``values``, ``queries``), which the compressor then fills (KeyDiff, Expected Attention, CriticalKV)
    decode_reads_kv: ClassVar[bool] = False
    #: True when the decode rule reads a per-slot weight that depends on the slot's value alone (CriticalKV's
    #: ``||W_o v||_1``): the engines compute it once, when the slot is written (:meth:`slot_weights`), and hand it
    #: over as ``DecodeInputs.weights``, instead of the rule recomputing it for every kept slot at every step
    slot_weighted: ClassVar[bool] = False
    #: facts about each layer the method needs from the engine (:data:`LAYER_FACTS`; see :meth:`layer_facts`)
    needs_layer: ClassVar[tuple[str, ...]] = ()
    #: a second pass the engine must run over the prompt before compressing it (:data:`SECOND_PASSES`), whose
    #: per-token scores reach :meth:`prefill_scores` as ``PrefillInputs.pass_scores``; None for single-pass methods
    second_pass: ClassVar[str | None] = None
    #: why the method cannot prefill in chunks (``prefill_chunk``, :mod:`slake.cache.chunked`), or None when it can.
    #: Set where the method's prefill selection is by definition one-shot over the whole prompt (SAGE-KV's top-k from
    #: the prompt's last token): a chunked prefill would select from the first chunk only (or not at all when the chunk
    #: is within the budget) and leave the rest to the decode rule, silently another method. ``begin_chunked_prefill``
    #: refuses it (ValueError) before any chunk runs, as it refuses a method with a :attr:`second_pass`
    not_chunkable: ClassVar[str | None] = None

    def __new__(cls, *args: Any, **kwargs: Any) -> Method:
        # the values given (not the defaults) must have their declared types before any __post_init__ compares them:
        # a method built directly refuses what make_method refuses (vabs="false" would be a true string)
        if args or kwargs:
            given = dict(zip((f.name for f in fields(cls) if f.init), args)) | kwargs
            check_hyperparameters(cls, given, label=repr(cls.name))
        return super().__new__(cls)

    def __post_init__(self) -> None:
        # numbers held as make_method holds them (an int given for a float hyperparameter as a float): built directly,
        # Cake(gamma=10**40) kept the int, which the float32-range check below never saw, and PyramidKV(beta=20)
        # differed from make_method's (repr, hyperparameters())
        numbers_ = {f.name: getattr(self, f.name) for f in fields(self)}
        numbers_ = {k: v for k, v in numbers_.items() if isinstance(v, numbers.Number) and not isinstance(v, bool)}
        for k, v in check_hyperparameters(type(self), numbers_, label=repr(self.name)).items():
            if type(v) is not type(numbers_[k]):
                setattr(self, k, v)
        if self.window < 0 or self.sinks < 0:
            raise ValueError(
                f"{self.name}: window and sinks must be >= 0 (got window={self.window}, sinks={self.sinks})"
            )
        if self.layer_budgets not in LAYER_BUDGET_POLICIES:
            raise ValueError(f"{self.name}: unknown layer budget policy {self.layer_budgets!r}")
        if not set(self.layer_facts()) <= set(LAYER_FACTS) or self.second_pass not in (None, *SECOND_PASSES):
            raise ValueError(f"{self.name}: unknown layer facts {self.layer_facts()} or second pass {self.second_pass}")
        for f in fields(self):  # rules every method shares, so no method can forget one
            value = getattr(self, f.name)
            if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= _FLOAT32_MAX):
                raise ValueError(
                    f"{self.name}: {f.name} must be a finite number within float32's range (|x| <= 3.4e38), got {value}"
                )
            if (
                (f.name == "kernel" or f.name.endswith("_kernel"))
                and isinstance(value, int)
                and (value < 1 or value % 2 == 0)
            ):
                raise ValueError(f"{self.name}: {f.name} (a pooling kernel) must be an odd integer >= 1, got {value}")
            if f.name == "pooling" and value not in ("avg", "max"):
                raise ValueError(f"{self.name}: pooling must be 'avg' or 'max', got {value!r}")

    # ------------------------------------------------------------------ description
    @property
    def protected(self) -> int:
        """Tokens per KV head that every layer keeps no matter what (sinks + window)."""
        return self.sinks + (0 if self.newest_evictable else self.window)

    @property
    def evicts_across_heads(self) -> bool:
        """True when a decode step evicts across the KV heads of a layer (:class:`slake.methods.decode_scope.
        DecodeScope`): the layer's size is fixed, its heads grow and shrink. False: one eviction per KV head."""
        return False

    @property
    def reads_block_queries(self) -> bool:
        """True when the decode rule reads a block's queries as a distribution (Expected Attention's mean and
        covariance, ``DecodeInputs.queries``) rather than their attention: a block of several tokens after the prefill
        (a later chat turn) and a later prompt chunk then hand the rule every one of their queries, as kvpress's
        press takes its statistics over every query of a forward, while the probabilities stay those of the block's
        observation window (the logits of every query over every slot would cost ``n_q x n`` memory). False: the
        queries of the observation window, as the probabilities."""
        return False

    def layer_facts(self) -> tuple[str, ...]:
        """The :class:`LayerContext` fields this configuration needs (default :attr:`needs_layer`; a method whose
        needs depend on a hyperparameter overrides it)."""
        return self.needs_layer

    def second_pass_key(self) -> str:
        """What identifies this configuration's second-pass scores (:attr:`second_pass`): configurations with the same
        key share them (a replay at another budget, or with the linear cache). Default: every hyperparameter."""
        return repr(self)

    def hyperparameters(self) -> dict[str, Any]:
        """The method's hyperparameters as a plain dict (for results rows and ``slake methods --json``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # ------------------------------------------------------------------ scoring
    def prefill_scores(self, inputs: PrefillInputs) -> PrefillScores:
        """Score every prompt token of one layer (higher = keep). Called once per layer after its exact prefill."""
        raise TypeError(f"method {self.name!r} keeps every token and has no prefill score")

    def decode_scores(self, inputs: DecodeInputs) -> torch.Tensor:
        """Return the ``(B, Hkv, n)`` float32 per-slot score used to pick the token evicted at this decode step."""
        raise TypeError(f"method {self.name!r} does not evict at decode")

    def slot_weights(self, values: torch.Tensor, layer: LayerContext | None) -> torch.Tensor:
        """``(B, Hkv, n)`` float32 weight of each slot from its value ``values`` ``(B, Hkv, n, d)`` float32
        (methods with :attr:`slot_weighted`); a pure function of each slot's own value, so that a weight computed
        when its slot is written stays exact while the slot is kept."""
        raise TypeError(f"method {self.name!r} keeps no per-slot weight")

    def fused_rule(self) -> FusedDecodeRule | None:
        """The decode rule in the terms of the fused decode kernels (:mod:`slake.methods.decode_rule`), or None when
        it is none of their families (the step then runs in torch, and says so). Must describe
        :meth:`decode_scores` exactly: the kernels' tests compare the two."""
        return None

    def decode_query_map(self, layer: LayerContext | None, head_dim: int, device: torch.device) -> torch.Tensor | None:
        """The ``(d, d)`` float32 map ``M`` a decode rule applies to the step's scaled queries before its own
        softmax (``softmax((M q) . k)``; fused kind ``expected_attention``), or None. Made once per layer and kept in
        ``layer.derived``, so that a step finds it at a fixed address (CUDA graphs)."""
        return None

    def head_budgets(
        self, scores: torch.Tensor, selectable: torch.Tensor, *, budget: torch.Tensor | None = None, final: bool = True
    ) -> torch.Tensor:
        """Split a layer's selectable budget across its KV heads (prefill eviction).

        Parameters
        ----------
        scores : torch.Tensor
            ``(B, Hkv, n)`` float32 per-slot scores; ``+inf`` marks protected slots, ``-inf`` empty ones.
        selectable : torch.Tensor
            ``(B,)`` int64 selectable budget of the layer per KV head on average (the layer keeps
            ``selectable * Hkv`` selectable tokens in total).
        budget : torch.Tensor | None
            ``(B,)`` int64 configured average per-layer budget ``C`` (window included), for floors defined on it.
        final : bool
            False at intermediate cascade stages (``layer_budgets == "preference"``), where a method may keep a
            superset of what the final stage keeps so that cascading equals one-shot eviction.

        Returns
        -------
        torch.Tensor
            ``(B, Hkv)`` int64 selectable tokens kept per head; the compressor clamps it to ``[0, candidates]`` and adds
            the protected slots. Default: the uniform split ``min(selectable, candidates)`` for every head.
        """
        return torch.minimum(selectable.to(scores.device).view(-1, 1), torch.isfinite(scores).sum(-1))

    def pyramid_schedule(self, num_layers: int, selectable: int, prompt_len: int) -> torch.Tensor:
        """Selectable budget of every layer when ``layer_budgets == "pyramid"`` (``(L,)`` int64)."""
        raise TypeError(f"method {self.name!r} has no pyramid schedule")


_REGISTRY: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    """Class decorator adding a method to the registry under ``cls.name``.

    Parameters
    ----------
    cls : type[Method]
        A dataclass subclass of :class:`Method` with a non-empty ``name``.

    Returns
    -------
    type[Method]
        ``cls`` itself.

    Raises
    ------
    TypeError
        For anything but a subclass of :class:`Method`.
    ValueError
        For a class without a name, or a name another class holds.
    """
    if not (isinstance(cls, type) and issubclass(cls, Method)):
        raise TypeError(f"register expects a subclass of slake.methods.Method, got {cls!r}")
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"method name {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def available_methods() -> dict[str, type[Method]]:
    """Name -> class of every registered method, in registration order."""
    return dict(_REGISTRY)


def make_method(name: str | Method, **overrides: Any) -> Method:
    """Build a method by registry name or spec (``"slake[vabs=false]"``) with optional hyperparameter overrides.

    Parameters
    ----------
    name : str or Method
        A registered name, a spec ``name[key=value,...]`` (:mod:`slake.methods.spec`), or a ready Method (returned
        as is).
    **overrides
        Hyperparameters; they may not repeat a key the spec already sets.

    Raises
    ------
    ValueError
        For an unknown name, an unknown hyperparameter (listing what exists), a key set twice, or a value of the
        wrong type for its hyperparameter's declared type (e.g. ``vabs=1`` for a boolean, ``k=1.5`` for an optional
        integer; integers are accepted for floats and converted; :func:`check_hyperparameters`), or one the method
        refuses (out of its domain, or an option it cannot use).
    """
    if isinstance(name, Method):
        if overrides:
            raise ValueError("pass hyperparameters either on the Method object or as overrides, not both")
        return name
    key, from_spec = parse_method_spec(str(name))
    if key not in _REGISTRY:
        raise ValueError(f"unknown method {key!r}; available: {', '.join(sorted(_REGISTRY))}")
    cls = _REGISTRY[key]
    twice = sorted(set(from_spec) & set(overrides))
    if twice:
        raise ValueError(f"hyperparameter {', '.join(twice)} is set both in {name!r} and as an override")
    return cls(**check_hyperparameters(cls, {**from_spec, **overrides}, label=repr(name)))


def check_compileable(method: Method) -> None:
    """Raise ValueError when ``method``'s decode step cannot run with fixed shapes (compiled decoding,
    ``docs/compile.md``)."""
    reason = method.decode_not_compileable
    if reason:
        raise ValueError(f"{method.name} cannot decode with fixed shapes, so it cannot be compiled: {reason}")


def parse_method_list(text: str) -> list[str]:
    """Split a command-line method list (:func:`split_method_list`) and validate every entry with
    :func:`slake.methods.make_method`, so a typo fails before any model is loaded.

    Parameters
    ----------
    text : str
        Comma-separated method specs, e.g. ``"snapkv,slake[vabs=false,window=16]"``.

    Returns
    -------
    list of str
        The specs as written, stripped.

    Raises
    ------
    ValueError
        For an empty list, unbalanced brackets, an unknown method or hyperparameter, or a mistyped value.
    """
    methods = split_method_list(text)
    if not methods:
        raise ValueError(f"expected a comma-separated list of methods, got {text!r}")
    for m in methods:
        make_method(m)
    return methods


def canonical_method_spec(spec: str, *, drop: tuple[str, ...] = ()) -> str:
    """The canonical spec of the method ``spec`` builds, with the values the method holds (``slake[alpha=1]`` and
    ``slake[alpha=1.0]`` give the same string); keys in ``drop`` are left out (e.g. a column of their own).

    Parameters
    ----------
    spec : str
        A method spec, ``name`` or ``name[key=value,...]``.
    drop : tuple of str
        Hyperparameters left out of the result.

    Returns
    -------
    str
        :func:`format_method_spec` of the name and the overridden hyperparameters' values as the method holds them.

    Raises
    ------
    ValueError
        As :func:`slake.methods.make_method`, or for a value :func:`format_method_spec` cannot write.
    """
    name, overrides = parse_method_spec(spec)
    method = make_method(spec)
    return format_method_spec(name, {k: getattr(method, k) for k in overrides if k not in drop})


__all__ = [
    "DecodeInputs",
    "LayerContext",
    "FusedDecodeRule",
    "Method",
    "PrefillInputs",
    "PrefillScores",
    "available_methods",
    "canonical_method_spec",
    "check_compileable",
    "check_hyperparameters",
    "make_method",
    "parse_method_list",
    "register",
]
