"""Why a configuration does not fit a device, in plain words with numbers."""

from __future__ import annotations

from dataclasses import replace

from remat.estimate.devices import DeviceSpec
from remat.estimate.results import StrategyEstimate
from remat._units import format_bytes
from remat.memory.diagnose import min_world_size
from remat.memory.model_state import ModelState, shard_model_state
from remat.memory.optimizer_state import BNB_QMAP_BYTES, adam8bit_tensor_bytes, optimizer_layout


def explain_state_overflow(
    unsharded: ModelState, rank: ModelState, *, budget_bytes: int, device: DeviceSpec, optimizer: str,
    world_size: int, zero_stage: int, param_count: int, unit_state: ModelState | None = None,
) -> str:
    """Model state per rank alone exceeds the device: say so, and what would fit, at this setup."""
    setup = f"ZeRO-{zero_stage} over {world_size} rank(s)" if zero_stage else f"plain data parallel over {world_size} rank(s)"
    lines = [
        f"On {device.name}, model state per rank is {format_bytes(rank.total_bytes)} with {setup} "
        f"({_parts(rank)}), above the {format_bytes(budget_bytes)} left for tensors "
        f"(device {format_bytes(device.memory_bytes)} minus the allowance), before any activation.",
        "Activation recomputation does not remove parameters, gradients or optimizer-state storage, "
        "so no recomputation strategy fits. What would fit:",
    ]
    for stage in (1, 2, 3):
        n = min_world_size(unsharded, zero_stage=stage, budget_bytes=budget_bytes, largest_unit=unit_state)
        name = "ZeRO-3 / FSDP" if stage == 3 else f"ZeRO-{stage}"
        lines.append(f"- {name}: from {n} data-parallel ranks." if n else f"- {name}: at no world size.")
    lines += _at_this_setup(unsharded, budget_bytes=budget_bytes, optimizer=optimizer, world_size=world_size,
                            zero_stage=zero_stage, param_count=param_count, unit_state=unit_state)
    return "\n".join(lines)


def state_parts(state: ModelState) -> list[tuple[str, int]]:
    """(name, bytes) of each kind of model state a GPU holds, as diagnoses and tables print them
    (the fp32 master copy and what FSDP2 gathers only when there are some; buffers, such as NF4
    base weights, from 1 MiB)."""
    parts = [("parameters", state.param_bytes), ("gradients", state.grad_bytes)]
    if state.master_bytes:
        parts.append(("fp32 master weights", state.master_bytes))
    parts.append(("optimizer state", state.optimizer_state_bytes))
    if state.gathered_bytes:
        parts.append(("FSDP2 gathered units", state.gathered_bytes))
    if state.buffer_bytes >= 1 << 20:  # NF4 base weights; not a rotary table's few bytes
        parts.append(("buffers", state.buffer_bytes))
    return parts


def _parts(state: ModelState) -> str:
    return ", ".join(f"{name} {format_bytes(num_bytes)}" for name, num_bytes in state_parts(state))


def _at_this_setup(unsharded: ModelState, *, budget_bytes: int, optimizer: str, world_size: int, zero_stage: int,
                   param_count: int, unit_state: ModelState | None) -> list[str]:
    """8-bit optimizer state and optimizer offload, each at the user's ZeRO stage and world size."""
    def per_rank(state: ModelState) -> int:
        return shard_model_state(state, world_size=world_size, zero_stage=zero_stage, largest_unit=unit_state).total_bytes

    lines = []
    if optimizer_layout(optimizer).name in ("adam", "adamw"):
        eight = replace(unsharded, optimizer_state_bytes=adam8bit_tensor_bytes((param_count,)) + BNB_QMAP_BYTES)
        lines.append(_verdict("8-bit optimizer state (bitsandbytes Adam8bit)", per_rank(eight), budget_bytes))
    offload = replace(unsharded, master_bytes=0, optimizer_state_bytes=0)
    host = unsharded.master_bytes + unsharded.optimizer_state_bytes
    lines.append(_verdict("optimizer offload to host", per_rank(offload), budget_bytes,
                          f", {format_bytes(_share(host, world_size, zero_stage))} per rank in host memory"))
    return lines


def _share(num_bytes: int, world_size: int, zero_stage: int) -> int:
    return -(-num_bytes // world_size) if zero_stage >= 1 else num_bytes


def _verdict(name: str, rank_bytes: int, budget_bytes: int, extra: str = "") -> str:
    verdict = "fits" if rank_bytes <= budget_bytes else "still does not fit"
    return f"- {name} at this setup: {format_bytes(rank_bytes)} per rank on the device{extra}; {verdict}."


def explain_activation_overflow(
    row: StrategyEstimate, rank: ModelState, *, budget_bytes: int, device: DeviceSpec, micro_batch: int
) -> str:
    """Model state fits but the step's peak does not: name the peak and its parts."""
    over = row.peak_bytes - budget_bytes
    layout = f" ({row.plan_strategy})" if row.plan_strategy != row.strategy else ""
    text = (
        f"On {device.name} with {row.strategy}{layout}, the step peaks at "
        f"{format_bytes(row.peak_bytes)} during the {row.peak_phase} phase: model state {format_bytes(rank.total_bytes)} "
        f"per rank plus {format_bytes(row.activation_bytes)} of activations and temporaries at micro-batch "
        f"{micro_batch}, {format_bytes(over)} above the {format_bytes(budget_bytes)} left for tensors."
    )
    if row.max_micro_batch:
        text += f" The largest micro-batch that fits with {row.strategy} is {row.max_micro_batch}."
    elif row.max_micro_batch == 0 and micro_batch > 1:
        text += f" Even micro-batch 1 does not fit with {row.strategy}."
    return text
