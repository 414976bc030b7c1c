"""`verify`: run the baseline step and the planned step from the same weights and RNG seed.

Both steps run on deep copies of the user's model and optimizer (the originals are never
touched), through the same sequence, so the two copies hold equal weights at every stage:

1. a plain step: loss, outputs and every parameter gradient are compared (max abs difference);
2. a step under `remat.apply.opcount.BlockOpCounter`: aten calls per block, forward + backward,
   against the baseline plus the replays the plan implies;
3. a step under the live-storage tracker (`remat.measure.tracker.track_step`): measured peak
   against the plan's prediction;
4. one untimed step each, then ``repeats`` rounds timing both, the order swapped every round:
   medians against each other and against the prediction, absolute (``step_error_pct``) and at
   this run's speed (``paired_step_error_pct``: the prediction scaled by the baseline measured
   side by side, which removes the machine's drift since profiling, ``baseline_drift_pct``).

Every step starts from the same seed, so dropout draws the same masks in both: torch's
generators, and Python's `random` and NumPy's global generator too (Hugging Face's wav2vec2 and
HuBERT draw their SpecAugment masks with ``np.random``; unseeded, the two runs would mask
different frames and differ without any recomputation). The caller's `random` and NumPy states
are restored afterwards, as torch's are. LayerDrop is off in both copies, as in the profile
(`remat.measure.layerdrop`): the step compared and measured runs every layer. On the CPU the
same kernels run in the same order, so loss, outputs and gradients must be bit-identical
(tolerance 0). CUDA kernels with atomic accumulation (embedding and scatter backward, some
cuBLAS reductions) are not reproducible run to run even without recomputation, so there the
tolerance is `CUDA_TOLERANCE`. A plan whose head strategy is not ``keep`` returns no logits, so
only the loss is compared of the outputs; a chunked head sums over tokens in another order and
multiplies chunks of rows, so the loss and every gradient are compared with the strategy's own
relative tolerance (`remat.apply.head.head_tolerance`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import math
import random
import statistics
import types
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from remat._batch import (LossFn, call_model, check_batch_device, check_grad_enabled, check_model, check_step_inputs, compute_loss,
                          model_device)
from remat.apply.api import apply_to_copy, check_plan_matches, is_applied, remove_
from remat.apply.head import HeadTolerance, head_tolerance
from remat.apply.opcount import BlockOpCounter, expected_extra_calls
from remat.checkpointing.caches import CacheOff
from remat.checkpointing.callsites import block_modules
from remat.measure.faults import FaultCount
from remat.measure.layerdrop import LayerDropOff
from remat.measure.profile import _Step
from remat.measure.state import BatchGrads, generators_in, host_rng_restored, model_generators
from remat.measure.timing import Clock
from remat.measure.storage import tensors_in
from remat.measure.tracker import track_step
from remat.plan.types import Plan
from remat.verify_compiled import with_compiled_steps
from remat.verify_types import OpCount, Verification

__all__ = ["verify", "CUDA_TOLERANCE"]

SEED = 1234
"""Seed of every compared step."""

def _seed() -> None:
    """Every compared, counted, tracked and timed step starts here: the same draws in both runs
    from torch's generators, Python's `random` and NumPy's global generator."""
    torch.manual_seed(SEED)
    random.seed(SEED)
    np.random.seed(SEED)


def _host_draws() -> tuple[Any, ...]:
    """Where Python's `random` and NumPy's global generator stand (compared between the runs)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return random.getstate(), kind, keys.tobytes(), pos, has_gauss, gauss


HOST_DRAWS = (" But the planned step drew other numbers from Python's random or NumPy's global generator than the "
              "step without a plan: a replayed block draws from them, and no checkpoint can restore them (it restores "
              "torch's generators). Keep the blocks that draw from them (remat.profile(..., blocks=...) or a plan "
              "that keeps them), or draw from torch's generator.")
"""Why the runs differ when the plan made the host's generators draw again."""


CUDA_TOLERANCE = 1e-5
"""Max abs difference allowed on CUDA (non-deterministic atomics in some backward kernels)."""


def _float_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _float_tensors(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _float_tensors(v)]
    return []


