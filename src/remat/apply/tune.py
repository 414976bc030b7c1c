"""Measured tuning, the timing half: candidate plans run side by side on the real model.

``remat.plan(profile, budget, tune=remat.Tuner(model, batch, loss_fn, optimizer))``, or
``remat.tune(model, batch, profile, budget, loss_fn, optimizer)``: the planning layer makes the
candidates (`remat.plan.tune.tune_candidates`: the cost model's best few plans and every recipe
that fits), a `Tuner` times them, and `remat.plan.tune.choose` keeps the fastest measured whose
measured peak fits. Tuning needs the model and a batch because it runs them; a `Tuner` holds
them (its constructor only stores them) so that `remat.plan`, which sees only the profile, can
run them.

Per candidate, through the real runtime (`remat.apply_`, a step, `remat.remove_`): one warm-up
step (not timed), one step under the live-storage tracker (its peak, checked against the
budget), then rounds: each round times one step of every candidate still in, in an order
rotated every round, so that a drift of the machine's speed falls on all alike; medians are
compared. Tuning stops after ``max_steps`` rounds or, checked after each round, once the rounds
have taken ``max_seconds``, whichever comes first (at least one round runs). So it costs about
``(2 + rounds) x candidates`` steps. Every step starts from the same seed; the model's
parameters, buffers, gradients, the optimizer state and the RNG state are restored afterwards
(`remat.measure.state.StateSnapshot`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from remat._batch import LossFn, check_batch_device, check_step_inputs, model_device
from remat.apply.api import applied, is_applied
from remat.checkpointing.callsites import block_modules
from remat.measure.profile import _Step
from remat.measure.state import StateSnapshot
from remat.measure.timing import Clock
from remat.measure.tracker import track_step
from remat.measure.types import Profile
from remat.plan.planners import plan
from remat.plan.tune import DEFAULT_NUM_OPTIMAL, Candidate, Measurement, TuneBounds, choose, tune_candidates
from remat.plan.types import Plan

__all__ = ["Tuner", "tune", "TimeStep", "DEFAULT_MAX_STEPS", "DEFAULT_MAX_SECONDS"]

DEFAULT_MAX_STEPS = 20
"""Timed steps per candidate at most (the warm-up and the tracked step not counted)."""
DEFAULT_MAX_SECONDS = 30.0
"""Wall-clock seconds of timing rounds after which no new round starts."""
SEED = 1234
"""Seed of every step tuning runs."""

TimeStep = Callable[[Plan, Callable[[], None]], float]
"""``time_step(plan, run_step) -> ms``: runs ``run_step()`` once (``plan`` applied) and returns
its time in milliseconds. The default reads the device's clock (`remat.measure.timing.Clock`)."""


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1.")


