"""What splitting a recomputed segment costs in a step: torch's own checkpoint around segments of
k blocks, for every k that divides the stack, side by side with remat's full and √N plans.

    .venv/bin/python -m benchmarks.segment_calls [--device cuda] [--rounds 15] [--json FILE]

Per model (the built-in convnet and GPT; on CUDA at the device check's full sizes, on the CPU at
toy sizes): one `remat.profile`, the plans none / full / sqrt and their predicted steps; then the
model without recomputation, ``checkpoint(use_reentrant=False)`` around each segment of k
consecutive blocks for k = 1, 2, 4 and the whole stack, and remat's full and √N plans applied,
each with its own AdamW, timed in interleaved rounds (the order rotated each round; CUDA events
on a GPU). Reported: medians, the profile's `Profile.checkpoint_call_ms` and block 0's
`recompute_overhead_ms`, which are what the time model charges a segment boundary.

The cost model takes a segment of k blocks to cost one checkpointed call less per block joined
(`remat.plan.costs`); this shows what a boundary costs in a real step.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import remat
from remat._batch import forward_backward
from remat._files import write_atomic
from remat.models import load_target
from remat.plan.planners import plan as make_plan

SIZES = {
    "cuda": {"convnet": dict(num_blocks=16, channels=64, image_size=64, batch_size=64),
             "gpt": dict(num_layers=8, d_model=1024, num_heads=16, seq_len=1024, batch_size=4, vocab_size=512)},
    "cpu": {"convnet": dict(num_blocks=8, channels=8, image_size=16, batch_size=4),
            "gpt": dict(num_layers=4, d_model=32, num_heads=2, seq_len=32, batch_size=2, vocab_size=64)},
}


class Segment(nn.Module):
    """``blocks`` run in turn inside one non-reentrant checkpoint."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._run, x, use_reentrant=False)


def segmented(model: nn.Module, k: int) -> nn.Module:
    """A copy of ``model`` whose ``blocks`` list runs in checkpointed segments of ``k`` blocks."""
    copied = copy.deepcopy(model)
    blocks = list(copied.blocks)
    copied.blocks = nn.ModuleList(Segment(blocks[i:i + k]) for i in range(0, len(blocks), k))
    return copied


def _step_ms(step: Any, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    begin = time.perf_counter()
    step()
    return 1e3 * (time.perf_counter() - begin)


def measure(name: str, sizes: dict[str, int], device: str, rounds: int, warmup: int = 3) -> dict[str, Any]:
    built = load_target(name, seed=0, device=device, **sizes)
    base = built.model
    count = len(base.blocks)
    prof = remat.profile(copy.deepcopy(base), built.batch, built.loss_fn, torch.optim.AdamW(base.parameters()))
    plans = {s: make_plan(prof, strategy=s) for s in ("none", "full", "sqrt")}
    variants: dict[str, nn.Module] = {"none": copy.deepcopy(base)}
    for k in sorted({1, 2, 4, count}):
        if k <= count:
            variants[f"torch, {k} a segment ({-(-count // k)} calls)"] = segmented(base, k)
    for s in ("full", "sqrt"):
        variants[f"remat {s}"] = remat.apply_(copy.deepcopy(base), plans[s], batch=built.batch)
    optimizers = {key: torch.optim.AdamW(model.parameters()) for key, model in variants.items()}

    def step(key: str) -> None:
        optimizers[key].zero_grad(set_to_none=True)
        forward_backward(variants[key], built.batch, built.loss_fn)
        optimizers[key].step()

    for key in variants:
        for _ in range(warmup):
            step(key)
    times: dict[str, list[float]] = {key: [] for key in variants}
    keys = list(variants)
    for r in range(rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            times[key].append(_step_ms(lambda: step(key), device))
    return dict(model=name, sizes=sizes, blocks=count, checkpoint_call_ms=prof.checkpoint_call_ms,
                block0_recompute_overhead_ms=prof.blocks[0].recompute_overhead_ms,
                block0_fwd_ms=prof.blocks[0].fwd_ms, block0_bwd_ms=prof.blocks[0].bwd_ms,
                predicted_ms={s: p.prediction.step_ms for s, p in plans.items()},
                measured_ms={key: statistics.median(ts) for key, ts in times.items()})


def markdown(rows: list[dict[str, Any]], device: str, rounds: int) -> str:
    lines = [f"Medians of {rounds} interleaved rounds, {device}, torch {torch.__version__}.", ""]
    for row in rows:
        lines += [f"{row['model']} ({row['blocks']} blocks, {row['sizes']}): checkpointed call "
                  f"{row['checkpoint_call_ms']:.3f} ms, block 0 overhead {row['block0_recompute_overhead_ms']:.3f} ms, "
                  f"forward {row['block0_fwd_ms']:.2f} ms, backward {row['block0_bwd_ms']:.2f} ms (profile); "
                  "predicted none / full / sqrt "
                  + " / ".join(f"{row['predicted_ms'][s]:.1f}" for s in ("none", "full", "sqrt"))
                  + " ms", "", "| run | step ms |", "| --- | ---: |"]
        lines += [f"| {key} | {ms:.1f} |" for key, ms in row["measured_ms"].items()]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=sorted(SIZES))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--models", nargs="+", default=list(SIZES["cpu"]))
    parser.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available; run with --device cpu.")
    rows = [measure(name, SIZES[args.device][name], args.device, args.rounds) for name in args.models]
    print(markdown(rows, args.device, args.rounds))
    if args.json is not None:
        write_atomic(args.json, json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
