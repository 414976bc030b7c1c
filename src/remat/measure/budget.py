"""How long a timing probe runs: a share of the model's training step, not fixed seconds.

A probe that repeats until a fixed time has passed (0.25 s each, before) costs a model with
fast steps hundreds of steps and a model with slow ones nothing; a profile is priced in steps of
the model it measures. A `ProbeBudget` gives a probe ``steps`` training steps' time
(``steps * step_ms``): after one untimed warm-up run, whose time says what a run costs, it takes
as many timed runs as fit, never fewer than ``min_repeats`` (a median needs a few) nor more
than ``max_repeats``. A model whose step takes a few milliseconds may give its probes a little
more (``floor_ms``): a median of a dozen runs of a 0.5 ms block moved by 20 % from one profile
to the next, and at that speed a hundred milliseconds is still nothing against the profile's
other parts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ProbeBudget", "MAX_REPEATS", "lockstep"]

MAX_REPEATS = 400
"""Timed runs of one probe at most, however fast it is."""


@dataclass(kw_only=True, frozen=True)
class ProbeBudget:
    """Time one probe may take, in training steps of the model measured."""

    step_ms: float
    """The model's plain training step, milliseconds (the profile's median)."""
    steps: float
    """Steps' time the probe may take."""
    min_repeats: int = 1
    """Timed runs at least."""
    max_repeats: int = MAX_REPEATS
    """Timed runs at most."""
    floor_ms: float = 0.0
    """Milliseconds the probe may take however fast the step is."""

    def __post_init__(self) -> None:
        if not self.step_ms >= 0 or not self.steps >= 0 or not self.floor_ms >= 0:
            raise ValueError(f"step_ms={self.step_ms!r}, steps={self.steps!r} and floor_ms={self.floor_ms!r} must "
                             "be >= 0 (a probe's time as a number of the model's steps, and its least ms).")
        if not 1 <= self.min_repeats <= self.max_repeats:
            raise ValueError(f"min_repeats={self.min_repeats!r}, max_repeats={self.max_repeats!r}: need "
                             "1 <= min_repeats <= max_repeats.")

    @property
    def budget_ms(self) -> float:
        """Milliseconds the probe may take."""
        return max(self.steps * self.step_ms, self.floor_ms)

    def repeats(self, run_ms: float) -> int:
        """Timed runs of a probe whose one run takes ``run_ms`` (the warm-up's time): as many as
        fit in `budget_ms`, within ``[min_repeats, max_repeats]``."""
        if lockstep():  # every rank runs the same number of steps, whatever its clock says
            return self.min_repeats
        if run_ms <= 0:
            return self.max_repeats
        fit = math.floor(self.budget_ms / run_ms)
        return max(self.min_repeats, min(self.max_repeats, fit))

    def split(self, parts: int) -> ProbeBudget:
        """The budget of one of ``parts`` probes sharing this one's time equally."""
        parts = max(parts, 1)
        return ProbeBudget(step_ms=self.step_ms, steps=self.steps / parts, min_repeats=self.min_repeats,
                           max_repeats=self.max_repeats, floor_ms=self.floor_ms / parts)


def lockstep() -> bool:
    """Whether the profile runs on several ranks of a process group (a tensor-parallel model,
    whose forward holds collectives): then every count of steps and probe runs is fixed, never
    read off a clock, or the ranks would run different numbers of forwards and wait on each
    other's collectives for ever."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
