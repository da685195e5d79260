"""SLAKE's linear state: the first-order Taylor summary of every evicted token (spec ``slake-cake.md`` section 8.2).

For each batch element and KV head the state holds ``k_sum = sum_E k_j``, ``v_sum = sum_E v_j``,
``kv = L = sum_E k_j v_j^T`` (``d x d``) and the number of folded tokens ``count = n_e``. It is shared by the ``g``
query heads of a GQA group and is never expanded per query head.

Deviations from the spec: ``count`` is kept per (batch element, KV head) rather than one integer per layer, because
per-head and per-sequence budgets (left padding, per-head eviction) can make the numbers differ; it is stored as
float32 (exact up to 2**24 tokens). All accumulators are float32 whatever the model dtype (section 11.3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LinearState"]


@dataclass
class LinearState:
    """Per-(batch, KV head) PTAA accumulators of one layer.

    Attributes
    ----------
    k_sum, v_sum : torch.Tensor
        ``(B, Hkv, d)`` sums of the evicted keys / values.
    kv : torch.Tensor
        ``(B, Hkv, d, d)`` ``L = sum_j k_j v_j^T`` over the evicted tokens.
    count : torch.Tensor
        ``(B, Hkv)`` number of evicted tokens folded in.
    """

    k_sum: torch.Tensor
    v_sum: torch.Tensor
    kv: torch.Tensor
    count: torch.Tensor

    @classmethod
    def empty(cls, batch: int, kv_heads: int, head_dim: int, device: torch.device | str | None = None,
              dtype: torch.dtype = torch.float32) -> LinearState:
        """A state with nothing folded in. ``dtype`` is float32 by default (float64 is useful in tests)."""
        if batch < 1 or kv_heads < 1 or head_dim < 1:
            raise ValueError(f"invalid LinearState shape: batch={batch}, kv_heads={kv_heads}, head_dim={head_dim}")
        if not dtype.is_floating_point or dtype.itemsize < 4:
            raise ValueError(f"the linear state must be float32 or float64, got {dtype}")
        z = dict(device=device, dtype=dtype)
        return cls(k_sum=torch.zeros(batch, kv_heads, head_dim, **z), v_sum=torch.zeros(batch, kv_heads, head_dim, **z),
                   kv=torch.zeros(batch, kv_heads, head_dim, head_dim, **z), count=torch.zeros(batch, kv_heads, **z))

    # ------------------------------------------------------------------ shape
    @property
    def batch_size(self) -> int:
        return self.k_sum.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.k_sum.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k_sum.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.k_sum.dtype

    # ------------------------------------------------------------------ update
    @torch.no_grad()
    def fold(self, keys: torch.Tensor, values: torch.Tensor, evicted: torch.Tensor) -> None:
        """Add the rows of ``keys``/``values`` marked in ``evicted`` to the state, in place.

        Parameters
        ----------
        keys, values : torch.Tensor
            ``(B, Hkv, n, d)``, any float dtype; accumulated in the state's dtype (float32).
        evicted : torch.Tensor
            ``(B, Hkv, n)`` bool, True for the rows to fold in. Unmarked rows are ignored even if non-finite.

        Notes
        -----
        ``L`` is updated with one batched matmul ``(B, Hkv, d, n) @ (B, Hkv, n, d)``. Folding disjoint sets one after
        the other equals folding their union once (spec section 8.3, invariant 8).
        """
        B, H, d = self.k_sum.shape
        if keys.shape != values.shape or keys.shape[:2] != (B, H) or keys.shape[-1] != d or keys.ndim != 4:
            raise ValueError(f"keys/values must be (B={B}, Hkv={H}, n, d={d}); got {tuple(keys.shape)} and "
                             f"{tuple(values.shape)}")
        if evicted.shape != keys.shape[:3] or evicted.dtype != torch.bool:
            raise ValueError(f"evicted must be a bool mask of shape {tuple(keys.shape[:3])}, got "
                             f"{evicted.dtype} {tuple(evicted.shape)}")
        m = evicted[..., None].to(self.k_sum.device)
        k = torch.where(m, keys.to(self.k_sum), 0.0)
        v = torch.where(m, values.to(self.v_sum), 0.0)
        self.k_sum += k.sum(2)
        self.v_sum += v.sum(2)
        self.kv += torch.matmul(k.transpose(-1, -2), v)
        self.count += m[..., 0].sum(-1).to(self.count.dtype)

    # ------------------------------------------------------------------ bookkeeping
    def nbytes(self) -> int:
        """Bytes held by the four tensors (the linear state is reported separately from the kept entries)."""
        return sum(t.numel() * t.element_size() for t in (self.k_sum, self.v_sum, self.kv, self.count))

    def _map(self, fn) -> LinearState:
        return LinearState(k_sum=fn(self.k_sum), v_sum=fn(self.v_sum), kv=fn(self.kv), count=fn(self.count))

    def _apply_(self, fn) -> LinearState:
        self.k_sum, self.v_sum, self.kv, self.count = fn(self.k_sum), fn(self.v_sum), fn(self.kv), fn(self.count)
        return self

    def select_batch(self, indices: torch.Tensor | list[int]) -> LinearState:
        """Keep / reorder batch elements ``indices`` (beam search, finished sequences), **in place**; returns self."""
        idx = torch.as_tensor(indices, dtype=torch.long).to(self.k_sum.device)
        return self._apply_(lambda t: t.index_select(0, idx))

    def repeat_interleave(self, repeats: int | torch.Tensor) -> LinearState:
        """Repeat each batch element ``repeats`` times (``num_return_sequences``), **in place**; returns self."""
        return self._apply_(lambda t: t.repeat_interleave(repeats, dim=0))

    def clone(self) -> LinearState:
        """A deep copy."""
        return self._map(torch.clone)

    def to(self, device: torch.device | str) -> LinearState:
        """A copy on ``device`` (dtype unchanged)."""
        return self._map(lambda t: t.to(device))
