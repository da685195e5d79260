"""How a total KV budget is split across layers.

See ``docs/methods/baselines.md#pyramid-budgets``, ``docs/methods/cake.md#layer-budgets`` and
``docs/methods/cake.md#cascading-prefill``.

Every budget returned here is a **selectable** (non-window) token count per layer and KV head, ``B_l`` in the notation
of ``docs/methods/cake.md``; the engine adds the protected window ``w`` on top. Integer results are ``int64`` tensors,
real-valued ones ``float64``.

* :func:`uniform_budgets` - every layer gets ``C'`` (SnapKV, H2O, ...).
* :func:`pyramid_budgets` - PyramidKV's linearly decreasing schedule (KVCache-Factory, October 2024),
  ``docs/methods/baselines.md#pyramid-budgets``.
* :func:`preference_budgets` - CAKE's preference-proportional allocation with our rounding
  (``docs/methods/cake.md#layer-budgets``, ``docs/methods/cake.md#deviations-from-the-paper``): proportional
  water-filling under a per-layer cap, ``ceil`` at intermediate cascade stages and largest-remainder rounding at the
  final stage. This guarantees integer stage budgets that never increase from one cascade stage to the next
  (Proposition 1), which is what makes cascading equal one-shot eviction (Theorem 1). Deviation: the reference CAKE
  code's ``adjust_budgets`` (truncate, even redistribution) is not reproduced, because it breaks Theorem 1
  (``docs/methods/cake.md#deviations-from-the-paper``).
* :func:`cross_head_counts` / :func:`safeguarded_head_counts` - AdaKV/LAVa per-head budgets: one top-k over all
  KV heads of a layer (``docs/methods/lava.md#head-budgets``), optionally with AdaKV's safeguard floor
  (``docs/methods/lava.md#safeguard``).
"""

from __future__ import annotations

import math
import numbers
import operator
import sys
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "cross_head_counts",
    "largest_remainder",
    "preference_budgets",
    "pyramid_budgets",
    "safeguarded_head_counts",
    "uniform_budgets",
    "waterfill",
]


def _as_int(value: Any, what: str) -> int:
    """``value`` as an int (anything with ``__index__``: numpy and 0-d torch integers too); TypeError naming ``what``
    for anything else, a bool included."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{what} must be an integer, got {value!r}")


def _check_real(value: Any, what: str) -> None:
    """TypeError naming ``what`` unless ``value`` is a real number (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a real number, got {value!r}")


def _check_scores(scores: Any, per_row: Any, what: str) -> None:
    """TypeError / ValueError unless ``scores`` is a ``(B, H, n)`` tensor and ``per_row`` (named ``what``) a tensor
    of ``B`` (or one) entries."""
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"scores must be a (B, H, n) torch.Tensor, got {type(scores).__name__}")
    if scores.ndim != 3:
        raise ValueError(f"scores must have shape (B, H, n), got {tuple(scores.shape)}")
    if not isinstance(per_row, torch.Tensor):
        raise TypeError(f"{what} must be a (B,) int64 torch.Tensor, got {type(per_row).__name__}")
    if per_row.numel() not in (1, scores.shape[0]):
        raise ValueError(f"{what} must have one entry per sequence ({scores.shape[0]}), got {tuple(per_row.shape)}")


def _as_prefs(prefs: Sequence[float] | torch.Tensor) -> torch.Tensor:
    p = torch.as_tensor(prefs, dtype=torch.float64).detach().cpu()
    if p.ndim != 1 or p.numel() == 0:
        raise ValueError(f"preferences must be a non-empty 1-D sequence, got shape {tuple(p.shape)}")
    if not bool(torch.isfinite(p).all()) or bool((p < 0).any()):
        raise ValueError(f"preferences must be finite and >= 0, got {p.tolist()}")
    return p


