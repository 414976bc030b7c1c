"""`apply_` a plan to the user's model in place, `remove_` it, or `auto_` profile+plan+apply.

``apply_`` checks everything before it changes anything: a second apply, a plan made for
another model (structure, dtype, device) or another batch (shapes), block names that are not
distinct, non-nested submodules of the model (or not the blocks the plan was profiled with), a
head strategy for a model without a head part, is an error and leaves the model untouched; a
step of the change itself that fails undoes the steps before it. It changes only the
``forward`` instance attribute of the planned blocks (`remat.apply.runtime`) and, when the
plan's head is not ``keep``, of the model itself (`remat.apply.head`), and on Hugging Face
models adds a forward pre-hook that turns the key/value cache off where gradients are enabled
(`remat.checkpointing.caches.CacheOff`, with a one-time warning). A forward pre-hook on the model
(`remat.apply.watch.StepWatch`) warns of a training batch larger than the one the plan was made
for and refuses Hugging Face checkpointing turned on since. ``state_dict`` keys and values stay as
they are, and ``remove_`` restores every ``forward`` exactly and takes the hooks off.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from remat._batch import LossFn, check_batch_device, check_model
from remat.apply.head import HeadRuntime
from remat.apply.runtime import Runtime
from remat.apply.strategies import HANDLERS
from remat.apply.watch import StepWatch
from remat.checkpointing.callsites import block_modules, split_site
from remat.checkpointing.callsites import uninstall as uninstall_sites
from remat.checkpointing.caches import CacheOff
from remat.head.site import find_head
from remat.head.strategies import parse_head
from remat.measure.types import Fingerprint
from remat.plan.types import Plan

RUNTIME_ATTR = "_remat_runtime"
"""Attribute of an applied model holding its `Runtime` (a plain attribute: not in state_dict)."""

__all__ = ["apply_", "remove_", "auto_", "is_applied", "applied_plan", "check_plan_matches"]


def is_applied(model: nn.Module) -> bool:
    """True when a plan is applied to ``model``."""
    return RUNTIME_ATTR in model.__dict__


def applied_plan(model: nn.Module) -> Plan | None:
    """The plan applied to ``model``, or None."""
    runtime = model.__dict__.get(RUNTIME_ATTR)
    return None if runtime is None else runtime.options["plan"]


def _wrapped_model(model: nn.Module) -> str | None:
    """The attribute under which a data-parallel or compile wrapper holds the user's model
    (DistributedDataParallel's, DataParallel's and FSDP1's ``module``), or None."""
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    return "module" if isinstance(model, wrappers) or type(model).__name__ == "FullyShardedDataParallel" else None


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def _resolve_blocks(model: nn.Module, plan: Plan) -> list[nn.Module]:
    """The plan's blocks in ``model``: distinct submodules (never the model itself), none inside
    another; for a call of a layer (``layer@i``, `remat.checkpointing.callsites`), the layer, checked
    here, its call site made when the plan is applied."""
    blocks = []
    for block_name in plan.block_names:
        name, index = split_site(block_name)
        try:
            block = model.get_submodule(name)
        except AttributeError:
            wrapped = _wrapped_model(model)
            if wrapped is not None and _has(model, f"{wrapped}.{name}"):
                raise ValueError(
                    f"{type(model).__name__} wraps the model the plan was made for (as {type(model).__name__}."
                    f"{wrapped}): apply the plan before wrapping (remat.apply_(model, plan), then "
                    f"{type(model).__name__}(model)), or pass the wrapped model (remat.apply_(wrapper.{wrapped}, plan))."
                ) from None
            raise ValueError(
                f"the plan names block {name!r}, which {type(model).__name__} does not have; the plan "
                "was made for another model. Profile and plan this model (remat.profile, remat.plan)."
            ) from None
        if block is model:
            raise ValueError(f"the plan names block {name!r}, which is the model itself; blocks are its "
                             "submodules (layers). Profile and plan this model (remat.profile, remat.plan).")
        if index is None or not any(b is block for b in blocks):  # a layer's calls: the layer once
            blocks.append(block)
    _check_disjoint(tuple(dict.fromkeys(split_site(name)[0] for name in plan.block_names)), blocks)
    return blocks


def _check_disjoint(names: tuple[str, ...], blocks: list[nn.Module]) -> None:
    owner = {id(block): name for name, block in zip(names, blocks)}
    if len(owner) != len(blocks):
        seen: dict[int, str] = {}
        for name, block in zip(names, blocks):
            if id(block) in seen:
                raise ValueError(f"the plan's blocks {seen[id(block)]!r} and {name!r} are the same module; "
                                 "each block must be a different module. Plan again (remat.plan).")
            seen[id(block)] = name
    for name, block in zip(names, blocks):
        for inner_name, inner in block.named_modules():
            if inner_name and id(inner) in owner:
                raise ValueError(f"the plan's block {owner[id(inner)]!r} lies inside its block {name!r}; "
                                 "blocks must not nest. Plan again (remat.plan).")


def _model_fingerprint(model: nn.Module, batch: Any) -> Fingerprint:
    from remat.measure.fingerprint import fingerprint

    return fingerprint(model, batch)


def check_plan_matches(model: nn.Module, plan: Plan, batch: Any = None) -> None:
    """Raise ValueError when ``plan`` was made for another model, dtype, device or batch."""
    have = _model_fingerprint(model, batch if batch is not None else ())
    want = plan.fingerprint
    # dtype and device first: the structure hash covers parameter dtypes too, and naming the
    # dtype is the more useful message.
    structure = have.model_hash if have.model_hash == want.run_model_hash else want.model_hash  # either state
    checks = [("dtype", want.dtype, have.dtype), ("device", want.device, have.device),
              ("model structure", structure, have.model_hash)]
    if batch is not None:
        checks.append(("batch shapes", want.batch_shapes, have.batch_shapes))
    for what, planned, actual in checks:
        if planned != actual:
            raise ValueError(
                f"the plan does not match this model: {what} was {planned!r} when profiled, now "
                f"{actual!r}. Profile and plan again for this model and batch (remat.profile, remat.plan)."
            )


def _offload_engines(plan: Plan, offload_dir: str | None) -> dict[str, Any]:
    targets = {seg.strategy.split(":", 1)[1] for seg in plan.segments if seg.kind == "offload"}
    if not targets:
        return {}
    from remat.apply.offload import OffloadEngine

    engines = {}
    for target in sorted(targets):
        directory = offload_dir if target == "disk" else None
        engines[target] = OffloadEngine(target, directory=directory)
    return engines


def _head_runtime(model: nn.Module, plan: Plan) -> HeadRuntime | None:
    """The runtime of the plan's head strategy (None for ``keep``); refused without a head part."""
    if plan.head == "keep":
        return None
    site, why = find_head(model)
    if site is None:
        raise ValueError(
            f"the plan runs the head as {plan.head!r}, but {why}. Plan the head as keep "
            "(remat.plan(..., head='keep'))."
        )
    return HeadRuntime(model, site, parse_head(plan.head))


def apply_(model: nn.Module, plan: Plan, *, batch: Any = None, offload_dir: str | None = None) -> nn.Module:
    """Apply ``plan`` to ``model`` in place and return the same model.

    ``batch`` (optional) is checked against the shapes the plan was profiled with;
    ``offload_dir`` is where ``offload:disk`` blocks write (default: the system temp directory)."""
    return apply_to_copy(model, plan, batch=batch, offload_dir=offload_dir, matched=False)


def apply_to_copy(model: nn.Module, plan: Plan, *, batch: Any = None, offload_dir: str | None = None,
                  matched: bool = True) -> nn.Module:
    """`apply_`; ``matched``: ``model`` is a copy of a model the plan was checked against, whose
    structure the copy may not repeat to the hash (e3nn's compiled graphs, copied, hold their
    constants as buffers of their own), so it is not checked again."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_ needs an nn.Module, got {type(model).__name__}.")
    check_model(model, "remat.apply_")
    if not isinstance(plan, Plan):
        raise TypeError(f"apply_ needs a remat Plan, got {type(plan).__name__}; load one with remat.Plan.load(path).")
    if is_applied(model):
        raise ValueError(
            f"{type(model).__name__} already has a remat plan applied "
            f"({applied_plan(model).strategy_name!r}); call remat.remove_(model) first."
        )
    plan.check()
    _resolve_blocks(model, plan)
    if batch is not None:
        check_batch_device(model, batch)
    if not matched:
        check_plan_matches(model, plan, batch)
    head = _head_runtime(model, plan)
    # every check passed: from here on, change the model, and undo everything if a step fails
    blocks, sites = block_modules(model, plan.block_names)
    try:
        watch = StepWatch(model, plan.fingerprint.batch_shapes, plan.prediction.peak_bytes, plan.budget_bytes,
                          blocks=list(zip(plan.block_names, blocks)))
        options = {"plan": plan, "offload_engines": {}, "cache_off": CacheOff(model), "head_runtime": head,
                   "step_watch": watch, "sites": tuple(sites.values())}
        runtime = Runtime(blocks=blocks, block_names=plan.block_names, segments=plan.segments,
                          handlers=HANDLERS, options=options)
    except BaseException:
        uninstall_sites(sites.values())
        raise
    model.__dict__[RUNTIME_ATTR] = runtime
    try:
        options["offload_engines"] = _offload_engines(plan, offload_dir)
        runtime.install()
        options["cache_off"].install()
        if not plan.fingerprint.shared_cache:  # else the model reads what the blocks write there
            options["cache_off"].drop_in(blocks)
        watch.install()
        if head is not None:
            head.install()
    except BaseException:
        with contextlib.suppress(Exception):  # the error that stopped the apply is the one to raise
            remove_(model)
        raise
    return model


def remove_(model: nn.Module) -> nn.Module:
    """Undo `apply_`: every block's ``forward`` is restored exactly; returns the same model.

    Each step runs even when one before it raised (a block's ``forward`` deleted by hand, an
    offload engine that cannot close): the model always ends with no plan applied, and the first
    error is raised after."""
    runtime = model.__dict__.get(RUNTIME_ATTR)
    if runtime is None:
        wrapped = _wrapped_model(model)
        if wrapped is not None and RUNTIME_ATTR in getattr(model, wrapped).__dict__:
            raise ValueError(f"{type(model).__name__} has no remat plan applied, the model it wraps has: "
                             f"remat.remove_(wrapper.{wrapped}).")
        raise ValueError(f"{type(model).__name__} has no remat plan applied; nothing to remove.")
    head = runtime.options.get("head_runtime")
    steps = [runtime.uninstall, functools.partial(uninstall_sites, runtime.options.get("sites", ())),
             runtime.options["cache_off"].remove]
    if "step_watch" in runtime.options:
        steps.append(runtime.options["step_watch"].remove)
    if head is not None:
        steps.append(head.uninstall)
    steps += [engine.close for engine in runtime.options["offload_engines"].values()]
    errors = []
    for step in steps:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - every step must run; the first error is raised below
            errors.append(exc)
    del model.__dict__[RUNTIME_ATTR]
    if errors:
        raise errors[0]
    return model


@contextlib.contextmanager
def applied(model: nn.Module, plan: Plan, **options: Any):
    """``with applied(model, plan): ...``: apply for the body only."""
    apply_(model, plan, **options)
    try:
        yield model
    finally:
        remove_(model)


def auto_(model: nn.Module, batch: Any, loss_fn: LossFn | None = None,
          optimizer: torch.optim.Optimizer | None = None, budget: str | int = "50%",
          strategy: str = "optimal", *, grad_accumulation: bool = False,
          blocks: str | Sequence[str] | None = None, head_chunks: Sequence[int] | None = None,
          offload_dir: str | None = None) -> Plan:
    """Profile ``model`` on ``batch``, plan the fastest step within ``budget``, apply it; return the plan.

    The budget-driven counterpart of Hugging Face's ``gradient_checkpointing_enable()``: ``budget``
    is bytes, text like ``"6GiB"``, or a share of the measured baseline peak like ``"50%"``.
    The model's weights and the optimizer's state are as they were (profiling restores them).
    The plan may run a language model's head chunked (`remat.plan.types.Plan.head`): its output
    then carries no logits in training. ``grad_accumulation``: several micro-batches per
    optimizer step, so the plan is for a micro-batch whose gradients add to the earlier ones'
    (`remat.profile`'s option; a share of the peak is then of that step's). ``blocks``: which
    modules are blocks, as `remat.profile` takes it (globs or class names; None: found).
    ``head_chunks``: the chunk sizes (tokens) a chunked head is measured at, as `remat.profile`
    takes them (None: its defaults, which need at least 128 tokens in the batch). ``offload_dir``:
    a directory the plan may offload saved activations to (its disk measured by the profile;
    the plan applied with it)."""
    from remat.measure.profile import profile as measure
    from remat.plan.budget import parse_budget
    from remat.plan.planners import plan as make_plan

    if is_applied(model):
        raise ValueError(f"{type(model).__name__} already has a remat plan applied; call remat.remove_(model) first.")
    prof = measure(model, batch, loss_fn=loss_fn, optimizer=optimizer, grad_accumulation=grad_accumulation, blocks=blocks,
                   head_chunks=head_chunks, offload_dir=offload_dir)
    the_plan = make_plan(prof, budget=parse_budget(budget, prof.peak_bytes), strategy=strategy)
    apply_(model, the_plan, batch=batch, offload_dir=offload_dir)
    return the_plan
