"""The optimal search's per-block choices besides recompute, priced from the cost registry.

Every block may be kept, run under a selective policy (the named ones, and every point of the
knapsack frontier of any block alike in structure) or offloaded where a cost and a measured
bandwidth exist. Blocks alike in structure (`structure_classes`: a transformer's layers) share
their option list and are priced together (`remat.plan.costs.selective_prices`, the formula
`remat.plan.costs.cost_of` uses, bit for bit), each with its own op times; each block then keeps
the options no other of its options beats in retained bytes, working bytes and time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from remat.measure.types import BlockProfile, Profile
from remat.plan.costs import cost_of, has_cost, selective_prices
from remat.plan.phases import keep_working_bytes, previous_held_bytes
from remat.plan.policies import knapsack_frontier_union, policy
from remat.plan.types import Segment

__all__ = ["NAMED_POLICIES", "BlockOptions", "OptionClass", "block_options", "structure_classes", "price_options",
           "undominated_rows"]

NAMED_POLICIES = ("attention-core", "save-matmuls")
"""Selective policies offered per block besides every point of the knapsack frontier."""


@dataclass(kw_only=True, frozen=True)
class OptionClass:
    """The priced options of one structure class: bytes per option, times and the dominance
    mask per member block (rows in ``members`` order)."""

    members: list[int]
    """Indices of the blocks alike in structure."""
    retained_bytes: np.ndarray
    """(K,) what each option holds while backward runs the later blocks."""
    working_bytes: np.ndarray
    """(K,) what each option's backward needs on top."""
    extra_ms: np.ndarray
    """(B, K) each option's time on each member."""
    ok: np.ndarray
    """(B, K) the options no earlier one of the same member beats (`undominated_rows`)."""


@dataclass(kw_only=True, frozen=True)
class BlockOptions:
    """One block's non-dominated top-level options, keep first: segments (named on the first
    block of its structure class: `option_segment` moves one) and their costs."""

    segments: tuple[Segment, ...]
    """The options as single-block segments."""
    retained_bytes: np.ndarray
    """(K,) int64."""
    working_bytes: np.ndarray
    """(K,) int64."""
    extra_ms: np.ndarray
    """(K,) float."""

    def __len__(self) -> int:
        return len(self.segments)

    def option_segment(self, index: int, k: int) -> Segment:
        """Option ``k`` as a segment on block ``index``."""
        segment = self.segments[k]
        return segment if segment.start == index else dataclasses.replace(segment, start=index, stop=index + 1)


def block_options(profile: Profile, index: int) -> list[Segment]:
    """Top-level single-block choices other than recompute: keep, selective policies (named, and
    every point of the knapsack frontier of any block alike in structure: `structure_classes`),
    offload where a cost and a measured bandwidth exist."""
    members = next(m for m in structure_classes(profile) if index in m)
    segments = [dataclasses.replace(s, start=index, stop=index + 1) for s in _class_segments(profile, members)]
    return segments + offload_options(profile, index)


def structure_classes(profile: Profile) -> list[list[int]]:
    """Blocks grouped by structure: equal op tables and bytes, times aside (`_structure_key`), and
    equal kept working sets (`remat.plan.phases.keep_working_bytes`: a forward at its place)."""
    classes: dict[tuple, list[int]] = {}
    for i, block in enumerate(profile.blocks):  # a kept or selective block's forward depends on its place
        key = (_structure_key(block), keep_working_bytes(profile, i), previous_held_bytes(profile, i, previous_kept=False))
        classes.setdefault(key, []).append(i)
    return list(classes.values())


def _structure_key(block: BlockProfile) -> tuple:
    ops = tuple((o.key, o.name, o.output_bytes, o.saved_bytes, o.flops, o.is_random, o.is_view, o.storage_ids,
                 o.storage_bytes, o.storage_escapes, o.mutated_later) for o in block.ops)
    flow = (block.held_input_bytes, block.unsaved_input_bytes, block.entry_bytes, block.handoff_bytes,
            block.between_bwd_temp_bytes, block.between_grad_bytes, block.bwd_start_temp_bytes, block.fwd_other_bytes,
            block.between_fwd_peak_bytes, block.unreached_fwd_bytes, block.held_input_bwd_temp_bytes,
            block.saved_dead_bytes)
    return (block.class_name, flow, block.input_bytes, block.output_bytes, block.saved_bytes, block.bwd_temp_bytes,
            block.fwd_temp_bytes, block.grad_bytes, block.fwd_flops, block.output_grad_bytes, block.bwd_free_order,
            block.fwd_live_bytes, block.checkpointed_fwd_live_bytes, block.checkpointed_fwd_freed_at, ops,
            block.unavailable, block.replay_saved_extra_bytes, block.graph_held_storages)


