"""A GPT-style decoder: token + position embedding, pre-LayerNorm blocks, LM head, CE loss.

Attention is written two ways: ``explicit`` (q @ k^T, scale, causal mask, softmax, dropout, @ v:
every op is visible to the profiler and to selective recomputation) and ``sdpa``
(`torch.nn.functional.scaled_dot_product_attention`, one fused op).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION_KINDS = ("explicit", "sdpa")


@dataclass(kw_only=True, frozen=True)
class GPTConfig:
    """Sizes of the built-in GPT.

    The defaults make activations dominate the peak, as in real language-model training: with
    explicit attention the per-head scores (batch x heads x seq x seq) outweigh the model state
    (weights, gradients, AdamW state: under 5% of the baseline peak), while one training step
    stays well under a second on 2 CPU cores.
    """

    num_layers: int = 4
    """Number of transformer blocks."""
    d_model: int = 64
    """Width of the residual stream."""
    num_heads: int = 4
    """Attention heads; must divide d_model."""
    seq_len: int = 256
    """Tokens per sequence."""
    batch_size: int = 8
    """Sequences per batch."""
    vocab_size: int = 512
    """Vocabulary size."""
    dropout: float = 0.1
    """Dropout probability (attention probabilities, attention output, MLP output)."""
    attention: str = "explicit"
    """``"explicit"`` or ``"sdpa"``."""

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(
                f"attention={self.attention!r} is not supported; allowed: {', '.join(ATTENTION_KINDS)}."
            )
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
                "pick num_heads that divides d_model."
            )
        for name in ("num_layers", "d_model", "num_heads", "seq_len", "batch_size", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1).")


class AttentionCore(nn.Module):
    """Explicit attention's core, its own module: q @ k^T, scale, causal mask, softmax, dropout,
    @ v. As a module it can be a block of its own (``blocks="blocks.*.attn.core"``): the region
    Megatron-LM's selective recomputation checkpoints, from q, k and v to the product with v."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.drop = nn.Dropout(config.dropout)
        mask = torch.tril(torch.ones(config.seq_len, config.seq_len, dtype=torch.bool))
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        seq = q.size(-2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
        scores = scores.masked_fill(~self.causal_mask[:seq, :seq], float("-inf"))
        probs = self.drop(F.softmax(scores, dim=-1))
        return probs @ v


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with dropout on probabilities and on the output."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.attention = config.attention
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.core = AttentionCore(config)
        self.resid_drop = nn.Dropout(config.dropout)

    @property
    def causal_mask(self) -> torch.Tensor:
        """The core's boolean lower-triangular mask (seq_len x seq_len)."""
        return self.core.causal_mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        if self.attention == "sdpa":
            p = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            y = self.core(q, k, v)
        y = y.transpose(1, 2).contiguous().view(batch, seq, width)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """The 4x feed-forward: Linear, GELU, Linear, dropout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * config.d_model, config.d_model)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Embeddings, ``blocks`` (an nn.ModuleList), final LayerNorm, LM head, cross-entropy."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab); the scalar cross-entropy loss when ``targets`` is given."""
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def make_batch(config: GPTConfig, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(idx, targets)``: random token ids and the same sequence shifted by one."""
    shape = (config.batch_size, config.seq_len + 1)
    tokens = torch.randint(0, config.vocab_size, shape, generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
