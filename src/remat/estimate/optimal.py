"""The fastest mix of per-layer strategies that fits: a dynamic program over a stage's layers.

Each layer of a stage takes one option (``none``, ``selective``, ``full``, ``offload``: what it
retains and the seconds it adds, `remat.estimate.layers` and `remat.estimate.stage.extra_s`).
With ``n`` micro-batches in flight, ``R`` the retained bytes of every layer and ``P_i`` those of
the layers before layer ``i``, layer ``i``'s backward peaks at (`remat.estimate.stage`)

    state_i + n pre + buffers + (n - 1) R + P_i + working_i

and the head's moment and the forward's before the layers grow with ``n R`` and ``(n - 1) R``.
So, layer by layer in forward order, the table

    T[i][P] = least added seconds of layers 0 .. i - 1 retaining P bytes, every moment so far fitting

takes each option of layer ``i`` where ``P + working_i`` fits its moment, and the least entry
whose ``R`` fits the head's moment wins. Each layer's moment is its own: the layers of two towers,
or of an encoder and a decoder, retain and work with different bytes, and the gradients live at
each backward differ. ``P`` runs over memory slots (``R_max / SLOTS`` bytes, a layer's bytes
rounded up); a slot keeps the fastest prefix reaching it with its exact bytes, which every check
reads, so a mix the table accepts fits. With several micro-batches in flight each row of the table
keeps room for ``(n - 1) T`` at every moment, over ``TARGETS`` targets ``T`` side by side, and an
entry counts where ``(n - 1) R`` fits the least room its prefix left. What the part before the
layers frees as its takers' backwards run (`remat.estimate.stage.Stage.pre_released`) is left
out of the table, which only makes it cautious: the mix it picks (and the same mix with the
layers holding the most last within each run of identical layers), and the uniform mixes beside
it, are priced by `stage_peak`, and the fastest that fits in bytes wins (of two as fast, the
lower peak).

The bound (`bound_bytes`): no mix whose peak fits ``n L q + (n - 1) R_max / TARGETS`` under the
budget (``L`` layers, ``q`` bytes a slot) is faster than the one returned. On stages of whole
bytes and few slots (``q = 1``) with one micro-batch in flight, none that fits the budget is:
`tests/estimate/test_stage.py` checks both against every assignment of two stacks' layers.
Unlike the planner's search (`remat.plan.search`) it does not nest recomputed segments or mix
selective policies per op: a 405B model's 126 layers take milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from remat.estimate.layers import LayerCost
from remat.estimate.stage import Stage, stage_peak

SLOTS = 4096
"""Memory slots of the table with one micro-batch in flight."""
PIPELINE_SLOTS = 512
"""Memory slots per target with several micro-batches in flight."""
TARGETS = 32
"""Targets of the retained bytes side by side with several micro-batches in flight."""


def cheapest_mix(stage: Stage, options: Sequence[Sequence[LayerCost]], seconds: Sequence[Sequence[float]],
                 budget_bytes: float) -> tuple[LayerCost, ...] | None:
    """For each layer of ``stage`` one of its options (``options[i][k]`` costing ``seconds[i][k]``),
    with the least summed time whose stage peak fits ``budget_bytes``; None when none does."""
    picks = [[k] * len(options) for k in range(len(options[0]))] if options else [[]]
    mixed = _solve(stage, options, seconds, budget_bytes) if options else None
    if mixed is not None:
        picks += [mixed, _ordered(stage, options, mixed)]
    fitting = []
    for p in picks:
        mix = tuple(options[i][k] for i, k in enumerate(p))
        peak = stage_peak(stage, mix).peak_bytes
        if peak <= budget_bytes:
            fitting.append((sum(seconds[i][k] for i, k in enumerate(p)), peak, len(fitting), mix))
    return min(fitting)[3] if fitting else None


def _ordered(stage: Stage, options: Sequence[Sequence[LayerCost]], picks: list[int]) -> list[int]:
    """``picks`` with, within each run of identical layers, the options holding the most last in
    forward order: as fast (the same options), and their backward runs first, while every other
    layer's activations are still held, so the largest retained bytes are freed first."""
    out = list(picks)
    start = 0
    for end in range(1, len(picks) + 1):
        if end == len(picks) or stage.layers[end] != stage.layers[start] or options[end] != options[start]:
            out[start:end] = sorted(picks[start:end], key=lambda k: options[start][k].retained_bytes)
            start = end
    return out


def bound_bytes(stage: Stage, options: Sequence[Sequence[LayerCost]], budget_bytes: float) -> float:
    """How far under ``budget_bytes`` a mix's peak must be for `cheapest_mix` to return one at
    least as fast (module docstring)."""
    grid = _grid(stage, options, budget_bytes)
    if grid is None:
        return 0.0
    quantum, cap = grid
    n = stage.in_flight
    return max(n, 1.0) * len(options) * quantum + (max(n, 1.0) - 1) * cap / TARGETS