def _max_abs_diff(a: list[torch.Tensor | None], b: list[torch.Tensor | None], infinities: bool = False) -> float:
    """Largest |x - y| over corresponding tensors; inf when counts, presence or shapes differ,
    or when either holds a NaN or an Inf (``max(0.0, nan)`` is 0.0: a NaN must never pass as equal).
    ``infinities``: a pair with the same infinities in the same places and no NaN (a model's
    outputs that mask logits with -inf by design: Grounding DINO's) is compared on the rest."""
    if len(a) != len(b):
        return float("inf")
    worst = 0.0
    for x, y in zip(a, b):
        if x is None or y is None:
            if x is not y:
                return float("inf")
            continue
        if x.shape != y.shape:
            return float("inf")
        if x.numel():
            x, y = x.detach(), y.detach()
            # complex gradients keep their imaginary parts (``.double()`` would drop them)
            x, y = (x.cdouble(), y.cdouble()) if x.is_complex() or y.is_complex() else (x.double(), y.double())
            if not (bool(torch.isfinite(x).all()) and bool(torch.isfinite(y).all())):
                if not (infinities and same_infinities(x, y)):
                    return float("inf")
                finite = torch.isfinite(x)
                x, y = x[finite], y[finite]
                if not x.numel():
                    continue
            worst = max(worst, float((x - y).abs().max()))
    return worst


