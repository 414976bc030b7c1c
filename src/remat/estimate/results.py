"""What estimate reports per device and strategy (plain data; the CLI renders it)."""

from __future__ import annotations

from dataclasses import dataclass

from remat.estimate.devices import DeviceSpec
from remat.memory.model_state import ModelState


@dataclass(kw_only=True, frozen=True)
class StrategyEstimate:
    """One strategy on one device."""

    strategy: str
    """``none``, ``full``, ``selective`` or ``optimal``."""
    plan_strategy: str
    """What the planner ran, e.g. ``selective:attention-core``."""
    fits: bool
    """Total (allocated peak + allowance) within device memory."""
    peak_bytes: int
    """Predicted allocated peak: model state + activations + temporaries."""
    allowance_bytes: int
    """Context, workspaces and fragmentation on top of the peak."""
    activation_bytes: int
    """Peak minus the model state counted at the peak."""
    peak_phase: str
    """Where the peak falls: ``block``, ``post`` or ``optimizer``."""
    recompute_flops: int
    """FLOPs replayed per micro-batch."""
    step_s: float
    """Estimated step time (all micro-batches and the optimizer step)."""
    max_micro_batch: int | None
    """Largest micro-batch that fits with this strategy (0: none; None: the model's batch is fixed)."""
    diagnosis: str = ""
    """Why it does not fit, in words with numbers ("" when it fits)."""

    @property
    def total_bytes(self) -> int:
        return self.peak_bytes + self.allowance_bytes


@dataclass(kw_only=True, frozen=True)
class DeviceEstimate:
    """All strategies on one device."""

    device: DeviceSpec
    """The device."""
    budget_bytes: int
    """Largest allocated peak that fits with the allowance."""
    model_state: ModelState
    """Model state per rank (sharded)."""
    strategies: tuple[StrategyEstimate, ...]
    """In the order asked."""
