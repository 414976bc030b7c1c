"""What a block needs in each phase of the step, on top of what the blocks before it hold.

The byte terms `remat.plan.costs` combines per strategy (../DESIGN.md "The memory model"): a
kept block's backward (`working_bytes`) and forward (`keep_working_bytes`: the larger), a
replayed block's backward (`replay_working_bytes`), the backward of the code run before a block
(`between_phase_bytes`), the head's backward (`post_working_bytes`), and the gradients live
when a block's backward starts (`grad_bytes_live`). Each reads the block's measured windows and
its dataflow terms (`remat.measure.dataflow`): ``entry_bytes`` are live through every phase of
the block whatever the plan, the inputs it saves itself were live before its forward began.
"""

from __future__ import annotations

from collections.abc import Sequence

from remat.measure.types import BlockProfile, Profile

__all__ = [
    "held_input_bytes", "held_bwd_temp_bytes", "between_phase_bytes", "working_bytes", "saved_input_bytes", "replay_base_bytes",
    "replay_working_bytes", "replayed_forward_bytes", "replay_stop", "stopped_replay_working_bytes", "stopped_replay_ms",
    "stopped_replay_flops", "forward_phase_bytes", "keep_working_bytes", "keep_forward_bytes", "unit_extra_bytes",
    "segment_forward_bytes", "checkpointed_forward_peak", "code_held_bytes", "code_held_input_bytes", "previous_held_bytes", "later_held_bytes", "held_twice_bytes",
    "released_grad_bytes", "grad_bytes_live", "post_working_bytes",
]


def held_input_bytes(block: BlockProfile) -> int:
    """What a checkpoint of the block holds of its own inputs (`BlockProfile.held_input_bytes`;
    all of ``input_bytes`` in profiles recorded without the dataflow)."""
    return block.input_bytes if block.held_input_bytes is None else block.held_input_bytes


def between_phase_bytes(block: BlockProfile) -> int:
    """What the backward of the code run before the block needs on top of the blocks before it:
    its saved bytes and what the block before handed off (in ``entry_bytes``), its temporaries,
    and the block's own gradients, accumulated by then (0 when no such backward was measured)."""
    if not block.between_bwd_temp_bytes:
        return 0
    return block.entry_bytes + block.between_bwd_temp_bytes + block.grad_bytes


def working_bytes(block: BlockProfile) -> int:
    """Bytes a kept block's backward needs: its saved bytes plus its backward temporaries, plus
    its ``entry_bytes`` (live through its backward, outside its own window's measurement), and at
    least `between_phase_bytes`.

    A block's input it saves itself is among its saved bytes; one it does not save is not live
    in its backward when kept."""
    return max(block.saved_bytes + block.bwd_temp_bytes + block.entry_bytes, between_phase_bytes(block))


def saved_input_bytes(block: BlockProfile) -> int:
    """Its held inputs it saves itself: live before its forward begins, so its forward
    temporaries (measured from there) leave them out although its saved bytes count them."""
    return 0 if block.held_input_bytes is None else block.held_input_bytes - block.unsaved_input_bytes


def replay_base_bytes(block: BlockProfile) -> int:
    """What is live beside a replay of the block, before it starts: the gradient of its output
    and what else the step holds when its backward first reads a tensor it saved
    (``bwd_start_temp_bytes``: GPT-OSS's routed outputs' gradient, made before; 8 KiB more
    than the output's gradient in BERT's backward, 4 bytes under a ``sum`` loss, whose gradient
    is a broadcast scalar); its output's bytes in profiles recorded without it."""
    return block.output_grad_bytes if block.bwd_start_temp_bytes is None else block.bwd_start_temp_bytes


def replay_working_bytes(block: BlockProfile, first: bool = True, forward_held: int = 0) -> int:
    """Bytes a block needs when its forward is replayed in backward: its saved bytes plus the
    larger of its backward temporaries and its forward temporaries on top of what is live when
    its backward starts (`replay_base_bytes`: the replay's peak; the forward temporaries are
    measured from the forward's start, when the inputs it saves already existed:
    `saved_input_bytes` are added back, 17 KiB of GPT-NeoX's replay); plus its ``entry_bytes``
    and the inputs its checkpoint holds that its saved bytes leave out (``unsaved_input_bytes``);
    at least `between_phase_bytes`. ``first``: the block starts the checkpoint replayed, which
    holds those inputs through its backward; after another block of the same replay
    (``first=False``) its inputs come from the replay and what it does not save of them is live
    in its forward only (an adapter's input, read by a frozen matmul and a residual add).
    ``forward_held``: bytes live beside its forward, not its backward (a nested checkpoint's
    input, which torch holds through the checkpoint's replay, not its backward)."""
    forward = block.fwd_temp_bytes + replay_base_bytes(block) + saved_input_bytes(block) + forward_held
    return _replay_need(block, forward, first)


