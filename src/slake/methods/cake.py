"""CAKE: Cascading and Adaptive KV cache Eviction with layer preferences (Qin et al., ICLR 2025).

Our reading: ``docs/methods/cake.md``. Per layer, from the observation-window attention ``Abar`` (the last ``w``
queries against the ``S - w`` non-window keys, fp32, rows not renormalised,
``docs/methods/README.md#observation-window-attention``):

* layer **preference** ``P = H^(1/tau1) * V^(1/tau2)`` with ``H`` the entropy of ``Abar`` and ``V`` the sum of the
  unbiased variances over the window rows (``docs/methods/cake.md#layer-preference``); the compressor turns preferences
  into budgets with :func:`slake.budgets.allocation.preference_budgets` (``docs/methods/cake.md#layer-budgets``,
  ``docs/methods/cake.md#cascading-prefill``);
* eviction **indicator** ``I = G(pool(mean_i Abar + gamma * Var_i Abar))``
  (``docs/methods/cake.md#eviction-indicator``);
* **decode** score: the pooled attention of the current query over the cached slots
  (``docs/methods/cake.md#decode-rule``).

Choices and deviations (``docs/methods/cake.md#deviations-from-the-paper``):

* Statistics are in fp32 (the reference code casts probabilities to fp16).
* Preferences are computed **per batch element** (sums over heads, rows and columns of that sample); the reference code
  sums over the batch. Padded keys have zero probability and contribute nothing; padded window rows (samples shorter
  than the window) are zeroed. With ``w == 1`` the variance is 0 (not NaN).
* Decode: probabilities are group-averaged, then pooled over *positional* neighbours
  (``docs/methods/README.md#eviction-and-positional-order``, ``sort=True``); window slots are zeroed before pooling,
  which equals the reference's pooling of ``p[..., :n-w]`` with zero padding. With ``pooling="max"`` the order
  pool/group-mean is swapped w.r.t. the reference (equal for ``avg``).
* ``tau1 = tau2 = 1`` by default; :func:`cake_taus` gives the reference code's tuned values
  (``docs/methods/cake.md#hyperparameters``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

import torch

from slake.methods.base import DecodeInputs, FusedDecodeRule, Method, PrefillInputs, PrefillScores, register
from slake.methods.common import group_mean, pool1d, pooled_outside_window, window_logits

__all__ = ["Cake", "cake_entropy", "cake_indicator", "cake_preference", "cake_taus"]

EPS = 1e-12
LOG_EPS = 1e-10

# reference code's config/model2tau.json: {family pattern: {budget C: (tau1, tau2)}}
_MODEL2TAU: dict[tuple[str, ...], dict[int, tuple[float, float]]] = {
    ("llama-2-7b",): {128: (0.9, 2.3), 1024: (1.9, 1.8)},
    ("llama-2-13b",): {128: (1.8, 2.0), 1024: (0.5, 0.4)},
    ("llama-3.1-8b",): {128: (1.6, 0.6), 1024: (1.6, 0.4)},
    ("mistral-7b", "v0.3"): {128: (1.0, 0.8), 1024: (0.8, 0.5)},
    ("qwen2.5-7b",): {128: (0.4, 0.6), 1024: (1.5, 0.6)},
}


def _family_key(name: str) -> str:
    """``name`` lower case, hub organisation dropped, alphanumerics only but for a ``|`` where separators split two
    runs of digits: ``"meta-llama/Llama-3.1-8B-Instruct"`` -> ``"llama3|1|8binstruct"``. The mark keeps
    ``Qwen2-57B`` (``"qwen2|57b"``) apart from ``Qwen2.5-7B`` (``"qwen2|5|7b"``), which dropping every separator
    made one name."""
    low = str(name).lower().rsplit("/", 1)[-1]
    return re.sub(r"[^a-z0-9|]", "", re.sub(r"(?<=\d)[^a-z0-9]+(?=\d)", "|", low))


def match_family(model_family: str, patterns: list[tuple[str, ...]]) -> tuple[str, ...] | None:
    """First pattern all of whose parts occur in the model's name, both normalised by :func:`_family_key` (any
    separators, any case: ``Llama-3.1-8B``, ``llama3.1_8b``), else None."""
    key = _family_key(model_family)
    return next((p for p in patterns if all(_family_key(part) in key for part in p)), None)


def cake_taus(model_family: str, budget: int) -> tuple[float, float]:
    """Tuned ``(tau1, tau2)`` of the reference code (``model2tau.json``); ``(1.0, 1.0)`` otherwise.

    See ``docs/methods/cake.md#hyperparameters``.

    Known families: Llama-2-7B/13B-chat, Llama-3.1-8B-Instruct, Mistral-7B-Instruct-v0.3, Qwen2.5-7B-Instruct, at
    budgets ``C = 128`` and ``1024`` exactly (other budgets use the default, as the reference code).
    """
    fam = match_family(model_family, list(_MODEL2TAU))
    return _MODEL2TAU[fam].get(int(budget), (1.0, 1.0)) if fam is not None else (1.0, 1.0)


def _row_var(abar: torch.Tensor) -> torch.Tensor:
    """Unbiased variance over the window-row axis (-2); zeros when there are fewer than two rows.

    Two passes (mean, then the sum of squared deviations) in float64, a block of columns at a time (the copy stays
    in cache at long prompts), rounded to float32 at the end: what ``abar.var(dim=-2)`` returns for float32 input on
    CPU (its Welford reduction also accumulates in float64; the two agree to the last bit on every float32 input we
    tried, ``tests/test_cake_slake_methods.py``), at a tenth of its cost, which was most of CAKE's prefill scoring.
    Float64 keeps it exact where a float32 two-pass or ``E[a^2] - E[a]^2`` would lose the small variances of stable
    columns.
    """
    w, n = abar.shape[-2], abar.shape[-1]
    if w < 2 or n == 0:
        return abar.new_zeros(abar.shape[:-2] + abar.shape[-1:])
    out = abar.new_empty(abar.shape[:-2] + abar.shape[-1:])
    step = max(1, _VAR_BLOCK // max(abar[..., 0].numel(), 1))  # columns per block: the float64 copy stays in cache
    for j in range(0, n, step):
        a = abar[..., j : j + step].to(torch.float64, copy=True)
        out[..., j : j + step] = a.sub_(a.sum(-2, keepdim=True).div_(w)).square_().sum(-2).div_(w - 1)
    return out


_VAR_BLOCK = 1 << 17  # float64 elements (1 MiB) of one column block of _row_var


def cake_entropy(abar: torch.Tensor) -> torch.Tensor:
    """``H = -sum a log(a + 1e-10)`` over heads, rows and columns of each sample, ``(B,)`` (the spatial dispersion of
    ``docs/methods/cake.md#layer-preference``); one temporary, updated in place."""
    a = abar.float()
    t = torch.add(a, LOG_EPS).log_().mul_(a)
    return -t.sum((1, 2, 3))


def cake_preference(abar: torch.Tensor, tau1: float, tau2: float, row_var: torch.Tensor | None = None) -> torch.Tensor:
    """Layer preference ``P = H^(1/tau1) * V^(1/tau2)`` per batch element, ``(B,)`` float64.

    See ``docs/methods/cake.md#layer-preference``.

    ``abar``: ``(B, Hq, w, S - w)`` window attention over the non-window keys. ``H = -sum a log(a + 1e-10)`` and
    ``V = sum_j Var_i(a)`` are summed over heads, rows and columns of each sample, clamped at ``1e-12`` before the
    powers, which are taken in float64: in float32 a small variance's power underflows to 0 (``1e-12 ** 4`` at
    ``tau2 = 0.25``, a value of ``slake calibrate``'s grid), and every layer's preference 0 would split the budget
    uniformly. ``row_var``: ``Var_i(a)`` ``(B, Hq, S - w)`` when already computed (the indicator's,
    :func:`_row_var`).
    """
    a = abar.float()
    ent = cake_entropy(a).double()
    var = (_row_var(a) if row_var is None else row_var).sum((1, 2)).double()
    return ent.clamp_min(EPS) ** (1.0 / tau1) * var.clamp_min(EPS) ** (1.0 / tau2)


def cake_indicator(
    abar: torch.Tensor,
    gamma: float,
    kernel: int,
    pooling: str,
    num_kv_heads: int,
    row_var: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention-shift tolerant indicator ``G(pool(mean_i abar + gamma * Var_i abar))``.

    See ``docs/methods/cake.md#eviction-indicator``.

    ``abar``: ``(B, Hq, w, S - w)``; returns ``(B, Hkv, S - w)`` float32 (pool first, then group mean, as the
    reference code). ``row_var``: ``Var_i(abar)`` when already computed (:func:`_row_var`).
    """
    a = abar.float()
    if a.shape[-1] == 0:  # S <= w: nothing selectable
        return a.new_zeros(a.shape[0], num_kv_heads, 0)
    raw = a.mean(-2) + gamma * (_row_var(a) if row_var is None else row_var)
    return group_mean(pool1d(raw, kernel, pooling), num_kv_heads)


@register
@dataclass
class Cake(Method):
    """CAKE (``docs/methods/cake.md``): preference-proportional cascading layer budgets, mean+variance indicator.

    Parameters
    ----------
    window : int
        Observation window ``w`` (32).
    gamma : float
        Weight of the variance term of the indicator (200, paper App. C).
    tau1, tau2 : float
        Temperatures of the entropy / variance terms of the preference (see :func:`cake_taus`).
    kernel : int
        Pooling kernel (5); ``pooling`` is ``"avg"`` (reference) or ``"max"``.
    max_layer_budget : int | None
        Optional cap on one layer's budget in tokens (window included); None (default, the paper) caps a layer only at
        the prompt length (``docs/methods/cake.md#max-layer-budget``). Not in the paper: the cascade's water-filling
        (``docs/methods/cake.md#layer-budgets``) runs with the cap ``min(S, max_layer_budget) - w`` instead of
        ``S - w``, which leaves budgets unchanged where no layer reaches the cap. A serving engine whose block table is
        shared by all layers (vLLM) needs the cap to know a request's slots in advance; it must be at least the average
        budget ``C``.
    """

    window: int = 32
    gamma: float = 200.0
    tau1: float = 1.0
    tau2: float = 1.0
    kernel: int = 5
    pooling: str = "avg"
    max_layer_budget: int | None = None

    name = "cake"
    summary = "CAKE: cascading, preference-proportional layer budgets; mean+variance window indicator"
    paper = "Qin et al., CAKE: Cascading and Adaptive KV Cache Eviction with Layer Preferences, ICLR 2025"
    layer_budgets: ClassVar[str] = "preference"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise ValueError(f"{self.name}: window must be >= 1, got {self.window}")
        if not (self.tau1 > 0 and self.tau2 > 0) or self.gamma < 0:
            raise ValueError(
                f"{self.name}: need tau1, tau2 > 0 and gamma >= 0 (got {self.tau1}, {self.tau2}, {self.gamma})"
            )
        if self.kernel < 1 or self.kernel % 2 == 0 or self.pooling not in ("avg", "max"):
            raise ValueError(
                f"{self.name}: kernel must be odd >= 1 and pooling 'avg' or 'max' (got {self.kernel}, {self.pooling!r})"
            )
        if self.max_layer_budget is not None and self.max_layer_budget <= self.protected:
            raise ValueError(
                f"{self.name}: max_layer_budget must exceed the protected window + sinks "
                f"({self.protected}), got {self.max_layer_budget}"
            )

    def prefill_scores(self, inputs: PrefillInputs) -> PrefillScores:
        """Indicator (window part 0, ignored by the compressor) and per-sample preference of one prefilled layer."""
        logits = window_logits(inputs.queries, inputs.keys, inputs.window, inputs.scaling, inputs.key_padding)
        probs = torch.softmax(logits, dim=-1)
        B, _, w, S = probs.shape
        pad = inputs.key_padding
        if pad is not None and bool(pad[:, S - w :].any()):  # padded window rows (sample shorter than w): no key
            probs.masked_fill_(pad[:, None, S - w :, None], 0.0)
        abar = probs[..., : S - w]
        row_var = _row_var(abar)  # shared by the indicator and CAKE's preference
        ind = cake_indicator(abar, self.gamma, self.kernel, self.pooling, inputs.keys.shape[1], row_var=row_var)
        scores = torch.cat([ind, ind.new_zeros(B, ind.shape[1], w)], dim=-1)
        pref = self.layer_preference(inputs, logits, probs, ind, row_var=row_var)
        return PrefillScores(scores=scores, preference=pref)

    def layer_preference(
        self,
        inputs: PrefillInputs,
        logits: torch.Tensor,
        probs: torch.Tensor,
        indicator: torch.Tensor,
        row_var: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``(B,)`` layer preference; CAKE's ``H^(1/tau1) V^(1/tau2)`` (overridden by SLAKE's VABS). ``row_var``: the
        indicator's ``Var_i(Abar)``, reused instead of computed again."""
        abar = probs[..., : probs.shape[-1] - probs.shape[-2]]
        return cake_preference(abar, self.tau1, self.tau2, row_var=row_var)

    def fused_rule(self) -> FusedDecodeRule:
        """:meth:`decode_scores` for the fused decode kernels."""
        return FusedDecodeRule(
            "pooled_attention", group="mean", kernel=self.kernel, pooling=self.pooling, zero_window=True
        )

    def decode_scores(self, inputs: DecodeInputs) -> torch.Tensor:
        """Pooled (positionally) group mean of the current queries' probabilities; ``(B, Hkv, n)``.

        See ``docs/methods/cake.md#decode-rule``.
        """
        probs = inputs.probs.float()
        # mean over query rows (one row, a decode step: the row itself, which is what the mean gives to the bit)
        p = probs[:, :, 0] if probs.shape[2] == 1 else probs.mean(2)
        s = group_mean(p, inputs.positions.shape[1])
        return pooled_outside_window(
            s, inputs.positions, inputs.valid, inputs.newest, self.window, self.kernel, self.pooling
        )
