"""Selective recomputation policies: which op calls of a block to save.

Each policy is a registry entry ``fn(block, target_bytes=None) -> tuple of op keys`` (keys of
`remat.measure.types.OpRecord`, e.g. ``"aten.mm.default#2"``); every other non-view op of the
block is replayed in backward. An op call is saved or replayed as a whole (a dropout's output
and mask together), and replayed random ops draw the same numbers because the checkpoint
restores the RNG state: gradients stay identical either way.
"""

from __future__ import annotations

from typing import Callable

from remat.measure.types import BlockProfile, OpRecord

__all__ = [
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
    return op.name.rsplit(".", 1)[0] if op.name.count(".") >= 2 else op.name


@register_policy("save-matmuls")
def save_matmuls(block: BlockProfile, target_bytes: int | None = None) -> tuple[str, ...]:
    """Save the outputs of matmuls, convolutions and fused attention; replay the rest."""
    return tuple(op.key for op in block.ops if _base(op) in MATMUL_OPS)


@register_policy("attention-core")
def attention_core(block: BlockProfile, target_bytes: int | None = None) -> tuple[str, ...]:
    """Replay QK^T, scale/mask, softmax, its dropout and the product with V (Megatron-LM's
    selective recomputation, Korthikanti et al. 2022); save every other op whose output
    autograd saves. The core spans from the last score matmul before each softmax to the
    first matmul after it."""
    core = _attention_core_indices(block.ops)
    return tuple(op.key for i, op in enumerate(block.ops) if i not in core and op.saved_bytes > 0 and not op.is_view)


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
    """Save the op outputs that keep the most replay time within ``target_bytes`` (exact 0/1
    knapsack over the block's op calls; weights: output bytes, values: op time)."""
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


def knapsack_frontier(block: BlockProfile) -> list[tuple[int, float, tuple[str, ...]]]:
    """Every Pareto-optimal ``(saved output bytes, saved op time ms, op keys)``, by bytes.

    Exact DP over items with dominance pruning: a point survives only if no other point saves
    at least as much time with no more bytes (Martello & Toth 1990, ch. 2)."""
    items = [op for op in block.ops if not op.is_view and (op.output_bytes > 0 or op.time_ms > 0)]
    frontier: list[tuple[int, float, tuple[str, ...]]] = [(0, 0.0, ())]
    for op in items:
        grown = [(w + op.output_bytes, v + op.time_ms, keys + (op.key,)) for w, v, keys in frontier]
        frontier = _prune(frontier + grown)
    return frontier


def _prune(points: list[tuple[int, float, tuple[str, ...]]]) -> list[tuple[int, float, tuple[str, ...]]]:
    out: list[tuple[int, float, tuple[str, ...]]] = []
    for point in sorted(points, key=lambda p: (p[0], -p[1])):
        if not out or point[1] > out[-1][1]:
            out.append(point)
    return out
