"""Disk offload against the disk's own sequential bandwidth, and predicted against measured step time.

    .venv/bin/python -m benchmarks.offload [--offload-dir DIR] [--repeats 5] [--json out.json]

1. Bandwidth: `remat.measure.bandwidth.measure_disk` on DIR (sequential write + fdatasync, read
   after POSIX_FADV_DONTNEED), median of the repeats.
2. Sustained offload: a chain of I/O-bound blocks (``x * scale`` on a 32 MiB tensor: each block
   saves its 32 MiB input) under `OffloadEngine("disk")`. Write throughput = offloaded bytes /
   time from the end of block 0's forward (when the first record is queued) until the last block
   file is flushed; read throughput = the same bytes / backward time (backward compute is a
   multiply and a sum per block, so the reads dominate).
   Target: both at least 80% of the measured sequential rates.
   The same bytes through the store alone (`io_path`: no model compute) separate the offload's
   I/O efficiency from a CPU too busy to produce or consume the tensors as fast as the disk.
3. Prediction: the built-in GPT is profiled (`remat.profile`), its bandwidths measured in DIR,
   every block planned ``offload:disk`` and applied with `remat.apply_`; the median measured
   step (forward + backward) is compared with `remat.plan.predict`'s step time, absolutely and
   at the speed of the baseline step measured just before it (the profile's step scaled by the
   measured baseline over the profiled one). Target: within 15%.

Runs on one intra-op thread (the development machine has 2 shared cores), so compute and I/O
threads do not fight over cores the benchmark cannot see.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time

import torch
from torch import nn

import remat
from remat.apply.offload import OffloadEngine
from remat._files import write_atomic
from remat.apply.offload_disk import DiskStore
from remat.measure.bandwidth import measure_bandwidths, measure_disk
from remat.models import build, load_target
from remat.plan.planners import make_plan
from remat.plan.predict import predict
from remat.plan.types import Segment

MiB = 1 << 20


class ScaleBlock(nn.Module):
    """``x * scale``: autograd saves the 32 MiB input for ``scale``'s gradient; one multiply of
    compute, so the disk, not the CPU, sets the pace."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def sustained(directory: str, *, tensor_mib: int = 32, num_blocks: int = 8, num_threads: int = 2) -> dict:
    """(write, read) bytes/s of disk offload on an I/O-bound chain.

    Write: all offloaded bytes over the time from the end of block 0's forward (its record is
    queued then: the disk cannot start earlier) until the last block file is flushed.
    Read: the same bytes over the backward (one multiply and one sum per block besides reads)."""
    x = torch.rand(tensor_mib * MiB // 4)
    blocks = [ScaleBlock() for _ in range(num_blocks)]
    engine = OffloadEngine("disk", directory=directory, num_threads=num_threads)
    try:
        h, start = x, None
        for i, block in enumerate(blocks):
            with engine.block_context(f"blocks.{i}", block):
                h = block(h)
            start = start or time.perf_counter()
        loss = h.sum()
        engine.wait_writes()
        mid = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        moved = engine.stats().offloaded_bytes
        left = engine.store.live_files()
    finally:
        engine.close()
    assert not left, f"files left after the step: {left}"
    return {"offloaded_bytes": moved, "write_bytes_per_s": moved / (mid - start), "read_bytes_per_s": moved / (end - mid)}


def io_path(directory: str, *, tensor_mib: int = 32, num_blocks: int = 8, num_threads: int = 2) -> dict:
    """(write, read) bytes/s of the offload's own I/O path with no model compute around it: the
    engine's `DiskStore` (block files, pwrite records with SHA-256, one flush per block; reads
    prefetched one block ahead, SHA-256 checked, file deleted), as the engine drives it."""
    datas = [torch.randint(0, 256, (tensor_mib * MiB,), dtype=torch.uint8) for _ in range(num_blocks)]
    store = DiskStore(directory=directory, num_threads=num_threads)
    try:
        start = time.perf_counter()
        tickets = []
        for i, data in enumerate(datas):
            block_file = store.open_block(f"blocks.{i}")
            tickets.append(block_file.put(data))
            block_file.seal()
        del block_file
        store.wait_writes()
        mid = time.perf_counter()
        tickets.reverse()  # backward order
        tickets[0].prefetch()
        for i, ticket in enumerate(tickets):
            if i + 1 < len(tickets):
                tickets[i + 1].prefetch()
            ticket.get()
        end = time.perf_counter()
        del tickets
        left = store.live_files()
    finally:
        store.close()
    assert not left, f"files left after reading: {left}"
    moved = num_blocks * tensor_mib * MiB
    return {"write_bytes_per_s": moved / (mid - start), "read_bytes_per_s": moved / (end - mid)}


def _step_ms(model, batch, loss_fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        loss = model(*batch) if loss_fn is None else loss_fn(model(*batch), batch)
        loss.backward()
        times.append(1e3 * (time.perf_counter() - start))
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def all_offloaded(profile: remat.Profile, strategy: str) -> remat.Plan:
    """Every block of ``profile`` offloaded with ``strategy`` (``offload:cpu`` or ``offload:disk``)."""
    segments = (Segment(start=0, stop=profile.num_blocks, strategy=strategy),)
    return make_plan(profile, segments, "offload", None)


def host_offload(sizes: dict, device: str, repeats: int) -> dict:
    """Pinned host offload (``offload:cpu``) of every block of the built-in GPT at ``sizes`` on
    a CUDA ``device``, verified against no offload (`remat.verify`: CUDA-event medians of
    ``repeats`` side-by-side pairs).

    Transfer overlap achieved: the step time the offload adds (measured, planned minus baseline)
    against the time its copies take at the profile's pinned rates (device->host of every
    offloaded byte, then host->device): ``hidden = 1 - added / transfer``. 1: the copies cost
    the step nothing; 0: the step waits for every byte. The bandwidth probe's own figure
    (`remat.measure.bandwidth.measure_host_device`: a side-stream copy under a matmul loop)
    is given beside it."""
    if torch.device(device).type != "cuda":
        raise ValueError(f"device={device!r}: offload:cpu moves CUDA tensors to pinned host memory; use a CUDA device.")
    built = load_target("gpt", device=device, **sizes)
    profile = remat.profile(built.model, built.batch, built.loss_fn, built.optimizer, repeats=repeats)
    profile = dataclasses.replace(profile, bandwidths=measure_bandwidths(device))
    plan = all_offloaded(profile, "offload:cpu")
    check = remat.verify(built.model, built.batch, plan, built.loss_fn, built.optimizer, repeats=repeats)
    bw, moved = profile.bandwidths, plan.prediction.offloaded_bytes
    transfer_ms = 1e3 * moved * (1 / bw.device_to_host_bytes_per_s + 1 / bw.host_to_device_bytes_per_s)
    added_ms = check.measured_step_ms - check.baseline_step_ms
    return {
        "offloaded_bytes": moved,
        "device_to_host_bytes_per_s": bw.device_to_host_bytes_per_s,
        "host_to_device_bytes_per_s": bw.host_to_device_bytes_per_s,
        "probe_overlap_fraction": bw.overlap_fraction,
        "transfer_ms": transfer_ms,
        "added_ms": added_ms,
        "predicted_added_ms": plan.prediction.extra_ms,
        "hidden_fraction": 1 - added_ms / transfer_ms if transfer_ms > 0 else None,
        "baseline_step_ms": check.baseline_step_ms,
        "measured_step_ms": check.measured_step_ms,
        "predicted_step_ms": check.predicted_step_ms,
        "paired_step_error_pct": check.paired_step_error_pct,
        "baseline_peak_bytes": check.baseline_peak_bytes,
        "measured_peak_bytes": check.measured_peak_bytes,
        "predicted_peak_bytes": check.predicted_peak_bytes,
        "grads_ok": check.ok,
        "grad_max_abs_diff": check.grad_max_abs_diff,
    }


def prediction(directory: str, repeats: int) -> dict:
    """Predicted vs measured step time of the built-in GPT with every block offloaded to disk."""
    built = build("gpt", optimizer="none", d_model=256, seq_len=128, batch_size=8, num_layers=4)
    model, batch = built.model, built.batch
    profile = remat.profile(model, batch, built.loss_fn, None, repeats=repeats)
    profile = dataclasses.replace(profile, bandwidths=measure_bandwidths("cpu", directory))
    plan = all_offloaded(profile, "offload:disk")
    predicted = predict(profile, plan)
    predicted_baseline = predicted.step_ms - predicted.extra_ms + predicted.fault_saving_ms
    baseline_ms = _step_ms(model, batch, built.loss_fn, repeats)
    remat.apply_(model, plan, offload_dir=directory)
    try:
        measured_ms = _step_ms(model, batch, built.loss_fn, repeats)
    finally:
        remat.remove_(model)
    # the profile's step includes an optimizer step; there is none here (optimizer="none")
    return {
        "offloaded_bytes": predicted.offloaded_bytes,
        "baseline_step_ms": baseline_ms,
        "predicted_step_ms": predicted.step_ms,
        "measured_step_ms": measured_ms,
        "error_pct": 100 * (measured_ms - predicted.step_ms) / predicted.step_ms,
        # the prediction at the speed of the baseline measured just before the planned steps
        "paired_error_pct": 100 * (measured_ms / (baseline_ms * predicted.step_ms / predicted_baseline) - 1),
        "predicted_baseline_step_ms": predicted_baseline,
        "extra_ms_predicted": predicted.extra_ms,
        "disk_overlap_fraction": profile.bandwidths.disk_overlap_fraction,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--offload-dir", default=tempfile.gettempdir())
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rates, ios, runs = [], [], []
    for _ in range(args.repeats):  # interleaved, so a busy moment hits all three alike
        rates.append(measure_disk(args.offload_dir))
        ios.append(io_path(args.offload_dir))
        runs.append(sustained(args.offload_dir))
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    write_bw, read_bw = statistics.median(r[0] for r in rates), statistics.median(r[1] for r in rates)
    write_io, read_io = med(ios, "write_bytes_per_s"), med(ios, "read_bytes_per_s")
    write_off, read_off = med(runs, "write_bytes_per_s"), med(runs, "read_bytes_per_s")
    pred = prediction(args.offload_dir, args.repeats)
    result = {
        "offload_dir": args.offload_dir,
        "load_average_1min": os.getloadavg()[0],
        "disk_write_bytes_per_s": write_bw, "disk_read_bytes_per_s": read_bw,
        "io_path_write_bytes_per_s": write_io, "io_path_read_bytes_per_s": read_io,
        "io_path_write_ratio": write_io / write_bw, "io_path_read_ratio": read_io / read_bw,
        "chain_write_bytes_per_s": write_off, "chain_read_bytes_per_s": read_off,
        "chain_write_ratio": write_off / write_bw, "chain_read_ratio": read_off / read_bw,
        "offloaded_bytes_per_step": runs[0]["offloaded_bytes"],
        "prediction": pred,
    }
    lines = [
        f"directory {args.offload_dir}, medians of {args.repeats}, load average {os.getloadavg()[0]:.1f}"
        f" on {os.cpu_count()} CPUs",
        f"sequential disk   write {write_bw / MiB:8.1f} MiB/s   read {read_bw / MiB:8.1f} MiB/s",
        f"offload I/O path  write {write_io / MiB:8.1f} MiB/s   read {read_io / MiB:8.1f} MiB/s"
        f"   ({100 * result['io_path_write_ratio']:.0f}% / {100 * result['io_path_read_ratio']:.0f}% of sequential; target >= 80%)",
        f"offload in chain  write {write_off / MiB:8.1f} MiB/s   read {read_off / MiB:8.1f} MiB/s"
        f"   ({100 * result['chain_write_ratio']:.0f}% / {100 * result['chain_read_ratio']:.0f}% of sequential, model compute included)",
        f"GPT all-offload   predicted {pred['predicted_step_ms']:.1f} ms   measured {pred['measured_step_ms']:.1f} ms"
        f"   error {pred['error_pct']:+.1f}%, at the measured baseline's speed {pred['paired_error_pct']:+.1f}%"
        f" (target within 15%); baseline {pred['baseline_step_ms']:.1f} ms measured,"
        f" {pred['predicted_baseline_step_ms']:.1f} ms profiled; {pred['offloaded_bytes'] / MiB:.1f} MiB offloaded per step",
    ]
    print("\n".join(lines))
    if args.json:
        write_atomic(args.json, json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
