"""How a planned head runs: keep, recompute, or chunked:<tokens>, each a config with one verb.

- ``keep``: the model's own projection and loss, as without a plan: autograd keeps the hidden
  states and the log-probabilities (tokens x vocabulary, fp32 for Hugging Face models).
- ``recompute``: the same, inside a non-reentrant checkpoint: the hidden states are all it
  keeps; the backward runs the projection and the loss again, with every kernel as before, so
  the gradients are bit-identical.
- ``chunked:<tokens>``: `remat.head.chunked`: the logits exist one chunk of rows at a time, in
  the forward and again in the backward; sums over tokens are taken in another order and matrix
  products have other shapes, so the loss and every gradient may differ in their last bits
  (`HeadChunked.relative_tolerance`).

`parse_head` turns a plan's head string into its config (a registry keyed by the kind before
``:``); `HeadStrategy.loss(...)` computes the loss from the hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from remat.head.chunked import chunked_cross_entropy, num_chunks
from remat.head.loss import LossInputs
from remat.head.names import check_head_name
from remat.head.site import HeadKind, HeadSite

__all__ = ["HeadCall", "HeadStrategy", "HeadKeep", "HeadRecompute", "HeadChunked", "parse_head", "HEAD_KINDS",
           "FP32_REASSOCIATION_RTOL"]

FP32_REASSOCIATION_RTOL = 1e-5
"""Normwise relative difference (``max|a - b| / max|b|``) allowed per gradient and on the loss
between a chunked fp32 head and the unchunked one: sums over tokens in another order, matrix
products of other shapes. Measured: up to 5.1e-7 on the head alone (64-32000 vocabulary,
32-512 tokens, `tests/head/test_chunked.py`) and 1.5e-6 on every gradient of 4-layer Llama and
GPT models of width 256 (one-row chunks; 9e-7 for 16 and 64 rows); the bound leaves 7x."""


@dataclass(kw_only=True, frozen=True)
class HeadCall:
    """One call of a model's head: the model, its projection and the call's labels."""

    kind: HeadKind
    """How this family of models runs its head."""
    site: HeadSite
    """The head found on the model."""
    model: nn.Module
    """The model (its ``loss_function`` and config, for Hugging Face models)."""
    projection: nn.Linear
    """The output projection."""
    inputs: LossInputs
    """The call's labels and loss keywords."""
    extra: dict[str, Any]
    """The forward's other keyword arguments, passed on to the model's loss as the model does."""

    @property
    def bias(self) -> torch.Tensor | None:
        """The bias of the logits: the projection's, or the parameter the model adds to its
        output (`HeadSite.logit_bias`: ESM's ``lm_head.bias``)."""
        return self.model.get_parameter(self.site.logit_bias) if self.site.logit_bias else self.projection.bias

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits exactly as the model makes them: the projection, then the bias it adds."""
        logits = self.projection(hidden)
        return logits + self.model.get_parameter(self.site.logit_bias) if self.site.logit_bias else logits

    def model_loss(self, hidden: torch.Tensor) -> torch.Tensor:
        """The projection and the loss exactly as the model runs them."""
        return self.kind.model_loss(self.model, self.logits(hidden), self.inputs, self.extra)


@dataclass(kw_only=True, frozen=True)
class HeadStrategy:
    """How the head runs (subclasses are the strategies)."""

    @property
    def name(self) -> str:
        """The strategy as a plan names it."""
        raise NotImplementedError

    def loss(self, call: HeadCall, hidden: torch.Tensor) -> torch.Tensor:
        """The model's loss from the hidden states the projection receives."""
        raise NotImplementedError

    def relative_tolerance(self, dtype: torch.dtype, num_tokens: int) -> float:
        """Normwise relative difference allowed on the loss and on each gradient against the
        model without a plan (0.0: bit-identical)."""
        return 0.0


@dataclass(kw_only=True, frozen=True)
class HeadKeep(HeadStrategy):
    """The model's own projection and loss."""

    @property
    def name(self) -> str:
        return "keep"

    def loss(self, call: HeadCall, hidden: torch.Tensor) -> torch.Tensor:
        return call.model_loss(hidden)


@dataclass(kw_only=True, frozen=True)
class HeadRecompute(HeadStrategy):
    """The model's own projection and loss, checkpointed: only the hidden states are kept."""

    @property
    def name(self) -> str:
        return "recompute"

    def loss(self, call: HeadCall, hidden: torch.Tensor) -> torch.Tensor:
        return checkpoint(call.model_loss, hidden, use_reentrant=False)


@dataclass(kw_only=True, frozen=True)
class HeadChunked(HeadStrategy):
    """Projection and loss over ``chunk_tokens`` rows at a time (`remat.head.chunked`)."""

    chunk_tokens: int
    """Rows of logits per chunk."""

    def __post_init__(self) -> None:
        if isinstance(self.chunk_tokens, bool) or not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 1:
            raise ValueError(f"chunked head needs a positive chunk of tokens, got {self.chunk_tokens!r}; e.g. chunked:1024.")

    @property
    def name(self) -> str:
        return f"chunked:{self.chunk_tokens}"

    def loss(self, call: HeadCall, hidden: torch.Tensor) -> torch.Tensor:
        return chunked_cross_entropy(hidden, call.projection.weight, call.bias, call.inputs, call.site.loss, self.chunk_tokens)

    def relative_tolerance(self, dtype: torch.dtype, num_tokens: int) -> float:
        """Chunking reorders the sums over tokens and reshapes the matrix products. In fp32
        that is a reassociation (`FP32_REASSOCIATION_RTOL`); in a 16-bit dtype the weight's
        running gradient sum is rounded to it once per chunk where the unchunked product
        rounds once: (chunks + 1) half-ulps of the result."""
        rounding = (num_chunks(num_tokens, self.chunk_tokens) + 1) * torch.finfo(dtype).eps / 2
        return max(FP32_REASSOCIATION_RTOL, rounding)


HEAD_KINDS: dict[str, type[HeadStrategy]] = {"keep": HeadKeep, "recompute": HeadRecompute, "chunked": HeadChunked}
"""Head strategy kind (before ``:``) -> its config class."""


def parse_head(text: str) -> HeadStrategy:
    """``"keep"``, ``"recompute"`` or ``"chunked:<tokens>"`` as its config."""
    kind, chunk_tokens = check_head_name(text)
    cls = HEAD_KINDS[kind]
    return cls(chunk_tokens=chunk_tokens) if chunk_tokens is not None else cls()
