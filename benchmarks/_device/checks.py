"""The device check's sections: each a function ``run(data, progress)`` made for one device and
`CheckConfig`, built on the existing harnesses (`remat.apply.run.demo_job`,
`benchmarks.attention_core`, `benchmarks.offload`, `benchmarks.peers`).

- ``models``: per model, remat's predictions against measurement for none, full, sqrt,
  attention-core and optimal at two budgets (`remat.verify`: tracker peak, CUDA-event step
  medians side by side, gradients against no recomputation); on CUDA also the allocator's
  figures (`benchmarks._device.allocator`).
- ``attention_core``: the Megatron-LM comparison at a GPT-3 layer, after checking with
  `remat.estimate` that the shape fits the device.
- ``host_offload``: pinned host offload of every block, and the transfer overlap it achieves.
- ``estimate``: `remat.estimate` against the same steps measured (peak and time, without
  recomputation and with every block recomputed).
- ``peers``: remat at the peers' peaks, eager, then compiled.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from collections.abc import Callable
from typing import Any

import torch

from benchmarks._device.allocator import allocator_peaks
from benchmarks._device.config import BUDGET_FRACTIONS, STRATEGIES, CheckConfig
from benchmarks._device.sections import Progress, Section, Skipped, prefixed, raise_failures, run_part

SectionRun = Callable[[dict[str, Any], Progress], None]
CORE_TARGET_STORED_PCT = -65.0
"""attention-core's target: at least 65 % fewer stored activation bytes..."""
CORE_TARGET_OVERHEAD_PCT = 5.0
"""...at no more than 5 % step time (Megatron-LM: 70 % at 2.7 % extra FLOPs)."""
ESTIMATE_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def device_memory_bytes(device: torch.device) -> int:
    """What the device holds: the GPU's memory, or the host's physical memory for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def environment(device: torch.device, config: CheckConfig, argv: list[str]) -> dict[str, Any]:
    """Where and when the check ran."""
    from remat.measure.profile import _environment

    env = _environment(device)
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": str(device), "device_name": env.device_name, "device_memory_bytes": device_memory_bytes(device),
        "torch_version": torch.__version__, "cuda_version": torch.version.cuda,
        "python_version": env.python_version, "num_threads": env.num_threads, "cpu_count": os.cpu_count(),
        "machine": platform.machine(), "hostname": env.hostname, "git_commit": _git_commit(),
        "size": config.size, "repeats": config.repeats, "total_limit_s": config.total_s,
        "command": "python -m benchmarks.device_check " + " ".join(argv),
    }


def _model_row(model: str, row: Any) -> dict[str, Any]:
    v, pred = row.verification, row.plan.prediction
    return {
        "model": model, "plan": row.label,
        "predicted_peak_bytes": pred.peak_bytes, "tracker_peak_bytes": v.measured_peak_bytes,
        "tracker_error_pct": v.peak_error_pct,
        "predicted_step_ms": v.predicted_step_ms, "measured_step_ms": v.measured_step_ms,
        "baseline_step_ms": v.baseline_step_ms, "predicted_overhead_pct": v.predicted_overhead_pct,
        "measured_overhead_pct": v.overhead_pct, "step_error_pct": v.paired_step_error_pct,
        "baseline_drift_pct": v.baseline_drift_pct,
        "grads_ok": v.ok, "grads_identical": v.grads_identical, "grad_max_abs_diff": v.grad_max_abs_diff,
        "tolerance": v.tolerance, "recompute_counts_match": v.recompute_counts_match,
    }


def _model_rows(name: str, sizes: dict[str, Any], config: CheckConfig, device: torch.device,
                progress: Progress) -> list[dict[str, Any]]:
    from remat.apply.run import demo_job

    job = demo_job(model_name=name, sizes=dict(sizes), repeats=config.repeats, device=str(device),
                   strategies=STRATEGIES, budget_fractions=BUDGET_FRACTIONS, progress=progress)
    rows = [_model_row(name, row) for row in job.rows]
    if device.type == "cuda":
        for entry, row in zip(rows, job.rows):
            progress(f"allocator peak of {row.label}")
            entry.update(allocator_peaks(name, dict(sizes), row.plan, device=str(device)))
    return rows


def models(config: CheckConfig, device: torch.device) -> SectionRun:
    """remat's predictions against measurement, per model and plan; a model that fails is
    recorded and the next one runs."""
    from remat.models.hf import transformers_available

    def run(data: dict[str, Any], progress: Progress) -> None:
        data["allocator"] = "measured" if device.type == "cuda" else (
            "CUDA only: torch.cuda.max_memory_allocated and max_memory_reserved have no CPU counterpart; "
            "the peak is the live-storage tracker's")
        rows, skipped = data.setdefault("rows", []), data.setdefault("skipped_models", {})
        failures = data.setdefault("failed_models", {})
        for name, sizes in config.models.items():
            if name.startswith("hf:") and not transformers_available():
                skipped[name] = "transformers is not installed"
                continue
            rows += run_part(failures, name, _model_rows, name, sizes, config, device, prefixed(progress, name)) or []
        raise_failures(failures)

    return run


def _core_fit(config: CheckConfig, device: torch.device) -> dict[str, Any]:
    """`remat.estimate` of one copy of the attention-core GPT; verify holds three at once."""
    from remat.estimate.api import estimate
    from remat.estimate.sources import ModelSource

    sizes = {k: v for k, v in config.core_sizes.items() if k not in ("batch_size", "seq_len")}
    est = estimate(ModelSource(builtin="gpt", sizes=sizes), devices=("H200-141GB",),
                   micro_batch=config.core_sizes["batch_size"], seq_len=config.core_sizes["seq_len"],
                   dtype=ESTIMATE_DTYPES[config.core_dtype], master_weights=False, strategies=("none",),
                   gpu_kernels=device.type == "cuda")
    peak, state = est.devices[0].strategies[0].peak_bytes, est.model_state.total_bytes
    needed, available = peak + 2 * state, device_memory_bytes(device)
    return {"estimated_peak_bytes": peak, "estimated_state_bytes": state, "needed_bytes": needed,
            "device_memory_bytes": available, "fits": needed <= available}


def attention_core(config: CheckConfig, device: torch.device) -> SectionRun:
    """Stored activation bytes and step time of attention-core against no recomputation."""
    from benchmarks import attention_core as harness

    def run(data: dict[str, Any], progress: Progress) -> None:
        progress("estimating what the shape needs")
        data["fit"] = fit = _core_fit(config, device)
        if not fit["fits"]:
            raise Skipped(f"the shape needs about {fit['needed_bytes'] / 2**30:.1f} GiB (three copies of the model "
                          f"under remat.verify), the device has {fit['device_memory_bytes'] / 2**30:.1f} GiB")
        progress(f"profiling and verifying at {config.core_sizes}")
        name = "gpt3-layer" if config.size == "full" else f"gpt3-ratios-{config.size}"
        row = harness.measure_sizes(name, dict(config.core_sizes), config.repeats, str(device),
                                    getattr(torch, config.core_dtype))
        stored_pct = 100 * (row["stored_core"] - row["stored_base"]) / row["stored_base"]
        data["row"] = {**row, "stored_change_pct": stored_pct}
        data["target_met"] = stored_pct <= CORE_TARGET_STORED_PCT and row["overhead"] <= CORE_TARGET_OVERHEAD_PCT

    return run


def host_offload(config: CheckConfig, device: torch.device) -> SectionRun:
    """Every block offloaded to pinned host memory: overlap achieved, time predicted and measured."""
    from benchmarks.offload import host_offload as harness

    def run(data: dict[str, Any], progress: Progress) -> None:
        if device.type != "cuda":
            raise Skipped(f"offload:cpu moves CUDA tensors to pinned host memory; on {device} they are there already")
        progress(f"profiling, measuring pinned copy rates and verifying at {config.offload_sizes}")
        data["row"] = harness(dict(config.offload_sizes), str(device), config.repeats)

    return run


ESTIMATE_STRATEGIES = ("none", "full")
"""What `remat estimate` is compared with measurement on: the step as written, every block recomputed."""


def _estimate_rows(name: str, sizes: dict[str, Any], device: torch.device, progress: Progress) -> list[dict[str, Any]]:
    """`remat.estimate` of one model (on the meta device, the GPU's fused kernels where the
    device is CUDA, as the CPU runs them otherwise) beside the same step measured here: the peak
    (the live-storage tracker: `remat.profile`'s step without recomputation, `remat.verify`'s
    with every block recomputed) and the step time."""
    from remat.apply.run import _profile
    from remat.estimate.api import estimate
    from remat.estimate.sources import ModelSource
    from remat.plan.planners import plan
    from remat.verify import verify

    built, prof = _profile(name, dict(sizes), progress, device=str(device))
    full = plan(prof, strategy="full")
    progress("verifying full")
    measured = {"none": (prof.peak_bytes, prof.step_ms)}
    ver = verify(built.model, built.batch, full, built.loss_fn, built.optimizer, repeats=1)
    measured["full"] = (ver.measured_peak_bytes, ver.measured_step_ms)
    progress("estimating on the meta device")
    model_sizes = {k: v for k, v in sizes.items() if k not in ("batch_size", "seq_len")}
    est = estimate(ModelSource(builtin=name, sizes=model_sizes), devices=("H200-141GB",), micro_batch=sizes["batch_size"],
                   seq_len=sizes["seq_len"], dtype="fp32", optimizer="adamw", strategies=ESTIMATE_STRATEGIES,
                   gpu_kernels=device.type == "cuda")
    rows = []
    for strategy in est.devices[0].strategies:
        peak, step_ms = measured[strategy.strategy]
        rows.append({"model": name, "strategy": strategy.strategy, "kernels": "GPU" if device.type == "cuda" else "CPU",
                     "estimated_peak_bytes": strategy.peak_bytes, "measured_peak_bytes": peak,
                     "peak_error_pct": 100 * (strategy.peak_bytes - peak) / peak,
                     "estimated_step_ms": 1e3 * strategy.step_s, "measured_step_ms": step_ms, "mfu": est.mfu})
    return rows


def estimate_check(config: CheckConfig, device: torch.device) -> SectionRun:
    """`remat estimate` against the measured step, per model; a model that fails is recorded and
    the next one runs."""
    from remat.models.hf import transformers_available

    def run(data: dict[str, Any], progress: Progress) -> None:
        rows, skipped = data.setdefault("rows", []), data.setdefault("skipped_models", {})
        failures = data.setdefault("failed_models", {})
        for name in ESTIMATE_MODELS:
            if name.startswith("hf:") and not transformers_available():
                skipped[name] = "transformers is not installed"
                continue
            rows += run_part(failures, name, _estimate_rows, name, config.models[name], device,
                             prefixed(progress, name)) or []
        raise_failures(failures)

    return run


ESTIMATE_MODELS = ("gpt", "hf:llama")
"""The models section's models that `remat estimate` takes as built-ins (a language model's
tokens and sequence length), at the models section's sizes."""


