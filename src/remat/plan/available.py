"""Strategies a block cannot run: the planner never picks them.

A profile marks a strategy unavailable for a block when its probe raised there, and every
strategy but keep for a block whose backward never ran (`remat.measure.types.NO_BACKWARD`)
(`remat.measure.types.BlockProfile.unavailable`). The optimal search leaves such options out
(`remat.plan.search`); the fixed planners (``full``, ``sqrt``, ``selective:<policy>``...) ask
for one strategy everywhere, so `fall_back` gives each block that cannot run it the nearest it
can: selective -> recompute -> keep, and a recompute segment is split around the blocks it
cannot replay. `check_available` is the last word: a plan naming an unavailable strategy is an
error, never a crash in the training step.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

from remat.checkpointing.caches import PREFILLED_CACHE, SHARED_CACHE
from remat.measure.types import BACKWARD_TWICE, GRADIENT_GRAPH, NO_BACKWARD, OWN_GENERATOR, WRITES_INPUT, Profile
from remat.plan.types import Segment

__all__ = ["check_available", "fall_back", "unavailable_blocks", "warn_fallen_back", "explained"]


def unavailable_blocks(profile: Profile, segment: Segment) -> list[tuple[int, str]]:
    """``(block index, reason)`` of the blocks of ``segment`` (children included) that cannot run
    its strategy."""
    found = [(i, profile.blocks[i].unavailable_reason(segment.strategy)) for i in range(segment.start, segment.stop)]
    found = [(i, reason) for i, reason in found if reason is not None]
    for child in segment.children:
        found += unavailable_blocks(profile, child)
    return found


def check_available(profile: Profile, segments: Sequence[Segment]) -> None:
    """ValueError naming the first block of ``segments`` whose strategy cannot run there, and why."""
    for seg in segments:
        for index, reason in unavailable_blocks(profile, seg):
            raise ValueError(
                f"block {profile.blocks[index].name!r} cannot run {seg.strategy!r}: "
                f"{explained(reason)}. "
                "Plan another strategy for it (the planners do: remat.plan(profile, ...))."
            )


def explained(reason: str) -> str:
    """An unavailable strategy's reason as a clause: the profile's own words, or what a probe raised."""
    own = reason in (NO_BACKWARD, GRADIENT_GRAPH, BACKWARD_TWICE, PREFILLED_CACHE, SHARED_CACHE, WRITES_INPUT) or reason.startswith(OWN_GENERATOR)
    return reason if own else f"its probe raised {reason}"


def warn_fallen_back(profile: Profile, segments: Sequence[Segment]) -> None:
    """A UserWarning naming the blocks of ``segments`` that cannot run their strategy, and why
    (`fall_back` gives them the nearest they can)."""
    found = [(seg.strategy, i, reason) for seg in segments for i, reason in unavailable_blocks(profile, seg)]
    if not found:
        return
    strategy, index, reason = found[0]
    others = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    warnings.warn(
        f"block {profile.blocks[index].name!r}{others} cannot run {strategy!r}: {explained(reason).rstrip('.')}. It runs the "
        "nearest strategy it can (selective -> recompute -> keep); plan.block_strategies() shows what each block runs.",
        UserWarning, stacklevel=3)


def fall_back(profile: Profile, segments: Sequence[Segment]) -> tuple[Segment, ...]:
    """``segments`` with every block that cannot run its segment's strategy given the nearest
    strategy it can run (selective -> recompute -> keep); a recompute segment is split into runs
    of blocks it can replay, the others kept. Segments that run everywhere are returned as they are."""
    out: list[Segment] = []
    for seg in segments:
        if not unavailable_blocks(profile, seg):
            out.append(seg)
        elif seg.kind == "recompute":
            out += _split(profile, seg)
        else:
            out.append(_nearest(profile, seg))
    return tuple(out)


def _nearest(profile: Profile, seg: Segment) -> Segment:
    """A single-block segment's nearest available strategy (offload and selective: recompute,
    then keep)."""
    recompute = Segment(start=seg.start, stop=seg.stop, strategy="recompute")
    return recompute if not unavailable_blocks(profile, recompute) else Segment(start=seg.start, stop=seg.stop,
                                                                                 strategy="keep")


def _split(profile: Profile, seg: Segment) -> list[Segment]:
    """Runs of blocks of ``seg`` that can be replayed, recomputed (without children); the others kept."""
    out: list[Segment] = []
    for i in range(seg.start, seg.stop):
        kind = "keep" if profile.blocks[i].unavailable_reason("recompute") else "recompute"
        if out and out[-1].strategy == kind == "recompute":
            out[-1] = dataclasses.replace(out[-1], stop=i + 1)
        else:
            out.append(Segment(start=i, stop=i + 1, strategy=kind))
    return out