class Tuner:
    """Times candidate plans on ``model`` and ``batch`` (`remat.plan(..., tune=Tuner(...))`).

    ``max_steps``: timed steps per candidate at most; ``max_seconds``: no new round once the
    rounds took this long; ``num_optimal``: the cost model's plans among the candidates;
    ``offload_dir``: where ``offload:disk`` plans write; ``time_step``: a `TimeStep` in place of
    the device's clock (tests give a deterministic one)."""

    def __init__(self, model: nn.Module, batch: Any, loss_fn: LossFn | None = None,
                 optimizer: torch.optim.Optimizer | None = None, *, max_steps: int = DEFAULT_MAX_STEPS,
                 max_seconds: float = DEFAULT_MAX_SECONDS, num_optimal: int = DEFAULT_NUM_OPTIMAL,
                 offload_dir: str | None = None, time_step: TimeStep | None = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Tuner needs the nn.Module to time, got {type(model).__name__}.")
        _positive_int("max_steps", max_steps)
        _positive_int("num_optimal", num_optimal)
        if isinstance(max_seconds, bool) or not isinstance(max_seconds, (int, float)) or not max_seconds > 0:
            raise ValueError(f"max_seconds={max_seconds!r} must be a number of seconds > 0.")
        self.model, self.batch, self.loss_fn, self.optimizer = model, batch, loss_fn, optimizer
        self.max_steps, self.max_seconds, self.num_optimal = max_steps, float(max_seconds), num_optimal
        self.offload_dir = offload_dir
        self.time_step = time_step

    def tuned_plan(self, profile: Profile, budget: int, head: str | None = None) -> Plan:
        """The fastest measured of `tune_candidates` under ``budget`` (bytes), with its `Tuning`."""
        if profile.compiled_backend:
            raise ValueError(
                f"the profile was taken for a model compiled with backend {profile.compiled_backend!r}, and tuning "
                "times the candidates' eager steps, whose times and peaks are not the compiled ones (a compiled "
                "full-recomputation step of a small Llama held 12 % more than its eager step). Plan without tune= "
                "and check the plan on the compiled step with remat.verify, or tune from an eager profile "
                "(remat.profile(..., compiled=False)) for a model that trains eagerly.")
        candidates = tune_candidates(profile, budget, head, self.num_optimal)
        measurements, bounds = self.measure(candidates)
        return choose(candidates, measurements, budget, bounds)

    def measure(self, candidates: Sequence[Candidate]) -> tuple[tuple[Measurement, ...], TuneBounds]:
        """Warm-up, tracked peak and interleaved timed rounds of every candidate (module docstring)."""
        if is_applied(self.model):
            raise ValueError(f"{type(self.model).__name__} already has a remat plan applied; call "
                             "remat.remove_(model) before tuning.")
        check_batch_device(self.model, self.batch)
        check_step_inputs(self.optimizer, "remat tuning", self.loss_fn)
        device = model_device(self.model)
        snapshot = StateSnapshot(self.model, self.optimizer, self.batch)
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                step = _Step(self.model, self.batch, self.loss_fn, self.optimizer)
                return self._measure(step, [c.plan for c in candidates], Clock(device))
        finally:
            snapshot.restore()

    def _measure(self, step: _Step, plans: list[Plan], clock: Clock) -> tuple[tuple[Measurement, ...], TuneBounds]:
        first = [self._first_steps(step, plan) for plan in plans]
        errors = [error for _, _, error in first]
        times: list[list[float]] = [[] for _ in plans]
        start, rounds = time.perf_counter(), 0
        live = [i for i, e in enumerate(errors) if not e]
        while live and rounds < self.max_steps:
            shift = rounds % len(live)
            for i in live[shift:] + live[:shift]:
                times[i].append(self._timed(step, plans[i], clock))
            rounds += 1
            if time.perf_counter() - start >= self.max_seconds:
                break
        bounds = TuneBounds(max_steps=self.max_steps, max_seconds=self.max_seconds, rounds=rounds,
                            seconds=time.perf_counter() - start)
        return tuple(Measurement(step_ms=tuple(t), peak_bytes=peak, device_peak_bytes=device_peak, error=error)
                     for t, (peak, device_peak, error) in zip(times, first)), bounds

    def _first_steps(self, step: _Step, plan: Plan) -> tuple[int | None, int | None, str]:
        """One warm-up step, then one under the live-storage tracker: (peak, CUDA allocator peak, "")
        or (None, None, why it failed)."""
        try:
            with applied(self.model, plan, batch=self.batch, offload_dir=self.offload_dir):
                torch.manual_seed(SEED)
                step.run()
                torch.manual_seed(SEED)
                blocks = list(zip(plan.block_names, block_modules(self.model, plan.block_names)[0]))  # as applied
                tracked = track_step(step.run, model=self.model, optimizer=self.optimizer, blocks=blocks,
                                     batch=self.batch)
            return tracked.peak_bytes, tracked.device_max_allocated_bytes, ""
        except RuntimeError as error:  # torch.OutOfMemoryError among them: this candidate cannot run
            return None, None, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"

    def _timed(self, step: _Step, plan: Plan, clock: Clock) -> float:
        with applied(self.model, plan, batch=self.batch, offload_dir=self.offload_dir):
            torch.manual_seed(SEED)
            if self.time_step is not None:
                return float(self.time_step(plan, step.run))
            clock.sync()
            begin = clock.mark()
            step.run()
            end = clock.mark()
            return clock.elapsed_ms(begin, end)


def tune(model: nn.Module, batch: Any, profile: Profile, budget: int | str, loss_fn: LossFn | None = None,
         optimizer: torch.optim.Optimizer | None = None, *, head: str | None = None, **options: Any) -> Plan:
    """``remat.plan(profile, budget, head=head, tune=Tuner(model, batch, loss_fn, optimizer, **options))``:
    the fastest measured plan under ``budget`` (bytes or text such as ``"40%"``), with the record
    of what was timed in ``plan.tuning``."""
    return plan(profile, budget, head=head, tune=Tuner(model, batch, loss_fn, optimizer, **options))
