"""Plain-words diagnosis when model state alone does not fit a memory budget.

Activation recomputation only shrinks activations; parameters, gradients, the fp32 master
copy and optimizer state stay. When they alone exceed the budget, the remedies are the ones
that shrink or move model state, and this module says how much each would need:
- ZeRO-1 / ZeRO-2 / ZeRO-3 (FSDP): the smallest data-parallel world size that fits;
- 8-bit optimizer state (bitsandbytes block-wise Adam8bit);
- optimizer offload to host memory (the master copy and moments leave the device).
"""

from __future__ import annotations

from dataclasses import dataclass

from remat._units import format_bytes, format_bytes_exact
from remat.memory.model_state import ModelState, gathered_unit_bytes, shard_model_state
from remat.memory.optimizer_state import BNB_QMAP_BYTES, adam8bit_tensor_bytes

GIB = 1024**3


def format_gib(num_bytes: float) -> str:
    """Bytes as GiB with two decimals, e.g. ``"12.50 GiB"`` (tables on one GiB scale; prose uses
    `remat._units.format_bytes`, which picks the unit)."""
    return f"{num_bytes / GIB:.2f} GiB"


@dataclass(kw_only=True, frozen=True)
class Remedy:
    """One way to make model state fit, with what it needs."""

    name: str
    """E.g. ``"ZeRO-3"``, ``"8-bit optimizer state"``, ``"optimizer offload to host"``."""
    fits: bool
    """True when the remedy brings model state under the budget."""
    state_bytes: int
    """Model-state bytes per device with the remedy applied (at the world size it names)."""
    world_size: int | None = None
    """ZeRO remedies: the smallest world size that fits (None: no world size does)."""
    host_bytes: int = 0
    """Bytes moved to host memory (offload)."""


def unsharded_bytes(state: ModelState, *, zero_stage: int) -> int:
    """The part of ``state`` that ZeRO-``zero_stage`` leaves whole on every rank."""
    kept = state.buffer_bytes
    kept += state.grad_bytes if zero_stage < 2 else 0
    kept += state.param_bytes if zero_stage < 3 else 0
    return kept


def min_world_size(
    state: ModelState, *, zero_stage: int, budget_bytes: int, largest_unit: ModelState | None = None
) -> int | None:
    """Smallest number of ranks whose ZeRO-``zero_stage`` shard of ``state`` fits; None if none.

    ``largest_unit``: ZeRO-3's largest unit (see `shard_model_state`)."""

    def per_rank(n: int) -> int:
        return shard_model_state(state, world_size=n, zero_stage=zero_stage, largest_unit=largest_unit).total_bytes

    if per_rank(1) <= budget_bytes:
        return 1
    gathered = gathered_unit_bytes(largest_unit) if largest_unit and zero_stage == 3 else 0
    if unsharded_bytes(state, zero_stage=zero_stage) + gathered >= budget_bytes:
        return None
    lo, hi = 1, 1 << 40
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if per_rank(mid) <= budget_bytes:
            hi = mid
        else:
            lo = mid
    return hi if per_rank(hi) <= budget_bytes else None  # shards round up: a byte each at any size


def remedies(state: ModelState, *, budget_bytes: int, param_count: int, optimizer_name: str,
             largest_unit: ModelState | None = None) -> tuple[Remedy, ...]:
    """ZeRO-1/2/3 world sizes, 8-bit optimizer state and host offload for ``state``;
    ``largest_unit``: ZeRO-3's largest unit (see `shard_model_state`)."""
    out = []
    for stage in (1, 2, 3):
        unit = largest_unit if stage == 3 else None
        n = min_world_size(state, zero_stage=stage, budget_bytes=budget_bytes, largest_unit=unit)
        shard = (shard_model_state(state, world_size=n, zero_stage=stage, largest_unit=unit).total_bytes if n is not None
                 else unsharded_bytes(state, zero_stage=stage))
        out.append(Remedy(name=f"ZeRO-{stage}" + (" / FSDP" if stage == 3 else ""), fits=n is not None,
                          state_bytes=shard, world_size=n))
    if optimizer_name.lower() in ("adam", "adamw"):
        eight = adam8bit_tensor_bytes((param_count,)) + BNB_QMAP_BYTES
        total = state.total_bytes - state.optimizer_state_bytes + eight
        out.append(Remedy(name="8-bit optimizer state", fits=total <= budget_bytes, state_bytes=total))
    host = state.master_bytes + state.optimizer_state_bytes
    device = state.total_bytes - host
    out.append(Remedy(name="optimizer offload to host", fits=device <= budget_bytes, state_bytes=device, host_bytes=host))
    return tuple(out)


