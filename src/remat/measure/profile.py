"""`profile`: measure the real model on its device, block by block.

One call runs the forward once (no backward) to find the stacks and the order the blocks run
in (`remat.measure.stacks`), ``max(warmup, 1)`` plain steps (so optimizer state exists),
one *accounting* step under the live-storage tracker, the saved-tensor accountant, the op
recorder and the dataflow recorder (`remat.measure.dataflow`), then ``repeats`` timed steps
(each after a plain one, timed whole: the parts are scaled to the plain steps' median,
`remat.measure.timing.without_instrumentation`) and ``repeats - 1`` more forwards for per-op
times, one forward without gradients for the calls whose outputs the code holds to the end
(`remat.measure.held`), then each block alone, plain and checkpointed, for the checkpointing overheads
(`remat.measure.overhead`; a probe that fails marks its strategy unavailable for the block,
`BlockProfile.unavailable`). Blocks that are the same computation share these timing probes:
they run on the first of them, and the forwards stop after the last block that runs them
(`remat.measure.sharing`; every block's bytes still come from the accounting step). The
overhead probes take a share of the step's time, not fixed seconds (`OVERHEAD_STEPS`,
`remat.measure.budget`), and a fault's cost is probed beside the timed steps that fault.
A step is ``zero_grad(set_to_none=True)``, forward, loss,
``loss.backward()``, ``optimizer.step()``. Parameters, buffers, gradients, optimizer state and
the RNG state are restored afterwards. Hugging Face key/value caches are off throughout, as
under a plan (`remat.checkpointing.caches`; not on the meta device, `_cache_off`), and LayerDrop
rates are 0 (`remat.measure.layerdrop`): every layer runs in every step measured; such a model's
blocks are not joined into multi-block segments (training skips layers: a block may not be fed
by the one before it).

Blocks are numbered in run order; the code between blocks j-1 and j (``between_j``: pooling,
patch merging, an encoder's final norm and a decoder's embeddings) is a segment of its own,
recorded on block j. The memory quantities satisfy, for the measured (keep-everything) step,
exactly (``P, B, O``: parameter, buffer, optimizer-state bytes; ``G_j``: gradient bytes live
when block j's backward starts; ``G_post``: gradients live when ``loss.backward()`` starts, 0
after ``zero_grad(set_to_none=True)``; ``S_<j``: the saved bytes of everything before block j,
``fixed_pre_saved_bytes + sum over i < j of (saved_bytes_i + between_saved_bytes_i) +
between_saved_bytes_j``):

- peak during block j's backward = ``P + B + O + G_j + S_<j + saved_bytes_j + bwd_temp_bytes_j``;
  when it starts the same with ``bwd_start_temp_bytes_j`` in place of ``bwd_temp_bytes_j``;
- peak during the backward of the code before block j (from the gradient of block j's chained
  input to the start of block j-1's backward) = ``P + B + O + G_j + grad_bytes_j + S_<j +
  between_bwd_temp_bytes_j`` (its own saved bytes are in ``S_<j``);
- peak from ``loss.backward()`` to the start of the last block's backward (the head's and the
  loss's backward) = ``P + B + O + G_post + S_<N + fixed_post_saved_bytes +
  fixed_post_bwd_temp_bytes`` (``S_<N``: every saved byte before the post part);
- peak during ``optimizer.step()`` = ``P + B + O + grad_bytes + step_held_bytes +
  optimizer_step_temp_bytes`` (``step_held_bytes``: what the step leaves on the model);
- peak during block j's forward = live bytes when it starts + ``saved_bytes_j +
  fwd_temp_bytes_j``, and the live bytes when it starts = ``P + B + O + S_<j +
  (shared_entry_bytes of blocks <= j) + fwd_other_bytes_j`` (no gradient exists yet);
- with a head part (`remat.measure.types.HeadProfile`), the head's backward ends where the
  gradient of the projection's input is ready, which splits the post window:
  ``fixed_post_saved_bytes + fixed_post_bwd_temp_bytes = max(head.post_head_bytes,
  head.post_rest_bytes)``, the head's and the rest's (final norm's) peaks above the same base.

So ``bwd_temp_bytes`` holds everything else live at that peak: the incoming gradient, the
gradients the block's own backward computes (parameter gradients included), saved tensors of
later blocks not yet freed, minus the block's own saved bytes already freed at that moment.
It is never negative: when the block's backward starts all of its saved bytes are live.
``G_j`` is ``grad_bytes - fixed_pre_grad_bytes - sum over blocks i <= j of (grad_bytes_i +
between_grad_bytes_i)`` (after ``zero_grad(set_to_none=True)``; parameters shared between blocks
count for the block whose backward accumulates them first). How a plan changes which of these
storages are live is `remat.plan.costs`'s subject (the dataflow terms of `remat.measure.dataflow`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import platform
import socket
import statistics
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat._batch import (LossFn, batch_tensors, call_model, check_batch_device, check_grad_enabled, check_model, check_step_inputs,
                          compute_loss, model_device)
from remat.checkpointing.cacheable import cacheable
from remat.checkpointing.callsites import layers_of, uninstall
from remat.checkpointing.caches import CacheOff, as_in_training
from remat.measure.layerdrop import LayerDropOff
from remat.measure.blocks import Blocks
from remat.measure.boundaries import Boundary, StepBoundaries
from remat.measure.budget import ProbeBudget, lockstep
from remat.measure.compiled import backend_name, measure_compiled, measure_pre_part, with_compiled
from remat.measure.dataflow import BlockFlow, DataflowRecorder, block_flows
from remat.measure.fixed import fixed_modules
from remat.measure.faults import FaultCount, first_touch_ms_per_byte
from remat.measure.fingerprint import fingerprint, model_hash
from remat.measure.held import code_held_calls
from remat.measure.head import HeadBoundary, capture_head, chunk_candidates, measure_head
from remat.measure.probes import failure_reason
from remat.measure.ops import OpRecorder
from remat.measure.overhead import (BlockOverheads, capture_block_inputs, measure_checkpoint_call_ms, measure_overheads,
                                    uncacheable_share)
from remat.measure.saved import BETWEEN, POST, PRE, SavedAccountant, between_name
from remat.measure.sharing import (BlockGroups, CallSignatures, group_blocks, stop_after, structure_key, trace_key,
                                   without_grad_flags)
from remat.measure.size_groups import another_draw, shape_from_values, size_groups
from remat.measure.stacks import Discovery, discover
from remat.measure.storage import storage_key, storage_keys, storage_nbytes, tensors_in
from remat.measure.state import (StateSnapshot, buffer_bytes, generators_in, grad_bytes, host_rng_restored,
                                 optimizer_state_bytes, param_bytes)
from remat.measure.timing import Clock, StepTimer, StepTimes, median_times, without_instrumentation
from remat.measure.tracker import StepTracking
from remat.measure.windows import BackwardWindows
from remat.head.site import HeadSite, find_head
from remat.measure.types import (BACKWARD_TWICE, GRADIENT_GRAPH, NO_BACKWARD, BlockProfile, CompiledBlock, Environment, OpRecord, Profile,
                                 own_generator_reason, with_grad_accumulation)

Progress = Callable[[int, int, str], None]


def profile(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    blocks: str | Sequence[str] | None = None,
    *,
    warmup: int = 1,
    repeats: int = 5,
    progress: Progress | None = None,
    head_chunks: Sequence[int] | None = None,
    share_timing: bool = True,
    compiled: bool | str = False,
    grad_accumulation: bool = False,
    offload_dir: str | os.PathLike | None = None,
) -> Profile:
    """Measure ``model`` on ``batch`` (calling convention of `remat._batch`) block by block.

    ``blocks``: None to detect every stack, or glob(s) over qualified module names / class names
    (several patterns may name several stacks). Blocks are numbered in the order the forward
    runs them (`remat.measure.stacks`). ``warmup``: plain steps before measuring (at least one
    runs). ``repeats``: timed steps at most: after `SETTLED_STEPS` of them the timing stops when
    they agree within `SETTLED_SPREAD` (`settled`). ``progress(done, total, stage)`` is called
    after each step or forward it runs (``total`` falls when the timing stops early). ``head_chunks``: chunk sizes (tokens) of the chunked head to measure
    (None: `chunk_candidates`). ``share_timing``: blocks that are the same computation take the
    timing probes of the first of them (`remat.measure.sharing`); False measures every block.
    ``compiled``: the model will train under ``torch.compile`` (True: inductor, or a backend's
    name): each block is also measured compiled and its figures become the compiled ones
    (`remat.measure.compiled`; ``Profile.compiled_backend``). ``grad_accumulation``: the model
    trains with several micro-batches per optimizer step, so every gradient is live through
    every micro-batch after the first, and plans are made for that step
    (`remat.measure.types.with_grad_accumulation`; `remat.verify` then measures one).
    ``offload_dir``: a directory whose disk the plans may offload to: its write and read rates
    are measured after the model's (`remat.measure.bandwidth.with_bandwidths`; on a CUDA model
    the host link's too), so that `remat.plan` offers ``offload:disk``.
    """
    _check_counts(warmup, repeats)
    if offload_dir is not None:  # before any work: a directory that cannot be used fails at once
        from remat._diskio import check_offload_root

        check_offload_root(offload_dir)
    check_grad_enabled("remat.profile")
    check_model(model, "remat.profile")
    check_step_inputs(optimizer, "remat.profile", loss_fn)
    check_batch_device(model, batch)
    _warn_eval_mode(model)
    device = model_device(model)
    backend = backend_name(compiled)
    if backend and device.type == "meta":
        raise ValueError(f"compiled={compiled!r} needs a model that runs: it is on the meta device. "
                         "Profile it on a real device, or pass compiled=False.")
    site, note = find_head(model) if loss_fn is None else (None, "the loss is a loss_fn outside the model")
    structure = model_hash(model)  # as given: a forward may resize buffers (QAT observers start empty)
    snapshot = StateSnapshot(model, optimizer, batch)
    found = None
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                _cache_off(model, device) as cache_off, LayerDropOff(model) as layerdrop:
            step = _Step(model, batch, loss_fn, optimizer, site)
            found = discover(model, blocks, step.forward)
            if cache_off is not None:  # the blocks handed no empty cache either, as under a plan
                cache_off.drop_in([module for _, module in found.blocks])
            if layerdrop.changed:  # a layer that training may skip does not reliably follow the one before
                found = dataclasses.replace(found, follows_previous=(False,) * len(found.blocks))
            prof, windows = _measure(step, found, warmup, repeats, progress, share_timing, backend)
            if cache_off is not None and cache_off.dropped and _cache_read_in_step(step, found, cache_off):
                # the step reads what the blocks write to their caches: measured again, the caches theirs
                cache_off.keep_in_blocks()
                prof, windows = _measure(step, found, warmup, repeats, progress, share_timing, backend,
                                         shared_caches=True)
                prof = dataclasses.replace(prof, fingerprint=dataclasses.replace(prof.fingerprint, shared_cache=True))
            prof = _with_head(step, prof, windows, note, head_chunks, repeats)
            prof = dataclasses.replace(prof, fingerprint=dataclasses.replace(prof.fingerprint, model_hash=structure))
            prof = with_grad_accumulation(prof) if grad_accumulation else prof
    finally:
        if found is not None:
            uninstall(found.sites)
        snapshot.restore()
    ran = model_hash(model)
    if ran != structure:  # the model changed its own structure by running (BigBird-Pegasus)
        prof = dataclasses.replace(prof, fingerprint=dataclasses.replace(prof.fingerprint, run_model_hash=ran))
    if offload_dir is not None:
        from remat.measure.bandwidth import with_bandwidths

        prof = with_bandwidths(prof, device, offload_dir)
    return prof


CACHE_READ_TOLERANCE = 1e-5
"""Relative difference of one forward's loss or of an output's absolute sum, the blocks handed
their caches or none, beyond which the step reads what they write there (`_cache_read_in_step`);
a cache only written differs in the last bits (attention reads the cache's copies of the keys and
values)."""


def _cache_read_in_step(step: _Step, found: Discovery, cache_off: CacheOff) -> bool:
    """Whether the step reads what its blocks write to a key/value cache (DiffusionGemma's encoder
    layers fill the cache its decoder attends to), for a model whose blocks were handed one
    (``cache_off.dropped``): one forward with the caches dropped (`CacheOff.drop_in`) against one
    with them, from the same random numbers: their losses, and the absolute sums of the floating
    tensors of their outputs. The loss alone can miss it: the mean square of a base model's
    normalized last hidden states is 1 whatever they attend to (DiffusionGemma with LoRA adapters,
    trained against it, lost every gradient to its encoder under a plan, its cache dropped)."""
    device = model_device(step.model)

    def figures() -> list[float]:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                host_rng_restored(generators_in(step.batch)):
            torch.manual_seed(0)
            output = call_model(step.model, step.batch)
            loss = float(compute_loss(output, step.batch, step.loss_fn).detach().double())
            with torch.no_grad():
                sums = [float(t.detach().abs().sum(dtype=torch.float64)) for t in tensors_in(output)
                        if t.is_floating_point()]
            del output
            return [loss, *sums]

    dropped = figures()
    cache_off.keep_in_blocks()
    try:
        kept = figures()
    except Exception:  # noqa: BLE001 - a model that cannot run with its blocks' caches: they stay dropped
        return False
    finally:
        cache_off.drop_in([module for _, module in found.blocks])
    if len(dropped) != len(kept):  # the output holds more with the caches (one it returns): the losses alone
        dropped, kept = dropped[:1], kept[:1]
    return any(math.isfinite(a) and math.isfinite(b) and not math.isclose(a, b, rel_tol=CACHE_READ_TOLERANCE, abs_tol=1e-12)
               for a, b in zip(dropped, kept))


def _cache_off(model: nn.Module, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Hugging Face key/value caches off, as under a plan; left as they are on the meta device
    (`remat.estimate`): without a cache, transformers asks a meta tensor whether the sequences are
    packed (``.all()``), which it cannot answer. Nothing is replayed there, and the bytes are the
    same: attention reads the cache's copies of the keys and values, which autograd then saves."""
    return CacheOff(model) if device.type != "meta" else contextlib.nullcontext()


