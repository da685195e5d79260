"""SLAKE: Softmax-approximated training-free Linear Attention with KV-cache Eviction (ICLR 2026 submission).

Our reading: ``docs/methods/slake.md``. SLAKE is CAKE (window, mean+variance indicator, cascading preference budgets,
one-token-per-step decode eviction; :class:`slake.methods.cake.Cake`) plus

* **PTAA** (``linear_cache=True``): every evicted token, at prefill (all cascade stages,
  ``docs/methods/slake.md#prefill-folding``) and at decode, is folded into a per-KV-head linear state and still
  contributes through a first-order Taylor term (:mod:`slake.attention.linear_state`,
  :func:`slake.attention.ptaa.attend`). Decode eviction happens before the step's output (Algorithm 1 order,
  ``docs/methods/slake.md#decode-step``), hence ``evict_before_output`` (with the linear cache; without it, CAKE's
  order: the output, then the eviction);
* **VABS** (``vabs=True``): the layer preference is the value-aware score of :func:`vabs_preference` (paper Eqs. 15-18,
  ``docs/methods/slake.md#vabs``) instead of CAKE's entropy/variance score.

Ablations of paper Table 2: eviction only = ``linear_cache=False, vabs=False`` (CAKE, decoding in CAKE's order);
+PTAA = ``linear_cache=True, vabs=False``; +VABS = the defaults.

Choices and deviations: VABS needs an evicted set before any budget exists
(``docs/methods/slake.md#the-provisional-split``). ``vabs_split`` selects the reading: ``"taylor"`` (default) linearises
every key (the full Taylor map of paper section 3.2); ``"window"`` linearises every non-window token, i.e. the PTAA
error of the whole evictable block at a provisional budget of 0; ``"uniform"`` keeps the top ``k0 = min(C - w, S - w)``
tokens of the CAKE indicator at the uniform budget ``C`` (our first reading). The default is the best reading on the
RULER-style suite at 4K on the default model (``docs/results-slake.md#ruler-style-suite-slakes-readings``; 13 tasks x 5
samples, macro average at budgets 64/128/256): ``"taylor"`` 0.0/8.2/13.9, ``"window"`` 0.0/4.9/12.4, ``"uniform"``
1.5/1.5/1.5 (it starves the sharp retrieval layers, whose in-sample error after keeping their own top tokens is about
0). At the output level ``"window"`` is marginally closer to the full model (mean KL 0.164/0.108 nats per token at
128/256 against 0.167/0.117 for ``"taylor"``); both beat CAKE (0.178/0.119). ``C`` (the average per-layer budget, window
included, ``docs/conventions.md#budgets``) comes from ``budget_hint`` or the compressor's ``PrefillInputs.budget``.
``Att``/``Att~`` are attention maps and the entropy uses the exact map's ``A[-w:, :-w]`` block
(``docs/methods/slake.md#vabs``). Scores are per batch element and padding-aware. ``alpha``/``beta`` default to
``(0.5, 0.4)`` (Llama-2-7B's values, identical at both budgets); the papers' models get Table 3's values and other
models their calibrated profile when one exists (:mod:`slake.methods.profiles`, ``slake calibrate``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slake.methods.base import PrefillInputs, register
from slake.methods.cake import EPS, LOG_EPS, Cake, match_family
from slake.methods.common import real_positions

__all__ = ["Slake", "VABS_SPLITS", "slake_alpha_beta", "vabs_preference"]

# paper Table 3 read as one (alpha, beta) pair per (model, budget) column (docs/methods/slake.md#hyperparameters)
_ALPHA_BETA: dict[tuple[str, ...], dict[int, tuple[float, float]]] = {
    ("llama-2-7b",): {128: (0.5, 0.4), 256: (0.5, 0.4)},
    ("llama-3.1-8b",): {128: (0.4, 0.2), 256: (0.6, 0.5)},
    ("mistral-7b", "v0.3"): {128: (0.6, 0.5), 256: (0.4, 0.2)},
}
DEFAULT_ALPHA_BETA = (0.5, 0.4)

#: readings of VABS's provisional split (``docs/methods/slake.md#the-provisional-split``); see
#: :func:`vabs_preference` and :class:`Slake`
VABS_SPLITS = ("uniform", "window", "taylor")


def slake_alpha_beta(model_family: str, budget: int) -> tuple[float, float]:
    """VABS ``(alpha, beta)`` of paper Table 3 for Llama-2-7B-chat, Llama-3.1-8B, Mistral-7B-v0.3.

    Our reading of the table: ``docs/methods/slake.md#hyperparameters``.

    Other budgets of a known model use the nearest tabulated budget (128 or 256, on a log scale); unknown models get
    :data:`DEFAULT_ALPHA_BETA` ``= (0.5, 0.4)``.
    """
    fam = match_family(model_family, list(_ALPHA_BETA))
    if fam is None:
        return DEFAULT_ALPHA_BETA
    return _ALPHA_BETA[fam][128 if budget * budget <= 128 * 256 else 256]


def vabs_preference(
    logits: torch.Tensor,
    probs: torch.Tensor,
    values: torch.Tensor,
    indicator: torch.Tensor,
    selectable: int | torch.Tensor,
    window: int,
    alpha: float,
    beta: float,
    gamma_v: float = 0.1,
    key_padding: torch.Tensor | None = None,
    split: str = "uniform",
    sinks: int = 0,
) -> torch.Tensor:
    """Value-aware budget score of one layer, per batch element (``docs/methods/slake.md#vabs``), ``(B,)`` float32.

    Parameters
    ----------
    logits, probs : torch.Tensor
        ``(B, Hq, w, S)`` window logits (``-inf`` where masked: causal block, padding, and nowhere else, as
        :func:`~slake.methods.common.window_logits` gives them) and their softmax.
    values : torch.Tensor
        ``(B, Hkv, S, d)`` the layer's values.
    indicator : torch.Tensor
        ``(B, Hkv, S - w)`` CAKE indicator used for the provisional split.
    selectable : int | torch.Tensor
        ``C' = C - w`` (an int, or ``(B,)`` per sample): provisional kept count ``k0 = min(C', S_b - w)`` per sample
        (``S_b`` = unpadded length).
    window : int
        Configured window; ``w = min(window, S)`` must equal ``logits.shape[2]``.
    alpha, beta, gamma_v : float
        Exponents of Eq. 18 and of the value-aware term (Eq. 16).
    key_padding : torch.Tensor | None
        ``(B, S)`` bool; by default derived from the last window row (padded keys are its only ``-inf`` entries).
    split : str
        Which keys the PTAA map linearises (``docs/methods/slake.md#the-provisional-split``, :data:`VABS_SPLITS`):
        ``"uniform"``, the non-window keys outside the top ``k0 = min(C', S_b - w)`` by indicator; ``"window"``, every
        non-window key (``k0 = 0``); ``"taylor"``, every visible key, window included (the full-Taylor map of paper
        section 3.2, Eq. 12).
    sinks : int
        The method's always-kept first tokens of each row (0: none). They are kept, as the window is, so the
        ``"uniform"`` and ``"window"`` splits never linearise them, and the uniform split's ``k0`` counts the other
        kept tokens, ``min(C' - sinks, S_b - w - sinks)``; the full-Taylor map linearises every key anyway.

    Returns ``1e-12`` for a sample with nothing provisionally evicted (``n0 == 0``; with ``"window"`` and
    ``"taylor"`` only when the prompt fits in the budget). Padded keys are neither in the provisional evicted set
    ``E0`` nor in the value-norm weights.
    """
    B, Hq, w, S = logits.shape
    Hkv, g, sel = values.shape[1], Hq // values.shape[1], S - w
    if split not in VABS_SPLITS:
        raise ValueError(f"vabs_preference: split must be one of {', '.join(VABS_SPLITS)}, got {split!r}")
    if w != min(window, S) or probs.shape != logits.shape or indicator.shape != (B, Hkv, sel):
        raise ValueError(
            f"vabs_preference: inconsistent shapes logits {tuple(logits.shape)}, probs "
            f"{tuple(probs.shape)}, indicator {tuple(indicator.shape)} for window {window}"
        )
    pad = ~torch.isfinite(logits[:, 0, -1, :]) if key_padding is None else key_padding.bool()
    kept = pad  # keys that are never in the provisional evicted set: padding, and the sinks when set
    if sinks and split != "taylor":
        # the first real tokens of each row (left padding): always kept, so linearising them described an eviction
        # that never happens
        pos = real_positions(pad)
        kept = pad | ((pos >= 0) & (pos < sinks))
    real_sel = (~kept[:, :sel]).sum(-1)  # (B,) = S_b - w (- sinks)
    budget_sel = torch.as_tensor(selectable, device=real_sel.device) - (sinks if split != "taylor" else 0)
    k0 = torch.minimum(real_sel, budget_sel.clamp_min(0).to(real_sel))
    # ``n0 > 0`` iff the layer evicts anything at budget C; the readings differ only in which keys they linearise
    n0 = real_sel - k0
    eps = torch.full((B,), EPS, dtype=torch.float32, device=logits.device)
    if sel == 0 or not bool((n0 > 0).any()):
        return eps
    # 1) provisional split (the full-Taylor map needs none: every visible key is linearised below)
    if split == "uniform":  # keep the top-k0 real non-window tokens by indicator, per (b, KV head)
        ind = indicator.float().masked_fill(kept[:, None, :sel], float("-inf"))
        order = torch.sort(ind, dim=-1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(sel, device=order.device).expand_as(order))
        ev = (rank >= k0[:, None, None]) & ~kept[:, None, :sel]
    elif split == "window":  # every real non-window token but the sinks (provisional budget 0)
        k0 = torch.zeros_like(k0)
        ev = (~kept[:, None, :sel]).expand(B, Hkv, sel)
    if split == "taylor":  # every visible key: the real keys at or before the row's query, counted per window row
        visible = (~pad).cumsum(-1)[:, S - w :].clamp_min(1).to(torch.float32)[:, None, None, :]  # (B, 1, 1, w)
        causal = torch.ones(w, w, dtype=torch.bool, device=logits.device).triu(1)  # the masked window keys per row
        padded = bool(pad.any())
    else:
        ev = torch.cat([ev, ev.new_zeros(B, Hkv, w)], -1)[:, :, None, None, :]  # (B, Hkv, 1, 1, S)
    # 2-3) per window row: PTAA weight map (group layout (B, Hkv, g, rows, S)), its total variation and value-aware
    # error against the exact row, and the entropy of the exact row; rows are independent, so they are taken a few
    # at a time to bound the transient memory (at 8K tokens a whole window's map is ~9 MB per temporary)
    x_all = logits.float().reshape(B, Hkv, g, w, S)
    a_all = probs.float().reshape(B, Hkv, g, w, S)
    vn = values.float().norm(dim=-1).masked_fill(pad[:, None, :], 0.0)  # (B, Hkv, S)
    omega = (vn / vn.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny))[:, :, None, None, :]
    n_fixed = None if split == "taylor" else (real_sel - k0).clamp_min(1).to(x_all.dtype)[:, None, None, None]
    rows = max(1, _VABS_BLOCK // max(B * Hq * S, 1))
    # a factor with exponent 0 is exactly 1 whatever its base: its passes are skipped (the default model's profile
    # has beta = 0)
    need = (alpha != 0, beta != 0)
    parts = []
    for r0 in range(0, w, rows):
        x, a = x_all[:, :, :, r0 : r0 + rows], a_all[:, :, :, r0 : r0 + rows]
        if split == "taylor":
            hidden = (causal[r0 : r0 + rows], pad[:, None, None, None, :] if padded else None)
            parts.append(_taylor_rows(x, a, visible[..., r0 : r0 + rows], hidden, omega, sel, gamma_v, need))
        else:
            parts.append(_vabs_rows(x, a, ev, n_fixed, omega, sel, gamma_v, need))
    tv, va, ent = (torch.cat(t, dim=-1) if t[0] is not None else None for t in zip(*parts))  # each (B, Hkv, g, w)
    # 4) P = E[TV * VA]^alpha * E[Ent]^beta, means over heads and window rows of each sample
    one = torch.ones(B, dtype=torch.float32, device=logits.device)
    err_term = one if tv is None or va is None else (tv * va).mean((1, 2, 3)).clamp_min(EPS) ** alpha
    ent_term = one if ent is None else ent.mean((1, 2, 3)).clamp_min(EPS) ** beta
    return torch.where(n0 > 0, err_term * ent_term, eps)


_VABS_BLOCK = 1 << 19  # elements of one (B, Hq, rows, S) temporary of the VABS map (2 MiB in float32)


def _vabs_rows(
    x: torch.Tensor,
    a: torch.Tensor,
    ev: torch.Tensor,
    n_ev: torch.Tensor | None,
    omega: torch.Tensor,
    sel: int,
    gamma_v: float,
    need: tuple[bool, bool] = (True, True),
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """TV, value-aware error and entropy of some window rows (``x``, ``a``: ``(B, Hkv, g, rows, S)`` logits and exact
    probabilities; ``ev``: the provisional evicted set, broadcastable, or ignored when ``n_ev`` is None, the
    full-Taylor split where every visible key is linearised). Each returned tensor is ``(B, Hkv, g, rows)``.
    ``need``: whether the error terms (TV, VA) and the entropy are wanted; those not wanted are None."""
    ent = _row_entropy(a[..., :sel]) if need[1] else None
    if not need[0]:
        return None, None, ent
    if n_ev is None:  # "taylor": the row's evicted count is its visible count
        ev = torch.isfinite(x)
        n_ev = ev.sum(-1).clamp_min(1).to(x.dtype)
    kept = torch.isfinite(x) & ~ev
    mu = torch.where(ev, x, 0.0).sum(-1) / n_ev
    m = torch.maximum(x.masked_fill(~kept, float("-inf")).amax(-1), mu)
    wt = torch.where(kept, torch.exp(x - m[..., None]), 0.0)
    wt += torch.where(ev, torch.exp(mu - m)[..., None] * (1 + x - mu[..., None]), 0.0)
    err = wt.div_(wt.sum(-1, keepdim=True)).sub_(a).abs_()
    tv = 0.5 * err.sum(-1)
    va = err.mul_(omega).sum(-1).clamp_min(EPS) ** gamma_v
    return tv, va, ent


def _taylor_rows(
    x: torch.Tensor,
    a: torch.Tensor,
    visible: torch.Tensor,
    hidden: tuple[torch.Tensor, torch.Tensor | None],
    omega: torch.Tensor,
    sel: int,
    gamma_v: float,
    need: tuple[bool, bool] = (True, True),
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """:func:`_vabs_rows` of the full-Taylor split (every visible key linearised), in a third of its passes, with the
    same result to the bit (``tests/test_cake_slake_methods.py``).

    With no kept key the general form's shift is ``m = mu`` and its weight ``exp(mu - m) (1 + x - mu)`` is
    ``1 + x - mu`` exactly, so no exponential is needed. ``visible``: ``(B, 1, 1, rows)`` float32 count of each row's
    visible keys (at least 1), which are its finite logits; ``hidden``: the masked keys, ``(rows, w)`` of the window
    block (causal) and ``(B, 1, 1, 1, S)`` padding or None, which are exactly the ``-inf`` logits of
    :func:`~slake.methods.common.window_logits`. The masked logits are zeroed with ``nan_to_num`` and these masks
    instead of a finiteness mask and ``where``, which cost ten times an arithmetic pass on CPU.
    """
    ent = _row_entropy(a[..., :sel]) if need[1] else None
    if not need[0]:
        return None, None, ent
    wt = x.nan_to_num(neginf=0.0)  # visible logits, 0 elsewhere
    mu = wt.sum(-1).div_(visible)
    wt.add_(1).sub_(mu[..., None])  # 1 + x - mu on visible keys: zero the masked ones again
    wt[..., x.shape[-1] - hidden[0].shape[-1] :].masked_fill_(hidden[0], 0.0)
    if hidden[1] is not None:
        wt.masked_fill_(hidden[1], 0.0)
    err = wt.div_(wt.sum(-1, keepdim=True)).sub_(a).abs_()
    tv = 0.5 * err.sum(-1)
    va = err.mul_(omega).sum(-1).clamp_min(EPS) ** gamma_v
    return tv, va, ent


def _row_entropy(a: torch.Tensor) -> torch.Tensor:
    """``-sum_j a log(a + 1e-10)`` over the last axis, with one temporary updated in place."""
    return -torch.add(a, LOG_EPS).log_().mul_(a).sum(-1)


@register
@dataclass
class Slake(Cake):
    """SLAKE (``docs/methods/slake.md``): CAKE + PTAA linear cache + VABS layer preference.

    Parameters
    ----------
    linear_cache : bool
        PTAA on (default) / off.
    alpha, beta : float
        VABS exponents (Eq. 18); see :func:`slake_alpha_beta`. Default ``(0.5, 0.4)``.
    gamma_v : float
        Exponent of the value-aware term (0.1, Eq. 16).
    vabs : bool
        True: VABS preference; False: CAKE's ``H^(1/tau1) V^(1/tau2)`` (ablation).
    budget_hint : int | None
        Average per-layer budget ``C`` (window included) for VABS's provisional split. When None (default), the
        compressor's per-sequence ``PrefillInputs.budget`` is used; when set, it overrides it, and must be at least
        ``max(1, sinks + window)``, as a budget must. The ``"uniform"`` split chooses tokens by it; under ``"taylor"``
        (the default) and ``"window"`` it decides only whether a prompt fits it (every layer's preference is then
        ``eps``: uniform layer budgets).
    vabs_split : str
        Which tokens VABS's PTAA error map linearises (``docs/methods/slake.md#the-provisional-split``). The paper says
        only that "in the prefill stage, SLAKE first performs VABS, which considers both the linear approximation error
        of the attention map and the contribution of value data" (section 3.1), before any eviction, so the evicted set
        it needs is not defined:

        * ``"uniform"``: the tokens the CAKE indicator would evict at the uniform budget ``C``: keep the top
          ``C - w`` non-window tokens, linearise the rest (the PTAA map of section 3.3 at a provisional split);
        * ``"window"``: provisional budget 0, every non-window token linearised, the window exact (the error PTAA
          makes on the whole evictable block, before anything is chosen to be kept);
        * ``"taylor"``: every key linearised, the full first-order Taylor attention of section 3.2 (Eq. 12).

        Default ``"taylor"``, the best of the three on the RULER-style suite (module docstring).
    """

    linear_cache: bool = True
    alpha: float = DEFAULT_ALPHA_BETA[0]
    beta: float = DEFAULT_ALPHA_BETA[1]
    gamma_v: float = 0.1
    vabs: bool = True
    budget_hint: int | None = None
    vabs_split: str = "taylor"

    name = "slake"
    summary = "SLAKE: CAKE eviction + first-order Taylor linear cache (PTAA) + value-aware budgets (VABS)"
    paper = (
        "SLAKE: Softmax-Approximated Training-Free Linear Attention with KV-Cache Eviction for Long-Sequence "
        "LLMs, ICLR 2026 submission"
    )

    @property
    def evict_before_output(self) -> bool:  # type: ignore[override]
        """Algorithm 1's order (evict and fold, then the output) with the linear cache; without it, CAKE's (the output,
        then the eviction): evicting first then only drops the victim from this step's output, and the paper's
        ablation row without PTAA is CAKE's decoding (Table 2)."""
        return self.linear_cache

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.alpha < 0 or self.beta < 0 or not self.gamma_v > 0:
            raise ValueError(
                f"{self.name}: need alpha, beta >= 0 and gamma_v > 0 (got {self.alpha}, {self.beta}, {self.gamma_v})"
            )
        if self.budget_hint is not None and self.budget_hint < max(1, self.protected):
            # C - window below 0 made the uniform split the window one without a word; the engines refuse such a
            # budget itself (slake.methods.budget_check)
            raise ValueError(
                f"{self.name}: budget_hint must be at least the protected tokens (sinks + window = {self.protected}) "
                f"and 1, as a budget must, got {self.budget_hint}"
            )
        if self.vabs_split not in VABS_SPLITS:
            raise ValueError(
                f"{self.name}: vabs_split must be one of {', '.join(VABS_SPLITS)}, got {self.vabs_split!r}"
            )

    def layer_preference(
        self,
        inputs: PrefillInputs,
        logits: torch.Tensor,
        probs: torch.Tensor,
        indicator: torch.Tensor,
        row_var: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """VABS score (or CAKE's preference when ``vabs=False``), ``(B,)``."""
        if not self.vabs:
            return super().layer_preference(inputs, logits, probs, indicator, row_var=row_var)
        budget = self.budget_hint if self.budget_hint is not None else getattr(inputs, "budget", None)
        if budget is None:
            raise ValueError(
                "slake: VABS needs the average per-layer budget C: set budget_hint or PrefillInputs.budget"
            )
        return vabs_preference(
            logits,
            probs,
            inputs.values,
            indicator,
            budget - inputs.window,
            inputs.window,
            self.alpha,
            self.beta,
            self.gamma_v,
            inputs.key_padding,
            split=self.vabs_split,
            sinks=self.sinks,
        )
