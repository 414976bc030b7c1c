"""What estimate reports per device and strategy (plain data; the CLI renders it)."""

from __future__ import annotations

from dataclasses import dataclass

from remat.estimate.devices import DeviceSpec
from remat.memory.model_state import ModelState


@dataclass(kw_only=True, frozen=True)
class StepTime:
    """Where one optimizer step's time goes, per GPU (`remat.estimate.comms`)."""

    compute_s: float
    """Forward, backward and replayed FLOPs of every micro-batch through the slowest stage."""
    comm_s: float
    """Tensor, context, expert and pipeline communication not hidden."""
    bubble_s: float
    """Pipeline bubble."""
    data_parallel_s: float
    """Gradient and parameter traffic between data-parallel ranks not hidden behind the backward."""
    optimizer_s: float
    """The optimizer step at memory bandwidth (it reads and writes every state byte once)."""

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.bubble_s + self.data_parallel_s + self.optimizer_s


@dataclass(kw_only=True, frozen=True)
class StrategyEstimate:
    """One strategy on one device (per GPU, at the stage whose peak is highest)."""

    strategy: str
    """``none``, ``full``, ``selective`` or ``optimal``."""
    plan_strategy: str
    """What ran, e.g. ``selective`` or ``optimal: 60 none, 20 full`` (`remat.estimate.strategies`)."""
    fits: bool
    """Total (allocated peak + allowance) within device memory, on every stage."""
    peak_bytes: int
    """Predicted allocated peak: model state + activations + temporaries."""
    allowance_bytes: int
    """Context, workspaces and fragmentation on top of the peak."""
    activation_bytes: int
    """Peak minus the model state."""
    peak_phase: str
    """Where the peak falls: ``layers``, ``head`` or ``optimizer``."""
    recompute_flops: int
    """FLOPs replayed per micro-batch on the peak stage's GPU."""
    step_s: float
    """Estimated step time (all micro-batches, bubble, data-parallel traffic, optimizer step)."""
    max_micro_batch: int | None
    """Largest micro-batch that fits with this strategy (0: none; None: the model's batch is fixed)."""
    peak_stage: int = 0
    """The pipeline stage whose peak is highest (0: the first)."""
    layer_retained_bytes: int = 0
    """What one layer holds per micro-batch between its forward and backward (a mix: the mean)."""
    held_bytes: int = 0
    """Activations held at the peak: every micro-batch in flight, the part before the layers."""
    working_bytes: int = 0
    """On top at the peak: the backward's working set of one layer (or the head), buffers."""
    time: StepTime | None = None
    """The step time's parts."""
    diagnosis: str = ""
    """Why it does not fit, in words with numbers ("" when it fits)."""

    @property
    def total_bytes(self) -> int:
        return self.peak_bytes + self.allowance_bytes


@dataclass(kw_only=True, frozen=True)
class HeadEstimate:
    """One head strategy on one GPU of the last pipeline stage, per micro-batch (`remat.estimate.head`)."""

    strategy: str
    """``keep``, ``recompute`` or ``chunked:<tokens>``."""
    logits_bytes: int
    """The rank's logits in the dtype the loss runs in."""
    held_bytes: int
    """Held from the head's forward to its backward, the hidden states included."""
    fwd_peak_bytes: int
    """Peak of the head's forward, from the hidden states on."""
    bwd_peak_bytes: int
    """Peak of the head's backward, the weight's gradient included."""
    post_peak_bytes: int
    """Peak of the whole part after the layers (final norm and head) on top of what the layers hold."""
    replay_flops: int
    """FLOPs run again in the backward (one more projection for ``recompute`` and ``chunked``)."""
    moved_bytes: int = 0
    """Bytes the chunks' updates of the weight's gradient read and write (priced at memory bandwidth)."""


@dataclass(kw_only=True, frozen=True)
class DeviceEstimate:
    """All strategies on one device."""

    device: DeviceSpec
    """The device."""
    budget_bytes: int
    """Largest allocated peak that fits with the allowance."""
    model_state: ModelState
    """Model state per GPU (sharded), on the stage that holds the most."""
    strategies: tuple[StrategyEstimate, ...]
    """In the order asked."""
