"""The fastest mix of per-layer strategies that fits: a multiple-choice knapsack over a stage.

Each layer of a stage takes one option (``none``, ``selective``, ``full``, ``offload``: what it
retains and the seconds it adds, `remat.estimate.layers` and `remat.estimate.stage.extra_s`).
The stage's peak grows with the sum of the retained bytes times the micro-batches in flight, so
the least added time whose retained bytes fit the room left is a multiple-choice knapsack:

    T[i][m] = min over options o of layer i: T[i-1][m - slots(o)] + seconds(o)

over memory slots of ``room / SLOTS`` bytes, sizes rounded up (a mix the table accepts fits in
bytes). The layers holding the most run their backward first (`_ordered`), so the room depends
on the largest option chosen: the table is solved once per option of the last layer, the
others limited to options retaining no more (`_room` bounds every moment of the peak). The
uniform mixes (every layer on one option) are priced beside them and the fastest of all that
fit in bytes wins. Unlike the planner's search (`remat.plan.search`), it does not nest
recomputed segments or mix selective policies per op: an estimate of a 405B model's 126 layers
at a few thousand slots runs in milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from remat.estimate.layers import LayerCost
from remat.estimate.stage import Stage, stage_peak

SLOTS = 2048
"""Memory slots of the knapsack table."""


def cheapest_mix(stage: Stage, options: Sequence[Sequence[LayerCost]], seconds: Sequence[Sequence[float]],
                 budget_bytes: float) -> tuple[LayerCost, ...] | None:
    """For each layer of ``stage`` one of its options (``options[i][k]`` costing ``seconds[i][k]``),
    with the least summed time whose stage peak fits ``budget_bytes``; None when none does."""
    picks = [[k] * len(options) for k in range(len(options[0]))] if options else [[]]
    for k in range(len(options[-1]) if options else 0):
        mixed = _knapsack(stage, options, seconds, budget_bytes, k)
        if mixed is not None:
            picks.append(mixed)
    candidates = [_ordered(stage, [options[i][k] for i, k in enumerate(p)], [seconds[i][k] for i, k in enumerate(p)])
                  for p in picks]
    fitting = [c for c in candidates if stage_peak(stage, c[0]).peak_bytes <= budget_bytes]
    return min(fitting, key=lambda c: c[1])[0] if fitting else None


def _ordered(stage: Stage, mix: list[LayerCost], secs: list[float]) -> tuple[tuple[LayerCost, ...], float]:
    """The mix with, within each run of identical layers, the layers holding the most last in
    forward order: their backward runs first, while every other layer's activations are still
    held, so the largest retained bytes are freed first. Returns it and its summed seconds."""
    out = list(mix)
    start = 0
    for end in range(1, len(mix) + 1):
        if end == len(mix) or stage.layers[end] != stage.layers[start]:
            out[start:end] = sorted(mix[start:end], key=lambda c: c.retained_bytes)
            start = end
    return tuple(out), sum(secs)


def _room(stage: Stage, last: LayerCost, allowed: Sequence[Sequence[LayerCost]], budget_bytes: float) -> float:
    """Retained bytes per micro-batch in flight that the layers before the last may hold, the
    last holding the most (``last``): layer i's backward peaks at
    ``state + n (pre + sum r) - sum_{j >= i} r_j + w_i <= state + n (pre + sum r) - r_last + max(w_last, w_i - r_i)``
    (every later layer holds at least r_i, the last r_last), and the head at
    ``state + n (pre + sum r) + head``."""
    state = float(stage.state.total_bytes - stage.state.grad_bytes) + stage.grads_live(0)
    n = stage.in_flight
    slack = max([last.working_bytes] + [o.working_bytes - o.retained_bytes for opts in allowed for o in opts])
    room = (budget_bytes - state - stage.buffer_bytes + last.retained_bytes - slack) / n
    if stage.last:
        head = stage.state.total_bytes - stage.state.grad_bytes + stage.grads_live(None)
        room = min(room, (budget_bytes - head - stage.post_saved_bytes - stage.post_working_bytes) / n)
    return room - stage.pre_bytes - last.retained_bytes


def _knapsack(stage: Stage, options: Sequence[Sequence[LayerCost]], seconds: Sequence[Sequence[float]],
              budget_bytes: float, last: int) -> list[int] | None:
    """Option index per layer from the table (module docstring), the last layer on option
    ``last`` and the others on options retaining no more; None when nothing fits."""
    top = options[-1][last]
    allowed = [[o for o in opts if o.retained_bytes <= top.retained_bytes] for opts in options[:-1]]
    room = _room(stage, top, allowed, budget_bytes)
    if room < 0:
        return None
    quantum = max(room / SLOTS, 1.0)
    slots = int(room // quantum)
    best = np.full(slots + 1, math.inf)
    best[0] = 0.0
    picks = np.zeros((len(options) - 1, slots + 1), dtype=np.int16)
    for i, (opts, secs) in enumerate(zip(options[:-1], seconds[:-1])):
        nxt = np.full(slots + 1, math.inf)
        for k, (option, s) in enumerate(zip(opts, secs)):
            need = int(math.ceil(option.retained_bytes / quantum - 1e-9))
            if need > slots or not math.isfinite(s) or option.retained_bytes > top.retained_bytes:
                continue
            shifted = np.full(slots + 1, math.inf)
            shifted[need:] = best[: slots + 1 - need] + s
            better = shifted < nxt
            nxt[better], picks[i][better] = shifted[better], k
        best = nxt
    end = int(np.argmin(best))
    if not math.isfinite(best[end]):
        return None
    return _backtrack(options[:-1], picks, end, quantum) + [last]


def _backtrack(options: Sequence[Sequence[LayerCost]], picks: np.ndarray, end: int, quantum: float) -> list[int]:
    chosen = []
    slot = end
    for i in range(len(options) - 1, -1, -1):
        k = int(picks[i][slot])
        chosen.append(k)
        slot -= int(math.ceil(options[i][k].retained_bytes / quantum - 1e-9))
    return chosen[::-1]


__all__ = ["SLOTS", "cheapest_mix"]
