"""AhaKV: adaptive holistic attention-driven KV cache eviction.

Gu et al., "AhaKV: Adaptive Holistic Attention-Driven KV Cache Eviction for Efficient Inference of Large Language
Models", arXiv 2506.03762. Our reading: ``docs/methods/ahakv.md``. Three changes to H2O-style scoring
(``docs/methods/ahakv.md#score``):

* **RA** (recent accumulation): sum the attention of the last ``r = B_r`` prompt queries only (``window``), so every
  candidate receives the same number of terms;
* **SGS** (step-gain softmax): the scoring softmax uses the logits times the gain ``c = sqrt(2 ln(N / B))``
  (``docs/methods/ahakv.md#step-gain-softmax``), which makes the expected row entropy ``log B``; ``c = 1`` at
  ``N = B * e^0.5``;
* **VPE** (value prior): multiply by ``gbar = avgpool(||v||_2^2) / max`` in (0, 1], then max-pool.

Prefill keeps the top ``B - B_r`` candidates per KV head plus the ``B_r`` newest tokens. Decode is H2O-like: after
each step's attention the step's SG-softmax row is added to every slot's running sum ``acc`` and the non-recent slot
with the smallest ``acc`` leaves, so each head stays at exactly ``B`` entries where the prompt was longer than ``B``
(a shorter one is not compressed at all, ``docs/methods/README.md#no-compression-rule``; the paper starts evicting at
decode once the cache exceeds ``B``). Budgets are uniform over layers and heads.

Where the paper is ambiguous we read it as follows (``docs/methods/ahakv.md#deviations-from-the-paper``): the gain
multiplies the standard scaled logits, ``softmax(c*A)``; ``c`` is computed once from the real prompt length ``N``
and the layer budget ``B`` (``max(N, B+1)`` when ``N <= B``) and reused at every decode step (in a chunked prefill
``N`` is the whole prompt's, ``PrefillInputs.prompt_len``, for the first chunk's scores too); it applies **only to
scoring**, the model's attention keeps its own scale; selection uses the refined, pooled score; exactly ``r`` rows;
value pool: average, kernel 7, same padding, padding not counted; score pool: max, kernel 7; decode increments carry
no value prior (literal); candidates exclude the recent window, so the total is exactly ``B``.

Choices and deviations:

* GQA (not in the paper): query-head scores are reduced to their KV head by the mean (``gqa="max"`` option);
  KV is stored per KV head.
* The score pooling runs over all prompt columns (``docs/methods/ahakv.md#deviations-from-the-paper``), so the recent
  window's partial sums can raise its neighbouring candidates; the pooled values seed ``acc`` for every kept slot, the
  recent window included (the compressor's ``carry_protected_scores``). Algorithm 1 seeds ``acc`` with the refined
  score before pooling; the spec (and this code) with the pooled one that selects.
* ``gain_floor=True`` (off by default, ``docs/methods/ahakv.md#step-gain-softmax``) floors ``c`` at 1 so short
  prompts are never flattened.
* At decode the compressor passes the standard probabilities ``p = softmax(A)`` over the cached slots; the SG row is
  computed as ``softmax(c * log p)``, which equals ``softmax(c * A)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from slake.methods.base import DecodeInputs, FusedDecodeRule, Method, PrefillInputs, PrefillScores, register
from slake.methods.common import pool1d, window_logits

__all__ = ["AhaKV", "ahakv_gain", "sg_rows", "value_prior"]


def ahakv_gain(prompt_len: torch.Tensor | float, budget: torch.Tensor | float, floor: bool = False) -> torch.Tensor:
    """SG-softmax gain ``c = sqrt(2 ln(max(N, B+1) / B))``, float64; ``floor`` clamps at 1.

    See ``docs/methods/ahakv.md#step-gain-softmax``.
    """
    n = torch.as_tensor(prompt_len, dtype=torch.float64)
    b = torch.as_tensor(budget, dtype=torch.float64).clamp_min(1.0)
    c = torch.sqrt(2.0 * torch.log(torch.maximum(n, b + 1.0) / b))
    return c.clamp_min(1.0) if floor else c


def sg_rows(inputs: PrefillInputs, gain: torch.Tensor) -> torch.Tensor:
    """SG-softmax rows of the last ``r = window`` queries, ``softmax(c * q.k * scaling)``: ``(B, Hq, r, S)`` fp32.

    ``gain``: ``(B,)`` per-sequence ``c``. Rows of padded queries (samples shorter than ``r``) are 0.
    """
    x = window_logits(inputs.queries, inputs.keys, inputs.window, inputs.scaling, inputs.key_padding)
    return torch.softmax(x * gain.to(x).view(-1, 1, 1, 1), dim=-1).nan_to_num(0.0)


def value_prior(values: torch.Tensor, key_padding: torch.Tensor, kernel: int = 7) -> torch.Tensor:
    """``gbar = gamma / max gamma`` with ``gamma = avgpool(||v||_2^2)`` (padding not counted): ``(B, Hkv, S)``."""
    B, H, S, _ = values.shape
    real = (~key_padding).to(torch.float32)[:, None, :].expand(B, H, S)
    nu = values.float().pow(2).sum(-1) * real
    if kernel > 1:
        pool = lambda t: F.avg_pool1d(t.reshape(-1, 1, S), kernel, 1, kernel // 2).reshape(B, H, S)  # noqa: E731
        nu = pool(nu) / pool(real).clamp_min(1e-12)  # = count_include_pad=False, padding tokens excluded too
    nu = nu * real
    return nu / nu.amax(-1, keepdim=True).clamp_min(1e-30)


@register
@dataclass
class AhaKV(Method):
    """AhaKV (``docs/methods/ahakv.md``).

    Parameters
    ----------
    window : int
        Recent budget ``B_r`` = accumulation rows ``r`` (32, paper 5.2.1); the ``B_r`` newest tokens are always kept.
    kernel : int
        Score pooling kernel (7) and ``pooling`` its type (``"max"``); our choice, the paper gives neither
        (``docs/methods/ahakv.md#deviations-from-the-paper``).
    value_kernel : int
        Average-pooling kernel of the squared value norms (7).
    value_prior : bool
        Apply VPE (default True; False is the paper's "w/o VPE" ablation).
    gain_floor : bool
        Floor the gain at 1 (default False, literal formula).
    gqa : str
        Query-head to KV-head reduction, ``"mean"`` (default) or ``"max"``.
    """

    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    value_kernel: int = 7
    value_prior: bool = True
    gain_floor: bool = False
    gqa: str = "mean"

    name: ClassVar[str] = "ahakv"
    summary: ClassVar[str] = "AhaKV: recent accumulation with a step-gain softmax and a value prior; H2O-style decode"
    paper: ClassVar[str] = (
        "Gu et al., AhaKV: Adaptive Holistic Attention-Driven KV Cache Eviction for Efficient "
        "Inference of Large Language Models, arXiv 2506.03762, 2025"
    )
    carry_protected_scores: ClassVar[bool] = True
    decode_accumulates: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1 or self.gqa not in ("mean", "max") or self.pooling not in ("max", "avg"):
            raise ValueError(
                f"ahakv: need window >= 1, gqa 'mean'/'max', pooling 'max'/'avg' (got {self.window}, "
                f"{self.gqa!r}, {self.pooling!r})"
            )
        for k in (self.kernel, self.value_kernel):
            if k < 1 or k % 2 == 0:
                raise ValueError(f"ahakv: pooling kernels must be odd and >= 1, got {k}")

    def _group(self, x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
        B, Hq = x.shape[:2]
        x = x.reshape(B, num_kv_heads, Hq // num_kv_heads, *x.shape[2:])
        return x.amax(2) if self.gqa == "max" else x.mean(2)

    def gain(self, prompt_len: torch.Tensor, budget: torch.Tensor | None) -> torch.Tensor:
        """Per-sequence gain ``c`` (``(B,)`` float64); without a budget (no compression) ``c = 1``."""
        if budget is None:
            return torch.ones(prompt_len.shape, dtype=torch.float64)
        return ahakv_gain(prompt_len.cpu(), budget.cpu(), self.gain_floor)

    def prefill_scores(self, inputs: PrefillInputs) -> PrefillScores:
        """Refined, pooled recent-accumulation score ``Ftil`` for every prompt token (it seeds ``acc``)."""
        # N is the whole prompt's real length (PrefillInputs.prompt_len): during a chunked prefill these inputs hold
        # the first chunk only, and the later chunks and decode steps use the whole prompt's N (DecodeInputs)
        n = inputs.prompt_len if inputs.prompt_len is not None else (~inputs.key_padding).sum(-1)
        c = self.gain(n, inputs.budget)
        f = self._group(sg_rows(inputs, c).sum(2), inputs.keys.shape[1])  # (B, Hkv, S): r terms per candidate
        if self.value_prior:
            f = f * value_prior(inputs.values, inputs.key_padding, self.value_kernel)
        f = pool1d(f, self.kernel, self.pooling)
        return PrefillScores(scores=f.masked_fill(inputs.key_padding[:, None, :], 0.0))

    def fused_rule(self) -> FusedDecodeRule:
        """:meth:`decode_scores` for the fused decode kernels."""
        return FusedDecodeRule("sharpened_accumulation", group=self.gqa, gain_floor=self.gain_floor)

    def decode_scores(self, inputs: DecodeInputs) -> torch.Tensor:
        """``acc += mean_h softmax(c * A_t)`` over the cached slots (``docs/methods/ahakv.md#decode-rule``)."""
        prompt_len = inputs.prompt_len if inputs.prompt_len is not None else inputs.valid.sum(-1).amax(-1)
        if inputs.budget is None:
            c = torch.ones_like(prompt_len, dtype=torch.float32)
        else:  # on the probabilities' device: no copy to the host at a decode step
            c = ahakv_gain(
                prompt_len.to(inputs.probs.device), inputs.budget.to(inputs.probs.device), self.gain_floor
            ).to(torch.float32)
        c = c.view(-1, 1, 1, 1)
        rows = torch.softmax(torch.log(inputs.probs.float()) * c, dim=-1).nan_to_num(0.0)
        add = self._group(rows.sum(2), inputs.positions.shape[1])
        stored = inputs.stored.masked_fill(~torch.isfinite(inputs.stored) & inputs.valid, 0.0)
        return stored + add
