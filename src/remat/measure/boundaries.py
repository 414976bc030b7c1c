"""Block boundaries of a training step, from module, tensor and optimizer hooks.

Events, in step order: ``fwd_start``/``fwd_end`` of each block (forward hooks),
``bwd_start`` of a block when the gradient of what it hands on (its output, or the output's
first element: `remat.measure.calls.first_output`), or of the tensor that is a view of, is ready, ``bwd_end`` when the gradient of
its chained input (its first positional argument) is ready (tensor hooks), ``opt_start``/
``opt_end`` around ``optimizer.step()``. Only the chained tensors count: a tensor shared by
several blocks (a position bias that needs a gradient) gets its gradient only once every block
that took it is done, and code between two blocks runs its backward after the ``bwd_end`` of
the block after it and before the ``bwd_start`` of the block before it. A driver may add its
own events with `StepBoundaries.emit` (``profile`` marks where ``loss.backward()`` begins and
ends). Forward hooks that fire during backward (recomputation) emit nothing. A block whose
chained input needs no gradient (the first block of a model fed with the raw batch) has no
``bwd_end``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from remat.measure.blocks import Blocks
from remat.measure.calls import chained_input, first_output
from remat.measure.storage import storage_key, tensors_in


@dataclass(kw_only=True, frozen=True)
class Boundary:
    """One event of the step."""

    kind: str
    """``fwd_start``, ``fwd_end``, ``bwd_start``, ``bwd_end``, ``opt_start``, ``opt_end`` or a driver's own."""
    index: int
    """Block index, or -1 for events that are not about a block."""
    where: str
    """Block name, ``"pre"``, ``"post"`` or ``"optimizer"``."""


Listener = Callable[[Boundary], None]


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


class StepBoundaries:
    """Context manager: calls every listener at each boundary of the steps run inside it."""

    def __init__(self, blocks: Blocks, optimizer: torch.optim.Optimizer | None = None,
                 listeners: Sequence[Listener] = ()) -> None:
        self.blocks = blocks
        self.optimizer = optimizer
        self.listeners = list(listeners)
        self._handles: list = []
        self.taken: dict[int, set[int | None]] = {}
        """Block index -> storage keys of the tensors its first call took as arguments."""

    def emit(self, kind: str, index: int = -1, where: str = "") -> None:
        event = Boundary(kind=kind, index=index, where=where)
        for listener in self.listeners:
            listener(event)

    def __enter__(self) -> StepBoundaries:
        for index, (name, module) in enumerate(self.blocks):
            self._handles.append(module.register_forward_pre_hook(self._pre(index, name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(index, name)))
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_pre_hook(
                lambda *_: self.emit("opt_start", -1, "optimizer")))
            self._handles.append(self.optimizer.register_step_post_hook(
                lambda *_: self.emit("opt_end", -1, "optimizer")))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _pre(self, index: int, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if in_backward():
                return
            self.emit("fwd_start", index, name)
            self.taken.setdefault(index, {storage_key(t) for t in tensors_in((args, kwargs))})
            chained = chained_input(args, kwargs)
            if chained is not None and chained.requires_grad:
                chained.register_hook(lambda grad: self.emit("bwd_end", index, name))

        return hook

    def _post(self, index: int, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            if in_backward():
                return
            self.emit("fwd_end", index, name)
            handed = handed_on(output)
            # its other outputs the next block takes too (PegasusX's global-token stream beside its
            # tokens): the backward that runs first may be theirs; what a loss alone takes (a
            # router's logits) gets its gradient when the whole backward starts and does not count
            others = [t for t in tensors_in(output) if t.requires_grad and not any(t is h for h in handed)]
            on_first_grad(handed, lambda: self.emit("bwd_start", index, name), also=others,
                          counts=lambda key: key in self.taken.get(index + 1, ()))

        return hook


def handed_on(output: object) -> list[torch.Tensor]:
    """The output tensors whose gradient starts a block's backward: what it hands on when that
    needs a gradient, and the tensor it is a view of (the first gradient of either starts it);
    else every output tensor that does. Flux's single-stream block hands on the text part of
    one tensor and returns the image part beside it; after the last block only the image part
    reaches the loss, so the text part gets no gradient: the last block's backward was never
    seen to start, its temporaries were counted in the head's backward on top of every block's
    saved bytes (no recomputation 3.6-10 % over). The tensor both are views of gets its
    gradient when the block's backward starts. The other outputs do not count: a router's
    logits under an auxiliary loss get theirs when the whole backward starts. A list's tensors are
    all handed on (CrossViT's blocks return one per branch, and the backward of one began before
    the other's gradient came: the block's backward start was measured late, with none of its
    output's gradient live, and full recomputation measured +1.6 % over its prediction)."""
    if isinstance(output, list):  # a list is handed on whole (CrossViT's blocks: one tensor per branch)
        handed = [t for t in output if isinstance(t, torch.Tensor) and t.requires_grad]
        if len(handed) > 1:
            return handed
    first = first_output(output)
    if first is not None and first.requires_grad:
        base = first._base
        return [first] if base is None or not base.requires_grad else [first, base]
    return [t for t in tensors_in(output) if t.requires_grad]


def on_first_grad(tensors: list[torch.Tensor], callback: Callable[[], None], also: Sequence[torch.Tensor] = (),
                  counts: Callable[[int | None], bool] = lambda key: True) -> None:
    """Call ``callback`` when the first gradient of any of ``tensors`` is computed, or of any of
    ``also`` for whose storage key ``counts`` (asked then) is true. The hooks hold keys, never
    the tensors: a tensor's hook holding it would keep it alive."""
    fired = {"done": False}

    def hook(grad: torch.Tensor, key: int | None = None, other: bool = False) -> None:
        if not fired["done"] and (not other or counts(key)):
            fired["done"] = True
            callback()

    for t in tensors:
        t.register_hook(hook)
    for t in also:
        t.register_hook(functools.partial(hook, key=storage_key(t), other=True))
