"""Count aten op calls per block over a training step, and what a plan says the counts should be.

`BlockOpCounter` is a TorchDispatchMode. An op belongs to the block whose forward is running
(the user's call of the block, seen by wrapping its ``forward``, or a run by the remat runtime,
in the forward or in a replay, seen through `remat.apply.runtime.block_listener`). In backward, block
``j``'s part begins when the gradient of what it hands on arrives and ends when the gradient of
its chained input does (tensor hooks, as `remat.measure.boundaries` places them); the backward of
code between blocks (pooling, an encoder's final norm) runs in neither and is not counted, so
models with several stacks and skip connections count as chains do.
Bookkeeping ops that never compute (detach, size, stride: torch's ``SAC_IGNORED_OPS``; making
or re-pointing a storage: `_STORAGE_OPS`) are not counted; checkpointing adds detaches of its
own, offloading its storages.

`expected_extra_calls` turns a plan into the forward op calls it adds: a block under ``r``
nested recompute segments replays its forward ``r`` times; a selective block replays every call
except the saved ones. The last block of a segment that stops early (`Segment.stops_early`:
selective blocks among them) replays the calls its forward had made when it last saved a tensor for backward
(`BlockOpCounter.stop_keys`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import SAC_IGNORED_OPS

from remat.apply.runtime import block_listener
from remat.checkpointing.selective import is_saved
from remat.measure.boundaries import handed_on, on_first_grad
from remat.measure.calls import chained_input
from remat.plan.types import Plan, Segment

__all__ = ["BlockOpCounter", "expected_extra_calls", "op_name"]


def op_name(key: str) -> str:
    """``"aten.mm.default#2"`` -> ``"aten.mm.default"``."""
    return key.rsplit("#", 1)[0]


class BlockOpCounter(TorchDispatchMode):
    """``with BlockOpCounter(blocks) as c: step()``; then ``c.total``, ``c.forward_keys``."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = blocks
        self.total: list[Counter[str]] = [Counter() for _ in blocks]
        """Per block: calls per op name, forward + replays + backward."""
        self.forward_keys: list[list[str]] = [[] for _ in blocks]
        """Per block: ``"<op>#<occurrence>"`` of its forward (before backward began), in call order."""
        self.stop_keys: list[int] = [0 for _ in blocks]
        """Per block: how many of ``forward_keys`` it had made when autograd last saved a tensor
        in its forward (where an early-stopping replay of it stops)."""
        self._stack: list[int] = []
        self._backward_block: int | None = None
        self._in_backward = False
        self._handles: list[Any] = []
        self._forwards: list[tuple[nn.Module, Any]] = []
        """Per block: its ``forward`` instance attribute before `__enter__` wrapped it (None: none)."""
        self._listener: Any = None

    def _on_block(self, index: int, entering: bool) -> None:
        if entering:
            self._stack.append(index)
        else:
            self._stack.pop()

    def _on_grad(self, index: int) -> None:
        self._in_backward = True
        self._backward_block = index

    def _on_input_grad(self, index: int) -> None:
        self._in_backward = True
        if self._backward_block == index:
            self._backward_block = None

    def _pre(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        chained = chained_input(args, kwargs)
        if chained is not None and chained.requires_grad and not self._in_backward:
            chained.register_hook(lambda grad: self._on_input_grad(index))
            if chained.is_leaf:
                # torch 2.9 runs no tensor hook of a leaf that a checkpoint took while saved-tensor
                # hooks were on (this counter's, `_pack`): the block's backward seemed never to end,
                # and the optimizer's step was counted as the first block's (wav2vec2's feature
                # extractor, its input made a leaf that needs a gradient). Its post-accumulate hook
                # runs; where both run, the second finds the block's backward ended already.
                self._handles.append(chained.register_post_accumulate_grad_hook(
                    lambda t: self._on_input_grad(index)))

    def _post(self, index: int, output: Any) -> None:
        if not self._in_backward:
            on_first_grad(handed_on(output), lambda: self._on_grad(index))

    def _own_forward(self, index: int, block: nn.Module) -> Any:
        """The block's ``forward`` telling the counter it runs: a user's call of the block counts
        the ops of its forward, not those of the call's hook machinery around it (a full backward
        hook's views of the inputs), which a replay, running the forward alone, does not make."""
        inner = block.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            self._on_block(index, True)
            try:
                return inner(*args, **kwargs)
            finally:
                self._on_block(index, False)

        return forward

    def __enter__(self) -> BlockOpCounter:
        for i, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(lambda m, a, k, i=i: self._pre(i, a, k),
                                                                 with_kwargs=True))
            self._handles.append(block.register_forward_hook(lambda m, a, o, i=i: self._post(i, o)))
            self._forwards.append((block, block.__dict__.get("forward")))
            block.forward = self._own_forward(i, block)
        self._listener = block_listener(self._on_block)
        self._listener.__enter__()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._hooks.__exit__(*exc)
        self._listener.__exit__(*exc)
        self._hooks = self._listener = None  # they hold bound methods: a cycle that kept the blocks alive
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for block, own in self._forwards:
            if own is None:
                del block.forward
            else:
                block.forward = own
        self._forwards.clear()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self._stack and not self._in_backward:
            self.stop_keys[self._stack[-1]] = len(self.forward_keys[self._stack[-1]])
        return t

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in SAC_IGNORED_OPS or func in _STORAGE_OPS:
            return out
        index = self._stack[-1] if self._stack else self._backward_block
        if index is None:
            return out
        name = str(func)
        self.total[index][name] += 1
        if self._stack and not self._in_backward:
            seen = sum(1 for k in self.forward_keys[index] if op_name(k) == name)
            self.forward_keys[index].append(f"{name}#{seen}")
        return out


_STORAGE_OPS = frozenset({torch.ops.aten.empty.memory_format, torch.ops.aten.set_.source_Storage,
                          torch.ops.aten.set_.source_Storage_storage_offset})
"""Ops that make or re-point a storage and compute nothing: an offload engine's own, as it packs
a saved tensor and unpacks it in the block's backward (every offload plan was reported with
replays that did not match the plan), counted in neither run."""


def expected_extra_calls(plan: Plan, forward_keys: list[list[str]],
                         stop_keys: list[int] | None = None) -> list[Counter[str]]:
    """Per block: the forward op calls ``plan`` adds to a step (replays), by op name;
    ``stop_keys``: `BlockOpCounter.stop_keys` of the same forward (None: every replay whole)."""
    extra = [Counter() for _ in forward_keys]

    def visit(seg: Segment) -> None:
        for i in range(seg.start, seg.stop):
            stopped = stop_keys is not None and seg.stops_early and i == seg.stop - 1
            keys = forward_keys[i][: stop_keys[i]] if stopped else forward_keys[i]
            if seg.kind == "recompute":
                extra[i].update(op_name(k) for k in keys)
            elif seg.kind == "selective":
                saved = frozenset(seg.saved_ops)
                extra[i].update(op_name(k) for k in keys if not is_saved(k, saved))
        for child in seg.children:
            visit(child)

    for seg in plan.segments:
        visit(seg)
    return extra


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
