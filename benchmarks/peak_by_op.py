"""What is live at a plan's measured peak, by the op that made each storage.

    python -m benchmarks.peak_by_op --device cuda --out DIR [--strategies selective:attention-core none]

For each case (a built-in model and its sizes: a 4-unit convnet and a 2-layer GPT, full width on
a GPU, toy widths on the CPU), profile it, then `remat.verify` each strategy's plan with the
live-storage tracker (`remat.measure.tracker.LiveTracker`) patched to remember the aten op and the
phase (``fwd``, or ``bwd`` inside autograd's backward, replays included) that made each storage.
At each tracker's peak it writes the live bytes grouped by category, phase and op, largest first:
``DIR/peak_by_op.txt``, with each case's profile as ``DIR/<model>-profile.json``.

Found with it on an H200 (torch 2.11, 2026-12-04): a selective plan held every cached output of
every block at the last block's backward, the replay recomputing what the cache held
(`remat.checkpointing.selective.SavedOpsPolicy` counted the replay's calls on from the forward's).
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path
from typing import Any

import torch

CASES = {
    "cuda": [("convnet", dict(num_blocks=4, channels=64, image_size=64, batch_size=64)),
             ("gpt", dict(num_layers=2, d_model=1024, num_heads=16, seq_len=1024, batch_size=4, vocab_size=512))],
    "cpu": [("convnet", dict(num_blocks=4, channels=8, image_size=16, batch_size=4)),
            ("gpt", dict(num_layers=2, d_model=64, num_heads=4, seq_len=64, batch_size=2, vocab_size=128))],
}


class _Attribution:
    """Patches `LiveTracker` so that each storage remembers its op and each tracker its peak's
    composition; `restore` undoes it."""

    def __init__(self) -> None:
        from remat.measure import tracker as T

        self.T, self.current, self.origin, self.peaks = T, None, {}, []
        self.saved = {name: getattr(T.LiveTracker, name) for name in ("__torch_dispatch__", "_add_locked", "_shift", "__exit__")}
        attribution = self

        def dispatch(tracker, func, types, args=(), kwargs=None):
            before = attribution.current
            attribution.current = (str(func), "bwd" if torch._C._current_graph_task_id() != -1 else "fwd")
            try:
                return attribution.saved["__torch_dispatch__"](tracker, func, types, args, kwargs)
            finally:
                attribution.current = before

        def add(tracker, t, label):
            key = None if T.is_traceable_wrapper_subclass(t) else T.storage_key(t)
            new = key is not None and key not in tracker._entries
            attribution.saved["_add_locked"](tracker, t, label)
            if new and key in tracker._entries:
                attribution.origin[(id(tracker), key)] = attribution.current or (f"registered {label}", "-")

        def shift(tracker, label, delta):
            before = tracker.peak_bytes
            attribution.saved["_shift"](tracker, label, delta)
            if tracker.peak_bytes > before:
                by: collections.Counter = collections.Counter()
                for key, entry in tracker._entries.items():
                    op, phase = attribution.origin.get((id(tracker), key), ("?", "?"))
                    by[(T.category_of(entry.label), phase, op)] += entry.nbytes
                tracker._peak_by_op = (tracker.peak_bytes, by)

        def exit_(tracker, *exc):
            if getattr(tracker, "_peak_by_op", None) is not None:
                attribution.peaks.append(tracker._peak_by_op)
            return attribution.saved["__exit__"](tracker, *exc)

        for name, fn in (("__torch_dispatch__", dispatch), ("_add_locked", add), ("_shift", shift), ("__exit__", exit_)):
            setattr(T.LiveTracker, name, fn)

    def restore(self) -> None:
        for name, fn in self.saved.items():
            setattr(self.T.LiveTracker, name, fn)


def run(device: str, out: Path, strategies: list[str], top: int = 25) -> list[str]:
    import remat
    from remat.apply.run import _profile

    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    attribution = _Attribution()
    try:
        for name, sizes in CASES["cuda" if device.startswith("cuda") else "cpu"]:
            built, prof = _profile(name, sizes, lambda message: None, device=device)
            prof.save(out / f"{name}-profile.json")
            for strategy in strategies:
                plan = remat.plan(prof, strategy=strategy)
                attribution.peaks.clear()
                v = remat.verify(built.model, built.batch, plan, built.loss_fn, built.optimizer, repeats=1)
                lines.append(f"## {name} {sizes} {strategy}: predicted {v.predicted_peak_bytes / 2**20:.2f} MiB, "
                             f"measured {v.measured_peak_bytes / 2**20:.2f} MiB ({v.peak_error_pct:+.2f} %), "
                             f"baseline {v.baseline_peak_bytes / 2**20:.2f} MiB; replayed calls as planned: "
                             f"{v.recompute_counts_match}")
                for i, (peak, by) in enumerate(attribution.peaks):
                    lines.append(f"  step {i} ({'baseline' if i == 0 else 'plan'}): peak {peak / 2**20:.2f} MiB")
                    for (category, phase, op), nbytes in sorted(by.items(), key=lambda kv: -kv[1])[:top]:
                        lines.append(f"    {nbytes / 2**20:10.2f} MiB  {category:16s} {phase:3s} {op}")
                print("\n".join(lines[-(top + 3) * 2:]), flush=True)
    finally:
        attribution.restore()
    (out / "peak_by_op.txt").write_text("\n".join(lines) + "\n")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peak_by_op", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategies", nargs="+", default=["selective:attention-core", "none", "full"])
    args: Any = parser.parse_args(argv)
    run(args.device, args.out, args.strategies)


if __name__ == "__main__":
    main()
