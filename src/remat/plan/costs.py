"""Per-block cost of a strategy: a registry keyed by strategy kind.

A cost function ``fn(profile, block_index, segment) -> BlockCost`` says what one block of
``segment`` holds and spends under the segment's strategy. `remat.plan.predict` combines
these along the chain (nesting, peaks); planners read them for their options. Offload costs
live in `remat.plan.offload_cost`, which registers the ``offload`` kind when imported.

Memory terms follow ../DESIGN.md "The memory model":
- ``retained_bytes``: what the block still holds while backward runs the blocks after it;
- ``working_bytes``: what its own backward needs on top (saved bytes rematerialized +
  backward temporaries).

Both count the block's dataflow terms (`remat.measure.dataflow`): whatever the strategy, the
block holds its ``entry_bytes`` (the code before it saved them, the block before it handed them
off, or they are shared tensors it takes first); kept, it holds its saved bytes less the ones
it hands off; checkpointed, its ``held_input_bytes``. The backward of the code before a block
runs right after the block's own, on top of the same earlier blocks: its need
(`between_phase_bytes`) is a lower bound on the block's working set.
"""

from __future__ import annotations

import importlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Callable

import numpy as np

from remat.measure.types import BlockProfile, Profile
from remat.plan.phases import (between_phase_bytes, code_held_bytes, held_bwd_temp_bytes, held_input_bytes, keep_working_bytes, previous_held_bytes,
                               replay_base_bytes, replay_stop, replay_working_bytes, saved_input_bytes, stopped_replay_flops, stopped_replay_ms,
                               stopped_replay_working_bytes, working_bytes)
from remat.plan.policies import op_cacheable, op_storages
from remat.plan.types import Segment

__all__ = [
    "BlockCost",
    "CostFn",
    "register_cost",
    "cost_of",
    "has_cost",
    "working_bytes",  # `remat.plan.phases`' two oldest names, kept here for their callers
    "replay_working_bytes",
    "selective_saved_bytes",
    "cached_ops",
    "reached_saved_ops",
    "SelectivePrices",
    "selective_cost",
    "selective_prices",
    "selective_working_bytes",
    "selective_working_parts",
    "clear_cost_cache",
]


@dataclass(kw_only=True, frozen=True)
class BlockCost:
    """What one block costs under one strategy."""

    retained_bytes: int
    """Bytes held while backward runs the blocks after this one."""
    working_bytes: int
    """Bytes its own backward needs on top of everything retained before it."""
    extra_ms: float
    """Time added to the step (one replay for recompute; exposed transfer for offload)."""
    extra_flops: int
    """FLOPs added to the step."""
    offloaded_bytes: int = 0
    """Bytes moved off the device per step."""
    forward_bytes: int | None = None
    """Of ``working_bytes`` (the larger of the two), the block's own forward's, where that is apart
    from its backward's (selective: its checkpointed forward, which the later blocks' gradients,
    live in its backward, do not reach; None: ``working_bytes`` counts both)."""
    backward_bytes: int | None = None
    """Likewise its backward's."""


CostFn = Callable[[Profile, int, Segment], BlockCost]
_REGISTRY: dict[str, CostFn] = {}
_PROVIDERS = {"offload": "remat.plan.offload_cost"}
"""Modules that register a kind when imported (kinds that live outside this module)."""


def register_cost(kind: str) -> Callable[[CostFn], CostFn]:
    """Decorator: register ``fn`` as the cost of strategy kind ``kind`` (``keep``, ``offload``...)."""

    def wrap(fn: CostFn) -> CostFn:
        if kind in _REGISTRY and _REGISTRY[kind] is not fn:
            raise ValueError(f"a cost for strategy kind {kind!r} is already registered ({_REGISTRY[kind].__name__}).")
        _REGISTRY[kind] = fn
        return fn

    return wrap


def has_cost(kind: str) -> bool:
    """True when a cost is registered for ``kind`` (importing its provider module if any)."""
    if kind not in _REGISTRY and kind in _PROVIDERS:
        try:
            importlib.import_module(_PROVIDERS[kind])
        except ModuleNotFoundError as err:
            if err.name != _PROVIDERS[kind]:
                raise
    return kind in _REGISTRY


