"""Shared tensors no block saves (a mask): priced as `remat.plan.predict` prices them.

A tensor several blocks take and none saves (an attention mask, rotary tables) is live past the
forward only while a checkpoint of one of its takers holds it. The costs count it from its first
taker on whatever the plan (`remat.plan.costs`: the taker's ``entry_bytes``), a bound; the
prediction leaves it out of the backward of a plan in which no taker is in a recompute or
selective segment (`remat.plan.predict.dead_shared_bytes`). The chain DPs cannot see that
(it depends on the strategies of blocks far apart), so the byte-exact search solves one problem
per set of such tensors assumed dead (`dead_variant`): their takers restricted to the strategies
that hold no checkpoint (keep, offload), their bytes left out of the first taker's held bytes and
added to the forward of it and of every block after it (live there, as the prediction counts
them). Each layout of the plan space is then priced exactly in the variant of the tensors it
leaves dead, and the least time over the variants at each need is the exact curve.

Tensors taken by the same blocks form one group; `MAX_DEAD_GROUPS` groups, the largest first, get
variants (2^groups problems), the others stay counted from their first taker (a bound).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from remat.measure.types import Profile

__all__ = ["SharedGroup", "shared_groups", "dead_variant", "dead_variants", "MAX_DEAD_GROUPS"]

MAX_DEAD_GROUPS = 3
"""Groups of shared tensors the exact search solves both ways (held or dead): 2^3 problems at most."""
_REASON = "a variant of the search in which no checkpoint holds the shared tensors this block takes"


@dataclass(kw_only=True, frozen=True)
class SharedGroup:
    """Shared tensors no block saves, taken by the same blocks."""

    takers: frozenset[int]
    """Blocks that take them."""
    first: int
    """The block that counts them (its ``shared_entry_bytes``)."""
    num_bytes: int
    """Their bytes."""


def shared_groups(profile: Profile) -> list[SharedGroup]:
    """Groups of the shared tensors the costs count (``counted == "shared"``), largest first."""
    takers: dict[int, set[int]] = {}
    for block in profile.blocks:
        for arg in block.inputs:
            takers.setdefault(arg.storage, set()).add(block.index)
    sizes: dict[tuple[frozenset[int], int], int] = {}
    for block in profile.blocks:
        shared = {arg.storage: arg.storage_bytes for arg in block.inputs if arg.counted == "shared"}
        for storage, num_bytes in shared.items():
            key = (frozenset(takers[storage]), block.index)
            sizes[key] = sizes.get(key, 0) + num_bytes
    groups = [SharedGroup(takers=t, first=f, num_bytes=b) for (t, f), b in sizes.items() if b > 0]
    return sorted(groups, key=lambda g: (-g.num_bytes, g.first, sorted(g.takers)))


def dead_variant(profile: Profile, dead: tuple[SharedGroup, ...]) -> Profile:
    """``profile`` with the groups ``dead``: their takers keep or offload only, their bytes out of
    the first taker's entry bytes and in the forward of every block from it on."""
    blocks = list(profile.blocks)
    for group in dead:
        first = blocks[group.first]
        blocks[group.first] = dataclasses.replace(first, entry_bytes=first.entry_bytes - group.num_bytes,
                                                  shared_entry_bytes=first.shared_entry_bytes - group.num_bytes)
        for j in range(group.first, len(blocks)):
            if blocks[j].fwd_other_bytes is not None:
                blocks[j] = dataclasses.replace(blocks[j], fwd_other_bytes=blocks[j].fwd_other_bytes + group.num_bytes)
        for j in sorted(group.takers):
            blocks[j] = dataclasses.replace(blocks[j], unavailable=_restricted(blocks[j].unavailable))
    return dataclasses.replace(profile, blocks=tuple(blocks))


def dead_variants(profile: Profile) -> list[Profile]:
    """``profile`` and its variants for every subset of its `MAX_DEAD_GROUPS` largest groups."""
    groups = shared_groups(profile)[:MAX_DEAD_GROUPS]
    subsets = itertools.chain.from_iterable(itertools.combinations(groups, r) for r in range(1, len(groups) + 1))
    return [profile, *(dead_variant(profile, subset) for subset in subsets)]


def _restricted(unavailable: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    names = {name for name, _ in unavailable}
    return unavailable + tuple((kind, _REASON) for kind in ("recompute", "selective") if kind not in names)
