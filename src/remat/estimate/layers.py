"""One layer on one GPU, and what it holds and spends under each recomputation strategy.

`on_gpu` divides a traced layer's shares by the parallel layout (`remat.estimate.shares.Share.divided`:
the per-token part by the tensor, sequence and context splits, the constant part by the tensor
split only). The backward's working set (saved bytes rematerialised plus temporaries, measured
on the traced layer by `remat.measure.profile`) is scaled by the same ratio as the layer's saved
bytes; under sequence parallelism it also holds the all-gathered input of a linear (the hidden
states of the whole sequence, Korthikanti et al. 2022, section 4.2.2).

The strategies (`LAYER_STRATEGIES`, a registry keyed by name):

- ``none``: the layer holds its saved bytes until its backward;
- ``selective``: Megatron-LM's selective recomputation (Korthikanti et al. 2022, section 4.3):
  everything but the attention core's internals, which the backward recomputes (the core's
  FLOPs, and at least writing its outputs at memory bandwidth); with a fused attention kernel
  the internals are its log-sum-exp only;
- ``full``: only the layer's own input (split along the sequence under sequence parallelism,
  as Megatron-LM stores it), its whole forward replayed in backward (its working set as a replay
  that stops at its last saved tensor needs, torch's ``early_stop``);
- ``offload``: nothing stays on the device between the forward and the backward; the saved
  bytes go to host memory and back over the host link, none of the transfer hidden.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from remat.estimate.parallel import Parallelism
from remat.estimate.shares import Segment, Share


@dataclass(kw_only=True, frozen=True)
class LayerOnGpu:
    """One layer's figures on one GPU for one micro-batch, before recomputation."""

    saved_bytes: float
    """What autograd saves (the layer's own storages and its input)."""
    core_bytes: float
    """Of those, the attention core's internals."""
    input_bytes: float
    """The layer's own input as stored (shared tensors counted once, before the layers)."""
    working_bytes: float
    """Its backward's working set: saved bytes rematerialised plus temporaries."""
    replay_working_bytes: float
    """The same with its forward replayed in backward."""
    forward_working_bytes: float = 0.0
    """Its forward's need above what is live before it, kept (`remat.estimate.shares.Segment.forward_working_bytes`)."""
    fwd_flops: float
    """Forward FLOPs."""
    bwd_flops: float
    """Backward FLOPs (`remat.estimate.shares.Segment.bwd_flops`)."""
    dequant_bytes: float = 0.0
    """Bytes its forward's weight dequantizations move (`remat.estimate.shares.Segment.dequant_bytes`)."""
    core_flops: float
    """Forward FLOPs of the attention core."""
    core_moved_bytes: float
    """Bytes the attention core's ops write in forward."""
    expert_flops: float
    """Forward FLOPs inside routed experts (0: not a MoE layer)."""
    hidden_bytes: float
    """The hidden states of the micro-batch on this rank's sequence share (before the sequence-
    parallel split): what each tensor-parallel collective of the layer moves."""


def per_gpu(per_token: Share, constant: Share, par: Parallelism) -> float:
    """A share's per-token part divided by the tensor, sequence and context splits, its constant
    part by the tensor split only (`remat.estimate.shares`)."""
    load = par.expert_load
    return (per_token.divided(tensor=par.tensor, sequence=par.sequence_divisor, context=par.context, expert_load=load)
            + constant.divided(tensor=par.tensor, sequence=1, context=1, expert_load=load))


