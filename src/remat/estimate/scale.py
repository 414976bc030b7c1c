"""From a profile traced on a few layers at micro-batch 1 and 2 to any layer count and micro-batch.

- Layers: the traced model has ``k`` identical layers (``k`` >= 2, so a layer's input is the
  previous layer's output, as in the full model). Every layer of the full model is a copy of
  the last traced layer; the fixed part (embeddings, head, loss) is traced as is. This is
  exact for models whose layers are identical (GPT, Llama, Mistral), up to the first layer's
  backward temporaries (the copy's may be larger: the first layer's input may need no
  gradient); `check_alike` refuses a trace whose layers run different ops.
- Micro-batch: every byte and FLOP count of one step is affine in the micro-batch size ``b``
  for ``b >= 2`` (each tensor has a batch dimension or none: position ids, causal masks), so
  traces at ``b = 2`` and ``b = 3`` give every count at any ``b >= 2`` exactly:
  ``f(b) = f(2) + (f(3) - f(2)) (b - 2)``. ``b = 1`` is traced on its own: with a batch
  dimension of 1, PyTorch's ``reshape`` of a transposed tensor is a view instead of a copy
  (an explicit attention's matmuls save views of the QKV output instead of copies of Q, K
  and V), so ``b = 1`` runs other ops and its per-op records are not on the line.
- Time on a device: FLOPs at a stated MFU (backward = 2 x forward, the usual count for matmuls:
  one product for the input gradient, one for the weight gradient), and the optimizer step
  at memory bandwidth (it reads and writes every state byte once). A replayed op (selective
  recomputation) costs at least reading and writing its output at memory bandwidth.
"""

from __future__ import annotations

from dataclasses import replace

from remat.measure.types import BlockProfile, OpRecord, Profile

_BLOCK_INT_FIELDS = ("input_bytes", "output_bytes", "saved_bytes", "bwd_temp_bytes", "fwd_flops")
_OP_INT_FIELDS = ("output_bytes", "saved_bytes", "flops")
_PROFILE_INT_FIELDS = ("fixed_pre_saved_bytes", "fixed_post_saved_bytes", "fixed_post_bwd_temp_bytes", "fixed_flops")


def check_alike(profile: Profile) -> None:
    """Raise if the last two traced layers run different ops (then copying one is wrong).

    Bytes may differ between the first layer and the others: tensors made before the layers
    and shared by all of them (rotary tables, masks) are counted by the first layer that saves
    them; `replicate_blocks` keeps the first layer as traced for that reason.
    """
    if profile.num_blocks < 2:
        raise ValueError(f"the trace has {profile.num_blocks} block(s); trace at least 2 identical layers.")
    first, last = profile.blocks[-2], profile.blocks[-1]
    if first.fwd_flops != last.fwd_flops or [op.name for op in first.ops] != [op.name for op in last.ops]:
        raise ValueError(
            f"traced layers {first.name!r} and {last.name!r} run different ops ({len(first.ops)} vs "
            f"{len(last.ops)} calls, {first.fwd_flops} vs {last.fwd_flops} FLOPs); estimate copies one layer and "
            "needs identical layers. Estimate such a model from a file.py:build that builds all of it."
        )