def segments(config: CheckConfig, device: torch.device) -> SectionRun:
    """`benchmarks.segment_calls` per model: torch's checkpoint around segments of 1, 2, 4 and
    every block, and remat's full and √N plans, side by side, beside what the profile charges a
    segment boundary; a model that fails is recorded and the next one runs."""
    from benchmarks.segment_calls import measure

    def run(data: dict[str, Any], progress: Progress) -> None:
        rows, failures = data.setdefault("rows", []), data.setdefault("failed_models", {})
        for name, sizes in config.segment_models.items():
            progress(f"{name}: profiling, then segments of k blocks side by side")
            row = run_part(failures, name, measure, name, dict(sizes), device.type, config.segment_rounds)
            if row is not None:
                rows.append(row)
        raise_failures(failures)

    return run


def _suite_json(workload: Any, peers_: list[Any], repeats: int, frontier_points: int) -> dict[str, Any]:
    """One peers comparison, measured (`benchmarks.peers.run_suite`), as JSON."""
    from benchmarks._peers import results
    from benchmarks.peers import run_suite

    suite = run_suite(workload, peers_, repeats=repeats, frontier_points=frontier_points)
    rows = results.rows(suite)
    return {"sizes": suite.workload.sizes, "num_blocks": suite.num_blocks,
            **results.as_json(rows, results.matches(rows))}