def on_gpu(per_token: Segment, constant: Segment, par: Parallelism) -> LayerOnGpu:
    """A traced layer (per-token and constant parts) on one GPU of ``par``."""

    def share(per: Share, const: Share) -> float:
        return per_gpu(per, const, par)

    saved = share(per_token.saved, constant.saved)
    traced = per_token.saved.total + constant.saved.total
    ratio = saved / traced if traced else 1.0
    hidden = per_token.input_bytes / par.context + constant.input_bytes
    gathered = hidden if par.sequence_parallel else 0.0
    return LayerOnGpu(
        saved_bytes=saved,
        core_bytes=share(Share(core=per_token.saved.core), Share(core=constant.saved.core)),
        input_bytes=per_token.input_bytes / (par.sequence_divisor * par.context) + constant.input_bytes,
        working_bytes=(per_token.working_bytes + constant.working_bytes) * ratio + gathered,
        replay_working_bytes=(per_token.replay_working_bytes + constant.replay_working_bytes) * ratio + gathered,
        forward_working_bytes=(per_token.forward_working_bytes + constant.forward_working_bytes) * ratio + gathered,
        fwd_flops=share(per_token.flops, constant.flops),
        bwd_flops=share(per_token.bwd_flops, constant.bwd_flops),
        dequant_bytes=per_token.dequant_bytes + constant.dequant_bytes,
        core_flops=share(Share(core=per_token.flops.core), Share(core=constant.flops.core)),
        core_moved_bytes=(per_token.core_moved_bytes / par.context + constant.core_moved_bytes) / par.tensor,
        expert_flops=share(Share(expert_split=per_token.flops.expert_split, expert_whole=per_token.flops.expert_whole),
                           Share(expert_split=constant.flops.expert_split, expert_whole=constant.flops.expert_whole)),
        hidden_bytes=hidden,
    )


@dataclass(kw_only=True, frozen=True)
class LayerCost:
    """What one layer holds and spends under one strategy, per micro-batch."""

    retained_bytes: float
    """Held from its forward to its backward."""
    working_bytes: float
    """Needed on top while its backward runs."""
    extra_flops: float = 0.0
    """FLOPs replayed in backward."""
    extra_moved_bytes: float = 0.0
    """Bytes the replay writes at least (memory-bound ops)."""
    offloaded_bytes: float = 0.0
    """Bytes sent to host memory and fetched back."""
    replays_forward: bool = False
    """The whole forward runs again in backward (its collectives too)."""
    forward_bytes: float = 0.0
    """Needed on top of what is live before it while its forward runs."""
    holds_inputs: bool = False
    """A checkpoint holds the layer's arguments to its backward, the shared tensors made before
    the layers that no op saves (a mask) among them (`remat.estimate.stage`)."""


def _none(layer: LayerOnGpu) -> LayerCost:
    return LayerCost(retained_bytes=layer.saved_bytes, working_bytes=layer.working_bytes,
                     forward_bytes=layer.forward_working_bytes)


def _selective(layer: LayerOnGpu) -> LayerCost:
    return LayerCost(retained_bytes=layer.saved_bytes - layer.core_bytes, working_bytes=layer.working_bytes,
                     forward_bytes=layer.forward_working_bytes,
                     extra_flops=layer.core_flops, extra_moved_bytes=layer.core_moved_bytes,
                     holds_inputs=bool(layer.core_bytes or layer.core_flops))


def _full(layer: LayerOnGpu) -> LayerCost:
    # a checkpointed forward saves nothing but its input: its temporaries alone, a bound
    forward = max(layer.input_bytes, layer.forward_working_bytes - layer.saved_bytes + layer.input_bytes)
    return LayerCost(retained_bytes=layer.input_bytes, working_bytes=layer.replay_working_bytes, forward_bytes=forward,
                     extra_flops=layer.fwd_flops, replays_forward=True, holds_inputs=True)


def _offload(layer: LayerOnGpu) -> LayerCost:
    return LayerCost(retained_bytes=0.0, working_bytes=layer.working_bytes, offloaded_bytes=layer.saved_bytes,
                     forward_bytes=layer.forward_working_bytes)


LAYER_STRATEGIES: dict[str, Callable[[LayerOnGpu], LayerCost]] = {
    "none": _none, "selective": _selective, "full": _full, "offload": _offload,
}
"""Strategy name -> what a layer costs under it."""


def layer_cost(layer: LayerOnGpu, strategy: str) -> LayerCost:
    """``layer`` under ``strategy`` (a `LAYER_STRATEGIES` name)."""
    if strategy not in LAYER_STRATEGIES:
        raise ValueError(f"unknown layer strategy {strategy!r}; allowed: {', '.join(LAYER_STRATEGIES)}.")
    return LAYER_STRATEGIES[strategy](layer)


__all__ = ["LAYER_STRATEGIES", "LayerCost", "LayerOnGpu", "layer_cost", "on_gpu", "per_gpu"]
