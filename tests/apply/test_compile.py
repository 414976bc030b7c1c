"""torch.compile of a planned model: remat's runtime adds no graph break (``fullgraph=True``
compiles it or raises), and the gradients equal those of the same model compiled without a plan.

The backend is ``aot_eager``: Dynamo traces remat's runtime and AOT Autograd partitions the
checkpointed regions, which is where a plan meets the compiler; Inductor's code generation is
left out to keep the test seconds long on the CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from remat.apply.api import apply_

from apply_helpers import make_plan, seg

WIDTH = 16


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.BatchNorm1d(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.linear(x))) + x


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _compiled_steps(model: nn.Module, x: torch.Tensor, steps: int = 2) -> list[dict[str, torch.Tensor]]:
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        compiled(x).backward()
        out.append({**{n: p.grad.clone() for n, p in model.named_parameters()},
                    **{n: b.clone() for n, b in model.named_buffers()}})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("segments", [
    [seg(0, 2, "recompute")],
    [seg(i, i + 1, "selective:save-matmuls", saved_ops=("aten.addmm.default#0",)) for i in range(2)],
], ids=["recompute", "selective"])
def test_a_planned_model_compiles_whole_with_the_gradients_of_the_unplanned_one(segments):
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(8, WIDTH)
    planned = copy.deepcopy(model)
    apply_(planned, make_plan(planned, x, ["blocks.0", "blocks.1"], segments))
    want, got = _compiled_steps(model, x), _compiled_steps(planned, x)
    for step_want, step_got in zip(want, got, strict=True):
        assert step_want.keys() == step_got.keys()
        for name in step_want:  # running statistics included: they advance once per step
            torch.testing.assert_close(step_got[name], step_want[name], msg=name)
    assert got[-1]["blocks.0.norm.num_batches_tracked"].item() == 2


@pytest.mark.slow
def test_the_cache_switch_traces_without_a_break():
    """What the runtime runs on every planned block's call, and the pre-hook on a Hugging Face
    model, compile whole (a type walk or a warning inside would break the graph)."""
    from remat.checkpointing.caches import _cache_off_hook, drop_kv_caches

    class _Config:
        use_cache = True

    class _Model(nn.Module):
        config = _Config()

    def step(x: torch.Tensor) -> torch.Tensor:
        args, kwargs = drop_kv_caches((x, None), {"mask": x, "past_key_values": None})
        _, hooked = _cache_off_hook(_Model(), (x,), {"use_cache": None})
        return args[0] * 2 if hooked["use_cache"] is False and kwargs["past_key_values"] is None else x

    torch._dynamo.reset()
    assert torch.equal(torch.compile(step, fullgraph=True, backend="eager")(torch.ones(2)), torch.full((2,), 2.0))
