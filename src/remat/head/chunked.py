"""The projection and token cross-entropy over chunks of tokens: the full logits never exist.

`chunked_cross_entropy(hidden, weight, bias, inputs, loss, chunk_tokens)` returns the model's
loss (`remat.head.loss`) as one autograd node. Its forward projects ``chunk_tokens`` rows of
the hidden states at a time and sums their cross-entropy; it keeps the hidden states, the
targets and the divisor. Its backward projects each chunk again and writes the chunk's share
of every gradient at once: the hidden states' rows, and the weight's (and bias's) running
sums. At most one chunk's logits, log-probabilities and their gradients are alive at a time.

This is the technique of torchtune's chunked cross-entropy (``CEWithChunkedOutputLoss``,
torchtune/modules/loss/ce_chunked_output_loss.py: chunked upcast and loss), Liger-Kernel's fused
linear cross-entropy (Hsu et al. 2024, arXiv 2410.10989; the projection chunked too, gradients
written in the forward, accumulated in the weight's dtype) and Cut Cross-Entropy (Wijmans et al.
2024, arXiv 2411.09009: the logits never materialised in global memory), written in plain
PyTorch. Unlike Liger, the gradients are computed in the backward (the forward keeps no gradient
buffers, so a forward-only call costs one chunk), and each chunk's logit gradient is made by the
very aten kernels autograd runs for ``F.cross_entropy`` (``log_softmax``, ``nll_loss_backward``,
``_log_softmax_backward_data``) with the same arguments.

What chunking changes is arithmetic order, in two ways. The loss and the weight's and bias's
gradients are sums over tokens, taken chunk by chunk (chunk sums added in turn, ``addmm_`` of one
chunk after another) where the unchunked head reduces all rows at once. And a matrix product of
a chunk of rows may be reduced in another order than the product of all rows (a BLAS picks its
kernel by shape): measured on this CPU, the hidden states' gradient is bit-identical for chunks
of 4 rows and more at width 32-64, but not at width 256 under 256 rows, nor for one-row chunks.
So every gradient may differ in its last bits; `remat.verify` compares them with the
strategy's stated tolerance (`remat.head.strategies.HeadChunked.relative_tolerance`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from remat.head.loss import LossInputs, TokenLoss, loss_divisor, token_targets

__all__ = ["chunked_cross_entropy", "chunk_bounds", "num_chunks"]

_MEAN, _SUM = 1, 2  # at::Reduction::Mean, at::Reduction::Sum


def num_chunks(num_tokens: int, chunk_tokens: int) -> int:
    """Chunks of ``chunk_tokens`` rows that cover ``num_tokens`` rows."""
    return -(-num_tokens // chunk_tokens)


def chunk_bounds(num_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each chunk of rows."""
    return [(a, min(a + chunk_tokens, num_tokens)) for a in range(0, num_tokens, chunk_tokens)]


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          inputs: LossInputs, loss: TokenLoss, chunk_tokens: int) -> torch.Tensor:
    """The loss of ``F.linear(hidden, weight, bias)`` under ``loss``, ``chunk_tokens`` rows at a time."""
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r} must be a positive int (rows of logits per chunk).")
    if torch.is_autocast_enabled(hidden.device.type):
        raise ValueError(
            "the chunked head does not run under torch.autocast: its backward recomputes the logits "
            "outside the autocast region. Cast the model to its training dtype (model.to(torch.bfloat16)) "
            "or plan the head as keep or recompute."
        )
    targets = token_targets(inputs, loss).to(hidden.device)
    divisor = loss_divisor(targets, inputs, loss)
    flat = hidden.reshape(-1, hidden.size(-1))
    if flat.size(0) != targets.numel():
        raise ValueError(
            f"the head sees {flat.size(0)} rows of hidden states but {targets.numel()} targets; the labels "
            "must have the shape of the input ids (batch, seq)."
        )
    mean = inputs.num_items_in_batch is None
    return _ChunkedLinearCrossEntropy.apply(flat, weight, bias, targets, divisor, chunk_tokens, loss, mean)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Forward: summed chunk losses / divisor. Backward: each chunk's logits again, then its
    logit gradient (the aten kernels of ``F.cross_entropy``'s backward) into the three gradients."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, divisor: Any, chunk_tokens: int, loss: TokenLoss, mean: bool) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        out_dtype = torch.float32
        for a, b in chunk_bounds(hidden.size(0), chunk_tokens):
            logits = _logits(hidden[a:b], weight, bias, loss)
            out_dtype = logits.dtype
            total.add_(F.cross_entropy(logits, targets[a:b], ignore_index=loss.ignore_index, reduction="sum"))
            del logits
        tensor_divisor = divisor if torch.is_tensor(divisor) else None
        ctx.save_for_backward(hidden, weight, bias, targets, tensor_divisor)
        # a tensor divisor only as a saved tensor: the backward frees those, not ctx attributes
        ctx.divisor = None if tensor_divisor is not None else divisor
        ctx.chunk_tokens, ctx.loss, ctx.mean = chunk_tokens, loss, mean
        return (total / divisor).to(out_dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, bias, targets, tensor_divisor = ctx.saved_tensors
        divisor = tensor_divisor if tensor_divisor is not None else ctx.divisor
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        d_hidden = torch.empty_like(hidden) if need_hidden else None
        d_weight = torch.zeros_like(weight) if need_weight else None
        d_bias = torch.zeros_like(bias) if bias is not None and need_bias else None
        # the grad of the summed loss, as the model's reduction passes it to nll_loss_backward
        scale = (grad, _MEAN) if ctx.mean else (grad / divisor, _SUM)
        for a, b in chunk_bounds(hidden.size(0), ctx.chunk_tokens):
            d_logits = _logits_grad(hidden[a:b], weight, bias, targets[a:b], scale, divisor, ctx.loss)
            if d_hidden is not None:
                torch.mm(d_logits, weight, out=d_hidden[a:b])
            if d_weight is not None:
                d_weight.addmm_(d_logits.t(), hidden[a:b])
            if d_bias is not None:
                d_bias.add_(d_logits.sum(0))
            del d_logits
        return d_hidden, d_weight, d_bias, None, None, None, None, None


def _logits(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, loss: TokenLoss) -> torch.Tensor:
    """One chunk's logits as the loss sees them (upcast to fp32 under the Hugging Face convention)."""
    logits = F.linear(rows, weight, bias)
    return logits.float() if loss.upcast else logits


def _logits_grad(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                 scale: tuple[torch.Tensor, int], divisor: Any, loss: TokenLoss) -> torch.Tensor:
    """d loss / d logits of one chunk, in the projection's dtype: what autograd computes for
    ``F.cross_entropy`` (log_softmax, then nll_loss) with the model's reduction, row for row."""
    logp = torch.log_softmax(_logits(rows, weight, bias, loss), dim=-1)
    grad, reduction = scale
    # the mean's total_weight: the count of non-ignored targets, in the loss's dtype
    total_weight = divisor.to(logp.dtype) if reduction == _MEAN else grad.new_ones((), dtype=logp.dtype)
    d_logp = torch.ops.aten.nll_loss_backward(grad.to(logp.dtype), logp, targets, None, reduction,
                                              loss.ignore_index, total_weight)
    d_logits = torch.ops.aten._log_softmax_backward_data(d_logp, logp, -1, logp.dtype)
    del d_logp, logp
    return d_logits.to(rows.dtype) if d_logits.dtype != rows.dtype else d_logits