def _check_counts(warmup: int, repeats: int) -> None:
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup={warmup!r} must be an integer >= 0 (plain steps before measuring).")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an integer >= 1 (timed steps; the median is kept).")


@dataclass
class _Step:
    """One baseline training step, announcing its phases on a `StepBoundaries`."""

    model: nn.Module
    batch: Any
    loss_fn: LossFn | None
    optimizer: torch.optim.Optimizer | None
    site: HeadSite | None = None
    """The model's head part, when it has one (`remat.head.site.find_head`)."""

    def run(self, marks: StepBoundaries | None = None, *, accumulate: bool = False) -> None:
        """One step; ``accumulate``: the gradients of a step before are kept and added to (the last
        micro-batch of gradient accumulation)."""
        emit = marks.emit if marks is not None else (lambda *a: None)
        emit("step_start")
        if not accumulate:
            (self.optimizer or self.model).zero_grad(set_to_none=True)
        emit("fwd_begin")
        output = call_model(self.model, self.batch)
        emit("model_end")  # the post part's forward goes on in the loss
        loss = compute_loss(output, self.batch, self.loss_fn)
        del output
        emit("loss_ready")
        emit("bwd_begin")
        loss.backward()
        del loss  # the optimizer step starts from the model state alone
        emit("bwd_done")
        if self.optimizer is not None:
            self.optimizer.step()
        emit("step_end")

    def forward(self) -> None:
        compute_loss(call_model(self.model, self.batch), self.batch, self.loss_fn)


