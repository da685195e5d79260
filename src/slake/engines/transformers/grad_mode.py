"""The grad mode a prefill into a user's cache runs under (:func:`no_grad_here`)."""

from __future__ import annotations

import contextlib

import torch

__all__ = ["no_grad_here"]


def no_grad_here() -> contextlib.AbstractContextManager:
    """``torch.no_grad()``, or nothing inside ``torch.inference_mode()``: what a prefill into a user's cache runs under
    (:func:`slake.engines.transformers.generate.prefill`, KVzip's second pass), so that the cache's tensors are of the
    kind the caller's later steps can update in place: inference tensors cannot be updated outside inference mode,
    where a plain ``model.generate`` (``torch.no_grad()``) runs, and inside it a compiled step guards on every tensor
    being one."""
    return contextlib.nullcontext() if torch.is_inference_mode_enabled() else torch.no_grad()
