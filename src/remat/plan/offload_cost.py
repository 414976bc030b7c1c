"""Cost of the ``offload`` strategies for the planner (registered into `remat.plan.costs`).

Per offloaded block ``i`` (``offload:cpu`` or ``offload:disk``), from the measured profile:

- ``offloaded_bytes``: the block's saved storages at or above the engine's size threshold
  (`remat.apply.offload.MIN_BYTES`): the outputs its ops save and its input, when large;
- ``retained_bytes`` = ``saved_bytes - offloaded_bytes``: what stays on the device (small tensors),
  less what the block hands off, plus its entry bytes (`remat.plan.costs`);
- ``working_bytes``: the block's own backward (saved bytes brought back + temporaries) plus the
  previous block's offloaded bytes, which the engine prefetches while this block's backward runs
  (conservative when the previous block is not offloaded: it is then counted twice);
- ``extra_ms``: transfer time not hidden behind compute. A write of the block's bytes overlaps
  with the forward after it, a read with the backward of the block after it; a share
  ``overlap_fraction`` (measured by `remat.measure.bandwidth`, 0 when not measured: nothing is
  assumed hidden) of the shorter of transfer and compute is hidden::

      exposed(transfer, compute) = transfer - overlap * min(transfer, compute)
      extra_ms = exposed(bytes / write_rate, fwd_ms) + exposed(bytes / read_rate, bwd_ms)

  with the rates of the target: pinned device->host / host->device for ``cpu``; the disk's
  sequential write / read for ``disk`` (plus the device->host / host->device copy on a GPU,
  when measured);
- ``extra_flops`` = 0: nothing is recomputed.

A strategy is offered only where its rates were measured (`offload_strategies`); costing it
without them is a ValueError that says how to measure them.
"""

from __future__ import annotations

from remat.measure.types import BlockProfile, Profile
from remat.plan.costs import BlockCost, register_cost
from remat.plan.phases import forward_phase_bytes, grad_bytes_live, working_bytes
from remat.plan.types import Segment

__all__ = ["offload_strategies", "offloadable_bytes", "exposed_ms", "transfer_ms"]

MIN_BYTES = 64 << 10
"""Same threshold as `remat.apply.offload.MIN_BYTES` (not imported: planning must not need torch
hooks); a test keeps them equal."""


def offload_strategies(profile: Profile) -> tuple[str, ...]:
    """The offload strategies this profile can cost: ``offload:cpu`` on an accelerator with
    measured host<->device rates, ``offload:disk`` with measured disk rates (the same rule as
    the planner's options in `remat.plan.search`)."""
    bw = profile.bandwidths
    out: list[str] = []
    if profile.fingerprint.device != "cpu" and bw.host_to_device_bytes_per_s and bw.device_to_host_bytes_per_s:
        out.append("offload:cpu")
    if bw.disk_write_bytes_per_s and bw.disk_read_bytes_per_s:
        out.append("offload:disk")
    return tuple(out)


def offloadable_bytes(block: BlockProfile, min_bytes: int = MIN_BYTES) -> int:
    """Saved bytes of ``block`` in storages of at least ``min_bytes`` (what the engine moves)."""
    large = sum(op.saved_bytes for op in block.ops if op.saved_bytes >= min_bytes)
    if block.input_bytes >= min_bytes:
        large += block.input_bytes
    return min(large, block.saved_bytes)


def exposed_ms(transfer: float, compute: float, overlap_fraction: float) -> float:
    """Transfer time left visible when a share of the shorter of the two runs concurrently."""
    return transfer - overlap_fraction * min(transfer, compute)


def transfer_ms(profile: Profile, strategy: str, nbytes: int) -> tuple[float, float]:
    """(offload, restore) milliseconds to move ``nbytes`` with ``strategy``."""
    if strategy not in offload_strategies(profile):
        raise ValueError(
            f"cannot cost {strategy!r}: the profile has no measured rates for it (bandwidths "
            f"{profile.bandwidths}); offload:disk needs a profile taken with an offload directory "
            "(remat profile --offload-dir DIR, remat.profile(..., offload_dir=DIR)), offload:cpu a CUDA model."
        )
    bw = profile.bandwidths
    out_ms, back_ms = 0.0, 0.0
    if profile.fingerprint.device != "cpu" and bw.device_to_host_bytes_per_s and bw.host_to_device_bytes_per_s:
        out_ms += 1e3 * nbytes / bw.device_to_host_bytes_per_s
        back_ms += 1e3 * nbytes / bw.host_to_device_bytes_per_s
    if strategy == "offload:disk":
        out_ms += 1e3 * nbytes / bw.disk_write_bytes_per_s
        back_ms += 1e3 * nbytes / bw.disk_read_bytes_per_s
    return out_ms, back_ms


def _overlap(profile: Profile, strategy: str) -> float:
    bw = profile.bandwidths
    value = bw.disk_overlap_fraction if strategy == "offload:disk" else bw.overlap_fraction
    return 0.0 if value is None else min(1.0, max(0.0, value))


@register_cost("offload")
def _offload(profile: Profile, block_index: int, segment: Segment) -> BlockCost:
    block = profile.blocks[block_index]
    moved = offloadable_bytes(block)
    out_ms, back_ms = transfer_ms(profile, segment.strategy, moved)
    overlap = _overlap(profile, segment.strategy)
    prefetched = offloadable_bytes(profile.blocks[block_index - 1]) if block_index > 0 else 0
    return BlockCost(
        retained_bytes=max(0, block.saved_bytes - moved - block.handoff_bytes) + block.entry_bytes,
        working_bytes=max(working_bytes(block) + prefetched,
                          forward_phase_bytes(block) - grad_bytes_live(profile, block_index)),
        extra_ms=exposed_ms(out_ms, block.fwd_ms, overlap) + exposed_ms(back_ms, block.bwd_ms, overlap),
        extra_flops=0,
        offloaded_bytes=moved,
    )