def peers(config: CheckConfig, device: torch.device) -> SectionRun:
    """remat against per-block checkpointing, checkpoint_sequential, torchtitan's policy and
    compile's memory budget, at matched peaks; the eager part first, kept if the compiled one
    fails or runs out of time."""
    from benchmarks._peers.strategies import COMPILED, default_peers
    from benchmarks._peers.workloads import Workload

    def run(data: dict[str, Any], progress: Progress) -> None:
        workload = Workload(model="gpt", size=config.peers_size, device=device.type, overrides=dict(config.peers_sizes))
        failures = data.setdefault("failed_parts", {})
        progress(f"eager peers on {workload.sizes}")
        eager = default_peers(with_compile=False)
        data["eager"] = run_part(failures, "eager", _suite_json, workload, eager, config.repeats, config.frontier_points)
        if not config.compile_budgets:
            data["compiled"] = {"skipped": "no compiled peers at this size or with --no-compile (inductor "
                                           "compiles each model for minutes on a CPU)"}
        else:
            compiled = [p for p in default_peers(with_compile=True, compile_budgets=config.compile_budgets)
                        if p.mode == COMPILED or p.name == "none"]
            progress(f"compiled peers: {', '.join(p.name for p in compiled)}")
            data["compiled"] = run_part(failures, "compiled", _suite_json, workload, compiled, config.repeats, 0)
        raise_failures(failures)

    return run


def sections(config: CheckConfig, device: torch.device) -> list[Section]:
    """Every section, in the order they run, with their shares of the time limit."""
    runs = {"models": models, "attention_core": attention_core, "host_offload": host_offload,
            "estimate": estimate_check, "segments": segments, "peers": peers}
    return [Section(name=name, share=config.shares[name], run=make(config, device)) for name, make in runs.items()]