OVERHEAD_STEPS = 1.0
"""Training steps' time the checkpointing-overhead probes take together, each group of blocks
that share them an equal part (`remat.measure.budget`)."""
OVERHEAD_FLOOR_MS = 200.0
"""...or this many milliseconds together when more: a model whose step takes milliseconds."""
OVERHEAD_MIN_REPEATS = 3
"""Timed repeats of each group's overhead probes at least (``repeats`` when fewer)."""
CALL_STEPS = 0.25
"""Steps' time the probe of one checkpointed call's own cost takes (`measure_checkpoint_call_ms`)."""
DRAWS = 3
"""Runs of a block whose calls' sizes may follow the data on its input plus noise
(`remat.measure.size_groups.another_draw`), one forward each without gradients: FlexOlmo's layers
of one batch all hit four of five experts, and another batch three."""
TOUCH_PROBES = 3
"""First-touch probes at most (`remat.measure.faults`), beside the first timed steps that fault:
each fills 64 MiB twice, three steps' time of the built-in GPT at 2 layers under load for five."""
HEAD_ROUNDS = 3
"""Timed rounds of the head's strategies at most (`remat.measure.head`; ``repeats`` when fewer)."""
SETTLED_STEPS = 3
"""Timed steps (plain and instrumented pairs) after which the timing may stop (`settled`)."""
SETTLED_SPREAD = 0.03
"""Largest ``max / min - 1`` of the plain and of the instrumented steps' times at which they count
as settled: a median of 3 within 3 % moves by less than the run-to-run spread of a step on a
shared machine, and the 2 steps more cost a tenth of a profile's time (a 16-layer GPT's profile
is about 20 steps)."""


def settled(plain_ms: Sequence[float], instrumented_ms: Sequence[float]) -> bool:
    """Whether the timed steps so far are enough: at least `SETTLED_STEPS` pairs, and within
    each kind the slowest at most `SETTLED_SPREAD` above the fastest."""
    if min(len(plain_ms), len(instrumented_ms)) < SETTLED_STEPS or lockstep():  # ranks: every step they all run
        return False
    return all(min(ts) > 0 and max(ts) / min(ts) - 1 <= SETTLED_SPREAD for ts in (plain_ms, instrumented_ms))


def _measure(step: _Step, found: Discovery, warmup: int, repeats: int,
             progress: Progress | None, share_timing: bool = True,
             backend: str = "", shared_caches: bool = False) -> tuple[Profile, BackwardWindows]:
    block_list = found.blocks
    device = model_device(step.model)
    timed = repeats if device.type != "meta" else 0  # nothing runs on the meta device to time
    # (`remat.estimate` prices time by FLOPs): the timed steps would be two of a trace's four
    report = _Reporter(progress, max(warmup, 1) + 1 + timed + max(timed - 1, 0))
    for _ in range(max(warmup, 1)):
        step.run()
        report("warm-up step")
    memory = _account(step, block_list)
    report("accounting step")
    times, plain, probes = ([], [], []) if timed else ([_untimed(len(block_list))], [0.0], [])
    for _ in range(timed):
        plain.append(_time_plain_step(step))
        times.append(_time_step(step, block_list))
        if times[-1].fault_bytes and len(probes) < TOUCH_PROBES:  # the cost of a fault probed beside the
            # timed steps that fault (a burst of load slows a few probes); the first probe warms up
            probes.append(first_touch_ms_per_byte(device, repeats=1, discard=0 if probes else 1))
        report("timed step")
        if len(times) < repeats and settled(plain, [t.step_ms for t in times]):
            report.total -= 2 * (repeats - len(times))  # the timed steps and op forwards left out
            break
    groups = _groups(found, memory, share_timing)
    for _ in range(len(times) - 1):
        _time_ops(step, block_list, memory.recorder, groups)
        report("op timing forward")
    _warn_varied(block_list, memory.recorder.varied_segments())
    steps = without_instrumentation(median_times(times), statistics.median(plain))
    touch = statistics.median(probes) if probes else 0.0  # probed where a timed step faulted: the probes of
    # the blocks alone subtract their own faults at that cost, whatever the settled step faults in
    budget = ProbeBudget(step_ms=statistics.median(plain), steps=OVERHEAD_STEPS, floor_ms=OVERHEAD_FLOOR_MS,
                         min_repeats=min(repeats, OVERHEAD_MIN_REPEATS))
    overheads = _overheads(step, block_list, memory.recorder, repeats, touch, groups, budget, shared_caches)
    draws = _draws(step, block_list, memory.recorder, groups, shared_caches)
    call_ms = 0.0 if device.type == "meta" else measure_checkpoint_call_ms(
        device, repeats=repeats, clock=Clock(device), touch_ms_per_byte=touch,
        budget=dataclasses.replace(budget, steps=CALL_STEPS, floor_ms=0.0, min_repeats=1))
    prof = _with_end_held(_assemble(step, found, memory, steps, overheads, touch, groups, draws), step, block_list)
    least = min((b.recompute_overhead_ms for b in prof.blocks), default=0.0)
    prof = dataclasses.replace(prof, checkpoint_call_ms=min(call_ms, least))
    if backend:
        prof = with_compiled(prof, _compiled_figures(step, block_list, memory.recorder, repeats, backend), backend,
                             measure_pre_part(step, block_list, backend))
    return prof, memory.windows


def _compiled_figures(step: _Step, block_list: Blocks, recorder: OpRecorder, repeats: int,
                      backend: str) -> tuple[CompiledBlock, ...]:
    """Each block run alone under ``torch.compile`` (`remat.measure.compiled`)."""
    inputs = capture_block_inputs(block_list, step.forward)
    keys = [frozenset(c.key for c in recorder.calls.get(name, [])) for name, _ in block_list]
    return measure_compiled(block_list, inputs, keys, backend=backend, repeats=repeats,
                            clock=Clock(model_device(step.model)))


