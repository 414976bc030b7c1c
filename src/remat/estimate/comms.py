"""Communication time of a training step, from the link bandwidths of the device table.

A collective over ``g`` ranks is timed as NCCL's ring algorithms move data (Thakur, Rabenseifner
and Gropp 2005, "Optimization of Collective Communication Operations in MPICH"; NCCL's
performance notes, ``nccl-tests/doc/PERFORMANCE.md``): an all-reduce sends ``2 (g - 1)/g`` of the
buffer over each rank's link, an all-gather, a reduce-scatter or an all-to-all ``(g - 1)/g`` of
the full buffer, a point-to-point send all of it; at one direction of the slowest link the group
spans. Groups are laid out tensor-parallel innermost, then context, data, pipeline
(Megatron-LM's default order): ``g`` ranks ``r`` apart span nodes when ``g r`` exceeds the GPUs
of a node, and then use the network; else the GPU-to-GPU link (NVLink, or PCIe).

Per micro-batch, on the critical path:
- tensor parallel: per layer two all-reduces of its hidden states in forward and two in
  backward (Shoeybi et al. 2019, figure 4: the f and g operators around attention and MLP;
  sequence parallelism turns each into an all-gather and a reduce-scatter of the same volume,
  Korthikanti et al. 2022, section 4.2.2), two more for a replayed forward;
- context parallel: per layer the ring passes each rank's K and V to the c - 1 others in
  forward, and K, V and their gradients in backward; the attention core's compute hides what
  it can (ring attention overlaps each transfer with a block of attention, Liu et al. 2023);
- expert parallel: per MoE layer an all-to-all dispatch and combine of the routed tokens (top-k
  copies of each) in forward, the same in backward;
- pipeline: the stage's output activations sent forward and their gradient sent back.
Per step:
- data parallel: the gradients' all-reduce (ZeRO 0) or reduce-scatter plus the parameters'
  all-gather (ZeRO 1 and 2; Megatron-LM's distributed optimizer), hidden behind the last
  micro-batch's backward up to its duration (gradients are reduced in buckets as the backward
  produces them); ZeRO-3 all-gathers the parameters in forward and backward and
  reduce-scatters the gradients every micro-batch, hidden behind that micro-batch's compute up
  to its duration;
- the pipeline bubble: ``(p - 1)/v`` micro-batch times (Narayanan et al. 2021, "Efficient
  Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", section 2.2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from remat.estimate.layers import LayerCost, LayerOnGpu
from remat.estimate.parallel import Parallelism


@dataclass(kw_only=True, frozen=True)
class Network:
    """The links a GPU talks over."""

    intra_node_bytes_per_s: float
    """GPU to GPU inside a node, one direction (NVLink, or PCIe)."""
    inter_node_bytes_per_s: float
    """Between nodes, per GPU, one direction."""
    gpus_per_node: int
    """GPUs sharing the intra-node link."""

    def bandwidth(self, size: int, stride: int) -> float:
        """One direction of the slowest link a group of ``size`` ranks ``stride`` apart crosses."""
        return self.intra_node_bytes_per_s if size * stride <= self.gpus_per_node else self.inter_node_bytes_per_s


def all_reduce_s(num_bytes: float, ranks: int, bytes_per_s: float) -> float:
    return 2 * (ranks - 1) / ranks * num_bytes / bytes_per_s if ranks > 1 else 0.0


def gather_s(num_bytes: float, ranks: int, bytes_per_s: float) -> float:
    """An all-gather, reduce-scatter or all-to-all of a ``num_bytes`` buffer."""
    return (ranks - 1) / ranks * num_bytes / bytes_per_s if ranks > 1 else 0.0


@dataclass(kw_only=True, frozen=True)
class ModelFacts:
    """What the communication terms read from the model's config."""

    experts_per_token: int = 0
    """Routed experts per token (0: no MoE layer)."""
    kv_fraction: float = 1.0
    """Width of K (and of V) over the hidden size (grouped-query attention: kv heads / heads)."""


def micro_batch_comm_s(layers: Sequence[LayerOnGpu], costs: Sequence[LayerCost], par: Parallelism, net: Network,
                       facts: ModelFacts, core_s: float) -> float:
    """Communication of one micro-batch through one stage (module docstring), in seconds;
    ``core_s``: the stage's attention-core compute time for that micro-batch (forward and backward)."""
    t, c, e = par.tensor, par.context, par.expert
    tp_bw = net.bandwidth(t, 1)
    seconds = 0.0
    for layer, cost in zip(layers, costs):
        collectives = 6 if cost.replays_forward else 4
        seconds += collectives * all_reduce_s(layer.hidden_bytes, t, tp_bw)
        if e > 1 and facts.experts_per_token and layer.expert_flops > 0:
            tokens = facts.experts_per_token * layer.hidden_bytes / par.sequence_divisor
            seconds += 4 * gather_s(tokens * par.expert_load, e, net.bandwidth(e * par.expert_tensor_size, 1))
    if c > 1:
        kv = sum(2 * facts.kv_fraction * layer.hidden_bytes / t for layer in layers)
        ring = 3 * (c - 1) * kv / net.bandwidth(c, t)
        seconds += max(0.0, ring - core_s)
    if par.pipeline > 1 and layers:
        seconds += 2 * layers[-1].hidden_bytes / par.sequence_divisor / net.bandwidth(par.pipeline, t * c * par.data)
    return seconds


def data_parallel_s(*, param_bytes: float, grad_bytes: float, zero_stage: int, par: Parallelism, net: Network) -> float:
    """Per step (ZeRO 0..2) or per micro-batch (ZeRO-3) data-parallel traffic, unhidden."""
    d = par.data
    bw = net.bandwidth(d, par.tensor * par.context)
    if zero_stage == 0:
        return all_reduce_s(grad_bytes, d, bw)
    if zero_stage in (1, 2):
        return gather_s(grad_bytes, d, bw) + gather_s(param_bytes, d, bw)
    return 2 * gather_s(param_bytes, d, bw) + gather_s(grad_bytes, d, bw)


def bubble_s(par: Parallelism, micro_batch_s: float) -> float:
    """The pipeline's idle time per step: ``(p - 1)/v`` micro-batch times."""
    return (par.pipeline - 1) / par.virtual_stages * micro_batch_s


__all__ = ["ModelFacts", "Network", "all_reduce_s", "bubble_s", "data_parallel_s", "gather_s", "micro_batch_comm_s"]