def _class_segments(profile: Profile, members: list[int]) -> list[Segment]:
    """Keep, the named policies and the knapsack union, on the class's first block (no selective
    option where its probe failed: the class's blocks share their `BlockProfile.unavailable`)."""
    first = profile.blocks[members[0]]
    a, b = first.index, first.index + 1
    out = [Segment(start=a, stop=b, strategy="keep")]
    if first.ops and first.unavailable_reason("selective") is None:
        for name in NAMED_POLICIES:
            out.append(Segment(start=a, stop=b, strategy=f"selective:{name}", saved_ops=policy(name)(first)))
        for _, keys in knapsack_frontier_union([profile.blocks[i] for i in members]):
            out.append(Segment(start=a, stop=b, strategy="selective:knapsack", saved_ops=keys))
    return out


def offload_options(profile: Profile, index: int) -> list[Segment]:
    """Offload segments on block ``index`` where a cost is registered, the rates measured and its
    probe did not fail."""
    if not has_cost("offload"):
        return []
    bw = profile.bandwidths
    targets = []
    if profile.fingerprint.device != "cpu" and bw.device_to_host_bytes_per_s and bw.host_to_device_bytes_per_s:
        targets.append("offload:cpu")
    if bw.disk_write_bytes_per_s and bw.disk_read_bytes_per_s:
        targets.append("offload:disk")
    block = profile.blocks[index]
    return [Segment(start=index, stop=index + 1, strategy=t) for t in targets if block.unavailable_reason(t) is None]


def price_options(profile: Profile) -> tuple[list[BlockOptions], list[OptionClass]]:
    """Per block, its non-dominated top-level options, priced: blocks alike in structure are
    priced together, offload options block by block; and the classes' arrays."""
    options: list[BlockOptions | None] = [None] * profile.num_blocks
    classes: list[OptionClass] = []
    for members in structure_classes(profile):
        group, per_block = _class_options(profile, members)
        classes.append(group)
        for i, opts in zip(members, per_block):
            options[i] = _with_offload(profile, i, opts)
    return options, classes  # type: ignore[return-value]


def _class_options(profile: Profile, members: list[int]) -> tuple[OptionClass, list[BlockOptions]]:
    """Options of the blocks of one structure class and the class's arrays."""
    blocks = [profile.blocks[i] for i in members]
    segments = _class_segments(profile, members)
    first = blocks[0]
    prices = selective_prices(blocks, [s.saved_ops for s in segments[1:]],
                              previous_held_bytes(profile, first.index, previous_kept=False))
    keep = cost_of(profile, first.index, segments[0])
    retained = np.r_[keep.retained_bytes, prices.retained_bytes].astype(np.int64)
    working = np.r_[keep.working_bytes, prices.working_bytes].astype(np.int64)
    ms = np.c_[np.zeros(len(blocks)), prices.extra_ms]
    ok = undominated_rows(retained, working, ms)
    group = OptionClass(members=members, retained_bytes=retained, working_bytes=working, extra_ms=ms, ok=ok)
    out = []
    for row in range(len(blocks)):
        keep = np.flatnonzero(ok[row])
        out.append(BlockOptions(segments=tuple(segments[k] for k in keep), retained_bytes=retained[keep],
                                working_bytes=working[keep], extra_ms=ms[row, keep]))
    return group, out


def _with_offload(profile: Profile, i: int, opts: BlockOptions) -> BlockOptions:
    offload = offload_options(profile, i)
    if not offload:
        return opts
    costs = [cost_of(profile, i, s) for s in offload]
    retained = np.r_[opts.retained_bytes, [c.retained_bytes for c in costs]].astype(np.int64)
    working = np.r_[opts.working_bytes, [c.working_bytes for c in costs]].astype(np.int64)
    ms = np.r_[opts.extra_ms, [c.extra_ms for c in costs]]
    segments = opts.segments + tuple(offload)
    # filtering the filtered list again equals filtering all at once (see `undominated_rows`)
    keep = np.flatnonzero(undominated_rows(retained, working, ms[None, :])[0])
    return BlockOptions(segments=tuple(segments[k] for k in keep), retained_bytes=retained[keep],
                        working_bytes=working[keep], extra_ms=ms[keep])


def undominated_rows(retained: np.ndarray, working: np.ndarray, ms: np.ndarray) -> np.ndarray:
    """Mask (B, K) of the options that no earlier option of their row beats or ties in retained
    bytes, working bytes and time (B rows of K options sharing bytes, times per row). An entry
    dropped for an earlier one is itself beaten by a kept one, so this equals filtering in order,
    and filtering a filtered list again equals filtering all at once."""
    bytes_no_worse = np.triu((retained[:, None] <= retained[None, :]) & (working[:, None] <= working[None, :]), k=1)
    out = np.empty(ms.shape, dtype=bool)
    step = max(1, 4_000_000 // max(ms.shape[1] ** 2, 1))  # rows at a time: about 4M booleans
    for lo in range(0, ms.shape[0], step):
        part = ms[lo : lo + step]
        out[lo : lo + step] = ~(bytes_no_worse[None] & (part[:, :, None] <= part[:, None, :])).any(axis=1)
    return out