def _with_head(step: _Step, prof: Profile, windows: BackwardWindows, note: str, chunks: Sequence[int] | None,
               repeats: int) -> Profile:
    """The profile with its head part measured (`remat.measure.head`), or the reason it has none.
    Not on the meta device: `remat.estimate` scales the head from its formulas
    (`remat.memory.head`), not from one traced micro-batch."""
    if step.site is None or model_device(step.model).type == "meta":
        return dataclasses.replace(prof, head_note=note or "the meta device: nothing runs to measure")
    try:  # a probe never crashes the profile: the head then stays in the fixed part, with the reason
        capture, note = capture_head(step.model, step.batch, step.site)
        if capture is None:
            return dataclasses.replace(prof, head_note=note)
        post = prof.fixed_post_saved_bytes
        split = windows.post_head_temp_bytes is not None  # else the head's backward ended the window
        head = measure_head(
            capture, post_head_bytes=post + (windows.post_head_temp_bytes if split else windows.post_temp_bytes),
            post_rest_bytes=post + windows.post_rest_temp_bytes if split else 0,
            chunks=chunk_candidates(capture.hidden.numel() // capture.hidden.size(-1)) if chunks is None else tuple(chunks),
            repeats=min(repeats, HEAD_ROUNDS), touch_ms_per_byte=prof.first_touch_ms_per_byte)
    except Exception as exc:  # noqa: BLE001 - reported in the profile, as the block probes do
        return dataclasses.replace(prof, head_note=f"measuring the head raised {failure_reason(exc)}")
    # the post part's forward as the step ran it, against the head's model of it: what the step
    # holds beside the head that the head run alone does not (an unreached block's graph, outputs
    # the model's output keeps to the loss: LLaVA's image features)
    keep = head.option("keep")
    modelled = post - keep.saved_bytes + keep.fwd_peak_bytes
    held = max(0, windows.post_fwd_bytes + windows.unreached_post_bytes() - modelled)
    return dataclasses.replace(prof, head=head, fixed_post_fwd_held_bytes=held)


class _Reporter:
    """Calls ``progress(done, total, stage)`` after each stage."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress, self.total, self.done = progress, total, 0

    def __call__(self, stage: str) -> None:
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, self.total, stage)


@dataclass
class _Accounting:
    """What the accounting step measured."""

    saved_bytes: dict[str, int]
    input_bytes: dict[str, int]
    output_bytes: dict[str, int]
    output_passed_bytes: dict[str, int]
    windows: BackwardWindows
    recorder: OpRecorder
    saved: dict
    savers: dict
    dropped_bytes: dict
    peak_bytes: int
    peak_by_category: dict[str, int]
    timeline: tuple
    grad_bytes: int
    block_grad_bytes: list[int]
    """Per block, its parameters' gradient bytes after the accounting step (read then: the timing
    probes that run a block alone give its parameters gradients even where the step gives none,
    as to a layer whose output never reaches the loss)."""
    optimizer_state_bytes: int
    flows: list[BlockFlow]
    call_signatures: list[tuple[Any, ...] | None]
    """Per block, `remat.measure.sharing.args_signature` of its first call's arguments."""
    backward_tasks: dict[str, set[int]]
    graph_building: set[str]
    """`remat.measure.saved.SavedAccountant`'s: the backward passes that read each segment's saved
    tensors, and the segments a graph-building backward read."""
    read_aside: tuple[bool, ...]
    """Per block, whether the code between it and the next block reads its output (`BlockProfile.output_read_aside`)."""


class _ForwardGate:
    """Boundary listener: the op recorder records only between ``fwd_begin`` and ``loss_ready``;
    at ``loss_ready`` the dataflow recorder learns who saved what."""

    def __init__(self, recorder: OpRecorder, dataflow: DataflowRecorder, accountant: SavedAccountant) -> None:
        self.recorder = recorder
        self.dataflow = dataflow
        self.accountant = accountant

    def __call__(self, event: Boundary) -> None:
        if event.kind in ("fwd_begin", "loss_ready"):
            self.recorder.enabled = event.kind == "fwd_begin"
        if event.kind == "loss_ready":
            self.dataflow.finish(self.accountant.savers)


def _segment_order(names: Sequence[str]) -> Callable[[str], int]:
    """`OpRecorder.segment_order` of the blocks ``names``."""
    index = {name: i for i, name in enumerate(names)}

    def order(segment: str) -> int:
        if segment in index:
            return index[segment]
        if segment.startswith(BETWEEN):
            return int(segment[len(BETWEEN):])
        return len(names) if segment == POST else -1

    return order


def _tensor_attributes(model: nn.Module) -> list[torch.Tensor]:
    """Tensors the model's modules keep as plain attributes, no parameter nor buffer, without a
    graph: a table made once and kept (diffusers' QwenImage keeps its rotary table so and hands
    each block a slice). They live before and after the step whatever the plan, as the model's
    buffers do; counted as a block's input, a checkpoint of it was priced as holding the whole
    table (QwenImage's full recomputation -11.6 %, a 3-block repro -81 %)."""
    return [value for module in model.modules() for value in vars(module).values()
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and value.grad_fn is None]


def _account(step: _Step, block_list: Blocks) -> _Accounting:
    names = [name for name, _ in block_list]
    tracking = StepTracking(step.model, optimizer=step.optimizer, blocks=block_list, batch=step.batch)
    windows = BackwardWindows(tracking.tracker, names, tracking.accountant)
    recorder = OpRecorder(lambda: tracking.accountant.segment, sync=Clock(model_device(step.model)).sync,
                          live_bytes=lambda: tracking.tracker.live_bytes)
    windows.storage_id = recorder.storage_id
    recorder.segment_order = _segment_order(names)
    tracking.accountant.on_pack = recorder.note_pack
    tracking.accountant.on_unpack = windows.note_read
    windows.inputs_of = lambda index: tracking.boundaries.taken.get(index, set())
    state = [*step.model.parameters(), *step.model.buffers(), *_tensor_attributes(step.model), *batch_tensors(step.batch)]
    dataflow = DataflowRecorder(block_list, recorder.producer_of, storage_keys(state), recorder.storage_number_of)
    windows.post_arguments = dataflow.live_arguments
    tracking.boundaries.listeners += [windows, _ForwardGate(recorder, dataflow, tracking.accountant)]
    head = contextlib.nullcontext() if step.site is None else HeadBoundary(
        step.model.get_submodule(step.site.projection), tracking.boundaries.emit)
    with recorder, tracking, dataflow, head, CallSignatures(block_list) as calls, _outside_grads(step.model, block_list, windows):
        step.run(tracking.boundaries)
    accountant, tracker = tracking.accountant, tracking.tracker
    flows = block_flows(dataflow, accountant.saved, accountant.savers, accountant.bytes_by_segment())
    return _Accounting(
        saved_bytes=accountant.bytes_by_segment(), input_bytes=accountant.input_bytes,
        output_bytes=accountant.output_bytes, output_passed_bytes=accountant.output_passed_bytes, windows=windows,
        recorder=recorder, saved=dict(accountant.saved),
        savers={key: tuple(who) for key, who in accountant.savers.items()}, dropped_bytes=dict(accountant.dropped_bytes),
        peak_bytes=tracker.peak_bytes, peak_by_category=dict(tracker.peak_by_category),
        timeline=tuple(tracking.timeline), grad_bytes=grad_bytes(step.model),
        block_grad_bytes=_block_grad_bytes(block_list),
        optimizer_state_bytes=optimizer_state_bytes(step.optimizer), flows=flows,
        call_signatures=calls.signatures, backward_tasks=accountant.backward_tasks,
        graph_building=accountant.graph_building,
        read_aside=tuple(i + 1 < len(names) and between_name(i + 1) in recorder.read_by_others(
            names[i], {key for _, key, _ in dataflow.outputs[i]}, {names[i + 1]}) for i in range(len(names))),
    )


def _time_step(step: _Step, block_list: Blocks) -> StepTimes:
    device = model_device(step.model)
    clock = Clock(device)
    timer = StepTimer(clock, len(block_list))
    clock.sync()
    with FaultCount(enabled=device.type == "cpu") as faults, StepBoundaries(block_list, step.optimizer, [timer]) as marks:
        step.run(marks)
    clock.sync()
    times = timer.times()
    return times if faults.bytes is None else dataclasses.replace(times, fault_bytes=faults.bytes)


def _untimed(blocks: int) -> StepTimes:
    """The times of a step on the meta device: zeros."""
    return StepTimes(block_fwd_ms=(0.0,) * blocks, block_bwd_ms=(0.0,) * blocks, fixed_fwd_ms=0.0, fixed_bwd_ms=0.0,
                     optimizer_step_ms=0.0, step_ms=0.0)


