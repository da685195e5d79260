"""Expected Attention: the attention future queries are expected to pay, weighted by value norms
(``docs/methods/expected-attention.md``).

Devoto, Jeblick and Jégou, "Expected Attention: KV Cache Compression by Estimating Attention from Future Queries
Distribution", 2025 (arXiv 2510.00636; kvpress ``ExpectedAttentionPress``). Queries before RoPE are modelled as a
Gaussian ``N(mu, Sigma)`` estimated from the prompt's queries (the first ``sinks`` left out); the rotation of the
next ``F`` positions is averaged, ``R = mean_{p=S}^{S+F-1} R(p)``, and moves the statistics there
(``mu' = R mu``, ``Sigma' = R Sigma R^T``). With ``s`` the softmax scale, ``E[exp(s q.k)]`` has the closed form
``exp(s mu'.k + s^2/2 k^T Sigma' k)`` (Sec. 3); normalised over the keys, averaged over the query heads of a KV head
and weighted by the value norm it gives the score

    score_j = (mean_g softmax_j(s mu'_g.k_j + s^2/2 k_j^T Sigma'_g k_j) + eps) * ||v_j||_2

Choices and deviations (``docs/methods/expected-attention.md#deviations``):

* Queries arrive after RoPE; they are rotated back with the model's rotary embedding (``PrefillInputs.layer``), in
  float64 angles, before the statistics; kvpress recomputes them from the hidden states. The averaged rotation uses
  its closed form (a Dirichlet kernel) instead of a float32 mean over ``F`` matrices.
* Padded batches: statistics and softmax over each sequence's real tokens, future positions after its own length.
* Decode (one eviction per step and KV head; kvpress re-compresses every ``n`` steps with the statistics of a buffer
  of recent queries): the statistics are those of the step's own queries (a buffer of one: the mean is the current
  query, no covariance), moved over the next ``F`` positions by the averaged *relative* rotation; sinks are not left
  out of the softmax there (the cache does not tell where a padded sequence starts).
* Defaults are kvpress's (``sinks=4``, no window, ``F = 512``, covariance and value norms on, ``eps = 0``); the AdaKV
  form ``ada-expected-attention`` is kvpress's registry entry ``expected_attention`` (``eps = 0.01``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from slake.methods.ada_snapkv import AdaKVHeads
from slake.methods.base import DecodeInputs, LayerContext, Method, PrefillInputs, PrefillScores, register
from slake.methods.common import group_mean, real_positions
from slake.methods.decode_rule import FusedDecodeRule
from slake.methods.rotary import Rotary

__all__ = ["AdaExpectedAttention", "ExpectedAttention", "expected_attention", "query_statistics"]


def query_statistics(
    queries: torch.Tensor, key_padding: torch.Tensor, rotary: Rotary, sinks: int, covariance: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mean ``(B, Hq, d)`` and biased covariance ``(B, Hq, d, d)`` (or None) of the pre-RoPE prompt queries.

    ``queries``: ``(B, Hq, S, d)`` post-RoPE; the first ``sinks`` real tokens and the padding are left out.
    """
    B, Hq, S, d = queries.shape
    first = key_padding.sum(-1, keepdim=True)  # (B, 1) left padding
    pos = torch.arange(S, device=queries.device).view(1, -1) - first
    q = rotary.rotate(queries, pos[:, None, :], inverse=True)
    use = (~key_padding & (pos >= sinks)).to(q.dtype)[:, None, :, None]
    n = use.sum(2).clamp_min(1.0)  # (B, 1, 1)
    mu = (q * use).sum(2) / n
    if not covariance:
        return mu, None
    c = (q - mu[:, :, None]) * use
    return mu, torch.einsum("bhsi,bhsj->bhij", c, c) / n[..., None]


