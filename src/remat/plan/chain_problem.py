"""A profile as the chain DPs' problem: every size in units of a quantum, the fixed part once.

`ChainBuilder` turns a Profile into a `remat.plan.chain_dp.ChainProblem` (sizes in slots of
``quantum`` bytes; ``quantum = 1`` is the byte-exact problem `remat.plan.chain_exact` solves) and
DP layouts back into Segments. Every byte and millisecond comes from the cost registry, so the
DPs price what `predict` prices: keep and recompute through `remat.plan.costs.cost_of`, the other
per-block options through `remat.plan.options`.

The part outside the blocks enters in one place, `FixedPart`: what stays live through the
backward, the gradients, the head's backward and the optimizer step (`remat.plan.predict`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from remat.measure.types import Profile
from remat.plan.chain_dp import BlockOption, ChainBlock, ChainProblem, Element, SegmentForward, UnitSlots, deep_recursion
from remat.plan.costs import cost_of, replay_working_bytes
from remat.plan.options import BlockOptions, OptionClass, offload_options, price_options, undominated_rows
from remat.plan.phases import (checkpointed_forward_peak, code_held_input_bytes, grad_bytes_live, handed_bytes,
                               held_input_bytes, post_working_bytes, previous_held_bytes, released_grad_bytes,
                               stopped_replay_ms, stopped_replay_working_bytes)
from remat.plan.predict import (backward_base_bytes, optimizer_phase_bytes, pre_backward_phase_bytes,
                                pre_forward_phase_bytes)
from remat.plan.types import Segment

__all__ = ["FixedPart", "fixed_part", "ChainBuilder", "keep_segments"]


@dataclass(kw_only=True, frozen=True)
class FixedPart:
    """What the part outside the blocks adds to every layout's peak (`remat.plan.predict`)."""

    base_bytes: int
    """Live through the whole backward: model state (`backward_base_bytes`) and the pre part's
    saved bytes."""
    grad_bytes: int
    """``G``: gradients live when the first block's backward starts, with that block's own
    (the DPs' gradient adjustment: `remat.plan.chain_dp`)."""
    head_bytes: int
    """The head's backward above the base and the blocks' retained bytes: the post part's saved
    bytes and backward temporaries, what the last block hands off to it, and the gradients live
    then (`remat.plan.phases.post_working_bytes`)."""
    optimizer_bytes: int
    """The larger of the phases no plan changes, no plan's peak lower: the optimizer step (model
    state and its temporaries), the forward before the first block and that part's backward
    (`remat.plan.predict.pre_forward_phase_bytes`, `remat.plan.predict.pre_backward_phase_bytes`)."""

    def peak_bytes(self, need_bytes: int | np.ndarray) -> int | np.ndarray:
        """Predicted peak of a layout whose gradient-adjusted need is ``need_bytes``."""
        return np.maximum(self.base_bytes + self.grad_bytes + need_bytes, self.optimizer_bytes)


def fixed_part(profile: Profile) -> FixedPart:
    first_grads = released_grad_bytes(profile.blocks[0]) if profile.blocks else 0
    return FixedPart(
        base_bytes=backward_base_bytes(profile) + profile.fixed_pre_saved_bytes,
        grad_bytes=grad_bytes_live(profile, 0) + first_grads,
        head_bytes=(post_working_bytes(profile) + grad_bytes_live(profile, profile.num_blocks)
                    - profile.block_gathered_bytes),  # FSDP2: not held through the head's backward
        optimizer_bytes=max(optimizer_phase_bytes(profile), pre_forward_phase_bytes(profile),
                            pre_backward_phase_bytes(profile)),
    )


def keep_segments(num_blocks: int) -> tuple[Segment, ...]:
    return tuple(Segment(start=i, stop=i + 1, strategy="keep") for i in range(num_blocks))


