"""The compiled steps of `remat.verify`, for a plan made from a compiled profile.

Such a plan predicts the step the user runs compiled, and the compiled step's memory is not the
eager step's: inductor's kernels allocate buffers no tensor shows, its partitioner saves other
tensors than eager autograd, and its buffer reuse can keep a freed buffer until a later one of
the same size takes it. So after the eager comparison, the baseline's and the plan's copies each
run compiled with the plan's backend (``torch.compile(model, backend=...)``, graph breaks allowed,
as a plain ``torch.compile`` of the model does), and:

- the peak is the allocator's: the bytes the step starts from, counted as the live tracker counts
  them (parameters, buffers, gradients, optimizer state: `remat.measure.tracker.state_bytes`; not
  the batch), plus the allocator's net peak of the compiled step above them
  (`remat.measure.tracker.allocator_net_peak_bytes`), which sees the buffers inside compiled
  kernels and memory no tensor shows (a checkpoint's saved CPU generator state, a oneDNN
  scratch buffer), where the tracker sees neither;
- the times are medians of ``repeats`` rounds, the two steps in turn (the order swapped every
  round), after `WARMUP` steps each (the compile, then the step with the optimizer's state).

Both steps run with dynamo's ``skip_fwd_side_effects_in_bwd_under_checkpoint``, as the compiled
profile tells the user to set it where a block's forward writes Python state outside itself (the
`kernels` package's attention): without it, torch.compile breaks the graph at every such
checkpoint (graph breaks being allowed here, it would not raise), and a tiny Llama's full plan
measured that graph-broken step (272,744 B, 13 breaks) where the step the user is told to run
holds 271,144 B. Where no forward writes outside itself the flag changes nothing. A model that
does not compile at all leaves the eager comparison as it was and says why (``compiled_error``).
"""

from __future__ import annotations

import dataclasses
import statistics
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from remat._batch import call_model, compute_loss
from remat.measure.probes import failure_reason
from remat.measure.profile import _Step
from remat.measure.timing import Clock
from remat.measure.tracker import allocator_net_peak_bytes, state_bytes
from remat.verify_types import Verification

__all__ = ["WARMUP", "with_compiled_steps"]

WARMUP = 2
"""Untimed steps of each compiled copy before it is measured: the first compiles, the second
runs with the optimizer's state made (a recompile where the graph reads it)."""


def with_compiled_steps(result: Verification, runs: Sequence[Any], *, accumulate: bool, repeats: int,
                        device: torch.device) -> Verification:
    """``result`` with its ``compiled_*`` fields measured: ``runs`` are verify's baseline and
    planned copies (each with ``model``, ``optimizer``, ``step`` and ``_seed``)."""
    backend = result.compiled_backend
    limit = max(torch._dynamo.config.recompile_limit, 8 + 2 * len(runs))
    try:
        with torch._dynamo.config.patch(recompile_limit=limit, skip_fwd_side_effects_in_bwd_under_checkpoint=True):
            found = _measure(runs, backend, accumulate, repeats, device)
    except Exception as exc:  # the eager comparison stands; the compiled one says why it is missing
        root = exc
        while (inner := getattr(root, "inner_exception", None) or root.__cause__) is not None:
            root = inner  # dynamo wraps what the backend raised
        reason = failure_reason(exc) + ("" if root is exc else f" ({failure_reason(root)})")
        warnings.warn(f"remat.verify could not run the steps compiled with backend {backend!r}: {reason}. The "
                      "eager comparison stands; the compiled fields are 0.", UserWarning, stacklevel=3)
        return dataclasses.replace(result, compiled_error=reason)
    (base_peak, peak), (base_ms, step_ms) = found
    predicted = result.predicted_peak_bytes
    return dataclasses.replace(
        result, compiled_baseline_peak_bytes=base_peak, compiled_peak_bytes=peak,
        compiled_peak_error_pct=100.0 * (peak - predicted) / predicted if predicted else float("inf"),
        compiled_baseline_step_ms=base_ms, compiled_step_ms=step_ms)


def _measure(runs: Sequence[Any], backend: str, accumulate: bool, repeats: int,
             device: torch.device) -> tuple[list[int], list[float]]:
    compiled = [_Step(torch.compile(run.model, backend=backend), run.step.batch, run.step.loss_fn, run.optimizer)
                for run in runs]
    for run, step in zip(runs, compiled):
        for _ in range(WARMUP):
            _run(run, step, accumulate)
    peaks = [_run(run, step, accumulate, measure=device) for run, step in zip(runs, compiled)]
    clock = Clock(device)
    times: list[list[float]] = [[] for _ in runs]
    for r in range(repeats):
        for k in (range(len(runs)) if r % 2 == 0 else reversed(range(len(runs)))):
            times[k].append(_run(runs[k], compiled[k], accumulate, clock=clock))
    return peaks, [statistics.median(t) for t in times]


def _run(run: Any, step: _Step, accumulate: bool, *, measure: torch.device | None = None,
         clock: Clock | None = None) -> Any:
    """One step of ``step`` from verify's seed, as verify's tracked step runs it (under gradient
    accumulation the last micro-batch's, after one whose gradients it adds to); ``measure``: the
    allocator's net peak of that step on the device; ``clock``: its time in ms."""
    def prepare() -> None:
        run._seed()
        if accumulate:
            (step.optimizer or step.model).zero_grad(set_to_none=True)
            compute_loss(call_model(step.model, step.batch), step.batch, step.loss_fn).backward()
            run._seed()

    def fn() -> None:
        step.run(accumulate=accumulate)

    if measure is not None:  # after one such step recorded: the sizes of what the measured one frees are known
        net = allocator_net_peak_bytes(fn, measure, before=lambda: (prepare(), fn(), prepare()))
        return state_bytes(run.model, run.optimizer, measure) + net
    prepare()
    if clock is None:
        return fn()
    clock.sync()
    start = clock.mark()
    fn()
    end = clock.mark()
    clock.sync()
    return clock.elapsed_ms(start, end)
