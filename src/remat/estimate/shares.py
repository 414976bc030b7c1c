"""Bytes and FLOPs of a traced model, split by how each parallelism divides them.

A `Share` holds one quantity of one segment (a layer, or the parts before and after the layers)
in five buckets (Korthikanti et al. 2022, section 4.2: tensor parallelism splits what lies
between a column-parallel and a row-parallel linear; sequence parallelism splits the rest along
the sequence; context parallelism splits every tensor indexed by token along the sequence):

- ``split``: inside the tensor-parallel region (attention heads, the MLP's hidden units):
  divided by the tensor-parallel size t;
- ``whole``: outside it (norm inputs, residual stream, dropout masks, the inputs of the
  column-parallel linears): whole on every tensor-parallel rank, divided by t only under
  sequence parallelism;
- ``core``: attention-core internals (scores, softmax, its dropout; a fused kernel's
  log-sum-exp), inside the split region: what Megatron-LM's selective recomputation frees;
- ``expert_split`` / ``expert_whole``: the same inside routed experts, whose token count is
  scaled by the router's load assumption (`remat.estimate.parallel.Parallelism.expert_load`);
- ``unsharded``: whole on every tensor-parallel rank even under sequence parallelism (an
  attention mask made a bias for the fused kernel: attention runs on the gathered sequence, and
  the mask has no head dimension to split), divided by context parallelism only.

A traced quantity is affine in the micro-batch ``b`` for ``b >= 2`` (each tensor has a batch
dimension or none: position ids, causal masks), so each one is
kept as a ``per_token`` part (proportional to the tokens of the micro-batch: divided by context
parallelism, and by t under sequence parallelism when ``whole``) and a ``constant`` part (a causal
mask, rotary tables: never divided by the sequence).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

BUCKETS = ("split", "whole", "core", "expert_split", "expert_whole", "unsharded")


@dataclass(kw_only=True, frozen=True)
class Share:
    """One quantity of one segment, by bucket (see the module docstring)."""

    split: float = 0
    """Inside the tensor-parallel region."""
    whole: float = 0
    """Outside it."""
    core: float = 0
    """Attention-core internals (inside the tensor-parallel region)."""
    expert_split: float = 0
    """Inside routed experts, inside the tensor-parallel region."""
    expert_whole: float = 0
    """Inside routed experts, outside it (dispatched tokens)."""
    unsharded: float = 0
    """Whole under tensor and sequence parallelism (an attention mask's bias)."""

    @property
    def total(self) -> float:
        return self.split + self.whole + self.core + self.expert_split + self.expert_whole + self.unsharded

    def divided(self, *, tensor: int, sequence: int, context: int, expert_load: float) -> float:
        """This share on one GPU: split buckets over ``tensor``, whole ones over ``sequence``
        (t under sequence parallelism, else 1), everything over ``context``, experts' buckets
        times ``expert_load``."""
        inside = (self.split + self.core + expert_load * self.expert_split) / tensor
        outside = (self.whole + expert_load * self.expert_whole) / sequence
        return (inside + outside + self.unsharded) / context

    def without_core(self) -> Share:
        return dataclasses.replace(self, core=0)


@dataclass(kw_only=True, frozen=True)
class Segment:
    """A segment's shares at one micro-batch."""

    saved: Share
    """Bytes of the storages autograd saves first in this segment."""
    flops: Share
    """Forward FLOPs."""
    bwd_flops: Share = Share()
    """Backward FLOPs: one product per gradient a linear gives, none where no gradient is needed
    (`remat.estimate.dataflow._backward_flops`)."""
    dequant_bytes: float = 0
    """Bytes the forward's dequantizations of weights read and write (NF4 base weights,
    `remat.models.qlora`): memory-bound, once in the forward, once in the backward, once more in a
    replay."""
    input_bytes: float = 0
    """A layer's own input (the hidden states it is called with; shared tensors excluded), and
    ``kept_bytes``."""
    kept_bytes: float = 0
    """What a stack's first layer holds for the layers after it, in its saved bytes (where autograd
    saves it) and in its input (what its checkpoint keeps), alive through its own backward: an
    encoder's output and what runs between two stacks, a position bias every layer of a stack
    adds (`remat.estimate.dataflow`)."""
    core_moved_bytes: float = 0
    """Bytes the attention core's ops write in forward (what replaying it moves at least)."""
    working_bytes: float = 0
    """What the segment's backward needs on top of what is held: its saved bytes and backward
    temporaries (`remat.plan.costs.working_bytes`; after the layers, the head's temporaries)."""
    replay_working_bytes: float = 0
    """The same when its forward is replayed in backward (`remat.plan.costs.replay_working_bytes`)."""
    forward_working_bytes: float = 0
    """What its own forward needs above what is live before it, kept: its saved bytes and forward
    temporaries (`remat.plan.phases.forward_phase_bytes`). Above its backward's where the forward
    makes more than it keeps (LoRA's dropout: the adapter's dropped input and mask, per linear)."""
    forward_peak_bytes: float = 0
    """The part before the layers: the peak of its forward above the model state
    (`remat.measure.types.Profile.fixed_pre_fwd_bytes`: what it saves and its temporaries, such as
    TAPAS's table-cell positions)."""
    released: Share = Share()
    """A layer: of the part before the layers' saved bytes, what this layer's backward frees: the
    tensors made before it that it is the first layer to save or to take (a mask, an encoder's
    output its cross-attention saves), and what the code between two stacks that runs before it
    saved (a decoder's embeddings). Live from the forward to the end of that backward; the part's
    own backward, after every layer's, holds none of it."""
    released_unsaved: Share = Share()
    """Of ``released``, the tensors no op saves (a mask the attention kernel reads): nothing holds
    them past the forward but a layer's checkpoint (`remat.plan.predict.dead_shared_bytes`)."""
    first_saved_bytes: float = 0
    """A layer: of the saved bytes its trace measured (`remat.measure.types.BlockProfile.saved_bytes`,
    in its working sets), the shared tensors it is the first layer to save, counted in the part
    before the layers (in ``released``): a mask every layer saves, in a text encoder's first layer,
    traced apart."""
    first_entry_bytes: float = 0
    """A layer: the shared tensors no op saves that it takes first and a later layer takes too,
    counted in the part before the layers and in its measured entry bytes (in its working sets,
    `remat.measure.types.BlockProfile.shared_entry_bytes`)."""
    first_alone_bytes: float = 0
    """A layer: the shared tensors no op saves that it alone takes, counted in the part before the
    layers and in what its checkpoint holds as measured (in its replay's working set,
    `remat.measure.types.BlockProfile.unsaved_input_bytes`)."""


@dataclass(kw_only=True, frozen=True)
class Flow:
    """A model's segments at one micro-batch: before the layers, each traced layer, after them."""

    pre: Segment
    """Embeddings, plus tensors made before the layers and held for the whole backward (rotary
    tables, masks, position ids passed to every layer: counted once, not per layer)."""
    layers: tuple[Segment, ...]
    """Each traced layer, in forward order."""
    post: Segment
    """Final norm, head and loss."""


@dataclass(kw_only=True, frozen=True)
class Split:
    """A flow at some micro-batch as a per-token part and a constant part."""

    per_token: Flow
    """Proportional to the micro-batch's tokens."""
    constant: Flow
    """Independent of the micro-batch (and of the sequence split)."""


def combine(a: T, b: T, fn: Callable[[float, float], float]) -> T:
    """``fn`` field by field over two alike trees of Share/Segment/Flow (tuples element-wise)."""
    if isinstance(a, (int, float)):
        return fn(a, b)  # type: ignore[return-value]
    if isinstance(a, tuple):
        return tuple(combine(x, y, fn) for x, y in zip(a, b, strict=True))  # type: ignore[return-value]
    values: dict[str, Any] = {f.name: combine(getattr(a, f.name), getattr(b, f.name), fn) for f in dataclasses.fields(a)}
    return type(a)(**values)


def scale(a: T, k: float) -> T:
    """Every number of the tree times ``k``."""
    return combine(a, a, lambda x, _: x * k)


def split_by_tokens(one: Flow | None, two: Flow, three: Flow, micro_batch: int, *, first: int = 2) -> Split:
    """The flow at ``micro_batch`` from flows traced at micro-batch ``first`` and ``first + 1``
    (``two``, ``three``; and ``one``, traced at a micro-batch below the line, needed only when
    ``micro_batch`` is below ``first``): the line through the two gives the constant part (its
    value at 0) and every micro-batch from ``first`` on. Micro-batch 1 is traced on its own: with
    a batch dimension of 1, PyTorch's ``reshape`` of a transposed tensor is a view instead of a
    copy, so other ops run and the bytes per op are not on the line. Where micro-batch 2 is off
    the line through 3 and 4 too (SigLIP's layers' backward), the line starts at 3 (``first=3``)
    and micro-batch 2 is its own trace (`line_starts`)."""
    constant = combine(two, three, lambda a, b: (first + 1) * a - first * b)
    if micro_batch < first:
        if one is None:
            raise ValueError(f"micro-batch {micro_batch} needs its own trace; pass the flow traced at it.")
        at = one
    else:
        at = combine(two, three, lambda a, b: a + (b - a) * (micro_batch - first))
    return Split(per_token=combine(at, constant, lambda x, k: x - k), constant=constant)


def on_one_line(two: Flow, three: Flow, four: Flow) -> bool:
    """True when every number of the flows traced at micro-batches 2, 3 and 4 lies on one line."""
    flat: list[float] = []
    combine(combine(two, three, lambda a, b: b - a), combine(three, four, lambda a, b: b - a),
            lambda x, y: flat.append(x - y) or 0.0)
    return all(abs(d) < 1e-6 for d in flat)


def untokenized(flow: Flow) -> Split:
    """A flow traced at one fixed batch (a file model's), all of it taken as per-token."""
    return Split(per_token=flow, constant=scale(flow, 0.0))


__all__ = ["BUCKETS", "Flow", "Segment", "Share", "Split", "combine", "on_one_line", "scale", "split_by_tokens",
           "untokenized"]
