"""Selective recomputation: save exactly the op calls a plan names, recompute the rest.

Op calls are named like the profile's op table (`remat.measure.types.OpRecord.key`):
``"<aten overload>#<occurrence>"``, the occurrence counted per overload within one forward of
the block, from 0. The policy is handed to
`torch.utils.checkpoint.create_selective_checkpoint_contexts`; a fresh counter is made for every
checkpointed forward, so the n-th ``aten.mm.default`` of every step maps to the same key.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from remat.checkpointing.cacheable import cacheable

__all__ = ["SavedOpsPolicy", "is_saved", "selective_context"]


class SavedOpsPolicy:
    """``policy(ctx, op, *args, **kwargs)``: MUST_SAVE for the named calls, PREFER_RECOMPUTE otherwise."""

    def __init__(self, saved_ops: frozenset[str]) -> None:
        self.saved_ops = saved_ops
        self.counts: Counter[str] = Counter()
        self.seen: list[str] = []
        """Keys of every call the policy was asked about, in order (for diagnostics and tests)."""

    def key(self, op: Any) -> str:
        name = str(op)
        index = self.counts[name]
        self.counts[name] += 1
        return f"{name}#{index}"

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        key = self.key(op)
        self.seen.append(key)
        return CheckpointPolicy.MUST_SAVE if is_saved(key, self.saved_ops) else CheckpointPolicy.PREFER_RECOMPUTE


def is_saved(key: str, saved_ops: frozenset[str] | set[str]) -> bool:
    """Whether the op call ``key`` keeps its output under a plan saving ``saved_ops``: named and
    `remat.checkpointing.cacheable.cacheable` by its overload. Plans name no call whose output is
    written later (the planner reads that from the profile, `OpRecord.mutated_later`)."""
    return key in saved_ops and cacheable(key.rsplit("#", 1)[0])


def selective_context(saved_ops: frozenset[str]) -> tuple[Any, Any]:
    """The (forward, recompute) context pair for one checkpointed call."""
    return create_selective_checkpoint_contexts(SavedOpsPolicy(saved_ops))
