"""Layouts drawn at random from the whole plan space, each run and measured against its prediction.

    python -m benchmarks.random_layouts [--layouts 15] [--models masked-rows ctx-tensor dit perceiver
                                         x-transformers x-transformers-residual]

Per model: profiled once (no optimizer, ``repeats=1``), then up to ``--layouts`` layouts drawn with
a fixed seed (per block a keep or selective option of `remat.plan.search.block_options`, or a
recompute segment of up to four blocks with nested children: what `tests/plan/plan_space.py`
enumerates), each verified (`remat.verify`, one step): how many measured above their prediction
(the unsafe side) and below it, the largest of each, and the first layouts that missed. The
hand-written models are `tests/plan/test_random_layouts_measured.py`'s; the x-transformers
decoders (two layers, width 32, 2 x 32 tokens; plain, and with residual attention and the first
layer's values) need `x_transformers` installed.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "plan"))

DEFAULT_MODELS = ("masked-rows", "ctx-tensor", "dit", "perceiver", "x-transformers", "x-transformers-residual")


def _x_transformers(residual: bool) -> tuple[Any, Any, Any]:
    import torch
    import torch.nn.functional as F
    from x_transformers import Decoder, TransformerWrapper

    torch.manual_seed(0)
    options = {"residual_attn": True, "add_value_residual": True} if residual else {}
    model = TransformerWrapper(num_tokens=128, max_seq_len=32, attn_layers=Decoder(dim=32, depth=2, heads=2, **options))
    loss = lambda out, batch: F.cross_entropy(out.reshape(-1, 128), batch.reshape(-1))  # noqa: E731
    return model, torch.randint(0, 128, (2, 32)), loss


def build(name: str) -> tuple[Any, Any, Any]:
    """(model, batch, loss_fn) of ``name``."""
    if name.startswith("x-transformers"):
        return _x_transformers(name.endswith("residual"))
    from test_random_layouts_measured import _case, _square

    model, batch = _case({"masked-rows": "masked rows", "ctx-tensor": "ctx tensor", "dit": "DiT",
                          "perceiver": "Perceiver"}[name])
    return model, batch, _square


def run(name: str, layouts: int) -> dict[str, Any]:
    import remat
    from remat.plan.planners import make_plan
    from test_random_layouts_measured import _random_layout

    model, batch, loss = build(name)
    start = time.perf_counter()
    prof = remat.profile(model, batch, loss, repeats=1)
    rng, errors, missed = random.Random(0), [], []
    for _ in range(10 * layouts):
        if len(errors) == layouts:
            break
        try:
            plan = make_plan(prof, _random_layout(prof, rng), "layout", None)
        except ValueError:  # across a break between blocks (`remat.plan.joins`)
            continue
        check = remat.verify(model, batch, plan, loss, repeats=1)
        error = check.measured_peak_bytes - check.predicted_peak_bytes
        errors.append((error, 100.0 * error / check.predicted_peak_bytes, check.grads_identical))
        if error:
            missed.append((error, [(s.start, s.stop, s.strategy, [(c.start, c.stop) for c in s.children])
                                   for s in plan.segments if s.strategy != "keep"]))
    return {"model": name, "blocks": prof.num_blocks, "layouts": len(errors), "errors": errors, "missed": missed,
            "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.random_layouts", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=DEFAULT_MODELS)
    parser.add_argument("--layouts", type=int, default=15)
    args = parser.parse_args(argv)
    print("| model | blocks | layouts | gradients identical | above prediction (largest) | below (largest) |")
    print("| --- | ---: | ---: | --- | --- | --- |")
    details = []
    for name in args.models:
        try:
            row = run(name, args.layouts)
        except ImportError as error:
            print(f"| {name} | - | - | - | not run: {error} | |")
            continue
        above = [e for e in row["errors"] if e[0] > 0]
        below = [e for e in row["errors"] if e[0] < 0]
        worst = lambda es, key: f"{len(es)} ({key(es)[0]:+,d} B, {key(es)[1]:+.2f} %)" if es else "0"  # noqa: E731
        print(f"| {name} | {row['blocks']} | {row['layouts']} | {all(e[2] for e in row['errors'])} | "
              f"{worst(above, lambda es: max(es))} | {worst(below, lambda es: min(es))} |", flush=True)
        details += [(name, error, layout) for error, layout in row["missed"][:3]]
    for name, error, layout in details:
        print(f"- {name}: {error:+,d} bytes, recomputed or selective: {layout}")


if __name__ == "__main__":
    main()