def held_bwd_temp_bytes(block: BlockProfile) -> int:
    """The backward temporaries of a block whose checkpoint holds the inputs it saves to its
    backward's end (`BlockProfile.held_input_bwd_temp_bytes`; ``bwd_temp_bytes`` without it)."""
    return block.bwd_temp_bytes if block.held_input_bwd_temp_bytes is None else block.held_input_bwd_temp_bytes


def _replay_need(block: BlockProfile, forward: int, first: bool) -> int:
    unsaved = block.unsaved_input_bytes
    saved = block.saved_bytes + block.replay_saved_extra_bytes  # a compiled replay saves what the eager one does
    if first:  # its checkpoint holds the inputs it saves to its backward's end
        replay = saved + max(held_bwd_temp_bytes(block), forward) + unsaved
    else:
        replay = saved + max(block.bwd_temp_bytes, forward + unsaved)
    return max(replay + block.entry_bytes, between_phase_bytes(block))


def replay_stop(block: BlockProfile) -> int:
    """Op calls an early-stopping replay of the block runs when it ends its checkpoint
    (`BlockProfile.replay_stop_calls`; all of them where not recorded)."""
    return len(block.ops) if block.replay_stop_calls is None else min(block.replay_stop_calls, len(block.ops))


def stopped_replay_working_bytes(block: BlockProfile, first: bool = True, forward_held: int = 0) -> int:
    """`replay_working_bytes` of a replay that stops at `replay_stop`: its forward term is cut
    where the forward's live curve (`BlockProfile.fwd_live_bytes`) is cut, so it falls by how far
    the curve's peak after the stop rises above its peak before it (the outputs and temporaries
    made after the last save are never made). At most `replay_working_bytes`."""
    curve = block.fwd_live_bytes
    stop = replay_stop(block)
    if stop >= len(block.ops) or len(curve) != len(block.ops):
        return replay_working_bytes(block, first, forward_held)
    drop = max(0, max(curve) - max(curve[:stop], default=0))
    forward = block.fwd_temp_bytes - drop + replay_base_bytes(block) + saved_input_bytes(block) + forward_held
    return min(_replay_need(block, forward, first), replay_working_bytes(block, first, forward_held))


def stopped_replay_ms(block: BlockProfile) -> float:
    """The block's forward time up to `replay_stop`: its share of the op calls' times."""
    stop = replay_stop(block)
    total = sum(op.time_ms for op in block.ops)
    if stop >= len(block.ops) or total <= 0:
        return block.fwd_ms
    return block.fwd_ms * sum(op.time_ms for op in block.ops[:stop]) / total


def stopped_replay_flops(block: BlockProfile) -> int:
    """FLOPs of the op calls up to `replay_stop`."""
    stop = replay_stop(block)
    return block.fwd_flops if stop >= len(block.ops) else sum(op.flops for op in block.ops[:stop])


def forward_phase_bytes(block: BlockProfile) -> int:
    """What the block's own forward, kept, needs on top of the blocks before it: its entry
    bytes, the other live bytes the model's code holds then (``fwd_other_bytes``: its input
    when nothing saved it before), the graphs of blocks no backward runs still live
    (``unreached_fwd_bytes``), and its saved bytes and forward temporaries, or the peak of the
    code before it, between the block before and this one, where that is higher
    (``between_fwd_peak_bytes``, above what is live as this block starts); 0 in profiles
    recorded without ``fwd_other_bytes`` (the forward was not priced)."""
    if block.fwd_other_bytes is None:
        return 0
    return block.entry_bytes + block.fwd_other_bytes + block.unreached_fwd_bytes + max(
        block.saved_bytes + block.fwd_temp_bytes, block.between_fwd_peak_bytes)


def keep_working_bytes(profile: Profile, block_index: int) -> int:
    """A kept block's working set whatever its neighbour's strategy: its backward's, or its
    forward's at its place where that is higher (`keep_forward_bytes` with the block before it
    not kept: the most it can be; exact when that block is not kept or leaves nothing to the
    model's code). The peak of a network with few parameters, a U-Net, is often the forward of its
    last block; `remat.plan.predict` prices each kept block's forward knowing its neighbour.
    Blocks alike in structure whose working sets differ here are priced apart
    (`remat.plan.options.structure_classes`)."""
    block = profile.blocks[block_index]
    forward = keep_forward_bytes(profile, block_index, previous_kept=False) if block.fwd_other_bytes is not None else 0
    return max(working_bytes(block), forward)


