"""The model's rotary position embedding (RoPE) as plain tensors, for methods that move queries between positions.

Expected Attention (``docs/methods/expected-attention.md``) needs the queries before RoPE and the rotation of future
positions. The engine hands a method the model's inverse frequencies and its attention scaling in a
:class:`Rotary` (``PrefillInputs.layer.rotary``); nothing here imports a model library.

Convention (Llama, Mistral, Qwen, Gemma, Phi-3: transformers' ``rotate_half``): the first ``r = 2 * len(inv_freq)``
channels of a head are rotated in pairs ``(i, i + r/2)`` by the angle ``p * inv_freq[i]`` and multiplied by the
attention scaling ``a`` (1 for plain RoPE); channels past ``r`` (partial rotary) pass through unchanged::

    R(p) x = a * (x * cos(p theta) + rotate_half(x) * sin(p theta))      on the rotary channels

Angles are computed in float64, so that a position of 10^5 keeps its phase to 1e-11.

An engine that cannot verify a layer's RoPE against this convention (interleaved pairs, another sign, a complex
rotation, frequencies the model recomputes during its forward) hands a :class:`RefusedRotary` instead: it carries the
reason, and every use raises it as a ValueError, so a method that moves queries is refused at its first use rather
than scoring with a wrong rotation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RefusedRotary", "Rotary", "rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` for ``x = [x1, x2]`` split in halves on the last axis."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@dataclass(frozen=True)
class Rotary:
    """A layer's rotary embedding: ``inv_freq`` ``(r/2,)`` and the attention scaling ``scaling`` (``a``).

    Methods
    -------
    rotate(x, positions, inverse=False)
        ``R(p) x`` (or ``R(p)^-1 x``) for ``x`` ``(..., n, d)`` at ``positions`` (broadcastable to ``(..., n)``).
    mean_rotation(start, count, scaled=True)
        The averaged rotation ``mean_{p=start}^{start+count-1} R(p)`` as the ``(..., r/2)`` cosine and sine factors.
    matrix(cos, sin, d)
        The ``(..., d, d)`` matrix of a rotation given by such factors.
    """

    inv_freq: torch.Tensor
    scaling: float = 1.0

    @property
    def rotary_dim(self) -> int:
        """Rotated channels per head (``2 * len(inv_freq)``)."""
        return 2 * int(self.inv_freq.numel())

    def _freq(self, device: torch.device) -> torch.Tensor:
        return self.inv_freq.to(device=device, dtype=torch.float64)

    def rotate(
        self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False, scaled: bool = True
    ) -> torch.Tensor:
        """``R(p) x`` or, with ``inverse``, ``R(p)^-1 x = R(-p) x / a``; float32, same shape as ``x``.
        ``scaled=False`` leaves out ``a`` (moving a post-RoPE vector by ``p`` positions)."""
        r = self.rotary_dim
        a = self.scaling if scaled else 1.0
        ang = positions.to(x.device, torch.float64)[..., None] * self._freq(x.device)  # (..., n, r/2)
        cos = torch.cat([ang.cos(), ang.cos()], -1).float()
        sin = torch.cat([ang.sin(), ang.sin()], -1).float()
        xr = x[..., :r].float()
        if inverse:
            out = (xr * cos - rotate_half(xr) * sin) / a
        else:
            out = (xr * cos + rotate_half(xr) * sin) * a
        return torch.cat([out, x[..., r:].float()], -1) if r < x.shape[-1] else out

    def mean_rotation(
        self, start: torch.Tensor | int, count: int, scaled: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cosine and sine factors ``(..., r/2)`` float32 of ``mean_{p=start}^{start+count-1} a R(p)``.

        Closed form (a Dirichlet kernel): ``mean_k cos((s+k) t) = D cos((s + (n-1)/2) t)`` with
        ``D = sin(n t/2) / (n sin(t/2))`` (1 where ``t = 0``), likewise for the sine. ``scaled=False`` leaves out
        ``a``: the relative rotation between two post-RoPE positions carries no scaling.
        """
        freq = self._freq(self.inv_freq.device)
        s = torch.as_tensor(start, dtype=torch.float64, device=freq.device)
        s = s[..., None] if s.ndim else s
        half = torch.sin(0.5 * freq)
        flat = half.abs() < 1e-12  # t = 0 (mod 2 pi): every rotation of the mean is the identity
        kernel = torch.sin(0.5 * count * freq) / (count * torch.where(flat, torch.ones_like(half), half))
        kernel = torch.where(flat, torch.ones_like(kernel), kernel)
        mid = (s + 0.5 * (count - 1)) * freq
        a = self.scaling if scaled else 1.0
        return (a * kernel * mid.cos()).float(), (a * kernel * mid.sin()).float()

    @staticmethod
    def matrix(cos: torch.Tensor, sin: torch.Tensor, d: int) -> torch.Tensor:
        """``(..., d, d)`` matrix ``C + S P`` of a rotation given by ``(..., r/2)`` factors (``P x = rotate_half(x)``
        on the rotary channels, identity on the others)."""
        h = cos.shape[-1]
        r = 2 * h
        m = torch.zeros(*cos.shape[:-1], d, d, dtype=cos.dtype, device=cos.device)
        idx = torch.arange(h, device=cos.device)
        m[..., idx, idx] = cos
        m[..., idx + h, idx + h] = cos
        m[..., idx, idx + h] = -sin  # (P x)[i] = -x[i + h]
        m[..., idx + h, idx] = sin  # (P x)[i + h] = x[i]
        if r < d:
            rest = torch.arange(r, d, device=cos.device)
            m[..., rest, rest] = 1.0
        return m


@dataclass(frozen=True)
class RefusedRotary(Rotary):
    """A layer's rotary embedding that slake could not verify against the rotate-half convention: ``reason`` says
    why, and :meth:`rotate` and :meth:`mean_rotation` raise it as a ValueError (``inv_freq`` is empty)."""

    reason: str = "slake could not verify the model's rotary embedding"

    def rotate(
        self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False, scaled: bool = True
    ) -> torch.Tensor:
        """Refused: raises ValueError(``reason``)."""
        raise ValueError(self.reason)

    def mean_rotation(
        self, start: torch.Tensor | int, count: int, scaled: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Refused: raises ValueError(``reason``)."""
        raise ValueError(self.reason)
