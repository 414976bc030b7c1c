"""Which neighbouring blocks may share a multi-block segment: the joins mask.

A checkpointed segment of several blocks runs them as a chain (`remat.apply.runtime`): block
``i+1`` from block ``i``'s output, with block ``i``'s other arguments. So blocks ``i`` and
``i+1`` may be in one segment (``joins[i]``) only when block ``i+1`` follows block ``i``
(`remat.measure.types.BlockProfile.follows_previous`: same stack, fed what block ``i`` handed on,
the same other arguments). The cost model adds three conditions, under which what a segment
holds is what its first block holds (`remat.plan.costs`): no code between them saves tensors,
block ``i+1`` takes no shared tensor first, and block ``i`` hands off nothing to anything but
block ``i+1``; no block past ``i+1`` takes block ``i``'s output (a skip, counted where block
``i+1`` holds it); and the code between them does not read block ``i``'s output (in one segment it
would run after block ``i+1``, and the gradient into that output would sum in another order); and
block ``i``'s graph holds nothing a replay would make again and hold to its end
(`remat.measure.types.BlockProfile.graph_held_storages`: a replay of several blocks measured
6-12 % above its prediction). A plan whose segment crosses a break is refused (`check_joins`); the planners
never make one.
"""

from __future__ import annotations

from collections.abc import Iterable

from remat.measure.types import BlockProfile, Profile
from remat.plan.types import Segment

__all__ = ["joins", "chain_runs", "check_joins", "break_reason", "skip_takers"]


def joins(profile: Profile) -> tuple[bool, ...]:
    """``joins[i]``: blocks ``i`` and ``i+1`` may be in one multi-block segment (N-1 entries)."""
    blocks = profile.blocks
    skips = skip_takers(profile)
    return tuple(break_reason(blocks[i], blocks[i + 1], skips.get(i, ())) is None for i in range(len(blocks) - 1))


def skip_takers(profile: Profile) -> dict[int, tuple[int, ...]]:
    """Block ``i`` -> the blocks past ``i + 1`` that take one of its outputs as an argument (a
    U-Net's decoder taking an encoder block's output as its skip)."""
    out: dict[int, set[int]] = {}
    for block in profile.blocks:
        for arg in block.inputs:
            if arg.source.startswith("block:") and (k := int(arg.source[6:])) < block.index - 1:
                out.setdefault(k, set()).add(block.index)
    return {k: tuple(sorted(v)) for k, v in out.items()}


def break_reason(previous: BlockProfile, block: BlockProfile, skip_takers: tuple[int, ...] = ()) -> str | None:
    """Why ``block`` cannot share a segment with the block before it, or None when it can
    (``skip_takers``: the later blocks that take an output of ``previous``, `skip_takers`)."""
    if skip_takers:
        # the memory model counts such a skip where the block after ``previous`` holds it (it saves it
        # kept, its checkpoint holds it recomputed); inside a segment neither does, and a recomputed
        # taker's checkpoint holds it uncounted (a U-Net: 10-27 % over the prediction)
        return (f"the previous block's output is taken by block(s) {list(skip_takers)} too (a skip "
                "connection), which the memory model counts where this block holds it")
    if block.stack != previous.stack:
        return f"they belong to different stacks ({previous.stack!r}, {block.stack!r})"
    if not block.follows_previous:
        return ("the model does not call it with the previous block's output and the same other "
                "arguments")
    if block.between_saved_bytes:
        return f"code between them saves {block.between_saved_bytes} bytes for backward"
    if block.shared_entry_bytes:
        return f"it is the first to take a shared tensor of {block.shared_entry_bytes} bytes"
    if previous.handoff_bytes != previous.handoff_next_bytes:
        return "the previous block's output is held further on (a skip connection)"
    if previous.graph_held_bytes:
        return (f"the previous block's autograd graph holds {previous.graph_held_bytes} bytes no checkpoint drops (a custom "
                "autograd.Function's ctx attributes), which a replay makes again and holds until it ends")
    if previous.output_read_aside:
        return ("the code between them reads the previous block's output (a side output): in one segment it "
                "would run after this block, and the two gradients into that output would sum in another order")
    return None


def chain_runs(profile: Profile) -> list[tuple[int, int]]:
    """Maximal ranges ``[a, b)`` of blocks whose neighbours all join."""
    runs, start = [], 0
    for i, ok in enumerate(joins(profile)):
        if not ok:
            runs.append((start, i + 1))
            start = i + 1
    if profile.num_blocks:
        runs.append((start, profile.num_blocks))
    return runs


def check_joins(profile: Profile, segments: Iterable[Segment]) -> None:
    """Refuse a segment (or nested child) that runs several blocks across a break (keep
    segments run their blocks as the model calls them and may span anything)."""
    _check_joins(profile, joins(profile), skip_takers(profile), segments)


def _check_joins(profile: Profile, mask: tuple[bool, ...], skips: dict[int, tuple[int, ...]],
                 segments: Iterable[Segment]) -> None:
    for seg in segments:
        if seg.kind != "keep":
            for i in range(seg.start, seg.stop - 1):
                if not mask[i]:
                    reason = break_reason(profile.blocks[i], profile.blocks[i + 1], skips.get(i, ()))
                    raise ValueError(
                        f"segment [{seg.start}, {seg.stop}) ({seg.strategy}) runs blocks {i} and {i + 1} "
                        f"({profile.blocks[i].name!r}, {profile.blocks[i + 1].name!r}) as one chain, but "
                        f"{reason}. Split the segment at block {i + 1}; remat.plan never crosses it."
                    )
        _check_joins(profile, mask, skips, seg.children)
