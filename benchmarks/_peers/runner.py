"""One prepared model per strategy, measured side by side: peak bytes, step time, gradients.

A step is: gradients set to None, the RNG seeded, forward, loss, backward (no optimizer: its
cost is the same for every strategy and would only dilute the differences). Every runner starts
from the same weights and batch, so its gradients must equal those of the no-recompute run.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from remat._batch import LossFn, call_model, compute_loss
from remat.verify import max_rel_diff

STEP_SEED = 1234


@dataclass(kw_only=True)
class Runner:
    """A strategy ready to step, and what was measured on it."""

    name: str
    """Row label."""
    mode: str
    """``eager`` or ``compile``."""
    source: str
    """``peer`` or ``remat``."""
    module: nn.Module
    """What is called: the prepared model (or its compiled wrapper)."""
    params: list[nn.Parameter]
    """The model's parameters in the original model's order (gradients are read from them)."""
    batch: Any
    loss_fn: LossFn | None
    detail: str = ""
    """What the strategy is (plan summary, budget...)."""
    plan: Any = None
    """remat runners: the applied `remat.Plan`."""
    times_ms: list[float] = field(default_factory=list)
    """Every timed step."""
    peak_bytes: int | None = None
    """Peak live bytes of a step (the live tracker; eager runs only)."""
    alloc_peak_bytes: int | None = None
    """Resident model bytes + the allocator's peak during a step (torch.profiler memory events)."""
    cuda_peak_bytes: int | None = None
    """CUDA only: resident model bytes + (max_memory_allocated - allocated before the step)."""
    loss: torch.Tensor | None = None
    grads: list[torch.Tensor | None] = field(default_factory=list)
    relative_tolerance: float = 0.0
    """remat runners whose plan chunks the LM head: the normwise relative difference its loss and
    gradients may show against the model without a plan (`remat.apply.head.head_tolerance`:
    the chunks reorder the sums over tokens); 0.0: bit-identical is required."""

    @property
    def step_ms(self) -> float | None:
        return statistics.median(self.times_ms) if self.times_ms else None


def _device(runner: Runner) -> torch.device:
    return runner.params[0].device


def step(runner: Runner) -> torch.Tensor:
    """One training step without optimizer; returns the detached loss."""
    for p in runner.params:
        p.grad = None
    torch.manual_seed(STEP_SEED)
    loss = compute_loss(call_model(runner.module, runner.batch), runner.batch, runner.loss_fn)
    loss.backward()
    return loss.detach()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(runner: Runner) -> float:
    """Run one step and record its wall time in milliseconds."""
    device = _device(runner)
    _sync(device)
    start = time.perf_counter()
    step(runner)
    _sync(device)
    elapsed_ms = (time.perf_counter() - start) * 1e3
    runner.times_ms.append(elapsed_ms)
    return elapsed_ms


def warm_up(runner: Runner, num_steps: int) -> None:
    """Untimed steps (compilation, allocator warm-up); keeps the loss and gradients of the last."""
    for _ in range(num_steps):
        runner.loss = step(runner)
    runner.grads = [None if p.grad is None else p.grad.detach().clone() for p in runner.params]


def measure_peak(runner: Runner) -> None:
    """Peak bytes of one step: live tracker, allocator events, and on CUDA max_memory_allocated."""
    from benchmarks._peers.tracking import allocator_peak_bytes, tracked_peak_bytes

    device = _device(runner)
    for p in runner.params:
        p.grad = None
    runner.alloc_peak_bytes = allocator_peak_bytes(runner.module, lambda: step(runner), device)
    for p in runner.params:
        p.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    if runner.mode == "eager":
        # Under the tracker's dispatch mode and saved-tensor hooks dynamo cannot compile the
        # frame; it falls back to eager and marks the shared forward code as skipped, so every
        # later compiled model would silently run eager. Compiled runs use the allocator peak.
        runner.peak_bytes = tracked_peak_bytes(runner.module, lambda: step(runner), runner.batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        resident = sum(t.numel() * t.element_size() for t in _state_tensors(runner))
        runner.cuda_peak_bytes = resident + torch.cuda.max_memory_allocated(device) - before


def _state_tensors(runner: Runner) -> list[torch.Tensor]:
    buffers = list(runner.module.buffers())
    return list(runner.params) + buffers


def interleaved_timing(runners: list[Runner], repeats: int) -> None:
    """``repeats`` rounds; each round times one step of every runner, starting one later each round.

    Interleaving spreads the machine's load changes over all strategies alike.
    """
    if not runners:
        return
    for r in range(repeats):
        start = r % len(runners)
        for runner in runners[start:] + runners[:start]:
            timed_step(runner)


@dataclass(kw_only=True, frozen=True)
class GradCheck:
    """Gradients and loss of a run against a reference run."""

    identical: bool
    """Loss and every gradient bit-identical."""
    max_abs_diff: float
    """Largest absolute difference over the loss and every gradient."""
    max_rel_diff: float = 0.0
    """Largest normwise relative difference (`remat.verify.max_rel_diff`)."""
    relative_tolerance: float = 0.0
    """What the run's head strategy allows (`Runner.relative_tolerance`); 0.0: nothing."""

    @property
    def accepted(self) -> bool:
        """Bit-identical, or a chunked head's reordering within its stated tolerance."""
        return self.identical or (self.relative_tolerance > 0 and self.max_rel_diff <= self.relative_tolerance)

    @property
    def label(self) -> str:
        if self.identical:
            return "identical"
        if self.accepted:
            return (f"within the chunked head's tolerance (rel {self.max_rel_diff:.1e} <= "
                    f"{self.relative_tolerance:.0e})")
        return f"differs (max |d| {self.max_abs_diff:.2e})"


def compare_grads(run: Runner, reference: Runner) -> GradCheck:
    """Compare loss and gradients (parameter by parameter, in model order)."""
    pairs = [(run.loss, reference.loss)] + list(zip(run.grads, reference.grads, strict=True))
    identical, worst = True, 0.0
    for got, want in pairs:
        if got is None or want is None:
            if got is not want:
                return GradCheck(identical=False, max_abs_diff=float("inf"))
            continue
        if got.shape != want.shape:
            return GradCheck(identical=False, max_abs_diff=float("inf"))
        identical = identical and torch.equal(got, want)
        worst = max(worst, (got.float() - want.float()).abs().max().item())
    rel = max_rel_diff([p[0] for p in pairs], [p[1] for p in pairs])
    return GradCheck(identical=identical, max_abs_diff=worst, max_rel_diff=rel,
                     relative_tolerance=run.relative_tolerance)
