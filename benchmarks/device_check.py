"""One prepared check of remat on an accelerator: every figure BENCHMARKS.md lacks for want of a GPU.

    python -m benchmarks.device_check --device cuda --out DIR [--size full|small]
                                      [--sections models attention_core host_offload estimate peers]
                                      [--time-limit-s S] [--repeats N] [--no-compile]
    make device-check OUT=DIR [DEVICE=cuda] [SIZE=full]

Sections (`benchmarks._device.checks`), each under its own share of the time limit and in its
own try/except, so one that fails or runs out loses nothing of the others (within models and
peers, each model and each mode likewise):

- models: gpt, hf:llama, mlp and convnet; none / full / sqrt / attention-core / optimal at two
  budgets: predicted peak against the live-storage tracker and, on CUDA, against
  `torch.cuda.max_memory_allocated` and `max_memory_reserved`; predicted step time against CUDA
  events (`remat.measure.timing.Clock`); gradients against no recomputation (`remat.verify`);
- attention_core: a GPT-3 175B layer in bf16 (`benchmarks.attention_core`), target >= 65 %
  fewer stored activation bytes at <= 5 % step time;
- host_offload: every block offloaded to pinned host memory, the transfer overlap it achieves
  (`benchmarks.offload.host_offload`; CUDA only);
- estimate: `remat estimate` (the meta device, the GPU's fused kernels on CUDA) of gpt and
  hf:llama at the models' sizes against the same steps measured: peak and step time without
  recomputation and with every block recomputed;
- peers: remat against per-block checkpointing, checkpoint_sequential, torchtitan's policy and
  torch.compile's activation memory budget at matched peaks (`benchmarks.peers.run_suite`).

``full`` (the default) is sized for one H200 within 7.5 minutes of sections; ``small`` runs the
same code on toy shapes on the CPU in about a minute (`benchmarks._device.config`). After every
section ``results.json`` and ``results.md`` (Markdown tables with the date, the device and the
torch version) are written again under ``--out``, so a run stopped from outside keeps its
finished sections. Progress goes to stderr. Exit status: 0 when every section ran or was
skipped for a stated reason, 1 when one failed or ran out of time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._device import checks, report
from benchmarks._device.config import PRESETS, SECTION_NAMES, SIZE_NAMES, CheckConfig
from remat._files import write_atomic
from benchmarks._device.sections import run_sections

FORMAT = {"format": "remat-device-check", "version": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.device_check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--size", choices=SIZE_NAMES, default="full",
                        help="full (default): shapes for one H200; small: toy shapes for the CPU test")
    parser.add_argument("--out", type=Path, required=True, help="directory for results.json and results.md")
    parser.add_argument("--sections", nargs="+", choices=SECTION_NAMES, default=list(SECTION_NAMES),
                        help="run only these (e.g. to rerun one that failed)")
    parser.add_argument("--time-limit-s", type=float, help="all sections together (default: full 450, small 170)")
    parser.add_argument("--repeats", type=int, help="timed pairs per plan (default: full 5, small 2)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile peers")
    args = parser.parse_args(argv)
    from remat.models.loading import resolve_device

    try:
        args.device = resolve_device(args.device)
    except ValueError as exc:
        parser.error(str(exc))
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {str(args.out)!r} is a file; pass a directory (it is created when missing).")
    for flag in ("time_limit_s", "repeats"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            parser.error(f"--{flag.replace('_', '-')} {value} must be > 0.")
    return args


def configure(args: argparse.Namespace) -> CheckConfig:
    """The size's preset with the command line's overrides."""
    config = PRESETS[args.size]
    changes: dict[str, Any] = {}
    if args.time_limit_s is not None:
        changes["total_s"] = args.time_limit_s
    if args.repeats is not None:
        changes["repeats"] = args.repeats
    if args.no_compile:
        changes["compile_budgets"] = ()
    return dataclasses.replace(config, **changes)


def finite(value: Any, path: str, bad: list[str]) -> Any:
    """``value`` with every NaN or infinity replaced by None (strict JSON), its path noted in ``bad``."""
    if isinstance(value, float) and not math.isfinite(value):
        bad.append(path)
        return None
    if isinstance(value, dict):
        return {k: finite(v, f"{path}.{k}", bad) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v, f"{path}[{i}]", bad) for i, v in enumerate(value)]
    return value


def _replace(path: Path, text: str) -> None:
    write_atomic(path, text)


def write_results(out: Path, results: dict[str, Any]) -> None:
    """``results.json``, then ``results.md`` under ``out``, each replaced whole (never half-written);
    a table that cannot be rendered leaves the JSON written and says why in the Markdown."""
    bad: list[str] = []
    clean = finite(results, "$", bad)
    clean["non_finite"] = bad
    _replace(out / "results.json", json.dumps(clean, indent=1, allow_nan=False) + "\n")
    try:
        text = report.markdown(clean)
    except Exception as exc:  # the figures are in the JSON; the Markdown must not lose them
        text = f"results.md could not be rendered ({type(exc).__name__}: {exc}); the figures are in results.json.\n"
    _replace(out / "results.md", text)


def _progress(start: float) -> Any:
    def progress(message: str) -> None:
        print(f"[{time.monotonic() - start:6.1f} s] {message}", file=sys.stderr, flush=True)

    return progress


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    config = configure(args)
    start = time.monotonic()
    progress = _progress(start)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {**FORMAT, "environment": checks.environment(args.device, config, argv), "sections": {}}
    chosen = [s for s in checks.sections(config, args.device) if s.name in args.sections]

    def save(sections: dict[str, dict[str, Any]]) -> None:
        results.update(sections=sections, elapsed_s=time.monotonic() - start)
        write_results(args.out, results)

    sections = run_sections(chosen, config.total_s, progress, save)
    progress(f"wrote {args.out / 'results.json'} and {args.out / 'results.md'}")
    print(report.header(results))
    return 0 if all(s["status"] in ("ok", "skipped") for s in sections.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