def _time_plain_step(step: _Step) -> float:
    """Milliseconds of one step without the boundary hooks (what a trained model spends)."""
    clock = Clock(model_device(step.model))
    clock.sync()
    start = clock.mark()
    step.run()
    end = clock.mark()
    clock.sync()
    return clock.elapsed_ms(start, end)


def _groups(found: Discovery, memory: _Accounting, share: bool) -> BlockGroups:
    """Which block's timing probes each block takes (`remat.measure.sharing`)."""
    recorder, saved_by_call = memory.recorder, memory.recorder.saved_by_call(memory.saved, memory.savers)
    structures, traces, alike = [], [], []
    for i, (name, module) in enumerate(found.blocks):
        structures.append(structure_key(module, memory.call_signatures[i]))
        alike.append(structure_key(module, without_grad_flags(memory.call_signatures[i])))
        traces.append(trace_key(
            i, ops=recorder.records(name, saved_by_call), call_args=recorder.call_args(name),
            input_bytes=memory.input_bytes.get(name, 0), output_bytes=memory.output_bytes.get(name, 0),
            sources=[(arg.argument, arg.source) for arg in memory.flows[i].inputs]))
    return group_blocks(structures, traces, share=share, alike_structures=alike)


def _until_last(step: _Step, block_list: Blocks, chosen: Sequence[int]) -> Callable[[], None]:
    """``step.forward`` stopped once the last of the ``chosen`` blocks has returned: what comes
    after it is not needed (the blocks that take its timing, the head, the loss). Whole, the
    loss_fn's included, on a model with forward hooks and a loss_fn."""
    last = block_list[max(chosen)][1] if chosen else None
    if step.loss_fn is not None and any(m._forward_hooks for m in step.model.modules()):
        # a hook of the user's may collect what the forward makes for the loss_fn to read and clear
        # (activations for an auxiliary loss): a forward stopped before the loss left them behind,
        # in the user's step after the profile (and verify's), read through a graph long gone
        return step.forward

    def forward() -> None:
        with stop_after(last):
            step.forward()

    return forward


def eval_mode_differences(model: nn.Module) -> list[str]:
    """What runs otherwise in ``model``'s training step when it is in eval mode (``model.training``
    False): its dropout layers with p > 0, its norms that keep running statistics, its config's
    dropout rates above 0 (a Hugging Face attention's dropout is a rate, not a layer); empty when
    the model is in train mode or has none of them."""
    if model.training:
        return []
    dropouts = sum(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())
    norms = sum(isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats for m in model.modules())
    config = getattr(model, "config", None)
    rates = {key: value for key, value in (vars(config).items() if hasattr(config, "__dict__") else ())
             if "dropout" in key and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0}
    found = []
    if dropouts:
        found.append(f"{dropouts} dropout layers (p > 0) save no mask" if dropouts > 1
                     else "1 dropout layer (p > 0) saves no mask")
    elif rates:  # dropout by rate only (functional): where there are layers, they are what the rates set
        found.append("its config's " + ", ".join(f"{key} {value:g}" for key, value in sorted(rates.items()))
                     + " not applied")
    if norms:
        found.append(f"{norms} norm layers use their running statistics" if norms > 1
                     else "1 norm layer uses its running statistics")
    return found


def _warn_eval_mode(model: nn.Module) -> None:
    """A UserWarning where ``model`` is in eval mode and its training step would run otherwise
    (`eval_mode_differences`): Hugging Face's ``from_pretrained`` returns a model in eval mode."""
    found = eval_mode_differences(model)
    if found:
        warnings.warn(
            f"{type(model).__name__} is in eval mode (model.training is False, as Hugging Face's from_pretrained "
            f"returns a model), so the step remat.profile measures runs as evaluation does: {'; '.join(found)}. "
            "A plan made from it holds less than that step in train mode. Call model.train() before remat.profile "
            "to plan training in train mode; if you train in eval mode on purpose (dropout off), this is that step.",
            UserWarning, stacklevel=3)


def _warn_varied(block_list: Blocks, varied: set[str]) -> None:
    """A UserWarning naming the blocks whose forward ran other operations in a later profiled
    step than in the first: their figures (bytes, ops, the replay's path) are the first step's."""
    names = [name for name, _ in block_list if name in varied]
    if not names:
        return
    shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    warnings.warn(
        f"block {shown} ran other operations, or the same on other shapes, in a later profiled step than in the "
        "first (control flow on the data or on a random draw: a length drawn at random): the profile's figures "
        "are the first step's, so a step that takes another path may peak elsewhere than predicted. "
        "remat.verify measures a plan's step.",
        UserWarning, stacklevel=3)


def _time_ops(step: _Step, block_list: Blocks, recorder: OpRecorder, groups: BlockGroups) -> None:
    """One more forward under the same recorder, for a median time per op call of the blocks
    whose timing others take (the forward stops after the last of them)."""
    accountant = SavedAccountant(block_list)
    recorder.next_run()
    recorder.segment_of = lambda: accountant.segment
    recorder.timed_segments = {block_list[i][0] for i in groups.representatives}
    recorder.enabled = True
    with recorder, accountant:
        _until_last(step, block_list, groups.representatives)()


def _overheads(step: _Step, block_list: Blocks, recorder: OpRecorder, repeats: int, touch_ms_per_byte: float,
               groups: BlockGroups, budget: ProbeBudget, shared_caches: bool = False) -> tuple[BlockOverheads, ...]:
    """Per-block checkpointing overheads (`remat.measure.overhead`), measured on each group's
    representative (the forward that captures their inputs stops after the last of them), each
    in an equal part of ``budget``; zeros on the meta device, where nothing runs and there is no
    time to measure."""
    device = model_device(step.model)
    if device.type == "meta":
        return tuple(BlockOverheads(selective_ms=0.0, recompute_ms=0.0, selective_cache_ms=0.0) for _ in block_list)
    chosen = groups.representatives
    inputs = capture_block_inputs([block_list[i] for i in chosen], _until_last(step, block_list, chosen),
                                  shared_caches=shared_caches)
    measured: dict[int, BlockOverheads] = {}
    for i, given in zip(chosen, inputs):
        calls = recorder.calls.get(block_list[i][0], [])
        keys = frozenset(c.key for c in calls if cacheable(c.name, c.mutated_later))
        uncacheable = uncacheable_share([(cacheable(c.name, c.mutated_later), c.is_view,
                                          statistics.median(c.times_s) if c.times_s else 0.0) for c in calls])
        measured[i] = measure_overheads([block_list[i]], [given], [keys], repeats=repeats, clock=Clock(device),
                                        touch_ms_per_byte=touch_ms_per_byte, uncacheable_shares=[uncacheable],
                                        budget=budget.split(len(chosen)))[0]
    return tuple(measured[source] for source in groups.timing_from)


def _draws(step: _Step, block_list: Blocks, recorder: OpRecorder, groups: BlockGroups,
           shared_caches: bool = False) -> dict[int, list[Any]]:
    """Block index -> `DRAWS` runs of `remat.measure.size_groups.another_draw` of the first block of
    each structure with a call whose output shape follows values (a router's ``nonzero``): the
    layers of one batch may all hit the same experts and the next batch's not, and a layer alone
    of its structure has no other to compare with. A swin stage's gather of its position bias
    by an integer index (an op that may make shapes from values, with another argument) runs no
    draw. Their inputs are captured in one more forward, stopped after the last of them."""
    if model_device(step.model).type == "meta" or not groups.structure_of:
        return {}
    chosen: dict[int, int] = {}
    for i, (name, _) in enumerate(block_list):
        if any(shape_from_values(call.name, call.args) for call in recorder.calls.get(name, [])):
            chosen.setdefault(groups.structure_of[i], i)
    if not chosen:
        return {}
    picked = sorted(chosen.values())
    try:
        inputs = capture_block_inputs([block_list[i] for i in picked], _until_last(step, block_list, picked),
                                      shared_caches=shared_caches)
    except Exception:  # noqa: BLE001 - the draws are evidence where they run; the calls' own shapes mark the rest
        return {}
    draws: dict[int, list[Any]] = {}
    for i, given in zip(picked, inputs):
        name, module = block_list[i]
        if not given.shared_cache:
            runs = [another_draw(module, given.args, given.kwargs, name, given.call_context(), seed=seed)
                    for seed in range(1, DRAWS + 1)]
            draws[i] = [run for run in runs if run is not None]
    return draws


