"""Plans built by hand for apply tests, and a training loop to compare runs bit for bit."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from remat._batch import call_model, compute_loss
from remat.apply.api import apply_
from remat.apply.opcount import BlockOpCounter
from remat.measure.fingerprint import fingerprint
from remat.plan.types import Plan, Prediction, Segment

PREDICTION = Prediction(
    peak_bytes=1, step_ms=1.0, extra_flops=0, extra_ms=0.0, model_state_bytes=0, fixed_bytes=0,
    retained_bytes=(), peak_block=-1, peak_phase="block", working_bytes=0,
)


def seg(start: int, stop: int, strategy: str = "recompute", *children: Segment, saved_ops: tuple[str, ...] = ()) -> Segment:
    return Segment(start=start, stop=stop, strategy=strategy, children=tuple(children), saved_ops=saved_ops)


def make_plan(model: nn.Module, batch: Any, names: list[str], segments: list[Segment], name: str = "test") -> Plan:
    return Plan(segments=tuple(segments), block_names=tuple(names), strategy_name=name, budget_bytes=None,
                prediction=PREDICTION, fingerprint=fingerprint(model, batch))


def train(model: nn.Module, batch: Any, loss_fn: Any = None, plan: Plan | None = None, *, steps: int = 2,
          seed: int = 1) -> list[dict[str, Any]]:
    """Train a deep copy for ``steps`` AdamW steps; per step: loss, grads, state_dict."""
    model = copy.deepcopy(model)
    if plan is not None:
        apply_(model, plan, batch=batch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(seed)
    history = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = compute_loss(call_model(model, batch), batch, loss_fn)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        history.append({"loss": loss.detach(), "grads": grads,
                        "state": {k: v.clone() for k, v in model.state_dict().items()}})
    return history


def assert_identical(expected: list[dict[str, Any]], actual: list[dict[str, Any]]) -> None:
    for step, (want, got) in enumerate(zip(expected, actual, strict=True)):
        assert torch.equal(want["loss"], got["loss"]), f"step {step}: loss differs"
        assert want["grads"].keys() == got["grads"].keys()
        for name, grad in want["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=0, atol=0, msg=f"step {step}: grad {name}")
        assert want["state"].keys() == got["state"].keys()
        for name, value in want["state"].items():
            assert torch.equal(got["state"][name], value), f"step {step}: state {name} differs"


class LinearReluBlock(nn.Module):
    """Linear then ReLU: forward ops t, addmm, relu."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


def assert_trained_alike(models: list[nn.Module], batch: Any, loss_fn: Any, steps: int = 2) -> None:
    """Train each of ``models`` ``steps`` SGD steps on ``batch`` from the same seed; every
    parameter ends bit-identical to the last model's (the reference)."""
    for model in models:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(steps):
            torch.manual_seed(1)
            opt.zero_grad()
            loss_fn(model(batch), batch).backward()
            opt.step()
    for params in zip(*(model.parameters() for model in models)):
        assert all(torch.equal(p, params[-1]) for p in params)


def block_op_counts(model: nn.Module, batch: torch.Tensor, names: list[str]) -> BlockOpCounter:
    """Each named block's aten calls in a forward and backward of ``model(batch)`` (a scalar)."""
    blocks = [model.get_submodule(n) for n in names]
    model.zero_grad(set_to_none=True)
    with BlockOpCounter(blocks) as counter:
        model(batch).backward()
    return counter