def waterfill(prefs: Sequence[float] | torch.Tensor, total: float, cap: float) -> torch.Tensor:
    """Real-valued proportional allocation with a per-layer cap (``docs/methods/cake.md#layer-budgets``).

    Returns ``B`` (float64, one entry per layer) with ``B_l = min(cap, c * P_l)`` and ``sum(B) = min(total, n*cap)``.

    Zero preferences are treated as an infinitesimal positive preference (the limit ``P_l -> 0+``): such a layer gets
    nothing unless every positive-preference layer is capped, in which case the remainder is shared equally among the
    zero-preference layers; all-zero preferences therefore give a uniform split. This keeps the result continuous in
    ``P`` and stage budgets monotone (Proposition 1). The split depends on the preferences' proportions only, however
    small or large they are (subnormal ones included, and finite ones whose sum overflows). Negative or non-finite
    preferences raise ``ValueError``.

    Parameters
    ----------
    prefs : sequence of float or torch.Tensor
        Layer preferences ``P_l``, one per layer, finite and ``>= 0``.
    total : float
        Total budget to share, finite and ``>= 0``.
    cap : float
        Per-layer cap, finite and ``>= 0``.

    Returns
    -------
    torch.Tensor
        ``(len(prefs),)`` float64 budgets ``B``.

    Raises
    ------
    TypeError
        For a ``total`` or ``cap`` that is not a real number.
    ValueError
        For empty, negative or non-finite preferences, or a negative or non-finite ``total`` or ``cap``.
    """
    _check_real(total, "total")
    _check_real(cap, "cap")
    p = _as_prefs(prefs)
    if not (math.isfinite(total) and total >= 0) or not (math.isfinite(cap) and cap >= 0):
        raise ValueError(f"total and cap must be finite and >= 0 (got total={total}, cap={cap})")
    n = p.numel()
    if n * cap <= total:
        return torch.full((n,), float(cap), dtype=torch.float64)
    capped = torch.zeros(n, dtype=torch.bool)
    while True:
        rest = total - cap * int(capped.sum())
        free = ~capped
        psum = float(p[free].sum())
        weights = p if psum > 0 else free.to(torch.float64)  # zero prefs only: equal shares of the rest
        wsum = float(weights[free].sum())
        c = rest / wsum
        if not (math.isfinite(c) and math.isfinite(wsum)):
            # preferences so small (subnormal) that rest / sum overflows, or so large that their sum does (two of
            # 1e308: c = rest / inf = 0 gave every layer 0): the same proportions, scaled so that the largest free
            # one is 1 (an inf share would cap a layer whatever its true share)
            weights = weights / float(weights[free].max())
            c = rest / float(weights[free].sum())
        b = torch.where(capped, torch.full_like(p, float(cap)), c * weights)
        newly = free & (b > cap)
        if not bool(newly.any()):
            return b
        capped |= newly


def largest_remainder(real: torch.Tensor, total: int) -> torch.Tensor:
    """Round non-negative reals to int64 summing to ``total``: floors, then +1 to the largest fractional parts.

    Ties are broken deterministically, lowest index first. ``total`` must lie between ``sum(floor(real))`` and
    ``sum(floor(real)) + len(real)``, otherwise ``ValueError``.

    Parameters
    ----------
    real : torch.Tensor
        1-D finite non-negative reals (a sequence of numbers is accepted too).
    total : int
        The sum the rounded values must have.

    Returns
    -------
    torch.Tensor
        int64, the shape of ``real``, summing to ``total``.

    Raises
    ------
    TypeError
        For a ``total`` that is not an integer.
    ValueError
        For ``real`` not 1-D, not finite or negative, or a ``total`` out of reach by rounding.
    """
    total = _as_int(total, "total")
    r = torch.as_tensor(real, dtype=torch.float64).detach().cpu()
    if r.ndim != 1 or not bool(torch.isfinite(r).all()) or bool((r < 0).any()):
        raise ValueError("largest_remainder expects a 1-D tensor of finite non-negative reals")
    floors = torch.floor(r)
    short = int(total) - int(floors.sum())
    if not 0 <= short <= r.numel():
        raise ValueError(f"cannot round {r.tolist()} to total {total}: {short} units missing")
    out = floors.to(torch.int64)
    order = torch.sort(r - floors, descending=True, stable=True).indices
    out[order[:short]] += 1
    return out


