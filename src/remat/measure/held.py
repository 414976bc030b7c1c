"""The op calls of each block whose outputs the model's code holds to the end of its forward.

A block's outputs that the code keeps (``output_attentions=True``: Hugging Face's output
recorder collects every layer's attention weights into the model's output) stay live through
the head and the loss whatever the block's strategy. Kept, the block saves them anyway (a
softmax saves its result); recomputed, nothing saves them, yet they are live: a Llama recomputing
three of its four layers measured 10.7 % above its prediction at the head's forward.

Which calls those are cannot be read off the accounting step, where autograd holds every saved
output too. One forward under ``torch.no_grad()`` can: nothing is saved, so whatever a block's
calls made that is still live when the model returns (its output still held) is held by the
code. The calls are named as the op table names them (``"<aten overload>#<occurrence>"`` within
the block's forward); a forward that runs other calls without gradients than with them (a path
chosen on ``torch.is_grad_enabled()``) names calls the op table may not have, and those count
nothing.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from remat._batch import LossFn, call_model, compute_loss
from remat.measure.blocks import Blocks
from remat.measure.calls import first_output
from remat.measure.storage import flat_tensors, storage_key, storage_nbytes, storage_of

__all__ = ["code_held_calls"]


class _Calls(TorchDispatchMode):
    """Each block's calls with weak references to the storages they made."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.current: int | None = None
        self.counts: list[dict[str, int]] = [defaultdict(int) for _ in range(count)]
        self.made: list[list[tuple[str, weakref.ref]]] = [[] for _ in range(count)]
        self.handed: list[weakref.ref | None] = [None] * count
        """Per block, the storage of what it hands on (its first output): the next block's input,
        or the post part's; the model's output when it is the last block's. Where that lives is
        the next block's and the post part's to count."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        block = self.current
        if block is not None:
            name = str(func)
            key = f"{name}#{self.counts[block][name]}"
            self.counts[block][name] += 1
            inputs = {storage_key(t) for t in flat_tensors(args, kwargs)}
            for t in flat_tensors((out,)):
                if storage_key(t) not in inputs and storage_nbytes(t) > 0:
                    self.made[block].append((key, weakref.ref(storage_of(t))))
        return out


def code_held_calls(model: torch.nn.Module, batch: Any, block_list: Blocks,
                    loss_fn: LossFn | None = None) -> list[frozenset[str]]:
    """Per block, the keys of its calls whose storages are live when the model's forward returns,
    other than what the block hands on, run once without gradients; the loss then runs on the
    output as in a step (a loss that reads what the model's hooks collected clears it). The
    caller restores what a forward changes (buffers, the RNG)."""
    calls = _Calls(len(block_list))
    handles = []
    for index, (_, module) in enumerate(block_list):
        def enter(_module: Any, _args: Any, index: int = index) -> None:
            calls.current = index

        def leave(_module: Any, _args: Any, output: Any, index: int = index) -> None:
            calls.current = None
            first = first_output(output)
            if first is not None and calls.handed[index] is None:
                calls.handed[index] = weakref.ref(storage_of(first))

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        with torch.no_grad(), calls:
            output = call_model(model, batch)
            held = [frozenset(key for key, ref in made if ref() is not None and not _same(ref, handed))
                    for made, handed in zip(calls.made, calls.handed)]
            calls.current = None
            compute_loss(output, batch, loss_fn)
            del output
    finally:
        for handle in handles:
            handle.remove()
    return held


def _same(ref: weakref.ref, other: weakref.ref | None) -> bool:
    return other is not None and ref() is other()
