"""One pipeline stage on one GPU: its peak memory and its time per micro-batch.

Memory, with ``n`` the micro-batches in flight (`Parallelism.in_flight`):

    layers   = state_i + n (pre + sum_i retained_i) + buffers - sum_{j >= i} retained_j + working_i
               (the backward of layer i of the first micro-batch in flight, i from the last)
    head     = state_head + n pre + sum_i retained_i + post saved + post working   (last stage)
    optimizer= state + optimizer step temporaries
    pre fwd  = state without gradients + (n - 1) (pre + sum_i retained_i) + pre forward peak   (first stage)
    pre bwd  = state_pre + pre own + pre working   (first stage, after every layer's backward)
    peak     = the largest

as `remat.plan.predict` prices a chain (../docs/memory-model.md), with shared tensors made
before the layers counted once in ``pre``: each until the backward of the first layer that saves
or takes it is over (``pre own``: what the part saved itself), one no op saves (a mask) past the
forward only while a layer's checkpoint holds it (`Stage.pre_released`). ``buffers``: the
pipeline's send and receive buffers (one output activation each way). Gradients: with one micro-batch per step and no pipeline,
PyTorch's gradients (set to None between steps) appear as the backward makes them, as the
planner counts them (`remat.plan.predict.grad_bytes_live`): none at the head's backward, at
layer i's those of the layers after it (its own are among its working bytes); with several
micro-batches every gradient persists across them, so every one is live the whole step (as in
Megatron-LM's contiguous gradient buffers).

Time per micro-batch: forward + backward FLOPs and the replayed FLOPs at ``MFU x peak FLOP/s``.
The backward runs one product per gradient a linear gives: its input's where the input needs
one, its weight's where the weight is trained (twice the forward in a model trained whole; once
for a frozen linear under LoRA; none for one that reads the batch or frozen embeddings' output),
as traced (`remat.estimate.dataflow`) and as ``torch.utils.flop_counter`` counts the real step. A
replayed op at least writes its outputs at memory bandwidth; NF4 base weights are dequantized at
memory bandwidth in the forward, the backward and a replay; offloaded bytes go to host memory and
back over the host link; communication as `remat.estimate.comms` times it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from remat.estimate.comms import ModelFacts, Network, micro_batch_comm_s
from remat.estimate.layers import LayerCost, LayerOnGpu
from remat.estimate.parallel import Parallelism
from remat.memory.model_state import ModelState


@dataclass(kw_only=True, frozen=True)
class Stage:
    """One pipeline stage on one GPU at one micro-batch, before choosing strategies."""

    index: int
    """0 .. p - 1."""
    first: bool
    """Holds the embedding and the most micro-batches in flight."""
    last: bool
    """Holds the head and the loss."""
    state: ModelState
    """Model state on this GPU."""
    layers: tuple[LayerOnGpu, ...]
    """The stage's layers in forward order."""
    pre_bytes: float
    """Held per micro-batch before the layers (first stage): embedding outputs and masks."""
    pre_forward_peak_bytes: float = 0.0
    """The peak of the forward before the layers, above the model state (first stage)."""
    pre_working_bytes: float = 0.0
    """The backward temporaries of the part before the layers (first stage)."""
    pre_flops: float = 0.0
    """Forward FLOPs of the part before the layers (first stage: a vision model's patch embedding)."""
    pre_bwd_flops: float = 0.0
    """Their backward FLOPs (none for the input's gradient: the batch takes none)."""
    pre_released: tuple[tuple[float, float], ...] = ()
    """Per layer (first stage), what of ``pre_bytes`` its backward frees, and of that what no op
    saves, which only a layer's checkpoint holds past the forward (`remat.estimate.shares.Segment.released`;
    empty: all of it held to the part's own backward)."""
    post_saved_bytes: float
    """Saved by the head and loss (last stage)."""
    post_working_bytes: float
    """The head's backward temporaries (last stage)."""
    post_flops: float
    """Forward FLOPs of the head and loss (last stage)."""
    post_bwd_flops: float
    """Their backward FLOPs (last stage)."""
    in_flight: float
    """Micro-batches whose activations the stage holds at its peak."""
    buffer_bytes: float
    """Pipeline send and receive buffers."""
    optimizer_temp_bytes: float = 0.0
    """Temporaries of the optimizer step."""
    layer_grad_bytes: tuple[float, ...] = ()
    """Gradient bytes of each layer on this GPU (empty: every gradient live the whole step)."""
    pre_grad_bytes: float = 0.0
    """Gradient bytes of the parts before the layers (made last, after every layer's backward)."""
    post_replay_flops: float = 0.0
    """FLOPs the head strategy runs again in the backward (last stage; `remat.estimate.head`)."""
    post_moved_bytes: float = 0.0
    """Bytes the chunked head's updates of the weight's gradient read and write (last stage)."""

    @property
    def fwd_flops(self) -> float:
        """Forward FLOPs of one micro-batch: the layers, and the parts before and after them on the
        first and last stage."""
        return (sum(x.fwd_flops for x in self.layers) + (self.pre_flops if self.first else 0.0)
                + (self.post_flops if self.last else 0.0))

    @property
    def bwd_flops(self) -> float:
        """Backward FLOPs of one micro-batch."""
        return (sum(x.bwd_flops for x in self.layers) + (self.pre_bwd_flops if self.first else 0.0)
                + (self.post_bwd_flops if self.last else 0.0))

    def grads_live(self, layer: int | None) -> float:
        """Gradient bytes live when the backward of ``layer`` starts (None: the head's)."""
        total = float(self.state.grad_bytes)
        if not self.layer_grad_bytes:
            return total
        if layer is None:
            return 0.0
        return max(0.0, total - self.pre_grad_bytes - sum(self.layer_grad_bytes[: layer + 1]))