def _limits(stage: Stage, budget_bytes: float) -> tuple[list[float], float]:
    """Per layer, what ``(n - 1) R + P_i + working_i`` may reach at its backward; and what ``R``
    may reach at the head's moment and the forward before the layers (module docstring). What
    the part before the layers releases is not subtracted: the limits are cautious."""
    n = stage.in_flight
    base = float(stage.state.total_bytes - stage.state.grad_bytes)
    fixed = base + n * stage.pre_bytes + stage.buffer_bytes
    per_layer = [budget_bytes - fixed - stage.grads_live(i) for i in range(len(stage.layers))]
    total = math.inf
    if stage.last:
        head = base + stage.grads_live(None) + n * stage.pre_bytes + stage.post_saved_bytes + stage.post_working_bytes
        total = (budget_bytes - head) / n
    if stage.first and (stage.pre_forward_peak_bytes or stage.pre_working_bytes) and n > 1:
        grads = 0.0 if stage.layer_grad_bytes else float(stage.state.grad_bytes)
        total = min(total, (budget_bytes - base - grads - stage.pre_forward_peak_bytes) / (n - 1) - stage.pre_bytes)
    return per_layer, total


def _grid(stage: Stage, options: Sequence[Sequence[LayerCost]], budget_bytes: float) -> tuple[float, float] | None:
    """(bytes per slot, the most the layers may retain), or None when no mix can fit."""
    per_layer, total = _limits(stage, budget_bytes)
    most = max((o.retained_bytes for opts in options for o in opts), default=0.0)
    cap = min(sum(max(o.retained_bytes for o in opts) for opts in options), total, max(per_layer, default=0.0) + most)
    if cap < 0:
        return None
    slots = SLOTS if stage.in_flight <= 1 else PIPELINE_SLOTS
    return max(cap / slots, 1.0), cap


def _solve(stage: Stage, options: Sequence[Sequence[LayerCost]], seconds: Sequence[Sequence[float]],
           budget_bytes: float) -> list[int] | None:
    """Option index per layer (module docstring); None when nothing fits."""
    grid = _grid(stage, options, budget_bytes)
    if grid is None:
        return None
    quantum, cap = grid
    targets = cap * np.arange(1, TARGETS + 1) / TARGETS if stage.in_flight > 1 else np.zeros(1)
    return _table(stage, options, seconds, budget_bytes, quantum, cap, targets)


def _table(stage: Stage, options: Sequence[Sequence[LayerCost]], seconds: Sequence[Sequence[float]],
           budget_bytes: float, quantum: float, cap: float, targets: np.ndarray):
    """The table (module docstring) over ``targets`` of the retained bytes side by side: each row
    keeps room for ``(n - 1) target`` at every layer's moment. A slot keeps the fastest prefix
    reaching it (of two as fast, the first to reach it), that prefix's exact bytes, which every
    check reads, and the least room it left at a moment; a row's entry counts where ``(n - 1) R``
    fits that room. Returns the option index per layer, or None when no entry fits."""
    per_layer, total = _limits(stage, budget_bytes)
    width = int(math.ceil(cap / quantum)) + len(options) + 1
    rows = len(targets)
    ahead = max(stage.in_flight - 1, 0.0) * targets[:, None]
    best = np.full((rows, width), math.inf)
    held = np.zeros((rows, width))
    least = np.full((rows, width), math.inf)  # the least room left at a moment so far, before (n - 1) R
    best[:, 0] = 0.0
    picks = np.zeros((len(options), rows, width), dtype=np.int8)
    for i, (opts, secs) in enumerate(zip(options, seconds)):
        nxt = np.full_like(best, math.inf)
        nxt_held = np.zeros_like(held)
        nxt_least = np.zeros_like(least)
        # the options holding less first: of two prefixes as fast, the one reaching a slot first stays
        for k in sorted(range(len(opts)), key=lambda k: opts[k].retained_bytes):
            option, s = opts[k], secs[k]
            need = int(math.ceil(option.retained_bytes / quantum - 1e-9))
            if need >= width or not math.isfinite(s):
                continue
            moved = best[:, : width - need] + s
            # its backward's moment; its forward's, where that needs more (gradients counted as at
            # the backward: a bound), is checked exactly with the rest by `stage_peak`
            left = per_layer[i] - max(option.working_bytes, option.forward_bytes) - held[:, : width - need]
            moved[left < ahead] = math.inf
            better = moved < nxt[:, need:]
            np.copyto(nxt[:, need:], moved, where=better)
            np.copyto(nxt_held[:, need:], held[:, : width - need] + option.retained_bytes, where=better)
            np.copyto(nxt_least[:, need:], np.minimum(least[:, : width - need], left), where=better)
            np.copyto(picks[i][:, need:], k, where=better)
        best, held, least = nxt, nxt_held, nxt_least
    # the retained bytes fit the head's moment and every layer's: (n - 1) R within the least room left
    best = np.where((held <= total) & (max(stage.in_flight - 1, 0.0) * held <= least), best, math.inf)
    flat = int(np.argmin(best))
    row, end = divmod(flat, width)
    if not math.isfinite(best[row, end]):
        return None
    chosen = []
    for i in range(len(options) - 1, -1, -1):
        k = int(picks[i][row][end])
        chosen.append(k)
        end -= int(math.ceil(options[i][k].retained_bytes / quantum - 1e-9))
    return chosen[::-1]


__all__ = ["PIPELINE_SLOTS", "SLOTS", "TARGETS", "bound_bytes", "cheapest_mix"]
