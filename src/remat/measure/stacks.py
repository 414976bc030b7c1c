"""Stacks: the chains of blocks a model runs, found by running its forward once.

`remat.measure.blocks` finds, from the module tree alone, every stack (a list of two or more
same-class modules with parameters) that no other stack contains. The tree cannot say in which
order the blocks run (CLIP runs its vision tower before its text tower, which it registers
first) nor whether a stack nested inside another stack's members is a chain of its own (the
blocks of each stage of a Swin or ConvNeXt model) or something else (a list of experts, each
called on some tokens). So `discover` runs the forward once (as in training, without a backward:
a model may refuse inputs without a history) with a hook on every member of every stack, nested
ones included, and

- descends into nested stacks when each of them runs as a chain (every member once, in order,
  each one's chained input what the one before handed on: `remat.measure.calls`), else keeps the
  outer stack; a list of plain lists (Funnel's encoder: a ``ModuleList`` of ``ModuleList``s of
  layers, which never run as modules) gives the layers of all of them (`flattened`); a stack
  whose members do not each run exactly once is left out, with a warning that names it when
  other stacks are found, and an error when none is (named blocks must: an error says which did
  not; a module called several times per forward, a layer shared across depths, cannot be a
  block, and the error says so);
- adds the layers beside the stacks chosen (`_beside`: in a member remat descended from, every
  layer outside the nested stacks; in a stack's module, the layers run between its members),
  each to the run of blocks it sits in, with a second forward that sees them run;
- numbers the blocks in the order they first run;
- cuts the blocks into `Stack` records, maximal runs of consecutive blocks of one list, and
  says for each block whether it follows the block before it (`remat.measure.calls.follows`,
  within one stack), which is what a multi-block checkpointed segment needs.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from remat.checkpointing.callsites import Sites, install, site_name
from remat.measure.blocks import (Blocks, attribute_stacks, candidate_lists, single_stages, leaf_sequences, flattened, has_parameters, inside, members, named_blocks,
                                  mixed_stacks, no_stack_error, outermost, stack_lists)
from remat.measure.calls import follows
from remat.measure.state import host_rng_restored
from remat.measure.types import Stack

__all__ = ["Discovery", "discover", "parent_name"]


@dataclass(kw_only=True, frozen=True)
class Discovery:
    """The blocks in run order, their stacks, and which blocks follow the one before them."""

    blocks: Blocks
    """``(qualified name, module)`` in the order they first run."""
    stacks: tuple[Stack, ...]
    """Runs of consecutive blocks (in run order) from one list."""
    follows_previous: tuple[bool, ...]
    """Per block: it follows the block before it in the same stack (False for a stack's first)."""
    sites: tuple[Sites, ...] = ()
    """Call sites installed for blocks that are calls of a layer run several times
    (`remat.checkpointing.callsites`), to uninstall when the profile is done."""


@dataclass
class _Call:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any = None
    grad: bool = True
    """Gradients were enabled when the call began (False: under ``torch.no_grad()``, a frozen
    backbone's)."""
    direct: bool = False
    """The parent called ``module.forward(...)`` itself (SqueezeBERT's encoder), past the module's
    hooks: seen by `_Trace`'s ``direct`` watch only."""
    checkpointed: str = ""
    """Where the model's own code ran the call inside ``torch.utils.checkpoint`` (`_own_checkpoint`):
    that code's file and line; "" otherwise."""


class _Trace:
    """Forward hooks on modules: each module's calls, in the order they began; with ``direct``,
    also the calls of those modules' ``forward`` made past their hooks (`_DirectWatch`)."""

    def __init__(self, modules: Blocks, direct: Sequence[str] = ()) -> None:
        self.modules = modules
        self.calls: dict[str, list[_Call]] = {name: [] for name, _ in modules}
        self.order: list[str] = []
        self.direct = set(direct)
        self._entered: set[str] = set()

    def run(self, forward: Callable[[], Any]) -> _Trace:
        handles, watches = [], []
        try:
            for name, module in self.modules:
                handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
                handles.append(module.register_forward_hook(self._post(name)))
                if name in self.direct:
                    watches.append(_DirectWatch(self, name, module))
            forward()
        finally:
            for handle in handles:
                handle.remove()
            for watch in watches:
                watch.remove()
        return self

    def directly_called(self) -> list[str]:
        """The modules the forward called, with gradients, through ``module.forward(...)`` only."""
        return [name for name, calls in self.calls.items() if any(c.direct and c.grad for c in calls)]

    def _pre(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.calls[name].append(_Call(args=args, kwargs=dict(kwargs), grad=torch.is_grad_enabled(),
                                          checkpointed=_own_checkpoint()))
            self.order.append(name)
            if name in self.direct:
                self._entered.add(name)

        return hook

    def _post(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self.calls[name][-1].output = output

        return hook

    def once_each(self, names: Sequence[str]) -> bool:
        return all(len(self.calls[n]) == 1 for n in names)

    def runs_as_chain(self, names: Sequence[str]) -> bool:
        """Every member ran once, in list order, each following the one before."""
        if not self.once_each(names):
            return False
        firsts = [self.order.index(n) for n in names]
        if firsts != sorted(firsts):
            return False
        return all(_follows(self.calls[a][0], self.calls[b][0]) for a, b in zip(names, names[1:]))


class _DirectWatch:
    """A module's ``forward`` instance attribute while `_Trace` watches it: a call that did not
    come through the module's hooks (the parent calls ``module.forward(...)``) is recorded as a
    call, ``direct``; the module's own forward runs either way. `remove` restores the attribute."""

    def __init__(self, trace: _Trace, name: str, module: nn.Module) -> None:
        self.trace, self.name, self.module = trace, name, module
        self.saved = module.__dict__.get("forward")
        self.inner = module.forward
        module.forward = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        trace, name = self.trace, self.name
        if name in trace._entered:  # through the module's call: its pre-hook recorded it
            trace._entered.discard(name)
            return self.inner(*args, **kwargs)
        call = _Call(args=args, kwargs=dict(kwargs), grad=torch.is_grad_enabled(), direct=True,
                     checkpointed=_own_checkpoint())
        trace.calls[name].append(call)
        trace.order.append(name)
        call.output = self.inner(*args, **kwargs)
        return call.output

    def remove(self) -> None:
        if self.module.__dict__.get("forward") is self:
            del self.module.__dict__["forward"]
            if self.saved is not None:
                self.module.forward = self.saved


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_REMAT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_CHECKPOINT_FILE = os.path.splitext(torch.utils.checkpoint.__file__)[0] + ".py"


def _own_checkpoint() -> str:
    """Where the code that runs this call put it inside ``torch.utils.checkpoint`` (``checkpoint``,
    ``checkpoint_sequential``, reentrant or not) itself, as ``"file:line"`` of that call, or "":
    no such frame on the stack, or only remat's own."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename != _CHECKPOINT_FILE or frame.f_code.co_name != "checkpoint":
            frame = frame.f_back  # (checkpoint_sequential runs its last segment outside a checkpoint)
            continue
        caller = frame.f_back  # the first frame outside torch called the checkpoint
        while caller is not None and caller.f_code.co_filename.startswith(_TORCH_DIR):
            caller = caller.f_back
        if caller is None:
            return ""
        if not caller.f_code.co_filename.startswith(_REMAT_DIR):
            return f"{caller.f_code.co_filename}:{caller.f_lineno}"
        frame = caller.f_back
    return ""


def _check_not_checkpointed(model: nn.Module, trace: _Trace) -> None:
    """Refuse a model whose own forward runs the modules traced inside ``torch.utils.checkpoint``:
    they already recompute (reentrant, they even run without gradients in the forward), so remat
    would measure checkpointed blocks and a plan would checkpoint them twice."""
    inside = {name: calls[0].checkpointed for name, calls in trace.calls.items() if calls and calls[0].checkpointed}
    if not inside:
        return
    names = list(inside)
    where = sorted(set(inside.values()))
    raise ValueError(
        f"{type(model).__name__}'s forward runs {', '.join(names[:4])}{' ...' if len(names) > 4 else ''} inside "
        f"torch.utils.checkpoint itself ({', '.join(where[:2])}{' ...' if len(where) > 2 else ''}), so they already "
        "recompute: remat would measure checkpointed blocks (nothing saved in them) and a plan would checkpoint them "
        "twice. Turn the model's own checkpointing off (its flag, or call the blocks without checkpoint(...)) while "
        "remat profiles and applies: a remat plan replaces it.")


def _follows(previous: _Call, call: _Call) -> bool:
    return follows((previous.args, previous.kwargs, previous.output), (call.args, call.kwargs))


def discover(model: nn.Module, blocks: str | Sequence[str] | None, forward: Callable[[], Any]) -> Discovery:
    """The blocks of ``model`` (detected, or named by ``blocks``) in run order, with their stacks.
    ``forward()`` runs the model's forward on its batch (once; no backward)."""
    if blocks is not None:
        chosen = named_blocks(model, blocks)
        trace = _with_direct_calls(_Trace(chosen).run(forward), forward)
        _check_not_checkpointed(model, trace)
        if any(not trace.calls[name] for name, _ in chosen):
            _check_ran_once(trace, chosen, model)  # a block the forward never ran: refused, named
        repeated = _repeated_with_grad(trace, [name for name, _ in chosen])
        repeated += [name for name in trace.directly_called() if name not in repeated]
        if repeated:  # each call of a layer that runs several times (or past its hooks) a block of its own
            return _call_sites(model, trace, chosen, repeated)
        _check_ran_once(trace, chosen, model)
        groups = [(parent_name(name), [(name, module)]) for name, module in chosen]
        groups = _without_no_grad(model, groups, trace)
        if not groups:
            raise ValueError(f"every block named by blocks={blocks!r} runs with gradients disabled ({_GRAD_OFF}): "
                             "there is nothing to recompute; name blocks that train.")
    else:
        lists = (stack_lists(model) or mixed_stacks(model) or attribute_stacks(model) or single_stages(model)
                 or leaf_sequences(model))
        every = [m for name in lists for m in members(model, name) + flattened(model, name)]
        siblings = [item for parent in dict.fromkeys(parent_name(n) for n in lists)
                    for item in _children_with_parameters(model, parent, lists)]  # for `_beside`
        trace = _with_direct_calls(_Trace(list(dict(every + siblings).items())).run(forward), forward,
                                   [m for m, _ in every])
        _check_not_checkpointed(model, trace)
        groups, left_out = _chosen_lists(model, lists, trace)
        if not groups and lists:
            found = _repeated_layers(model, forward, [m for m, _ in every])
            if found is not None:
                return found
            counts = {m: len(trace.calls[m]) for m, _ in every if len(trace.calls[m]) != 1}
            hint = _repeated_hint(counts, trace)
            raise ValueError(
                f"no blocks found in {type(model).__name__}: its stacks {lists} do not run each member exactly "
                f"once per step" + (f".{hint}" if hint else f" (calls: {counts}).") + " Name the blocks that run "
                "once with blocks='<glob>'" + (" (modules outside those that repeat), if the model has any." if hint else ".")
                + _never_called_hint(counts) + _traced_hint(model, counts)
            )
        if not groups:
            found = _repeated_layers(model, forward)
            if found is not None:
                return found
            error = _repeated_error(model, forward) or no_stack_error(model)
            raise ValueError(str(error) + _traced_hint(model)) if _traced_hint(model) else error
        members_trace = trace  # every member of every list hooked (`_beside` may trace its layers alone)
        groups, trace = _beside(model, lists, groups, forward, trace)
        groups = _without_no_grad(model, groups, trace)
        if not groups:
            raise ValueError(f"no blocks found in {type(model).__name__}: every stack runs with gradients disabled "
                             f"({_GRAD_OFF}), so there is nothing to recompute.")
        if left_out:
            found, left_out = _with_repeated_stacks(model, forward, groups, left_out, members_trace)
            if left_out:
                warnings.warn(_left_out_message(model, left_out, trace), UserWarning, stacklevel=3)
            if found is not None:
                return found
    direct = [name for name in trace.directly_called() if any(name == n for _, items in groups for n, _ in items)]
    if direct:  # called as ``layer.forward(...)``: through a call site, which the parent's call reaches
        return _call_sites(model, trace, [item for _, items in groups for item in items], direct,
                           {name: group for group, items in groups for name, _ in items})
    return _in_run_order(groups, trace)


def _with_direct_calls(trace: _Trace, forward: Callable[[], Any], names: Sequence[str] | None = None) -> _Trace:
    """``trace``, or where some of ``names`` (every module traced by default) never ran as modules, a
    trace of the same modules that also sees the calls of their ``forward`` made directly
    (SqueezeBERT's encoder calls ``layer.forward(...)``, past every module hook): such a layer is a
    block through a call site (`remat.checkpointing.callsites`), which its ``forward`` hands the
    call to, hooks and all."""
    never = [name for name in (names if names is not None else list(trace.calls)) if not trace.calls.get(name)]
    if not never:
        return trace
    # a forward more leaves the random draws of the steps after it as they were (VITS's durations
    # set its shapes: its predictions rose 26 %)
    devices = range(torch.cuda.device_count()) if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), host_rng_restored([]):
        again = _Trace(trace.modules, direct=never).run(forward)
    return again if again.directly_called() else trace


def _with_repeated_stacks(model: nn.Module, forward: Callable[[], Any], groups: list[tuple[str, Blocks]],
                          left_out: list[str], trace: _Trace) -> tuple[Discovery | None, list[str]]:
    """Blocks found, with the calls of the members of the ``left_out`` stacks that run several
    times, each call with gradients a block (a looped model's core layers between a prelude and a
    coda that run once), and the stacks still left out; ``(None, left_out)`` when no left-out
    stack is such."""
    chosen = [item for _, items in groups for item in items]
    taken = [name for name, _ in chosen]
    group_of = {name: group for group, items in groups for name, _ in items}
    added: list[tuple[str, nn.Module]] = []
    repeated: list[str] = []
    still: list[str] = []
    for stack in left_out:
        items = [(m, module) for m, module in members(model, stack) + flattened(model, stack)
                 if not any(inside(m, t) or inside(t, m) for t in taken)]
        calls = {m: trace.calls.get(m, []) for m, _ in items}
        if not any(len(c) > 1 for c in calls.values()) or not any(call.grad for c in calls.values() for call in c):
            still.append(stack)
            continue
        for m, module in items:
            if any(call.grad for call in calls[m]):
                added.append((m, module))
                group_of[m] = stack
                if len(calls[m]) > 1:
                    repeated.append(m)
    if not repeated:
        return None, left_out
    everything = chosen + added
    return _call_sites(model, _Trace(everything).run(forward), everything, repeated, group_of), still


_GRAD_OFF = ("under torch.no_grad(), a frozen part of the model, or inside a custom torch.autograd.Function's forward, "
             "as reversible layers run (Reformer's, RevNet's), which recompute their activations in the backward already")
"""Where a stack runs with gradients disabled: what the messages of `discover` say."""


def _without_no_grad(model: nn.Module, groups: list[tuple[str, Blocks]], trace: _Trace) -> list[tuple[str, Blocks]]:
    """``groups`` less the blocks the forward ran with gradients disabled (CLIPSeg runs its CLIP
    towers under ``torch.no_grad()``): they save nothing and have no backward, so there is
    nothing to recompute, and counted as blocks they made the prediction of the blocks after
    them 7-9 % low. They stay in the fixed part, named in a warning."""
    dropped = [name for _, items in groups for name, _ in items if not all(c.grad for c in trace.calls[name])]
    if not dropped:
        return groups
    warnings.warn(f"remat leaves out of the blocks of {type(model).__name__} those its forward runs with gradients "
                  f"disabled (torch.no_grad(): a frozen part), which have nothing to recompute: {', '.join(dropped)}.",
                  UserWarning, stacklevel=4)
    kept = [(group, [item for item in items if item[0] not in dropped]) for group, items in groups]
    return [(group, items) for group, items in kept if items]


def _repeated_hint(counts: dict[str, int], trace: _Trace | None = None, counted: bool = True) -> str:
    """A sentence for modules that ran more than once per step (a layer whose weights are shared
    across depths, ALBERT's; a model called once per input; a reference pass under no_grad), or ""
    when none did: naming them as blocks cannot help. ``counted``: the counts are part of it."""
    repeated = {name: n for name, n in counts.items() if n > 1}
    if not repeated:
        return ""
    text = f" Calls per step: {repeated}." if counted else ""
    off = {name: sum(not c.grad for c in trace.calls[name]) for name in repeated} if trace is not None else {}
    if any(off.values()):
        text += (f" Of these, {max(off.values())} per module ran with gradients disabled (a reference pass under "
                 "torch.no_grad(), as DPO does with the adapters off): such calls save nothing and are no blocks.")
    if any(n > 1 for n in repeated.values()):
        text += (" A module called more than once shares its weights across the calls (across depths: ALBERT's layer "
                 "groups; across inputs; across chunks of one input): each of its calls with gradients is a block of "
                 "its own (named 'layer@i'), planned as any other.")
    return text


def _repeated_with_grad(trace: _Trace, names: Sequence[str]) -> list[str]:
    """Of ``names``, the modules called more than once, one call with gradients at least, when
    every other ran once ([] otherwise: the errors of `_check_ran_once` apply)."""
    counts = {name: len(trace.calls[name]) for name in names}
    repeated = [name for name in names if counts[name] > 1]
    if not repeated or any(counts[name] == 0 for name in names):
        return []
    if not all(_with_grad(trace, name) for name in repeated):
        return []
    return repeated


def _with_grad(trace: _Trace, name: str) -> bool:
    return any(call.grad for call in trace.calls[name])


def _repeated_layers(model: nn.Module, forward: Callable[[], Any], members: Sequence[str] = ()) -> Discovery | None:
    """Where no stack runs as one: the outermost modules with parameters that the forward calls
    several times (ALBERT's layer group at every depth, a Universal Transformer's layer, a
    recurrent cell over time steps), each call with gradients a block
    (`remat.checkpointing.callsites`; a call under ``torch.no_grad()`` saves nothing), with the
    ``members`` of the stacks found that run once, with gradients, apart from those (a layer run
    once beside one run twice); None when no module repeats so."""
    modules = [(name, m) for name, m in model.named_modules() if name and has_parameters(m)]
    trace = _Trace(modules).run(forward)
    several = [name for name, calls in trace.calls.items() if len(calls) > 1]
    repeated = [name for name in several if _with_grad(trace, name) and not any(inside(name, other) for other in several)]
    repeated = [inner for name in repeated for inner in _repeated_members(model, name, trace)]
    if not repeated:
        return None
    once = [name for name in members if name in trace.calls and len(trace.calls[name]) == 1 and trace.calls[name][0].grad
            and not any(inside(name, other) or inside(other, name) for other in several)]
    chosen = [(name, model.get_submodule(name)) for name in repeated + once]
    return _call_sites(model, trace, chosen, repeated)


def _repeated_members(model: nn.Module, name: str, trace: _Trace) -> list[str]:
    """The layers whose calls are blocks for module ``name``, which runs several times: the
    members of the list of two or more layers with parameters inside it that hold most of its
    parameters and run once per call of it, with gradients where it has them (HRM's reasoning
    module, called twice, runs its 16 layers at each call: 32 blocks rather than 2), or ``[name]``."""
    module = model.get_submodule(name)
    total = sum(p.numel() for p in module.parameters())
    for inner, child in module.named_modules():
        if not inner or not isinstance(child, (nn.ModuleList, nn.Sequential)):
            continue
        items = [(f"{name}.{inner}.{k}", m) for k, m in child.named_children() if has_parameters(m)]
        if len(items) < 2 or not all(n in trace.calls for n, _ in items):
            continue
        grads = [c.grad for c in trace.calls[name]]
        if (all([c.grad for c in trace.calls[n]] == grads for n, _ in items)
                and 2 * sum(p.numel() for _, m in items for p in m.parameters()) > total):
            return [n for n, _ in items]
    return [name]


def _call_sites(model: nn.Module, trace: _Trace, chosen: Blocks, repeated: list[str],
                group_of: dict[str, str] | None = None) -> Discovery:
    """The blocks of ``chosen`` in run order, each call of a ``repeated`` module a block named
    ``name@i`` (its call site installed: `remat.checkpointing.callsites.install`; a call without
    gradients is counted, its site made, but no block: it saves nothing); a stack per list
    the modules sit in (``group_of``'s, else the list they sit in, else a layer's own name), the
    blocks of a stack that run one after the other in it, each following the call before when it
    takes that call's output."""
    installed = install(model, {name: len(trace.calls[name]) for name in repeated})
    modules = dict(chosen)
    seen: dict[str, int] = {}
    order: list[tuple[str, str, int]] = []  # (block name, module name, call index)
    for name in trace.order:
        if name not in modules:
            continue
        index = seen.get(name, 0)
        seen[name] = index + 1
        if trace.calls[name][index].grad:
            order.append((site_name(name, index) if name in installed else name, name, index))
    blocks = [(block, installed[name].sites[index] if name in installed else modules[name]) for block, name, index in order]
    stacks: list[Stack] = []
    chained: list[bool] = []
    for position, (block, name, index) in enumerate(order):
        parent = parent_name(name)
        group = (group_of or {}).get(name) or (
            parent if parent and isinstance(model.get_submodule(parent), (nn.ModuleList, nn.Sequential)) else name)
        if stacks and stacks[-1].name == group:
            stacks[-1] = Stack(name=group, start=stacks[-1].start, stop=position + 1, class_name=stacks[-1].class_name)
            _, previous, previous_index = order[position - 1]
            chained.append(_follows(trace.calls[previous][previous_index], trace.calls[name][index]))
        else:
            stacks.append(Stack(name=group, start=position, stop=position + 1, class_name=type(modules[name]).__name__))
            chained.append(False)
    return Discovery(blocks=blocks, stacks=tuple(stacks), follows_previous=tuple(chained),
                     sites=tuple(installed.values()))


def _repeated_error(model: nn.Module, forward: Callable[[], Any]) -> ValueError | None:
    """Without a stack or a repeated layer with gradients (`_repeated_layers`): the error for a
    model whose listed modules run several times per forward, every call without gradients, or
    None."""
    single = [(f"{name}.{child}" if name else child, m) for name, _, _ in candidate_lists(model)
              for child, m in model.get_submodule(name).named_children() if has_parameters(m)]
    if not single:
        return None
    trace = _Trace(single).run(forward)
    counts = {name: len(trace.calls[name]) for name, _ in single if len(trace.calls[name]) > 1}
    if not counts:
        return None
    return ValueError(f"no blocks found in {type(model).__name__}: its only layers repeat." + _repeated_hint(counts, trace)
                      + f" Every call ran with gradients disabled ({_GRAD_OFF}), so there is nothing to recompute: the "
                      "model trains as it is without a plan.")


def _left_out_message(model: nn.Module, left_out: list[str], trace: _Trace) -> str:
    details, runs = [], []
    for name in left_out:
        calls = {m: len(trace.calls[m]) for m, _ in members(model, name) + flattened(model, name) if m in trace.calls}
        if not any(calls.values()):  # read for their weights only (SAM's point embeddings): not layers that run
            details.append(f"{name} (its members are never called: the model reads their weights, nothing to plan)")
            continue
        details.append(f"{name} (calls per member: {calls})")
        runs.append(name)
    advice = "" if not runs else (
        " To plan them, name the modules that run once with blocks='<glob>' (e.g. "
        f"blocks=['{runs[0]}.*', ...] with the stacks found) or blocks='<ClassName>'.")
    return (f"remat found blocks in {type(model).__name__} but left out the stacks {'; '.join(details)}: their "
            "members do not each run exactly once per forward, so they stay in the fixed part and are never "
            f"recomputed.{advice}")


def parent_name(name: str) -> str:
    """The qualified name of the module that holds ``name`` ("" for the root)."""
    return name.rpartition(".")[0]


def _check_ran_once(trace: _Trace, chosen: Blocks, model: nn.Module) -> None:
    wrong = {name: len(trace.calls[name]) for name, _ in chosen if len(trace.calls[name]) != 1}
    if wrong:
        raise ValueError(
            f"blocks must run exactly once per step; these ran another number of times: {wrong}. "
            "remat plans each block's activations once per step: name blocks that the step calls once."
            + _repeated_hint(wrong, trace, counted=False)
            + _never_called_hint(wrong) + _traced_hint(model, wrong)
        )


def _traced_hint(model: nn.Module, counts: dict[str, int] | None = None) -> str:
    """A sentence for a ``torch.fx.GraphModule`` ("" otherwise, or when ``counts`` has no layer the
    forward never called): symbolic tracing inlines the forward of every module that is not a leaf
    (torch's own layers are), so the graph calls the layers' parts, never the layers, and keeps
    them as plain ``Module``s that only hold those parts."""
    if not isinstance(model, torch.fx.GraphModule) or (counts is not None and not any(n == 0 for n in counts.values())):
        return ""
    return (f" {type(model).__name__} is a torch.fx GraphModule: tracing inlined the forward of every layer that is "
            "not one of torch's own into its graph, which calls their parts instead. Profile the model before "
            "tracing, or trace it with your layers kept as leaf modules (a torch.fx.Tracer whose is_leaf_module "
            "returns True for their class): the graph then calls each layer, and remat plans them.")


def _never_called_hint(counts: dict[str, int]) -> str:
    """A sentence for modules the forward never ran ("" when none): as modules or through a direct
    ``module.forward(...)`` (which `_with_direct_calls` sees), so it skips them."""
    never = [name for name, n in counts.items() if n == 0]
    if not never:
        return ""
    return (f" 0 calls ({', '.join(never[:4])}{', ...' if len(never) > 4 else ''}): the forward never ran them, "
            "neither as modules nor through `module.forward(...)`: it skips them (layers dropped at this depth, or "
            "in this mode); name the blocks that run instead.")


def _chosen_lists(model: nn.Module, lists: list[str], trace: _Trace) -> tuple[list[tuple[str, Blocks]], list[str]]:
    """Outermost stacks, replaced by the stacks nested in their members when all of those run as
    chains (recursively), with their blocks; a list of plain lists gives the layers of all of
    them (`flattened`); stacks whose members do not run once each are left out (the second list)."""
    out: list[tuple[str, Blocks]] = []
    left_out: list[str] = []
    pending = list(reversed(outermost(lists)))  # depth first, in list order (a loop: a recursive closure
    while pending:  # is a reference cycle that kept the trace, and the forward's whole graph, alive)
        name = pending.pop()
        nested = outermost([n for n in lists if inside(n, name)])
        own, flat = members(model, name), flattened(model, name)
        if flat and trace.once_each([m for m, _ in flat]):  # plain lists: every layer in them, in one stack
            out.append((name, flat))
        elif nested and all(trace.runs_as_chain([m for m, _ in members(model, n)]) for n in nested) and (
                not trace.once_each([m for m, _ in own]) or covered(own, nested) and mostly_nested(own, nested)):
            pending.extend(reversed(nested))
        elif trace.once_each([m for m, _ in own]):
            out.append((name, own))
        else:
            left_out.append(name)
    return out, left_out


def _beside(model: nn.Module, lists: list[str], groups: list[tuple[str, Blocks]], forward: Callable[[], Any],
            trace: _Trace) -> tuple[list[tuple[str, Blocks]], _Trace]:
    """``groups`` with the layers beside the stacks chosen, each a block of the run of stack
    blocks it sits in, and a trace that saw them all run: in the module that holds a stack, the
    layers run between two of its members (a U-Net mid block's attention between its ResNet
    units; ``trace`` saw the stacks' siblings); in a member of an outer stack remat descended
    from, every layer outside the nested stacks (a VAE decoder stage's upsampler, a U-Net
    stage's ResNet unit and downsampler beside its attention's transformer blocks, the
    attention's norm and projections, Swin's patch merging), and so in a layer between two
    members that holds blocks of its own (a mid block's attention around its transformer
    blocks), for which the forward runs once more with them hooked. A layer is a module with
    parameters, not a plain list (whose members are the layers), that runs exactly once per
    forward with gradients (else it stays in the fixed part, as before). Left out, an upsampler's convolution at twice the resolution, a VAE
    decoder's largest layer output, was never recomputed. Layers before or after a stack in a
    module of no outer stack (embeddings, a final norm, a head) stay in the fixed part."""
    chosen = [name for _, items in groups for name, _ in items]
    taken = set(chosen)
    out = list(groups)
    holders: list[str] = []  # layers between two members that hold blocks of their own: walked below
    for group in dict.fromkeys(g for g, _ in groups if g in lists):  # between two members of a stack
        runs = [trace.order.index(n) for n, _ in members(model, group) if trace.calls.get(n)]
        for name, module in _children_with_parameters(model, parent_name(group), lists):
            calls = trace.calls.get(name, [])
            if name in taken or len(calls) != 1 or not calls[0].grad:
                continue
            if runs and min(runs) < trace.order.index(name) < max(runs):
                if any(inside(c, name) for c in chosen):
                    holders.append(name)  # a mid block's attention around its transformer blocks
                    continue
                taken.add(name)
                out.append((group, [(name, module)]))
    descended = [m for name in lists for m, _ in members(model, name)
                 if m not in taken and any(inside(c, m) for c in chosen)] + holders
    scopes = {name: member for member in descended for name, _ in _uncovered(model, member, taken)}
    if not scopes:
        return out, trace
    blocks = [name for _, items in out for name, _ in items]
    trace = _Trace([(name, model.get_submodule(name)) for name in blocks + list(scopes)], direct=trace.direct).run(forward)
    group_of = {name: group for group, items in out for name, _ in items}
    first = {name: i for i, name in reversed(list(enumerate(trace.order)))}
    in_order = sorted((n for n in chosen if n in first), key=first.__getitem__)
    for name, scope in scopes.items():
        calls = trace.calls[name]
        near = [n for n in in_order if inside(n, scope)]
        if len(calls) != 1 or not calls[0].grad or not near:
            continue
        before = [n for n in near if first[n] < first[name]]
        out.append((group_of[before[-1] if before else near[0]], [(name, model.get_submodule(name))]))
    return out, trace


def _uncovered(model: nn.Module, member: str, chosen: set[str]) -> Blocks:
    """The layers of ``member`` outside the blocks ``chosen``: its children with parameters that
    hold no block, those holding one walked in turn (plain lists: their members)."""
    out: Blocks = []
    for child, module in model.get_submodule(member).named_children():
        name = f"{member}.{child}"
        if name in chosen or not has_parameters(module):
            continue
        if any(inside(c, name) for c in chosen) or type(module) in (nn.ModuleList, nn.ModuleDict):
            out += _uncovered(model, name, chosen)
        else:
            out.append((name, module))
    return out


def _children_with_parameters(model: nn.Module, parent: str, lists: list[str]) -> Blocks:
    """The children of module ``parent`` that hold parameters and are no stack, the members of
    those that are plain lists (a U-Net block's one upsampler in its ``upsamplers`` list)."""
    out: Blocks = []
    for child, module in model.get_submodule(parent).named_children():
        qualified = f"{parent}.{child}" if parent else child
        if qualified in lists or not has_parameters(module):
            continue
        if type(module) in (nn.ModuleList, nn.ModuleDict):
            out += [(f"{qualified}.{n}", m) for n, m in module.named_children() if has_parameters(m)]
        else:
            out.append((qualified, module))
    return out


def mostly_nested(own: Blocks, nested: list[str]) -> bool:
    """In every member of a stack, the ``nested`` stacks hold at least half of its parameters:
    descending into them makes blocks of the member's main layers (Swin's and a VAE's stages),
    where a nested list of small layers (FocalNet's two depthwise focal convolutions beside its
    projections and MLP) would cut each member into many blocks and leave the member's own code
    between them (least feasible peak 15 % above the members' as blocks)."""
    for name, module in own:
        inner = {id(p): p.numel() for n in nested if inside(n, name)
                 for p in module.get_submodule(n[len(name) + 1:]).parameters()}
        total = {id(p): p.numel() for p in module.parameters()}
        if 2 * sum(inner.values()) < sum(total.values()):
            return False
    return True


def covered(own: Blocks, nested: list[str]) -> bool:
    """Every member of a stack holds one of the ``nested`` stacks: descending into them leaves no
    member's layers out (a ConvNeXt stage of one layer holds no stack; with the outer stages as
    the blocks, its layer is planned too)."""
    return all(any(inside(n, name) for n in nested) for name, _ in own)


def _in_run_order(groups: list[tuple[str, Blocks]], trace: _Trace) -> Discovery:
    """Blocks by first call; stacks as runs of consecutive blocks of one group."""
    group_of = {name: group for group, items in groups for name, _ in items}
    order = {name: i for i, name in reversed(list(enumerate(trace.order)))}
    blocks = sorted((item for _, items in groups for item in items), key=lambda item: order[item[0]])
    stacks: list[Stack] = []
    chained: list[bool] = []
    for index, (name, _) in enumerate(blocks):
        group = group_of[name]
        same = bool(stacks) and stacks[-1].name == group and stacks[-1].stop == index
        if same:
            stacks[-1] = Stack(name=group, start=stacks[-1].start, stop=index + 1, class_name=stacks[-1].class_name)
            chained.append(_follows(trace.calls[blocks[index - 1][0]][0], trace.calls[name][0]))
        else:
            stacks.append(Stack(name=group, start=index, stop=index + 1, class_name=type(blocks[index][1]).__name__))
            chained.append(False)
    return Discovery(blocks=blocks, stacks=tuple(stacks), follows_previous=tuple(chained))
