"""What a selective plan's caches hold on a batch other than the profiled one, on mixtures of experts.

    python -m benchmarks.routed_caches [--hf jetmoe mixtral qwen2_moe ...] [--block 1] [--options 40]

A router sends each token to its experts, so the calls of an expert run on as many tokens as
this batch routed to it. Per model (a Hugging Face model type built as `benchmarks.sweep` builds
it, random weights, ``--layers`` layers; ``--experts``: the kernel its experts run, where
Hugging Face's MoE layers let the config choose: ``grouped_mm``, the default, runs every expert in
one call on the tokens sorted by expert, ``eager`` loops over the experts): profiled once on its batch (no optimizer), then up to
``--options`` of block ``--block``'s selective options (`remat.plan.search.block_options`, evenly
spaced, the other blocks kept), each applied and run forward on the profiled batch and on
another batch of the same shapes (the builder's batch under another seed). The bytes live once
the loss is computed (parameters, what autograd saved, the caches, the output) differ between
the batches by what the step without a plan holds differently (a router that drops the tokens
past an expert's capacity saves fewer of them), and a plan's caches must add nothing to it: a
cache that holds one expert's tokens does. Reported per model: the calls whose
sizes the profile found following the data (`remat.measure.size_groups`: in families, and
never cached), how many options held other bytes on the other batch and the largest
difference. The same command on the code before `size_groups` (no such field) shows what
the options held then.
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch
from torch.utils._pytree import tree_map

DEFAULT_MODELS = ("jetmoe", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "phimoe", "deepseek_v3",
                  "dbrx", "gpt_oss", "minimax", "ernie4_5_moe", "hunyuan_v1_moe", "glm4_moe", "flex_olmo", "dots1")


def _live_after_forward(model: Any, plan: Any, batch: Any, loss_fn: Any) -> int:
    import remat
    from remat._batch import call_model
    from remat.measure.tracker import LiveTracker

    remat.apply_(model, plan)
    try:
        tracker = LiveTracker(torch.device("cpu"))
        tracker.register(model.parameters(), "parameters")
        tracker.register(model.buffers(), "buffers")
        with tracker:
            loss = loss_fn(call_model(model, batch), batch)
            gc.collect()  # what only a reference cycle holds is not the step's
            live = tracker.live_bytes
        del loss
    finally:
        remat.remove_(model)
    return live


def _other_batch(batch: Any) -> Any:
    """``batch`` with its token ids shuffled (one permutation per shape, so labels that equal the
    ids stay equal to them) and noise added to its floating tensors; masks (0 and 1 only) as they are."""
    generator = torch.Generator().manual_seed(1)
    orders: dict[tuple[int, ...], torch.Tensor] = {}

    def other(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.numel() < 2:
            return t
        if t.is_floating_point():
            return t + torch.randn(t.shape, generator=generator).to(t.dtype) * (t.float().std().item() or 1.0)
        if t.dtype == torch.bool or set(t.unique().tolist()) <= {0, 1}:
            return t
        order = orders.setdefault(tuple(t.shape), torch.randperm(t.numel(), generator=generator))
        return t.flatten()[order].reshape(t.shape)

    return tree_map(other, batch)


def run(model_type: str, block: int, limit: int, experts: str | None = None) -> dict[str, Any]:
    import benchmarks._sweep.build as hf
    import remat
    from remat.plan.planners import make_plan
    from remat.plan.search import block_options
    from remat.plan.types import Segment

    start = time.perf_counter()
    hf.seed(0)
    built = hf.build(model_type)
    model, batch, loss_fn = built.model, built.batch, hf.loss_fn
    if experts is not None:
        hf.experts_kernel(model, experts)
    other = _other_batch(batch)
    prof = remat.profile(model, batch, loss_fn, repeats=1)
    block = min(block, prof.num_blocks - 1)
    groups = [getattr(op, "size_group", -1) for op in prof.blocks[block].ops]
    options = [o for o in block_options(prof, block) if o.kind == "selective"]
    picked = options[:: max(1, -(-len(options) // limit))]
    def difference(option: Segment) -> int:
        layout = tuple(option if i == block else Segment(start=i, stop=i + 1, strategy="keep")
                       for i in range(prof.num_blocks))
        plan = make_plan(prof, layout, "layout", None)
        return _live_after_forward(model, plan, other, loss_fn) - _live_after_forward(model, plan, batch, loss_fn)

    # what a kept step holds differs too where a router drops tokens past its capacity: the options'
    # caches are what differs beyond it
    kept = difference(Segment(start=block, stop=block + 1, strategy="keep"))
    differ = [d - kept for d in map(difference, picked) if d != kept]
    return {"model": model_type, "block": prof.blocks[block].name, "families": len({g for g in groups if g >= 0}),
            "in_families": sum(g >= 0 for g in groups), "never": sum(g == -2 for g in groups),
            "options": len(picked), "of": len(options), "differ": differ, "kept": kept,
            "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.routed_caches", description=__doc__.splitlines()[0])
    parser.add_argument("--hf", nargs="*", default=list(DEFAULT_MODELS), metavar="MODEL_TYPE")
    parser.add_argument("--block", type=int, default=1, help="the block whose selective options are run")
    parser.add_argument("--options", type=int, default=40, help="selective options per model at most")
    parser.add_argument("--layers", type=int, default=4, help="layers of each stack")
    parser.add_argument("--experts", default=None, choices=("eager", "grouped_mm", "batched_mm"),
                        help="the experts kernel of Hugging Face's MoE layers (default: the model's, grouped_mm)")
    args = parser.parse_args(argv)
    import benchmarks._sweep.build as hf

    hf.LAYERS = args.layers
    print("| model | block | calls in families (families) | never cached | options run (of) | kept step, other batch | "
          "options holding other bytes beyond it (largest) | s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |")
    for model_type in args.hf:
        try:
            row = run(model_type, args.block, args.options, args.experts)
        except Exception as error:  # noqa: BLE001 - a row of the table, the others go on
            print(f"| {model_type} | - | - | - | - | - | failed: {type(error).__name__}: {str(error).splitlines()[0][:160]} | |")
            continue
        largest = max(row["differ"], key=abs) if row["differ"] else 0
        print(f"| {model_type} | {row['block']} | {row['in_families']} ({row['families']}) | {row['never']} | "
              f"{row['options']} ({row['of']}) | {row['kept']:+,d} B | {len(row['differ'])} ({largest:+,d} B) | "
              f"{row['seconds']:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
