"""Selective recomputation policies: which op calls of a block to save.

Each policy is a registry entry ``fn(block, target_bytes=None) -> tuple of op keys`` (keys of
`remat.measure.types.OpRecord`, e.g. ``"aten.mm.default#2"``); every other non-view op of the
block is replayed in backward. An op call is saved or replayed as a whole (a dropout's output
and mask together), and replayed random ops draw the same numbers because the checkpoint
restores the RNG state: gradients stay identical either way.

`cacheable` is the one rule of which calls can be saved at all, shared by the planner (policies,
`remat.plan.costs`) and `remat.apply.selective`: allocation-only and in-place calls never are.
A saved call keeps alive the whole storages its outputs live in (`OpRecord.storage_ids`): a view
of a replayed op's output is not free, so `knapsack` prices groups of storages, not op calls.
"""

from __future__ import annotations

import functools

from itertools import combinations
from typing import Callable

from remat.measure.types import BlockProfile, OpRecord

__all__ = [
    "ALLOCATION_OPS",
    "cacheable",
    "op_storages",
    "POLICIES",
    "register_policy",
    "policy",
    "saved_ops_for",
    "attention_core",
    "save_matmuls",
    "knapsack",
    "knapsack_frontier",
    "MATMUL_OPS",
]

PolicyFn = Callable[..., tuple[str, ...]]
POLICIES: dict[str, PolicyFn] = {}

MATMUL_OPS = frozenset(
    {
        "aten.mm",
        "aten.addmm",
        "aten.bmm",
        "aten.baddbmm",
        "aten.linear",
        "aten.convolution",
        "aten._convolution",
        "aten._scaled_dot_product_flash_attention",
        "aten._scaled_dot_product_efficient_attention",
        "aten._scaled_dot_product_cudnn_attention",
        "aten._scaled_dot_product_flash_attention_for_cpu",
        "aten._flash_attention_forward",
        "aten._efficient_attention_forward",
    }
)
"""Compute-intensive ops whose outputs `save-matmuls` keeps (torchtitan's list, plus the CPU
fused attention kernel, which differs from the CUDA ones)."""

ALLOCATION_OPS = frozenset({"aten.empty_like", "aten.empty", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided"})
"""Ops that only allocate: their outputs are filled in place afterwards (a dropout mask is
``empty_like`` + ``bernoulli_`` + ``div_``), so a cached output would be mutated, which
selective checkpointing forbids. They cost nothing to replay, so they are always replayed."""

_MAX_GROUP_STORAGES = 10
"""Storages sharing saved ops beyond which `knapsack_frontier` offers a group only whole."""

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
    return _packet(op.name)


def _packet(name: str) -> str:
    return name.rsplit(".", 1)[0] if name.count(".") >= 2 else name


@functools.lru_cache(maxsize=4096)  # called per op per option by the optimal search
def cacheable(name: str) -> bool:
    """Whether a call of aten overload ``name`` (``"aten.mm.default"``) can keep its output.

    Allocation ops and in-place ops (``bernoulli_``, ``div_``: their output is their input) are
    always replayed. Caching them is unsound: the replay of ``dropout`` fills the tensor it
    allocated (``noise.bernoulli_(); noise.div_()``), not the value an op returns, so a cached
    in-place op would leave that tensor unfilled."""
    packet = _packet(name)
    in_place = packet.endswith("_") and not packet.rsplit(".", 1)[-1].startswith("__")  # not __and__
    return packet not in ALLOCATION_OPS and not in_place


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
    return tuple(op.key for op in block.ops if _base(op) in MATMUL_OPS and cacheable(op.name))


@register_policy("attention-core")
def attention_core(block: BlockProfile, target_bytes: int | None = None) -> tuple[str, ...]:
    """Replay QK^T, scale/mask, softmax, its dropout and the product with V (Megatron-LM's
    selective recomputation, Korthikanti et al. 2022); save every other op whose output
    autograd saves. The core spans from the last score matmul before each softmax to the
    first matmul after it."""
    core = _attention_core_indices(block.ops)
    return tuple(
        op.key for i, op in enumerate(block.ops)
        if i not in core and op.saved_bytes > 0 and not op.is_view and cacheable(op.name)
    )


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
    """Per group of calls sharing storages: its Pareto options other than saving nothing."""
    items = [(i, op) for i, op in enumerate(block.ops)
             if not op.is_view and cacheable(op.name) and (op.output_bytes > 0 or op.time_ms > 0)]
    groups: list[tuple[dict[object, int], list[tuple[int, OpRecord]]]] = []
    for i, op in items:
        storages = op_storages(i, op)
        merged = (dict(storages), [(i, op)])
        for g in [g for g in groups if set(storages) & set(g[0])]:
            merged[0].update(g[0])
            merged[1].extend(g[1])
            groups.remove(g)
        groups.append(merged)
    return [_subset_options(storages, calls) for storages, calls in groups]


def _subset_options(storages: dict[object, int], calls: list[tuple[int, OpRecord]]) -> list[_Point]:
    """Options of one group: each subset of its storages (all of them only, past a size) with
    the calls that fit inside it, Pareto-pruned."""
    ids = list(storages)
    subsets = [ids] if len(ids) > _MAX_GROUP_STORAGES else [list(c) for r in range(len(ids) + 1) for c in combinations(ids, r)]
    options = []
    for subset in subsets:
        inside = [(i, op) for i, op in sorted(calls) if set(op_storages(i, op)) <= set(subset)]
        if inside:
            options.append((sum(storages[s] for s in subset), sum(op.time_ms for _, op in inside),
                            tuple(op.key for _, op in inside)))
    return _prune(options)


def _prune(points: list[_Point]) -> list[_Point]:
    out: list[_Point] = []
    for point in sorted(points, key=lambda p: (p[0], -p[1])):
        if not out or point[1] > out[-1][1]:
            out.append(point)
    return out
