"""Predict peak memory and step time of a plan from a measured Profile.

The model (../DESIGN.md "The memory model"), with blocks run forward in order and backward in
reverse:

    peak = max( post phase, each block's backward, optimizer step )
    block j's backward = state + grads_j + pre_saved + sum_{i<j} retained_i + working_j
    post phase         = state + grads_N + pre_saved + sum_i retained_i + post_saved + post_bwd_temp
    optimizer step     = params + buffers + grads + optimizer state + step temporaries

``state`` is params + buffers + optimizer state; ``grads_j`` the gradients accumulated when
block j's backward starts (`grad_bytes_live`; the measured backward temporaries hold the
gradients a block's own backward computes).
A recomputed segment holds its input; while backward is inside it, the segment is replayed and
its blocks hold what its *children* layout says (uncovered blocks keep their saved bytes), so
the same sum applies one nesting level down. Each refinement lives in one function:
backward temporaries in `remat.plan.phases.working_bytes`, gradients in `grad_bytes_live`,
per-strategy terms (incl. offload in flight) in the cost registry.

The post phase's bytes depend on the plan's head strategy (keep, recompute, chunked: output
projection and loss); `remat.plan.head.priced_profile` writes them into the profile's post
part before the sum above.

Step time = baseline forward + backward + optimizer step + the extra time of every block cost
(one replay per recompute nesting level; selective: the ops it does not save; offload: exposed
transfer) and of the head strategy (`remat.plan.head.head_extra_ms`), less the fresh memory the
plan no longer faults in (`fresh_memory`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from remat.measure.types import BlockProfile, Profile
from remat.plan.chain_dp import deep_recursion
from remat.plan.costs import cached_held_bytes, cached_ops, cached_storages, call_storages, cost_of, selective_cost
from remat.plan.phases import (code_held_bytes, grad_bytes_live, held_twice_bytes, keep_forward_bytes, later_held_bytes,
                               post_working_bytes, previous_held_bytes, replay_base_bytes, replayed_forward_bytes,
                               replay_working_bytes, segment_forward_bytes, stopped_replay_working_bytes, unit_extra_bytes,
                               working_bytes)
from remat.plan.head import head_extra_flops, head_extra_ms, priced_profile
from remat.plan.joins import check_joins
from remat.plan.policies import op_storages
from remat.plan.types import Plan, Prediction, Segment
from remat.plan.variants import cached_shared_profile, resaved_profile, revived_profile

__all__ = ["predict", "check_profile", "extra_ms", "pre_forward_phase_bytes", "optimizer_phase_bytes", "pre_backward_phase_bytes", "layout_peak", "dead_shared_bytes", "baseline_step_ms", "fresh_memory", "keep_peak_bytes", "backward_base_bytes", "grad_bytes_live", "check_segments", "stored_held_bytes", "post_code_held_saving", "saved_after_bytes"]


@dataclass(kw_only=True, frozen=True)
class _Peak:
    """Highest point of one layout's backward, relative to what was live before it."""

    bytes: int
    block: int
    working_bytes: int


def check_profile(profile: Any, where: str) -> None:
    """TypeError naming what was passed where a `Profile` goes (``remat.<where>``'s first argument)."""
    if not isinstance(profile, Profile):
        raise TypeError(f"remat.{where} needs the remat Profile of a model, got {type(profile).__name__}; make one with "
                        "remat.profile(model, batch, loss_fn, optimizer) or load one with remat.Profile.load(path).")


def predict(profile: Profile, plan_or_segments: Plan | tuple[Segment, ...] | list[Segment],
            head: str = "keep") -> Prediction:
    """Predicted peak bytes, step time and breakdown of a plan (or of top-level segments with
    the head strategy ``head``; a plan carries its own)."""
    check_profile(profile, "predict")
    if isinstance(plan_or_segments, Plan):
        segments, head = plan_or_segments.segments, plan_or_segments.head
    else:
        segments = tuple(plan_or_segments)
    with deep_recursion(profile.num_blocks):
        return _predict(profile, segments, head)


def _predict(profile: Profile, segments: tuple[Segment, ...], head: str) -> Prediction:
    check_segments(profile, segments)
    # shared tensors a selective block's cache holds, counted there alone
    profile, cached = cached_shared_profile(profile, {seg.start: cached_storages(profile.blocks[seg.start], seg.saved_ops)
                                                      for seg in segments if seg.kind == "selective"})
    # shared tensors the code freed before a block's forward, kept alive there by a checkpoint of this
    # plan or a cache
    profile = revived_profile(profile, checkpoint_held_storages(profile, segments) | cached)
    # shared tensors a later block saves first, in the forwards after it where this plan does not keep it
    profile = resaved_profile(profile, {i for seg in _fill_gaps(segments, 0, profile.num_blocks) if seg.kind == "keep"
                                        for i in range(seg.start, seg.stop)})
    # the post part's bytes under the head strategy; what the plan's recomputed blocks leave held
    # by the code goes in the head's forward where the profile has a head part, else in the post
    # part's forward, split at the model's return (`_peak_phases`)
    end, begin = end_held_bytes(profile, segments), end_held_bytes(profile, segments, at_post=True)
    priced = priced_profile(profile, head, begin)
    _, phases, retained, inner = _peak_phases(priced, segments, (0, 0) if profile.head is not None else (begin, end),
                                              post_code_held_saving(profile, segments))
    phase = max(phases, key=lambda name: phases[name])
    extra_ms, extra_flops, offloaded = _extras(profile, segments)
    extra_ms, extra_flops = extra_ms + head_extra_ms(profile, head), extra_flops + head_extra_flops(profile, head)
    faulted, saving = fresh_memory(profile, phases[phase], offloaded)
    return Prediction(
        peak_bytes=phases[phase],
        step_ms=baseline_step_ms(profile) + extra_ms - saving,
        fault_bytes=faulted,
        fault_saving_ms=saving,
        extra_flops=extra_flops,
        extra_ms=extra_ms,
        model_state_bytes=profile.model_state_bytes,
        fixed_bytes=_fixed_at(priced, phase),
        retained_bytes=retained,
        peak_block=inner.block if phase == "block" else -1,
        peak_phase=phase,
        working_bytes=inner.working_bytes if phase == "block" else 0,
        offloaded_bytes=offloaded,
    )