def keep_forward_bytes(profile: Profile, block_index: int, previous_kept: bool) -> int:
    """A kept block's forward at its place, less the gradients its backward counts (none is
    allocated yet), with the outputs of the block before it that the code still holds when that
    block is not kept (its saved bytes hold them when it is)."""
    block = profile.blocks[block_index]
    return forward_phase_bytes(block) + previous_held_bytes(profile, block_index, previous_kept) - grad_bytes_live(profile, block_index)


def checkpointed_forward_peak(block: BlockProfile, unheld: int = 0) -> int:
    """The most a checkpointed forward of the block holds above its start, its output included
    (`BlockProfile.checkpointed_fwd_live_bytes`; without it, its forward temporaries and output)
    with the graphs of blocks no backward runs still live (``unreached_fwd_bytes``) and what the
    code holds beside (`code_held_bytes`), or the code run before it, since the block before,
    where that peaks higher (``between_fwd_peak_bytes``, above what is live as the block starts).
    ``unheld``: the shared tensors no checkpoint holds that the blocks before count (`code_held_bytes`)."""
    curve = block.checkpointed_fwd_live_bytes
    own = max(curve) if curve else block.fwd_temp_bytes + block.output_bytes
    return block.unreached_fwd_bytes + code_held_bytes(block, unheld) + max(own, block.between_fwd_peak_bytes)


def code_held_bytes(block: BlockProfile, unheld: int = 0) -> int:
    """What the model's code holds as the block starts beyond the inputs a checkpoint of it holds
    (``fwd_other_bytes`` less `held_input_bytes`): a bias the code before it made and keeps in a
    variable; live beside its forward, kept (``fwd_other_bytes`` counts it) or checkpointed. 0
    in profiles recorded without ``fwd_other_bytes``. ``unheld``: the shared tensors no
    checkpoint holds (`remat.plan.predict.dead_shared_bytes`), which the blocks before count as
    held and ``fwd_other_bytes`` takes off again where the code freed them (the forward's live
    bytes less what they count: e3nn's edge features, freed at the end of each layer's
    convolution): counted here as the code's, for the caller to take off the held bytes, as
    `remat.plan.variants` prices them."""
    if block.fwd_other_bytes is None:
        return 0
    return max(0, block.fwd_other_bytes + unheld - held_input_bytes(block))


def code_held_input_bytes(block: BlockProfile) -> int:
    """The block's input (what the block before handed on) that something besides a checkpoint
    holds past the block when it runs inside a recompute segment: the model's code through the
    backward (`BlockProfile.input_code_held_bytes`) or in the forward
    (``input_code_kept_bytes``), or the graph of code after the blocks that saves it
    (``input_saved_after_bytes``). One storage: the most of the three. The optimal search counts
    it through a segment's replay and the backward after it, a bound (`remat.plan.predict`
    counts each where it is live)."""
    return max(block.input_code_held_bytes, block.input_code_kept_bytes, block.input_saved_after_bytes)


def segment_forward_bytes(profile: Profile, start: int, stop: int, previous_kept: bool = False, unheld: int = 0) -> int:
    """The forward of a top-level recompute segment ``[start, stop)``: the model calls its first
    block, and the runtime runs every block of it then (`remat.apply.runtime`), each output held
    for the model's own call of the next block until it makes that call. So at block j the
    segment holds its input and the outputs of blocks ``start..j-1`` beside j's checkpointed
    forward. A long segment's forward, not its replays, is the peak of the least-memory plans of
    long chains: a 64-block MLP's nested least-peak plan measured 2.3x its prediction without it.
    The outputs of the block before that the code holds are live beside it unless that block is
    kept (``previous_kept``; False: a bound wherever the segment sits). ``unheld``: the shared
    tensors no checkpoint of the plan holds, first taken before the segment (`code_held_bytes`),
    counted by the bytes held before it: taken off where the code freed them by then (a
    segment starting e3nn's last layer measured 7 % under its prediction, which counted the
    previous layers' edge features in its forward; a kept block's forward was exact)."""
    first = profile.blocks[start]
    best, pending = 0, 0
    for j in range(start, stop):
        block = profile.blocks[j]
        best = max(best, pending + checkpointed_forward_peak(block, unheld))
        pending += handed_bytes(block)
    return (held_input_bytes(first) + first.entry_bytes + best + previous_held_bytes(profile, start, previous_kept)
            - unheld)


def handed_bytes(block: BlockProfile) -> int:
    """What the block's output adds while it waits for the model's next call: its output less the
    storages it returns as they came in (`BlockProfile.output_passed_bytes`, live as its inputs).
    Counted whole, a LongT5 segment of three layers was priced two position biases (1.5 MiB)
    above its measured forward: 5,754,880 bytes against 4,182,016."""
    return block.output_bytes - block.output_passed_bytes