def replicate_blocks(profile: Profile, num_layers: int, *, name_format: str | None = None) -> Profile:
    """The profile with ``num_layers`` copies of its last block (indices and names renumbered).

    What the first traced layer saves beyond the last one (tensors made before the layers and
    shared by all, such as rotary tables, which the first layer saves first) moves to the fixed
    part before the blocks: it lives from the forward of the first layer to the end of the
    backward, as that part does. All layers then look alike to the planner, whose exact search
    is much faster for alike layers.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}.")
    template = profile.blocks[-1]
    prefix = template.name.rsplit(".", 1)[0] if "." in template.name else template.name
    fmt = name_format or prefix + ".{}"
    shared = max(0, profile.blocks[0].saved_bytes - template.saved_bytes)
    blocks = tuple(replace(template, index=i, name=fmt.format(i)) for i in range(num_layers))
    return replace(profile, blocks=blocks, timeline=(), fixed_pre_saved_bytes=profile.fixed_pre_saved_bytes + shared)


BASE_MICRO_BATCH = 2
"""The first of the two traced micro-batches the line goes through (the second is one more)."""


def _affine(one: int, two: int, micro_batch: int) -> int:
    return one + (two - one) * (micro_batch - BASE_MICRO_BATCH)


def _scale_op(one: OpRecord, two: OpRecord, micro_batch: int) -> OpRecord:
    return replace(one, **{f: _affine(getattr(one, f), getattr(two, f), micro_batch) for f in _OP_INT_FIELDS})


def _scale_block(one: BlockProfile, two: BlockProfile, micro_batch: int) -> BlockProfile:
    if [op.key for op in one.ops] != [op.key for op in two.ops]:
        raise ValueError(
            f"block {one.name!r} runs different ops at micro-batch 2 and 3; its memory is not affine in the "
            "micro-batch, so estimate cannot extrapolate it. Estimate at the micro-batch you need."
        )
    ops = tuple(_scale_op(a, b, micro_batch) for a, b in zip(one.ops, two.ops))
    values = {f: _affine(getattr(one, f), getattr(two, f), micro_batch) for f in _BLOCK_INT_FIELDS}
    return replace(one, ops=ops, **values)


def at_micro_batch(one: Profile, two: Profile, micro_batch: int) -> Profile:
    """The profile at ``micro_batch`` >= 2 from profiles of the same model at micro-batch 2 and 3."""
    if micro_batch < BASE_MICRO_BATCH:
        raise ValueError(f"micro_batch must be >= {BASE_MICRO_BATCH} to extrapolate, got {micro_batch}.")
    if one.num_blocks != two.num_blocks:
        raise ValueError(f"profiles have {one.num_blocks} and {two.num_blocks} blocks; trace the same model twice.")
    blocks = tuple(_scale_block(a, b, micro_batch) for a, b in zip(one.blocks, two.blocks))
    values = {f: _affine(getattr(one, f), getattr(two, f), micro_batch) for f in _PROFILE_INT_FIELDS}
    return replace(one, blocks=blocks, **values)


def forward_flops(profile: Profile) -> int:
    """Forward FLOPs of one micro-batch: blocks plus fixed part."""
    return profile.fixed_flops + sum(b.fwd_flops for b in profile.blocks)


def timed_for_device(
    profile: Profile, *, flops_per_s: float, optimizer_ms: float, memory_bytes_per_s: float | None = None
) -> Profile:
    """The profile with every time derived from FLOPs at ``flops_per_s`` (peak x MFU).

    An op's own time (what a selective replay of it costs) is the larger of its FLOPs at that
    rate and, when ``memory_bytes_per_s`` is given, reading and writing its output once at memory
    bandwidth: pointwise ops (norms, activations, dropout) do no matmul FLOPs but are not free.
    """
    def ms(flops: int) -> float:
        return 1e3 * flops / flops_per_s

    def op_ms(op: OpRecord) -> float:
        moved = 1e3 * 2 * op.output_bytes / memory_bytes_per_s if memory_bytes_per_s and not op.is_view else 0.0
        return max(ms(op.flops), moved)

    blocks = tuple(
        replace(b, fwd_ms=ms(b.fwd_flops), bwd_ms=2 * ms(b.fwd_flops), ops=tuple(replace(op, time_ms=op_ms(op)) for op in b.ops))
        for b in profile.blocks
    )
    fwd_ms = ms(profile.fixed_flops)
    total = fwd_ms * 3 + sum(b.fwd_ms + b.bwd_ms for b in blocks) + optimizer_ms
    return replace(profile, blocks=blocks, fixed_fwd_ms=fwd_ms, fixed_bwd_ms=2 * fwd_ms,
                   optimizer_step_ms=optimizer_ms, step_ms=total)


__all__ = ["at_micro_batch", "check_alike", "forward_flops", "replicate_blocks", "timed_for_device"]