def preference_budgets(prefs: Sequence[float] | torch.Tensor, total: int, cap: int, final: bool) -> torch.Tensor:
    """CAKE cascade-stage budgets ``alloc(P, T, cap, final)`` with our rounding, as int64.

    See ``docs/methods/cake.md#layer-budgets`` and ``docs/methods/cake.md#deviations-from-the-paper``.

    Parameters
    ----------
    prefs : sequence of float or torch.Tensor
        Preferences ``P_0..P_m`` of the layers prefilled so far (see :func:`waterfill` for zeros).
    total : int
        Total selectable budget ``T = L * C'`` of the whole model (not of the layers seen so far).
    cap : int
        Per-layer cap, ``S - w``.
    final : bool
        True at the last stage: largest-remainder rounding so that ``sum == min(T, n*cap)`` exactly. False at
        intermediate stages: ``min(ceil(B_real), cap)``, which can exceed the final budgets but never increases from
        one stage to the next, so re-evicting a layer with its new budget equals evicting it once (Theorem 1).

    Raises
    ------
    TypeError
        For a ``total`` or ``cap`` that is not a real number (a bool included).
    ValueError
        For a ``total`` or ``cap`` that is not a finite non-negative whole number, or preferences :func:`waterfill`
        refuses.
    """
    _check_real(total, "total")  # a bool is not a total (True was taken as 1)
    _check_real(cap, "cap")
    # in range before int(): int() of an infinite total raised OverflowError, of a NaN one a message naming neither
    if not all(0 <= x <= sys.float_info.max and int(x) == x for x in (total, cap)):
        raise ValueError(f"total and cap must be non-negative integers (got total={total}, cap={cap})")
    real = waterfill(prefs, float(total), float(cap))
    if final:
        return largest_remainder(real, min(int(total), real.numel() * int(cap)))
    tol = 1e-9 * torch.clamp(real, min=1.0)  # absorb float noise above an integer (3.0000000001 -> 3)
    return torch.clamp(torch.ceil(real - tol), 0, int(cap)).to(torch.int64)


def uniform_budgets(num_layers: int, per_layer: int) -> torch.Tensor:
    """Every layer gets the same selectable budget ``C'``: ``(num_layers,)`` int64.

    Parameters
    ----------
    num_layers : int
        Number of layers ``L``, ``>= 1``.
    per_layer : int
        Selectable budget ``C'`` of every layer, ``>= 0``.

    Returns
    -------
    torch.Tensor
        ``(num_layers,)`` int64, every entry ``per_layer``.

    Raises
    ------
    TypeError
        For arguments that are not integers.
    ValueError
        For ``num_layers < 1`` or ``per_layer < 0``.
    """
    num_layers, per_layer = _as_int(num_layers, "num_layers"), _as_int(per_layer, "per_layer")
    if num_layers < 1 or per_layer < 0:
        raise ValueError(f"need num_layers >= 1 and per_layer >= 0 (got {num_layers}, {per_layer})")
    return torch.full((num_layers,), int(per_layer), dtype=torch.int64)