def _assemble(step: _Step, found: Discovery, memory: _Accounting, times: StepTimes,
              overheads: tuple[BlockOverheads, ...], touch_ms_per_byte: float, groups: BlockGroups,
              draws: dict[int, Any] | None = None) -> Profile:
    model, optimizer, block_list = step.model, step.optimizer, found.blocks
    saved, recorder = memory.saved_bytes, memory.recorder
    between_flops = sum(recorder.segment_flops(between_name(i)) for i in range(1, len(block_list)))
    return Profile(
        fingerprint=fingerprint(model, step.batch, [name for name, _ in block_list]), environment=_environment(model_device(model)),
        blocks=_block_profiles(found, memory, times, overheads, groups, draws), timing_split=groups.split,
        stacks=found.stacks, fixed_modules=fixed_modules(model, layers_of(m for _, m in block_list)),
        param_bytes=param_bytes(model), grad_bytes=memory.grad_bytes,
        optimizer_state_bytes=memory.optimizer_state_bytes,
        optimizer_name=type(optimizer).__name__ if optimizer is not None else "none",
        optimizer_step_temp_bytes=memory.windows.optimizer_temp_bytes,
        step_held_bytes=memory.windows.opt_start_held_bytes,
        fixed_pre_fwd_bytes=memory.windows.pre_fwd_bytes,
        fixed_pre_bwd_temp_bytes=memory.windows.pre_bwd_temp_bytes,
        optimizer_step_ms=times.optimizer_step_ms, buffer_bytes=buffer_bytes(model),
        # what the pre part saved for a backward: a graph off the loss path dies with the forward
        fixed_pre_saved_bytes=saved[PRE] - memory.windows.pre_saved_dead_bytes(), fixed_post_saved_bytes=saved[POST],
        fixed_post_bwd_temp_bytes=max(memory.windows.post_temp_bytes, memory.windows.post_fwd_bytes
                                      + memory.windows.unreached_post_bytes() - saved[POST]),
        fixed_post_fwd_bytes=memory.windows.post_fwd_bytes + memory.windows.unreached_post_bytes(),
        fixed_post_model_fwd_bytes=memory.windows.post_model_fwd_bytes + memory.windows.unreached_post_bytes(),
        fixed_post_bwd_own_temp_bytes=memory.windows.post_temp_bytes,
        fixed_post_loss_fwd_bytes=(None if memory.windows.post_loss_fwd_bytes is None
                                   else memory.windows.post_loss_fwd_bytes + memory.windows.unreached_post_bytes()),
        **_post_code_held(memory.windows, saved[POST]),
        fixed_pre_grad_bytes=_pre_grad_bytes(memory, block_list),
        fixed_pre_early_grad_bytes=_pre_early_grad_bytes(memory, block_list),
        fixed_fwd_ms=times.fixed_fwd_ms, fixed_bwd_ms=times.fixed_bwd_ms,
        fixed_flops=recorder.segment_flops(PRE) + between_flops + recorder.segment_flops(POST),
        step_ms=times.step_ms, peak_bytes=memory.peak_bytes, peak_bytes_by_category=memory.peak_by_category,
        device_max_allocated_bytes=_device_max_allocated(step), timeline=memory.timeline,
        step_fault_bytes=times.fault_bytes,
        first_touch_ms_per_byte=touch_ms_per_byte,
    )


def _post_code_held(windows: BackwardWindows, post_saved: int) -> dict[str, Any]:
    """`Profile.post_code_held` and `Profile.post_code_held_saving_bytes`: the post part's need,
    ``max(its saved bytes + its backward's peak, its forward's peak)``, less the same with the
    forward's peak measured without the arguments the code holds (empty and 0 where it is no lower)."""
    unreached = windows.unreached_post_bytes()
    need = max(post_saved + windows.post_temp_bytes, windows.post_fwd_bytes + unreached)
    apart = max(post_saved + windows.post_temp_bytes, windows.post_fwd_apart_bytes + unreached)
    saving = max(0, need - apart)
    if not saving:
        return {"post_code_held": (), "post_code_held_saving_bytes": 0}
    return {"post_code_held": tuple(sorted(windows.post_code_held.items())), "post_code_held_saving_bytes": saving}


def _block_grad_bytes(block_list: Blocks) -> list[int]:
    """Per block, the bytes of its parameters' gradients, each counted once: a parameter several
    blocks hold (Zamba's hybrid layers share one transformer's weights) counts for the first of
    them in run order. Its gradient becomes ``.grad`` only when that block's backward, the last
    of theirs, is done; until then the later holders' contributions wait in autograd's buffer,
    which the windows of the blocks in between measure as temporaries. Counted for every holder,
    the gradients live at the backward of a block after the last holder came out short by the
    shared bytes (Zamba: 1.5-3.5 % under its peak)."""
    owner: dict[Any, tuple[int, int]] = {}
    for i, (_, module) in enumerate(block_list):
        for p in module.parameters():
            if p.grad is not None:
                owner.setdefault(storage_key(p.grad) or id(p.grad), (i, storage_nbytes(p.grad)))
    out = [0] * len(block_list)
    for i, nbytes in owner.values():
        out[i] += nbytes
    return out


def _pre_grad_bytes(memory: _Accounting, block_list: Blocks) -> int:
    """Gradients allocated after the backward of the first block that has one and are not its
    own nor of the code before it (embeddings). That block is block 0 but where the blocks
    before it have no backward (a frozen backbone's): taken as block 0 there, every gradient
    counted as allocated after it, and the gradients live at the later blocks' backward came
    out negative (DETR's peaks 4.5-7.5 % under, Deformable DETR's 18 %)."""
    windows = memory.windows
    first = windows.first_backward_block or 0
    released = sum(memory.block_grad_bytes[i] + windows.between_grad_bytes[i] for i in range(first + 1))
    return memory.grad_bytes - released - windows.grads_at_first_block_bytes


@contextlib.contextmanager
def _outside_grads(model: nn.Module, block_list: Blocks, windows: BackwardWindows):
    """Hooks telling ``windows`` of each parameter outside every block whose gradient is made
    whole (`BackwardWindows.note_outside_grad`), removed on exit."""
    inside = {id(p) for _, module in block_list for p in module.parameters()}
    handles = [p.register_post_accumulate_grad_hook(lambda p: windows.note_outside_grad(storage_nbytes(p.grad)))
               for p in model.parameters() if p.requires_grad and id(p) not in inside]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _outside_grad_bytes(memory: _Accounting, index: int) -> int:
    """Gradients of parameters outside the blocks that block ``index``'s backward makes whole (their
    last use is in it: SEW-D's relative position embeddings, which every layer reads, whole within
    the first layer's backward). Not yet made while the blocks after it run their backward, so
    released with it (in its ``between_grad_bytes``); counted live there before, 2.1 % over
    SEW-D's peak without recomputation. The first block to run a backward has them in the pre
    part's (`_pre_grad_bytes`, `_pre_early_grad_bytes`)."""
    windows = memory.windows
    if index == windows.first_backward_block:
        return 0
    return windows.outside_grad_bytes[index]