def _peak_phases(profile: Profile, segments: tuple[Segment, ...],
                 post_extra: tuple[int, int] = (0, 0), post_saving: int = 0) -> tuple[int, dict[str, int], tuple[int, ...], _Peak]:
    """(peak, bytes per phase, retained bytes per block, the block phase's peak); ``post_extra``:
    bytes the code holds beyond the profile's post part as the post part's forward begins and as
    the model returns (`end_held_bytes`). Where the profile has the post forward's peaks (to the
    model's return and to the loss), each is counted in its own; else through the post phase
    whole, a bound. ``post_saving``: what the post part's need counts of the arguments this
    plan's checkpoints hold (`post_code_held_saving`), left out of it."""
    retained = _top_retained(profile, segments)
    base = backward_base_bytes(profile)
    dead = dead_shared_bytes(profile, segments)
    stored = [a + b for a, b in zip(stored_held_bytes(profile, segments), cached_escaping_bytes(profile, segments))]
    inner = layout_peak(profile, segments, 0, profile.num_blocks, dead=dead, stored=stored)
    held = (base - profile.block_gathered_bytes  # FSDP2: not held through the head's backward
            + grad_bytes_live(profile, profile.num_blocks) + profile.fixed_pre_saved_bytes + sum(retained)
            - (dead[-1] if dead else 0) + stored[-1] + saved_after_bytes(profile, segments, profile.num_blocks))
    post = held + post_working_bytes(profile) - post_saving - _post_gone_bytes(profile, segments)
    begin, end = post_extra
    if begin and profile.fixed_post_fwd_bytes:  # held by the code through the post part's forward only
        loss, model = profile.fixed_post_fwd_bytes, profile.fixed_post_model_fwd_bytes
        if profile.fixed_post_loss_fwd_bytes is not None and profile.fixed_post_loss_fwd_bytes <= model:
            # the forward peaks before the return: the arguments this plan's checkpoints hold that the
            # code holds too are counted once there (`post_code_held_saving`, a saving that peak bounds)
            loss, model = profile.fixed_post_loss_fwd_bytes, model - post_saving
            if begin < 0 and profile.fixed_post_bwd_own_temp_bytes is not None:
                # a selective block caches what the code holds to the return: the forward's peak, in
                # the post part's need, comes down; its backward's and the loss's forward's do not
                post += profile.fixed_post_bwd_own_temp_bytes - profile.fixed_post_bwd_temp_bytes
        held += profile.blocks[-1].handoff_bytes if profile.blocks else 0
        post = max(post, held + model + begin, held + loss + end)
    else:  # the post part's need is its backward's too, where the code holds nothing of a cache
        post += max(begin, 0)
    phases = {
        "block": base + profile.fixed_pre_saved_bytes + inner.bytes,
        "post": post,
        "optimizer": optimizer_phase_bytes(profile),
        "pre-forward": pre_forward_phase_bytes(profile),
        "pre-backward": pre_backward_phase_bytes(profile),
    }
    return max(phases.values()), phases, retained, inner


def _post_gone_bytes(profile: Profile, segments: tuple[Segment, ...]) -> int:
    """What the kept blocks' retained bytes count that the post part's backward does not hold
    (`BlockProfile.saved_dead_bytes`): live through its forward, whose measured peak leaves the
    blocks' saved bytes out, so counted off only as far as its backward's need exceeds its
    forward's. 0 with a head part (its need is priced from the head's own measurements) or where
    the post part's forward was not measured."""
    if profile.head is not None or not profile.fixed_post_fwd_bytes:
        return 0
    gone = sum(profile.blocks[seg.start].saved_dead_bytes for seg in _fill_gaps(segments, 0, profile.num_blocks)
               if seg.kind == "keep")
    backward = profile.fixed_post_saved_bytes + profile.fixed_post_bwd_temp_bytes
    return min(gone, max(0, backward - profile.fixed_post_fwd_bytes))


def fresh_memory(profile: Profile, peak_bytes: int, offloaded_bytes: int = 0) -> tuple[int, float]:
    """(bytes a step with this peak faults in fresh, ms it saves against the baseline).

    The baseline step faults in ``profile.step_fault_bytes`` (measured: the part of its
    high-water mark the host allocator had returned to the kernel, in the least faulting of the
    profile's timed steps, `remat.measure.timing.steady_fault_bytes`); a plan whose peak is lower
    by D reaches D bytes less far and faults in D fewer (never fewer than none), each saving
    ``profile.first_touch_ms_per_byte`` (`remat.measure.faults`). The replayed forwards reuse
    memory the backward has just freed and fault nothing; offloaded tensors come back into new
    read buffers, so the part of D they account for (``offloaded_bytes``) saves nothing. 0 on
    CUDA (a caching allocator)."""
    if not profile.step_fault_bytes or not profile.first_touch_ms_per_byte:
        return profile.step_fault_bytes, 0.0
    lower = keep_peak_bytes(profile) - peak_bytes - offloaded_bytes
    avoided = min(profile.step_fault_bytes, max(0, lower))
    return profile.step_fault_bytes - avoided, avoided * profile.first_touch_ms_per_byte


