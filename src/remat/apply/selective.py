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


ALLOCATION_OPS = frozenset({"aten.empty_like", "aten.empty", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided"})
"""Ops that only allocate: their outputs are filled in place afterwards (a dropout mask is
``empty_like`` + ``bernoulli_`` + ``div_``), so a cached output would be mutated, which
selective checkpointing forbids. They cost nothing to replay, so they are always replayed;
to keep such a value, a plan names the last in-place op that writes it (``div_``)."""


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
    """Whether the op call ``key`` keeps its output under a plan saving ``saved_ops``.

    Allocation ops and in-place ops (``bernoulli_``, ``div_``: their output is their input)
    are always replayed. Caching them is unsound: the replay of ``dropout`` fills the tensor it
    allocated (``noise.bernoulli_(); noise.div_()``), not the value an op returns, so a cached
    in-place op would leave that tensor unfilled."""
    packet = key.rsplit("#", 1)[0].rsplit(".", 1)[0]
    return key in saved_ops and packet not in ALLOCATION_OPS and not packet.endswith("_")


def selective_context(saved_ops: frozenset[str]) -> tuple[Any, Any]:
    """The (forward, recompute) context pair for one checkpointed call."""
    return create_selective_checkpoint_contexts(SavedOpsPolicy(saved_ops))