def pyramid_budgets(
    num_layers: int,
    selectable: int,
    prompt_len: int,
    window: int,
    beta: float = 20,
    exact: bool = False,
    snapkv_fallback: bool = True,
    min_layer: int = 0,
) -> torch.Tensor:
    """PyramidKV's per-layer selectable budgets (KVCache-Factory ``PyramidKVCluster``, Oct. 2024).

    See ``docs/methods/baselines.md#pyramid-budgets``.

    With ``C' = selectable``, ``S = prompt_len``, ``w = window``::

        min_n = C' // beta ; max_n = 2*C' - min_n
        if max_n >= S - w: max_n = S - w ; min_n = 2*C' - max_n
        step = (max_n - min_n) // (L - 1) ;  B_l = max_n - l*step        (layer 0 largest)

    For ``S < 2*C'`` (and for ``S < C' + w``, where the engine does not compress at all) every layer gets ``C'``, the
    reference code's SnapKV fallback. The floor on ``step`` makes ``sum B_l >= L*C'`` (slight over-budget, as the
    reference). ``exact=True`` (an option, not the reference) instead uses the unfloored real step and
    :func:`largest_remainder`, so that ``sum B_l == L*C'`` exactly (``max_n + min_n == 2*C'`` by construction).
    For ``beta < 1`` (layer 0 smallest) the deepest layer is capped at ``S - w`` the same way (``min_n = S - w``,
    ``max_n = 2*C' - min_n``; the reference leaves it above the layer's candidates), and the floored (negative) step's
    overshoot at the deep end is clamped to ``S - w``. ``snapkv_fallback=False`` is AdaKV's Ada-PyramidKV (FFY0/AdaKV
    ``AdaptiveSnapKVCluster`` with ``pyram_mode``), which has no such fallback: for ``C' + w <= S < 2*C'`` its layers
    still form a pyramid, capped at ``S - w``.
    Deviation: ``num_layers == 1`` (a division by zero in the reference) gives ``[C']``. Budgets are not
    clamped to ``S - w`` in the fallback; the engine keeps ``min(B_l, S - w)``. ``min_layer`` (deviation, 0 by
    default): a layer below it is raised to it and the tokens are taken from the largest layers, so the sum is
    unchanged; PyramidKV passes 1 when it protects no token (``window=0`` and no sinks), where ``C' < beta`` made the
    deepest layers 0 and would empty them.

    Parameters
    ----------
    num_layers : int
        Number of layers ``L``, ``>= 1``.
    selectable : int
        Average selectable budget ``C'`` per layer, ``>= 0``.
    prompt_len : int
        Prompt length ``S``, ``>= 0``.
    window : int
        Observation window ``w``, ``>= 0``: the prompt's tokens that are not candidates (the window and any sinks).
    beta : float
        PyramidKV's ``beta``, ``> 0.5`` (at ``0.5`` and below the largest layer would get nothing or less).
    exact : bool
        Exact sum ``L*C'`` (real step and largest-remainder rounding) instead of the reference's floored step.
    snapkv_fallback : bool
        Every layer gets ``C'`` for ``S < 2*C'`` (the reference); False is AdaKV's form.
    min_layer : int
        Floor of every layer's budget (at most ``C'``).

    Returns
    -------
    torch.Tensor
        ``(num_layers,)`` int64 selectable budgets, layer 0 largest.

    Raises
    ------
    TypeError
        For an integer argument that is not an integer, or a ``beta`` that is not a real number.
    ValueError
        For ``num_layers < 1``, a negative ``selectable``, ``prompt_len`` or ``window``, or ``beta <= 0.5``.
    """
    ints = {"num_layers": num_layers, "selectable": selectable, "prompt_len": prompt_len, "window": window}
    for what, arg in (ints | {"min_layer": min_layer}).items():
        _as_int(arg, what)
    _check_real(beta, "beta")
    if num_layers < 1 or selectable < 0 or prompt_len < 0 or window < 0 or not beta > 0.5:
        raise ValueError(
            f"invalid pyramid arguments: num_layers={num_layers}, selectable={selectable}, "
            f"prompt_len={prompt_len}, window={window}, beta={beta}"
        )
    c, s, w, n = int(selectable), int(prompt_len), int(window), int(num_layers)
    if n == 1 or s < c + w or (snapkv_fallback and s < 2 * c):
        return uniform_budgets(n, c)
    min_n = int(c // beta)
    max_n = 2 * c - min_n
    if max_n >= s - w:
        max_n = s - w
        min_n = 2 * c - max_n
    elif min_n > s - w:  # beta < 1 turns the pyramid over (the deepest layer largest): its top is capped the same way
        min_n = s - w
        max_n = 2 * c - min_n
    if exact:
        real = max_n - (max_n - min_n) / (n - 1) * torch.arange(n, dtype=torch.float64)
        budgets = largest_remainder(real.clamp_min(0), n * c)
    else:
        step = (max_n - min_n) // (n - 1)  # for beta < 1 a negative step, floored past S - w at the deep end
        budgets = (max_n - step * torch.arange(n, dtype=torch.int64)).clamp_max(s - w)
    return _raise_to_floor(budgets, min(int(min_layer), c))


def _raise_to_floor(budgets: torch.Tensor, floor: int) -> torch.Tensor:
    """``budgets`` with every entry below ``floor`` raised to it, the tokens taken one at a time from the largest
    entry (the first of equals), so the sum is unchanged; needs ``sum(budgets) >= floor * len(budgets)``."""
    short = int((floor - budgets).clamp_min(0).sum())
    if short == 0:
        return budgets
    out = budgets.clamp_min(floor).tolist()
    for _ in range(short):
        top = max(range(len(out)), key=lambda i: (out[i], -i))
        out[top] -= 1
    return torch.tensor(out, dtype=torch.int64)


def _candidates(scores: torch.Tensor) -> torch.Tensor:
    """Selectable slots: finite scores (``+inf`` = protected, ``-inf`` = empty)."""
    return torch.isfinite(scores)


def cross_head_counts(scores: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Per-head counts of one top-``total`` over all KV heads of a layer (AdaKV / LAVa head budgets).

    Parameters
    ----------
    scores : torch.Tensor
        ``(B, H, n)`` float scores; only finite entries are candidates (``+inf`` protected, ``-inf`` empty).
    total : torch.Tensor
        ``(B,)`` int64 number of candidates to keep in the whole layer (clamped to the candidates available).

    Returns
    -------
    torch.Tensor
        ``(B, H)`` int64, ``count[b, h]`` = entries of head ``h`` among the ``total[b]`` best candidates of sequence
        ``b``; the counts sum to ``min(total, candidates)`` exactly and never exceed a head's candidates. Ties are
        broken deterministically (lower head, then lower slot first), consistently with a stable per-head sort.

    Raises
    ------
    TypeError
        For ``scores`` or ``total`` that is not a tensor.
    ValueError
        For ``scores`` not 3-D, or a ``total`` with neither one entry nor one per sequence.
    """
    _check_scores(scores, total, "total")
    B, H, n = scores.shape
    cand = _candidates(scores)
    flat = scores.float().masked_fill(~cand, float("-inf")).reshape(B, H * n)
    order = torch.sort(flat, dim=-1, descending=True, stable=True).indices
    k = torch.minimum(total.to(scores.device).view(-1, 1), cand.reshape(B, -1).sum(-1, keepdim=True))
    chosen = torch.arange(H * n, device=scores.device).view(1, -1) < k
    counts = torch.zeros(B, H, dtype=torch.int64, device=scores.device)
    return counts.scatter_add_(-1, order // max(n, 1), chosen.to(torch.int64))


def safeguarded_head_counts(scores: torch.Tensor, per_head: torch.Tensor, alpha: float) -> torch.Tensor:
    """AdaKV's cross-head top-k with a safeguard floor, in kvpress ``AdaKVPress`` form (exact sums).

    Every head first keeps its own ``F = int(alpha * per_head)`` best candidates; the remaining
    ``H * (per_head - F)`` slots go to one top-k over all heads' other candidates. ``alpha = 0`` is the pure
    cross-head top-k, ``alpha = 1`` the uniform split.

    Parameters
    ----------
    scores : torch.Tensor
        ``(B, H, n)`` float scores; only finite entries are candidates (``+inf`` protected, ``-inf`` empty).
    per_head : torch.Tensor
        ``(B,)`` int64 average selectable budget per head.
    alpha : float
        Safeguard fraction in ``[0, 1]``.

    Returns
    -------
    torch.Tensor
        ``(B, H)`` int64 counts summing to ``min(H * per_head, candidates)`` when every head has at least ``F``
        candidates.

    Raises
    ------
    TypeError
        For ``scores`` or ``per_head`` that is not a tensor, or an ``alpha`` that is not a real number.
    ValueError
        For ``scores`` not 3-D, a ``per_head`` with neither one entry nor one per sequence, or ``alpha`` outside
        ``[0, 1]``.
    """
    _check_scores(scores, per_head, "per_head")
    _check_real(alpha, "alpha")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    B, H, n = scores.shape
    cand = _candidates(scores)
    per_head = per_head.to(scores.device).view(-1, 1)
    floor = torch.minimum((per_head.double() * alpha).floor().to(torch.int64), cand.sum(-1))  # (B, H)
    rank = torch.sort(
        torch.sort(scores.float().masked_fill(~cand, float("-inf")), dim=-1, descending=True, stable=True).indices,
        dim=-1,
    ).indices  # rank of each slot in its head
    rest = scores.float().masked_fill(rank < floor[..., None], float("inf"))  # floor slots leave the pool
    return floor + cross_head_counts(rest, (H * per_head[:, 0] - floor.sum(-1)).clamp_min(0))
