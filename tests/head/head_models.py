"""Tiny language models with a head part, built from configs (no download), labels partly -100."""

from __future__ import annotations

import torch

from remat.models import build

SIZES = {"num_layers": 2, "d_model": 32, "num_heads": 2, "seq_len": 16, "batch_size": 2, "vocab_size": 300}
"""32 tokens of 300-way logits: the head's 38400-byte fp32 logits outweigh a block's activations."""
IGNORED = 3
"""Labels set to -100 at the start of the first sequence."""
MODELS = ("gpt", "hf:llama", "hf:gpt2")


def tiny(name: str, *, optimizer: str = "adamw", dtype: torch.dtype | None = None, **sizes):
    """``name`` at `SIZES` without dropout, its labels' first `IGNORED` positions -100."""
    extra = {} if name == "hf:llama" else {"dropout": 0.0}
    built = build(name, optimizer=optimizer, **{**SIZES, **extra, **sizes})
    if dtype is not None:
        built.model.to(dtype)
    labels = built.batch["labels"] if isinstance(built.batch, dict) else built.batch[1]
    labels[0, :IGNORED] = -100
    return built
