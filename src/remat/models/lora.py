"""Low-rank adapters (LoRA, Hu et al. 2021) on a model's linear layers, every other weight frozen.

`add_lora` turns each ``nn.Linear`` of a model but its output embeddings (the LM head) into a
`LoRALinear` (or only those named in ``targets``): the same module, its weight and bias frozen, with two trained matrices beside it,
``lora_A`` (rank x in) and ``lora_B`` (out x rank), whose product is added to its output, scaled
by ``alpha / rank``; every other parameter (embeddings, norms, the head, experts kept as 3-D
tensors) is frozen. This is peft's ``LoraConfig(target_modules="all-linear", lora_dropout=0)``
(its default ``init_lora_weights``: ``lora_B`` starts at zero), with the parameter names of the
linear kept (``q_proj.weight``, ``q_proj.lora_A.weight``), so what names a linear (tensor
parallel plans) names it still. `remat.estimate` applies it with ``--lora R``; a model built here
with it and profiled measures the same step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a frozen weight and a trained low-rank update (module docstring)."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    scaling: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(x)) * self.scaling


def add_lora(model: nn.Module, rank: int, *, alpha: float | None = None,
             targets: Sequence[str] | None = None) -> nn.Module:
    """``model`` with LoRA of ``rank`` on every linear layer but its output embeddings, in place
    (module docstring), or on those whose name ends in one of ``targets`` (peft's
    ``target_modules`` as names: ``("q_proj", "v_proj")``, its default for Llama); returns it."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"LoRA rank must be an integer >= 1, got {rank!r}.")
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    linears = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear and m is not head]
    if not linears:
        raise ValueError(f"{type(model).__name__} has no nn.Linear besides its output embeddings for LoRA to adapt; "
                         "drop --lora.")
    if targets is not None:
        wanted = set(targets)
        found = [(n, m) for n, m in linears if n.rsplit(".", 1)[-1] in wanted]
        missing = sorted(wanted - {n.rsplit(".", 1)[-1] for n, _ in found})
        if missing:
            names = sorted({n.rsplit(".", 1)[-1] for n, _ in linears})
            raise ValueError(f"LoRA targets {missing} name no linear layer of {type(model).__name__}; its linear "
                             f"layers are named {', '.join(names)}. Pass --lora-targets with some of those, or leave it "
                             "out for all of them.")
        linears = found
    targets = [m for _, m in linears]
    for p in model.parameters():
        p.requires_grad_(False)
    for linear in targets:
        w = linear.weight
        linear.__class__ = LoRALinear
        linear.lora_A = nn.Linear(linear.in_features, rank, bias=False, device=w.device, dtype=w.dtype)
        linear.lora_B = nn.Linear(rank, linear.out_features, bias=False, device=w.device, dtype=w.dtype)
        if w.device.type != "meta":
            nn.init.kaiming_uniform_(linear.lora_A.weight, a=math.sqrt(5))
            nn.init.zeros_(linear.lora_B.weight)
        linear.scaling = (alpha if alpha is not None else rank) / rank
    return model


__all__ = ["LoRALinear", "add_lora"]