def cost_of(profile: Profile, block_index: int, segment: Segment) -> BlockCost:
    """Cost of block ``block_index`` under ``segment``'s strategy."""
    if not has_cost(segment.kind):
        raise ValueError(
            f"no cost model for strategy {segment.strategy!r} is installed; known kinds: "
            f"{sorted(_REGISTRY)}. Offload costs come with remat.plan.offload_cost."
        )
    return _REGISTRY[segment.kind](profile, block_index, segment)


def cached_ops(block: BlockProfile, saved_ops: tuple[str, ...]) -> frozenset[str]:
    """The named op calls whose outputs selective checkpointing really keeps and fetches: the
    named ones that can be cached (`remat.plan.policies.op_cacheable`: the rule the runtime
    applies) and that the block's early-stopping replay reaches (`remat.plan.phases.replay_stop`:
    a call past it would be cached and never fetched; `remat.plan.planners.make_plan` leaves such
    calls out of a plan's ``saved_ops``)."""
    index = {op.key: i for i, op in enumerate(block.ops)}
    unknown = [key for key in saved_ops if key not in index]
    if unknown:
        raise ValueError(
            f"block {block.name!r} has no op call(s) {unknown}; known keys look like "
            f"{[op.key for op in block.ops[:3]]}. Regenerate the plan from this model's profile."
        )
    stop = replay_stop(block)
    return frozenset(key for key in saved_ops if index[key] < stop and op_cacheable(block.ops[index[key]]))


def reached_saved_ops(block: BlockProfile, saved_ops: tuple[str, ...]) -> tuple[str, ...]:
    """``saved_ops`` less the calls the block's early-stopping replay does not reach (`cached_ops`):
    what a plan names. Unknown keys are kept, for `cached_ops` to report."""
    index = {op.key: i for i, op in enumerate(block.ops)}
    stop = replay_stop(block)
    return tuple(key for key in saved_ops if index.get(key, -1) < stop)


def selective_saved_bytes(block: BlockProfile, saved_ops: tuple[str, ...]) -> int:
    """Bytes of the distinct storages the cached op calls keep alive (`cached_ops`): a call's
    outputs keep their whole storages, shared storages count once (a view of a matmul's output
    holds the matmul's storage)."""
    return sum(cached_storages(block, saved_ops).values())


def _cached_storages(block: BlockProfile, cached: frozenset[str]) -> dict[object, int]:
    """Storage id -> bytes of the storages the cached calls keep alive, less those the block's
    autograd graph holds anyway (`BlockProfile.graph_held_storages`: a custom Function's ctx
    attribute; caching one measured nothing more, priced as one more storage it was 5.8 % over:
    tests/measure/test_graph_held.py)."""
    storages: dict[object, int] = {}
    for i, op in enumerate(block.ops):
        if op.key in cached:
            storages.update(op_storages(i, op))
    for sid in block.graph_held_storages:
        storages.pop(sid, None)
    return storages


def cached_storages(block: BlockProfile, saved_ops: tuple[str, ...]) -> dict[object, int]:
    """Storage id -> bytes of what a selective strategy saving ``saved_ops`` keeps alive
    (`selective_saved_bytes`'s storages)."""
    return _cached_storages(block, cached_ops(block, saved_ops))


def call_storages(block: BlockProfile, calls: Collection[str]) -> set[object]:
    """Ids of the storages the outputs of ``calls`` live in (as `_cached_storages` names them: a
    view's is the viewed storage's)."""
    return {s for i, op in enumerate(block.ops) if op.key in calls for s in (op.storage_ids or (("op", i),))}


def cached_held_bytes(block: BlockProfile, cached: frozenset[str], calls: tuple[str, ...]) -> int:
    """Bytes of the storages the ``cached`` calls keep alive (`_cached_storages`) that the outputs
    of ``calls`` live in: what the model's code holds of them anyway."""
    if not cached or not calls:
        return 0
    held = call_storages(block, set(calls))
    return sum(nbytes for sid, nbytes in _cached_storages(block, cached).items() if sid in held)


