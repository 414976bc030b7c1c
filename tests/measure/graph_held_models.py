"""A custom autograd Function that keeps a tensor as an attribute of its ``ctx``, as torch's
documentation has it for intermediates: `tests/measure/test_graph_held.py` and
`tests/plan/test_random_layouts_measured.py`."""

from __future__ import annotations

import torch


class SiLU(torch.autograd.Function):
    """x * sigmoid(x): the input saved for backward, the sigmoid kept on ``ctx``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        s = torch.sigmoid(x)
        ctx.s = s
        ctx.save_for_backward(x)
        return x * s

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * ctx.s * (1 + x * (1 - ctx.s))
