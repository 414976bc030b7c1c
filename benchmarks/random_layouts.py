"""Layouts drawn at random from the whole plan space, each run and measured against its prediction.

    python -m benchmarks.random_layouts [--layouts 15] [--models masked-rows ctx-tensor dit perceiver
                                         x-transformers x-transformers-residual] [--hf gpt2 llama ...]
                                        [--diffusers unet2d flux ...] [--autocast]

Per model: profiled once (no optimizer, ``repeats=1``), then up to ``--layouts`` layouts drawn with
a fixed seed (per block a keep or selective option of `remat.plan.search.block_options`, or a
recompute segment of up to four blocks with nested children: what `tests/plan/plan_space.py`
enumerates), each verified (`remat.verify`, one step): how many measured above their prediction
(the unsafe side) and below it, the largest of each, and the first layouts that missed. The
hand-written models are `tests/plan/test_random_layouts_measured.py`'s; the x-transformers
decoders (two layers, width 32, 2 x 32 tokens; plain, and with residual attention and the first
layer's values) need `x_transformers` installed. ``--hf``: Hugging Face model types too, each
built as `benchmarks.sweep` builds it (`benchmarks._sweep.build`: a tiny config, random weights,
a batch made in code), profiled with SGD as the sweep does; ``--lora RANK``: fine-tuned with
LoRA of that rank and ``--lora-dropout`` as the sweep's ``--lora`` runs do (its frozen base
matmuls save none of a block's input that the adapters' dropout does not); ``--autocast``: their
forward under ``torch.autocast`` (bfloat16 on the CPU, entered inside the model's forward as the
README's "Mixed precision" has it); ``--experts eager``: their MoE layers loop over the experts
(`benchmarks._sweep.build.experts_kernel`), each on the tokens routed to it. ``--diffusers``:
diffusers models built from tiny configs (`benchmarks._sweep.diffusers_build`; diffusers installed
apart, no dependency of remat), without an optimizer as the hand-written ones.
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


LORA: tuple[int, float] | None = None
"""(rank, dropout) of the LoRA the Hugging Face models are fine-tuned with (None: none)."""
AUTOCAST = False
"""Whether the Hugging Face models run their forward under bfloat16 autocast."""
EXPERTS: str | None = None
"""The experts kernel of the Hugging Face models' MoE layers (`benchmarks._sweep.build.experts_kernel`;
None: the model's own)."""


def _autocast(model: Any) -> Any:
    import torch

    class Autocast(torch.nn.Module):
        """``model``'s forward under CPU bfloat16 autocast, keyword batches."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, **batch: Any) -> Any:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.model(**batch)

    return Autocast()


def build(name: str) -> tuple[Any, Any, Any]:
    """(model, batch, loss_fn) of ``name`` (``hf:<model type>``: a Hugging Face model)."""
    if name.startswith("hf:"):
        import benchmarks._sweep.build as hf
        from benchmarks.sweep import _fine_tuned

        hf.seed(0)
        built = hf.build(name[3:].split(" ")[0])
        if EXPERTS is not None:
            hf.experts_kernel(built.model, EXPERTS)
        model = built.model if LORA is None else _fine_tuned(built.model, LORA[0], LORA[1], None)
        return _autocast(model) if AUTOCAST else model, built.batch, hf.loss_fn
    if name.startswith("df:"):
        from benchmarks._sweep.diffusers_build import build as diffusers_model

        return diffusers_model(name[3:])
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

    import torch

    model, batch, loss = build(name)
    start = time.perf_counter()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3) if name.startswith("hf:") else None
    prof = remat.profile(model, batch, loss, optimizer, repeats=1)
    rng, errors, missed = random.Random(0), [], []
    for _ in range(10 * layouts):
        if len(errors) == layouts:
            break
        try:
            plan = make_plan(prof, _random_layout(prof, rng), "layout", None)
        except ValueError:  # across a break between blocks (`remat.plan.joins`)
            continue
        check = remat.verify(model, batch, plan, loss, optimizer, repeats=1)
        error = check.measured_peak_bytes - check.predicted_peak_bytes
        errors.append((error, 100.0 * error / check.predicted_peak_bytes, check.grads_identical))
        if error:
            missed.append((error, [(s.start, s.stop, s.strategy, [(c.start, c.stop) for c in s.children])
                                   for s in plan.segments if s.strategy != "keep"]))
    return {"model": name, "blocks": prof.num_blocks, "layouts": len(errors), "errors": errors, "missed": missed,
            "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.random_layouts", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(DEFAULT_MODELS), choices=DEFAULT_MODELS)
    parser.add_argument("--layouts", type=int, default=15)
    parser.add_argument("--hf", nargs="*", default=[], metavar="MODEL_TYPE",
                        help="Hugging Face model types to draw layouts for too (benchmarks.sweep's builds)")
    parser.add_argument("--hf-layers", type=int, default=4, help="layers of each stack of a Hugging Face model")
    parser.add_argument("--lora", type=int, default=None, metavar="RANK", help="fine-tune the Hugging Face models with LoRA")
    parser.add_argument("--lora-dropout", type=float, default=0.1)
    parser.add_argument("--autocast", action="store_true", help="the Hugging Face models' forward under bfloat16 autocast")
    parser.add_argument("--experts", default=None, choices=("eager", "grouped_mm", "batched_mm"),
                        help="the experts kernel of the Hugging Face models' MoE layers (default: theirs)")
    parser.add_argument("--diffusers", nargs="*", default=[], metavar="MODEL",
                        help="diffusers models to draw layouts for too (benchmarks._sweep.diffusers_build.BUILDERS)")
    args = parser.parse_args(argv)
    import benchmarks._sweep.build as hf

    global LORA, AUTOCAST, EXPERTS
    layers = hf.LAYERS
    LORA, hf.LAYERS = None if args.lora is None else (args.lora, args.lora_dropout), args.hf_layers  # `shrink` reads it
    AUTOCAST, EXPERTS = args.autocast, args.experts
    try:
        _table(args)
    finally:
        LORA, AUTOCAST, EXPERTS, hf.LAYERS = None, False, None, layers


def _table(args: argparse.Namespace) -> None:
    print("| model | blocks | layouts | gradients identical | above prediction (largest) | below (largest) |")
    print("| --- | ---: | ---: | --- | --- | --- |")
    details = []
    lora = f" + LoRA {args.lora} (dropout {args.lora_dropout})" if args.lora is not None else ""
    lora += " under autocast" if args.autocast else ""
    lora += f" ({args.experts} experts)" if args.experts else ""
    for name in [*args.models, *(f"hf:{t}{lora}" for t in args.hf), *(f"df:{m}" for m in args.diffusers)]:
        try:
            row = run(name, args.layouts)
        except ImportError as error:
            print(f"| {name} | - | - | - | not run: {error} | |")
            continue
        except Exception as error:  # noqa: BLE001 - a row of the table, the others go on
            print(f"| {name} | - | - | - | failed: {type(error).__name__}: {str(error).splitlines()[0][:200]} | |")
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
