"""SLAKE's linear state: the first-order Taylor summary of every evicted token (``docs/methods/slake.md#linear-state``).

For each batch element and KV head the state holds ``k_sum = sum_E k_j``, ``v_sum = sum_E v_j``,
``kv = L = sum_E k_j v_j^T`` (``d x d``) and the number of folded tokens ``count = n_e``. It is shared by the ``g``
query heads of a GQA group and is never expanded per query head.

Deviation from the paper's notation: ``count`` is kept per (batch element, KV head) rather than one integer per layer,
because per-head and per-sequence budgets (left padding, per-head eviction) can make the numbers differ; it is stored as
float32 (exact up to 2**24 tokens). All accumulators are float32 whatever the model dtype
(``docs/methods/slake.md#numerical-safeguards``).
"""

from __future__ import annotations

import torch

__all__ = ["LinearState"]


_FOLD_BLOCK = 1024  # rows folded per matmul-accumulate (bounds fold's transient copies at long prompts)


class LinearState:
    """Per-(batch, KV head) PTAA accumulators of one layer, stored as one augmented matrix.

    The four accumulators live in a single ``(B, Hkv, d + 1, d + 1)`` tensor ``aug``, the sum of ``k'^T v'`` over
    the evicted tokens with ``k' = [k, 1]`` and ``v' = [v, 1]``::

        aug = [[ L        , k_sum ],
               [ v_sum^T  , count ]]

    so that folding rows is a single batched matmul-accumulate, and the PTAA linear term of a query row
    ``r = [s q, 1 - mu]`` is the single product ``r @ aug[..., :d]`` (:func:`slake.attention.ptaa.attend`). The
    number of stored floats is ``(d + 1)^2 = d^2 + 2d + 1``, exactly the separate tensors' total.

    Attributes
    ----------
    aug : torch.Tensor
        ``(B, Hkv, d + 1, d + 1)`` the augmented accumulator (float32 by default).
    k_sum, v_sum : torch.Tensor
        ``(B, Hkv, d)`` sums of the evicted keys / values (views of ``aug``).
    kv : torch.Tensor
        ``(B, Hkv, d, d)`` ``L = sum_j k_j v_j^T`` over the evicted tokens (a view of ``aug``).
    count : torch.Tensor
        ``(B, Hkv)`` number of evicted tokens folded in (a view of ``aug``).
    """

    __slots__ = ("_aug", "_ones_cache", "_parts", "_row_buffers")

    def __init__(
        self,
        aug: torch.Tensor | None = None,
        *,
        k_sum: torch.Tensor | None = None,
        v_sum: torch.Tensor | None = None,
        kv: torch.Tensor | None = None,
        count: torch.Tensor | None = None,
    ) -> None:
        if aug is None:  # the former dataclass signature LinearState(k_sum=, v_sum=, kv=, count=)
            if k_sum is None or v_sum is None or kv is None or count is None:
                raise ValueError("LinearState needs aug, or all of k_sum, v_sum, kv and count")
            B, H, d = k_sum.shape
            aug = torch.zeros(B, H, d + 1, d + 1, device=k_sum.device, dtype=k_sum.dtype)
            aug[..., :-1, -1], aug[..., -1, :-1], aug[..., :-1, :-1], aug[..., -1, -1] = k_sum, v_sum, kv, count
        if aug.ndim != 4 or aug.shape[-1] != aug.shape[-2] or aug.shape[-1] < 2:
            raise ValueError(f"aug must be (B, Hkv, d + 1, d + 1), got {tuple(aug.shape)}")
        self.aug = aug
        self._ones_cache: torch.Tensor | None = None
        self._row_buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def aug(self) -> torch.Tensor:
        return self._aug

    @aug.setter
    def aug(self, value: torch.Tensor) -> None:
        self._aug = value
        self._parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def attention_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views used by PTAA each step, made once per buffer: ``count`` ``(B, Hkv, 1, 1)``, ``[L, k_sum]``
        ``(B, Hkv, d, d + 1)`` and ``v_sum`` ``(B, Hkv, 1, d)``.

        Inside a compiled graph the views are made from :attr:`aug` afresh: cached views would enter the graph as
        inputs aliasing ``aug``, which the step mutates, and a graph with mutated aliased inputs loses its static
        inputs (then inductor skips CUDA graphs; found on an H100, ``docs/compile.md``)."""
        if torch.compiler.is_compiling():
            return self._views()
        if self._parts is None:
            self._parts = self._views()
        return self._parts

    def _views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = self._aug
        d = a.shape[-1] - 1
        return a[..., d:, d:], a[..., :d, :], a[..., d:, :d]

    @classmethod
    def empty(
        cls,
        batch: int,
        kv_heads: int,
        head_dim: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> LinearState:
        """A state with nothing folded in. ``dtype`` is float32 by default (float64 is useful in tests)."""
        if batch < 1 or kv_heads < 1 or head_dim < 1:
            raise ValueError(f"invalid LinearState shape: batch={batch}, kv_heads={kv_heads}, head_dim={head_dim}")
        if not dtype.is_floating_point or dtype.itemsize < 4:
            raise ValueError(f"the linear state must be float32 or float64, got {dtype}")
        return cls(torch.zeros(batch, kv_heads, head_dim + 1, head_dim + 1, device=device, dtype=dtype))

    # ------------------------------------------------------------------ views of the augmented matrix
    @property
    def k_sum(self) -> torch.Tensor:
        return self.aug[..., :-1, -1]

    @k_sum.setter
    def k_sum(self, value: torch.Tensor) -> None:
        _assign(self.aug[..., :-1, -1], value)

    @property
    def v_sum(self) -> torch.Tensor:
        return self.aug[..., -1, :-1]

    @v_sum.setter
    def v_sum(self, value: torch.Tensor) -> None:
        _assign(self.aug[..., -1, :-1], value)

    @property
    def kv(self) -> torch.Tensor:
        return self.aug[..., :-1, :-1]

    @kv.setter
    def kv(self, value: torch.Tensor) -> None:
        _assign(self.aug[..., :-1, :-1], value)

    @property
    def count(self) -> torch.Tensor:
        return self.aug[..., -1, -1]

    @count.setter
    def count(self, value: torch.Tensor) -> None:
        _assign(self.aug[..., -1, -1], value)

    # ------------------------------------------------------------------ shape
    @property
    def batch_size(self) -> int:
        """``B``, the batch rows."""
        return self.aug.shape[0]

    @property
    def kv_heads(self) -> int:
        """``Hkv``, the KV heads."""
        return self.aug.shape[1]

    @property
    def head_dim(self) -> int:
        """``d``, the head dimension (the accumulator is ``d + 1`` square)."""
        return self.aug.shape[2] - 1

    @property
    def dtype(self) -> torch.dtype:
        """The accumulator's dtype (float32 by default)."""
        return self.aug.dtype

    # ------------------------------------------------------------------ update
    @torch.no_grad()
    def fold(
        self, keys: torch.Tensor, values: torch.Tensor, evicted: torch.Tensor | None, finite: bool = False
    ) -> None:
        """Add the rows of ``keys``/``values`` marked in ``evicted`` to the state, in place.

        See ``docs/methods/slake.md#linear-state``.

        Parameters
        ----------
        keys, values : torch.Tensor
            ``(B, Hkv, n, d)``, any float dtype; accumulated in the state's dtype (float32).
        evicted : torch.Tensor | None
            ``(B, Hkv, n)`` bool, True for the rows to fold in. Unmarked rows are ignored even if non-finite. None:
            every row (no mask is applied).
        finite : bool
            The caller guarantees that every row is finite (the compressor's gathered decode rows): unmarked rows are
            then zeroed by a multiplication instead of two selects. Results are identical for finite rows.

        Notes
        -----
        One batched matmul-accumulate ``aug += [k, 1]^T [v, 1]`` over the marked rows updates ``L``, ``k_sum``,
        ``v_sum`` and ``count`` at once; more than 1024 rows (a prefill compaction) are folded 1024 at a time, so the
        transient ``[k, 1]`` / ``[v, 1]`` copies stay small whatever the prompt length. Folding disjoint sets one
        after the other equals folding their union once (``docs/methods/slake.md#linear-state``).
        """
        aug = self.aug
        B, H, d1, _ = aug.shape
        d = d1 - 1
        if keys.shape != values.shape or keys.shape[:2] != (B, H) or keys.shape[-1] != d or keys.ndim != 4:
            raise ValueError(
                f"keys/values must be (B={B}, Hkv={H}, n, d={d}); got {tuple(keys.shape)} and {tuple(values.shape)}"
            )
        if evicted is not None and (evicted.shape != keys.shape[:3] or evicted.dtype != torch.bool):
            raise ValueError(
                f"evicted must be a bool mask of shape {tuple(keys.shape[:3])}, got "
                f"{evicted.dtype} {tuple(evicted.shape)}"
            )
        n = keys.shape[2]
        if n > _FOLD_BLOCK:  # a prefill compaction: fold in row blocks to bound the transient copies
            for s in range(0, n, _FOLD_BLOCK):
                self.fold(
                    keys[:, :, s : s + _FOLD_BLOCK],
                    values[:, :, s : s + _FOLD_BLOCK],
                    None if evicted is None else evicted[:, :, s : s + _FOLD_BLOCK],
                    finite=finite,
                )
            return
        dt = aug.dtype
        k = keys if keys.dtype == dt else keys.to(dt)
        v = values if values.dtype == dt else values.to(dt)
        if evicted is None and n >= 128:  # many rows: [k, 1]^T [v, 1] by blocks, no concatenated copy of the rows
            aug.view(B * H, d1, d1)[:, :d, :d].baddbmm_(k.reshape(B * H, n, d).transpose(1, 2), v.reshape(B * H, n, d))
            aug[..., :d, d] += k.sum(2)
            aug[..., d, :d] += v.sum(2)
            aug[..., d, d] += n
            return
        if evicted is None:  # a few rows (a cascade stage): one product of the augmented rows
            ones = self._ones(B, H, n, v)
            kp = torch.cat([k, ones], -1).view(B * H, n, d1)
            vp = torch.cat([v, ones], -1).view(B * H, n, d1)
            aug.view(B * H, d1, d1).baddbmm_(kp.transpose(1, 2), vp)
            return
        m = (evicted if evicted.device == aug.device else evicted.to(aug.device)).unsqueeze(-1)
        mf = m.to(dt)
        if finite:
            k = k * mf  # v needs no mask: the zero rows of k' cancel it
        else:
            k = torch.where(m, k, 0.0)
            v = torch.where(m, v, 0.0)
        kp = torch.cat([k, mf], -1).view(B * H, n, d1)  # [k, 1] (0 if unmarked)
        vp = torch.cat([v, self._ones(B, H, n, v)], -1).view(B * H, n, d1)  # [v, 1]
        aug.view(B * H, d1, d1).baddbmm_(kp.transpose(1, 2), vp)

    @torch.no_grad()
    def fold_slots(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, chosen: torch.Tensor) -> None:
        """Fold the rows ``slots`` of ``keys``/``values`` where ``chosen`` is True, in place (a decode step's eviction).

        Parameters
        ----------
        keys, values : torch.Tensor
            ``(B, Hkv, n, d)`` stored rows in the state's dtype, all finite (a layer's kept, freed or zero-grown
            slots).
        slots : torch.Tensor
            ``(B, Hkv, e)`` int64 slot indices.
        chosen : torch.Tensor
            ``(B, Hkv, e)`` bool: which of ``slots`` are evicted (the others are not folded).

        Notes
        -----
        Equals ``fold(keys.gather(slots), values.gather(slots), chosen, finite=True)``: the ``e`` rows are gathered
        straight into two reused ``(B, Hkv, e, d + 1)`` buffers ``[k * c, c]`` and ``[v, 1]`` (``c`` the chosen
        flag), and ``aug += [k c, c]^T [v, 1]`` is one outer-product update when ``e == 1`` (the usual decode
        step) or one batched matmul otherwise, so a step's fold is five small operations and no allocation.
        """
        aug = self.aug
        B, H, d1, _ = aug.shape
        d = d1 - 1
        e = slots.shape[-1]
        if keys.dtype != aug.dtype or values.dtype != aug.dtype or keys.shape[-1] != d or slots.shape != chosen.shape:
            raise ValueError(
                f"fold_slots needs {aug.dtype} keys/values of width {d} and slots/chosen of one shape; "
                f"got {keys.dtype} {tuple(keys.shape)}, {tuple(slots.shape)}, {tuple(chosen.shape)}"
            )
        if torch.compiler.is_compiling():  # a graph fuses this anyway; the reused ``out=`` buffers cannot be traced
            gi = slots[..., None].expand(-1, -1, -1, d)
            c = chosen[..., None].to(aug.dtype)
            kp = torch.cat([keys.gather(2, gi) * c, c], -1)  # [k c, c]
            vp = torch.cat([values.gather(2, gi), torch.ones_like(c)], -1)  # [v, 1]
            aug.add_(torch.matmul(kp.transpose(-1, -2), vp))
            return
        buf = self._row_buffers
        if buf is None or buf[0].shape != (B, H, e, d1) or buf[0].device != aug.device:
            buf = self.new_row_buffers(e)
            if e == 1:  # a decode step's: kept for the next step; a larger eviction's are freed after it
                self._row_buffers = buf
        kb, vb = buf
        gi = slots[..., None].expand(-1, -1, -1, d)
        torch.gather(keys, 2, gi, out=kb[..., :d])
        torch.gather(values, 2, gi, out=vb[..., :d])  # vb[..., d] stays 1
        self.fold_buffered(kb[..., :d], buf, chosen)

    def new_row_buffers(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two ``(B, Hkv, e, d + 1)`` buffers for :meth:`fold_buffered`: scratch for ``[k c, c]``, and ``[v, 1]``
        (the last column set to 1 once; callers write the values into ``[..., :d]``)."""
        B, H, d1, _ = self.aug.shape
        return self.aug.new_empty(B, H, e, d1), self.aug.new_ones(B, H, e, d1)

    def fold_buffered(
        self, keys: torch.Tensor, buffers: tuple[torch.Tensor, torch.Tensor], chosen: torch.Tensor
    ) -> None:
        """``aug += [k c, c]^T [v, 1]`` for ``e`` rows per (batch, head), ``c`` the chosen flag: the fold of
        :meth:`fold_slots` once its rows are in place, also used by callers that select the rows themselves (the
        vLLM decode pool, from paged blocks).

        Parameters
        ----------
        keys : torch.Tensor
            ``(B, Hkv, e, d)`` the rows' keys in the state's dtype (may be ``buffers[0][..., :d]`` itself).
        buffers : tuple of torch.Tensor
            :meth:`new_row_buffers`' pair, the values already written into ``buffers[1][..., :d]``; the first is
            overwritten.
        chosen : torch.Tensor
            ``(B, Hkv, e)`` bool: which rows are evicted (the others add nothing).
        """
        kb, vb = buffers
        B, H, e, d1 = kb.shape
        d = d1 - 1
        c = kb[..., d:]
        c.copy_(chosen[..., None])
        torch.mul(keys, c, out=kb[..., :d])  # v needs no mask: the zero rows of [k c, c] cancel it
        if e == 1:
            self.aug.addcmul_(kb.transpose(-1, -2), vb)
        else:
            self.aug.view(B * H, d1, d1).baddbmm_(kb.view(B * H, e, d1).transpose(1, 2), vb.view(B * H, e, d1))

    def _ones(self, B: int, H: int, n: int, like: torch.Tensor) -> torch.Tensor:
        """A ``(B, H, n, 1)`` tensor of ones, reused between one-row decode folds (no allocation per step)."""
        if torch.compiler.is_compiling():  # no cached state in a graph (it would change the next step's guards)
            return like.new_ones(B, H, n, 1)
        o = self._ones_cache
        if o is None or o.shape != (B, H, n, 1) or o.device != like.device or o.dtype != like.dtype:
            o = like.new_ones(B, H, n, 1)
            if n == 1:
                self._ones_cache = o
        return o

    # ------------------------------------------------------------------ bookkeeping
    def nbytes(self) -> int:
        """Bytes of the accumulators, ``(d^2 + 2d + 1)`` numbers per (batch, KV head) (reported separately from the
        kept entries). The two ``(B, Hkv, 1, d + 1)`` scratch rows an eager decode step's fold reuses are workspace,
        not state, and are not counted (a compiled step holds none; 2 (d + 1) / (d + 1)^2 of the state, 3% at
        ``d = 64``); a larger eviction's are freed after its fold."""
        return self.aug.numel() * self.aug.element_size()

    def _map(self, fn) -> LinearState:
        return LinearState(fn(self.aug).contiguous())

    def _apply_(self, fn) -> LinearState:
        self.aug = fn(self.aug).contiguous()
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


def _assign(view: torch.Tensor, value: torch.Tensor) -> None:
    """Write ``value`` into a view of the augmented matrix (``state.k_sum += x`` lands here after the in-place add)."""
    if value.data_ptr() != view.data_ptr() or value.stride() != view.stride():
        view.copy_(value)
