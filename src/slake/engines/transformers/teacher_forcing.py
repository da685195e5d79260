"""Teacher-forced decoding of a replayed cache, and how far its next-token distributions are from the full cache's.

Used by ``slake fidelity``'s output level (:mod:`slake.quality.output_fidelity`) and by ``slake eval --fidelity``
(:mod:`slake.engines.transformers.evaluate`), which measure the same thing: feed a continuation one token at a time
through a compressed cache and through the full cache, and compare the two distributions at every step.
"""

from __future__ import annotations

from typing import Any

import torch

from slake.engines.transformers.cache_kwarg import with_cache

__all__ = ["distances", "teacher_forced_logprobs"]


def teacher_forced_logprobs(model: Any, capture: Any, cache: Any, targets: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the next token at every continuation position, feeding ``targets`` step by step.

    Parameters
    ----------
    model : transformers model
        Prepared with :func:`slake.prepare_model`.
    capture : slake.engines.transformers.prefill_once.PrefillCapture
        The prompt's recorded prefill (batch ``B``, left-padded).
    cache : slake.SlakeCache
        A cache replayed from ``capture`` (``capture.replay(method, budget)``).
    targets : torch.Tensor
        ``(B, T)`` continuation token ids (rows shorter than ``T`` padded with any id; the caller masks them).

    Returns
    -------
    torch.Tensor
        ``(B, T, vocab)`` float32 log-probabilities; row ``t`` predicts ``targets[:, t]`` given the prompt and
        ``targets[:, :t]``. Row 0 comes from the recorded prefill logits.
    """
    mask = capture.attention_mask
    B, T = targets.shape
    real = mask.sum(-1)
    out = [torch.log_softmax(capture.last_logits.float(), -1)]
    with torch.inference_mode():
        for t in range(T - 1):
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=mask.device)], 1)
            logits = model(
                input_ids=targets[:, t : t + 1],
                attention_mask=mask,
                **with_cache(model, cache),
                position_ids=(real + t)[:, None],
            ).logits[:, -1]
            out.append(torch.log_softmax(logits.float(), -1))
    cache.check_routed()
    return torch.stack(out, 1)


def distances(full_lp: torch.Tensor, lp: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> dict:
    """Per-row KL(full || method), NLL change and top-1 agreement over the ``valid`` positions.

    Parameters
    ----------
    full_lp, lp : torch.Tensor
        ``(B, T, V)`` log-probabilities of the full cache and of the method.
    targets : torch.Tensor
        ``(B, T)`` the continuation's tokens.
    valid : torch.Tensor
        ``(B, T)`` bool, the positions that count.

    Returns
    -------
    dict
        ``{"kl", "delta_nll", "top1", "nll_full", "tokens"}``, each a list over rows (means over the row's valid
        positions; ``nan`` for a row with none).
    """
    # p log(p / q) is 0 where the full cache gives probability 0 (log p = -inf), not 0 * -inf = NaN
    terms = full_lp.exp() * (full_lp - lp)
    kl = terms.masked_fill(full_lp == float("-inf"), 0.0).sum(-1).clamp_min(0.0)  # (B, T); rounding: a hair below 0
    nll_full = -full_lp.gather(-1, targets[..., None]).squeeze(-1)
    nll = -lp.gather(-1, targets[..., None]).squeeze(-1)
    top1 = (full_lp.argmax(-1) == lp.argmax(-1)).float()
    n = valid.sum(-1)

    def mean(x: torch.Tensor) -> list[float]:
        # masked, not multiplied: a position that does not count (past a row's end) may hold anything, NaN included
        sums = x.masked_fill(~valid, 0.0).sum(-1)
        return [float(s / c) if c > 0 else float("nan") for s, c in zip(sums.tolist(), n.tolist())]

    return {
        "kl": mean(kl),
        "delta_nll": mean(nll - nll_full),
        "top1": mean(top1),
        "nll_full": mean(nll_full),
        "tokens": n.tolist(),
    }