def replayed_forward_bytes(profile: Profile, start: int, stop: int) -> int:
    """The forward of a recompute segment ``[start, stop)`` nested in a replay, above what the
    replay holds before it: its input, and at each block the checkpointed forward beside the
    block's input (the replay hands each output on and lets it go, `remat.apply.runtime`)."""
    blocks = profile.blocks
    return held_input_bytes(blocks[start]) + max(
        (blocks[j - 1].output_bytes if j > start else 0) + checkpointed_forward_peak(blocks[j]) for j in range(start, stop))


def previous_held_bytes(profile: Profile, block_index: int, previous_kept: bool) -> int:
    """The outputs of the block before ``block_index`` that the model's code still holds while
    this block's forward runs (`BlockProfile.output_held_bytes`: GPT-NeoX-Japanese's layers
    return their attention weights, and the loop's ``outputs`` holds them through the next
    layer's call), when that block is not kept: kept, its saved bytes hold them."""
    return 0 if previous_kept or not block_index else profile.blocks[block_index - 1].output_held_bytes


def later_held_bytes(profile: Profile, block_index: int, unkept: Sequence[tuple[int, frozenset[str]]]) -> int:
    """The outputs of blocks two or more before ``block_index`` that the model's code still
    holds as its forward starts (`BlockProfile.output_later_held_bytes`: x-transformers' list of
    every layer's attention scores), of the blocks in ``unkept`` (kept, their saved bytes hold
    them), each with the calls its selective strategy caches (held by its cache already)."""
    total = 0
    for j, cached in unkept:
        block = profile.blocks[j]
        if j > block_index - 2 or block.output_held_until < block_index:
            continue
        cached_held = sum(op.saved_bytes for op in block.ops if op.key in cached and op.key in block.output_later_held_calls)
        total += max(0, block.output_later_held_bytes - cached_held)
    return total


def held_twice_bytes(profile: Profile, block_index: int, holders: Sequence[int] | set[int]) -> int:
    """Inputs of earlier blocks in ``holders`` (their checkpoints hold them) that the model's code
    holds too as this block begins, so that its ``fwd_other_bytes`` counts them already
    (`BlockProfile.code_held_inputs`: x-transformers' residual attention scores, in a list and
    in the next attention layer's checkpoint): counted twice in its forward unless taken out."""
    return sum(nbytes for j, nbytes in profile.blocks[block_index].code_held_inputs if j in holders)


def unit_extra_bytes(profile: Profile, start: int, stop: int) -> int:
    """What a top-level recompute segment ``[start, stop)`` adds to every phase of its backward
    under ZeRO-3/FSDP: it is one unit (`remat.distributed.fsdp_units`: its replay runs its blocks
    together), so its blocks' weights are gathered together, where ``gathered_bytes`` counts the
    largest block's; and the units beside it, whose prefetched weights and reduce-scatter input
    it holds, are priced as large as it is (one side at either end of the chain). 0 for one
    block, and without ZeRO-3 (``unit_bytes`` empty)."""
    if stop - start < 2 or not profile.unit_bytes:
        return 0
    return unit_extra(profile.unit_bytes, start, stop)


def unit_extra(unit_bytes: Sequence[int], start: int, stop: int) -> int:
    """`unit_extra_bytes` of the blocks' unsharded weights ``unit_bytes``."""
    grown = max(0, sum(unit_bytes[start:stop]) - max(unit_bytes))
    return grown * (1 + (start > 0) + (stop < len(unit_bytes)))


def released_grad_bytes(block: BlockProfile) -> int:
    """Gradients the backward of the block and of the code before it allocate: not yet live
    while the blocks after it run their backward (the chain's per-block gradients)."""
    return block.grad_bytes + block.between_grad_bytes


def grad_bytes_live(profile: Profile, block_index: int) -> int:
    """Gradients already accumulated when block ``block_index``'s backward starts.

    The step zeroes gradients to None, so at the head's backward (``block_index ==
    num_blocks``) none exist yet: the head's own gradients are among its measured backward
    temporaries, as a block's are among its own. At block j: all but those of blocks ``<= j``,
    of the code before them (``between_grad_bytes``) and of the pre part
    (``fixed_pre_grad_bytes``); what the profile does not split out counts as live
    (conservative)."""
    if block_index >= profile.num_blocks:
        return 0
    return profile.grad_bytes - profile.fixed_pre_grad_bytes - profile.released_grad_prefix[block_index + 1]


def post_working_bytes(profile: Profile) -> int:
    """What the head's and the loss's backward needs above the blocks' retained bytes: the post
    part's saved bytes and temporaries, and what the last block handed off to it (held by the
    post part whatever the last block's strategy)."""
    handoff = profile.blocks[-1].handoff_bytes if profile.blocks else 0
    return profile.fixed_post_saved_bytes + profile.fixed_post_bwd_temp_bytes + handoff