def same_infinities(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether ``x`` and ``y`` (same shape) hold no NaN and the same infinities in the same places."""
    if x.is_complex() or y.is_complex() or bool(torch.isnan(x).any()) or bool(torch.isnan(y).any()):
        return False
    inf = torch.isinf(x)
    return bool(torch.equal(inf, torch.isinf(y))) and bool(torch.equal(x[inf], y[inf]))


def _nonfinite(run: str, what: str, tensors: list[torch.Tensor | None], names: list[str]) -> list[str]:
    """One line per tensor of ``tensors`` holding NaN or Inf: which run, which tensor, how many."""
    found = []
    for name, t in zip(names, tensors):
        if t is None or not (t.is_floating_point() or t.is_complex()) or not t.numel():
            continue
        t = t.detach()
        nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        if nan or inf:
            found.append(f"{run} run: {what} {name} holds {nan} NaN and {inf} Inf of {t.numel()} values")
    return found


def _nonfinite_report(run: str, loss: torch.Tensor, outputs: list[torch.Tensor],
                      grads: list[torch.Tensor | None], param_names: list[str],
                      other_outputs: list[torch.Tensor] | None = None) -> list[str]:
    """The lines of `_nonfinite` for the loss, the outputs and the gradients; an output with the
    same infinities as the other run's (``other_outputs``) and no NaN is left out: infinities the
    model puts there by design (-inf masking logits), which recomputation left as they were."""
    if other_outputs is not None and len(other_outputs) == len(outputs):
        outputs = [None if _alike(x, y) else x for x, y in zip(outputs, other_outputs)]
    return (_nonfinite(run, "loss", [loss], [""])
            + _nonfinite(run, "output", outputs, [f"#{i}" for i in range(len(outputs))])
            + _nonfinite(run, "gradient of", grads, param_names))


def _alike(x: torch.Tensor | None, y: torch.Tensor | None) -> bool:
    return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
            and x.is_floating_point() and y.is_floating_point() and same_infinities(x.detach(), y.detach()))


def _copy_optimizer(optimizer: torch.optim.Optimizer | None, source: nn.Module, target: nn.Module) -> torch.optim.Optimizer | None:
    """The same optimizer class, hyper-parameters and state, on ``target``'s parameters."""
    if optimizer is None:
        return None
    mapping = {id(p): q for p, q in zip(source.parameters(), target.parameters())}
    groups = []
    for group in optimizer.param_groups:
        missing = [p for p in group["params"] if id(p) not in mapping]
        if missing:
            raise ValueError(
                f"the optimizer holds {len(missing)} parameter(s) that are not the model's; pass the "
                "optimizer built on this model's parameters (torch.optim.AdamW(model.parameters()))."
            )
        groups.append({**group, "params": [mapping[id(p)] for p in group["params"]]})
    accepted = inspect.signature(type(optimizer)).parameters
    try:
        clone = type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    except TypeError:  # an optimizer that wraps others (its own constructor): its attributes deep-copied onto
        # the target's parameters (`Optimizer.__getstate__` would keep only its own state and groups)
        memo: dict[int, Any] = {id(p): q for p, q in zip(source.parameters(), target.parameters())}
        clone = object.__new__(type(optimizer))
        clone.__dict__.update(copy.deepcopy(optimizer.__dict__, memo))
        return clone
    clone.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    return clone


def _copy_model(model: nn.Module) -> tuple[nn.Module, dict[int, Any]]:
    """``copy.deepcopy(model)`` and its memo (original's id -> copy), with the tensors the model's
    code left on its modules from an earlier forward that belong to its graph (deep supervision's
    features, kept by a forward hook) copied detached: a tensor of a graph cannot be deep-copied
    (torch's error names weight norm), and the copy's own forwards make them again. The copy's
    hooks and the functions set on its modules (an instance ``forward`` wrapping the original's,
    as TRL's fused-head patch and accelerate's output casts are) act on the copy (`_rebound`)."""
    memo: dict[int, Any] = {}
    for module in model.modules():
        for value in vars(module).values():
            for t in tensors_in(value):
                if t.grad_fn is not None:
                    memo[id(t)] = t.detach().clone()
    try:
        copied = copy.deepcopy(model, memo)
    except Exception as exc:  # noqa: BLE001 - whatever deepcopy raises, said with what verify needs
        raise ValueError(
            f"remat.verify runs both steps on copies of the model (copy.deepcopy), and {type(model).__name__} cannot "
            f"be copied: {type(exc).__name__}: {exc}. Something on its modules (a hook object, an attribute) holds what "
            "cannot be copied (a lock, an open file); take it off while verifying, or check the plan by applying it "
            "(remat.apply_) and comparing training steps.") from exc
    for module in copied.modules():
        for name in _HOOK_DICTS:
            hooks = getattr(module, name, None)
            for key, hook in list((hooks or {}).items()):
                hooks[key] = _rebound(hook, memo)
        for name, value in list(vars(module).items()):
            if isinstance(value, _CALLABLES):
                module.__dict__[name] = _rebound(value, memo)
    return copied, memo


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_CALLABLES = (types.FunctionType, types.MethodType, functools.partial)


def _rebound(fn: Any, memo: dict[int, Any], seen: dict[int, Any] | None = None) -> Any:
    """``fn`` reading the copies in ``memo`` (`copy.deepcopy`'s) of what it reads of the original.

    ``copy.deepcopy`` copies a function as itself: a hook registered as ``lambda m, i, o:
    self.feats.append(o)`` on a copied model, a loss_fn reading ``model.aux`` and
    ``model.feats``, or an instance ``forward`` closing over the original's bound ``forward``
    still acted on the original. `verify` then compared steps that were not the one trained (the
    copies' features went to the original's list; a patched forward ran the original model twice
    and gave its parameters gradients: "identical", 40 % off in peak) or raised an autograd error.
    A function is rebuilt with each closure cell, default and global name it reads pointing at
    the copy of what ``memo`` copied, and the functions it closes over rebuilt the same way (the
    globals as a copied dict, so only this function sees the copy); a bound method is bound to
    the copy of its object, its function rebuilt; a ``functools.partial`` gets its function and
    arguments so; any other object (a callable class holding the model) is deep-copied through
    ``memo``. Anything that reads nothing ``memo`` copied is returned as it is."""
    seen = {} if seen is None else seen
    if id(fn) in memo:
        return memo[id(fn)]
    if id(fn) in seen:
        return seen[id(fn)]
    seen[id(fn)] = fn  # a function that closes over itself (recursion) stops here

    def mapped(value: Any) -> Any:
        if id(value) in memo:
            return memo[id(value)]
        if isinstance(value, _CALLABLES):
            return _rebound(value, memo, seen)
        return _holding_copied(value, memo)

    if isinstance(fn, types.MethodType):
        func, owner = mapped(fn.__func__), mapped(fn.__self__)
        out = fn if func is fn.__func__ and owner is fn.__self__ else types.MethodType(func, owner)
    elif isinstance(fn, functools.partial):
        func, args = mapped(fn.func), tuple(mapped(a) for a in fn.args)
        kwargs = {k: mapped(v) for k, v in fn.keywords.items()}
        same = func is fn.func and all(a is b for a, b in zip(args, fn.args)) and all(
            kwargs[k] is v for k, v in fn.keywords.items())
        out = fn if same else functools.partial(func, *args, **kwargs)
    elif isinstance(fn, types.FunctionType):
        out = _rebuilt_function(fn, mapped)
    elif fn is None or isinstance(fn, (types.BuiltinFunctionType, type)):
        out = fn
    else:  # a callable object: its attributes through the memo (the original model -> the copy)
        try:
            out = copy.deepcopy(fn, memo)
        except Exception:  # noqa: BLE001 - an object that cannot be copied is used as it is
            out = fn
    seen[id(fn)] = out
    return out


def _holding_copied(value: Any, memo: dict[int, Any]) -> Any:
    """``value`` deep-copied through ``memo`` when one of its attributes is something ``memo``
    copied (a trainer-like object whose ``self.model`` a lambda or method reads), else itself."""
    attributes = getattr(value, "__dict__", None)
    if not isinstance(attributes, dict) or isinstance(value, (nn.Module, type, types.ModuleType)):
        return value
    if not any(id(v) in memo for v in attributes.values()):
        return value
    try:
        return copy.deepcopy(value, memo)
    except Exception:  # noqa: BLE001 - an object that cannot be copied is used as it is
        return value


def _rebuilt_function(fn: types.FunctionType, mapped: Any) -> types.FunctionType:
    """``fn`` with its closure cells, defaults and global names passed through ``mapped``; where it
    reads itself (a recursive function, by a cell or a global name), it reads the rebuilt one."""
    cells, changed, own_cells, own_names = [], False, [], []
    for cell in fn.__closure__ or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell (a name bound later)
            cells.append(cell)
            continue
        if contents is fn:
            cells.append(types.CellType())
            own_cells.append(cells[-1])
            continue
        value = mapped(contents)
        changed |= value is not contents
        cells.append(types.CellType(value) if value is not contents else cell)
    names = {}
    for name in fn.__code__.co_names:
        if name in fn.__globals__:
            if fn.__globals__[name] is fn:
                own_names.append(name)
                continue
            value = mapped(fn.__globals__[name])
            if value is not fn.__globals__[name]:
                names[name] = value
    defaults = tuple(mapped(v) for v in fn.__defaults__ or ())
    kwdefaults = {k: mapped(v) for k, v in (fn.__kwdefaults__ or {}).items()}
    changed |= bool(names) or any(a is not b for a, b in zip(defaults, fn.__defaults__ or ())) or any(
        kwdefaults[k] is not v for k, v in (fn.__kwdefaults__ or {}).items())
    if not changed:
        return fn
    scope = {**fn.__globals__, **names} if names else fn.__globals__
    out = types.FunctionType(fn.__code__, scope, fn.__name__, defaults or None, tuple(cells) or None)
    out.__kwdefaults__ = kwdefaults or None
    out.__dict__.update(fn.__dict__)
    out.__qualname__ = fn.__qualname__
    for cell in own_cells:
        cell.cell_contents = out
    if names:
        scope.update(dict.fromkeys(own_names, out))
    return out


class _Run:
    """One copy of the model (baseline or planned) and its optimizer, stepped identically."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, batch: Any,
                 loss_fn: LossFn | None, plan: Plan, *, planned: bool, offload_dir: str | None = None,
                 batch_generators: list[tuple[torch.Generator, torch.Tensor]] = ()) -> None:
        self.model, memo = _copy_model(model)
        # as each compared step starts: the batch's generators as verify found them (``batch_generators``),
        # this copy's modules' as they were copied
        self.generators = [*batch_generators, *((g, g.get_state()) for g in model_generators(self.model))]
        if is_applied(self.model):
            remove_(self.model)
        LayerDropOff(self.model).install()  # every layer runs, as in the profile (the copy's own rates)
        self.optimizer = _copy_optimizer(optimizer, model, self.model)
        if planned:
            apply_to_copy(self.model, plan, batch=batch, offload_dir=offload_dir)  # the model was checked
        else:  # as under the plan and in the profile: no key/value cache (remat.checkpointing.caches)
            cache_off = CacheOff(self.model).install()
            if not plan.fingerprint.shared_cache:  # else the model reads what the blocks write there
                cache_off.drop_in(block_modules(self.model, plan.block_names)[0])
        self.plan = plan
        if optimizer is not None:  # a loss reading the optimizer (an L2 term over its parameters) reads the copy's
            memo[id(optimizer)] = self.optimizer
        self.step = _Step(self.model, batch, _rebound(loss_fn, memo), self.optimizer)
        self.blocks = block_modules(self.model, plan.block_names)[0]  # a layer's calls: its sites, as applied
        self.host_draws: tuple[Any, ...] = ()
        """Python's and NumPy's generator states after the first `compared_step`."""
        self.first_step: tuple[Any, ...] | None = None
        """The first `compared_step`'s loss, outputs and gradients."""
        self.faults: list[int] = []
        """Host memory faulted in fresh by each timed step (CPU)."""

    def _seed(self) -> None:
        """`_seed`, and every generator of the batch and of this copy's modules set back to its
        state when the run began: both runs draw the same numbers from them."""
        _seed()
        for g, state in self.generators:
            g.set_state(state)

    def compared_step(self) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor | None]]:
        """Loss, float outputs and gradients of one step from `SEED` (the first one's are kept:
        ``first_step``)."""
        self._seed()
        (self.optimizer or self.model).zero_grad(set_to_none=True)
        output = call_model(self.model, self.step.batch)
        loss = compute_loss(output, self.step.batch, self.step.loss_fn)
        loss.backward()
        # a planned head returns no logits: of the outputs, only the loss (compared apart) is left
        outputs = [t.detach().clone() for t in _float_tensors(output)] if self.plan.head == "keep" else []
        # a sparse embedding's gradient is compared densely
        grads = [None if p.grad is None else p.grad.to_dense() if p.grad.is_sparse else p.grad.clone()
                 for p in self.model.parameters()]
        loss = loss.detach()
        del output
        if self.optimizer is not None:
            self.optimizer.step()
        if self.first_step is None:
            self.first_step = (loss, outputs, grads)
            self.host_draws = _host_draws()
        return loss, outputs, grads

    def counted_step(self) -> BlockOpCounter:
        self._seed()
        with BlockOpCounter(self.blocks) as counter:
            self.step.run()
        return counter

    def tracked_step(self) -> Any:
        """The step the plan is for, under the live-storage tracker: under gradient accumulation,
        the last micro-batch's, its gradients adding to those of one before it (untracked)."""
        self._seed()
        accumulate = self.plan.grad_accumulation
        if accumulate:
            (self.optimizer or self.model).zero_grad(set_to_none=True)
            compute_loss(call_model(self.model, self.step.batch), self.step.batch, self.step.loss_fn).backward()
            self._seed()
        return track_step(functools.partial(self.step.run, accumulate=accumulate), model=self.model,
                          optimizer=self.optimizer, blocks=list(zip(self.plan.block_names, self.blocks)),
                          batch=self.step.batch)

    def timed_step(self, clock: Clock) -> float:
        self._seed()
        clock.sync()
        with FaultCount(enabled=not clock.cuda) as faults:
            start = clock.mark()
            self.step.run()
            end = clock.mark()
        if faults.bytes is not None:
            self.faults.append(faults.bytes)
        return clock.elapsed_ms(start, end)

    def close(self) -> None:
        if is_applied(self.model):
            remove_(self.model)


