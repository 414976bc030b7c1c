"""Variants of the optimal search's problem: terms a chain DP cannot see, priced as
`remat.plan.predict` prices them.

Two of the prediction's terms depend on the strategies of other blocks, which a block's options
cannot know:
- **Shared tensors no block saves** (an attention mask, rotary tables) are live past the forward
  only while a checkpoint of one of their takers holds them. The costs count them from their first
  taker on whatever the plan (`remat.plan.costs`: the taker's ``entry_bytes``), a bound; the
  prediction leaves them out of the backward of a plan in which no taker is in a recompute or
  selective segment (`remat.plan.predict.dead_shared_bytes`).
- **Shared tensors the code frees before a later block's forward** (an audio tower's mask, dropped
  as the tower returns, before a language model's layers run): that block's measured
  ``fwd_other_bytes`` counts them out, yet a checkpoint of one of their takers keeps them alive
  there. The search counts them back in every such forward, a bound (`revived_profile` with
  ``held=None``); the prediction where a checkpoint of the plan holds them.
- **Shared tensors a later block saves first** (RT-DETR's reference points with LoRA, taken first
  by its frozen query-position head, saved by each decoder layer) are counted by the first taker's
  entry and by the saver's saved bytes, so the forwards after the saver were measured counting
  them out; where the saver is not kept, those forwards hold them all the same. The search counts
  them back in every such forward, a bound (`resaved_profile` with ``kept=None``); the prediction
  where the plan does not keep the saver, and a variant keeps the saver.
- **A kept block's forward** holds the output of the block before it that the model's code keeps
  (a U-Net's skip) only when that block is not kept (`remat.plan.phases.keep_forward_bytes`); the
  option prices the larger (`remat.plan.phases.keep_working_bytes`).

The byte-exact search therefore solves one problem per combination of *choices* (`variants`):
a group of shared tensors left dead (their takers keep or offload only; their bytes out of the
first taker's held bytes and in the forward of it and of every block after it, live there as
the prediction counts them), a forward-bound block's predecessor kept (that block keeps only;
its output then held by its own saved bytes), or a saver of shared tensors kept (it keeps only;
the forwards after it count them through its saved bytes). Each layout of the plan space is priced exactly
in the variant of the choices it makes, and over-priced (never under) in the others, so the least
time over the variants at each need is the exact curve. `MAX_CHOICES` choices, the most bytes
first, get variants (2^choices problems); the others stay bounds.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from collections.abc import Callable, Container

from remat.measure.types import BlockProfile, Profile
from remat.plan.phases import keep_forward_bytes, working_bytes

__all__ = ["SharedGroup", "KeptNeighbour", "KeptSaver", "shared_groups", "kept_neighbours", "kept_savers", "variant",
           "variants", "MAX_CHOICES", "revived_profile", "resaved_profile",
           "cached_shared_profile"]

MAX_CHOICES = 4
"""Choices the exact search solves both ways: 2^4 problems at most (Funnel's decoder: three groups of
shared tensors and a saver of one; with three, its 512-byte group stayed a bound)."""
_DEAD = "a variant of the search in which no checkpoint holds the shared tensors this block takes"
_KEPT = "a variant of the search in which this block is kept (the next block's forward is priced so)"
_SAVER = "a variant of the search in which this block is kept (the forwards after it priced with what it saves)"


@dataclass(kw_only=True, frozen=True)
class SharedGroup:
    """Shared tensors no block saves, taken by the same blocks."""

    takers: frozenset[int]
    """Blocks that take them."""
    first: int
    """The block that counts them (its ``shared_entry_bytes``)."""
    num_bytes: int
    """Their bytes."""
    storages: frozenset[int] = frozenset()
    """Their storage ids (`remat.measure.types.BlockInput.storage`)."""


@dataclass(kw_only=True, frozen=True)
class KeptNeighbour:
    """A block whose kept forward is the larger part of its working set and depends on whether
    the block before it is kept."""

    block: int
    """The block whose forward it is (its predecessor is the one kept in the variant)."""
    num_bytes: int
    """What the predecessor's output adds to that forward when the predecessor is not kept."""


@dataclass(kw_only=True, frozen=True)
class KeptSaver:
    """A block that saves first shared tensors an earlier block takes first
    (`remat.measure.types.BlockProfile.shared_saved`): the forwards after it count them only when
    it is not kept."""

    block: int
    """The saver (kept in the variant)."""
    num_bytes: int
    """What the forwards after it count when it is not kept."""


Choice = SharedGroup | KeptNeighbour | KeptSaver