def _pre_early_grad_bytes(memory: _Accounting, block_list: Blocks) -> int:
    """Of `_pre_grad_bytes`, the gradients live as the pre part's backward begins: made in the
    first block's backward window but not its own (a weight outside the blocks whose every use is
    in them, whole once that block's backward has run). 0 where the pre part ran no backward."""
    windows = memory.windows
    if windows.grads_at_pre_bytes is None or windows.first_backward_block != 0:
        return 0
    pre = _pre_grad_bytes(memory, block_list)
    return min(pre, max(0, windows.grads_at_pre_bytes - (memory.grad_bytes - pre)))


def _with_end_held(prof: Profile, step: _Step, block_list: Blocks) -> Profile:
    """Each block's `BlockProfile.output_end_held_bytes`, ``output_later_held_bytes`` and
    ``output_held_until``: the saved bytes of its calls whose outputs the code holds to the end
    of the forward, and past the block after it (`remat.measure.held`); its ``stored_held``: what
    the containers among its arguments hold of every block's calls then; its ``output_held_bytes``
    where more of them are live as the next block starts than the dataflow named; its
    ``input_code_held_bytes``: the block before's output the code holds through the backward (and
    ``input_code_kept_bytes`` to when in the forward). One more forward,
    without gradients; not on the meta device, where no storage is freed. A forward that fails
    there leaves them 0, as before they were measured."""
    if model_device(step.model).type == "meta":
        return prof
    try:
        with as_in_training():  # the caches off as in the step (`CacheOff`), though without gradients
            held = code_held_calls(step.model, step.batch, block_list, step.loss_fn)
    except Exception:  # noqa: BLE001 - a refinement: the profile stands without it
        return prof

    def saved(block: BlockProfile, keys: frozenset[str]) -> int:
        return sum(op.saved_bytes for op in block.ops if op.key in keys)

    def made(block: BlockProfile, keys: frozenset[str]) -> int:
        return sum(op.output_bytes for op in block.ops if op.key in keys)

    def stored_held(holder: dict[int, frozenset[str]]) -> tuple[tuple[int, int, int, int], ...]:
        # of each block's, what it saves and what of that a later segment saves too (its handoff)
        return tuple((i, made(prof.blocks[i], keys), saved(prof.blocks[i], keys),
                      sum(op.saved_bytes for op in prof.blocks[i].ops if op.key in keys and any(op.storage_escapes)))
                     for i, keys in sorted(holder.items()) if made(prof.blocks[i], keys))

    stored_calls: dict[int, set[str]] = {}  # per block, its calls that some block's containers hold
    for holder in held.stored:
        for i, keys in holder.items():
            stored_calls.setdefault(i, set()).update(keys)
    blocks = []
    for b, end, post, during, stored, through, saved_through, (kept, until) in zip(
            prof.blocks, held.end, held.post, held.during, held.stored, held.through, held.saved_through, held.kept):
        later = {k: saved(b, keys) for k, keys in during.items() if k >= b.index + 2}
        later = {k: nbytes for k, nbytes in later.items() if nbytes > 0}
        calls = sorted(set().union(*(during[k] for k in later)) & {op.key for op in b.ops if op.saved_bytes})
        # the dataflow sees the outputs it can name (tensors, in tuples, lists and dicts); this
        # forward sees those inside other objects too (x-transformers' intermediates dataclass)
        following = saved(b, during.get(b.index + 1, frozenset()))
        last_held: dict[str, int] = {}  # per call, the last block whose forward began with it held
        for k, keys in during.items():
            for key in keys:
                last_held[key] = max(last_held.get(key, 0), k)
        for key in post:
            last_held[key] = len(prof.blocks)
        blocks.append(dataclasses.replace(b, output_end_held_bytes=saved(b, end), output_post_held_bytes=saved(b, post),
                                          output_held_bytes=max(b.output_held_bytes, following),
                                          output_later_held_bytes=max(later.values(), default=0),
                                          output_held_until=max(later, default=0),
                                          output_later_held_calls=tuple(calls),
                                          output_held_calls_until=tuple(sorted(last_held.items())),
                                          output_end_held_calls=tuple(sorted(end)),
                                          output_post_held_calls=tuple(sorted(post)),
                                          stored_held=stored_held(stored),
                                          stored_calls=tuple(sorted(stored_calls.get(b.index, ()))),
                                          input_code_held_bytes=through, saved_code_held_bytes=saved(b, saved_through),
                                          input_code_kept_bytes=kept,
                                          input_code_kept_until=until))
    return dataclasses.replace(prof, blocks=tuple(blocks))


def _block_profiles(found: Discovery, memory: _Accounting, times: StepTimes, overheads: tuple[BlockOverheads, ...],
                    groups: BlockGroups, draws: dict[int, Any] | None = None) -> tuple[BlockProfile, ...]:
    block_list = found.blocks
    saved_by_call = memory.recorder.saved_by_call(memory.saved, memory.savers)
    records = {name: memory.recorder.records(name, saved_by_call) for name, _ in block_list}
    ops = [_shared_times(records[name], records[block_list[groups.timing_from[i]][0]])
           for i, (name, _) in enumerate(block_list)]
    if groups.structure_of:  # calls whose sizes follow the data (an expert's tokens), by family
        sizes = size_groups(groups.structure_of, ops, [memory.recorder.call_args(name) for name, _ in block_list], draws)
        ops = [tuple(op if g == op.size_group else dataclasses.replace(op, size_group=g) for op, g in zip(block, found))
               for block, found in zip(ops, sizes)]
    stack_of = {i: stack.name for stack in found.stacks for i in range(stack.start, stack.stop)}
    return tuple(
        BlockProfile(
            index=i, name=name, class_name=type(module).__name__,
            input_bytes=memory.input_bytes.get(name, 0), output_bytes=memory.output_bytes.get(name, 0),
            # a block no backward runs (its output reaches no loss: LLaVA's last vision layer) had
            # its graph dropped in the forward: what it saved lives there only, not to a backward
            saved_bytes=memory.saved_bytes[name] if i in memory.windows.backward_blocks else 0,
            bwd_temp_bytes=memory.windows.block_temp_bytes[i],
            fwd_ms=times.block_fwd_ms[i], bwd_ms=times.block_bwd_ms[i],
            fwd_flops=memory.recorder.segment_flops(name),
            ops=_scaled_times(ops[i], times.block_fwd_ms[i]), timing_from=groups.timing_from[i],
            grad_bytes=memory.block_grad_bytes[i],
            between_fwd_peak_bytes=memory.windows.between_fwd_peak_bytes[i],
            unreached_fwd_bytes=memory.windows.unreached_live_bytes(i),
            # what the code right after it freed of its saved bytes was counted saved at its end
            fwd_temp_bytes=memory.windows.block_fwd_temp_bytes[i] + memory.dropped_bytes.get(name, 0)
            + (0 if i in memory.windows.backward_blocks else memory.saved_bytes[name]),
            output_grad_bytes=memory.output_bytes.get(name, 0),
            output_passed_bytes=memory.output_passed_bytes.get(name, 0),
            bwd_free_order=memory.windows.block_free_order[i],
            fwd_live_bytes=tuple(max(0, c.live_after - memory.windows.block_fwd_start_bytes[i])
                                 for c in memory.recorder.calls.get(name, [])),
            replay_stop_calls=memory.recorder.stop_calls.get(name, 0),
            **_overhead_ms(_aligned(overheads[i], len(memory.recorder.calls.get(name, []))),
                           backward=i in memory.windows.backward_blocks,
                           own_generator_calls=memory.recorder.own_generators.get(name, ()),
                           backward_reads=_backward_reads(memory, name)),
            stack=stack_of[i], follows_previous=found.follows_previous[i], output_read_aside=memory.read_aside[i],
            **_flow_fields(memory.flows[i], memory.windows.between_temp_bytes[i]),
            # a window that opens with fewer bytes live than the block's saved bytes it excludes
            # (some freed before its backward began) measures below zero: nothing is live beside
            # a replay then, which rebuilds them all
            bwd_start_temp_bytes=max(memory.windows.replay_start_bytes(i), 0),
            saved_dead_bytes=min(memory.saved_bytes[name], memory.windows.saved_dead_at_backward[i])
            if i in memory.windows.backward_blocks else 0,
            held_input_bwd_temp_bytes=memory.windows.block_held_input_temp_bytes[i],
            between_grad_bytes=memory.windows.between_grad_bytes[i] + _outside_grad_bytes(memory, i),
            fwd_other_bytes=memory.windows.block_fwd_start_temporaries[i]
            - sum(flow.shared_entry_bytes for flow in memory.flows[: i + 1]),
            **_freed_between(memory.flows[i], *memory.windows.between_apart[i]),
        )
        for i, (name, module) in enumerate(block_list)
    )


