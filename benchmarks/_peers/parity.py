"""Same-layout parity: each recipe against remat running the same layout as a plan.

A recipe (per-block checkpointing, `checkpoint_sequential`, torchtitan's selective policy,
Megatron's attention-core checkpoint, Hugging Face's ``gradient_checkpointing_enable``) fixes
which blocks are recomputed and which op outputs are saved. `layout` writes that choice as remat
segments over the profile's blocks, `remat.plan.planners.make_plan` makes it a Plan (with its
prediction), and `remat.apply_` runs it. Both are measured side by side: the live tracker's peak,
and ``repeats`` rounds that time one step of each, the order swapped every round. remat at parity
holds no more than the recipe (``peak_ratio <= 1``) and takes no longer than 1.02x its time.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from benchmarks._peers.runner import Runner, compare_grads, timed_step
from benchmarks._peers.strategies import (TITAN_MM_OPS, TITAN_SAVE_OPS, AttentionCoreCheckpoint,
                                          PerBlockCheckpoint, Peer, SqrtSequential, TitanSelective,
                                          sqrt_segments)
from benchmarks._peers.suite import Suite, plan_summary, remat_profile, try_add
from benchmarks._peers.workloads import Workload, block_list, recipe_blocks

TIME_GOAL = 1.02
"""remat's step time at parity: at most this multiple of the recipe's."""

Layout = Callable[[Any, nn.Module], tuple[Any, ...]]
"""``layout(profile, model) -> segments``: the recipe's choice as remat segments."""


def _recipe_indices(profile: Any, model: nn.Module) -> list[int]:
    """Profile indices of the blocks the per-block recipes wrap (`workloads.recipe_blocks`), in run order."""
    names = {name for name, _ in recipe_blocks(model)}
    return [b.index for b in profile.blocks if b.name in names]


def _list_indices(profile: Any, model: nn.Module) -> list[int]:
    """Profile indices of the longest module list's blocks (`checkpoint_sequential`'s chain), in run order."""
    _, _, blocks = block_list(model)
    prefix = next(name for name, module in model.named_modules() if module is blocks)
    names = {f"{prefix}.{i}" if prefix else str(i) for i in range(len(blocks))}
    return [b.index for b in profile.blocks if b.name in names]


def _segments(profile: Any, chosen: dict[int, Any]) -> tuple[Any, ...]:
    """Top-level segments: ``chosen`` (start index -> segment), every other block kept."""
    from remat.plan.types import Segment

    out, pos = [], 0
    while pos < profile.num_blocks:
        seg = chosen.get(pos) or Segment(start=pos, stop=pos + 1, strategy="keep")
        out.append(seg)
        pos = seg.stop
    return tuple(out)


def per_block_layout(profile: Any, model: nn.Module) -> tuple[Any, ...]:
    """Every block of the list recomputed on its own."""
    from remat.plan.types import Segment

    return _segments(profile, {i: Segment(start=i, stop=i + 1, strategy="recompute")
                               for i in _recipe_indices(profile, model)})


def sequential_layout(profile: Any, model: nn.Module) -> tuple[Any, ...]:
    """`checkpoint_sequential` with round(sqrt(N)) segments: segments of N // k blocks recomputed,
    the last chunk (N - (k-1) * (N // k) blocks) kept (torch's ``checkpoint_sequential``)."""
    from remat.plan.types import Segment

    indices = _list_indices(profile, model)
    num_segments = sqrt_segments(len(indices))
    size = len(indices) // num_segments
    chosen = {}
    for start in range(0, size * (num_segments - 1), size):
        first, last = indices[start], indices[start + size - 1]
        chosen[first] = Segment(start=first, stop=last + 1, strategy="recompute")
    return _segments(profile, chosen)


def titan_saved_ops(block: Any) -> tuple[str, ...]:
    """The op calls torchtitan's policy saves in one block's forward: the listed ops, except every
    second matmul (mm and addmm counted together, `strategies.titan_policy`)."""
    names = {str(op): op for op in TITAN_SAVE_OPS}
    mm_names = {str(op) for op in TITAN_MM_OPS}
    counts: dict[str, int] = defaultdict(int)
    saved = []
    for op in block.ops:
        if op.name in mm_names:
            counts["mm"] += 1
        if op.name in names and not (op.name in mm_names and counts["mm"] % 2 == 0):
            saved.append(op.key)
    return tuple(saved)


def titan_layout(profile: Any, model: nn.Module) -> tuple[Any, ...]:
    """Every block of the list selective, saving what torchtitan's policy saves."""
    from remat.plan.types import Segment

    return _segments(profile, {
        i: Segment(start=i, stop=i + 1, strategy="selective:titan", saved_ops=titan_saved_ops(profile.blocks[i]))
        for i in _recipe_indices(profile, model)})


CORE_BLOCKS = "blocks.*.attn.core"
"""The built-in GPT's attention cores (`remat.models.gpt.AttentionCore`) named as remat's blocks:
the region Megatron-LM checkpoints, from q, k and v to the product with v."""


def core_layout(profile: Any, model: nn.Module) -> tuple[Any, ...]:
    """Megatron's attention-core checkpoint on a profile whose blocks are the cores
    (`CORE_BLOCKS`): every core recomputed on its own, everything else kept."""
    from remat.plan.types import Segment

    return tuple(Segment(start=i, stop=i + 1, strategy="recompute") for i in range(profile.num_blocks))


@dataclass(kw_only=True, frozen=True)
class Recipe:
    """A peer and the remat layout that is the same choice."""

    peer: Peer
    layout: Layout
    blocks: str | None = None
    """What remat profiles as its blocks for this layout (`remat.profile`'s ``blocks``): None, the
    detected stacks; a glob names smaller regions (Megatron's attention cores)."""