def _escaping_storages(block: BlockProfile, cached: frozenset[str]) -> dict[object, int]:
    """Storages of the cached calls that outlive the block (its output: `op_storages` leaves
    them to the next block's input). Until the replay reaches their call, the cache is what holds
    them: whoever else took them (the next block's saved input, a skip, the head) has run its
    backward by then."""
    storages: dict[object, int] = {}
    for op in block.ops:
        if op.key in cached and op.storage_ids and op.storage_escapes:
            storages.update({s: b for s, b, out in zip(op.storage_ids, op.storage_bytes, op.storage_escapes) if out})
    return storages


@register_cost("keep")
def _keep(profile: Profile, block_index: int, segment: Segment) -> BlockCost:
    """Its saved bytes, less what it hands off to the block after it, plus its entry bytes.
    Working: `keep_working_bytes` (a bound on its forward wherever the block sits;
    `remat.plan.predict` knows the block's place and neighbour and prices it exactly)."""
    block = profile.blocks[block_index]
    retained = block.saved_bytes - block.handoff_bytes + block.entry_bytes
    working = keep_working_bytes(profile, block_index)
    return BlockCost(retained_bytes=retained, working_bytes=working, extra_ms=0.0, extra_flops=0)


@register_cost("recompute")
def _recompute(profile: Profile, block_index: int, segment: Segment) -> BlockCost:
    """One replay of the block plus the checkpoint's own overhead (hooks, RNG state: measured
    in `remat.measure.overhead`), of which the segment's first block alone pays the part one
    checkpointed call costs (`Profile.checkpoint_call_ms`); only the segment's first block holds
    something (its held input and its entry bytes: a segment never starts after a block that
    hands off to something beyond the block after it, `remat.plan.joins`). The last block of a
    segment that stops early (`Segment.stops_early`) replays its forward up to its last saved
    tensor (`remat.plan.phases.stopped_replay_ms`). A later block holds the input the model's code
    keeps through the backward (`BlockProfile.input_code_held_bytes`): the replay makes it again
    beside it."""
    block = profile.blocks[block_index]
    first = block_index == segment.start
    stopped = segment.stops_early and block_index == segment.stop - 1
    return BlockCost(
        retained_bytes=held_input_bytes(block) + block.entry_bytes if first else block.input_code_held_bytes,
        working_bytes=stopped_replay_working_bytes(block) if stopped else replay_working_bytes(block),
        extra_ms=(stopped_replay_ms(block) if stopped else block.fwd_ms) + block.recompute_overhead_ms
        - (0.0 if first else profile.checkpoint_call_ms),
        extra_flops=stopped_replay_flops(block) if stopped else block.fwd_flops,
    )


@register_cost("selective")
def _selective(profile: Profile, block_index: int, segment: Segment) -> BlockCost:
    """Hold the input and the storages of the cached ops' outputs; replay the other (non-view)
    ops, the named ones that cannot be cached included. Time: the replayed ops plus the selective
    machinery's dispatch on every op of the forward and the replay, plus the cache's share for
    the share of cacheable calls saved (`remat.measure.overhead`). Priced by `selective_prices`,
    the one formula the optimal search also uses."""
    return selective_cost(profile.blocks[block_index], segment.saved_ops,
                           previous_held_bytes(profile, block_index, previous_kept=False))


_SELECTIVE_COSTS: dict[tuple[int, tuple[str, ...], int], tuple[BlockProfile, BlockCost]] = {}
"""`selective_cost`'s results by block identity (hashing a block's op table costs more than a
lookup should): predict prices each block's option several times per plan."""


def clear_cost_cache() -> None:
    """Forget cached selective costs (benchmarks time cold planning)."""
    _SELECTIVE_COSTS.clear()


