"""Model state on one GPU of one pipeline stage, as Megatron-LM shards it.

Each parameter has a role (`remat.estimate.dataflow.ROLES`, found by tracing its use): a GPU of
stage ``k`` holds

- ``tensor`` and ``vocab`` parameters of its layers (and of the embedding on the first stage,
  the head on the last) divided by the tensor-parallel size t, ``whole`` ones entire, ``expert``
  ones divided by expert_tensor x expert (``megatron/training/theoretical_memory_usage.py``,
  ``compute_weight_and_optimizer_memory``: ``tp_sharded``, ``replicated`` and
  ``expert_sharded`` parameters on the most loaded shard);
- with a pipeline, the layers of stage k (``[k L/p, (k + 1) L/p)``, or the uneven split
  of `Parallelism.stage_sizes`); a head tied to the embedding is held by
  the first stage and, as a copy, by the last (Megatron-LM keeps the word embeddings on the
  last stage for its output layer);
- its optimizer state sharded over the data-parallel ranks by ZeRO (stage 1 is Megatron-LM's
  distributed optimizer: ``6 + 12/d`` bytes per parameter with fp32 gradients) over ``d`` for
  the dense parameters and over ``expert_data`` for the experts' (`remat.memory.model_state`).

``fp32_grads``: gradients kept in fp32 whatever the weights' dtype (Megatron-LM's ``main_grad``
buffers, 18 bytes per parameter with mixed-precision Adam and no distributed optimizer).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from remat.estimate.parallel import Parallelism
from remat.memory.model_state import ModelState, model_state, shard_model_state

Shape = tuple[int, ...]


@dataclass(kw_only=True, frozen=True)
class RoleShapes:
    """Parameter shapes of one part of the model by sharding role."""

    tensor: tuple[Shape, ...] = ()
    """Column- and row-parallel weights, column-parallel biases."""
    vocab: tuple[Shape, ...] = ()
    """Token embedding and head (vocabulary-parallel)."""
    whole: tuple[Shape, ...] = ()
    """Norms, routers, row-parallel biases, position embeddings."""
    expert: tuple[Shape, ...] = ()
    """Routed experts."""

    @property
    def count(self) -> int:
        return sum(math.prod(s) for s in (*self.tensor, *self.vocab, *self.whole, *self.expert))


@dataclass(kw_only=True, frozen=True)
class ModelParams:
    """Every parameter of the full model, by part and role."""

    pre: RoleShapes
    """Used before the layers only (embeddings)."""
    post: RoleShapes
    """Used after the layers only (final norm, an untied head)."""
    tied: RoleShapes
    """Used both before and after the layers (a head tied to the embedding)."""
    layers: tuple[RoleShapes, ...]
    """One entry per layer of the full model (layers of one kind share an entry)."""
    gradless: RoleShapes = RoleShapes()
    """Outside the layers, those the training step gives no gradient
    (`remat.estimate.dataflow.Classified.gradless`: frozen, read by no op, or not reaching the
    loss): held by the first stage as weights, with no gradient (``.grad`` stays None), no
    optimizer state (PyTorch's optimizers skip a parameter without a gradient and never make its
    state) and no fp32 master copy under mixed precision. NeoMME's image patch embeddings, in a masked LM's step over text,
    priced 30 % above the measured peak as trained."""

    shared: tuple[tuple[frozenset[int], RoleShapes], ...] = ()
    """(the layers of the full model that run them, parameters): weights a layer holds and several
    layers run (Zamba's transformer block, one module its hybrid layers share), held once on each
    pipeline stage that runs one of those layers (as a tied embedding is on the first and last),
    outside the layers' own (a ZeRO-3 unit of their own, as the embedding is)."""

    layer_gradless: tuple[RoleShapes, ...] = ()
    """Per layer of the full model (empty: none), its parameters frozen or read by no op, held as
    ``gradless`` is, on the layer's stage: BLIP's text layers' cross-attention, which its
    contrastive step never runs (11 % above the measured peak priced as trained). Those ops read
    without reaching the loss count as trained (`remat.estimate.dataflow.Classified.unreached`)."""

    @property
    def count(self) -> int:
        """Parameters of the whole model, a tied one once."""
        return (self.pre.count + self.post.count + self.tied.count + self.gradless.count
                + sum(shapes.count for _, shapes in self.shared)
                + sum(layer.count for layer in self.layers) + sum(layer.count for layer in self.layer_gradless))


@dataclass(kw_only=True, frozen=True)
class StateRecipe:
    """How model state is stored: optimizer, precision, ZeRO stage, gradient dtype."""

    optimizer: str
    """Name in the optimizer-state table."""
    precision: str
    """``mixed``, ``bf16`` or ``fp32`` (`remat.memory.model_state.PRECISIONS`)."""
    zero_stage: int
    """0..3 over the data-parallel ranks (1 = Megatron-LM's distributed optimizer)."""
    fp32_grads: bool = False
    """Gradients in fp32 whatever the weights' dtype (Megatron-LM's ``main_grad``)."""


def stage_layers(num_layers: int, par: Parallelism, stage: int) -> range:
    """The layers stage ``stage`` of ``par``'s pipeline runs (`Parallelism.stage_sizes`)."""
    sizes = par.stage_sizes(num_layers)
    start = sum(sizes[:stage])
    return range(start, start + sizes[stage])


def check_layers(num_layers: int, par: Parallelism) -> None:
    """Every stage (and every interleaved chunk) holds the same number of layers, or the first
    and last stages the counts given and the others the same (`Parallelism.stage_sizes`)."""
    par.stage_sizes(num_layers)


def _stage_parts(params: ModelParams, par: Parallelism, stage: int) -> list[RoleShapes]:
    first, last = stage == 0, stage == par.pipeline - 1
    parts = [params.layers[i] for i in stage_layers(len(params.layers), par, stage)]
    if first:
        parts += [params.pre, params.tied]
    if last:
        parts.append(params.post)
        if not first:
            parts.append(params.tied)  # the last stage's copy of the tied embedding
    held = set(stage_layers(len(params.layers), par, stage))
    parts += [shapes for readers, shapes in params.shared if readers & held]  # a copy per stage that runs them
    return parts


def _shard(shapes: Sequence[Shape], divisor: int) -> list[Shape]:
    """Shapes of one rank's shard: the first dimension divided (rounded up) when it can be."""
    return [(-(-s[0] // divisor), *s[1:]) if s else s for s in shapes]


def gpu_state(params: ModelParams, par: Parallelism, stage: int, recipe: StateRecipe,
              buffer_bytes: int = 0) -> ModelState:
    """Model state on one GPU of ``stage`` (module docstring)."""
    parts = _stage_parts(params, par, stage)
    dense = [s for p in parts for s in _dense(p, par)]
    experts = [s for p in parts for s in _shard(p.expert, par.expert_tensor_size * par.expert)]
    unit = largest_unit(params, par, stage, recipe) if recipe.zero_stage == 3 else None
    state = add_states(_sharded(dense, par.data, recipe, unit), _sharded(experts, par.expert_data, recipe, None))
    for gradless in _stage_gradless(params, par, stage):
        state = add_states(state, _weights_only(gradless, par, recipe))
    return replace(state, buffer_bytes=buffer_bytes)


def _stage_gradless(params: ModelParams, par: Parallelism, stage: int) -> list[RoleShapes]:
    """The parameters without a gradient that ``stage`` holds: those outside the layers on the
    first stage, its layers' own."""
    layers = [params.layer_gradless[i] for i in stage_layers(len(params.layers), par, stage)] \
        if params.layer_gradless else []
    return [p for p in ([params.gradless] if stage == 0 else []) + layers if p.count]


def _weights_only(part: RoleShapes, par: Parallelism, recipe: StateRecipe) -> ModelState:
    """``part`` sharded as trained parameters are, its weights alone: no gradient, no optimizer
    state and no fp32 master copy (under mixed precision the master weights are the optimizer's,
    of the parameters it updates: Megatron-LM's ``main_param`` of those that require grad)."""
    weights = add_states(_sharded(_dense(part, par), par.data, recipe, None),
                         _sharded(_shard(part.expert, par.expert_tensor_size * par.expert), par.expert_data, recipe,
                                  None))
    return replace(weights, grad_bytes=0, master_bytes=0, optimizer_state_bytes=0)


def _dense(part: RoleShapes, par: Parallelism) -> list[Shape]:
    return [*_shard(part.tensor, par.tensor), *_shard(part.vocab, par.tensor), *part.whole]


def part_grad_bytes(part: RoleShapes, par: Parallelism, recipe: StateRecipe) -> int:
    """Gradient bytes one GPU holds for ``part`` (sharded over the data-parallel ranks from ZeRO-2 on)."""
    dense = _sharded(_dense(part, par), par.data, recipe, None)
    experts = _sharded(_shard(part.expert, par.expert_tensor_size * par.expert), par.expert_data, recipe, None)
    return dense.grad_bytes + experts.grad_bytes


def largest_unit(params: ModelParams, par: Parallelism, stage: int, recipe: StateRecipe) -> ModelState:
    """What ZeRO-3 all-gathers at once on ``stage``: the largest dense shard of one layer (or of
    the embedding and head), unsharded over the data-parallel ranks; a layer's parameters without
    a gradient among its weights (FSDP2 gathers them), not its gradients."""
    parts = _stage_parts(params, par, stage)
    layers = list(stage_layers(len(params.layers), par, stage))
    units = []
    for k, part in enumerate(parts):
        unit = _state(_dense(part, par), recipe)
        if k < len(layers) and params.layer_gradless and params.layer_gradless[layers[k]].count:
            frozen = _state(_dense(params.layer_gradless[layers[k]], par), recipe)
            unit = add_states(unit, replace(frozen, grad_bytes=0, master_bytes=0, optimizer_state_bytes=0))
        units.append(unit)
    return max(units, key=lambda u: (u.param_bytes, u.grad_bytes), default=_state([], recipe))


def _sharded(shapes: list[Shape], ranks: int, recipe: StateRecipe, unit: ModelState | None) -> ModelState:
    return shard_model_state(_state(shapes, recipe), world_size=ranks, zero_stage=recipe.zero_stage, largest_unit=unit)


def _state(shapes: list[Shape], recipe: StateRecipe) -> ModelState:
    state = model_state(shapes, optimizer=recipe.optimizer, precision_name=recipe.precision)
    if recipe.fp32_grads and state.grad_bytes:
        state = replace(state, grad_bytes=4 * sum(math.prod(s) for s in shapes))
    return state


def add_states(a: ModelState, b: ModelState) -> ModelState:
    """Field-by-field sum of two model states."""
    return ModelState(**{f: getattr(a, f) + getattr(b, f) for f in (
        "param_bytes", "grad_bytes", "master_bytes", "optimizer_state_bytes", "buffer_bytes", "gathered_bytes")})


__all__ = ["ModelParams", "RoleShapes", "StateRecipe", "add_states", "check_layers", "gpu_state", "largest_unit",
           "part_grad_bytes", "stage_layers"]