_KEEP_PEAKS: dict[int, tuple[Profile, int]] = {}


def keep_peak_bytes(profile: Profile) -> int:
    """Predicted peak without recomputation (cached by profile identity)."""
    hit = _KEEP_PEAKS.get(id(profile))
    if hit is not None and hit[0] is profile:
        return hit[1]
    if len(_KEEP_PEAKS) > 64:
        _KEEP_PEAKS.clear()
    keep = tuple(Segment(start=i, stop=i + 1, strategy="keep") for i in range(profile.num_blocks))
    with deep_recursion(profile.num_blocks):
        peak = _peak_phases(priced_profile(profile), keep)[0]
    _KEEP_PEAKS[id(profile)] = (profile, peak)
    return peak


def baseline_step_ms(profile: Profile) -> float:
    """Forward + backward of blocks and fixed part, plus the optimizer step."""
    blocks_ms = sum(b.fwd_ms + b.bwd_ms for b in profile.blocks)
    return profile.fixed_fwd_ms + profile.fixed_bwd_ms + blocks_ms + profile.optimizer_step_ms


def backward_base_bytes(profile: Profile) -> int:
    """Model state live during the whole backward: params, buffers, optimizer state, under
    ZeRO-3/FSDP the largest unit's all-gathered weights and gradients (`remat.distributed`), and
    under gradient accumulation every gradient (`remat.measure.types.with_grad_accumulation`)."""
    return (profile.param_bytes + profile.buffer_bytes + profile.optimizer_state_bytes + profile.gathered_bytes
            + profile.bucket_bytes
            + profile.accumulated_grad_bytes)


def optimizer_phase_bytes(profile: Profile) -> int:
    """The optimizer's step: model state, what the step leaves on the model (`Profile.step_held_bytes`)
    and the step's temporaries; no plan changes it."""
    return profile.model_state_bytes + profile.step_held_bytes + profile.optimizer_step_temp_bytes


def pre_forward_phase_bytes(profile: Profile) -> int:
    """The forward before the first block: model state without gradients (none yet after
    ``zero_grad(set_to_none=True)``) and the pre part's own peak; no plan changes it."""
    return backward_base_bytes(profile) + profile.fixed_pre_fwd_bytes


def pre_backward_phase_bytes(profile: Profile) -> int:
    """The backward of the part before the first block (a stem), after every block's: model
    state, every gradient but the pre part's own (less those already whole as it begins,
    `Profile.fixed_pre_early_grad_bytes`), its saved bytes and its backward's peak; no plan
    changes it (0 where it was not measured)."""
    if not profile.fixed_pre_bwd_temp_bytes:
        return 0
    return (backward_base_bytes(profile) + profile.grad_bytes - profile.fixed_pre_grad_bytes
            + profile.fixed_pre_early_grad_bytes + profile.fixed_pre_saved_bytes + profile.fixed_pre_bwd_temp_bytes)


def _fixed_at(profile: Profile, phase: str) -> int:
    if phase == "post":
        return profile.fixed_pre_saved_bytes + profile.fixed_post_saved_bytes
    return profile.fixed_pre_saved_bytes if phase in ("block", "pre-backward") else 0


def end_held_bytes(profile: Profile, segments: tuple[Segment, ...], at_post: bool = False) -> int:
    """Outputs the model's code holds to its return (`BlockProfile.output_end_held_bytes`:
    ``output_attentions=True``'s weights), or as the post part's forward begins (``at_post``,
    `BlockProfile.output_post_held_bytes`: also a list of every layer's attention scores the
    forward drops as it returns), of the blocks not kept: a kept block's saved bytes hold them
    already. A Llama recomputing three of four layers with its attention weights returned measured
    10.7 % above its prediction at the head's forward before; a recomputed stack keeping its
    scores in a list, 4 % at the head's projection. Less what selective blocks cache of all the
    outputs the code holds then (`BlockProfile.output_post_held_calls`, ``output_end_held_calls``),
    counted in their retained bytes: below 0 where the post part's measured forward counts those
    too (not saved, so not counted here)."""
    def held(block: BlockProfile) -> int:
        return max(block.output_post_held_bytes, block.output_end_held_bytes) if at_post else block.output_end_held_bytes

    filled = _fill_gaps(segments, 0, profile.num_blocks)
    unkept = {i for seg in filled if seg.kind != "keep" for i in range(seg.start, seg.stop)}
    # what the code holds through the backward too is in the blocks' retained bytes (`saved_code_held`)
    total = (sum(max(0, held(profile.blocks[i]) - profile.blocks[i].saved_code_held_bytes) for i in unkept)
             + kept_inputs_bytes(profile, filled, profile.num_blocks))
    total = max(total, 0)
    # what a selective block caches of them: its retained bytes count it, and here (saved) or the
    # post part's measured forward (not saved) count it again
    for seg in filled:
        block = profile.blocks[seg.start]
        if seg.kind == "selective" and not block.saved_code_held_bytes:
            calls = block.output_post_held_calls if at_post else block.output_end_held_calls
            total -= cached_held_bytes(block, cached_ops(block, seg.saved_ops), calls)
    return total


