"""Command-line options shared by several ``slake`` sub-commands."""

from __future__ import annotations

import argparse


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Add ``--model``, ``--gguf-file``, ``--device`` and ``--dtype`` to a sub-command's parser."""
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (default, packaged), a hub id, a local directory or a .gguf file")
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside --model (hub repo or directory)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (auto-detected)")
    p.add_argument("--dtype", default=None, help="fp32, bf16 or fp16 (fp32 on CPU, bf16 on CUDA by default)")
