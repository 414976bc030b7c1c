"""Strategy handlers, a registry keyed by strategy kind (`Segment.kind`).

A handler is ``handler(runtime, segment, first, extra, kwargs) -> outputs``: it runs blocks
``segment.start..segment.stop-1`` starting from input ``first`` (with the extra positional and
keyword arguments every block receives) and returns one output per block.

Recomputation runs each segment as one `remat.checkpointing.region.checkpointed` call
(non-reentrant, RNG and autocast state preserved; a replay ending with a kept block stops at
its last saved tensor, `Segment.stops_early`). Nested children are
checkpointed in the forward and in the parent's replay alike; by torch's nesting rules (a saved
tensor belongs to the innermost checkpoint, a child's inputs to its parent) the forward then
retains only the parent's input, and the parent's replay retains only the children's inputs and
the blocks kept between them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from remat.apply.runtime import Runtime
from remat.checkpointing.region import checkpointed
from remat.checkpointing.selective import selective_context
from remat.plan.types import Segment

Handler = Callable[[Runtime, Segment, Any, tuple[Any, ...], dict[str, Any]], list[Any]]


def _checkpointed(runtime: Runtime, seg: Segment, body: Callable[[Any], list[Any]], first: Any, extra: tuple[Any, ...],
                  kwargs: dict[str, Any], context_fn: Callable[[], Any] | None = None) -> list[Any]:
    guard = runtime.guards[(seg.start, seg.stop)]  # one per region, made with the runtime
    return checkpointed(body, first, extra, guard=guard, context_fn=context_fn, early_stop=seg.stops_early,
                        kwargs=kwargs)


def run_keep(runtime: Runtime, seg: Segment, first: Any, extra: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """Store what autograd saves: run the blocks as they are."""
    return runtime.run_plain(seg.start, seg.stop, first, extra, kwargs)


def run_recompute(runtime: Runtime, seg: Segment, first: Any, extra: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """Keep only the segment's input; replay its blocks (children checkpointed) in backward."""
    body = lambda f, e: runtime.run_layout(seg, f, e, kwargs)  # noqa: E731
    return _checkpointed(runtime, seg, body, first, extra, kwargs)


def run_selective(runtime: Runtime, seg: Segment, first: Any, extra: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """Save the outputs of the op calls named in ``saved_ops``; recompute the others."""
    body = lambda f, e: runtime.run_plain(seg.start, seg.stop, f, e, kwargs)  # noqa: E731
    context_fn = functools.partial(selective_context, frozenset(seg.saved_ops))
    return _checkpointed(runtime, seg, body, first, extra, kwargs, context_fn)


def run_offload(runtime: Runtime, seg: Segment, first: Any, extra: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """Move each block's saved tensors off the device (`remat.apply.offload.OffloadEngine`)."""
    engine = runtime.options["offload_engines"][seg.strategy.split(":", 1)[1]]

    def context(i: int) -> Any:
        return engine.block_context(runtime.block_names[i], module=runtime.blocks[i])

    return runtime.run_plain(seg.start, seg.stop, first, extra, kwargs, context=context)


HANDLERS: dict[str, Handler] = {
    "keep": run_keep,
    "recompute": run_recompute,
    "selective": run_selective,
    "offload": run_offload,
}
"""Strategy kind -> handler."""
