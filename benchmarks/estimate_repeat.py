"""One model estimated several times in one Python process: a notebook's loop over micro-batches
and devices. Each call is timed with the trace cache (`remat.estimate.trace.trace_source`: the
first call traces, the others reuse it) and with the cache cleared before it, the modes in turn.

    .venv/bin/python -m benchmarks.estimate_repeat [--rounds 2] [--layers 12] [--hidden 768] [--seq 512]

The model: T5 of ``--layers`` encoder and decoder layers (the estimate's ``--hf t5``), 12 heads.
"""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.estimate_repeat", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of both modes, in turn")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args(argv)
    from remat.estimate import ModelSource, estimate
    from remat.estimate.trace import clear_trace_cache

    t5 = ModelSource(hf_family="t5", sizes=dict(hidden=args.hidden, layers=args.layers, heads=12, seq=args.seq))
    calls = [("micro-batch 8", lambda: estimate(t5, seq_len=args.seq, micro_batch=8)),
             ("micro-batch 16", lambda: estimate(t5, seq_len=args.seq, micro_batch=16)),
             ("micro-batch 8 on A100-80GB and L4-24GB",
              lambda: estimate(t5, seq_len=args.seq, micro_batch=8, devices=["A100-80GB", "L4-24GB"]))]
    tiny = ModelSource(hf_family="llama", sizes=dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=96,
                                                     seq=32))
    estimate(tiny, seq_len=32)  # the imports, outside every timing
    print("| round | mode | call | wall s |\n| ---: | --- | --- | ---: |")
    for round_ in range(1, args.rounds + 1):
        for mode in ("cleared", "cached"):
            clear_trace_cache()
            for name, call in calls:
                if mode == "cleared":
                    clear_trace_cache()
                start = time.perf_counter()
                call()
                print(f"| {round_} | {mode} | {name} | {time.perf_counter() - start:.1f} |", flush=True)


if __name__ == "__main__":
    main()