def layout_peak(profile: Profile, segments: tuple[Segment, ...], start: int, stop: int, replay: bool = False,
                dead: Sequence[int] | None = None, stopped: bool = False, stored: Sequence[int] | None = None,
                code_from: int = -1, input_held: bool = True) -> _Peak:
    """Peak of the backward of blocks ``[start, stop)`` laid out as ``segments`` (gaps: keep),
    above what was live before it (gradients accumulated by then included); ``replay``: the
    blocks are replayed in backward (inside a recompute segment); ``stopped``: that replay stops
    early (`Segment.stops_early`: its last block, kept, replays up to its last saved tensor);
    ``dead``: at the top level, `dead_shared_bytes` (counted by the costs, not live in the
    backward); ``stored``: at the top level, `stored_held_bytes` (live in the backward only);
    ``code_from``: in a replay, the first block of the top-level segment replayed, whose later
    blocks' inputs the code holds (`code_held_through`); ``input_held``: in a replay, the region's
    input is held through its backward. A top-level checkpoint holds its input to its node's
    backward, the region's last; a child's input is saved into its parent's replay, which lets it
    go once the child's replay has taken it, so the child's first block, kept, holds it through
    its forward only, as a block after another of a replay does (unless the child begins its
    parent, whose input is the same tensor: then as held as the parent's). A child at the end of a
    segment of blocks that do not save their input measured 8 % under its prediction when its
    input was counted through its backward. Torch holds it through the child's replay, though
    (the arguments it replays the child with): beside the forwards of the child's later blocks
    too, where a child of two or more such blocks measured one activation over its prediction.
    """
    best = _Peak(bytes=0, block=-1, working_bytes=0)
    held = 0
    gone = 0  # of ``held``, what the kept blocks before this one saved and no backward holds (top level)
    previous_kept = True
    unkept: list[tuple[int, frozenset[str]]] = []  # top-level blocks before this one not kept, what they cache
    holders: set[int] = set()  # top-level blocks before this one whose checkpoint holds their inputs
    kept_later = not replay and _keeps_later(profile)
    kept_inputs = not replay and any(b.input_code_kept_bytes or b.input_saved_after_bytes for b in profile.blocks)
    saved_after = kept_inputs and any(b.input_saved_after_bytes for b in profile.blocks)
    held_inputs = replay and code_from >= 0 and any(b.input_code_held_bytes for b in profile.blocks[code_from:stop])
    passed: list[Segment] = []  # top-level segments before this one
    caches: list[tuple[int, frozenset[str]]] = []  # top-level selective blocks before this one, what they cache
    code_cached = not replay and any(b.output_held_calls_until for b in profile.blocks)
    filled = _fill_gaps(segments, start, stop)
    cached_inputs = {} if replay else cached_input_bytes(profile, filled)
    # a nested checkpoint's input, not held through its backward, is through its replay, beside the
    # forwards after its first block (kept: else a child's checkpoint beginning it holds it)
    forward_held = (profile.blocks[start].unsaved_input_bytes
                    if replay and not input_held and filled and filled[0].kind == "keep" else 0)
    for seg in filled:
        held -= cached_inputs.get(seg.start, 0)  # in an earlier selective block's cache, counted there
        unheld = dead[seg.start] if dead else 0
        container = stored[seg.start] if stored else 0  # in its backward, not its forward
        later = later_held_bytes(profile, seg.start, unkept) if kept_later else 0
        if caches:  # what the code holds of earlier selective blocks' caches, counted in their retained bytes
            later -= cached_code_held_bytes(profile, seg.start, caches)
        if kept_inputs:  # the inputs the code keeps of earlier segments' blocks, in the forwards
            later += kept_inputs_bytes(profile, passed, seg.start)
        after = saved_after_bytes(profile, passed, seg.start) if saved_after else 0  # in the backwards
        twice = 0  # inputs of earlier checkpoints the code holds too, in a kept or recomputed forward: counted once
        if not replay and holders and seg.kind in ("keep", "recompute", "selective"):
            twice = min(min(held_twice_bytes(profile, i, holders), code_held_bytes(profile.blocks[i]))
                        for i in range(seg.start, seg.stop))
        if seg.kind == "recompute":
            inner = layout_peak(profile, seg.children, seg.start, seg.stop, replay=True, stopped=seg.stops_early,
                                code_from=code_from if replay else seg.start,
                                input_held=not replay or (input_held and seg.start == start))
            unit = 0 if replay else unit_extra_bytes(profile, seg.start, seg.stop)  # ZeRO-3: one unit
            # the inputs the code holds past its blocks (the replay's part counted there) and what the code
            # holds of their saved tensors (the replay reads the same storage)
            code = (0 if replay else code_held_through(profile, seg.start, seg.stop - 1)) + saved_code_held(profile, seg)
            candidate = _Peak(bytes=held + inner.bytes + unit - unheld + container - gone + after, block=inner.block,
                              working_bytes=inner.working_bytes)
            forward = 0 if replay else segment_forward_bytes(profile, seg.start, seg.stop, previous_kept,
                                                               unheld) + later - twice
            if replay and forward_held:  # its forward in the replay, beside the replayed region's input and
                # what the backward holds as the replay starts (the region's output's gradient, the later blocks')
                forward = (forward_held + replay_base_bytes(profile.blocks[stop - 1]) + grad_bytes_live(profile, stop - 1)
                           + replayed_forward_bytes(profile, seg.start, seg.stop))
            # its forward: every output held for the model's calls, and the shared tensors no
            # checkpoint holds (``unheld``) where the code still holds them, as a kept block's forward counts
            if held + forward > candidate.bytes:
                candidate = _Peak(bytes=held + forward, block=seg.start, working_bytes=forward)
            held += cost_of(profile, seg.start, seg).retained_bytes + code
        else:
            cost = cost_of(profile, seg.start, seg)
            working, parts = cost.working_bytes, (cost.backward_bytes, cost.forward_bytes)
            if seg.kind == "selective" and (previous_held_bytes(profile, seg.start, previous_kept=False) or later or unheld):
                # the cost counts the block before's held outputs on its forward, as if not kept; the
                # shared tensors no checkpoint holds are taken off below, from its backward alone
                held_then = 0 if replay else previous_held_bytes(profile, seg.start, previous_kept) + later
                priced = selective_cost(profile.blocks[seg.start], seg.saved_ops, held_then, unheld)
                working, parts = priced.working_bytes, (priced.backward_bytes, priced.forward_bytes)
            if replay and seg.kind == "keep":  # kept inside a replay: its forward runs again
                last = stopped and seg.start == stop - 1
                first = seg.start == start and input_held  # else its inputs come from the replay, not the checkpoint
                working = (stopped_replay_working_bytes if last else replay_working_bytes)(
                    profile.blocks[seg.start], first, forward_held if seg.start > start else 0)
            elif seg.kind == "keep":  # its backward, or its forward (no gradient, the shared tensors live)
                working = working_bytes(profile.blocks[seg.start]) - unheld + container - gone + after
                unheld = container = after = 0
                working = max(working, keep_forward_bytes(profile, seg.start, previous_kept) + later - twice)
            need = held + working - unheld + container + grad_bytes_live(profile, seg.start) + after  # selective: a bound
            if seg.kind == "selective" and not replay and parts[1] is not None:
                # its forward apart: no later block's gradient there, nothing only its backward holds
                # (x-transformers' last layer, selective, measured the head's gradients under its prediction)
                backward, forward = parts  # its forward counts what the code holds, earlier checkpoints' inputs too
                need = held - unheld + max(forward - twice, backward + container + grad_bytes_live(profile, seg.start) + after)
            if held_inputs:
                need += code_held_through(profile, code_from, seg.start)
            candidate = _Peak(bytes=need, block=seg.start, working_bytes=working)
            held += cost.retained_bytes + saved_code_held(profile, seg)
            if seg.kind == "keep" and not replay:
                gone += profile.blocks[seg.start].saved_dead_bytes
            if replay and seg.start == start and input_held:  # the checkpoint holds the region's input to its end
                held += profile.blocks[seg.start].unsaved_input_bytes
        # backward runs in reverse: on a tie the later block reaches the peak first
        if (candidate.bytes, candidate.block) > (best.bytes, best.block):
            best = candidate
        previous_kept = seg.kind == "keep"
        passed.append(seg)
        if seg.kind in ("recompute", "selective"):
            holders.add(seg.start)
        if not previous_kept and kept_later:
            cached = cached_ops(profile.blocks[seg.start], seg.saved_ops) if seg.kind == "selective" else frozenset()
            unkept.extend((i, cached) for i in range(seg.start, seg.stop))
        if code_cached and seg.kind == "selective":
            caches.append((seg.start, cached_ops(profile.blocks[seg.start], seg.saved_ops)))
    return best


