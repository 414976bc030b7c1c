"""Model state of a training step: parameters, gradients, fp32 master weights, optimizer state.

Precision recipes (bytes per parameter element: weights, gradients, master copy, optimizer
state element):
- ``fp32``: 4, 4, 0, 4;
- ``mixed``: 16-bit weights and gradients, fp32 master weights and fp32 optimizer state:
  2, 2, 4, 4. With Adam this is the ZeRO paper's 2 + 2 + 12 = 16 bytes per parameter
  (Rajbhandari et al. 2020, section 3.1: K = 12 for the fp32 copy, momentum and variance);
- ``bf16``: pure bf16 training, everything 16-bit, no master copy: 2, 2, 0, 2.

Sharding over ``world_size`` data-parallel ranks follows the ZeRO paper (section 5, figure 1):
stage 1 shards the optimizer states (the master copy counts as optimizer state, as in the
paper), stage 2 also the gradients, stage 3 (= FSDP full sharding) also the parameters.
A shard is ``ceil(bytes / world_size)``, the padded size FSDP uses.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from remat.memory.optimizer_state import optimizer_layout, optimizer_state_bytes


@dataclass(kw_only=True, frozen=True)
class Precision:
    """Bytes per element of each kind of model state."""

    name: str
    """``fp32``, ``mixed`` or ``bf16``."""
    param_elem_bytes: int
    """Working weights."""
    grad_elem_bytes: int
    """Gradients."""
    master_elem_bytes: int
    """fp32 master copy of the weights (0: none)."""
    state_elem_bytes: int
    """One optimizer-state element."""


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision(name="fp32", param_elem_bytes=4, grad_elem_bytes=4, master_elem_bytes=0, state_elem_bytes=4),
    "mixed": Precision(name="mixed", param_elem_bytes=2, grad_elem_bytes=2, master_elem_bytes=4, state_elem_bytes=4),
    "bf16": Precision(name="bf16", param_elem_bytes=2, grad_elem_bytes=2, master_elem_bytes=0, state_elem_bytes=2),
}

_PRECISION_ALIASES = {"float32": "fp32", "amp": "mixed", "mixed-bf16": "mixed", "mixed-fp16": "mixed",
                      "bfloat16": "bf16", "pure-bf16": "bf16"}


def precision(name: str) -> Precision:
    """The precision recipe for a name (``fp32``, ``mixed``, ``bf16`` and a few aliases)."""
    key = _PRECISION_ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in PRECISIONS:
        raise ValueError(
            f"unknown precision {name!r}; allowed: fp32, mixed (16-bit weights with fp32 master "
            "weights and optimizer state), bf16 (pure bf16)."
        )
    return PRECISIONS[key]


@dataclass(kw_only=True, frozen=True)
class ModelState:
    """Bytes of model state on one rank."""

    param_bytes: int
    """Working weights."""
    grad_bytes: int
    """Gradients."""
    master_bytes: int
    """fp32 master copy of the weights (mixed precision)."""
    optimizer_state_bytes: int
    """Optimizer state (moments...), without the master copy."""
    buffer_bytes: int = 0
    """Module buffers (never sharded)."""
    gathered_bytes: int = 0
    """ZeRO-3/FSDP: the all-gathered weights and unsharded gradients of the largest unit."""

    @property
    def total_bytes(self) -> int:
        return (self.param_bytes + self.grad_bytes + self.master_bytes + self.optimizer_state_bytes
                + self.buffer_bytes + self.gathered_bytes)

    @property
    def optimizer_side_bytes(self) -> int:
        """What the ZeRO paper calls optimizer states: master copy + moments."""
        return self.master_bytes + self.optimizer_state_bytes


def model_state(
    shapes: Iterable[Sequence[int]],
    *,
    optimizer: str = "adamw",
    precision_name: str = "mixed",
    buffer_bytes: int = 0,
) -> ModelState:
    """Unsharded model state of parameters of ``shapes`` under an optimizer and precision recipe."""
    shapes = [tuple(s) for s in shapes]
    prec = precision(precision_name)
    numel = sum(_numel(s) for s in shapes)
    return ModelState(
        param_bytes=numel * prec.param_elem_bytes,
        grad_bytes=numel * prec.grad_elem_bytes if optimizer_layout(optimizer).name != "none" else 0,
        master_bytes=numel * prec.master_elem_bytes,
        optimizer_state_bytes=optimizer_state_bytes(optimizer, shapes, state_dtype_bytes=prec.state_elem_bytes),
        buffer_bytes=buffer_bytes,
    )


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _shard(num_bytes: int, world_size: int) -> int:
    return -(-num_bytes // world_size)


def check_sharding(world_size: int, zero_stage: int) -> None:
    """Raise a ValueError for a world size below 1 or a ZeRO stage outside 0..3."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}; pass the number of data-parallel ranks.")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(
            f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}; 0 = plain data parallel, "
            "1 = shard optimizer state, 2 = + gradients, 3 = + parameters (FSDP)."
        )


def shard_model_state(
    state: ModelState, *, world_size: int, zero_stage: int, largest_unit: ModelState | None = None
) -> ModelState:
    """Per-rank model state under ZeRO ``zero_stage`` over ``world_size`` ranks.

    ``largest_unit`` (stage 3 only): the unsharded state of the largest FSDP unit (a
    transformer layer; the embedding and the head are units of their own, as torchtitan wraps
    them). While a unit's backward runs FSDP2 holds `gathered_unit_bytes` beside the shards.
    """
    check_sharding(world_size, zero_stage)
    n = world_size
    out = replace(
        state,
        master_bytes=_shard(state.master_bytes, n) if zero_stage >= 1 else state.master_bytes,
        optimizer_state_bytes=_shard(state.optimizer_state_bytes, n) if zero_stage >= 1 else state.optimizer_state_bytes,
        grad_bytes=_shard(state.grad_bytes, n) if zero_stage >= 2 else state.grad_bytes,
        param_bytes=_shard(state.param_bytes, n) if zero_stage >= 3 else state.param_bytes,
    )
    if zero_stage == 3 and largest_unit is not None and n > 1:
        out = replace(out, gathered_bytes=gathered_unit_bytes(largest_unit))
    return out


def gathered_unit_bytes(unit: ModelState) -> int:
    """What FSDP2 holds beside the shards while a unit's backward runs, priced with the largest
    unit: its weights all-gathered at full size and its unsharded gradients, the next unit's
    weights (all-gathered as this backward begins: backward prefetch) and the gradients of the unit
    before (the reduce-scatter input, held until this unit's reduce-scatter is issued). The shards
    stay in storages of their own, so none of it is the rank's shard. Measured on CPU ranks
    (`remat.distributed.fsdp2_gathered_bytes`, BENCHMARKS.md "tenth run"); the ZeRO paper's
    accounting, one unit's weights and gradients less the shard, was 6.5 % to 14 % under those
    peaks."""
    return 2 * (unit.param_bytes + unit.grad_bytes)