def shared_groups(profile: Profile) -> list[SharedGroup]:
    """Groups of the shared tensors the costs count (``counted == "shared"``), largest first."""
    takers: dict[int, set[int]] = {}
    for block in profile.blocks:
        for arg in block.inputs:
            takers.setdefault(arg.storage, set()).add(block.index)
    sizes: dict[tuple[frozenset[int], int], int] = {}
    members: dict[tuple[frozenset[int], int], set[int]] = {}
    for block in profile.blocks:
        shared = {arg.storage: arg.storage_bytes for arg in block.inputs if arg.counted == "shared"}
        for storage, num_bytes in shared.items():
            key = (frozenset(takers[storage]), block.index)
            sizes[key] = sizes.get(key, 0) + num_bytes
            members.setdefault(key, set()).add(storage)
    groups = [SharedGroup(takers=t, first=f, num_bytes=b, storages=frozenset(members[(t, f)]))
              for (t, f), b in sizes.items() if b > 0]
    return sorted(groups, key=lambda g: (-g.num_bytes, g.first, sorted(g.takers)))


def kept_neighbours(profile: Profile) -> list[KeptNeighbour]:
    """Blocks whose forward depends on whether the block before it is kept, largest term first:
    kept, where its forward with that block not kept may exceed its backward (counting every
    shared group's bytes as a dead variant adds them); or starting a recompute segment, whose
    forward holds those outputs beside it (`remat.plan.phases.segment_forward_bytes`)."""
    shared = sum(g.num_bytes for g in shared_groups(profile))
    out = []
    for i in range(1, profile.num_blocks):
        block, held = profile.blocks[i], profile.blocks[i - 1].output_held_bytes
        if held <= 0:
            continue
        kept_forward = block.fwd_other_bytes is not None and (
            keep_forward_bytes(profile, i, previous_kept=False) + shared > working_bytes(block))
        if kept_forward or block.unavailable_reason("recompute") is None:
            out.append(KeptNeighbour(block=i, num_bytes=held))
    return sorted(out, key=lambda k: (-k.num_bytes, k.block))


def _forwards_changed(profile: Profile, has: Callable[[BlockProfile], object],
                      change: Callable[[BlockProfile], dict]) -> Profile:
    """``profile`` with ``change(block)``'s fields set on each block whose forward was priced
    (``fwd_other_bytes``) and for which ``has(block)``; ``profile`` itself where no block has."""
    if not any(has(block) for block in profile.blocks):
        return profile
    return dataclasses.replace(profile, blocks=tuple(
        dataclasses.replace(block, **change(block)) if block.fwd_other_bytes is not None and has(block) else block
        for block in profile.blocks))


def revived_profile(profile: Profile, held: Container[int] | None = None) -> Profile:
    """``profile`` with the shared tensors the model's code freed before each block's forward
    (`remat.measure.types.BlockProfile.shared_freed`, which its ``fwd_other_bytes`` counts out)
    counted back in that forward where a checkpoint holds them: those whose storage ids are in
    ``held``, every one where None (the search's bound). ``profile`` itself where nothing changes."""

    def change(block: BlockProfile) -> dict:
        extra = sum(nbytes for storage, nbytes in block.shared_freed if held is None or storage in held)
        between = block.between_fwd_peak_bytes
        if block.between_fwd_apart_bytes is not None:
            # those the code before it freed: its peak above the start is without them where a
            # checkpoint holds them (live at both), at most with those it does not hold added
            dead = sum(nbytes for storage, nbytes in block.shared_freed
                       if storage in block.shared_freed_between and held is not None and storage not in held)
            between = min(between, block.between_fwd_apart_bytes + dead)
        return {"fwd_other_bytes": block.fwd_other_bytes + extra, "between_fwd_peak_bytes": between}

    return _forwards_changed(profile, lambda block: block.shared_freed, change)


def resaved_profile(profile: Profile, kept: Container[int] | None = None) -> Profile:
    """``profile`` with the shared tensors a later block saves first (`remat.measure.types.
    BlockProfile.shared_saved`, which the forwards after it count out, its saved bytes counting
    them) counted back in those forwards where that block does not save them: it is not among the
    ``kept`` blocks of the plan (a recomputed, selective or offloaded block saves none of its
    inputs on the device); not kept anywhere where None (the search's bound). ``profile`` itself
    where nothing changes."""

    def change(block: BlockProfile) -> dict:
        extra = sum(nbytes for _, nbytes, saver in block.shared_saved if kept is None or saver not in kept)
        return {"fwd_other_bytes": block.fwd_other_bytes + extra}

    return _forwards_changed(profile, lambda block: block.shared_saved, change)


