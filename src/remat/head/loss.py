"""The token cross-entropy a language model computes from its logits, as plain data.

Two conventions cover the models remat plans a head for:

- Hugging Face causal LMs (``transformers.loss.loss_utils.ForCausalLMLoss``, 5.x): the logits
  are upcast to fp32 (``logits.float()``, a no-op for fp32 logits), the labels are shifted by
  one inside the loss (padded on the right with ``ignore_index``, then ``labels[..., 1:]``),
  positions labelled ``ignore_index`` (-100) are left out, and the mean is taken over the
  others, or the sum is divided by ``num_items_in_batch`` when the batch passes one;
- the built-in GPT (`remat.models.gpt.GPT`): ``F.cross_entropy`` of the logits as they are,
  against targets already aligned, mean over the non-ignored targets.

`reference_loss` computes either with the very ops the model runs, so that its result is
bit-identical to the model's own loss (`remat.head.site` checks that before planning a head);
`remat.head.chunked` computes the same loss chunk by chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["TokenLoss", "LossInputs", "token_targets", "reference_loss", "loss_divisor"]


@dataclass(kw_only=True, frozen=True)
class TokenLoss:
    """How a model turns logits and labels into its scalar loss."""

    shift: bool
    """Labels are shifted by one inside the loss (Hugging Face); False: targets are aligned."""
    upcast: bool
    """Logits are upcast to fp32 before the loss (Hugging Face's ``logits.float()``)."""
    ignore_index: int = -100
    """Label value left out of the loss and of the mean's count."""


@dataclass(kw_only=True, frozen=True)
class LossInputs:
    """The labels of one call and the loss keywords that came with them."""

    labels: torch.Tensor
    """Labels as passed to the model, shape (batch, seq)."""
    num_items_in_batch: Any = None
    """Divide the summed loss by this instead of taking the mean (Hugging Face keyword)."""
    shift_labels: torch.Tensor | None = None
    """Already shifted labels (Hugging Face keyword); used instead of shifting ``labels``."""


def token_targets(inputs: LossInputs, loss: TokenLoss) -> torch.Tensor:
    """The flat target of every logit row, made with the model's own ops (a new storage when
    shifted: the padded copy is a temporary, the shifted copy what the loss keeps)."""
    if not loss.shift:
        return inputs.labels.reshape(-1)
    shifted = inputs.shift_labels
    if shifted is None:
        padded = F.pad(inputs.labels, (0, 1), value=loss.ignore_index)
        shifted = padded[..., 1:].contiguous()
    return shifted.view(-1)


def reference_loss(logits: torch.Tensor, inputs: LossInputs, loss: TokenLoss) -> torch.Tensor:
    """The model's loss of full logits (batch, seq, vocab), op for op as the model computes it."""
    if loss.upcast:
        logits = logits.float()
    targets = token_targets(inputs, loss).to(logits.device)
    flat = logits.reshape(-1, logits.size(-1))
    if inputs.num_items_in_batch is None:
        return F.cross_entropy(flat, targets, ignore_index=loss.ignore_index)
    summed = F.cross_entropy(flat, targets, ignore_index=loss.ignore_index, reduction="sum")
    return summed / _on(inputs.num_items_in_batch, summed.device)


def loss_divisor(targets: torch.Tensor, inputs: LossInputs, loss: TokenLoss) -> torch.Tensor | Any:
    """What the summed loss is divided by: the count of non-ignored targets (as the mean's
    fp32 ``total_weight``), or ``num_items_in_batch``."""
    if inputs.num_items_in_batch is not None:
        return _on(inputs.num_items_in_batch, targets.device)
    return (targets != loss.ignore_index).sum().to(torch.float32)


def _on(value: Any, device: torch.device) -> Any:
    return value.to(device) if torch.is_tensor(value) else value
