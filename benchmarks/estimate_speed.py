"""How long `remat estimate` takes for a 70B-parameter configuration, from a fresh process.

Runs the command a user types (``remat estimate --hf llama --hidden 8192 --layers 80 ...
--device H100-80GB --world-size 8 --zero 3 --seq 4096 --micro-batch 1 --json``) in a new
Python process each time, so imports (torch, transformers) count, and reports the median wall
time and the CPU time (user + system) of the child, plus the answer: which strategies fit.

    .venv/bin/python -m benchmarks.estimate_speed [--repeats 3] [--world-size 8] [--device H100-80GB]

The target: under 30 s on the development machine (2 shared cores, CPU only).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

LLAMA_70B = ["--hf", "llama", "--hidden", "8192", "--layers", "80", "--heads", "64", "--kv-heads", "8",
             "--intermediate", "28672", "--vocab", "128256", "--seq", "4096", "--micro-batch", "1"]


def command(world_size: int, devices: list[str]) -> list[str]:
    """The remat estimate command line for Llama-70B sizes."""
    device_args = [arg for d in devices for arg in ("--device", d)]
    remat = str(Path(sys.executable).with_name("remat"))  # the console script next to this Python
    return [remat, "estimate", *LLAMA_70B, *device_args,
            "--world-size", str(world_size), "--zero", "3", "--json"]


def run_once(argv: list[str]) -> tuple[float, float, dict]:
    """(wall s, child CPU s, parsed JSON) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"remat estimate exited with {done.returncode}:\n{done.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(done.stdout)


def summary(result: dict) -> list[str]:
    """One line per device and strategy: fits, peak GiB, max micro-batch, step s."""
    lines = []
    for dev in result["devices"]:
        for row in dev["strategies"]:
            lines.append(
                f"{dev['device']['name']:<12} {row['strategy']:<10} fits={str(row['fits']):<5} "
                f"peak={row['peak_bytes'] / 2**30:8.2f} GiB  max_micro_batch={row['max_micro_batch']}  "
                f"step={row['step_s']:.2f} s"
            )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.estimate_speed", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--device", action="append", default=None)
    args = parser.parse_args(argv)
    argv_run = command(args.world_size, args.device or ["H100-80GB"])
    runs = [run_once(argv_run) for _ in range(args.repeats)]
    walls, cpus = [r[0] for r in runs], [r[1] for r in runs]
    out = sys.stdout
    out.write("command: remat " + " ".join(argv_run[1:]) + "\n")
    out.write(f"wall s: median {statistics.median(walls):.1f} (runs: {', '.join(f'{w:.1f}' for w in walls)})\n")
    out.write(f"child CPU s (user+sys): median {statistics.median(cpus):.1f}\n")
    out.write(f"parameters: {runs[-1][2]['param_count']:,}\n")
    out.write("\n".join(summary(runs[-1][2])) + "\n")


if __name__ == "__main__":
    main()
