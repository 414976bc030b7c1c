"""How long `remat estimate` takes at the scale people train, each run in a fresh process.

Runs the commands a user types, in a new Python process each time, so imports (torch,
transformers) count, and reports the median wall time, the CPU time (user + system) of the child
and the answer:

- ``llama70b``: Llama-3-70B sizes on 8 x H100-80GB with ZeRO-3 (target: under 30 s);
- ``mixtral``: the Mixtral-8x7B config (hidden 4096, 32 layers, 8 experts, top-2) on 32 x
  H100-80GB with expert parallelism 8 and ZeRO-1 (target: under 60 s);
- ``search``: ``--search`` for Llama-3-70B on 64 x H100-80GB, global batch 1024 (target: under 60 s).

    .venv/bin/python -m benchmarks.estimate_speed [--repeats 3] [--only llama70b,mixtral,search]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LLAMA_70B = ["--hf", "llama", "--hidden", "8192", "--layers", "80", "--heads", "64", "--kv-heads", "8",
             "--intermediate", "28672", "--vocab", "128256", "--seq", "4096", "--micro-batch", "1"]
MIXTRAL_8X7B = dict(model_type="mixtral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                    vocab_size=32000, max_position_embeddings=32768)
"""mistralai/Mixtral-8x7B-v0.1's config.json sizes."""


def commands(config_dir: Path) -> dict[str, list[str]]:
    """The remat estimate command lines, by name."""
    config = config_dir / "mixtral-8x7b.json"
    config.write_text(json.dumps(MIXTRAL_8X7B))
    return {
        "llama70b": [*LLAMA_70B, "--device", "H100-80GB", "--world-size", "8", "--zero", "3", "--json"],
        "mixtral": ["--config", str(config), "--seq", "4096", "--device", "H100-80GB", "--world-size", "32",
                    "--expert-parallel", "8", "--zero", "1", "--json"],
        "search": [*LLAMA_70B, "--device", "H100-80GB", "--search", "--gpus", "64", "--global-batch", "1024",
                   "--json"],
    }


def run_once(argv: list[str]) -> tuple[float, float, object]:
    """(wall s, child CPU s, parsed JSON) of one run."""
    import time

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"remat estimate exited with {done.returncode}:\n{done.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(done.stdout)


def summary(result: object) -> list[str]:
    """One line per device and strategy, or per layout found by --search."""
    if isinstance(result, list):
        return [f"{_layout(c['parallelism'])} ZeRO-{c['zero_stage']} mb={c['micro_batch']} m={c['micro_batches']} "
                f"{c['strategy']}, head {c.get('head', 'keep')}: {c['step_s']:.2f} s, {c['peak_bytes'] / 2**30:.1f} GiB, MFU {c['mfu']:.1%}"
                for c in result]
    lines = []
    for dev in result["devices"]:
        for row in dev["strategies"]:
            lines.append(f"{dev['device']['name']:<12} {row['strategy']:<10} fits={str(row['fits']):<5} "
                         f"peak={row['peak_bytes'] / 2**30:8.2f} GiB  max_micro_batch={row['max_micro_batch']}  "
                         f"step={row['step_s']:.2f} s  ({row['plan_strategy']})")
    return lines


def _layout(par: dict) -> str:
    """``dp4 tp4 pp2 v2 cp2`` from a Parallelism's JSON (sizes above 1)."""
    names = (("data", "dp"), ("tensor", "tp"), ("pipeline", "pp"), ("virtual_stages", "v"), ("context", "cp"),
             ("expert", "ep"))
    return " ".join(f"{short}{par[key]}" for key, short in names if key == "data" or par[key] > 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.estimate_speed", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="llama70b,mixtral,search")
    args = parser.parse_args(argv)
    remat = str(Path(sys.executable).with_name("remat"))  # the console script next to this Python
    out = sys.stdout
    with tempfile.TemporaryDirectory() as tmp:
        for name, options in commands(Path(tmp)).items():
            if name not in args.only.split(","):
                continue
            runs = [run_once([remat, "estimate", *options]) for _ in range(args.repeats)]
            walls, cpus = [r[0] for r in runs], [r[1] for r in runs]
            out.write(f"\n{name}: remat estimate " + " ".join(options) + "\n")
            out.write(f"wall s: median {statistics.median(walls):.1f} (runs: {', '.join(f'{w:.1f}' for w in walls)}); "
                      f"child CPU s (user+sys): median {statistics.median(cpus):.1f}\n")
            out.write("\n".join(summary(runs[-1][2])) + "\n")


if __name__ == "__main__":
    main()
