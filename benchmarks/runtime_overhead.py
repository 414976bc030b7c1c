"""What remat's runtime adds per checkpointed block, beyond torch's own checkpoint.

A chain of tiny blocks (``Linear(width, width)`` + ReLU on 4 rows: a few microseconds of ops) is
trained three ways, each from the same weights, in interleaved rounds:

- ``plain``: the chain as written;
- ``checkpoint``: every block under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``,
  called directly (what per-block recipes do);
- ``remat``: every block ``recompute`` in a remat plan (`remat.apply_`).

Per block, forward and replay included: ``checkpoint - plain`` is what torch's checkpoint costs,
``remat - checkpoint`` what remat's runtime adds on top (block dispatch, the region, the buffer
guard). Medians over the rounds.

    python -m benchmarks.runtime_overhead --blocks 64 --width 8 --rounds 200
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class _Chain(nn.Module):
    def __init__(self, num_blocks: int, width: int, checkpointed: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width) for _ in range(num_blocks))
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return x.sum()


def _step_ms(model: nn.Module, x: torch.Tensor) -> float:
    for p in model.parameters():
        p.grad = None
    start = time.perf_counter()
    model(x).backward()
    return (time.perf_counter() - start) * 1e3


def measure(num_blocks: int, width: int, rounds: int, warmup: int = 20) -> dict[str, Any]:
    """Median step ms of each way and the per-block microseconds derived from them."""
    import remat
    from remat.plan.planners import make_plan
    from remat.plan.types import Segment

    torch.manual_seed(0)
    x = torch.randn(4, width)
    plain = _Chain(num_blocks, width)
    direct = _Chain(num_blocks, width, checkpointed=True)
    direct.load_state_dict(plain.state_dict())
    planned = _Chain(num_blocks, width)
    planned.load_state_dict(plain.state_dict())
    profile = remat.profile(planned, x, loss_fn=lambda out, batch: out, optimizer=None, repeats=1)
    segments = tuple(Segment(start=i, stop=i + 1, strategy="recompute") for i in range(num_blocks))
    remat.apply_(planned, make_plan(profile, segments, "every block", None))
    ways = {"plain": plain, "checkpoint": direct, "remat": planned}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(warmup + rounds):
        order = list(ways.items())
        order = order[r % 3:] + order[:r % 3]
        for name, model in order:
            ms = _step_ms(model, x)
            if r >= warmup:
                times[name].append(ms)
    medians = {name: statistics.median(t) for name, t in times.items()}
    per_block_us = {name: 1e3 * ms / num_blocks for name, ms in medians.items()}
    return {
        "blocks": num_blocks, "width": width, "rounds": rounds, "step_ms": medians,
        "checkpoint_us_per_block": per_block_us["checkpoint"] - per_block_us["plain"],
        "remat_us_per_block": per_block_us["remat"] - per_block_us["checkpoint"],
    }


def markdown(row: dict[str, Any]) -> str:
    ms = row["step_ms"]
    return "\n".join([
        "| blocks | width | rounds | plain ms | checkpoint ms | remat ms | checkpoint us / block | remat adds us / block |",
        "|---|---|---|---|---|---|---|---|",
        f"| {row['blocks']} | {row['width']} | {row['rounds']} | {ms['plain']:.3f} | {ms['checkpoint']:.3f} "
        f"| {ms['remat']:.3f} | {row['checkpoint_us_per_block']:.1f} | {row['remat_us_per_block']:.1f} |",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args(argv)
    for name in ("blocks", "width", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(1)
    print(markdown(measure(args.blocks, args.width, args.rounds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