def _median_int(values: list[int]) -> int:
    return int(statistics.median(values)) if values else 0


def _timed_pairs(base: _Run, planned: _Run, repeats: int, clock: Clock) -> tuple[list[float], list[float]]:
    """One untimed step of each (the first steps after a copy fault in fresh memory), then
    ``repeats`` rounds timing both, the order swapped every round (ABBA), so that a drift in the
    machine's speed hits both alike."""
    base.timed_step(clock)
    planned.timed_step(clock)
    times: dict[int, list[float]] = {0: [], 1: []}
    for r in range(repeats):
        for which in ((0, 1) if r % 2 == 0 else (1, 0)):
            times[which].append((base, planned)[which].timed_step(clock))
    return times[0], times[1]


def _op_counts(plan: Plan, base: BlockOpCounter, planned: BlockOpCounter) -> tuple[OpCount, ...]:
    extra = expected_extra_calls(plan, base.forward_keys, base.stop_keys)
    rows = []
    for i, name in enumerate(plan.block_names):
        expected = base.total[i] + extra[i]
        for op in sorted(set(base.total[i]) | set(planned.total[i]) | set(expected)):
            rows.append(OpCount(block=name, op=op, baseline_count=base.total[i][op],
                                planned_count=planned.total[i][op], expected_count=expected[op]))
    return tuple(rows)