def selective_cost(block: BlockProfile, saved_ops: tuple[str, ...], previous_held: int = 0, unheld: int = 0) -> BlockCost:
    """A selective block's cost; ``previous_held``: the outputs of the block before it the code
    holds through its forward (`remat.plan.phases.previous_held_bytes`); ``unheld``: the shared
    tensors no checkpoint holds that the caller takes off the working set (`selective_working_bytes`)."""
    hit = _SELECTIVE_COSTS.get((id(block), saved_ops, previous_held, unheld))
    if hit is not None and hit[0] is block:
        return hit[1]
    if len(_SELECTIVE_COSTS) >= 65536:
        _SELECTIVE_COSTS.clear()
    prices = selective_prices([block], [saved_ops], previous_held, unheld)
    cost = BlockCost(
        retained_bytes=int(prices.retained_bytes[0]),
        working_bytes=int(prices.working_bytes[0]),
        extra_ms=float(prices.extra_ms[0, 0]),
        extra_flops=int(prices.extra_flops[0]),
        forward_bytes=int(prices.forward_bytes[0]),
        backward_bytes=int(prices.backward_bytes[0]),
    )
    _SELECTIVE_COSTS[(id(block), saved_ops, previous_held, unheld)] = (block, cost)
    return cost


def selective_working_bytes(block: BlockProfile, cached: Sequence[dict[object, int]],
                            escaping: Sequence[dict[object, int]] | None = None, previous_held: int = 0,
                            unheld: int = 0) -> np.ndarray:
    """Working sets of a selective block for each of ``cached`` (storage id -> bytes of the
    storages its cached op calls keep alive: `selective_saved_bytes`'s storages): the larger of
    its backward's and its forward's (`selective_working_parts`)."""
    return np.maximum(*selective_working_parts(block, cached, escaping, previous_held, unheld))


