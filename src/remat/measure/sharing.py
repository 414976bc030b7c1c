"""Blocks that are the same computation share their timing probes.

A transformer's layers, a deep MLP's blocks: every one of them runs the same ops on tensors of
the same shapes, so timing each of them alone (`remat.measure.overhead`) and timing each one's
ops (`remat.measure.profile`'s op-timing forwards) measures the same thing N times, which made
a profile cost 15 to 220 training steps. Here the blocks are put into groups; the first block of
a group (in run order) is its *representative*, the only one whose timing probes run, and the
others take its figures.

Two blocks fall into one group when both of these match:

- *structure* (`structure_key`, read off the module and the arguments of its first call): the
  class, every submodule's qualified name, class, ``extra_repr`` (a dropout's ``p``, a norm's
  ``eps``) and training mode, every parameter's and buffer's name, shape, dtype and
  ``requires_grad``, and the shape, dtype and ``requires_grad`` of each tensor argument (other
  arguments by value), keyed by where they were passed. Other attributes do not enter: a
  Hugging Face layer keeps its own index (``layer_idx``), and what an attribute changes in the
  computation (a dropout probability read from a config) the trace sees;
- *trace* (`trace_key`, from the accounting step, which still traces every block): the op calls
  of its forward (op, the shapes and dtypes of their tensor arguments and the values of the
  others, such as a dropout's ``p``; output, saved and storage bytes, FLOPs, the random, view and
  written-later flags), its input and output bytes and the role of each of its inputs in
  the dataflow: its own (handed on by the block before it, the code between or before the
  blocks: the chain), a skip from k blocks back, or shared with other blocks (a mask). What
  happens to its outputs after it (which later code reads them, whether the next block follows
  it in a segment) is the model's around it, not its computation, and does not enter; nor does
  its saved-bytes total beyond its ops' own (a tensor several blocks save, Llama's rotary
  tables, counts for the first of them). This is
  the soundness check of the sharing: a block alike in
  structure whose trace differs (a branch its forward takes on the data, an op run with other
  arguments) is measured apart, and `BlockGroups.split` names it.

Only timing is shared (probes' milliseconds, op times' shares). Every byte figure of every block
comes from the accounting step, as without sharing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.measure.blocks import Blocks

__all__ = ["BlockGroups", "CallSignatures", "args_signature", "group_blocks", "input_role", "stop_after",
           "structure_key", "trace_key", "without_grad_flags"]

_PLAIN = (bool, int, float, str, type(None))


def args_signature(args: Any, kwargs: Any = None) -> tuple[Any, ...]:
    """``args`` and ``kwargs`` with each tensor as its shape, dtype, ``requires_grad`` and device
    type, tuples, lists and dicts walked, numbers, strings, dtypes and devices as they are, and
    anything else as its class name (hashable; called on every op of the accounting step)."""
    return (_signature(args), _signature(kwargs or {}))


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.requires_grad, value.device.type)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *(_signature(v) for v in value))
    if isinstance(value, dict):
        return ("dict", *((k, _signature(v)) for k, v in value.items()))
    if isinstance(value, (*_PLAIN, torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return value
    return type(value).__qualname__


class CallSignatures:
    """Context manager: forward pre-hooks on the blocks that keep `args_signature` of each one's
    first call (``signatures[i]``; None for a block that did not run)."""

    def __init__(self, block_list: Blocks) -> None:
        self.block_list = block_list
        self.signatures: list[tuple[Any, ...] | None] = [None] * len(block_list)
        self._handles: list[Any] = []

    def __enter__(self) -> CallSignatures:
        for i, (_, module) in enumerate(self.block_list):
            self._handles.append(module.register_forward_pre_hook(self._hook(i), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self.signatures[index] is None:
                self.signatures[index] = args_signature(args, kwargs)

        return hook


def structure_key(module: nn.Module, call: tuple[Any, ...] | None) -> tuple[Any, ...]:
    """What must match for two blocks to be the same computation, from the module and
    ``call``, `args_signature` of its first call (module docstring)."""
    return (
        type(module).__qualname__, module.training, call,
        tuple((name, type(m).__qualname__, m.extra_repr(), m.training) for name, m in module.named_modules()),
        tuple((name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in module.named_parameters()),
        tuple((name, tuple(b.shape), str(b.dtype)) for name, b in module.named_buffers()),
    )


def without_grad_flags(call: Any) -> Any:
    """`args_signature` ``call`` with every tensor's ``requires_grad`` set False."""
    if isinstance(call, tuple) and len(call) == 4 and isinstance(call[0], tuple) and isinstance(call[2], bool) \
            and isinstance(call[1], torch.dtype):
        return (call[0], call[1], False, call[3])
    if isinstance(call, tuple):
        return tuple(without_grad_flags(v) for v in call)
    return call