def _backward_reads(memory: _Accounting, name: str) -> tuple[bool, int]:
    """Whether a graph-building backward read block ``name``'s saved tensors and another backward
    read them again (``create_graph=True``, then the loss's backward), and how many backward passes
    read them. Grad mode on alone is not enough: a custom Function's backward may unpack its saved
    tensors under ``torch.enable_grad()`` in an ordinary step (a memory-efficient Swish did, and
    every block was made keep-only)."""
    tasks = len(memory.backward_tasks.get(name, ()))
    return name in memory.graph_building and tasks > 1, tasks


def _freed_between(flow: BlockFlow, apart_bytes: int, freed: frozenset[int]) -> dict[str, Any]:
    """`BlockProfile.shared_freed_between` and ``between_fwd_apart_bytes``: the shared tensors the
    code before the block freed, and its peak with them set apart (none where it freed a block
    argument that is not one)."""
    shared = {storage for storage, _ in flow.shared_freed}
    if not freed or not freed <= shared:
        return {}
    return {"shared_freed_between": tuple(sorted(freed)), "between_fwd_apart_bytes": apart_bytes}


def _flow_fields(flow: BlockFlow, between_temp_bytes: int) -> dict[str, Any]:
    """The `BlockProfile` dataflow fields (`remat.measure.dataflow`)."""
    return {
        "inputs": flow.inputs, "held_input_bytes": flow.held_input_bytes,
        "unsaved_input_bytes": flow.unsaved_input_bytes, "shared_entry_bytes": flow.shared_entry_bytes,
        "handoff_bytes": flow.handoff_bytes, "handoff_next_bytes": flow.handoff_next_bytes,
        "between_saved_bytes": flow.between_saved_bytes, "between_bwd_temp_bytes": max(between_temp_bytes, 0),
        "entry_bytes": flow.entry_bytes, "output_held_bytes": flow.output_held_bytes,
        "code_held_inputs": flow.code_held_inputs,
        "input_saved_after_bytes": flow.input_saved_after_bytes, "input_saved_after_from": flow.input_saved_after_from,
        "shared_freed": flow.shared_freed, "shared_saved": flow.shared_saved,
    }


def _shared_times(ops: tuple[OpRecord, ...], source: tuple[OpRecord, ...]) -> tuple[OpRecord, ...]:
    """``ops`` with the op times of ``source``, the same calls timed on the block whose timing
    this one takes (`remat.measure.sharing`'s check made their keys equal)."""
    if ops is source:
        return ops
    assert [op.key for op in ops] == [op.key for op in source], "shared timing between unlike blocks"
    return tuple(dataclasses.replace(op, time_ms=mine.time_ms) for op, mine in zip(ops, source))


def _scaled_times(ops: tuple[OpRecord, ...], fwd_ms: float) -> tuple[OpRecord, ...]:
    """The calls with their times scaled to add up to the block's forward time from the timed
    steps: the recorder times each call alone (a synchronisation and its own dispatch per call),
    which inflates the sum; the shares between calls are what it measures well."""
    total = sum(op.time_ms for op in ops)
    if total <= 0 or fwd_ms <= 0:
        return ops
    return tuple(dataclasses.replace(op, time_ms=op.time_ms * fwd_ms / total) for op in ops)


def _aligned(overheads: BlockOverheads, calls: int) -> BlockOverheads:
    """``overheads`` without the checkpointed forward's curve where that forward made another
    number of op calls than the traced one (a router whose path depends on the data, a cache the
    probes do not pass): the curve is read call for call against the block's ops, so one that
    does not line up is left out and the planner takes its bound (`checkpointed_forward_peak`)."""
    if len(overheads.checkpointed_fwd_live_bytes) in (0, calls):
        return overheads
    return dataclasses.replace(overheads, checkpointed_fwd_live_bytes=(), checkpointed_fwd_freed_at=(),
                               graph_held=tuple((-1, nbytes) for _, nbytes in overheads.graph_held))


def _overhead_ms(overheads: BlockOverheads, backward: bool = True,
                 own_generator_calls: Sequence[str] = (), backward_reads: tuple[bool, int] = (False, 1)) -> dict[str, Any]:
    """The `BlockProfile` overhead fields, and the strategies whose probes failed; a block whose
    backward never ran (``backward`` False) offers no strategy but keep (`NO_BACKWARD`); one that
    draws from a generator of its own (``own_generator_calls``) is never replayed; one a
    graph-building backward read (``backward_reads``: that, and how many backward passes read it)
    is never replayed either (`GRADIENT_GRAPH`), one read by several is never selective
    (`BACKWARD_TWICE`)."""
    unavailable = overheads.unavailable if backward else tuple(
        (strategy, NO_BACKWARD) for strategy in ("recompute", "selective", "offload"))
    for kinds, reason in ((("recompute", "selective"), own_generator_reason(own_generator_calls) if own_generator_calls else None),
                          (("recompute", "selective", "offload"), GRADIENT_GRAPH if backward_reads[0] else None),
                          (("selective",), BACKWARD_TWICE if backward_reads[1] > 1 else None)):
        if reason is not None:
            named = {name for name, _ in unavailable}
            unavailable += tuple((kind, reason) for kind in kinds if kind not in named)
    return {
        "selective_overhead_ms": overheads.selective_ms,
        "recompute_overhead_ms": overheads.recompute_ms,
        "selective_cache_overhead_ms": overheads.selective_cache_ms,
        "checkpointed_fwd_live_bytes": overheads.checkpointed_fwd_live_bytes,
        "checkpointed_fwd_freed_at": overheads.checkpointed_fwd_freed_at,
        "graph_held_storages": tuple(number for number, _ in overheads.graph_held if number >= 0),
        "graph_held_bytes": sum(nbytes for _, nbytes in overheads.graph_held),
        "unavailable": unavailable,
    }


def _device_max_allocated(step: _Step) -> int | None:
    """``torch.cuda.max_memory_allocated`` over one more plain step (CUDA only)."""
    device = model_device(step.model)
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    step.run()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device))


def _environment(device: torch.device) -> Environment:
    return Environment(
        device_name=_device_name(device), num_threads=torch.get_num_threads(),
        python_version=platform.python_version(), hostname=socket.gethostname(),
    )


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu" and os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or device.type
