"""One checkpointed call of a run of blocks, as the applied runtime and the profile's probes run it.

`checkpointed` runs ``body`` inside `torch.utils.checkpoint.checkpoint` with
``use_reentrant=False`` and ``preserve_rng_state=True`` (CPU and device generators restored
before the replay, so dropout masks repeat) and the autocast state of the forward.
``early_stop=False``: the replay runs the whole body, so a region's forward is recomputed
exactly once per backward, the number the planner prices and `remat.verify` counts.

`BufferGuard` keeps buffers (BatchNorm running statistics...) advancing once per step although
the replay runs the forward again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import checkpoint

__all__ = ["BufferGuard", "Body", "EARLY_STOP", "checkpointed"]

EARLY_STOP = False
"""Replay whole regions (see the module docstring): counts and prices stay exact."""
Body = Callable[[Any, tuple[Any, ...]], list[Any]]
"""``body(first, extra) -> outputs``: runs the region's blocks from input ``first``."""


@contextlib.contextmanager
def _outside_modes() -> Iterator[None]:
    """Bookkeeping copies must not be seen by the selective-checkpoint cache (it would expect
    them in the replay) nor counted as the step's ops."""
    with _disable_current_modes(), torch.no_grad():
        yield


class BufferGuard:
    """Undo buffer updates made by a replay (BatchNorm running statistics...).

    The first run of a region is the real forward; every later run is a replay. Which buffers
    a forward changes is found once per region and training mode by comparing values (the
    kernels that update running statistics do not bump version counters) and kept in
    ``known``, shared by every guard of the same blocks. A replay copies those buffers first
    and restores them after, so they advance once per step, as without recomputation."""

    def __init__(self, blocks: Sequence[nn.Module], known: dict[tuple[Any, ...], list[torch.Tensor]],
                 name: tuple[Any, ...] = ()) -> None:
        self.blocks = blocks
        self.known = known
        self.name = name
        """Tells regions apart in ``known`` (the runtime's ``(start, stop)``)."""
        self.calls = 0

    def _key(self) -> tuple[Any, ...]:
        return (*self.name, tuple(m.training for block in self.blocks for m in block.modules()))

    @contextlib.contextmanager
    def run(self) -> Iterator[None]:
        self.calls += 1
        key = self._key()
        known = self.known.get(key)
        if self.calls == 1 and known is None:
            buffers = [b for block in self.blocks for b in block.buffers()]
            with _outside_modes():
                before = [b.detach().clone() for b in buffers]
            yield
            with _outside_modes():
                self.known[key] = [b for b, v in zip(buffers, before) if not torch.equal(b, v)]
            return
        if self.calls == 1 or not known:
            yield
            return
        with _outside_modes():
            saved = [b.detach().clone() for b in known]
        try:
            yield
        finally:
            with _outside_modes():
                for buf, value in zip(known, saved):
                    buf.copy_(value)


def checkpointed(body: Body, first: Any, extra: tuple[Any, ...], *, guard: BufferGuard,
                 context_fn: Callable[[], Any] | None = None) -> list[Any]:
    """``body(first, extra)``'s outputs, computed under one non-reentrant checkpoint that keeps
    only ``first`` and ``extra``; ``context_fn``: torch's (forward, recompute) context pair
    (selective checkpointing)."""

    def region(first: Any, *extra_args: Any) -> tuple[Any, ...]:
        with guard.run():
            return tuple(body(first, extra_args))

    options: dict[str, Any] = {"context_fn": context_fn} if context_fn is not None else {}
    out = checkpoint(region, first, *extra, use_reentrant=False, preserve_rng_state=True,
                     early_stop=EARLY_STOP, **options)
    return list(out)