def selective_working_parts(block: BlockProfile, cached: Sequence[dict[object, int]],
                            escaping: Sequence[dict[object, int]] | None = None, previous_held: int = 0,
                            unheld: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(backward, forward): the working sets of a selective block's backward (its replay, and the
    backward of the code before it) and of its forward, for each of ``cached``.

    The replay runs the block's forward again with the cached outputs already there: torch's
    selective checkpointing holds each from the forward until the replay reaches its call, then
    drops it (the entry becomes ``_CONSUMED``), after which it lives as in a plain forward, and
    the backward frees as a plain one does. At a moment of the replay the block holds the plain
    forward's live bytes then (`BlockProfile.fwd_live_bytes`) plus the cached outputs of the
    calls still ahead, before the first call all of them: the replay's peak is its plain peak
    (``saved_bytes + fwd_temp_bytes``) plus how far that curve rises above it, with the output's
    gradient on top; the replay stops at the block's last saved tensor (`Segment.stops_early`),
    so both are read from the curve up to there. On the built-in GPT, attention-core's replay of
    QK^T, softmax and dropout runs while the cached MLP outputs (16 MiB) are held: 9.5 % of the
    step's peak. The block's
    forward is bounded too, from the checkpointed forward's own curve
    (`BlockProfile.checkpointed_fwd_live_bytes`) plus the cached outputs made so far; its need
    counts against what earlier blocks hold, as the backward's does, with the later blocks'
    gradients: a bound. Without the curve (older profiles): the replay's working set plus every
    cached byte, an upper bound. ``escaping``: per choice, the cached storages that outlive the
    block (`_escaping_storages`): held by the cache alone when the replay starts, until the
    replay reaches their call (a ResNet's strided unit caching its output measured 73 KiB above
    the prediction before). ``previous_held``: what the model's code holds of the block before
    through this block's forward (`remat.plan.phases.previous_held_bytes`), on its forward.
    ``unheld``: the shared tensors no checkpoint holds (`remat.plan.predict.dead_shared_bytes`),
    which the caller takes off the working set, as the backward does not hold them: its forward
    counts them as the code's (`remat.plan.phases.code_held_bytes`), as a recomputed block's does,
    so that taken off they leave it as the code ran it (LW-DETR's last decoder layer with LoRA,
    selective, measured 2.2 % above its prediction, its forward's shared tensors taken off twice)."""
    escaping = escaping if escaping is not None else [{} for _ in cached]
    totals = np.array([sum(c.values()) for c in cached], dtype=np.int64)
    replay_totals = totals + np.array([sum(e.values()) for e in escaping], dtype=np.int64)
    curve = np.array(block.fwd_live_bytes, dtype=np.int64)
    if curve.size == 0 or curve.size != len(block.ops):
        return replay_working_bytes(block) + replay_totals, replay_working_bytes(block) + replay_totals
    stop = replay_stop(block)
    created: dict[object, int] = {}
    for i, op in enumerate(block.ops):
        for sid in (op.storage_ids or op_storages(i, op)):
            created.setdefault(sid, i)
    saved = {sid for sid, _ in block.bwd_free_order if sid >= 0}
    made = np.zeros((len(cached), curve.size), dtype=np.int64)  # cached bytes first made at each call
    unsaved = np.zeros_like(made)  # of those, the ones autograd does not keep
    for k, storages in enumerate(cached):
        for sid, nbytes in storages.items():
            made[k, created.get(sid, 0)] += nbytes
            if sid not in saved:
                unsaved[k, created.get(sid, 0)] += nbytes
    made_outliving = np.zeros_like(made)  # the block's own outputs, cached
    for k, storages in enumerate(escaping):
        for sid, nbytes in storages.items():
            made_outliving[k, created.get(sid, 0)] += nbytes
    ahead = replay_totals[:, None] - np.cumsum(made + made_outliving, axis=1)  # after call t: cached outputs of calls > t
    # the replay stops at `replay_stop` (its cached calls all come before it): its curve is cut
    # there, and falls by how far the whole curve rises above the cut one
    reached = curve[:stop]
    top = int(reached.max()) if reached.size else 0
    held = np.maximum((reached[None, :] + ahead[:, :stop]).max(axis=1, initial=0), replay_totals)  # before the first call
    rise = np.maximum(held - top, 0)
    replay = block.fwd_temp_bytes - (int(curve.max()) - top) + replay_base_bytes(block) + saved_input_bytes(block) + rise
    own = block.entry_bytes + block.unsaved_input_bytes
    backward = (block.saved_bytes + block.replay_saved_extra_bytes + own  # its checkpoint holds its inputs
                + np.maximum(held_bwd_temp_bytes(block), replay))
    # the forward itself: autograd holds nothing (checkpointed), the cache holds what it caches
    # (on the built-in GPT, save-matmuls caches QK^T's 8 MiB: its last block's forward is the
    # step's peak, 3.3 % above the backward's). Two bounds at each call, the lesser kept: the
    # plain curve plus the cached outputs autograd would not have kept, made by then (it counts
    # saved storages the checkpointed forward has dropped); the checkpointed forward's measured
    # curve plus every cached output made by then (an output cached and still in use counts twice)
    held_then = curve[None, :] + np.cumsum(unsaved, axis=1)
    checkpointed = np.array(block.checkpointed_fwd_live_bytes, dtype=np.int64)
    if checkpointed.size == curve.size:
        held_then = np.minimum(held_then, checkpointed[None, :] + np.cumsum(
            _outliving(block, cached, created, made), axis=1))
    # what the checkpointed forward starts beside: its held inputs and what the code holds beyond
    # them, as a recomputed block's (`remat.plan.phases.segment_forward_bytes`); ``fwd_other_bytes``
    # alone may be below them (LW-DETR's last decoder layer: -112 KiB, its step 3.7 % under)
    live = held_input_bytes(block) + code_held_bytes(block, unheld)
    # or the code between the block before and this one, before it starts (`between_fwd_peak_bytes`)
    forward = live + block.entry_bytes + previous_held + block.unreached_fwd_bytes + np.maximum(
        held_then.max(axis=1), block.between_fwd_peak_bytes)
    return np.maximum(backward, between_phase_bytes(block)), forward


def _outliving(block: BlockProfile, cached: Sequence[dict[object, int]], created: dict[object, int],
               made: np.ndarray) -> np.ndarray:
    """(K, calls): the cached bytes a selective forward holds beyond the checkpointed forward's
    curve, by the call they start at: each cached storage from the call the checkpointed forward
    freed it at (`BlockProfile.checkpointed_fwd_freed_at`); while that forward still holds it,
    the curve counts it. Without the free points, or with a different number of storages than
    the op table names (the two forwards did not make the same storages): from the call that
    made it (an upper bound)."""
    freed_at = block.checkpointed_fwd_freed_at
    calls = made.shape[1]
    named = 1 + max((sid for op in block.ops for sid in op.storage_ids), default=-1)
    if not freed_at or len(freed_at) != named:
        return made
    extra = np.zeros_like(made)
    for k, storages in enumerate(cached):
        for sid, nbytes in storages.items():
            at = created.get(sid, 0)
            if isinstance(sid, int) and 0 <= sid < len(freed_at):
                at = max(freed_at[sid], at)
            if at < calls:
                extra[k, at] += nbytes
    return extra


@dataclass(kw_only=True, frozen=True)
class SelectivePrices:
    """`_selective`'s cost of K saved-op choices on B blocks alike in structure (equal op tables
    but for times): bytes and FLOPs per choice, milliseconds per block and choice."""

    retained_bytes: np.ndarray
    """(K,) int."""
    working_bytes: np.ndarray
    """(K,) int."""
    forward_bytes: np.ndarray
    """(K,) int: of ``working_bytes``, the forward's (`selective_working_parts`)."""
    backward_bytes: np.ndarray
    """(K,) int: the backward's."""
    extra_flops: np.ndarray
    """(K,) int."""
    extra_ms: np.ndarray
    """(B, K) float."""


def selective_prices(blocks: Sequence[BlockProfile], saved_ops: Sequence[tuple[str, ...]],
                     previous_held: int = 0, unheld: int = 0) -> SelectivePrices:
    """Cost of saving each of ``saved_ops`` (op keys) in each of ``blocks``; the blocks must be
    alike in structure (the first one's bytes, FLOPs and cached storages are used for all).

    Working set: the replay's, plus what the cached storages add by staying alive through the
    block's whole backward (`selective_working_bytes`); ``previous_held``: the blocks' own
    `remat.plan.phases.previous_held_bytes` (equal within a structure class)."""
    first = blocks[0]
    replayed = np.zeros((len(saved_ops), len(first.ops)))
    cached_bytes = np.zeros(len(saved_ops), dtype=np.int64)
    num_cached = np.zeros(len(saved_ops))
    views = np.array([op.is_view for op in first.ops], dtype=bool)
    storages: list[dict[object, int]] = []
    escaping: list[dict[object, int]] = []
    for k, keys in enumerate(saved_ops):
        cached = cached_ops(first, keys)
        replayed[k] = [op.key not in cached for op in first.ops]
        storages.append(_cached_storages(first, cached))
        escaping.append(_escaping_storages(first, cached))
        cached_bytes[k] = sum(storages[-1].values())
        num_cached[k] = len(cached)
    replayed[:, views] = 0.0
    stop = replay_stop(first)
    replayed[:, stop:] = 0.0  # the replay stops early (`Segment.stops_early`)
    times = np.array([[op.time_ms for op in b.ops] for b in blocks], dtype=float).reshape(len(blocks), -1)
    flops = np.array([op.flops for op in first.ops], dtype=np.int64)
    select = np.array([b.selective_overhead_ms for b in blocks])[:, None]
    cache = np.array([b.selective_cache_overhead_ms for b in blocks])[:, None]
    cacheable_calls = max(sum(op_cacheable(op) for op in first.ops), 1)
    # a sum over each row's own ops: the same rounding for one block and for many (rows in
    # chunks of about 4M products)
    ms = np.empty((len(blocks), len(saved_ops)))
    step = max(1, 4_000_000 // max(replayed.size, 1))
    for lo in range(0, len(blocks), step):
        ms[lo : lo + step] = (times[lo : lo + step, None, :] * replayed[None, :, :]).sum(axis=2)
    # the dispatch mode runs on every call of the forward and of the replay, which stops early
    calls = len(first.ops)
    ms += select * ((calls + stop) / (2 * calls) if calls else 1.0) + cache * num_cached[None, :] / cacheable_calls
    backward, forward = selective_working_parts(first, storages, escaping, previous_held, unheld)
    return SelectivePrices(
        retained_bytes=held_input_bytes(first) + first.entry_bytes + cached_bytes,
        working_bytes=np.maximum(backward, forward),
        forward_bytes=forward,
        backward_bytes=backward,
        extra_flops=(replayed.astype(np.int64) * flops[None, :]).sum(axis=1),
        extra_ms=ms,
    )