def cached_code_held_bytes(profile: Profile, block_index: int, caches: Sequence[tuple[int, frozenset[str]]]) -> int:
    """What the selective blocks ``caches`` (``(j, cached calls)``, before ``block_index``) cache of
    the outputs the model's code holds, not saved, as this block's forward begins
    (`BlockProfile.output_held_calls_until`: x-transformers' keys and values, in a list to the
    forward's return): this block's measured forward counts them, and their retained bytes
    again. Counted off there; 0 in its backward, where the code holds nothing of them."""
    total = 0
    for j, cached in caches:
        block = profile.blocks[j]
        if j >= block_index or not cached or not block.output_held_calls_until:
            continue
        saved = {op.key for op in block.ops if op.saved_bytes}
        calls = tuple(key for key, until in block.output_held_calls_until if until >= block_index and key not in saved)
        total += cached_held_bytes(block, cached, calls)
    return total


def cached_input_bytes(profile: Profile, segments: Sequence[Segment]) -> dict[int, int]:
    """Per first block k of a top-level recompute or selective segment: of the inputs its
    checkpoint holds (``counted == "held"``), those an earlier top-level selective block caches
    (`BlockInput.producer_storage` among its cached storages), whose cache holds them past k's
    backward: counted once, in that cache (BERT with LoRA, whose layers save none of their
    input: a layer caching its output beside the next one recomputed was 4,096 bytes over)."""
    caches: dict[int, dict[object, int]] = {}
    out: dict[int, int] = {}
    for seg in segments:
        if seg.kind == "selective":
            block = profile.blocks[seg.start]
            # not those the code holds beyond the block too: where it does, the forwards and the post
            # part count them as the code's, and the other corrections take the copies off there
            # (`cached_code_held_bytes`, `post_code_held_saving`); after, both copies are counted, a bound
            held = call_storages(block, {key for key, _ in block.output_held_calls_until} | set(block.output_post_held_calls))
            caches[seg.start] = {sid: nbytes for sid, nbytes in cached_storages(block, seg.saved_ops).items()
                                 if sid not in held}
        if seg.kind not in ("recompute", "selective") or not caches:
            continue
        seen: set[int] = set()
        for arg in profile.blocks[seg.start].inputs:
            j = arg.producer(seg.start)
            if arg.counted == "held" and arg.storage not in seen and arg.producer_storage in caches.get(j, {}):
                seen.add(arg.storage)
                out[seg.start] = out.get(seg.start, 0) + caches[j][arg.producer_storage]
    return out