@dataclass(kw_only=True, frozen=True)
class StagePeak:
    """The stage's predicted peak and its parts."""

    peak_bytes: float
    """Model state plus activations plus temporaries at the peak."""
    phase: str
    """``layers``, ``head`` or ``optimizer``."""
    held_bytes: float
    """Activations held at that moment (every micro-batch in flight, the part before the layers)."""
    working_bytes: float
    """On top: the working set of the layer (or head) whose backward runs, and buffers."""


def stage_peak(stage: Stage, costs: Sequence[LayerCost]) -> StagePeak:
    """The peak of ``stage`` with layer ``i`` under ``costs[i]`` (module docstring)."""
    state = float(stage.state.total_bytes)
    base = state - stage.state.grad_bytes
    n = stage.in_flight
    retained = sum(c.retained_bytes for c in costs)
    # what the part before the layers holds for the layers (`Stage.pre_released`): of what no op
    # saves, past the forward, only what a checkpoint of a layer from its first taker on holds; in the
    # backward of layer i, none of what the layers after i freed, and of what no op saves, what a
    # checkpoint of a layer from its first taker to i holds
    released = [(f, b, u) for f, (b, u) in enumerate(stage.pre_released) if b or u]
    latest, last_holder = [], -1  # per layer i, the last layer up to i whose checkpoint holds its arguments
    for i, cost in enumerate(costs):
        last_holder = i if cost.holds_inputs else last_holder
        latest.append(last_holder)
    idle = sum(u for f, _, u in released if not latest or latest[-1] < f)
    held = n * (stage.pre_bytes - idle + retained)
    moments = [StagePeak(peak_bytes=state + stage.optimizer_temp_bytes, phase="optimizer", held_bytes=0.0,
                         working_bytes=stage.optimizer_temp_bytes)]
    freed = 0.0
    for i in range(len(costs) - 1, -1, -1):
        freed += costs[i].retained_bytes
        gone = sum(b if f > i else u if latest[i] < f else 0.0 for f, b, u in released)
        now = held + idle - gone - freed
        on_top = costs[i].working_bytes + stage.buffer_bytes
        moments.append(StagePeak(peak_bytes=base + stage.grads_live(i) + now + on_top, phase="layers",
                                 held_bytes=now, working_bytes=on_top))
    # each layer's forward, the layers before it holding what they keep, the micro-batches in flight
    # before this one all they keep; gradients none yet where the backward makes them, else all
    before = (n - 1) * (stage.pre_bytes - idle + retained) + stage.pre_bytes
    grads = 0.0 if stage.layer_grad_bytes else float(stage.state.grad_bytes)
    for cost in costs:
        moments.append(StagePeak(peak_bytes=base + grads + before + cost.forward_bytes + stage.buffer_bytes,
                                 phase="forward", held_bytes=before, working_bytes=cost.forward_bytes))
        before += cost.retained_bytes
    if stage.first and (stage.pre_forward_peak_bytes or stage.pre_working_bytes):
        # the forward before the layers, the micro-batches in flight before this one held: gradients
        # none yet where the backward makes them, else all of them
        earlier = (n - 1) * (stage.pre_bytes - idle + retained)
        grads = 0.0 if stage.layer_grad_bytes else float(stage.state.grad_bytes)
        moments.append(StagePeak(peak_bytes=base + grads + earlier + stage.pre_forward_peak_bytes,
                                 phase="pre-forward", held_bytes=earlier, working_bytes=stage.pre_forward_peak_bytes))
        # its backward, after every layer's: every gradient but its own, what it saved (not what the
        # layers' backwards freed)
        own = stage.pre_bytes - sum(b for _, b, _ in released)
        moments.append(StagePeak(peak_bytes=base + stage.grads_live(-1) + own + stage.pre_working_bytes,
                                 phase="pre-backward", held_bytes=own, working_bytes=stage.pre_working_bytes))
    if stage.last:
        head = stage.post_saved_bytes + stage.post_working_bytes
        moments.append(StagePeak(peak_bytes=base + stage.grads_live(None) + held + head, phase="head", held_bytes=held,
                                 working_bytes=head))
    return max(moments, key=lambda m: m.peak_bytes)