def trace_key(index: int, *, ops: Sequence[Any], call_args: Sequence[Any], input_bytes: int, output_bytes: int,
              sources: Sequence[tuple[str, str]]) -> tuple[Any, ...]:
    """What the accounting step traced of block ``index`` that must match its representative's:
    ``ops`` (`remat.measure.types.OpRecord` of its forward, times left out, saved bytes in), ``call_args``
    (per op call, the `args_signature` of its arguments), its bytes, ``sources`` (``(argument,
    source)`` of each tensor input, `remat.measure.types.BlockInput`) as roles (`input_role`)."""
    op_rows = tuple((op.key, op.output_bytes, op.saved_bytes, op.flops, op.is_random, op.is_view, op.storage_ids,
                     op.storage_bytes, op.mutated_later) for op in ops)
    return (op_rows, tuple(call_args), input_bytes, output_bytes,
            tuple((argument, input_role(source, index)) for argument, source in sources))


def input_role(source: str, index: int) -> str:
    """The role in the dataflow of an input of block ``index`` whose source is ``source``
    (`remat.measure.types.BlockInput.source`): ``chain`` (``previous``, ``between``, ``outside``),
    ``skip:-<n>`` (``block:<index - n>``) or ``shared``."""
    if source.startswith("block:"):
        return f"skip:-{index - int(source.split(':', 1)[1])}"
    return "shared" if source == "shared" else "chain"


@dataclass(kw_only=True, frozen=True)
class BlockGroups:
    """Which block's timing probes each block takes."""

    timing_from: tuple[int, ...]
    """Per block, the index of its group's representative (itself when it is one)."""
    split: tuple[int, ...] = ()
    """Blocks alike in structure to an earlier block whose trace differed: measured apart."""
    structure_of: tuple[int, ...] = ()
    """Per block, the first block alike in structure but for which of its arguments require
    gradients (the first layer's input, the batch, does not), itself when none before it is;
    (): not known. `remat.measure.size_groups` compares the blocks of a structure."""

    @property
    def representatives(self) -> tuple[int, ...]:
        """The blocks whose timing probes run, in run order."""
        return tuple(i for i, source in enumerate(self.timing_from) if source == i)

    def members(self, representative: int) -> tuple[int, ...]:
        """The blocks that take ``representative``'s figures, itself first."""
        return tuple(i for i, source in enumerate(self.timing_from) if source == representative)


def group_blocks(structures: Sequence[Any], traces: Sequence[Any], *, share: bool = True,
                 alike_structures: Sequence[Any] | None = None) -> BlockGroups:
    """Groups of blocks equal in ``structures[i]`` and ``traces[i]`` (`structure_key`,
    `trace_key`); each is its own group when ``share`` is False. ``alike_structures``: the
    `structure_key` of each block less its arguments' gradient flags (`without_grad_flags`), for
    `BlockGroups.structure_of`."""
    if len(structures) != len(traces):
        raise ValueError(f"{len(structures)} structure keys for {len(traces)} trace keys: one of each per block.")
    first: dict[Any, int] = {}
    alike: dict[Any, int] = {}
    timing_from, split = [], []
    for i, (structure, trace) in enumerate(zip(structures, traces)):
        source = first.setdefault((structure, trace), i)
        timing_from.append(source)
        if alike.setdefault(structure, i) != i and source == i:
            split.append(i)
    loose: dict[Any, int] = {}
    structure_of = tuple(loose.setdefault(key, i) for i, key in enumerate(alike_structures)) if alike_structures else ()
    if not share:
        return BlockGroups(timing_from=tuple(range(len(structures))), structure_of=structure_of)
    return BlockGroups(timing_from=tuple(timing_from), split=tuple(split), structure_of=structure_of)


class _Stop(Exception):
    """Raised by `stop_after`'s hook: the forward has run what was needed."""


@contextmanager
def stop_after(module: nn.Module | None) -> Iterator[None]:
    """Inside, a forward that returns from ``module`` stops there (the rest of the model is not
    run; the exception is caught here). None: nothing stops."""
    if module is None:
        yield
        return
    handle = module.register_forward_hook(_raise_stop)
    try:
        yield
    except _Stop:
        pass
    finally:
        handle.remove()


def _raise_stop(module: nn.Module, args: Any, output: Any) -> None:
    raise _Stop
