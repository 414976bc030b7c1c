"""`selective:attention-core` on the built-in GPT (explicit attention) at several shapes: the
activation bytes it removes and the step time it adds, measured side by side with no recomputation.

    .venv/bin/python -m benchmarks.attention_core [--repeats 5] [--shapes demo wide wide-nodrop]
                                                  [--device cuda] [--markdown attention-core.md]

Per shape: `remat run`'s job (`remat.apply.run.run_job`): one profile, then the baseline and the
attention-core plan verified by `remat.verify` (``--repeats`` timed pairs, order swapped each
round, medians). Reported:

- stored: the bytes the blocks keep for backward at the end of the forward, all blocks together
  (the profile's exact accounting: what autograd saves without recomputation against the block
  inputs and cached op outputs the policy keeps; Korthikanti et al.'s "activation memory");
- at peak: measured peak less the model state (parameters, gradients, optimizer state, buffers),
  baseline against plan: what the step needed for activations and temporaries;
- overhead: measured and predicted step time against no recomputation;
- the replayed ops' share of a block's forward time and FLOPs, and the random ops' share of its
  time (`OpRecord.is_random`: dropout's ``bernoulli_``/``native_dropout``), from the profile.

Target (issue [3 of 9]): at least 65 % fewer activation bytes at no more than 5 % overhead,
Megatron-LM's 70 % at 2.7 % extra FLOPs on GPT-3 175B. Both numbers depend on the shape: the core
stores 5as/h bytes per token and hidden unit against the rest's 34, and its replay costs
4bs^2h FLOPs against a layer's 24bsh^2 + 4bs^2h, so its share of the FLOPs falls as the width
grows against the sequence; on a CPU its elementwise ops and random numbers cost far more than
their FLOPs say (the second reported share).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch

from remat.apply.run import run_job
from remat._files import write_atomic
from remat.plan.costs import cost_of

SHAPES: dict[str, dict[str, float | int]] = {
    # the default job's GPT: seq / d_model = 4, the core is most of the FLOPs
    "demo": dict(num_layers=4, d_model=64, num_heads=4, seq_len=256, batch_size=8, dropout=0.1),
    # Megatron-like ratios: a*s/h = 16 (the paper's GPT-3: 96 * 2048 / 12288 = 16), s = h
    "wide": dict(num_layers=2, d_model=1024, num_heads=16, seq_len=1024, batch_size=1, dropout=0.1),
    # the same without dropout: no random numbers to draw again in the replay
    "wide-nodrop": dict(num_layers=2, d_model=1024, num_heads=16, seq_len=1024, batch_size=1, dropout=0.0),
}
STRATEGY = "selective:attention-core"


def measure(shape: str, repeats: int, device: str | None = None) -> dict:
    """One of `SHAPES`, measured (`measure_sizes`)."""
    return measure_sizes(shape, SHAPES[shape], repeats, device)


def measure_sizes(shape: str, sizes: dict[str, float | int], repeats: int, device: str | None = None,
                  dtype: torch.dtype | None = None) -> dict:
    """The built-in GPT at ``sizes`` (named ``shape`` in the table) in ``dtype`` (None: float32):
    no recomputation against attention-core, side by side."""
    start = time.perf_counter()
    job = run_job("gpt", budget=None, strategy=STRATEGY, sizes=dict(sizes), repeats=repeats, device=device,
                  dtype=dtype)
    prof = job.profile
    base, core = job.rows[0].verification, job.rows[1].verification
    state = prof.param_bytes + prof.grad_bytes + prof.optimizer_state_bytes + prof.buffer_bytes
    stored_base = sum(b.saved_bytes for b in prof.blocks)
    stored_core = sum(cost_of(prof, i, seg).retained_bytes
                      for seg in job.rows[1].plan.segments for i in range(seg.start, seg.stop))
    saved_ops = set(job.rows[1].plan.segments[0].saved_ops)
    block = prof.blocks[0]
    fwd = sum(op.time_ms for op in block.ops)
    replayed = [op for op in block.ops if op.key not in saved_ops and not op.is_view]
    rng = [op for op in replayed if op.is_random]
    return dict(
        shape=shape, sizes=sizes, dtype=str(dtype or torch.float32).removeprefix("torch."),
        seconds=time.perf_counter() - start,
        stored_base=stored_base, stored_core=stored_core,
        peak_act_base=base.measured_peak_bytes - state, peak_act_core=core.measured_peak_bytes - state,
        peak_base=base.measured_peak_bytes, peak_core=core.measured_peak_bytes,
        peak_error=core.peak_error_pct,
        overhead=core.overhead_pct, predicted_overhead=core.predicted_overhead_pct,
        baseline_ms=core.baseline_step_ms,
        replay_share=100 * sum(op.time_ms for op in replayed) / fwd,
        rng_share=100 * sum(op.time_ms for op in rng) / fwd,
        replay_flops_share=100 * sum(op.flops for op in replayed) / max(block.fwd_flops, 1),
        identical=core.grads_identical and base.grads_identical,
        device=prof.environment.device_name,
    )


def _dtype(row: dict) -> str:
    return "" if row.get("dtype", "float32") == "float32" else f", {row['dtype']}"


def _pct(new: float, old: float) -> str:
    return f"{100 * (new - old) / old:+.0f}%"


def markdown(rows: list[dict], repeats: int) -> str:
    lines = [
        "| shape | layers x d_model / heads x seq x batch, dropout | stored activations (none -> core) | "
        "activations at peak (none -> core) | overhead measured | overhead predicted | replayed share of a "
        "block's forward: time / FLOPs / random numbers | gradients |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        s = r["sizes"]
        lines.append(
            f"| {r['shape']} | {s['num_layers']} x {s['d_model']} / {s['num_heads']} x {s['seq_len']} x "
            f"{s['batch_size']}, p={s['dropout']}{_dtype(r)} | {r['stored_base'] / 2**20:.1f} -> {r['stored_core'] / 2**20:.1f} MiB "
            f"({_pct(r['stored_core'], r['stored_base'])}) | {r['peak_act_base'] / 2**20:.1f} -> "
            f"{r['peak_act_core'] / 2**20:.1f} MiB ({_pct(r['peak_act_core'], r['peak_act_base'])}) | "
            f"{r['overhead']:+.1f}% | {r['predicted_overhead']:+.1f}% | {r['replay_share']:.0f}% / "
            f"{r['replay_flops_share']:.0f}% / {r['rng_share']:.0f}% | {'identical' if r['identical'] else 'DIFFER'} |"
        )
    lines.append("")
    lines.append(
        f"Medians of {repeats} side-by-side pairs (baseline, plan) per shape; torch {torch.__version__}, "
        f"{platform.machine()}, {torch.get_num_threads()} threads, {os.cpu_count()} cores"
        + "".join(f", {d}" for d in sorted({r['device'] for r in rows})) + "."
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: the CPU)")
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    rows = []
    for shape in args.shapes:
        rows.append(measure(shape, args.repeats, args.device))
        print(f"{shape}: {rows[-1]['seconds']:.0f} s", flush=True)
    text = markdown(rows, args.repeats)
    print(text)
    if args.markdown:
        write_atomic(args.markdown, text + "\n")


if __name__ == "__main__":
    main()
