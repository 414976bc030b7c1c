"""Per-block cost of a strategy: a registry keyed by strategy kind.

A cost function ``fn(profile, block_index, segment) -> BlockCost`` says what one block of
``segment`` holds and spends under the segment's strategy. `remat.plan.predict` combines
these along the chain (nesting, peaks); planners read them for their options. Offload costs
live in `remat.plan.offload_cost`, which registers the ``offload`` kind when imported.

Memory terms follow ../DESIGN.md "The memory model":
- ``retained_bytes``: what the block still holds while backward runs the blocks after it;
- ``working_bytes``: what its own backward needs on top (saved bytes rematerialized +
  backward temporaries).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

import numpy as np

from remat.measure.types import BlockProfile, Profile
from remat.plan.policies import cacheable, op_storages
from remat.plan.types import Segment

__all__ = [
    "BlockCost",
    "CostFn",
    "register_cost",
    "cost_of",
    "has_cost",
    "working_bytes",
    "replay_working_bytes",
    "selective_saved_bytes",
    "cached_ops",
    "SelectivePrices",
    "selective_prices",
    "selective_working_bytes",
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


def working_bytes(block: BlockProfile) -> int:
    """Bytes a block's backward needs: its saved bytes plus its backward temporaries.

    The block's input is assumed to be among its saved bytes (the first op of a block saves
    its input), so a recomputed block's held input is not counted twice.
    """
    return block.saved_bytes + block.bwd_temp_bytes


def replay_working_bytes(block: BlockProfile) -> int:
    """Bytes a block needs when its forward is replayed in backward: its saved bytes plus the
    larger of its backward temporaries and its forward temporaries with the gradient of its
    output, which is already there while the replay runs (the replay's peak)."""
    return block.saved_bytes + max(block.bwd_temp_bytes, block.fwd_temp_bytes + block.output_grad_bytes)


def cached_ops(block: BlockProfile, saved_ops: tuple[str, ...]) -> frozenset[str]:
    """The named op calls whose outputs selective checkpointing really keeps: the named ones
    that are `remat.plan.policies.cacheable` (the rule `remat.apply.selective` applies)."""
    by_key = {op.key: op for op in block.ops}
    unknown = [key for key in saved_ops if key not in by_key]
    if unknown:
        raise ValueError(
            f"block {block.name!r} has no op call(s) {unknown}; known keys look like "
            f"{[op.key for op in block.ops[:3]]}. Regenerate the plan from this model's profile."
        )
    return frozenset(key for key in saved_ops if cacheable(by_key[key].name))


def selective_saved_bytes(block: BlockProfile, saved_ops: tuple[str, ...]) -> int:
    """Bytes of the distinct storages the cached op calls keep alive (`cached_ops`): a call's
    outputs keep their whole storages, shared storages count once (a view of a matmul's output
    holds the matmul's storage)."""
    return sum(_cached_storages(block, cached_ops(block, saved_ops)).values())


def _cached_storages(block: BlockProfile, cached: frozenset[str]) -> dict[object, int]:
    storages: dict[object, int] = {}
    for i, op in enumerate(block.ops):
        if op.key in cached:
            storages.update(op_storages(i, op))
    return storages


@register_cost("keep")
def _keep(profile: Profile, block_index: int, segment: Segment) -> BlockCost:
    block = profile.blocks[block_index]
    return BlockCost(retained_bytes=block.saved_bytes, working_bytes=working_bytes(block), extra_ms=0.0, extra_flops=0)


@register_cost("recompute")
def _recompute(profile: Profile, block_index: int, segment: Segment) -> BlockCost:
    """One replay of the block plus the checkpoint's own overhead (hooks, RNG state: measured
    in `remat.measure.overhead`), of which the segment's first block alone pays the part one
    checkpointed call costs (`Profile.checkpoint_call_ms`); only the segment's first block holds
    something (its input)."""
    block = profile.blocks[block_index]
    first = block_index == segment.start
    return BlockCost(
        retained_bytes=block.input_bytes if first else 0,
        working_bytes=replay_working_bytes(block),
        extra_ms=block.fwd_ms + block.recompute_overhead_ms - (0.0 if first else profile.checkpoint_call_ms),
        extra_flops=block.fwd_flops,
    )


@register_cost("selective")
def _selective(profile: Profile, block_index: int, segment: Segment) -> BlockCost:
    """Hold the input and the storages of the cached ops' outputs; replay the other (non-view)
    ops, the named ones that cannot be cached included. Time: the replayed ops plus the selective
    machinery's dispatch on every op of the forward and the replay, plus the cache's share for
    the share of cacheable calls saved (`remat.measure.overhead`). Priced by `selective_prices`,
    the one formula the optimal search also uses."""
    return _selective_cost(profile.blocks[block_index], segment.saved_ops)


_SELECTIVE_COSTS: dict[tuple[int, tuple[str, ...]], tuple[BlockProfile, BlockCost]] = {}
"""`_selective_cost`'s results by block identity (hashing a block's op table costs more than a
lookup should): predict prices each block's option several times per plan."""


def clear_cost_cache() -> None:
    """Forget cached selective costs (benchmarks time cold planning)."""
    _SELECTIVE_COSTS.clear()


def _selective_cost(block: BlockProfile, saved_ops: tuple[str, ...]) -> BlockCost:
    hit = _SELECTIVE_COSTS.get((id(block), saved_ops))
    if hit is not None and hit[0] is block:
        return hit[1]
    if len(_SELECTIVE_COSTS) >= 65536:
        _SELECTIVE_COSTS.clear()
    prices = selective_prices([block], [saved_ops])
    cost = BlockCost(
        retained_bytes=int(prices.retained_bytes[0]),
        working_bytes=int(prices.working_bytes[0]),
        extra_ms=float(prices.extra_ms[0, 0]),
        extra_flops=int(prices.extra_flops[0]),
    )
    _SELECTIVE_COSTS[(id(block), saved_ops)] = (block, cost)
    return cost


def selective_working_bytes(block: BlockProfile, cached: Sequence[dict[object, int]]) -> np.ndarray:
    """Working sets of a selective block for each of ``cached`` (storage id -> bytes of the
    storages its cached op calls keep alive: `selective_saved_bytes`'s storages).

    Selective checkpointing keeps its cached outputs alive through the block's whole backward,
    where a plain backward frees saved tensors as it goes (on the built-in GPT, the MLP's before
    the attention's peak: ignoring this under-predicted that peak by 7-10 %). With the measured
    order in which the plain backward freed the block's storages and its temporaries at each
    moment (`BlockProfile.bwd_free_order`, `bwd_free_points`) the peak is the largest
    temporaries plus the cached storages already freed by then; the replay, before that, holds
    the cached storages autograd does not save (not in the order) until it fetches them, an
    upper bound on top of its forward temporaries. Without these measurements: the replay's
    working set plus every cached byte, an upper bound."""
    totals = np.array([sum(c.values()) for c in cached], dtype=np.int64)
    if not block.bwd_free_points or not block.bwd_free_order:
        return replay_working_bytes(block) + totals
    ids = [sid for sid, _ in block.bwd_free_order]
    kept = np.array([[c.get(sid, 0) if sid >= 0 else 0 for sid in ids] for c in cached], dtype=np.int64)
    prefix = np.concatenate([np.zeros((len(cached), 1), dtype=np.int64), np.cumsum(kept, axis=1)], axis=1)
    counts = np.array([min(k, len(ids)) for k, _ in block.bwd_free_points])
    temps = np.array([t for _, t in block.bwd_free_points], dtype=np.int64)
    held = np.maximum((temps[None, :] + prefix[:, counts]).max(axis=1), block.bwd_temp_bytes)
    # cached storages autograd does not save: held by the cache from the forward until the
    # replay fetches them (then freed as in a plain forward), so on top of the replay's peak
    unsaved = totals - kept.sum(axis=1)
    return block.saved_bytes + np.maximum(held, block.fwd_temp_bytes + block.output_grad_bytes + unsaved)


@dataclass(kw_only=True, frozen=True)
class SelectivePrices:
    """`_selective`'s cost of K saved-op choices on B blocks alike in structure (equal op tables
    but for times): bytes and FLOPs per choice, milliseconds per block and choice."""

    retained_bytes: np.ndarray
    """(K,) int."""
    working_bytes: np.ndarray
    """(K,) int."""
    extra_flops: np.ndarray
    """(K,) int."""
    extra_ms: np.ndarray
    """(B, K) float."""


def selective_prices(blocks: Sequence[BlockProfile], saved_ops: Sequence[tuple[str, ...]]) -> SelectivePrices:
    """Cost of saving each of ``saved_ops`` (op keys) in each of ``blocks``; the blocks must be
    alike in structure (the first one's bytes, FLOPs and cached storages are used for all).

    Working set: the replay's, plus what the cached storages add by staying alive through the
    block's whole backward (`selective_working_bytes`)."""
    first = blocks[0]
    replayed = np.zeros((len(saved_ops), len(first.ops)))
    cached_bytes = np.zeros(len(saved_ops), dtype=np.int64)
    num_cached = np.zeros(len(saved_ops))
    views = np.array([op.is_view for op in first.ops], dtype=bool)
    storages: list[dict[object, int]] = []
    for k, keys in enumerate(saved_ops):
        cached = cached_ops(first, keys)
        replayed[k] = [op.key not in cached for op in first.ops]
        storages.append(_cached_storages(first, cached))
        cached_bytes[k] = sum(storages[-1].values())
        num_cached[k] = len(cached)
    replayed[:, views] = 0.0
    times = np.array([[op.time_ms for op in b.ops] for b in blocks], dtype=float).reshape(len(blocks), -1)
    flops = np.array([op.flops for op in first.ops], dtype=np.int64)
    select = np.array([b.selective_overhead_ms for b in blocks])[:, None]
    cache = np.array([b.selective_cache_overhead_ms for b in blocks])[:, None]
    cacheable_calls = max(sum(cacheable(op.name) for op in first.ops), 1)
    # a sum over each row's own ops: the same rounding for one block and for many (rows in
    # chunks of about 4M products)
    ms = np.empty((len(blocks), len(saved_ops)))
    step = max(1, 4_000_000 // max(replayed.size, 1))
    for lo in range(0, len(blocks), step):
        ms[lo : lo + step] = (times[lo : lo + step, None, :] * replayed[None, :, :]).sum(axis=2)
    ms += select + cache * num_cached[None, :] / cacheable_calls
    return SelectivePrices(
        retained_bytes=first.input_bytes + cached_bytes,
        working_bytes=selective_working_bytes(first, storages),
        extra_flops=(replayed.astype(np.int64) * flops[None, :]).sum(axis=1),
        extra_ms=ms,
    )