def expected_attention(
    mu: torch.Tensor, cov: torch.Tensor | None, keys: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``(B, Hq, n)`` softmax over the unmasked keys of ``s mu.k + s^2/2 k^T Sigma k``.

    ``mu``: ``(B, Hq, d)``; ``cov``: ``(B, Hq, d, d)`` or None; ``keys``: ``(B, Hkv, n, d)``; ``mask``: ``(B, 1 or
    Hkv, n)`` bool, True where a key takes part.
    """
    B, Hq, d = mu.shape
    Hkv, n = keys.shape[1], keys.shape[2]
    g = Hq // Hkv
    k = keys.float()
    z = torch.matmul(mu.reshape(B, Hkv, g, d), k.transpose(-1, -2)) * scaling  # (B, Hkv, g, n)
    if cov is not None:
        kc = torch.matmul(k.unsqueeze(2), cov.reshape(B, Hkv, g, d, d))  # (B, Hkv, g, n, d)
        z = z + (kc * k.unsqueeze(2)).sum(-1) * (0.5 * scaling * scaling)
    z = z.masked_fill(~mask.view(B, -1, 1, n), float("-inf"))
    return torch.softmax(z, dim=-1).nan_to_num_(0.0).reshape(B, Hq, n)


@register
@dataclass
class ExpectedAttention(Method):
    """Expected attention of future queries from Gaussian query statistics, weighted by value norms.

    Parameters
    ----------
    window : int
        Recent tokens always kept (0, as kvpress).
    sinks : int
        First tokens always kept and left out of the statistics and the softmax (4, kvpress's ``n_sink``).
    n_future : int
        Future positions the rotation is averaged over (512, kvpress's ``n_future_positions``).
    covariance : bool
        Use the query covariance (True) or the mean only.
    vnorm : bool
        Weight by the value's L2 norm (True).
    epsilon : float
        Added to the expected attention before the value weighting (0).
    """

    window: int = 0
    sinks: int = 4
    n_future: int = 512
    covariance: bool = True
    vnorm: bool = True
    epsilon: float = 0.0

    name: ClassVar[str] = "expected-attention"
    summary: ClassVar[str] = "expected attention of future queries (Gaussian statistics, RoPE-averaged) x value norm"
    paper: ClassVar[str] = (
        "Devoto, Jeblick and Jegou, Expected Attention: KV Cache Compression by Estimating Attention from Future "
        "Queries Distribution, 2025"
    )
    needs_layer: ClassVar[tuple[str, ...]] = ("rotary",)
    decode_reads_kv: ClassVar[bool] = True
    prefill_scores_use_budget: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_future < 1 or self.epsilon < 0:
            raise ValueError(f"{self.name}: need n_future >= 1 and epsilon >= 0 (got {self.n_future}, {self.epsilon})")

    def _rotary(self, layer) -> Rotary:
        if layer is None or layer.rotary is None:
            raise ValueError(f"{self.name}: needs the model's rotary embedding (LayerContext.rotary)")
        return layer.rotary

    def _weigh(self, p: torch.Tensor, values: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
        s = group_mean(p, num_kv_heads)
        return (s + self.epsilon) * values.float().norm(dim=-1) if self.vnorm else s

    def prefill_scores(self, inputs: PrefillInputs) -> PrefillScores:
        """Expected attention of the next ``n_future`` positions' queries over the prompt, value-weighted."""
        rotary = self._rotary(inputs.layer)
        pad = inputs.key_padding
        mu, cov = query_statistics(inputs.queries, pad, rotary, self.sinks, self.covariance)
        c, s = rotary.mean_rotation((~pad).sum(-1), self.n_future)  # (B, r/2): from each sequence's next position
        R = Rotary.matrix(c, s, mu.shape[-1]).to(mu.device)[:, None]  # (B, 1, d, d)
        mu = torch.matmul(R, mu[..., None])[..., 0]
        if cov is not None:
            cov = R @ cov @ R.transpose(-1, -2)
        pos = real_positions(pad)
        mask = (~pad & (pos >= self.sinks))[:, None, :]
        p = expected_attention(mu, cov, inputs.keys, mask, inputs.scaling)
        return PrefillScores(scores=self._weigh(p, inputs.values, inputs.keys.shape[1]))

    def decode_query_map(self, layer: LayerContext | None, head_dim: int, device: torch.device) -> torch.Tensor:
        """The averaged relative rotation ``R = mean_{p=1}^{F} R(p)`` (no attention scaling) that moves the step's
        query over the next ``F = n_future`` positions: ``(d, d)`` float32, made once per layer and device."""
        rotary = self._rotary(layer)
        assert layer is not None
        key = ("expected-attention rotation", self.n_future, int(head_dim), str(device))
        R = layer.derived.get(key)
        if R is None:
            c, s = rotary.mean_rotation(1, self.n_future, scaled=False)
            R = layer.derived[key] = Rotary.matrix(c, s, head_dim).to(device)
        return R

    @property
    def reads_block_queries(self) -> bool:
        """A block's statistics are those of every one of its queries (:attr:`Method.reads_block_queries`)."""
        return True

    def fused_rule(self) -> FusedDecodeRule:
        """:meth:`decode_scores` for the fused decode kernels (one query per step: the map is
        :meth:`decode_query_map`, no covariance)."""
        return FusedDecodeRule("expected_attention", value_norm=self.vnorm, epsilon=self.epsilon)

    def decode_scores(self, inputs: DecodeInputs) -> torch.Tensor:
        """Expected attention of the next ``n_future`` queries, estimated from the step's queries, value-weighted."""
        if inputs.queries is None or inputs.keys is None or inputs.values is None:
            raise ValueError(f"{self.name}: the decode step needs the queries, keys and values (decode_reads_kv)")
        q = inputs.queries  # (B, Hq, nq, d), scaled: the softmax scale is already in
        nq, d = q.shape[2], q.shape[3]
        if nq > 1:  # align every query to the newest position (row i is nq - 1 - i positions before it)
            back = torch.arange(nq - 1, -1, -1, device=q.device)
            q = self._rotary(inputs.layer).rotate(q, back, scaled=False)
        mu = q.mean(2)
        cov = None
        if self.covariance and nq > 1:
            c0 = q - mu[:, :, None]
            cov = torch.einsum("bhsi,bhsj->bhij", c0, c0) / nq
        R = self.decode_query_map(inputs.layer, d, q.device)
        mu = mu @ R.T
        if cov is not None:
            cov = R @ cov @ R.T
        p = expected_attention(mu, cov, inputs.keys, inputs.valid, 1.0)
        return self._weigh(p, inputs.values, inputs.positions.shape[1])


@register
@dataclass
class AdaExpectedAttention(AdaKVHeads, ExpectedAttention):
    """Expected Attention with AdaKV head budgets (kvpress's registry ``expected_attention``).

    Parameters
    ----------
    epsilon : float
        0.01, kvpress's registry value.
    alpha_safeguard : float
        Fraction of each head's uniform share it keeps whatever the other heads score (0.2).
    """

    epsilon: float = 0.01

    name: ClassVar[str] = "ada-expected-attention"
    summary: ClassVar[str] = "Expected Attention with AdaKV adaptive head budgets (kvpress's leaderboard entry)"
    paper: ClassVar[str] = (
        "Devoto et al., Expected Attention, 2025, with Feng et al., Ada-KV, 2024 (kvpress AdaKVPress)"
    )