class ChainBuilder:
    """Options, sizes and chain problems of one profile (no work in the constructor)."""

    def __init__(self, profile: Profile, joins: tuple[bool, ...] | None = None):
        if joins is not None and len(joins) != max(profile.num_blocks - 1, 0):
            raise ValueError(
                f"joins has {len(joins)} entries for a profile of {profile.num_blocks} blocks; give one per pair "
                f"of neighbouring blocks ({max(profile.num_blocks - 1, 0)}), or None when any blocks may join."
            )
        self.profile = profile
        self.joins = None if joins is None else tuple(bool(j) for j in joins)
        self.fixed = fixed_part(profile)
        self._priced: tuple[list[BlockOptions], list[OptionClass]] | None = None
        self._priced_by: ChainBuilder | None = None
        self._sizes: list[int] | None = None

    def share_pricing(self, other: ChainBuilder) -> None:
        """Take ``other``'s priced options (priced on first use, once for both) where its profile
        prices the same: the same block objects, and the same profile-wide figures the pricing
        reads (`remat.plan.costs`, `remat.plan.options`). A profile priced with another head
        strategy differs only in its post part, which no block's options read."""
        if _prices_alike(self.profile, other.profile):
            self._priced_by = other._priced_by or other

    def _priced_options(self) -> tuple[list[BlockOptions], list[OptionClass]]:
        if self._priced is None:
            self._priced = self._priced_by._priced_options() if self._priced_by is not None else price_options(self.profile)
        return self._priced

    def options(self) -> list[BlockOptions]:
        """Per block, its non-dominated top-level options (`remat.plan.options.price_options`)."""
        return self._priced_options()[0]

    def sizes(self) -> list[int]:
        """Every size the problem counts, in bytes (the quantum's candidates divide them)."""
        if self._sizes is None:
            sizes = [self.fixed.head_bytes, self.fixed.grad_bytes]
            for i, block in enumerate(self.profile.blocks):
                keep = cost_of(self.profile, i, Segment(start=i, stop=i + 1, strategy="keep"))
                replay = cost_of(self.profile, i, Segment(start=i, stop=i + 1, strategy="recompute"))
                sizes += [replay.retained_bytes, keep.retained_bytes, block.unsaved_input_bytes, replay_working_bytes(block),
                          stopped_replay_working_bytes(block), replay_working_bytes(block, first=False),
                          stopped_replay_working_bytes(block, first=False), released_grad_bytes(block)]
                sizes += self.options()[i].retained_bytes.tolist() + self.options()[i].working_bytes.tolist()
            self._sizes = sizes
        return self._sizes

    def alike_in_bytes(self) -> bool:
        """Every block has the same replay-table sizes (`remat.plan.chain_dp.solve_chain`)."""
        return len({self._byte_key(i) for i in range(self.profile.num_blocks)}) <= 1

    def _byte_key(self, i: int) -> tuple:
        b = self.profile.blocks[i]
        keep = cost_of(self.profile, i, Segment(start=i, stop=i + 1, strategy="keep"))
        replay = cost_of(self.profile, i, Segment(start=i, stop=i + 1, strategy="recompute"))
        return (replay.retained_bytes, keep.retained_bytes, b.unsaved_input_bytes, replay_working_bytes(b),
                stopped_replay_working_bytes(b), replay_working_bytes(b, first=False),
                stopped_replay_working_bytes(b, first=False), released_grad_bytes(b))

    def keep_need(self) -> int:
        """Gradient-adjusted bytes keeping every block needs (`FixedPart.peak_bytes` of it is
        the no-recomputation peak, without a second pass of `predict`)."""
        head = self.head_need(1)
        held, need = 0, head
        for options, block in zip(self.options(), self.profile.blocks):  # keep is every block's first option
            need = max(need, held + int(options.working_bytes[0]) - released_grad_bytes(block))
            held += int(options.retained_bytes[0]) - released_grad_bytes(block)
        return max(need, held + head)

    def head_need(self, quantum: int, relax: bool = False) -> int:
        """The head's backward in slots, gradient-adjusted: its bytes plus the blocks' gradients
        minus ``G`` (rounded up; down with ``relax``)."""
        block_grads = sum(released_grad_bytes(b) for b in self.profile.blocks)
        head = self.fixed.head_bytes + block_grads - self.fixed.grad_bytes
        return head // quantum if relax else -(-head // quantum)

    def problem(self, quantum: int, capacity: int, relax: bool = False) -> ChainProblem:
        """Slots, gradient-adjusted as in `remat.plan.chain_dp`. Needs round up and gradients
        down, so a layout the DP accepts fits; ``relax``: the other way round, so every layout
        that fits in bytes is accepted (the DP's cost is then a lower bound; held slots are
        integers, so ``(allowance - G) // quantum`` still bounds them)."""
        self.options()
        chain: list[ChainBlock | None] = [None] * self.profile.num_blocks
        for group in self._priced[1]:  # type: ignore[index]
            plain = [row for row, i in enumerate(group.members) if not offload_options(self.profile, i)]
            for row, block in zip(plain, self._class_chain_blocks(group, plain, quantum, relax)):
                chain[group.members[row]] = block
        blocks = tuple(b if b is not None else self._chain_block(i, quantum, relax) for i, b in enumerate(chain))
        units = None
        if self.profile.unit_bytes:  # ZeRO-3: a segment's unit gathered whole (rounded down with ``relax``)
            units = UnitSlots(unit_bytes=self.profile.unit_bytes, quantum=quantum, relax=relax)
        blocks_ = self.profile.blocks
        forward = SegmentForward(
            # the outputs the code holds of the block before, as if it is not kept: a bound (`remat.plan.variants`)
            first_bytes=tuple(held_input_bytes(b) + b.entry_bytes + previous_held_bytes(self.profile, i, False)
                              for i, b in enumerate(blocks_)),
            output_bytes=tuple(map(handed_bytes, blocks_)), peak_bytes=tuple(map(checkpointed_forward_peak, blocks_)),
            grad_bytes=tuple(map(released_grad_bytes, blocks_)), total_grad_bytes=self.fixed.grad_bytes,
            quantum=quantum, relax=relax)
        later = tuple(self._later_slots(i, quantum, relax) for i in range(self.profile.num_blocks))
        # the inputs the code holds past a block inside a segment, through the replay and after it (a
        # bound: `remat.plan.predict.code_held_through` counts those of the blocks replayed by then, and
        # those the forward alone keeps in the forwards, and those code after the blocks saves down to
        # its backward); none in the relaxed problem, a lower bound
        code = tuple(0 if relax else _ceil(code_held_input_bytes(b), quantum) for b in blocks_)
        return ChainProblem(blocks=blocks, post_slots=self.head_need(quantum, relax), capacity_slots=capacity,
                            later_slots=later if any(later) else None, code_held_slots=code if any(code) else None,
                            segment_ms=self.profile.checkpoint_call_ms,
                            joins=self.joins, replayable=self.replayable(), units=units, forward=forward)

    def replayable(self) -> tuple[bool, ...] | None:
        """Per block, whether its replay ran when profiled (None: every block's did)."""
        ok = tuple(b.unavailable_reason("recompute") is None for b in self.profile.blocks)
        return None if all(ok) else ok

    def _class_chain_blocks(self, group: OptionClass, rows: list[int], quantum: int, relax: bool) -> list[ChainBlock]:
        """Chain blocks of a structure class's rows (blocks without offload options): the slot
        dominance filter runs on all of them at once; labels index each block's options."""
        retained = _slots(group.retained_bytes, quantum, relax)
        working = _slots(group.working_bytes, quantum, relax)
        ok = group.ok[rows]
        keep = undominated_rows(retained, working, np.where(ok, group.extra_ms[rows], np.inf)) & ok
        position = np.cumsum(ok, axis=1) - 1  # index of a class option in the block's own list
        out = []
        for r, row in enumerate(rows):
            k = np.flatnonzero(keep[r])
            options = tuple(map(BlockOption._make, zip(position[r, k].tolist(), retained[k].tolist(),
                                                       working[k].tolist(), group.extra_ms[row, k].tolist())))
            out.append(self._chain_block(group.members[row], quantum, relax, options))
        return out

    def _chain_block(self, i: int, quantum: int, relax: bool = False,
                     options: tuple[BlockOption, ...] | None = None) -> ChainBlock:
        need, grad = (_floor, _ceil) if relax else (_ceil, _floor)
        keep = cost_of(self.profile, i, Segment(start=i, stop=i + 1, strategy="keep"))
        replay = cost_of(self.profile, i, Segment(start=i, stop=i + 1, strategy="recompute"))
        block = self.profile.blocks[i]
        if options is None:
            opts = self.options()[i]
            retained, working = _slots(opts.retained_bytes, quantum, relax), _slots(opts.working_bytes, quantum, relax)
            ok = undominated_rows(retained, working, opts.extra_ms[None, :])[0]
            options = tuple(BlockOption(label=k, retained_slots=r, working_slots=w, extra_ms=ms) for k, r, w, ms in zip(
                np.flatnonzero(ok).tolist(), retained[ok].tolist(), working[ok].tolist(), opts.extra_ms[ok].tolist()))
        later = self._later_slots(i, quantum, relax)
        if later:  # not kept, the outputs the code keeps through later forwards (a bound: `later_slots`)
            kinds = [segment.kind for segment in self.options()[i].segments]
            options = tuple(o._replace(retained_slots=o.retained_slots + later) if kinds[o.label] != "keep" else o
                            for o in options)
        return ChainBlock(
            input_slots=need(replay.retained_bytes, quantum),
            saved_slots=need(keep.retained_bytes, quantum),
            # none in the relaxed problem: the slot tables count them wherever the block is kept
            unsaved_slots=0 if relax else need(block.unsaved_input_bytes, quantum),
            working_slots=need(replay_working_bytes(block), quantum),
            # a whole replay (a single-block segment's cost stops early); the segment pays the call once
            fwd_ms=block.fwd_ms + block.recompute_overhead_ms - self.profile.checkpoint_call_ms,
            options=options,
            grad_slots=grad(released_grad_bytes(block), quantum),
            stop_working_slots=need(stopped_replay_working_bytes(block), quantum),
            later_working_slots=need(replay_working_bytes(block, first=False), quantum),
            later_stop_working_slots=need(stopped_replay_working_bytes(block, first=False), quantum),
            stop_saving_ms=block.fwd_ms - stopped_replay_ms(block),
        )

    def _later_slots(self, i: int, quantum: int, relax: bool) -> int:
        """`remat.plan.chain_dp.ChainProblem.later_slots` of block ``i``: its outputs the code
        keeps through the forwards of blocks from two after it, counted while they are held as a
        checkpoint's input is (through the backward too: a bound, the prediction counts them in
        those forwards only), and its saved tensors the code holds through the backward
        (`BlockProfile.saved_code_held_bytes`: exact for a top-level segment; a nested child's are
        not in the replay tables, and the prediction judges such layouts); none in the relaxed
        problem, whose costs bound from below."""
        block = self.profile.blocks[i]
        if relax:
            return 0
        later = block.output_later_held_bytes if block.output_held_until >= i + 2 else 0
        return _ceil(later + block.saved_code_held_bytes, quantum)

    def segments(self, elements: tuple[Element, ...]) -> tuple[Segment, ...]:
        """A DP layout as Segments."""
        with deep_recursion(self.profile.num_blocks):
            return tuple(self._segment(e) for e in elements)

    def _segment(self, element: Element) -> Segment:
        if element.option is not None:
            return self.options()[element.start].option_segment(element.start, element.option)
        children = tuple(self._segment(c) for c in element.children)
        return Segment(start=element.start, stop=element.stop, strategy="recompute", children=children)


_PRICING_FIELDS = ("bandwidths", "fingerprint", "checkpoint_call_ms", "fixed_pre_grad_bytes", "grad_bytes",
                   "released_grad_prefix", "unit_bytes")
"""The profile-wide figures a block's options are priced from (`remat.plan.costs`, `remat.plan.options`,
`remat.plan.offload_cost`, the phases they read), besides the blocks."""


def _prices_alike(a: Profile, b: Profile) -> bool:
    """True where ``a`` and ``b`` price every block's options the same: the same block objects and
    equal `_PRICING_FIELDS`."""
    return (len(a.blocks) == len(b.blocks) and all(x is y for x, y in zip(a.blocks, b.blocks))
            and all(getattr(a, name) == getattr(b, name) for name in _PRICING_FIELDS))


def _slots(num_bytes: np.ndarray, quantum: int, relax: bool) -> np.ndarray:
    """Sizes in slots: rounded up (down with ``relax``), as `_ceil` / `_floor`."""
    return num_bytes // quantum if relax else -(-num_bytes // quantum)


def _ceil(num_bytes: int, quantum: int) -> int:
    return -(-int(num_bytes) // quantum)


def _floor(num_bytes: int, quantum: int) -> int:
    return int(num_bytes) // quantum