def _remedy_line(r: Remedy) -> str:
    if r.world_size is not None:
        return f"- {r.name}: fits from {r.world_size} data-parallel ranks ({format_bytes(r.state_bytes)} per rank)."
    if r.name.startswith("ZeRO"):
        return f"- {r.name}: does not fit at any world size (unsharded part {format_bytes(r.state_bytes)})."
    verdict = "fits" if r.fits else "still does not fit"
    host = f", {format_bytes(r.host_bytes)} moved to host memory" if r.host_bytes else ""
    return f"- {r.name}: {format_bytes(r.state_bytes)} on the device{host}; {verdict}."


def optimizer_part(optimizer_name: str, optimizer_state_bytes: int) -> str:
    """``"AdamW optimizer state 2.00 GiB"``; without an optimizer, ``"no optimizer state"``."""
    if optimizer_name.strip().lower() in ("", "none") and optimizer_state_bytes == 0:
        return "no optimizer state"
    if optimizer_name.strip().lower() in ("", "none"):
        return f"optimizer state {format_bytes(optimizer_state_bytes)}"
    return f"{optimizer_name} optimizer state {format_bytes(optimizer_state_bytes)}"


def explain_model_state_overflow(
    *,
    param_bytes: int,
    grad_bytes: int,
    optimizer_state_bytes: int,
    buffer_bytes: int,
    budget_bytes: int,
    optimizer_name: str,
    master_bytes: int = 0,
    param_count: int | None = None,
    largest_unit: ModelState | None = None,
) -> str:
    """Say in plain words, with numbers, why model state alone exceeds ``budget_bytes``, and what fits.

    ``param_count`` defaults to ``param_bytes // 4`` (fp32 weights); ``largest_unit``: what ZeRO-3
    gathers as one unit (`shard_model_state`). Returns "" when model state fits.
    """
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}; pass the device memory in bytes.")
    state = ModelState(param_bytes=param_bytes, grad_bytes=grad_bytes, master_bytes=master_bytes,
                       optimizer_state_bytes=optimizer_state_bytes, buffer_bytes=buffer_bytes)
    if state.total_bytes <= budget_bytes:
        return ""
    count = param_count if param_count is not None else param_bytes // 4
    parts = [f"parameters {format_bytes(param_bytes)}", f"gradients {format_bytes(grad_bytes)}"]
    if master_bytes:
        parts.append(f"fp32 master weights {format_bytes(master_bytes)}")
    parts += [optimizer_part(optimizer_name, optimizer_state_bytes), f"buffers {format_bytes(buffer_bytes)}"]
    lines = [
        f"Model state alone needs {format_bytes_exact(state.total_bytes)} ({', '.join(parts)}), more than the "
        f"budget of {format_bytes_exact(budget_bytes)} by {format_bytes_exact(state.total_bytes - budget_bytes)}, "
        "before any activation.",
        "Activation recomputation does not remove parameters, gradients or optimizer-state storage, "
        "so no checkpointing plan can fit. What would fit:",
    ]
    lines += [_remedy_line(r) for r in remedies(state, budget_bytes=budget_bytes, param_count=count,
                                                 optimizer_name=optimizer_name, largest_unit=largest_unit)]
    return "\n".join(lines)