def kept_inputs_bytes(profile: Profile, segments: Sequence[Segment], position: int) -> int:
    """The inputs of the blocks inside the top-level recompute segments of ``segments`` (not their
    first) that the model's code keeps in the forward up to the block at ``position`` at least (the
    number of blocks: the part after them; `BlockProfile.input_code_kept_bytes`: a tuple of every
    layer's hidden states the output returns), but not through the backward (`code_held_through`
    counts those): no checkpoint holds them. FLAVA's least-peak plan, a segment of its two image
    layers, measured 1.25 % above its prediction at its untrained multimodal layers' forward."""
    return sum(_kept_then(block, position, profile.num_blocks) for seg in segments if seg.kind == "recompute"
               for block in profile.blocks[seg.start + 1 : seg.stop] if not block.input_code_held_bytes)


def _kept_then(block: BlockProfile, position: int, num_blocks: int) -> int:
    """`kept_inputs_bytes`' share of one block: its input the code keeps then, in the forward of the
    block at ``position`` (``num_blocks``: the part after the blocks). One that code after it saves
    (`BlockProfile.input_saved_after_bytes`) is held to the end of the forward; from the part after
    the blocks on, `saved_after_bytes` counts it (through that part's backward too)."""
    kept = block.input_code_kept_bytes if block.input_code_kept_until >= position else 0
    if block.input_saved_after_bytes:
        return 0 if position >= num_blocks else max(kept, block.input_saved_after_bytes)
    return kept


def saved_after_bytes(profile: Profile, segments: Sequence[Segment], position: int) -> int:
    """The inputs of the blocks inside the top-level recompute segments of ``segments`` (not their
    first) that code after them saves (`BlockProfile.input_saved_after_bytes`: a norm on every
    layer's hidden states before a neck reads them), live in the backward of the block at
    ``position`` (the number of blocks: the part after them) and, from that part's forward on,
    the whole step down to that code's backward: no checkpoint holds them, the code's graph
    does. Depth Anything's least-peak plan, segments of two backbone layers, measured 0.16 % above
    its prediction without them."""
    return sum(block.input_saved_after_bytes for seg in segments if seg.kind == "recompute"
               for block in profile.blocks[seg.start + 1 : seg.stop]
               if block.input_saved_after_bytes and not block.input_code_held_bytes
               and block.input_saved_after_from <= position)


def saved_code_held(profile: Profile, seg: Segment) -> int:
    """What the model's code holds through the backward of the saved tensors of a segment's blocks
    not kept, top-level or nested in a replay (`BlockProfile.saved_code_held_bytes`: the weight
    ``torch.nn.utils.spectral_norm`` leaves on its module): held while the backward runs the
    blocks after them, whatever the plan. Full recomputation of four such blocks measured one
    weight per block above its prediction without it, a nested child one weight per block."""
    if seg.kind == "keep":
        return 0
    return sum(block.saved_code_held_bytes for block in profile.blocks[seg.start : seg.stop])


def code_held_through(profile: Profile, start: int, block: int) -> int:
    """Of a top-level recompute segment starting at ``start``, the inputs of its blocks
    ``start + 1 .. block`` that the model's code holds through the backward
    (`BlockProfile.input_code_held_bytes`: a forward hook's list of every block's output): the
    replay makes them again beside the code's. Live from the segment's forward to the step's end;
    the profile's step, whose blocks were all kept, counts those past each block's backward in its
    temporaries (``bwd_temp_bytes``), so a replay's block ``j`` counts its own input and those
    before it: a hook keeping every block's output measured +3.6 % above the prediction of a
    4-block model's √N segments without them, -5.2 % with every one counted through the replay."""
    return sum(profile.blocks[i].input_code_held_bytes for i in range(start + 1, block + 1))


def _keeps_later(profile: Profile) -> bool:
    """Whether the model's code keeps any block's outputs past the block after it
    (`BlockProfile.output_later_held_bytes`): most models' do not, and their plans skip the count."""
    return any(b.output_later_held_bytes for b in profile.blocks)


def dead_shared_bytes(profile: Profile, segments: tuple[Segment, ...]) -> list[int]:
    """Per block j, the bytes of the shared tensors no block saves (a mask) first taken by blocks
    ``<= j`` that no checkpoint of this plan holds: no block taking them is in a top-level recompute
    or selective segment (a segment's blocks take its first block's arguments). The costs count
    them from their first taker on, a bound for the optimal search; nothing holds them past the
    forward, so the prediction leaves them out of the backward (an exact peak without
    recomputation). Cumulative."""
    held = checkpoint_held_storages(profile, segments)
    out, total = [], 0
    for block in profile.blocks:
        shared = {arg.storage: arg.storage_bytes for arg in block.inputs if arg.counted == "shared"}
        total += sum(nbytes for storage, nbytes in shared.items() if storage not in held)
        out.append(total)
    return out


def checkpoint_held_storages(profile: Profile, segments: tuple[Segment, ...]) -> set[int]:
    """Storage ids of the blocks' arguments a checkpoint of this plan holds: those taken by a block
    in a top-level recompute or selective segment (a segment's blocks take its first block's
    arguments)."""
    checkpointed = {i for seg in segments if seg.kind in ("recompute", "selective") for i in range(seg.start, seg.stop)}
    return {arg.storage for block in profile.blocks if block.index in checkpointed for arg in block.inputs}