def default_recipes() -> list[Recipe]:
    """Every recomputing eager recipe of the peers benchmark (on Hugging Face models the per-block
    recipe is ``gradient_checkpointing_enable()``)."""
    return [
        Recipe(peer=PerBlockCheckpoint(name="per-block checkpoint"), layout=per_block_layout),
        Recipe(peer=SqrtSequential(name="checkpoint_sequential sqrt(N)"), layout=sequential_layout),
        Recipe(peer=TitanSelective(name="torchtitan selective"), layout=titan_layout),
        Recipe(peer=AttentionCoreCheckpoint(name="Megatron attention core"), layout=core_layout, blocks=CORE_BLOCKS),
    ]


@dataclass(kw_only=True)
class Pair:
    """A recipe's runner and remat's runner of the same layout, and their timed rounds."""

    recipe: Runner
    remat: Runner
    ratios: list[float]
    """Per round: remat's step time over the recipe's (the two steps run back to back)."""

    @property
    def peak_ratio(self) -> float:
        return self.remat.peak_bytes / self.recipe.peak_bytes

    @property
    def time_ratio(self) -> float:
        """Median of the per-round ratios."""
        return statistics.median(self.ratios)

    @property
    def medians_ratio(self) -> float:
        return self.remat.step_ms / self.recipe.step_ms

    @property
    def met(self) -> bool:
        return self.peak_ratio <= 1.0 and self.time_ratio <= TIME_GOAL and self.identical

    @property
    def identical(self) -> bool:
        return compare_grads(self.remat, self.recipe).identical


def _remat_prepare(plan: Any) -> Callable[[nn.Module, Any], nn.Module]:
    def prepare(model: nn.Module, batch: Any) -> nn.Module:
        import remat

        return remat.apply_(model, plan)

    return prepare


def build_pairs(suite: Suite, recipes: list[Recipe], warmup: int) -> list[Pair]:
    """Prepare every recipe that runs here and remat's plan of its layout; measure their peaks."""
    from remat.plan.planners import make_plan

    profiles = {None: remat_profile(suite.workload)}
    suite.num_blocks = profiles[None].num_blocks
    model = suite.workload.build().model
    pairs = []
    for recipe in recipes:
        peer = try_add(suite, recipe.peer.name, recipe.peer.mode, "peer", recipe.peer.prepare,
                        recipe.peer.describe(), warmup)
        if peer is None:
            continue
        if recipe.blocks not in profiles:
            profiles[recipe.blocks] = remat_profile(suite.workload, blocks=recipe.blocks)
        profile = profiles[recipe.blocks]
        plan = make_plan(profile, recipe.layout(profile, model), f"layout of {recipe.peer.name}", None)
        ours = try_add(suite, f"remat, layout of {recipe.peer.name}", recipe.peer.mode, "remat",
                        _remat_prepare(plan), plan_summary(plan), warmup)
        if ours is None:
            continue
        ours.plan = plan
        pairs.append(Pair(recipe=peer, remat=ours, ratios=[]))
    return pairs


def time_pairs(pairs: list[Pair], repeats: int) -> None:
    """``repeats`` rounds; each round times every pair back to back, remat first on odd rounds."""
    for r in range(repeats):
        for pair in pairs[r % len(pairs):] + pairs[:r % len(pairs)]:
            order = (pair.recipe, pair.remat) if r % 2 == 0 else (pair.remat, pair.recipe)
            times = {id(runner): timed_step(runner) for runner in order}
            pair.ratios.append(times[id(pair.remat)] / times[id(pair.recipe)])


def run_parity(workload: Workload, recipes: list[Recipe], *, repeats: int, warmup: int = 2) -> tuple[Suite, list[Pair]]:
    """Every recipe against remat's plan of its layout on ``workload``."""
    suite = Suite(workload=workload)
    pairs = build_pairs(suite, recipes, warmup)
    if pairs:
        time_pairs(pairs, repeats)
    return suite, pairs


def parity_table(pairs: list[Pair]) -> str:
    """Markdown: per recipe, peaks, times and their ratios, gradients, goal."""
    mib = 2**20
    lines = [
        "| recipe | remat plan of its layout | recipe peak MiB | remat peak MiB | peak ratio | recipe ms "
        "| remat ms | time ratio (median per round) | ratio of medians | gradients | goal (peak <= 1, time <= "
        f"{TIME_GOAL}) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in pairs:
        lines.append("| " + " | ".join([
            p.recipe.name, p.remat.detail, f"{p.recipe.peak_bytes / mib:.2f}", f"{p.remat.peak_bytes / mib:.2f}",
            f"{p.peak_ratio:.3f}", f"{p.recipe.step_ms:.1f}", f"{p.remat.step_ms:.1f}", f"{p.time_ratio:.3f}",
            f"{p.medians_ratio:.3f}", "identical" if p.identical else compare_grads(p.remat, p.recipe).label,
            "met" if p.met else "missed",
        ]) + " |")
    return "\n".join(lines)


def parity_json(pairs: list[Pair]) -> list[dict[str, Any]]:
    return [{
        "recipe": p.recipe.name, "plan": p.remat.detail, "recipe_peak_bytes": p.recipe.peak_bytes,
        "remat_peak_bytes": p.remat.peak_bytes, "recipe_ms": p.recipe.step_ms, "remat_ms": p.remat.step_ms,
        "time_ratio": p.time_ratio, "medians_ratio": p.medians_ratio, "peak_ratio": p.peak_ratio,
        "identical": p.identical, "met": p.met, "ratios": p.ratios,
    } for p in pairs]
