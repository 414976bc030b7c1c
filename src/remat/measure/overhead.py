"""What the checkpointing machinery itself costs, block by block, measured on the real model.

The planner prices a replayed op by its own time, but torch's checkpointing adds work that no
op table shows. Selective checkpointing
(`torch.utils.checkpoint.create_selective_checkpoint_contexts`) runs a Python
``TorchDispatchMode`` on every op of the block in the forward and again in the replay (a policy
call, a cache store or lookup), and plain non-reentrant checkpointing adds saved-tensor hooks,
an RNG state save and restore and the replay's bookkeeping. On small ops this costs more than
the ops themselves, so a plan that looks cheaper on paper can be slower than full recomputation.

Each block runs alone on the inputs it received in a real forward, forward then backward with
ones as the output gradient, in three ways per repeat (interleaved, so a loaded machine slows
them alike), medians over the repeats:

- ``plain``: the block as written (also gives its forward time);
- ``full``: `torch.utils.checkpoint.checkpoint` (``use_reentrant=False``, RNG preserved), as
  `remat.apply` runs it (the same `remat.checkpointing.region.checkpointed` call, buffer guard
  included): overhead = full - plain - plain forward (the replay);
- ``selective``: the same under `remat.checkpointing.selective.selective_context` saving nothing (every
  op goes through the policy's dispatch mode in the forward and is replayed through it):
  overhead = selective - plain - plain forward. Plans save a few large ops and replay the many
  small ones, so this is close to what they pay beyond the replayed ops' own time;
- ``cached``: the same saving every op call that can be cached (the replay fetches them):
  cache overhead = cached - plain - the selective overhead - the replay of the calls that cannot
  be cached (random and in-place ops, outputs written later: `uncacheable_share` of the
  forward), what storing and
  fetching outputs adds; a plan saving a share of the cacheable calls pays that share of it.
  (Before the uncacheable replay was taken out, dropout's random numbers counted as the cache's
  cost: half the built-in GPT block's time, over-predicting its selective plans by 10-16 %.)

On the CPU each run's time is taken less the fresh host memory it faulted in, at the measured
cost per byte (`remat.measure.faults`): a block run alone faults in memory a step would not, and
a step's faults are modelled from its peak (`remat.plan.predict.fresh_memory`). Measured on the
built-in GPT: a block under plain checkpointing faults in 16 MiB more than run plainly, which
had counted 4 ms (two thirds) of its measured overhead.

A probe that raises marks its strategy unavailable for the block, with the reason (exception
type and message, one line: `BlockOverheads.unavailable`); the other probes go on. A block that
cannot even run alone on its captured inputs has nothing measured, and both strategies are
marked: the planner never picks what was not seen to run.

Each overhead is the median over repeats of the difference within one repeat (paired: a load
spike hits the runs of a repeat alike), clamped at 0, in milliseconds. Most of it is Python run
per call and per op (the dispatch mode, the checkpoint's frame, remat's runtime), which does not
grow with the block's own time: taken as a share of the block run alone and scaled to the
block's time in a step, it shrank by a third on the built-in MLP (a block alone pays the
harness's call of the backward, 0.58 ms against 0.4 in a step), under-predicting its selective
plans by 15-27 %.
"""

from __future__ import annotations

import copy

import contextlib
import dataclasses
import functools
import statistics
import weakref
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from remat.checkpointing.caches import SHARED_CACHE, CacheState, cache_positions, drop_kv_caches, is_kv_cache, kv_caches_in
from remat.checkpointing.region import (BufferGuard, autocast_entered, autocast_state, call_with_first, checkpointed,
                                       first_argument)
from remat.checkpointing.selective import selective_context
from remat.measure.budget import ProbeBudget
from remat.measure.blocks import Blocks
from remat.measure.faults import FaultCount
from remat.measure.ops import new_storages
from remat.measure.probes import Attempts
from remat.measure.storage import storage_key, tensors_in
from remat.measure.timing import Clock
from remat.measure.tracker import LiveTracker
from remat.measure.types import WRITES_INPUT

__all__ = ["BlockOverheads", "BlockInputs", "capture_block_inputs", "measure_overheads", "uncacheable_share",
           "measure_checkpoint_call_ms", "checkpointed_forward_curve"]

Runner = Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], Any]

_BUFFERS_CHANGED: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], list[torch.Tensor]]] = (
    weakref.WeakKeyDictionary())
"""Per block, the buffers its forward changes (`BufferGuard`'s store): learnt once per block, as
in a planned step."""