def cached_shared_profile(profile: Profile, caches: dict[int, Container[int]]) -> tuple[Profile, set[int]]:
    """``profile`` with the shared tensors that a selective block caches (``caches``: block ->
    the storage numbers among its call outputs its strategy keeps, `remat.plan.costs.cached_storages`)
    counted in its cache alone, and their storage ids. A block's output that several later blocks
    take and none saves (LongT5's position bias, made by its first layer and added to every
    layer's scores) is counted from its first taker on (``shared_entry_bytes``); a cache of it holds
    it from the block's forward to the end of its backward, longer, so that count goes: the first
    taker's entry bytes less it, its input counted ``earlier`` (no longer left out of the backward by
    `remat.plan.predict.dead_shared_bytes`). Caching LongT5's measured 786,432 bytes (6 %) under the
    prediction before. ``profile`` itself where no cache holds one."""
    gone: dict[int, int] = {}  # storage id -> bytes
    blocks = list(profile.blocks)
    for block in profile.blocks:
        inputs, dropped = [], 0
        for arg in block.inputs:
            j = arg.producer(block.index)
            if arg.counted == "shared" and j in caches and arg.producer_storage in caches[j]:
                gone[arg.storage] = arg.storage_bytes
                dropped += arg.storage_bytes
                arg = dataclasses.replace(arg, counted="earlier")
            inputs.append(arg)
        if dropped:
            blocks[block.index] = dataclasses.replace(block, inputs=tuple(inputs), entry_bytes=block.entry_bytes - dropped,
                                                      shared_entry_bytes=block.shared_entry_bytes - dropped)
    if not gone:
        return profile, set()
    return dataclasses.replace(profile, blocks=tuple(blocks)), set(gone)


class _AllBut:
    """Every storage id but ``excluded``: what a variant's checkpoints may hold."""

    def __init__(self, excluded: frozenset[int]) -> None:
        self.excluded = excluded

    def __contains__(self, storage: object) -> bool:
        return storage not in self.excluded


def kept_savers(profile: Profile) -> list[KeptSaver]:
    """The blocks that save first shared tensors an earlier block takes first, largest first."""
    sizes: dict[int, dict[int, int]] = {}
    for block in profile.blocks:
        for storage, nbytes, saver in block.shared_saved:
            sizes.setdefault(saver, {})[storage] = nbytes
    out = [KeptSaver(block=saver, num_bytes=sum(storages.values())) for saver, storages in sizes.items()]
    return sorted(out, key=lambda k: (-k.num_bytes, k.block))


def variant(profile: Profile, choices: tuple[Choice, ...]) -> Profile:
    """``profile`` (as measured) with ``choices`` made (see the module docstring): the shared
    tensors the code freed before a block counted back in its forward where a checkpoint may hold
    them, as the search's bound does (`revived_profile`), but a dead group's, which none holds;
    the shared tensors a later block saves first, in the forwards after it, but a kept saver's."""
    dead = frozenset().union(*(c.storages for c in choices if isinstance(c, SharedGroup)))
    profile = revived_profile(profile, _AllBut(dead))
    profile = resaved_profile(profile, {c.block for c in choices if isinstance(c, KeptSaver)})
    blocks = list(profile.blocks)
    for choice in choices:
        if isinstance(choice, KeptNeighbour):
            j = choice.block - 1
            blocks[j] = dataclasses.replace(blocks[j], output_held_bytes=0, unavailable=_restricted(
                blocks[j].unavailable, ("recompute", "selective", "offload"), _KEPT))
            continue
        if isinstance(choice, KeptSaver):
            blocks[choice.block] = dataclasses.replace(blocks[choice.block], unavailable=_restricted(
                blocks[choice.block].unavailable, ("recompute", "selective", "offload"), _SAVER))
            continue
        first = blocks[choice.first]
        blocks[choice.first] = dataclasses.replace(first, entry_bytes=first.entry_bytes - choice.num_bytes,
                                                   shared_entry_bytes=first.shared_entry_bytes - choice.num_bytes)
        for j in range(choice.first, len(blocks)):
            if blocks[j].fwd_other_bytes is not None:
                blocks[j] = dataclasses.replace(blocks[j], fwd_other_bytes=blocks[j].fwd_other_bytes + choice.num_bytes)
        for j in sorted(choice.takers):
            blocks[j] = dataclasses.replace(blocks[j], unavailable=_restricted(
                blocks[j].unavailable, ("recompute", "selective"), _DEAD))
    return dataclasses.replace(profile, blocks=tuple(blocks))


def variants(profile: Profile) -> list[Profile]:
    """The search's ``profile`` (`revived_profile` with ``held=None``) and its variants for every
    non-empty subset of its `MAX_CHOICES` largest choices."""
    base = resaved_profile(revived_profile(profile))
    choices: list[Choice] = [*shared_groups(base), *kept_neighbours(base), *kept_savers(base)]
    choices = sorted(choices, key=lambda c: -c.num_bytes)[:MAX_CHOICES]
    subsets = itertools.chain.from_iterable(itertools.combinations(choices, r) for r in range(1, len(choices) + 1))
    return [base, *(variant(profile, subset) for subset in subsets)]


def _restricted(unavailable: tuple[tuple[str, str], ...], kinds: tuple[str, ...], reason: str) -> tuple[tuple[str, str], ...]:
    names = {name for name, _ in unavailable}
    return unavailable + tuple((kind, reason) for kind in kinds if kind not in names)
