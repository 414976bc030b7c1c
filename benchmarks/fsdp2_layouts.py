"""FSDP2 per-rank peaks of explicit layouts against their predictions: how far the sharded
prediction sits above the measured peak where kept blocks and recompute segments of several blocks
mix.

    python -m benchmarks.fsdp2_layouts [--heavy-weights] [LAYOUT ...]

Two CPU ranks on gloo, the built-in GPT of `tests/distributed` (4 layers, d_model 64, 2 x 32
tokens a rank; ``--heavy-weights``: d_model 128, 1 x 4 tokens, no dropout, so weights outweigh
activations), AdamW. Each rank profiles the model, plans each layout on `shard_profile(profile,
world_size=2, zero_stage=3)` (`make_plan`, no search), applies it to a copy, shards it with
`fully_shard_by_plan` (a recompute segment of several blocks is one unit) and measures one step
under the live tracker after a first step that creates the optimizer state.

A layout is ``start:stop:strategy`` segments joined by ``,``: ``0:3:recompute,3:4:keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

# the workers live with the tests, at the repository root
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed"))

LAYOUTS = (
    "0:4:keep", "0:2:recompute,2:4:recompute", "0:2:keep,2:4:recompute", "0:2:recompute,2:4:keep",
    "0:3:recompute,3:4:keep", "0:1:keep,1:4:recompute", "0:1:keep,1:3:recompute,3:4:keep",
)
WORLD_SIZE = 2


def segments(layout: str) -> tuple:
    """The plan's segments: a kept range is one segment per block, a recompute range one segment."""
    from remat.plan.types import Segment

    out = []
    for part in layout.split(","):
        start, stop, strategy = part.split(":")
        a, b = int(start), int(stop)
        if strategy == "keep":
            out += [Segment(start=i, stop=i + 1, strategy="keep") for i in range(a, b)]
        else:
            out.append(Segment(start=a, stop=b, strategy=strategy))
    return tuple(out)


def rank_main(rank: int, world_size: int, port: int, out_dir: str, layouts: list[str], heavy: bool) -> None:
    import workers

    import remat
    from remat.distributed import shard_profile
    from remat.plan.planners import make_plan

    if heavy:
        workers.GPT_SIZES.update(d_model=128, seq_len=4, batch_size=1, dropout=0.0)
    workers._init(rank, world_size, port)
    weights, batch = workers._built(rank)
    profile = remat.profile(weights.model, batch, weights.loss_fn, weights.optimizer, warmup=0, repeats=1)
    sharded = shard_profile(profile, world_size=world_size, zero_stage=3)
    result: dict = {"unit_bytes": list(sharded.unit_bytes), "layouts": {}}
    for layout in layouts:
        plan = make_plan(sharded, segments(layout), layout, None)
        tracked = workers.fsdp2_step_peak(weights, batch, plan)
        result["layouts"][layout] = {"predicted": plan.prediction.peak_bytes, "measured": tracked.peak_bytes}
    workers._write(out_dir, rank, result)


def main(argv: list[str] | None = None) -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layouts", nargs="*", default=list(LAYOUTS))
    parser.add_argument("--heavy-weights", action="store_true")
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        mp.spawn(rank_main, args=(WORLD_SIZE, port, out_dir, args.layouts, args.heavy_weights), nprocs=WORLD_SIZE,
                 join=True)
        results = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    print(f"unit (one block's unsharded weights): {results[0]['unit_bytes'][0]:,} B")
    print("| layout | rank | predicted B | measured B | predicted - measured B | in units |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    unit = results[0]["unit_bytes"][0]
    for layout in args.layouts:
        for rank, res in enumerate(results):
            p, m = res["layouts"][layout]["predicted"], res["layouts"][layout]["measured"]
            print(f"| `{layout}` | {rank} | {p:,} | {m:,} | {p - m:+,} ({(p - m) / m * 100:+.1f} %) | {(p - m) / unit:.2f} |")


if __name__ == "__main__":
    main()
