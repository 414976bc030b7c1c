"""What a profile costs against depth: wall time and training steps of `remat.profile`.

For each model and depth: the median of a few plain training steps (after two warm-up steps),
then one `remat.profile` (default settings: one warm-up step, 5 timed steps) timed whole, as
seconds and as that many training steps; the blocks whose timing probes ran (the rest take an
alike block's, `remat.measure.sharing`); and whether the profile met the target, at most
max(20 steps, 10 s). ``--unshared`` adds a profile that measures every block's probes
(``share_timing=False``), side by side.

    .venv/bin/python -m benchmarks.profile_cost                        # MLP 8-256 blocks, GPT 2-16 layers
    .venv/bin/python -m benchmarks.profile_cost --mlp-depths 8,64 --gpt-layers 2 --unshared
    .venv/bin/python -m benchmarks.profile_cost --markdown profile-cost.md
    .venv/bin/python -m benchmarks.profile_cost --mlp-depths '' --gpt-layers '' --resnet-images 96,160
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from remat._batch import call_model, compute_loss
from remat.measure.profile import profile
from remat.models import build

TARGET_STEPS = 20
TARGET_S = 10.0


@dataclass(frozen=True)
class Row:
    model: str
    blocks: int
    step_ms: float
    profile_s: float
    measured_blocks: int
    unshared_s: float | None

    @property
    def steps(self) -> float:
        return 1e3 * self.profile_s / self.step_ms

    @property
    def target_s(self) -> float:
        return max(TARGET_STEPS * self.step_ms / 1e3, TARGET_S)


def _step_ms(built, steps: int = 5) -> float:
    """Median ms of plain training steps (zero_grad, forward, loss, backward, optimizer step)."""
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        (built.optimizer or built.model).zero_grad(set_to_none=True)
        compute_loss(call_model(built.model, built.batch), built.batch, built.loss_fn).backward()
        if built.optimizer is not None:
            built.optimizer.step()
        if i >= 2:
            times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def _profile_s(built, share: bool) -> tuple[float, int, int]:
    """Seconds of one profile with default settings (``share``) or every block's probes run, the
    blocks whose probes ran (all of them in a profile that does not record it), and its blocks."""
    options = {} if share else {"share_timing": False}
    start = time.perf_counter()
    result = profile(built.model, built.batch, built.loss_fn, built.optimizer, **options)
    elapsed = time.perf_counter() - start
    probed = sum(1 for b in result.blocks if getattr(b, "timing_from", b.index) in (b.index, None))
    return elapsed, probed, result.num_blocks


def _resnet50(image_size: int) -> SimpleNamespace:
    """Hugging Face's ResNet-50 from its default config (random weights): 16 bottlenecks, 52
    blocks of different shapes in 23 timing groups, a heterogeneous chain unlike the MLP and GPT;
    4 images of ``image_size`` pixels a side, 10 classes, AdamW."""
    import transformers

    torch.manual_seed(0)
    model = transformers.ResNetForImageClassification(transformers.ResNetConfig(num_labels=10)).train()
    g = torch.Generator().manual_seed(0)
    batch = {"pixel_values": torch.randn(4, 3, image_size, image_size, generator=g),
             "labels": torch.randint(0, 10, (4,), generator=g)}
    return SimpleNamespace(model=model, batch=batch, loss_fn=None, optimizer=torch.optim.AdamW(model.parameters()))


def measure(model: str, depth: int, unshared: bool) -> Row:
    if model == "resnet50":  # ``depth``: the image size
        built = _resnet50(depth)
    else:
        built = build(model, **{"mlp": {"depth": depth}, "gpt": {"num_layers": depth}}[model])
    step_ms = _step_ms(built)
    profile_s, measured, blocks = _profile_s(built, True)
    other = _profile_s(built, False)[0] if unshared else None
    return Row(model=model if model != "resnet50" else f"resnet50 @ {depth} px", blocks=blocks, step_ms=step_ms,
               profile_s=profile_s, measured_blocks=measured, unshared_s=other)


def markdown(rows: list[Row]) -> str:
    head = ["model", "blocks", "step ms", "profile s", "profile / step", "target s", "met",
            "blocks probed"]
    unshared = any(r.unshared_s is not None for r in rows)
    if unshared:
        head.append("every block probed, s")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.model, str(r.blocks), f"{r.step_ms:.1f}", f"{r.profile_s:.2f}", f"{r.steps:.1f}",
                 f"{r.target_s:.1f}", "yes" if r.profile_s <= r.target_s else "no", f"{r.measured_blocks}/{r.blocks}"]
        if unshared:
            cells.append("" if r.unshared_s is None else f"{r.unshared_s:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    env = (f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
           f"{os.cpu_count()} cores")
    return "\n".join(lines) + f"\n\n{env}\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mlp-depths", default="8,32,64,128,256", help="MLP depths, comma separated ('' for none).")
    parser.add_argument("--gpt-layers", default="2,4,8,16", help="GPT layers, comma separated ('' for none).")
    parser.add_argument("--resnet-images", default="", help="Hugging Face ResNet-50 at these image sizes, comma "
                        "separated (default none; needs transformers).")
    parser.add_argument("--unshared", action="store_true", help="Also profile with every block's probes run.")
    parser.add_argument("--markdown", type=Path, default=None, help="Write the table here too.")
    args = parser.parse_args(argv)
    jobs = [("mlp", int(d)) for d in args.mlp_depths.split(",") if d] + [
        ("gpt", int(d)) for d in args.gpt_layers.split(",") if d] + [
        ("resnet50", int(d)) for d in args.resnet_images.split(",") if d]
    rows = []
    for model, depth in jobs:
        rows.append(measure(model, depth, args.unshared))
        print(markdown(rows[-1:]).splitlines()[-3], flush=True)
    table = markdown(rows)
    print(table)
    if args.markdown is not None:
        args.markdown.write_text(table)


if __name__ == "__main__":
    main()