def post_code_held_saving(profile: Profile, segments: tuple[Segment, ...]) -> int:
    """What the post part's need (`remat.plan.phases.post_working_bytes`) counts twice under this
    plan: block arguments the model's code holds through the post part's forward
    (`Profile.post_code_held`: EoMT's attention mask of its last layer, a local of its forward to
    the return), which its measured forward counts while they live, that a checkpoint of this
    plan holds too, counted in the blocks' retained bytes (`_retained_arguments`). With all of
    them so held, the post part's need is its forward measured without them against its
    backward (`Profile.post_code_held_saving_bytes` lower; EoMT's 2-layer full recomputation
    measured 8.2 % under its prediction before); with some, that need plus the bytes of the others
    bounds it (each counted as if live at the peak). 0 with a head part: its need is priced from
    the head's own measurements (`remat.plan.head.head_need_bytes`)."""
    if not profile.post_code_held_saving_bytes or profile.head is not None:
        return 0
    retained = _retained_arguments(profile, segments)
    others = sum(nbytes for storage, nbytes in profile.post_code_held if storage not in retained)
    return max(0, profile.post_code_held_saving_bytes - others)


def _retained_arguments(profile: Profile, segments: tuple[Segment, ...]) -> set[int]:
    """Storages of block arguments that nothing saves and the plan's retained bytes count: a held
    input (`BlockInput.counted`) of the first block of a top-level recompute or selective segment,
    which its checkpoint holds, and a shared one (counted from its first taker on,
    `BlockProfile.shared_entry_bytes`) that a checkpoint holds (`dead_shared_bytes`) where its
    first taker's retained bytes count its entry (not a later block of a recompute segment)."""
    filled = _fill_gaps(segments, 0, profile.num_blocks)
    holders = {seg.start for seg in filled if seg.kind in ("recompute", "selective")}
    inside = {i for seg in filled if seg.kind == "recompute" for i in range(seg.start + 1, seg.stop)}
    checkpointed = {i for seg in filled if seg.kind in ("recompute", "selective") for i in range(seg.start, seg.stop)}
    takers: dict[int, set[int]] = {}
    for block in profile.blocks:
        for arg in block.inputs:
            takers.setdefault(arg.storage, set()).add(block.index)
    out: set[int] = set()
    for block in profile.blocks:
        for arg in block.inputs:
            if (arg.counted == "held" and block.index in holders) or (
                    arg.counted == "shared" and block.index not in inside and takers[arg.storage] & checkpointed):
                out.add(arg.storage)
    return out


def cached_escaping_bytes(profile: Profile, segments: tuple[Segment, ...]) -> list[int]:
    """Per block j, then the post part (0): what the top-level selective blocks before j cache of
    their calls' outputs that a later segment saves too (`OpRecord.storage_escapes`: caching them
    costs nothing while that segment holds them), where that segment's backward runs before j's
    (`OpRecord.storage_saved_from` past the block after the cache's): between the two, the cache
    alone holds them, unless a later checkpoint holds them as its input (counted in its retained
    bytes). BridgeTower's last text layer caching its output, which the post part saves, measured
    8,192 bytes above its prediction in the image layer's backward after it."""
    out = [0] * (profile.num_blocks + 1)
    starts = [seg.start for seg in segments if seg.kind in ("recompute", "selective")]
    for seg in segments:
        if seg.kind != "selective":
            continue
        i, block = seg.start, profile.blocks[seg.start]
        cached = cached_ops(block, seg.saved_ops)
        until: dict[int, tuple[int, int]] = {}  # storage -> (first later saver, bytes)
        for op in block.ops:
            if op.key in cached and op.storage_saved_from:
                for sid, nbytes, saver in zip(op.storage_ids, op.storage_bytes, op.storage_saved_from):
                    if saver > i + 1:
                        until[sid] = (saver, nbytes)
        for sid, (saver, nbytes) in until.items():
            # a later checkpoint holding it as its input counts it from its forward to its backward
            held = min((m for m in starts if m > i and _holds_input(profile.blocks[m], i, sid)), default=saver)
            for j in range(i + 1, min(saver, held, profile.num_blocks)):
                out[j] += nbytes
    return out


def _holds_input(block: BlockProfile, producer: int, storage: int) -> bool:
    """Whether a checkpoint beginning with ``block`` holds the storage number ``storage`` of block
    ``producer``'s call outputs as its input (`BlockInput.counted` ``held``)."""
    return any(arg.counted == "held" and arg.producer_storage == storage and arg.producer(block.index) == producer
               for arg in block.inputs)


