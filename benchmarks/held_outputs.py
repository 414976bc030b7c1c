"""Models whose output keeps every layer's attention weights (``output_attentions=True``): every
keep/recompute layout of their blocks, predicted peak against measured.

    python -m benchmarks.held_outputs [--models bert whisper mistral t5]

The test zoo's tiny models (`tests/zoo/zoo_models.py`, nothing downloaded) and a BART of the same
size built from its config, each profiled once
with ``output_attentions=True`` in its batch, then every layout of ``keep`` and ``recompute`` over
its blocks verified (`remat.verify`, one timed step): per model, the bytes the code holds to the
loss per block (`BlockProfile.output_end_held_bytes`), the largest measured excess over the
prediction (under-prediction, the unsafe side) and the largest shortfall.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "zoo"))

DEFAULT_MODELS = ("bert", "whisper", "mistral", "t5", "bart")


def _bart() -> tuple[Any, dict[str, Any], Any]:
    """BART, not in the zoo: 2 + 2 layers of width 32, 4 sequences of 32 tokens, AdamW."""
    import torch
    import transformers

    cfg = transformers.BartConfig(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(cfg).train()
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(3, 128, (4, 32), generator=g), torch.randint(3, 128, (4, 32), generator=g)
    return model, {"input_ids": ids, "labels": labels, "use_cache": False}, torch.optim.AdamW(model.parameters(), lr=1e-3)


def layouts(name: str) -> dict[str, Any]:
    """One model's row: its held bytes per block and every layout's peak error."""
    import remat
    from remat.plan.planners import make_plan
    from remat.plan.types import Segment
    from zoo_models import build_zoo

    if name == "bart":
        model, batch, optimizer = _bart()
        loss_fn = None
    else:
        zoo = build_zoo(name)
        model, batch, loss_fn, optimizer = zoo.model, zoo.batch, zoo.loss_fn, zoo.optimizer
    batch = {**batch, "output_attentions": True}
    prof = remat.profile(model, batch, loss_fn, optimizer, repeats=1)
    errors = []
    for combo in itertools.product(("keep", "recompute"), repeat=prof.num_blocks):
        segments = tuple(Segment(start=i, stop=i + 1, strategy=s) for i, s in enumerate(combo))
        check = remat.verify(model, batch, make_plan(prof, segments, "layout", None), loss_fn, optimizer, repeats=1)
        errors.append((100 * (check.measured_peak_bytes - check.predicted_peak_bytes) / check.predicted_peak_bytes,
                       combo))
    return {"model": name, "held": [b.output_end_held_bytes for b in prof.blocks], "layouts": len(errors),
            "most_under": max(errors), "most_over": min(errors)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.held_outputs", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    args = parser.parse_args(argv)
    print("| model | held to the loss per block (bytes) | layouts | measured above predicted, most (layout) "
          "| measured below predicted, most |")
    print("| --- | --- | ---: | --- | ---: |")
    for name in args.models:
        row = layouts(name)
        (under, combo), (over, _) = row["most_under"], row["most_over"]
        print(f"| {name} | {row['held']} | {row['layouts']} | {under:+.2f} % ({', '.join(combo)}) | {over:+.2f} % |",
              flush=True)


if __name__ == "__main__":
    main()
