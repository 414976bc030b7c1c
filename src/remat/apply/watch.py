"""What an applied plan watches in every training forward: a batch larger than the one it was
made for, Hugging Face's gradient checkpointing switched on after it, and blocks replaced since.

A plan's figures hold for the batch it was profiled with (`remat.measure.types.Fingerprint`'s
``batch_shapes``). Activations grow with the batch: a plan made at 4x32 tokens and trained at
8x128 peaks several times over its prediction, and nothing in the runtime would say so. So the
model gets a forward pre-hook (`StepWatch`) that, in each forward with gradients enabled, reads
the sizes of the tensors the model is called with. For each rank (number of dimensions) the
profiled batch has, it keeps the largest size of each dimension; a call whose tensor of that
rank is larger in any dimension is warned of, with the fix: plan at the largest batch trained
on. A shape no larger in every dimension than one already warned of is not warned of again
(dynamic padding would otherwise warn at every batch); 8x128 after 4x128 and 8x32 is. A batch
no larger in any dimension than the profiled one is not warned of: a plan made there holds for
it (its activations are no larger). Tensors of a rank the profiled batch had none of are not
judged.

Hugging Face's ``gradient_checkpointing_enable()`` after `remat.apply_` (``Trainer`` calls it
when ``TrainingArguments(gradient_checkpointing=True)``) checkpoints every layer on top of the
plan: the plan's blocks kept are recomputed anyway and its prediction no longer describes the
step. `remat.apply_` refuses a model that has it on already; the hook refuses the forward that
finds it turned on since, before anything runs.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from remat._batch import batch_tensors
from remat.checkpointing.callsites import layer_of, split_site

__all__ = ["StepWatch", "largest_dims"]


def largest_dims(batch_shapes: tuple[str, ...]) -> dict[int, list[int]]:
    """For each rank among ``batch_shapes`` (`remat._batch.batch_shapes` strings such as
    ``"4x32:int64"``), the largest size of each dimension over the tensors of that rank."""
    out: dict[int, list[int]] = {}
    for text in batch_shapes:
        dims = [int(d) for d in text.split(":", 1)[0].split("x") if d]
        if not dims:
            continue
        have = out.setdefault(len(dims), list(dims))
        out[len(dims)] = [max(a, b) for a, b in zip(have, dims)]
    return out


def _shape_text(dims: Any) -> str:
    return "x".join(str(d) for d in dims)


class StepWatch:
    """The forward pre-hook of an applied plan on its model: `install`, `remove`."""

    def __init__(self, model: nn.Module, batch_shapes: tuple[str, ...], peak_bytes: int,
                 budget_bytes: int | None, blocks: list[tuple[str, nn.Module]] = ()) -> None:
        self.model = model
        self.blocks = list(blocks)
        """``(name, module)`` of each planned block as applied: one the model no longer holds under
        its name is warned of once (`_check_blocks`)."""
        self.replaced: set[str] = set()
        self.profiled = largest_dims(batch_shapes)
        self.told: dict[int, list[tuple[int, ...]]] = {rank: [tuple(dims)] for rank, dims in self.profiled.items()}
        """Per rank, the shapes no larger than which a call is not warned of: the profiled batch's
        largest, then each shape warned of."""
        self.peak_bytes = peak_bytes
        self.budget_bytes = budget_bytes
        self.hf_modules = [m for m in model.modules() if isinstance(getattr(m, "gradient_checkpointing", None), bool)]
        self.handle: Any = None

    def install(self) -> StepWatch:
        self.handle = self.model.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def _hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not torch.is_grad_enabled():
            return None  # inference and generation: no backward, nothing the plan figures for
        if any(m.gradient_checkpointing is True for m in self.hf_modules):
            raise RuntimeError(
                f"Hugging Face gradient checkpointing was turned on in {type(self.model).__name__} after a remat plan "
                "was applied (gradient_checkpointing_enable(), or Trainer with "
                "TrainingArguments(gradient_checkpointing=True)): every layer would be checkpointed on top of the "
                "plan, which then no longer describes the step. Use one: call model.gradient_checkpointing_disable() "
                "(activation_checkpointing_disable() in transformers 5) and pass gradient_checkpointing=False to "
                "TrainingArguments (TRL's SFTConfig and DPOConfig turn it on by default), or remat.remove_(model)."
            )
        self._check_sizes(batch_tensors((args, kwargs)))
        self._check_blocks()
        return None

    def _check_blocks(self) -> None:
        """Warn once per block replaced since the plan was applied (a layer swapped by hand): the
        new module runs without the plan, every activation of it kept, and remat holds the old one."""
        for name, block in self.blocks:
            if name in self.replaced:
                continue
            try:
                now = self.model.get_submodule(split_site(name)[0])
            except AttributeError:
                now = None
            block = layer_of(block)  # a call of a layer (remat.checkpointing.callsites): the layer
            if now is not block and not (now is not None and any(m is block for m in now.modules())):
                # a wrapper holding the block (FSDP1's, a compiled module's, the user's) runs its planned forward
                self.replaced.add(name)
                if not torch.compiler.is_compiling():
                    warnings.warn(
                        f"remat: block {name!r} of {type(self.model).__name__} was replaced after the plan was applied: the "
                        "new module runs without the plan (its activations all kept, as the plan did not count) and remat "
                        "still holds the old one. Call remat.remove_(model), then profile and plan the model as it is now.",
                        RuntimeWarning, stacklevel=3)

    def _check_sizes(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            told = self.told.get(t.dim())
            if told is None or any(all(d <= m for d, m in zip(t.shape, shape)) for shape in told):
                continue
            profiled = self.profiled[t.dim()]
            told.append(tuple(t.shape))
            budget = f", budget {self.budget_bytes:,} bytes" if self.budget_bytes is not None else ""
            if not torch.compiler.is_compiling():  # a warning breaks a compiled graph; eager runs say it
                warnings.warn(
                    f"remat: {type(self.model).__name__} is called with a tensor of shape {_shape_text(t.shape)}, "
                    f"larger than the batch its plan was made for (largest of that rank: {_shape_text(profiled)}). "
                    f"Activations grow with the batch, so this step may peak above the plan's predicted "
                    f"{self.peak_bytes:,} bytes{budget}. Profile and plan with the largest batch you train on "
                    "(remat.profile(model, largest_batch, ...)): a plan made there holds for every smaller one.",
                    RuntimeWarning, stacklevel=3)
