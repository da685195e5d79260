"""A user's own decode rule that the fused kernels do not cover (SnapKV with its scores negated and no fused form):
shared by the kernel tests that check the torch fallback says so. Imports nothing of transformers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slake.methods.base import DecodeInputs
from slake.methods.snapkv import SnapKV


@dataclass
class Reversed(SnapKV):
    """A user's own decode rule, which the fused kernels do not cover (no fused form)."""

    def decode_scores(self, inputs: DecodeInputs) -> torch.Tensor:
        return -super().decode_scores(inputs)

    def fused_rule(self):
        return None