def stored_held_bytes(profile: Profile, segments: tuple[Segment, ...]) -> list[int]:
    """Per block j, then the post part: the bytes the blocks wrote to mutable containers among the
    arguments of blocks this plan checkpoints (`BlockProfile.stored_held`: Gemma 4's keys and
    values, in the mapping every layer is handed) that are live in j's backward beyond what the
    rest of the prediction counts. A checkpoint holds its arguments to the end of its backward, and
    with them the container, where the model's code let it go as the forward returned: what it
    holds is live from the head's forward on, down to the backward of the first top-level recompute
    or selective segment that takes it. In the backward of the blocks after the writer, other terms
    count a share: a kept writer's saved share (its saved bytes; not in its own backward, which
    lets them go as it reads them), a selective writer's cached share (its retained bytes; in its
    replay, the share that outlives it), and what a later segment saves too (the next block's
    entry bytes: Gemma 4's keys and values that its last layers reuse). A replay's writes are
    undone (`remat.checkpointing.region`): one copy. Zeros where no checkpoint takes a container,
    as in the measured step."""
    if not any(block.stored_held for block in profile.blocks):
        return [0] * (profile.num_blocks + 1)
    held: dict[int, tuple[int, int, int, int]] = {}  # block i -> (first holder's start, bytes, saved, handed off)
    kept: set[int] = set()
    # selective block -> what its cache holds of it: outliving the block (its replay's working set
    # counts them), the others (its retained bytes count them)
    cached: dict[int, tuple[int, int]] = {}
    for seg in _fill_gaps(segments, 0, profile.num_blocks):
        if seg.kind == "keep":
            kept.add(seg.start)
        elif seg.kind in ("recompute", "selective"):
            for j in range(seg.start, seg.stop):
                for i, nbytes, saved, handed in profile.blocks[j].stored_held:
                    held.setdefault(i, (seg.start, nbytes, saved, handed))
        if seg.kind == "selective":
            block = profile.blocks[seg.start]
            calls = cached_ops(block, seg.saved_ops) & set(block.stored_calls)
            ops = [(k, op) for k, op in enumerate(block.ops) if op.key in calls]
            kept_apart = sum({s: b for k, op in ops for s, b in op_storages(k, op).items()}.values())
            cached[seg.start] = (sum(op.output_bytes for _, op in ops) - kept_apart, kept_apart)

    def counted(i: int, saved: int, handed: int, j: int) -> int:  # by block j's phase and the blocks before it
        if i >= j:
            return cached.get(i, (0, 0))[0] if i == j else 0
        return saved if i in kept else handed + cached.get(i, (0, 0))[1]

    return [sum(nbytes - counted(i, saved, handed, j)
                for i, (first, nbytes, saved, handed) in held.items() if first <= j)
            for j in range(profile.num_blocks + 1)]


def _fill_gaps(segments: tuple[Segment, ...], start: int, stop: int) -> list[Segment]:
    """``segments`` in order, with single-block ``keep`` segments where they leave gaps; a
    multi-block non-recompute segment is split into its blocks (each block costs on its own)."""
    out: list[Segment] = []
    pos = start
    for seg in sorted(segments, key=lambda s: s.start):
        out.extend(Segment(start=i, stop=i + 1, strategy="keep") for i in range(pos, seg.start))
        if seg.kind == "recompute":
            out.append(seg)
        else:
            out.extend(Segment(start=i, stop=i + 1, strategy=seg.strategy, saved_ops=seg.saved_ops) for i in range(seg.start, seg.stop))
        pos = seg.stop
    out.extend(Segment(start=i, stop=i + 1, strategy="keep") for i in range(pos, stop))
    return out


def _top_retained(profile: Profile, segments: tuple[Segment, ...]) -> tuple[int, ...]:
    out: list[int] = []
    filled = _fill_gaps(segments, 0, profile.num_blocks)
    cached = cached_input_bytes(profile, filled)
    for seg in filled:
        out.extend(cost_of(profile, i, seg).retained_bytes + (0 if seg.kind == "keep" else profile.blocks[i].saved_code_held_bytes)
                   - cached.get(i, 0) for i in range(seg.start, seg.stop))
    return tuple(out)


def extra_ms(profile: Profile, segments: tuple[Segment, ...], head: str = "keep") -> float:
    """A layout's extra time over the baseline step before the fresh memory its peak saves
    (`fresh_memory`): the step time `predict` gives, without pricing its peak."""
    return _extras(profile, segments)[0] + head_extra_ms(profile, head)


def _extras(profile: Profile, segments: tuple[Segment, ...]) -> tuple[float, int, int]:
    """(extra ms, extra FLOPs, offloaded bytes) of a layout, children included."""
    extra_ms, extra_flops, offloaded = 0.0, 0, 0
    for seg in segments:
        for i in range(seg.start, seg.stop):
            cost = cost_of(profile, i, seg)
            extra_ms, extra_flops, offloaded = extra_ms + cost.extra_ms, extra_flops + cost.extra_flops, offloaded + cost.offloaded_bytes
        if seg.children:
            child_ms, child_flops, child_off = _extras(profile, seg.children)
            extra_ms, extra_flops, offloaded = extra_ms + child_ms, extra_flops + child_flops, offloaded + child_off
    return extra_ms, extra_flops, offloaded


def check_segments(profile: Profile, segments: tuple[Segment, ...]) -> None:
    """Top-level segments must cover the profile's blocks in order; children must not overlap;
    no segment but a kept one may run two blocks that do not join (`remat.plan.joins`)."""
    pos = 0
    for seg in segments:
        if seg.start != pos:
            raise ValueError(
                f"segments must cover blocks 0..{profile.num_blocks - 1} in order; segment "
                f"[{seg.start}, {seg.stop}) starts at {seg.start}, expected {pos}."
            )
        _check_children(seg)
        _check_offload_target(profile, seg)
        pos = seg.stop
    if pos != profile.num_blocks:
        raise ValueError(f"segments cover {pos} blocks but the profile has {profile.num_blocks}; plan for this profile.")
    check_joins(profile, segments)


def _check_children(seg: Segment) -> None:
    ordered = sorted(seg.children, key=lambda s: s.start)
    for left, right in zip(ordered, ordered[1:]):
        if right.start < left.stop:
            raise ValueError(f"child segments [{left.start}, {left.stop}) and [{right.start}, {right.stop}) overlap.")
    for child in ordered:
        _check_children(child)


def _check_offload_target(profile: Profile, seg: Segment) -> None:
    if seg.strategy == "offload:cpu" and profile.fingerprint.device == "cpu":
        raise ValueError(
            f"segment [{seg.start}, {seg.stop}) offloads to the CPU, but the profile was taken on the "
            "CPU: the tensors are already in host memory. Use keep, recompute, selective:<policy> "
            "or offload:disk."
        )
    for child in seg.children:
        _check_offload_target(profile, child)
