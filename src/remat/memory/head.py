"""Bytes of the head part (output projection + token cross-entropy) by strategy, by hand.

The same quantities `remat.measure.head` measures (`remat.measure.types.HeadOption`), as
formulas of the head's shape, for models that do not run here (`remat.estimate`) and to check
the measurement (``tests/head``: equal to the byte on the built-in GPT and on Hugging Face
Llama and GPT-2; ``tests/estimate/test_text_encoders.py``: on BERT's, ModernBERT's and ESM's
masked LMs, with their bias). Bytes count from the head's input on: the hidden states ``T x H`` in the
model's dtype, and every storage the head allocates; mean reduction. A bias of the logits
(a masked LM's: the projection's, or ESM's added after it) adds its gradient ``V p`` from the
projection's backward on (``+ bias`` below, 0 without one).

Symbols: ``T`` tokens (batch x sequence), ``H`` hidden size, ``V`` vocabulary, ``p`` bytes of
the model's dtype, ``r`` bytes of the dtype the loss runs in (4 when the logits are upcast to
fp32, as Hugging Face does, else ``p``), ``L = T V`` logits, ``up = L 4`` when the upcast makes
a copy (``p != 4``), else 0. Labels (int64) shifted inside the loss (Hugging Face) add a padded
copy ``B (S + 1) 8`` while the loss runs and the shifted copy ``T 8``, which the loss keeps.

keep (the model's own head)::

    forward peak  = T H p + L p + up + pad + shifted + L r + 2 r     logits, fp32 copy, labels,
                                                                      log-probs, loss and weight
    held          = T H p + shifted + L r + 2 r                      what nll_loss and log_softmax keep
    backward peak = T H p + 2 r + max(3 L r,                          log-probs, their gradient
                                      L r + L p  (upcast copy),       and the logits' gradient
                                      L p + T H p + H V p + bias,     the projection's backward
                                      2 T H p + 2 H V p  (untied),    an untied weight's gradient
                                                                      copied to its own layout
                                      L p + T H p + H V p + 2 bias)   untied with a bias: addmm's
                                                                      backward makes the weight's
                                                                      gradient in its layout (no
                                                                      copy); the bias's twice
                                                                      (RemBERT's peak holds both)
recompute: the same forward, holding ``T H p + r``; its backward replays the forward first::

    backward peak = max(keep forward peak + 2 r, keep backward peak)

chunked:<c> (`remat.head.chunked`, chunks of ``c`` rows, ``C = c V``)::

    forward peak  = T H p + shifted + max(pad, T + 8, 4 + 4 + chunk forward)   padded labels;
                                                 the count's mask and sum; count, total, one chunk
    chunk forward = max(C p + up_c, 2 C r) + 2 r                      (up_c = C 4 when p != 4)
    held          = T H p + shifted + 4 + r                           hidden, targets, count, loss
    backward peak = T H p + shifted + 4 + 2 r + T H p + H V p + bias + max(C p + up_c, 2 C r, 3 C r + w, C r + C p + w)

(the hidden states' and the weight's gradients, written chunk by chunk; ``w = r`` when the
mean's fp32 count is cast to a 16-bit loss dtype, else 0).

A frozen projection (``trained=False``: LoRA's head) saves only its weight: keep holds no ``T H p``
from the forward to the backward, and no strategy makes the weight's or the bias's gradient (``H V p``
and ``bias`` are 0 above, and so is the untied weight's copy); recompute's checkpoint still holds
the hidden states, so its backward peak is keep's plus ``T H p``.
A long head peaks at about ``3 L r`` under keep against ``H V p + 2 T H p + 3 C r`` chunked: at
Llama-3-8B sizes (V = 128256, H = 4096, bf16, one sequence of T = 8192) the fp32 logits alone
are 3.9 GiB; keep's backward peaks at 11.8 GiB, chunked:1024 at 2.6 GiB (of which 1.0 GiB is
the weight's gradient, there under every strategy), chunked:256 at 1.5 GiB.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["HeadShape", "HeadBytes", "head_bytes", "keep_bytes", "keep_saved_bytes", "recompute_bytes", "chunked_bytes",
           "projection_flops", "logits_bytes", "FORMULAS"]

LABEL_BYTES = 8
"""int64 labels."""
COUNT_BYTES = 8
"""The int64 count of non-ignored labels, before it becomes the fp32 divisor."""
FP32_BYTES = 4


@dataclass(kw_only=True, frozen=True)
class HeadShape:
    """The head's sizes and conventions (mean over the non-ignored labels)."""

    batch_size: int
    """Sequences per batch."""
    seq_len: int
    """Tokens per sequence: ``num_tokens = batch_size * seq_len`` rows of logits."""
    hidden_size: int
    """Input features of the projection."""
    vocab_size: int
    """Output features of the projection."""
    dtype_bytes: int
    """Bytes per element of the hidden states and the projection's weight."""
    upcast: bool
    """The loss upcasts the logits to fp32 (Hugging Face); False: it runs in the model's dtype."""
    shift: bool
    """The loss shifts the labels itself (Hugging Face): padded and shifted int64 copies."""
    tied: bool
    """The weight is tied to the input embedding (its gradient is not copied at once)."""
    bias: bool = False
    """The logits have a bias (``V`` elements in the model's dtype), whose gradient the backward makes."""
    trained: bool = True
    """The projection's weight (and bias) take gradients. Frozen (LoRA leaves the head so): the
    projection saves only its weight, not its input, and the backward makes the hidden states'
    gradient alone."""

    @property
    def num_tokens(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def loss_bytes(self) -> int:
        """``r``: bytes per element of the dtype the loss runs in."""
        return FP32_BYTES if self.upcast else self.dtype_bytes

    def upcast_copy(self, rows: int) -> int:
        """Bytes of the fp32 copy of ``rows`` rows of logits (0 when there is none)."""
        return rows * self.vocab_size * FP32_BYTES if self.upcast and self.dtype_bytes != FP32_BYTES else 0

    @property
    def padded_bytes(self) -> int:
        return self.batch_size * (self.seq_len + 1) * LABEL_BYTES if self.shift else 0

    @property
    def shifted_bytes(self) -> int:
        return self.num_tokens * LABEL_BYTES if self.shift else 0

    @property
    def hidden_bytes(self) -> int:
        return self.num_tokens * self.hidden_size * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        return self.vocab_size * self.hidden_size * self.dtype_bytes

    @property
    def bias_bytes(self) -> int:
        """The bias's gradient (0 without a bias, or frozen)."""
        return self.vocab_size * self.dtype_bytes if self.bias and self.trained else 0

    @property
    def weight_grad_bytes(self) -> int:
        """The weight's gradient (0 when frozen)."""
        return self.weight_bytes if self.trained else 0

    @property
    def saved_hidden_bytes(self) -> int:
        """The hidden states the projection saves for its weight's gradient (0 when frozen)."""
        return self.hidden_bytes if self.trained else 0


@dataclass(kw_only=True, frozen=True)
class HeadBytes:
    """The bytes `remat.measure.types.HeadOption` measures, predicted."""

    held_bytes: int
    """Live from the end of the head's forward to its backward."""
    fwd_peak_bytes: int
    """Peak of the head's forward."""
    bwd_peak_bytes: int
    """Peak of the head's backward."""


def logits_bytes(shape: HeadShape) -> int:
    """The full logits in the dtype the loss runs in: ``T V r``."""
    return shape.num_tokens * shape.vocab_size * shape.loss_bytes


def keep_bytes(shape: HeadShape) -> HeadBytes:
    """The model's own head (module docstring)."""
    s, r = shape, shape.loss_bytes
    logits = s.num_tokens * s.vocab_size
    forward = s.hidden_bytes + logits * s.dtype_bytes + s.upcast_copy(s.num_tokens) + s.padded_bytes \
        + s.shifted_bytes + logits * r + 2 * r
    moments = [3 * logits * r, logits * s.dtype_bytes + s.hidden_bytes + s.weight_grad_bytes + s.bias_bytes]
    if s.upcast_copy(s.num_tokens):
        moments.append(logits * r + logits * s.dtype_bytes)
    if not s.trained:
        pass  # no weight gradient, no copy of it
    elif not s.tied and not s.bias:
        moments.append(s.hidden_bytes + 2 * s.weight_bytes)
    elif not s.tied:  # addmm's backward makes the weight's gradient in its layout: no copy (docstring)
        moments.append(logits * s.dtype_bytes + s.hidden_bytes + s.weight_bytes + 2 * s.bias_bytes)
    return HeadBytes(held_bytes=s.saved_hidden_bytes + s.shifted_bytes + logits * r + 2 * r, fwd_peak_bytes=forward,
                     bwd_peak_bytes=s.saved_hidden_bytes + 2 * r + max(moments))


def keep_saved_bytes(shape: HeadShape) -> int:
    """What autograd saves under keep: what it holds less the loss itself (``T H p + shifted + L r + r``:
    the hidden states, the shifted labels, the log-probabilities and nll_loss's total weight)."""
    return keep_bytes(shape).held_bytes - shape.loss_bytes


def recompute_bytes(shape: HeadShape) -> HeadBytes:
    """The model's own head in a checkpoint: held is the hidden states and the loss."""
    keep = keep_bytes(shape)
    r = shape.loss_bytes
    held_input = shape.hidden_bytes - shape.saved_hidden_bytes  # what the checkpoint holds that keep's backward does not
    return HeadBytes(held_bytes=shape.hidden_bytes + r, fwd_peak_bytes=keep.fwd_peak_bytes,
                     bwd_peak_bytes=max(keep.fwd_peak_bytes + 2 * r, keep.bwd_peak_bytes + held_input))


def chunked_bytes(shape: HeadShape, chunk_tokens: int) -> HeadBytes:
    """`remat.head.chunked` with chunks of ``chunk_tokens`` rows (module docstring)."""
    s, r = shape, shape.loss_bytes
    rows = min(chunk_tokens, s.num_tokens) * s.vocab_size
    first = rows * s.dtype_bytes + s.upcast_copy(min(chunk_tokens, s.num_tokens))  # projection (+ fp32 copy)
    chunk_fwd = max(first, 2 * rows * r) + 2 * r
    targets = s.hidden_bytes + s.shifted_bytes
    # the labels' padded copy; the count's mask and int64 sum; the count, the running total and a chunk
    forward = targets + max(s.padded_bytes, s.num_tokens + COUNT_BYTES, 2 * FP32_BYTES + chunk_fwd)
    weight = r if r != FP32_BYTES else 0  # the mean's count cast to a 16-bit loss dtype
    chunk_bwd = max(first, 2 * rows * r, 3 * rows * r + weight, rows * r + rows * s.dtype_bytes + weight)
    backward = targets + FP32_BYTES + 2 * r + s.hidden_bytes + s.weight_grad_bytes + s.bias_bytes + chunk_bwd
    return HeadBytes(held_bytes=targets + FP32_BYTES + r, fwd_peak_bytes=forward, bwd_peak_bytes=backward)


FORMULAS: dict[str, Callable[..., HeadBytes]] = {"keep": keep_bytes, "recompute": recompute_bytes, "chunked": chunked_bytes}
"""Head strategy kind -> its byte formula."""


def head_bytes(shape: HeadShape, strategy: str) -> HeadBytes:
    """The bytes of ``strategy`` (``keep``, ``recompute``, ``chunked:<tokens>``) on ``shape``."""
    kind, _, argument = strategy.partition(":")
    if kind not in FORMULAS or (kind == "chunked") != argument.isdigit():
        raise ValueError(f"unknown head strategy {strategy!r}; allowed: keep, recompute, chunked:<tokens>.")
    return FORMULAS[kind](shape, int(argument)) if argument else FORMULAS[kind](shape)


def projection_flops(num_tokens: int, hidden_size: int, vocab_size: int) -> int:
    """FLOPs of one forward of the projection: ``2 T H V`` (a multiply and an add per weight and token)."""
    return 2 * num_tokens * hidden_size * vocab_size