@dataclass(kw_only=True, frozen=True)
class Rates:
    """What a GPU computes and moves per second."""

    flops_per_s: float
    """Peak dense BF16 FLOP/s x MFU."""
    memory_bytes_per_s: float | None = None
    """Device memory bandwidth."""
    host_link_bytes_per_s: float | None = None
    """Host link, one direction (offload)."""


def extra_s(cost: LayerCost, rates: Rates) -> float:
    """What a strategy adds to a layer's time per micro-batch, communication aside."""
    replay = cost.extra_flops / rates.flops_per_s
    if rates.memory_bytes_per_s:
        replay = max(replay, cost.extra_moved_bytes / rates.memory_bytes_per_s)
    offload = 0.0
    if cost.offloaded_bytes:
        link = rates.host_link_bytes_per_s
        offload = 2 * cost.offloaded_bytes / link if link else float("inf")
    return replay + offload


def head_extra_s(stage: Stage, rates: Rates) -> float:
    """What the head strategy adds: its replayed projection, or its traffic of the weight's
    gradient at memory bandwidth when that takes longer (`remat.estimate.head`)."""
    replay = stage.post_replay_flops / rates.flops_per_s
    return max(replay, stage.post_moved_bytes / rates.memory_bytes_per_s) if rates.memory_bytes_per_s else replay


@dataclass(kw_only=True, frozen=True)
class StageTime:
    """One micro-batch through one stage."""

    compute_s: float
    """Forward, backward and replays."""
    comm_s: float
    """Tensor, context, expert and pipeline communication not hidden."""
    backward_s: float
    """The backward's share of ``compute_s`` (what hides data-parallel traffic)."""

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s


def stage_time(stage: Stage, costs: Sequence[LayerCost], rates: Rates, *, par: Parallelism, net: Network,
               facts: ModelFacts) -> StageTime:
    """One micro-batch through ``stage`` with layer ``i`` under ``costs[i]`` (module docstring)."""
    forward = stage.fwd_flops / rates.flops_per_s
    backward = stage.bwd_flops / rates.flops_per_s
    if rates.memory_bytes_per_s:  # NF4 weights dequantized in the forward, the backward and a replay
        forward += sum(x.dequant_bytes for x in stage.layers) / rates.memory_bytes_per_s
        backward += sum(x.dequant_bytes * (2 if c.replays_forward else 1)
                        for x, c in zip(stage.layers, costs)) / rates.memory_bytes_per_s
    extra = sum(extra_s(c, rates) for c in costs) + (head_extra_s(stage, rates) if stage.last else 0.0)
    core = 3 * sum(layer.core_flops for layer in stage.layers) / rates.flops_per_s
    comm = micro_batch_comm_s(stage.layers, costs, par, net, facts, core)
    return StageTime(compute_s=forward + backward + extra, comm_s=comm, backward_s=backward + extra)


__all__ = ["Rates", "Stage", "StagePeak", "StageTime", "extra_s", "head_extra_s", "stage_peak", "stage_time"]