def _pct(measured: float, predicted: float) -> float:
    return 100.0 * (measured - predicted) / predicted if predicted else float("inf")


def _tolerance(device: torch.device, head: HeadTolerance) -> tuple[float, str]:
    if device.type == "cpu":
        tolerance, reason = 0.0, "CPU: the same kernels run in the same order with the RNG restored, so results are bit-identical."
    else:
        tolerance, reason = CUDA_TOLERANCE, (
            f"{device.type}: kernels with atomic accumulation (embedding/scatter backward, split reductions) "
            f"differ run to run even without recomputation; allowed max abs difference {CUDA_TOLERANCE:g}."
        )
    return tolerance, f"{reason} Except: {head.reason}." if head.reason else reason


def _rel_diff(a: torch.Tensor | None, b: torch.Tensor | None, floor: float = 0.0) -> float:
    """max|a - b| / max(max|b|, floor) (normwise relative difference; inf when only one exists)."""
    if a is None or b is None:
        return 0.0 if a is b else float("inf")
    scale = max(float(b.detach().abs().double().max()) if b.numel() else 0.0, floor)
    diff = _max_abs_diff([a], [b])
    if diff == float("inf"):
        return diff
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def _largest(tensors: list[torch.Tensor | None]) -> float:
    finite = [float(t.detach().abs().double().max()) for t in tensors if t is not None and t.numel()]
    return max((x for x in finite if math.isfinite(x)), default=0.0)


