"""Selective recomputation policies: which op calls of a block to save.

Each policy is a registry entry ``fn(block, target_bytes=None) -> tuple of op keys`` (keys of
`remat.measure.types.OpRecord`, e.g. ``"aten.mm.default#2"``); every other non-view op of the
block is replayed in backward. An op call is saved or replayed as a whole (a dropout's output
and mask together), and replayed random ops draw the same numbers because the checkpoint
restores the RNG state: gradients stay identical either way.

Which calls can be saved at all is `remat.checkpointing.cacheable.cacheable`, the one rule the
planner (policies, `remat.plan.costs`), the runtime and the profile's probes share
(`op_cacheable` reads it for a recorded call): allocation-only and in-place calls never are, nor
calls whose output a later call writes into.
A saved call keeps alive the whole storages its outputs live in (`OpRecord.storage_ids`): a view
of a replayed op's output is not free, so `knapsack` prices groups of storages, not op calls.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from itertools import combinations
from typing import Callable

import numpy as np

from remat.checkpointing.cacheable import ALLOCATION_OPS, MATMUL_OPS, cacheable, op_packet
from remat.measure.size_groups import UNCACHED
from remat.measure.types import BlockProfile, OpRecord
from remat.plan.phases import replay_stop

__all__ = [
    "ALLOCATION_OPS",
    "MAX_KNAPSACK_GROUPS",
    "knapsack_left_out_ms",
    "cacheable",
    "op_cacheable",
    "op_storages",
    "POLICIES",
    "register_policy",
    "policy",
    "saved_ops_for",
    "attention_core",
    "has_attention_core",
    "save_matmuls",
    "knapsack",
    "knapsack_frontier",
    "knapsack_frontier_union",
    "whole_families",
    "clear_subset_cache",
    "MATMUL_OPS",
]

PolicyFn = Callable[..., tuple[str, ...]]
POLICIES: dict[str, PolicyFn] = {}

_MAX_GROUP_STORAGES = 10
"""Storages sharing saved ops beyond which `knapsack_frontier` offers a group only whole."""

MAX_KNAPSACK_GROUPS = 64
"""Groups of calls (`knapsack_frontier`) a block's knapsack chooses among at most: those whose
calls take the most replay time; the others are replayed in every knapsack option. The built-in
models' blocks have 1 to 40 groups, a Llama layer 40; a layer whose kernel is a Python loop of
small ops has hundreds (BailingHybrid's and Kimi Linear's linear attention in PyTorch, 420 in a
1,048-call layer), whose exact frontier had 18,671 points: 41 s to build, and the optimal
search's dominance filter over them did not end in 400 s. The search is exact over the options
it offers; one that also caches left-out groups saves at most their replay time
(`knapsack_left_out_ms`)."""

_SOFTMAX_OPS = frozenset({"aten._softmax", "aten.softmax", "aten._safe_softmax"})
_SCORE_MATMULS = frozenset({"aten.mm", "aten.bmm", "aten.baddbmm", "aten.matmul"})


def register_policy(name: str) -> Callable[[PolicyFn], PolicyFn]:
    """Decorator: register a selective policy under ``name`` (used as ``selective:<name>``)."""

    def wrap(fn: PolicyFn) -> PolicyFn:
        POLICIES[name] = fn
        return fn

    return wrap


def policy(name: str) -> PolicyFn:
    """The policy registered as ``name``."""
    if name not in POLICIES:
        raise ValueError(f"unknown selective policy {name!r}; allowed: {sorted(POLICIES)} (write selective:<policy>).")
    return POLICIES[name]


def saved_ops_for(name: str, block: BlockProfile, target_bytes: int | None = None) -> tuple[str, ...]:
    """Op keys that policy ``name`` saves in ``block``."""
    return policy(name)(block, target_bytes=target_bytes)


def _base(op: OpRecord) -> str:
    """``"aten.mm.default"`` -> ``"aten.mm"``."""
    return op_packet(op.name)


def op_cacheable(op: OpRecord) -> bool:
    """Whether selective checkpointing can keep the output of the recorded call ``op``, and a plan
    may: not a call the profile marked never to cache (`OpRecord.size_group` -2,
    `remat.measure.size_groups`: its size, and its family's total, or its key follow the data), whose
    cache would hold another number of bytes, or another call's, on the next batch."""
    return cacheable(op.name, op.mutated_later) and op.size_group != UNCACHED


def op_storages(index: int, op: OpRecord) -> dict[object, int]:
    """Bytes per storage that caching ``op`` (the block's ``index``-th call) keeps alive.

    Ids come from `OpRecord.storage_ids`, less the storages that outlive the block
    (`OpRecord.storage_escapes`: the block's output, counted with the next block's input); an
    op recorded without ids counts its own output bytes as one private storage (``("op", index)``)."""
    if op.storage_ids:
        escapes = op.storage_escapes or (False,) * len(op.storage_ids)
        return {s: b for s, b, out in zip(op.storage_ids, op.storage_bytes, escapes) if not out}
    return {("op", index): op.output_bytes} if op.output_bytes > 0 else {}


@register_policy("save-matmuls")
def save_matmuls(block: BlockProfile, target_bytes: int | None = None) -> tuple[str, ...]:
    """Save the outputs of matmuls, convolutions and fused attention; replay the rest."""
    return whole_families(block, tuple(op.key for op in block.ops if _base(op) in MATMUL_OPS and op_cacheable(op)))


@register_policy("attention-core")
def attention_core(block: BlockProfile, target_bytes: int | None = None) -> tuple[str, ...]:
    """Replay QK^T, scale/mask, softmax, its dropout and the product with V (Megatron-LM's
    selective recomputation, Korthikanti et al. 2022); outside that core, save every op whose
    output autograd saves and every matmul. The core spans from the last score matmul before
    each softmax to the first matmul after it.

    A matmul outside the core is saved even when autograd keeps nothing of it (an output
    projection that feeds a dropout): the replay runs the whole block, and replaying the
    projection would cost a GEMM of the block's width to spare one activation of it (on the
    built-in GPT at d_model 1024 and 1024 tokens, 73 ms of a 571 ms forward for 8 MiB a block)."""
    core = _attention_core_indices(block.ops)
    return whole_families(block, tuple(
        op.key for i, op in enumerate(block.ops)
        if i not in core and (op.saved_bytes > 0 or _base(op) in MATMUL_OPS) and not op.is_view and op_cacheable(op)
    ))


def whole_families(block: BlockProfile, keys: tuple[str, ...]) -> tuple[str, ...]:
    """``keys`` less the calls of each family of calls whose sizes follow the data
    (`OpRecord.size_group`) that ``keys`` does not hold whole: a part of a family holds another
    number of bytes each batch (an MoE router's softmax puts the first expert's matmul in the
    attention core), the whole family the same total."""
    chosen = set(keys)
    partial = {op.size_group for op in block.ops
               if op.size_group >= 0 and op.key not in chosen and not op.is_view and op_cacheable(op)}
    if not partial:
        return keys
    dropped = {op.key for op in block.ops if op.size_group in partial}
    return tuple(key for key in keys if key not in dropped)


def has_attention_core(block: BlockProfile) -> bool:
    """Whether ``block`` has a softmax for `attention_core` to replay."""
    return bool(_attention_core_indices(block.ops))


def _attention_core_indices(ops: tuple[OpRecord, ...]) -> set[int]:
    core: set[int] = set()
    for i, op in enumerate(ops):
        if _base(op) not in _SOFTMAX_OPS:
            continue
        before = [k for k in range(i) if _base(ops[k]) in _SCORE_MATMULS]
        after = [k for k in range(i + 1, len(ops)) if _base(ops[k]) in _SCORE_MATMULS]
        first = before[-1] if before else i
        last = after[0] if after else i
        core.update(range(first, last + 1))
    return core


@register_policy("knapsack")
def knapsack(block: BlockProfile, target_bytes: int | None = None) -> tuple[str, ...]:
    """Save the op outputs that keep the most replay time within ``target_bytes`` of storages
    kept alive (exact: see `knapsack_frontier`)."""
    if target_bytes is None or target_bytes < 0:
        raise ValueError(
            f"the knapsack policy needs a byte target >= 0 for block {block.name!r}, got {target_bytes!r}; "
            "plan with a budget (remat.plan(profile, budget=...)) or call knapsack(block, target_bytes=N)."
        )
    best: tuple[int, float, tuple[str, ...]] = (0, 0.0, ())
    for point in knapsack_frontier(block):
        if point[0] <= target_bytes and point[1] > best[1]:
            best = point
    return best[2]


_Point = tuple[int, float, tuple[str, ...]]


def knapsack_frontier(block: BlockProfile) -> list[_Point]:
    """Every Pareto-optimal ``(bytes of storages kept, saved op time ms, op keys)``, by bytes.

    Items are the cacheable, non-view op calls. Saving a call keeps its storages alive
    (`op_storages`), and several calls may share one (an ``_unsafe_view`` of a matmul's output),
    so the weight of a choice is the bytes of the union of its storages. Calls are grouped into
    the connected components of shared storages; a group's options are its subsets of storages
    (value: every call whose storages all lie in the subset), and the groups are combined by an
    exact multiple-choice knapsack DP with dominance pruning: a point survives only if no other
    point saves at least as much time with no more bytes (Martello & Toth 1990, ch. 2 and 6).
    A group of more than `_MAX_GROUP_STORAGES` storages is offered whole only; below that the
    frontier is exact (the built-in models' groups hold at most 3: a layer norm's outputs)."""
    frontier: list[_Point] = [(0, 0.0, ())]
    for options in _group_options(block):
        grown = [(w + ow, v + ov, keys + okeys) for w, v, keys in frontier for ow, ov, okeys in options]
        frontier = _prune(frontier + grown)
    return frontier


def _group_options(block: BlockProfile) -> list[list[_Point]]:
    """Per group of calls sharing storages (`MAX_KNAPSACK_GROUPS` at most): its Pareto options
    other than saving nothing."""
    times = [op.time_ms for op in block.ops]
    return [
        _prune([(w, sum(times[i] for i in calls), tuple(block.ops[i].key for i in calls)) for w, calls in group])
        for group in _offered(_group_subsets(block), np.array([times], dtype=float))
    ]


def _offered(groups: _Subsets, times: np.ndarray) -> _Subsets:
    """``groups`` (`_group_subsets`), or where there are more than `MAX_KNAPSACK_GROUPS` of them,
    those whose calls take the most replay time (``times``: one row of op times per block; a
    group's time is that of all its calls, on the block where it is most), in their order."""
    if len(groups) <= MAX_KNAPSACK_GROUPS:
        return groups
    worth = [max(times[:, list(inside)].sum(axis=1).max() for _, inside in group) for group in groups]
    top = sorted(sorted(range(len(groups)), key=lambda g: -worth[g])[:MAX_KNAPSACK_GROUPS])
    return tuple(groups[g] for g in top)


def knapsack_left_out_ms(block: BlockProfile) -> float:
    """Replay time of the calls the block's knapsack never caches for `MAX_KNAPSACK_GROUPS`: what
    an option caching them too could save at most (0 for a block of that many groups or fewer)."""
    groups = _group_subsets(block)
    times = np.array([[op.time_ms for op in block.ops]], dtype=float)
    offered = {group[-1][1] for group in _offered(groups, times)}  # a group's last option holds all its calls
    return float(sum(times[0, list(group[-1][1])].sum() for group in groups if group[-1][1] not in offered))


_Subsets = tuple[tuple[tuple[int, tuple[int, ...]], ...], ...]


def _group_subsets(block: BlockProfile) -> _Subsets:
    """Per group of calls sharing storages (connected components), each subset of its storages
    (all of them only, past `_MAX_GROUP_STORAGES`) as ``(bytes, indices of the calls inside)``,
    subsets with no call inside left out. It depends on the block's op structure, not its times:
    blocks alike but for times share the work. Calls past the block's replay stop are no items:
    the early-stopping replay never fetches them (`remat.plan.costs.cached_ops`)."""
    stop = replay_stop(block)
    family = _family_storages(block)
    return _subsets_of(tuple(
        (not op.is_view and op_cacheable(op) and i < stop,
         tuple(dict.fromkeys(family.get(s, (s, b)) for s, b in op_storages(i, op).items())))
        for i, op in enumerate(block.ops)
    ))


def _family_storages(block: BlockProfile) -> dict[object, tuple[object, int]]:
    """Storage id -> ``(("size", group), bytes)`` for the storages of the calls whose sizes follow
    the data (`OpRecord.size_group` >= 0): one item per family, its bytes the family's total (the
    same every batch), so a knapsack option caches all of a family or none of it."""
    storages: dict[int, dict[object, int]] = {}
    for i, op in enumerate(block.ops):
        if op.size_group >= 0 and not op.is_view and op_cacheable(op):  # an in-place member (index_add_)
            # names the storage it writes, made before the family (zeros_like): not the family's
            storages.setdefault(op.size_group, {}).update(op_storages(i, op))
    return {s: (("size", group), sum(inside.values())) for group, inside in storages.items() for s in inside}


def clear_subset_cache() -> None:
    """Forget the knapsack groups' subsets cached by op structure."""
    _subsets_of.cache_clear()


@functools.lru_cache(maxsize=256)
def _subsets_of(structure: tuple[tuple[bool, tuple], ...]) -> _Subsets:
    groups: list[tuple[dict[object, int], list[int]]] = []
    for i, (candidate, storages) in enumerate(structure):
        if not candidate:
            continue
        merged: tuple[dict[object, int], list[int]] = (dict(storages), [i])
        for g in [g for g in groups if set(dict(storages)) & set(g[0])]:
            merged[0].update(g[0])
            merged[1].extend(g[1])
            groups.remove(g)
        groups.append(merged)
    out = []
    for storages, calls in groups:
        ids = list(storages)
        subsets = [ids] if len(ids) > _MAX_GROUP_STORAGES else [c for r in range(len(ids) + 1) for c in combinations(ids, r)]
        options = []
        for subset in subsets:
            inside = tuple(i for i in sorted(calls) if set(dict(structure[i][1])) <= set(subset))
            if inside:
                options.append((sum(storages[s] for s in subset), inside))
        out.append(tuple(options))
    return tuple(out)


def knapsack_frontier_union(blocks: Sequence[BlockProfile]) -> list[tuple[int, tuple[str, ...]]]:
    """``(bytes of storages kept, op keys)`` of every point on the `knapsack_frontier` of any of
    ``blocks`` (alike in structure: equal op tables but for times), by bytes, computed at once.

    The same multiple-choice knapsack DP, keeping a point while it is Pareto-optimal for at least
    one block: a point that a block prunes cannot grow into a point on that block's frontier
    (what grows from it is beaten by what grows from the point that beat it). A block may pick
    another of several equal points than `knapsack_frontier` does alone (equal bytes and time);
    the optimal search's dominance filter drops, block by block, the points it does not need."""
    times = np.array([[op.time_ms for op in b.ops] for b in blocks], dtype=float).reshape(len(blocks), -1)
    weights = np.zeros(1, dtype=np.int64)
    calls: list[tuple[int, ...]] = [()]
    values = np.zeros((len(blocks), 1))
    for group in _offered(_group_subsets(blocks[0]), times):
        gw = np.array([w for w, _ in group], dtype=np.int64)
        gv = np.stack([times[:, list(inside)].sum(axis=1) for _, inside in group], axis=1)
        weights = np.concatenate([weights, (weights[:, None] + gw[None, :]).ravel()])
        values = np.concatenate([values, (values[:, :, None] + gv[:, None, :]).reshape(len(blocks), -1)], axis=1)
        calls = calls + [c + inside for c in calls for _, inside in group]
        keep = _union_pareto(weights, values)
        weights, values, calls = weights[keep], values[:, keep], [calls[k] for k in keep]
    keys = [op.key for op in blocks[0].ops]
    return [(int(w), tuple(keys[i] for i in sorted(c))) for w, c in zip(weights.tolist(), calls)]


def _union_pareto(weights: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Indices, by bytes, of the points Pareto-optimal for some row of ``values`` by `_prune`'s
    rule: per row, the first point of the best value of its byte level, kept when that value
    is above every value with fewer bytes."""
    order = np.argsort(weights, kind="stable")
    w, v = weights[order], values[:, order]
    new_level = np.r_[True, w[1:] != w[:-1]]
    starts = np.flatnonzero(new_level)
    level = np.cumsum(new_level) - 1
    level_best = np.maximum.reduceat(v, starts, axis=1)
    below = np.maximum.accumulate(np.c_[np.full((v.shape[0], 1), -np.inf), level_best[:, :-1]], axis=1)
    best = v == level_best[:, level]
    seen = np.cumsum(best, axis=1)
    before_level = seen[:, starts] - best[:, starts]
    first = best & (seen - before_level[:, level] == 1)
    useful = first & (level_best[:, level] > below[:, level])
    return order[useful.any(axis=0)]


def _prune(points: list[_Point]) -> list[_Point]:
    out: list[_Point] = []
    for point in sorted(points, key=lambda p: (p[0], -p[1])):
        if not out or point[1] > out[-1][1]:
            out.append(point)
    return out
