"""Models whose forward hook keeps every block's output in a list on the model through the
backward (activation statistics, feature maps kept for a later look): predicted peak against
measured under full recomputation, √N segments and the least-peak plan.

    python -m benchmarks.hook_held [--models gpt mlp bert mistral t5 whisper]

The built-in GPT (4 layers) and a 16-block MLP, and the test zoo's tiny Hugging Face models
(`tests/zoo/zoo_models.py`, nothing downloaded). Each is profiled once without the hook to name
its blocks; a hook on each block then appends the block's output to a list the model's forward
empties as it begins, and the model is profiled again and verified under each plan (one timed
step): per model, the bytes of the blocks' inputs the code holds through the backward
(`BlockProfile.input_code_held_bytes`, summed), and per plan the measured peak's excess over the
prediction (positive: under-predicted, the unsafe side) and whether the gradients are
bit-identical (a plan with a chunked head: within that head's stated tolerance).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "zoo"))

DEFAULT_MODELS = ("gpt", "mlp", "bert", "mistral", "t5", "whisper")
PLANS = ("full", "sqrt", "least")


def _build(name: str) -> tuple[Any, Any, Any, Any]:
    from remat.models import build

    if name == "gpt":
        built = build("gpt")
    elif name == "mlp":
        built = build("mlp", depth=16, width=64, batch_size=64)
    else:
        from zoo_models import build_zoo

        zoo = build_zoo(name)
        return zoo.model, zoo.batch, zoo.loss_fn, zoo.optimizer
    return built.model, built.batch, built.loss_fn, built.optimizer


def hooked(name: str) -> dict[str, Any]:
    """One model's row: the held bytes and each plan's peak error."""
    import torch

    import remat

    model, batch, loss_fn, optimizer = _build(name)
    names = [b.name for b in remat.profile(model, batch, loss_fn, optimizer, repeats=1).blocks]
    kept: list[Any] = []

    def empty(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        kept.clear()

    model.register_forward_pre_hook(empty, with_kwargs=True)
    for block in names:
        model.get_submodule(block).register_forward_hook(lambda module, args, output: kept.append(output))
    prof = remat.profile(model, batch, loss_fn, optimizer, repeats=1)
    row: dict[str, Any] = {"model": name, "blocks": prof.num_blocks,
                           "held": sum(b.input_code_held_bytes for b in prof.blocks)}
    for strategy in PLANS:
        if strategy == "least":
            plan = remat.plan(prof, budget=min(p.prediction.peak_bytes for p in remat.pareto(prof)))
        else:
            plan = remat.plan(prof, strategy=strategy)
        check = remat.verify(model, batch, plan, loss_fn, optimizer, repeats=1)
        same = "bit-identical" if check.grads_identical else (
            f"{plan.head} head, within {check.relative_tolerance:g}" if check.ok else "DIFFER")
        row[strategy] = (100 * (check.measured_peak_bytes - check.predicted_peak_bytes) / check.predicted_peak_bytes, same)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hook_held", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    args = parser.parse_args(argv)
    print("| model | blocks | inputs the code holds (bytes) | " + " | ".join(f"{p}: measured above predicted" for p in PLANS)
          + " | gradients |")
    print("| --- | ---: | ---: | " + " | ".join("---:" for _ in PLANS) + " | --- |")
    for name in args.models:
        row = hooked(name)
        grads = "; ".join(f"{p}: {row[p][1]}" for p in PLANS if row[p][1] != "bit-identical") or "bit-identical"
        print(f"| {name} | {row['blocks']} | {row['held']:,} | " + " | ".join(f"{row[p][0]:+.2f} %" for p in PLANS)
              + f" | {grads} |", flush=True)


if __name__ == "__main__":
    main()