def max_rel_diff(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> float:
    """The largest normwise relative difference (max|x - y| / max|y|) of corresponding tensors
    (``a`` against ``b``): what a chunked head's tolerance bounds (`remat.apply.head.head_tolerance`).

    A tensor whose values all lie below the square root of its dtype's epsilon times the largest
    value of ``b`` is measured against that floor instead of its own largest value: a gradient that
    is zero but for rounding (an attention key's bias: softmax does not change when every score
    of a row moves alike) differs between two orders of summation by as much as it is large
    (BERT's, 5.6e-12 where the step's largest is 0.53, 57 % apart with two CPU threads), which
    says nothing about the plan. A gradient 4e-5 of the largest, 10 % wrong, still reads 1.1 %."""
    if len(a) != len(b):
        return float("inf")
    largest = _largest(b)

    def floor(y: torch.Tensor | None) -> float:
        if y is None or not (y.is_floating_point() or y.is_complex()):
            return 0.0
        return math.sqrt(torch.finfo(y.dtype).eps) * largest

    return max((_rel_diff(x, y, floor(y)) for x, y in zip(a, b)), default=0.0)


def verify(model: nn.Module, batch: Any, plan: Plan, loss_fn: LossFn | None = None,
           optimizer: torch.optim.Optimizer | None = None, *, repeats: int = 5,
           offload_dir: str | None = None) -> Verification:
    """Run the baseline and ``plan``'s step from the same weights and seed; compare them.

    ``offload_dir``: where ``offload:disk`` blocks of the plan write (see `remat.apply_`)."""
    if not isinstance(plan, Plan):
        raise TypeError(f"verify needs a remat Plan, got {type(plan).__name__}; load one with remat.Plan.load(path).")
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be an integer >= 1 (timed steps; the median is kept).")
    check_grad_enabled("remat.verify")
    check_model(model, "remat.verify")
    check_step_inputs(optimizer, "remat.verify", loss_fn)
    check_batch_device(model, batch)
    check_plan_matches(model, plan, batch)
    if plan.head != "keep" and loss_fn is not None:
        raise ValueError(
            f"the plan's head is {plan.head!r}: the model's output carries no logits in training, and its loss is the "
            "model's own (labels in the batch). A loss_fn was given, which reads the output: a profile with a "
            "loss_fn plans no head. Plan the head as keep (remat.plan(..., head='keep')), or drop loss_fn and pass "
            "the labels in the batch."
        )
    hooked = sum(1 for p in model.parameters() if getattr(p, "_post_accumulate_grad_hooks", None))
    if hooked:
        warnings.warn(
            f"{hooked} parameter(s) of the model have post-accumulate-grad hooks (an optimizer stepped in the "
            "backward, as torchtune's optimizer_in_bwd does); verify steps copies of the model, and a tensor's hooks "
            "are not copied: both steps run without them, so their gradients compare as always but each gradient "
            "stays live to the step's end and the measured peaks are above a plan's prediction, which the profile "
            "made with the hooks. Check the peak by applying the plan (remat.apply_) and measuring a training "
            "step.", UserWarning, stacklevel=2)
    device = model_device(model)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
            host_rng_restored(generators_in(batch)), BatchGrads(batch):
        drawn = [(g, g.get_state()) for g in generators_in(batch)]
        base = _Run(model, optimizer, batch, loss_fn, plan, planned=False, batch_generators=drawn)
        planned = _Run(model, optimizer, batch, loss_fn, plan, planned=True, offload_dir=offload_dir,
                       batch_generators=drawn)
        try:
            with _OriginalUntouched(model):
                result = _compare(plan, base, planned, repeats, device)
                if plan.compiled_backend:  # the step the plan is for: both copies compiled
                    result = with_compiled_steps(result, (base, planned), accumulate=bool(plan.grad_accumulation),
                                                 repeats=repeats, device=device)
        finally:
            planned.close()
        if result.ok or result.nonfinite:
            return result
        if base.host_draws != planned.host_draws:
            result = dataclasses.replace(result, tolerance_reason=result.tolerance_reason + HOST_DRAWS)
        again = _Run(model, optimizer, batch, loss_fn, plan, planned=False, batch_generators=drawn)
        with _OriginalUntouched(model):
            return _with_determinism(result, base.first_step, again)


class _OriginalUntouched:
    """Raise, naming the cause, when the caller's model runs or gets gradients while verify steps
    its copies: a loss_fn or hook reaching the model through something `_rebound` cannot point at
    the copy (an object holding the model beside a lock or an open file; a module that holds the
    model) would otherwise make verify compare the original with itself, or end in an autograd
    error about in-place changes that names neither."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.handles: list[Any] = []
        self.grads: list[torch.Tensor | None] = []

    def __enter__(self) -> _OriginalUntouched:
        names = {id(m): n or "<root>" for n, m in self.model.named_modules()}
        self.grads = [p.grad for p in self.model.parameters()]
        self.handles = [m.register_forward_pre_hook(functools.partial(_ran_original, names[id(m)]))
                        for m in self.model.modules()]
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()
        if kind is None and any(p.grad is not g for p, g in zip(self.model.parameters(), self.grads)):
            raise ValueError(_ORIGINAL_REACHED.format(what="parameters got gradients"))


_ORIGINAL_REACHED = (
    "remat.verify steps copies of the model, but the original model's {what} while it did: the loss_fn or a hook "
    "reaches the model through something remat cannot point at the copy (an object holding the model beside a "
    "lock, an open file or another object that cannot be copied; a module holding the model). Let the loss_fn "
    "reach the model by a closure, a global name or an attribute of an object that can be copied, or check the "
    "plan by applying it (remat.apply_) and comparing training steps.")


def _ran_original(name: str, module: nn.Module, args: Any) -> None:
    raise ValueError(_ORIGINAL_REACHED.format(what=f"module {name!r} ran"))


def _with_determinism(result: Verification, first: tuple[Any, ...], again: _Run) -> Verification:
    """``result`` (gradients that differ), its reason extended when a second run without a plan,
    from the same weights and seed, differs from the first too: a model that draws from a
    generator remat does not seed (Reformer calls ``torch.seed()`` in its forward) differs from
    itself, and the comparison then says nothing about the plan."""
    loss_a, out_a, grads_a = first
    loss_b, out_b, grads_b = again.compared_step()
    drift = max(_max_abs_diff([loss_a], [loss_b]), _max_abs_diff(out_a, out_b), _max_abs_diff(grads_a, grads_b))
    if drift <= result.tolerance:  # as deterministic as the comparison asks (CUDA's atomics allowed for)
        return result
    note = (f" But the model without a plan is not deterministic: two of its runs from the same weights and seed "
            f"differ by up to {drift:.2e} (it draws from a generator remat does not seed, or calls torch.seed() in "
            "its forward), so this difference does not say whether the plan changed anything.")
    return dataclasses.replace(result, tolerance_reason=result.tolerance_reason + note)


def _compare(plan: Plan, base: _Run, planned: _Run, repeats: int, device: torch.device) -> Verification:
    (loss_b, out_b, grads_b), (loss_p, out_p, grads_p) = base.compared_step(), planned.compared_step()
    counts = _op_counts(plan, base.counted_step(), planned.counted_step())
    tracked_b, tracked_p = base.tracked_step(), planned.tracked_step()
    times_b, times_p = _timed_pairs(base, planned, repeats, Clock(device))
    loss_diff = _max_abs_diff([loss_b], [loss_p])
    out_diff, grad_diff = _max_abs_diff(out_b, out_p, infinities=True), _max_abs_diff(grads_b, grads_p)
    names = [n for n, _ in base.model.named_parameters()]
    nonfinite = (_nonfinite_report("baseline", loss_b, out_b, grads_b, names, out_p)
                 + _nonfinite_report("planned", loss_p, out_p, grads_p, names, out_b))
    head = head_tolerance(base.model, plan.head, base.step.batch)
    rel_diff = max(max_rel_diff([loss_p], [loss_b]), max_rel_diff(grads_p, grads_b))
    tolerance, reason = _tolerance(device, head)
    step_b, step_p = statistics.median(times_b), statistics.median(times_p)
    pred = plan.prediction
    pred_base = pred.step_ms - pred.extra_ms + pred.fault_saving_ms
    at_this_speed = step_b * pred.step_ms / pred_base if pred_base > 0 else pred.step_ms
    return Verification(
        strategy_name=plan.strategy_name, budget_bytes=plan.budget_bytes,
        loss_max_abs_diff=loss_diff, output_max_abs_diff=out_diff, grad_max_abs_diff=grad_diff,
        grads_identical=loss_diff == 0.0 and out_diff == 0.0 and grad_diff == 0.0 and not nonfinite,
        nonfinite=tuple(nonfinite),
        tolerance=tolerance, tolerance_reason=reason, head=plan.head,
        relative_tolerance=head.relative_tolerance, grad_max_rel_diff=rel_diff,
        baseline_peak_bytes=tracked_b.peak_bytes, measured_peak_bytes=tracked_p.peak_bytes,
        predicted_peak_bytes=pred.peak_bytes, peak_error_pct=_pct(tracked_p.peak_bytes, pred.peak_bytes),
        device_max_allocated_bytes=tracked_p.device_max_allocated_bytes,
        baseline_step_ms=step_b, measured_step_ms=step_p, predicted_step_ms=pred.step_ms,
        step_error_pct=_pct(step_p, pred.step_ms), overhead_pct=100.0 * (step_p / step_b - 1.0),
        baseline_fault_bytes=_median_int(base.faults[1:]), measured_fault_bytes=_median_int(planned.faults[1:]),
        predicted_fault_bytes=pred.fault_bytes,
        predicted_baseline_step_ms=pred_base, predicted_overhead_pct=_pct(pred.step_ms, pred_base) if pred_base > 0 else 0.0,
        paired_step_error_pct=_pct(step_p, at_this_speed), baseline_drift_pct=_pct(step_b, pred_base) if pred_base > 0 else 0.0,
        op_counts=counts, recompute_counts_match=all(c.planned_count == c.expected_count for c in counts),
        compiled_backend=plan.compiled_backend, timeline=tracked_p.timeline,
    )