@dataclass(kw_only=True, frozen=True)
class BlockOverheads:
    """Checkpointing overheads of one block in milliseconds (medians, never negative)."""

    selective_ms: float
    """Selective checkpointing's cost beyond the ops it replays (forward + replay dispatch)."""
    recompute_ms: float
    """Plain checkpointing's cost beyond one replayed forward."""
    selective_cache_ms: float
    """What saving every cacheable op call adds to ``selective_ms``."""
    checkpointed_fwd_live_bytes: tuple[int, ...] = ()
    """Per op call of a checkpointed forward of the block, the bytes it had made live once the
    call's outputs existed (`checkpointed_forward_curve`)."""
    checkpointed_fwd_freed_at: tuple[int, ...] = ()
    """Per storage the forward made (numbered as `remat.measure.ops.OpRecorder` numbers them),
    the call from which it was no longer live (`checkpointed_forward_curve`)."""
    graph_held: tuple[tuple[int, int], ...] = ()
    """``(number, bytes)`` of each storage (numbered so) that checkpointed forward left to its
    autograd graph (`checkpointed_forward_curve`)."""
    unavailable: tuple[tuple[str, str], ...] = ()
    """``(strategy, reason)`` of each strategy whose probe raised (``recompute``, ``selective``)."""


@dataclass(kw_only=True, frozen=True)
class BlockInputs:
    """The positional and keyword arguments one block received, detached from the graph, and
    the autocast state it ran in."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    cache_positions: int = 0
    """Positions the key/value cache the block was handed already held (prefix tuning)."""
    caches: tuple[CacheState, ...] = ()
    """The filled key/value caches the block was handed, as it found them (their tensors
    detached): each run of the block alone gets them back so (`call_context`), as its replay
    does (`remat.checkpointing.region`)."""
    shared_cache: bool = False
    """The block was handed a cache that the model reads later in the step (captured with
    ``shared_caches``): never replayed (`remat.checkpointing.caches.SHARED_CACHE`), nor probed."""
    autocast: tuple[tuple[str, torch.dtype, bool], ...] = ()
    """``(device type, dtype, cache enabled)`` of each device type whose autocast was on when the
    block was called (a model whose forward enters ``torch.autocast``): the probes run the block
    in it, as its replay runs (`remat.checkpointing.region` restores it). Run without it, a
    convolution raised on its bfloat16 input (recompute marked unavailable on every block), and a
    replay's casts of the block's weights were missing from its figures (plans 2-3 % under)."""

    def call_context(self) -> contextlib.AbstractContextManager[Any]:
        """The autocast state the block ran in, entered (nothing when autocast was off), with its
        filled key/value caches as it found them: its forward appends to them."""
        for state in self.caches:
            state.restore()
        return autocast_entered(self.autocast)


def capture_block_inputs(block_list: Blocks, forward: Callable[[], Any], *,
                         shared_caches: bool = False) -> list[BlockInputs]:
    """Run ``forward()`` once (gradients enabled) and keep each block's first call's arguments:
    tensors detached, floating ones needing gradients as they did in the model; Hugging Face
    key/value caches become None, as `remat.apply` passes them (every call would append to them).
    ``shared_caches``: the model reads what its blocks write to their caches
    (`remat.measure.types.Fingerprint.shared_cache`), and a block handed one is keep-only."""
    captured: dict[int, BlockInputs] = {}

    def hook_for(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if index not in captured:
                if shared_caches and any(is_kv_cache(v) for v in (*args, *kwargs.values())):
                    captured[index] = BlockInputs(args=(), kwargs={}, shared_cache=True)
                    return
                args, kwargs = drop_kv_caches(args, kwargs)
                caches = tuple(CacheState(c, detach=True) for c in kv_caches_in((*args, *kwargs.values())))
                captured[index] = BlockInputs(args=tree_map(_detach, args), kwargs=tree_map(_detach, kwargs),
                                              autocast=autocast_state(), cache_positions=cache_positions(args, kwargs),
                                              caches=caches)

        return hook

    handles = [module.register_forward_pre_hook(hook_for(i), with_kwargs=True) for i, (_, module) in enumerate(block_list)]
    try:
        forward()
    finally:
        for handle in handles:
            handle.remove()
    missing = [name for i, (name, _) in enumerate(block_list) if i not in captured]
    if missing:
        raise ValueError(
            f"blocks {missing} did not run in the model's forward, so their checkpointing overhead "
            "cannot be measured. Pass blocks= naming only modules the forward calls."
        )
    return [captured[i] for i in range(len(block_list))]


def _detach(value: Any) -> Any:
    if isinstance(value, MutableMapping):  # a mapping pytree leaves whole (Gemma 4's shared key/value states,
        # a UserDict later layers read): copied, or the probes' runs backward through the model's graph
        copied = copy.copy(value)
        for key, item in value.items():
            copied[key] = tree_map(_detach, item)
        return copied
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().requires_grad_(value.requires_grad and value.is_floating_point())


def measure_overheads(block_list: Blocks, inputs: Sequence[BlockInputs], op_keys: Sequence[frozenset[str]], *,
                      repeats: int, clock: Clock, touch_ms_per_byte: float = 0.0,
                      uncacheable_shares: Sequence[float] | None = None,
                      budget: ProbeBudget | None = None) -> tuple[BlockOverheads, ...]:
    """Overheads of every block (``inputs`` from `capture_block_inputs`; ``op_keys[i]``: the
    `remat.measure.types.OpRecord` keys of block i's calls that can be cached
    (`remat.checkpointing.cacheable.cacheable`); ``uncacheable_shares[i]``: the share
    of its forward's op time in calls that cannot be cached, replayed even when every other call
    is: `uncacheable_share`): one untimed warm-up repeat, then ``repeats`` timed ones, or with a
    ``budget`` as many as fit in its time (`remat.measure.budget.ProbeBudget.repeats`, the
    warm-up's time being what one repeat costs), shared equally between the groups below. Alike
    blocks (same class, op calls, parameter and input shapes: the layers of a transformer) share
    one measurement, its repeats taken in turn on each of them, at least ``repeats + number of
    alike blocks - 1`` of them without a budget, and with one at least one per block: every
    block runs at least once. (`remat.measure.profile` passes one block per group of
    `remat.measure.sharing`.)"""
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an integer >= 1 (timed repeats; the median is kept).")
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, (_, module) in enumerate(block_list):
        groups.setdefault(_alike_key(module, inputs[i], op_keys[i]), []).append(i)
    found: dict[int, BlockOverheads] = {}
    each = budget.split(len(groups)) if budget is not None else None
    for members in groups.values():
        if inputs[members[0]].shared_cache:  # keep-only, never probed
            unavailable = (("recompute", SHARED_CACHE), ("selective", SHARED_CACHE))
            found.update((i, BlockOverheads(selective_ms=0.0, recompute_ms=0.0, selective_cache_ms=0.0,
                                            unavailable=unavailable)) for i in members)
            continue
        runs = [(block_list[i][1], inputs[i]) for i in members]
        uncacheable = uncacheable_shares[members[0]] if uncacheable_shares is not None else 0.0
        count = _Count(repeats + len(runs) - 1) if each is None else _Count(len(runs), each)
        shared = _group_overheads(runs, op_keys[members[0]], count, clock, touch_ms_per_byte, uncacheable)
        found.update((i, shared) for i in members)
    return tuple(found[i] for i in range(len(block_list)))


def _alike_key(module: nn.Module, inputs: BlockInputs, op_keys: frozenset[str]) -> tuple[Any, ...]:
    tensors = [t for t in tree_leaves((inputs.args, inputs.kwargs)) if isinstance(t, torch.Tensor)]
    return (
        type(module), op_keys, inputs.cache_positions > 0, inputs.shared_cache,
        tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in tensors),
        tuple((name, tuple(p.shape), p.dtype) for name, p in module.named_parameters()),
    )


@dataclass(frozen=True)
class _Count:
    """Timed repeats of a probe: ``least``, or with a budget as many as fit in it (never fewer
    than ``least``), the warm-up's time ``run_ms`` being what one repeat costs."""

    least: int
    budget: ProbeBudget | None = None

    def of(self, run_ms: float) -> int:
        return self.least if self.budget is None else max(self.least, self.budget.repeats(run_ms))


def _group_overheads(runs: list[tuple[nn.Module, BlockInputs]], op_keys: frozenset[str], count: _Count,
                     clock: Clock, touch_ms_per_byte: float = 0.0, uncacheable: float = 0.0) -> BlockOverheads:
    """Repeat r runs on ``runs[(r - 1) % len(runs)]``; repeat 0 (on the first) warms up and says
    how many timed repeats follow (``count``). Each
    run's time is less the fresh host memory it faulted in (``touch_ms_per_byte`` per byte):
    a block run alone faults in what a step would not, and the step's faults are modelled
    from its peak (`remat.plan.predict.fresh_memory`). The cached run still replays the calls
    that cannot be cached (``uncacheable``: their share of the forward), which the planner
    prices as replayed ops: they are not the cache's cost. A probe that raises stops its
    strategy's runs (`remat.measure.probes.Attempts`)."""
    attempts = Attempts()
    series: dict[str, list[float]] = {"selective": [], "recompute": [], "cache": []}
    curve, freed_at, graph_held = attempts.run("recompute", checkpointed_forward_curve, *runs[0]) or ((), (), ())
    rep, repeats = 0, 0
    while rep <= repeats:
        module, inputs = runs[max(rep - 1, 0) % len(runs)]
        timed = functools.partial(_timed_run, module, inputs, clock=clock, touch_ms_per_byte=touch_ms_per_byte)
        plain = attempts.run(_ALONE, timed, _plain)
        if plain is None:
            break
        full, selective, cached = (attempts.run(strategy, timed, runner) for strategy, runner in (
            ("recompute", _full), ("selective", _selective(frozenset())), ("selective", _selective(op_keys))))
        if rep > 0:
            _add(series, plain, full, selective, cached, uncacheable)
        else:
            repeats = count.of(sum(run[1] for run in (plain, full, selective, cached) if run is not None))
        rep += 1
    return dataclasses.replace(_overheads_of(series, curve, freed_at, _unavailable(attempts)), graph_held=graph_held)


_ALONE = "run alone"
"""The plain run of a block alone: without it nothing can be measured."""


def _unavailable(attempts: Attempts) -> tuple[tuple[str, str], ...]:
    """``(strategy, reason)`` per strategy whose probe failed; both when the block cannot run alone."""
    failed = attempts.failed()
    if _ALONE in failed:
        reason = f"the block run alone on its captured inputs raised {failed[_ALONE]}"
        if "leaf Variable that requires grad is being used in an in-place operation" in failed[_ALONE]:
            reason = WRITES_INPUT
        return (("recompute", reason), ("selective", reason))
    return tuple(sorted(failed.items()))


def _add(series: dict[str, list[float]], plain: tuple[float, float], full: tuple[float, float] | None,
         selective: tuple[float, float] | None, cached: tuple[float, float] | None, uncacheable: float) -> None:
    """One repeat's differences, for the probes that ran."""
    fwd_ms, plain_ms = plain
    if full is not None:
        series["recompute"].append(full[1] - plain_ms - fwd_ms)
    if selective is not None:
        series["selective"].append(selective[1] - plain_ms - fwd_ms)
        if cached is not None:
            series["cache"].append(cached[1] - selective[1] + (1.0 - uncacheable) * fwd_ms)


def _overheads_of(series: dict[str, list[float]], curve: tuple[int, ...], freed_at: tuple[int, ...],
                  unavailable: tuple[tuple[str, str], ...]) -> BlockOverheads:
    def median(name: str) -> float:
        return max(statistics.median(series[name]), 0.0) if series[name] else 0.0

    return BlockOverheads(selective_ms=median("selective"), recompute_ms=median("recompute"),
                          selective_cache_ms=median("cache"), checkpointed_fwd_live_bytes=curve,
                          checkpointed_fwd_freed_at=freed_at, unavailable=unavailable)


class _Curve(TorchDispatchMode):
    """Live bytes after each op call, read from a `LiveTracker` entered after this mode (the
    tracker then counts a call's outputs once the call has returned here: they are added), and
    the call from which each storage the forward made was no longer live. Storages are numbered
    in the order they are made, as `remat.measure.ops.OpRecorder` numbers a block's storages."""

    def __init__(self, tracker: LiveTracker) -> None:
        super().__init__()
        self.tracker = tracker
        self.points: list[int] = []
        self.freed_at: list[int] = []
        self._live: dict[int, int] = {}  # storage key -> number, while live
        self.active = False
        """Set while the block's own forward runs: the checkpoint's calls around it are not the
        block's (torch before 2.12 makes two empty tensors before the body, `_NoopSaveInputs`,
        and a curve two calls longer than the op table was dropped from every profile)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.active:
            return out
        call = len(self.points)
        new = new_storages(args, kwargs, out)
        live = self.tracker.live_keys()
        for key in [k for k in self._live if k not in live or k in new]:
            self.freed_at[self._live.pop(key)] = call  # freed (an address that comes back is new)
        for key in new:
            self._live[key] = len(self.freed_at)
            self.freed_at.append(-1)
        self.points.append(self.tracker.live_bytes + sum(new.values()))
        return out

    def finish(self) -> tuple[int, ...]:
        """``freed_at``, with the storages still live at the end at ``len(points)``."""
        return tuple(len(self.points) if at < 0 else at for at in self.freed_at)

    def live_after(self) -> dict[int, int]:
        """Storage key -> number of the storages the forward made that are live now."""
        live = self.tracker.live_keys()
        return {key: number for key, number in self._live.items() if key in live}


def checkpointed_forward_curve(module: nn.Module, inputs: BlockInputs
                               ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, int], ...]]:
    """(curve, freed at, graph-held) of a checkpointed forward of ``module`` (as `remat.apply`
    runs it: autograd keeps only the input). Curve: the bytes it has made live after each op
    call, beyond what was live before it. Freed at: per storage it made, numbered in the order
    made, the call from which it was no longer live (the number of calls: still live at the end).
    What a selective forward holds beyond the curve is its cache, each cached output from the
    call its storage would have been freed at (`remat.plan.costs.selective_working_bytes`): with
    the plain forward's curve instead, which counts every saved storage, the bound on the
    built-in GPT's save-matmuls forward was 4.6 % above the measured peak. Graph-held:
    ``(number, bytes)`` of the storages it made, not its outputs, still live once it returned and
    gone with its outputs' graph: tensors a custom ``torch.autograd.Function`` keeps as
    attributes of its ``ctx`` (an intermediate, as torch's documentation has it, which no
    saved-tensor hook sees), held by the graph whatever checkpointing does
    (`remat.measure.types.BlockProfile.graph_held_storages`)."""
    leaves = [t for t in tree_leaves((inputs.args, inputs.kwargs)) if isinstance(t, torch.Tensor)]
    device = leaves[0].device if leaves else next((p.device for p in module.parameters()), torch.device("cpu"))
    tracker = LiveTracker(device)
    curve = _Curve(tracker)

    def recorded(*args: Any, **kwargs: Any) -> Any:
        curve.active = True
        try:
            return module.forward(*args, **kwargs)
        finally:
            curve.active = False

    with torch.enable_grad(), curve, tracker, inputs.call_context():
        out = _checkpointed(module, inputs.args, inputs.kwargs, forward=recorded)
        outputs = {storage_key(t) for t in tensors_in(out)}
        held = {key: (number, tracker.bytes_of_key(key)) for key, number in curve.live_after().items()
                if key not in outputs}
        del out
        left = curve.live_after()  # what outlives the graph: the module's or the code's, not the graph's
    graph_held = tuple(sorted(pair for key, pair in held.items() if key not in left))
    return tuple(curve.points), curve.finish(), graph_held


class _Twice(nn.Module):
    """The least a checkpointed call can run: one op that saves nothing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def measure_checkpoint_call_ms(device: torch.device, *, repeats: int, clock: Clock,
                               touch_ms_per_byte: float = 0.0, budget: ProbeBudget | None = None) -> float:
    """What one checkpointed call costs beyond its replay whatever it runs: a one-element
    multiply run plainly and checkpointed as `remat.apply` runs it (at least ``10 * repeats``
    pairs and 25, after one warm-up pair, or with a ``budget`` as many more as fit in its time;
    median of the differences, never negative). A segment of k blocks pays it once where k
    one-block segments pay it k times: 0.1-0.3 ms here when the probe ran through an installed
    runtime, a third to a half of a built-in MLP block's checkpoint overhead, which made √N plans
    cost 13-23 points of overhead less than full recomputation; 0.05-0.08 ms through the
    checkpoint region alone, as it runs now (12 profiles of the test GPT, a loaded machine)."""
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an integer >= 1 (timed repeats; the median is kept).")
    module = _Twice()
    inputs = BlockInputs(args=(torch.ones(1, device=device, requires_grad=True),), kwargs={})
    found: list[float] = []
    pairs = None
    while pairs is None or len(found) < pairs:
        fwd_ms, plain_ms = _timed_run(module, inputs, _plain, clock, touch_ms_per_byte)
        full_ms = _timed_run(module, inputs, _full, clock, touch_ms_per_byte)[1]
        if pairs is None:  # the first pair warms up and says what a pair costs
            pairs = _Count(max(25, 10 * repeats), budget).of(plain_ms + full_ms)
        else:
            found.append(full_ms - plain_ms - fwd_ms)
    return max(statistics.median(found), 0.0)


def uncacheable_share(calls: Sequence[tuple[bool, bool, float]]) -> float:
    """Share of a forward's op time (``calls``: ``(can be cached, is a view, ms)`` per call) in
    the calls selective checkpointing replays even when it caches every call it can
    (`remat.checkpointing.cacheable.cacheable`: random and in-place ops, dropout's above all);
    views cost nothing to replay and are not counted."""
    total = sum(ms for _, _, ms in calls)
    if total <= 0:
        return 0.0
    return sum(ms for can_cache, view, ms in calls if not view and not can_cache) / total


def _timed_run(module: nn.Module, inputs: BlockInputs, runner: Runner, clock: Clock,
               touch_ms_per_byte: float = 0.0) -> tuple[float, float]:
    """(forward ms, forward + backward ms) of one run, the latter less ``touch_ms_per_byte`` per
    byte of fresh host memory the run faulted in; parameter and input gradients start unset, as
    in a training step after ``zero_grad(set_to_none=True)``.

    On CUDA the timed run is queued behind an untimed run of the same kind, as a block in a step
    runs behind the blocks before it: the Python the checkpoint adds (hooks, its frame, the
    guard, the policy) then runs while the device still works, and costs device time only where
    it outlasts the block's kernels, as in the step. Timed from an idle device, a run pays all of
    it: an H200 (2026-12-04) measured 1.11 ms of overhead per unit of a convolutional net whose
    forward takes 0.76 ms, and predicted its recomputing plans 8-18 % slower than they ran."""
    leaves = [t for t in tree_leaves((inputs.args, inputs.kwargs)) if isinstance(t, torch.Tensor)]
    clock.sync()
    if getattr(clock, "cuda", False):  # a run of the same kind queued first: the timed one starts behind it
        _run_once(module, inputs, runner, leaves)
    with FaultCount(enabled=bool(touch_ms_per_byte)) as faults:
        start, mid, end = _run_once(module, inputs, runner, leaves, clock.mark)
        clock.sync()
    return clock.elapsed_ms(start, mid), clock.elapsed_ms(start, end) - touch_ms_per_byte * (faults.bytes or 0)


def _run_once(module: nn.Module, inputs: BlockInputs, runner: Runner, leaves: list[torch.Tensor],
              mark: Callable[[], Any] | None = None) -> tuple[Any, Any, Any]:
    """One run, forward then backward with ones, from unset gradients; ``mark`` is read at its
    start, after the forward and at its end (those marks are returned)."""
    for tensor in [*leaves, *module.parameters()]:
        tensor.grad = None
    start = mark() if mark else None
    with inputs.call_context():  # the forward only: autograd runs the backward in the dtypes it recorded
        out = runner(module, inputs.args, inputs.kwargs)
    mid = mark() if mark else None
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
    return start, mid, mark() if mark else None


def _plain(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The block's own forward, as `_checkpointed` and a replay run it: not its call, whose user
    hooks would fire on every probe (a deep-supervision hook appending block outputs to a list
    on the model kept a hundred graphs alive after the profile)."""
    return module.forward(*args, **kwargs)


def _full(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Plain checkpointing as `remat.apply` runs a one-block segment."""
    return _checkpointed(module, args, kwargs)


def _selective(saved_ops: frozenset[str]) -> Runner:
    """Selective checkpointing as `remat.apply` runs it, saving ``saved_ops`` (those cacheable)."""

    def run(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return _checkpointed(module, args, kwargs, functools.partial(selective_context, saved_ops))

    return run


def _checkpointed(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                  context_fn: Callable[[], Any] | None = None, forward: Callable[..., Any] | None = None) -> Any:
    """``module`` called as the runtime calls a one-block segment's block: its first positional
    argument through the checkpoint, the others and the keyword arguments beside it, under the
    same region and buffer guard (the guard's bookkeeping is part of the overhead a planned step
    pays). The runtime's dispatch to the region is left out: side by side on the built-in MLP's
    block, this costs 97.6 % of what a call through an installed runtime costs beyond the plain
    run (0.59 against 0.61 ms)."""
    first, extra, rest, key = first_argument(args, kwargs)
    guard = BufferGuard([module], _BUFFERS_CHANGED.setdefault(module, {}))
    forward = forward or module.forward  # bound now: the replay runs the forward the forward ran
    body = lambda first, extra: [call_with_first(forward, first, extra, rest, key)]  # noqa: E731
    return checkpointed(body, first, extra, guard=guard, context_fn=context_fn, kwargs=rest)[0]
