"""Trace one training step of a model on the meta device: no memory, no download, no data.

The model is built on the meta device with a few layers (2 by default: the second layer sees a
layer's output as input, like every later layer; DeepSeek-style models whose first
``first_k_dense_replace`` layers are dense get those and two MoE layers) and traced twice at
each micro-batch 1, 2 and 3, each on first use:

- `remat.profile` (`trace_profile`): saved bytes per block and per op, backward temporaries,
  FLOPs. The same code measures a real model on the CPU, so the estimate counts what a real run
  counts (with `remat.estimate.kernels.GpuKernels`, what a GPU's fused attention and dropout
  kernels save instead of the CPU's);
- `remat.estimate.dataflow.classify`: which of those bytes and FLOPs each parallelism divides.

Every layer of the full model is a copy of one traced layer (`Traced.layer_kinds`); the
micro-batch is extrapolated along the line through 2 and 3 (`remat.estimate.shares`). Hugging
Face models are traced as they train: without a key/value cache (``use_cache=False``).

A ``file.py:build`` model is built under ``torch.device("meta")`` as its function writes it
(all its layers) and traced once at the batch it returns.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import math
import os
import sys
import traceback
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat.estimate.comms import ModelFacts
from remat.estimate.dataflow import GAP, Classified, classify
from remat.estimate.kernels import (CpuKernels, GpuKernels, no_packed_sequence_check, register_flash_attention,
                                   register_meta_ctc_kernels)
from remat.estimate.ssm import WKV, has_fused_mamba2
from remat.estimate.shares import Flow, Segment, Split, on_one_line, split_by_tokens, untokenized
from remat.estimate.head import TracedHead, find_traced_head
from remat.estimate.sharding import ModelParams, RoleShapes
from remat.estimate.sources import (CTC_FRAMES_PER_TARGET, ModelSource, audio_samples, build_hf_on_meta,
                                    check_num_layers, ctc_loss_fn, hf_batch, hf_config_and_part,
                                    image_input, is_encoder_decoder, is_image_encoder, is_masked_lm, num_layers,
                                    speech_ctc, speech_features, stack_layers, two_towers)
from remat.measure.blocks import find_blocks
from remat.measure.layerdrop import LayerDropOff
from remat.measure.types import BlockProfile, Profile
from remat.memory.optimizer_state import optimizer_name_of
from remat.plan.costs import working_bytes
from remat.plan.phases import forward_phase_bytes, stopped_replay_working_bytes

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

Shape = tuple[int, ...]

TRACED_MICRO_BATCHES = (1, 2, 3, 4)
"""1 exactly; 2 and 3 for the line through every larger micro-batch (`remat.estimate.shares`), 4
to check that the line holds (`Traced.split`)."""


@dataclass(kw_only=True, frozen=True)
class ModelShape:
    """What the parallel layout is checked against (from the model's config when it has one)."""

    heads: int = 0
    """Attention heads (0: unknown)."""
    kv_heads: int = 0
    """Key/value heads."""
    experts: int = 0
    """Routed experts per MoE layer (0: no MoE layer)."""


@dataclass(kw_only=True, frozen=True)
class Traced:
    """What estimate knows about a model after tracing it."""

    label: str
    """Human name of the model."""
    tracer: Callable[[int], tuple[Profile, Classified]] = field(repr=False, compare=False)
    """Traces one step at a micro-batch (1, 2 or 3); a file model ignores it (its own batch)."""
    num_layers: int
    """Layers of the full model."""
    layer_kinds: tuple[int, ...]
    """For each layer of the full model, the traced layer it copies."""
    layer_names: tuple[str, ...]
    """Qualified names of the traced layers."""
    param_shapes: Mapping[str, Shape] = field(repr=False)
    """Shape of every parameter of the traced model."""
    fixed_buffer_bytes: int
    """Buffers outside the layers."""
    layer_buffer_bytes: tuple[int, ...]
    """Buffers of each traced layer (NF4 base weights among them: an encoder-decoder's decoder layers
    hold more than its encoder layers)."""
    facts: ModelFacts = ModelFacts()
    """Experts per token and key/value width, for the communication terms."""
    shape: ModelShape = ModelShape()
    """Heads and experts, for checking a parallel layout."""
    whole: bool = False
    """True when the trace already covers every layer (a file model): nothing is copied."""
    optimizer_name: str | None = None
    """The table name of the optimizer the model came with (a file model's), else None."""
    head: TracedHead | None = None
    """The LM head and loss after the layers, priced by its byte model (`remat.estimate.head`);
    None: the part after the layers is priced as traced."""
    head_note: str = ""
    """Why the model has no head part to price (when ``head`` is None)."""
    encoder_layers: int = 0
    """Layers of an encoder-decoder's encoder, the first ``encoder_layers`` of ``layer_kinds`` (0: one
    stack of layers)."""
    tokens: int | None = None
    """The tokens a layer runs over where the model sets them, not --seq (an image encoder's patches)."""
    whole_batch_loss: bool = False
    """True where the loss couples the micro-batch's samples (a contrastive loss over its image-text
    pairs): micro-batches accumulated into a step train another objective than one batch, so
    `remat.estimate.fastest.search` keeps one micro-batch per step."""
    outside_grads_between: bool = False
    """True where parameters outside the layers run between two layers of one stack (a speech
    encoder's feature projection and positional convolution, between its convolutions and its
    transformer layers): their gradients are made after the backward of the layer that follows
    them (`between_grads`), not after every layer's. Between two stacks: `gap_grads`, always."""
    quantized: str | None = None
    """The format of the LoRA layers' frozen base weights (`remat.estimate.sources.ModelSource.quantize`):
    held as the layers' buffers, whole on every GPU that holds the layer."""
    quantized_params: int = 0
    """Elements of the full model's base weights held quantized (buffers, not parameters)."""
    layer_quantized_bytes: tuple[int, ...] = ()
    """Of ``layer_buffer_bytes``, each traced layer's quantized base weights (empty: none)."""
    lora: bool = False
    """LoRA adapters were added (`remat.estimate.sources.ModelSource.lora_rank`)."""
    checked: tuple[int, ...] | None = None
    """The traced layers checked against the traced layer before them, their twin (None: every
    traced layer that is copied, but the first). An encoder-decoder's stacks each trace their first
    layer apart (T5's computes the position bias the others reuse), which is checked against none."""
    _traces: dict[int, tuple[Profile, Classified]] = field(default_factory=dict, repr=False, compare=False)

    def _trace(self, micro_batch: int) -> tuple[Profile, Classified]:
        key = 1 if self.whole else micro_batch
        if key not in TRACED_MICRO_BATCHES:
            raise ValueError(f"traced micro-batches are {TRACED_MICRO_BATCHES}, got {micro_batch}.")
        if key not in self._traces:
            self._traces[key] = self.tracer(key)
        return self._traces[key]

    def profile(self, micro_batch: int) -> Profile:
        """The traced profile at micro-batch 1, 2 or 3, traced on first use (a file model: its batch)."""
        return self._trace(micro_batch)[0]

    def classified(self, micro_batch: int) -> Classified:
        """The dataflow classification at micro-batch 1, 2 or 3."""
        return self._trace(micro_batch)[1]

    def flow(self, micro_batch: int) -> Flow:
        """The shares at micro-batch 1, 2 or 3, with each layer's working set from the profile."""
        profile, classified = self._trace(micro_batch)
        if not self.whole:
            _check_kinds(profile, self.layer_kinds if self.checked is None else self.checked)
        flow = classified.flow
        layers = tuple(_working_sets(seg, b) for seg, b in zip(flow.layers, profile.blocks))
        pre = replace(flow.pre, working_bytes=profile.fixed_pre_bwd_temp_bytes,
                      forward_peak_bytes=profile.fixed_pre_fwd_bytes)
        return replace(flow, pre=pre, layers=layers, post=replace(flow.post, working_bytes=profile.fixed_post_bwd_temp_bytes))

    def split(self, micro_batch: int) -> Split:
        """The shares at any micro-batch, as per-token and constant parts."""
        if self.whole:
            return untokenized(self.flow(1))
        if micro_batch == 1:
            return split_by_tokens(self.flow(1), self.flow(2), self.flow(3), 1)
        if self.line_starts == 2:
            return split_by_tokens(None, self.flow(2), self.flow(3), micro_batch)
        return split_by_tokens(self.flow(2) if micro_batch == 2 else None, self.flow(3), self.flow(4), micro_batch,
                               first=3)

    @cached_property
    def line_starts(self) -> int:
        """The micro-batch from which the traced figures lie on one line: 2, unless micro-batch 2 is
        off the line through 3 and 4 (SigLIP's layers' backward temporaries: 2.4 % under with every
        layer recomputed at micro-batch 8 on the line through 2 and 3); then 3."""
        return 2 if on_one_line(self.flow(2), self.flow(3), self.flow(4)) else 3

    @property
    def scalable(self) -> bool:
        """True when the micro-batch can be changed (traced at micro-batch 1, 2 and 3 on demand)."""
        return not self.whole

    @cached_property
    def params(self) -> ModelParams:
        """Every parameter of the full model by part and role (`remat.estimate.sharding`)."""
        classified = self.classified(1)
        # a layer's parameters frozen or read by no op hold no gradient; those ops read without the
        # loss reaching them count as trained, on the safe side: the traced step may take a path
        # the device does not (MRA's attention without its CUDA kernel returns zeros)
        weights = classified.gradless - classified.unreached
        traced = [_role_shapes([n for n in self._names_in(name) if n not in weights], self.param_shapes,
                               classified.roles) for name in self.layer_names]
        frozen = [_role_shapes([n for n in self._names_in(name) if n in weights], self.param_shapes,
                               classified.roles) for name in self.layer_names]
        outside = [n for n, layer in self._layer_of.items() if layer is None]

        trained = [n for n in outside if n not in classified.gradless]

        def part(where: set[str]) -> RoleShapes:
            names = [n for n in trained if _part(classified.used_in.get(n, frozenset())) == where]
            return _role_shapes(names, self.param_shapes, classified.roles)

        gradless = [n for n in outside if n in classified.gradless]
        shared = {n: frozenset(i for i, k in enumerate(self.layer_kinds) if k in self._layer_readers(n))
                  for n in trained if self._shared_between_layers(n)}
        trained = [n for n in trained if n not in shared]
        return ModelParams(pre=part({"pre"}), post=part({"post"}), tied=part({"pre", "post"}),
                           shared=tuple((readers, _role_shapes([n for n in shared if shared[n] == readers],
                                                               self.param_shapes, classified.roles))
                                        for readers in dict.fromkeys(shared.values())),
                           layers=tuple(traced[k] for k in self.layer_kinds),
                           gradless=_role_shapes(gradless, self.param_shapes, classified.roles),
                           layer_gradless=tuple(frozen[k] for k in self.layer_kinds) if any(f.count for f in frozen)
                           else ())

    @cached_property
    def gap_grads(self) -> tuple[tuple[int, RoleShapes], ...]:
        """(full-model layer, parameters) for the parameters outside the layers that are first used
        between two stacks (`remat.estimate.dataflow.GAP`: an encoder-decoder's decoder embeddings,
        tied to its head or not): their gradients are whole once the backward of the layer after
        them is over, live through the first stack's backward, not made after every layer's as the
        part before the layers' own are. Whisper's full recomputation 0.23 % under the measured peak
        without them (its frozen position table's optimizer state, counted before, hid it)."""
        classified = self.classified(1)
        outside = [n for n, layer in self._layer_of.items() if layer is None]
        after: dict[int, list[str]] = {}
        for name in outside:
            uses = classified.used_in.get(name, frozenset())
            if name in classified.gradless or not uses:
                continue
            first = min(uses, key=_forward_order)
            if first.startswith(GAP):
                traced = int(first.removeprefix(GAP))
                if traced in self.layer_kinds:
                    after.setdefault(self.layer_kinds.index(traced), []).append(name)
        return tuple((layer, _role_shapes(names, self.param_shapes, classified.roles))
                     for layer, names in sorted(after.items()))

    @cached_property
    def between_grads(self) -> tuple[tuple[int, RoleShapes], ...]:
        """(full-model layer, parameters) for the parameters outside the layers that run after a
        traced layer's forward and before the next one's (`outside_grads_between`): their gradients
        are made once that next layer's backward is over. Empty unless ``outside_grads_between``."""
        if not self.outside_grads_between:
            return ()
        classified = self.classified(1)
        outside = [n for n, layer in self._layer_of.items() if layer is None]
        after: dict[int, list[str]] = {}
        for name in outside:
            segments = classified.used_in.get(name, frozenset())
            # run after layer k's forward, before layer k + 1's (between two stacks: `gap_grads`)
            if (name not in classified.gradless and segments and all(s.startswith("layer:") for s in segments)
                    and not self._shared_between_layers(name)):  # weights a layer holds: `shared_grads`
                traced = max(int(s.split(":", 1)[1]) for s in segments) + 1
                if traced in self.layer_kinds:
                    after.setdefault(self.layer_kinds.index(traced), []).append(name)
        return tuple((layer, _role_shapes(names, self.param_shapes, classified.roles))
                     for layer, names in sorted(after.items()))

    def _names_in(self, block: str) -> list[str]:
        return [n for n, layer in self._layer_of.items() if layer == block]

    @cached_property
    def _layer_of(self) -> dict[str, str | None]:
        """The traced layer each parameter belongs to (its qualified name; None: outside the layers),
        by its name, but for a parameter registered in a layer and read by the ops of other layers
        (Zamba's transformer block, one module every hybrid layer runs; Zamba 2's adapters of it, one
        per hybrid layer): it belongs to the one layer whose ops read it, and read by several layers,
        to none: held once, outside the layers, where copying the layer that holds it would count it
        once per copy, or never."""
        out: dict[str, str | None] = {}
        for name in self.param_shapes:
            layer = next((b for b in self.layer_names if name.startswith(b + ".")), None)
            readers = self._layer_readers(name) if layer is not None else set()
            if readers:
                layer = self.layer_names[readers.pop()] if len(readers) == 1 else None
            out[name] = layer
        return out

    def _shared_between_layers(self, name: str) -> bool:
        """Whether parameter ``name`` is held by a layer and run by several (`_layer_of`: none
        holds it then)."""
        return self._layer_of[name] is None and any(name.startswith(b + ".") for b in self.layer_names)

    def _layer_readers(self, name: str) -> set[int]:
        """The traced layers whose ops read parameter ``name``, where only layers' ops read it (else
        an empty set)."""
        segments = self.classified(1).used_in.get(name, frozenset())
        if not segments or not all(s.startswith("layer:") for s in segments):
            return set()
        return {int(s.split(":", 1)[1]) for s in segments}

    @cached_property
    def shared_grads(self) -> tuple[tuple[int, RoleShapes], ...]:
        """(full-model layer, parameters) for the parameters a layer holds and several layers read
        (`_layer_of`: Zamba's shared transformer block): their gradient is made in the backward of
        the last layer of the full model that reads them, the first backward to reach them, and
        lives from there, not after every layer's backward as the part before the layers' own
        (Zamba's full recomputation 4.7 % under the measured peak so)."""
        classified = self.classified(1)
        after: dict[int, list[str]] = {}
        for name in self._layer_of:
            if name in classified.gradless or not self._shared_between_layers(name):
                continue
            readers = self._layer_readers(name)
            last = max((i for i, k in enumerate(self.layer_kinds) if k in readers), default=None)
            if last is not None:
                after.setdefault(last, []).append(name)
        return tuple((layer, _role_shapes(names, self.param_shapes, classified.roles))
                     for layer, names in sorted(after.items()))

    @property
    def param_count(self) -> int:
        """Parameters of the full model (a shared one once), the quantized base weights among them."""
        return self.params.count + self.quantized_params


def _working_sets(seg: Segment, block: BlockProfile) -> Segment:
    """A traced layer's share with its backward's working sets from its profile, kept
    (`remat.plan.costs.working_bytes`) and replayed (`remat.plan.phases.stopped_replay_working_bytes`:
    a checkpoint of one layer replays its forward up to its last saved tensor, as torch's
    ``early_stop`` and the planner's recompute segments do; DeBERTa's full recomputation was 0.59 %
    above the measured peak with the whole forward's temporaries). What the layer keeps for the
    layers after it is alive through its own backward too; what the part before the layers counts
    of them (`remat.estimate.shares.Segment.first_saved_bytes`, ``first_entry_bytes``,
    ``first_alone_bytes``) is counted there once (a text encoder's first layer, traced apart, saves
    a mask or takes a position bias every layer reads: DeBERTa-v2 0.20 % above the measured peak
    without recomputation); its saved bytes are at least what the dataflow counts of its own (a
    scalar made on the CPU, which the meta device's accountant leaves out: 12 bytes of DeBERTa-v2's)."""
    own = max(0.0, seg.saved.total - (block.saved_bytes - seg.first_saved_bytes))
    shared = seg.first_saved_bytes + seg.first_entry_bytes
    return replace(seg, working_bytes=working_bytes(block) + seg.kept_bytes - shared + own,
                   forward_working_bytes=forward_phase_bytes(block) + seg.kept_bytes - shared + own,
                   replay_working_bytes=stopped_replay_working_bytes(block) + seg.kept_bytes - shared
                   - seg.first_alone_bytes + own)


def _forward_order(segment: str) -> float:
    """Where a dataflow segment runs in the forward: before the layers, in layer i, between
    traced layers i - 1 and i (``gap:i``), after the layers."""
    if segment.startswith(GAP):
        return int(segment.removeprefix(GAP)) - 0.5
    if segment.startswith("layer:"):
        return int(segment.removeprefix("layer:"))
    return float("inf") if segment == "post" else -1.0


def _part(segments: frozenset[str]) -> set[str]:
    """Where a parameter outside the layers lives: before them, after them, or both (tied)."""
    where = {"post" if s == "post" else "pre" for s in segments} or {"pre"}
    return where


def _role_shapes(names: Sequence[str], shapes: Mapping[str, Shape], roles: Mapping[str, str]) -> RoleShapes:
    grouped: dict[str, list[Shape]] = {"tensor": [], "vocab": [], "whole": [], "expert": []}
    for name in names:
        grouped[roles.get(name, "whole")].append(shapes[name])
    return RoleShapes(**{k: tuple(v) for k, v in grouped.items()})


def check_alike(profile: Profile) -> None:
    """Raise if the last two traced layers run different ops (then copying one is wrong).

    Bytes may differ between the first layer and the others: tensors made before the layers
    and shared by all of them (rotary tables, masks) are counted by the first layer that saves
    them (the dataflow classification counts them once, before the layers).
    """
    if profile.num_blocks < 2:
        raise ValueError(f"the trace has {profile.num_blocks} block(s); trace at least 2 identical layers.")
    first, last = profile.blocks[-2], profile.blocks[-1]
    if first.fwd_flops != last.fwd_flops or [op.name for op in first.ops] != [op.name for op in last.ops]:
        raise ValueError(
            f"traced layers {first.name!r} and {last.name!r} run different ops ({len(first.ops)} vs "
            f"{len(last.ops)} calls, {first.fwd_flops} vs {last.fwd_flops} FLOPs); estimate copies one layer and "
            "needs identical layers. Estimate such a model from a file.py:build that builds all of it."
        )


def _check_kinds(profile: Profile, kinds: tuple[int, ...]) -> None:
    """Each traced layer that is copied runs the same ops as the layer traced before it (its
    twin: the same kind of layer). One that stands for itself alone is not copied (the second layer
    of a 2-layer Mamba 2 whose first is traced apart: its input float32, the first's bf16)."""
    for k in sorted(set(kinds)):
        if k >= 1 and any(i != k for i, kind in enumerate(kinds) if kind == k):
            check_alike(replace(profile, blocks=profile.blocks[k - 1 : k + 1]))


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype for ``bf16``, ``fp16`` or ``fp32``."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; allowed: {', '.join(DTYPES)}.")
    return DTYPES[name]


def _unique_shapes(module: nn.Module) -> dict[str, Shape]:
    """Shape of each parameter of ``module`` under its first name (a tied one once)."""
    seen: dict[int, str] = {}
    out: dict[str, Shape] = {}
    for name, p in module.named_parameters():
        if id(p) not in seen:
            seen[id(p)] = name
            out[name] = tuple(p.shape)
    return out


def _quantized_elements(module: nn.Module) -> int:
    """Elements of the base weights ``module`` holds quantized (`remat.models.qlora.NF4Linear`)."""
    from remat.models.qlora import NF4Linear

    return sum(m.out_features * m.in_features for m in module.modules() if isinstance(m, NF4Linear))


def _quantized_bytes(module: nn.Module) -> int:
    """Bytes of the base weights ``module`` holds quantized (their buffers)."""
    from remat.models.qlora import NF4Linear

    return sum(_buffer_bytes(m) for m in module.modules() if isinstance(m, NF4Linear))


def _buffer_bytes(module: nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers())


def trace_profile(model: nn.Module, batch: Any, loss_fn: Any = None, *, gpu_kernels: bool = False) -> Profile:
    """`remat.profile` of one training step (no optimizer; on the meta device no step is timed);
    with ``gpu_kernels``, SDPA and dropout run as a GPU's fused kernels (`GpuKernels`), else
    SDPA as the CPU's (`CpuKernels`)."""
    from remat.measure.profile import profile

    mode = GpuKernels() if gpu_kernels else CpuKernels()
    with mode:
        return profile(model, batch, loss_fn=loss_fn, optimizer=None, warmup=0, repeats=1)


def _tracer(model: nn.Module, batch_at: Callable[[int], Any], loss_fn: Any, fused: bool,
            plan: Mapping[str, str] | None, stack_ends: frozenset[int] = frozenset(),
            blocks: list[tuple[str, nn.Module]] | None = None) -> Callable[[int], tuple[Profile, Classified]]:
    """The tracer of ``model``; ``blocks``: its blocks in the order its forward runs them (default
    `find_blocks`'s, the modules' order, which is the running order but for two towers)."""
    blocks = blocks if blocks is not None else find_blocks(model)

    def trace(micro_batch: int) -> tuple[Profile, Classified]:
        batch = batch_at(micro_batch)
        try:
            with no_packed_sequence_check():
                profile = trace_profile(model, batch, loss_fn, gpu_kernels=fused)
                with GpuKernels() if fused else CpuKernels(), LayerDropOff(model):  # every layer runs, as profiled
                    classified = classify(model, batch, blocks, loss_fn=loss_fn, plan=plan, stack_ends=stack_ends)
        except _MODEL_ERRORS as error:
            raised = _untraceable(model, error)
            if raised is error:
                raise
            raise raised from error
        return profile, classified

    return trace


_MODEL_ERRORS = (RuntimeError, NotImplementedError, TypeError, KeyError, IndexError, ValueError, AttributeError)
"""What a model's own code raises on the meta device (`_untraceable`): BLIP-2's placeholder mask,
a Python bool where its code expects a tensor, raised an AttributeError (a traceback before)."""


def _untraceable(model: nn.Module, error: Exception) -> Exception:
    """``error``, raised by ``model``'s step on the meta device, as one line naming the way that
    works; remat's own refusal (already in words) as it is."""
    if isinstance(error, (ValueError, AttributeError)) and _raised_in_remat(error):
        return error  # remat's own refusal, already in words; or its own fault, left to show
    first = (str(error).splitlines() or [""])[0][:300]
    return ValueError(
        f"{type(model).__name__}'s training step cannot be traced on the meta device, where the estimate runs "
        f"it: {type(error).__name__}: {first} (its forward reads tensor values, which a meta tensor has not, "
        "calls a kernel with no meta implementation, needs inputs besides token ids (an image), or looks up a "
        "per-layer setting the estimate's model of fewer layers has not). Measure it with `remat profile "
        "path/to/file.py:build` at a size that runs here.")


def _raised_in_remat(error: BaseException) -> bool:
    """True when the innermost frame of ``error`` is remat's code (its own refusal), not the model's
    or torch's (GIT's loss raises a ValueError of torch's on logits it sliced to nothing)."""
    import remat

    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(os.path.dirname(os.path.abspath(remat.__file__)) + os.sep)


def _describe(label: str, model: nn.Module, tracer: Callable[[int], tuple[Profile, Classified]],
              kinds: tuple[int, ...], seq_len: int | None, blocks: list[tuple[str, nn.Module]] | None = None,
              **extra: Any) -> Traced:
    blocks = blocks if blocks is not None else find_blocks(model)
    head, note = find_traced_head(model, seq_len)
    per_block = [_quantized_elements(block) for _, block in blocks]
    if any(per_block) or _quantized_elements(model):
        extra["quantized_params"] = _quantized_elements(model) - sum(per_block) + sum(per_block[k] for k in kinds)
        extra["layer_quantized_bytes"] = tuple(_quantized_bytes(block) for _, block in blocks)
    return Traced(
        label=label, tracer=tracer, num_layers=len(kinds), layer_kinds=kinds,
        layer_names=tuple(name for name, _ in blocks), param_shapes=_unique_shapes(model),
        fixed_buffer_bytes=_buffer_bytes(model) - sum(_buffer_bytes(block) for _, block in blocks),
        layer_buffer_bytes=tuple(_buffer_bytes(block) for _, block in blocks), head=head, head_note=note, **extra,
    )


TRACE_CACHE_SIZE = 8
"""Traced models `trace_source` keeps in this process, the least recently used dropped first."""
_TRACE_CACHE: OrderedDict[tuple, Traced] = OrderedDict()


def clear_trace_cache() -> None:
    """Forget every traced model `trace_source` keeps: the next estimate of each traces it anew."""
    _TRACE_CACHE.clear()


def _cache_key(source: ModelSource, *args: Any) -> tuple | None:
    """What a traced model follows from: the source's every field, a config file's bytes (an edited
    config is traced anew) and `trace_source`'s arguments. None for a ``file.py:build`` model, whose
    code (and whatever it imports) may change between calls: it is traced each time."""
    if source.file is not None:
        return None
    content = b""
    if source.hf_config_path is not None:
        try:
            content = Path(source.hf_config_path).read_bytes()
        except OSError:
            return None  # `hf_config_and_part` says what is wrong with the path
    return (repr(source), hashlib.sha256(content).hexdigest(), *args)


def trace_source(
    source: ModelSource, *, seq_len: int, dtype: str = "bf16", trace_layers: int = 2, gpu_kernels: bool = True
) -> Traced:
    """Build ``source`` on the meta device (module docstring); nothing is traced until asked.

    ``gpu_kernels``: SDPA and dropout run as a GPU's fused kernels (`GpuKernels`); False traces
    what the CPU runs (the same bytes a CPU profile measures).

    The same source at the same arguments gets the same `Traced` back while this process keeps it
    (`TRACE_CACHE_SIZE`; `clear_trace_cache`), its traces made once: a notebook pricing one model at
    several micro-batches, layouts or devices traces it once. A built-in model, a family's sizes or a
    config file's bytes name the model; a ``file.py:build`` model is traced on each call."""
    key = _cache_key(source, seq_len, dtype, trace_layers, gpu_kernels)
    if key is not None and key in _TRACE_CACHE:
        _TRACE_CACHE.move_to_end(key)
        return _TRACE_CACHE[key]
    traced = _trace_source(source, seq_len=seq_len, dtype=dtype, trace_layers=trace_layers, gpu_kernels=gpu_kernels)
    if key is not None:
        _TRACE_CACHE[key] = traced
        while len(_TRACE_CACHE) > TRACE_CACHE_SIZE:
            _TRACE_CACHE.popitem(last=False)
    return traced


def _trace_source(source: ModelSource, *, seq_len: int, dtype: str, trace_layers: int, gpu_kernels: bool) -> Traced:
    torch_dtype = dtype_of(dtype)
    if source.file is not None:
        return _trace_file(source, torch_dtype, gpu_kernels)
    if source.builtin is not None:
        return _trace_builtin(source, seq_len=seq_len, dtype=torch_dtype, layers=trace_layers, fused=gpu_kernels)
    traced = _trace_hf(source, seq_len=seq_len, dtype=torch_dtype, layers=trace_layers, fused=gpu_kernels)
    return replace(traced, quantized=source.quantize, lora=bool(source.lora_rank)) if source.lora_rank else traced


def hf_layer_kinds(config: Any, full: int, layers: int, first_apart: bool = False) -> tuple[int, tuple[int, ...]]:
    """(layers to trace, traced layer per full-model layer): the first ``first_k_dense_replace``
    layers of DeepSeek-style models are dense, the rest MoE; a model whose per-layer lists mix
    kinds (``layer_types``: Gemma 3's five sliding-window layers to one global, Qwen3-Next's linear
    and full attention; ``mlp_layer_types``: the dense and sparse layers of EXAONE-MoE, Kimi Linear,
    Hunyuan 3) traces two layers of each kind, a kind being the layer's entry in every list, in
    the order they first come (`traced_layer_values`), and copies the second of each; other models
    are uniform. ``first_apart``: the first layer is traced as itself and copied nowhere, before
    the two of each kind (a text encoder's: ModernBERT's first layer has no attention norm)."""
    kinds, per_layer = _layer_kinds(config, full)
    if first_apart:
        if kinds:
            return 1 + 2 * len(kinds), (0,) + tuple(2 * kinds.index(k) + 2 for k in per_layer[1:])
        traced = min(layers + 1, full)
        return traced, (0,) + (traced - 1,) * (full - 1)
    if kinds:
        return 2 * len(kinds), tuple(2 * kinds.index(k) + 1 for k in per_layer)
    dense = int(getattr(config, "first_k_dense_replace", 0) or 0)
    if 0 < dense < full:
        traced = min(full, dense + 2)
        return traced, (dense - 1,) * dense + (traced - 1,) * (full - dense)
    traced = min(layers, full)
    return traced, (traced - 1,) * full


_KIND_LISTS = ("layer_types", "mlp_layer_types", "no_rope_layers", "layers_block_type", "layers_num_experts")
"""Per-layer lists of transformers configs that name each layer's kind (Llama 4's
``no_rope_layers``: 0 where a layer runs without rotary embeddings; Jamba's and Zamba's
``layers_block_type``, the mixer each layer runs, and Jamba's ``layers_num_experts``, 1 for a
dense feed-forward)."""


def _kind_lists(config: Any, full: int) -> dict[str, list]:
    """The per-layer lists of ``config`` (`_KIND_LISTS`) that cover its ``full`` layers; with
    ``mlp_layer_types`` absent, ``first_k_dense_replace`` as one more where another list is there."""
    lists = {}
    for name in _KIND_LISTS:
        try:
            value = getattr(config, name, None)
        except Exception:  # noqa: BLE001 - transformers' per-layer lookups raise errors of their own
            value = None
        if isinstance(value, (list, tuple)) and len(value) >= full:
            lists[name] = list(value[:full])
    dense = int(getattr(config, "first_k_dense_replace", 0) or 0)
    if lists and "mlp_layer_types" not in lists and 0 < dense < full:
        lists["first_k_dense_replace"] = [i < dense for i in range(full)]
    first = int(getattr(config, "num_dense_layers", 0) or 0)  # AFMoE: its first layers dense
    if 0 < first < full:
        lists["num_dense_layers"] = [i < first for i in range(full)]
    start, end = getattr(config, "moe_layer_start_index", None), getattr(config, "moe_layer_end_index", None)
    interval = getattr(config, "moe_layer_interval", None)  # ERNIE 4.5: its MoE layers by range and step
    if all(isinstance(v, int) for v in (start, end, interval)) and interval > 0:
        lists["moe_layer_range"] = [(i + 1) % interval == 0 and start <= i <= end for i in range(full)]
    moe = getattr(config, "moe_layers", None)  # Llama 4: the indices of its MoE layers
    if isinstance(moe, (list, tuple)) and all(isinstance(i, int) for i in moe):
        lists["moe_layers"] = [i in set(moe) for i in range(full)]
    return lists


def _layer_kinds(config: Any, full: int) -> tuple[list[tuple], list[tuple]]:
    """(the distinct kinds in the order they first come, each layer's kind) where the lists mix
    several kinds (([], []) otherwise)."""
    lists = _kind_lists(config, full)
    per_layer = [tuple(values[i] for values in lists.values()) for i in range(full)] if lists else []
    kinds = list(dict.fromkeys(per_layer))
    return (kinds, per_layer) if len(kinds) > 1 else ([], [])


def traced_layer_values(config: Any, full: int, first_apart: bool = False) -> dict[str, Any]:
    """What the traced model's config sets per layer (two layers of each kind, `hf_layer_kinds`,
    after the first layer with ``first_apart``): each list of `_KIND_LISTS`, and
    ``first_k_dense_replace`` as the traced dense layers ({} for a uniform model)."""
    kinds, _ = _layer_kinds(config, full)
    if not kinds:
        return {}
    names = list(_kind_lists(config, full))
    first = [kinds[0]] if first_apart else []
    out: dict[str, Any] = {name: [kind[j] for kind in first + [k for k in kinds for _ in range(2)]]
                           for j, name in enumerate(names)}
    if "first_k_dense_replace" in out:
        flags = out.pop("first_k_dense_replace")
        out["first_k_dense_replace"] = sum(flags)  # the dense kinds come first: the dense layers do
    if "moe_layers" in out:
        out["moe_layers"] = [i for i, moe in enumerate(out["moe_layers"]) if moe]
    if "num_dense_layers" in out:
        out["num_dense_layers"] = sum(out["num_dense_layers"])  # the dense kinds come first here too
    if "moe_layer_range" in out:
        moe = [i for i, flag in enumerate(out.pop("moe_layer_range")) if flag]
        # one step of 1 from the first MoE layer to the last: the traced MoE layers must be those
        if moe and moe != list(range(moe[0], moe[-1] + 1)):
            raise ValueError("the traced model's MoE layers are not one run of layers, which ERNIE's "
                             "moe_layer_start_index / moe_layer_end_index can name")
        out.update(moe_layer_start_index=moe[0] if moe else 2 * len(kinds), moe_layer_end_index=moe[-1] if moe else -1,
                   moe_layer_interval=1)
    return out


def _hf_facts(config: Any) -> tuple[ModelFacts, ModelShape]:
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    kv = int(getattr(config, "num_key_value_heads", 0) or heads)
    experts = int(next((getattr(config, k) for k in ("num_local_experts", "num_experts", "n_routed_experts")
                        if getattr(config, k, None)), 0))
    top_k = int(getattr(config, "num_experts_per_tok", 0) or 0) if experts else 0
    facts = ModelFacts(experts_per_token=top_k, kv_fraction=kv / heads if heads else 1.0)
    return facts, ModelShape(heads=heads, kv_heads=kv, experts=experts)


def encoder_decoder_kinds(encoder: int, decoder: int, layers: int = 3) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """(layers traced per stack, traced layer per full-model layer, traced layers to check against
    the one before them) for an encoder-decoder of ``encoder`` + ``decoder`` layers: each stack traces
    up to ``layers`` layers; its first layer is its own (T5's first layers compute the position
    bias the others reuse), every later layer a copy of the stack's last traced layer, which is
    checked against the one before it where it is copied."""
    per_stack = max(min(layers, max(encoder, decoder)), 1)
    te, td = min(per_stack, encoder), min(per_stack, decoder)
    kinds = (0,) + (te - 1,) * (encoder - 1) + (te,) + (te + td - 1,) * (decoder - 1)
    copied = tuple(k for k in dict.fromkeys(kinds) if kinds.count(k) > 1)
    return per_stack, kinds, copied


def _trace_hf(source: ModelSource, *, seq_len: int, dtype: torch.dtype, layers: int, fused: bool) -> Traced:
    config, part = hf_config_and_part(source)
    config.use_cache = False
    said = _settle_attention(source, config, dtype, fused)
    traced = _trace_hf_config(source, config, part, seq_len=seq_len, dtype=dtype, layers=layers, fused=fused)
    return replace(traced, label=traced.label + said) if said else traced


MAMBA2_NOTE = " (its Mamba layers priced as mamba_ssm's fused kernels save: `remat.estimate.ssm`)"
"""What the estimate says of a model whose Mamba or Mamba-2 mixers it prices as the GPU's fused kernels."""
WKV_NOTE = " (its time mixing priced as RWKV's WKV kernel saves: `remat.estimate.ssm`)"
"""And of an RWKV model, whose time mixing it prices as the WKV CUDA kernel."""


def _wkv(module: nn.Module) -> bool:
    """Whether ``module`` is RWKV's time mixing, whose modeling code calls the WKV kernel through
    ``rwkv_linear_attention`` (`remat.estimate.ssm.FusedWkv`)."""
    return type(module).__name__.startswith("Rwkv") and hasattr(sys.modules.get(type(module).__module__), WKV)


def _state_space(module: nn.Module) -> bool:
    """Whether ``module`` is a state-space mixer (its ``A_log`` parameter: Mamba's, Mamba-2's)."""
    return isinstance(getattr(module, "A_log", None), nn.Parameter)


def _unmodelled_state_space(module: nn.Module) -> bool:
    """A state-space mixer whose GPU kernels `remat.estimate.ssm` does not stand in for (its modeling
    code calls none of the functions it replaces)."""
    return _state_space(module) and not has_fused_mamba2(module)


STATE_SPACE_NOTE = (
    " (its state-space layers traced as their PyTorch code, which saves several times what the fused kernels a GPU "
    "runs them with save (mamba_ssm's): those layers are over-priced)")
"""What the estimate says of a hybrid whose state-space layers it traces as their PyTorch code, on a
GPU (none of transformers' today: `remat.estimate.ssm` stands in for the kernels of all of them): a tiny Mamba-2 mixer's PyTorch path saves 7.4 times the tensors
``mamba_split_conv1d_scan_combined`` saves (its input projection, its scan's output and the norm's
statistics), and Mamba-1's selective scan as much more."""


def _settle_attention(source: ModelSource, config: Any, dtype: torch.dtype, fused: bool) -> str:
    """The attention the estimate traces where transformers offers the model no SDPA, set on
    ``config``, and the words that say so ("" where SDPA runs, or where ``--explicit-attention``
    asked for the model's own code): FlashAttention as transformers' kernels run it, where the
    model takes attention functions and FlashAttention (Gemma 2, GPT-OSS: the kernel takes their
    softcap and sinks; `remat.estimate.kernels.flash_attention_forward`), on a GPU; else the
    model's own code (eager: BLOOM's ALiBi, DeBERTa's disentangled attention), which is what runs
    it. One layer built on the meta device finds out. A model of state-space layers and no attention
    (Mamba 2) has none to trace; one of state-space or recurrent layers the estimate does not price
    as a GPU's kernels (RWKV, xLSTM: `remat.estimate.ssm` stands in for Mamba's and Mamba-2's) is
    refused on a GPU, whose kernels save other tensors than their code."""
    if source.attention == "eager":
        return ""
    try:
        build_hf_on_meta(config, layers=1, dtype=dtype)
        return ""
    except Exception as error:  # noqa: BLE001 - transformers' own failures: `_build` words the others
        said = " ".join(str(error).split())
        if not (isinstance(error, ValueError) and ("attn_implementation" in said or "scaled_dot_product_attention" in said)):
            return ""
    config._attn_implementation = "eager"
    try:
        model = build_hf_on_meta(config, layers=1, dtype=dtype)
    except Exception:  # noqa: BLE001 - `_build` words it
        return ""
    recurrent = next((type(m).__name__ for m in model.modules() if _unmodelled_state_space(m) or (
        type(m).__name__.startswith(("Rwkv", "xLSTM")) and not _wkv(m))), None)
    if fused and recurrent is not None:
        raise ValueError(
            f"{source.label}: {type(config).__name__} runs no attention but state-space or recurrent layers ({recurrent}), "
            "which a GPU runs as fused kernels of their own (mamba_ssm's selective scan, RWKV's WKV kernel, xLSTM's "
            "mLSTM kernels), whose saved tensors the estimate does not model (mamba_ssm's and RWKV's it does); their "
            "code without "
            "those kernels, which the meta device would trace, saves every time step's state. Estimate it with "
            "--cpu-kernels for what a CPU runs, or measure it with `remat profile path/to/file.py:build` at a size "
            "that runs here.")
    if any(_state_space(m) for m in model.modules()) and not any("Attention" in type(m).__name__ for m in model.modules()):
        return ""  # no attention to trace (Mamba 2)
    if any(_wkv(m) for m in model.modules()):
        return ""  # RWKV's time mixing, no softmax attention (on a GPU the WKV kernel: `remat.estimate.ssm.FusedWkv`)
    import transformers

    models = [m for m in model.modules() if isinstance(m, transformers.PreTrainedModel)]
    if fused and models and all(m._supports_flash_attn and m._supports_attention_backend for m in models):
        config._attn_implementation = register_flash_attention()
        return (" (attention as FlashAttention: transformers runs this model with FlashAttention kernels or its own "
                "code, not SDPA)")
    return (" (attention as the model's own code, eager: transformers offers it "
            + ("neither SDPA nor FlashAttention)" if fused else "no SDPA on the CPU)"))


def _trace_hf_config(source: ModelSource, config: Any, part: str, *, seq_len: int, dtype: torch.dtype, layers: int,
                     fused: bool) -> Traced:
    if is_encoder_decoder(config):
        return _trace_encoder_decoder(source, config, seq_len=seq_len, dtype=dtype, fused=fused)
    if speech_ctc(config) is not None:
        return _trace_speech_encoder(source, config, seq_len=seq_len, dtype=dtype, fused=fused)
    if two_towers(config) is not None:
        return _trace_two_towers(source, config, seq_len=seq_len, dtype=dtype, fused=fused)
    image = image_input(config) if is_image_encoder(config) else None
    stages = next((name for name in ("depths", "hidden_sizes", "embed_dim_multipliers")
                   if isinstance(getattr(config, name, None), (list, tuple))), None)
    if image is not None and stages:
        raise ValueError(
            f"{source.label}: {type(config).__name__} is an image model of stages that differ ({stages} "
            f"{list(getattr(config, stages))}: Swin, ConvNeXt, ResNet...); the estimate copies one traced layer to "
            "every layer, which a plain vision transformer (ViT, DeiT, BEiT, DINOv2) has. Measure it with `remat "
            "profile path/to/file.py:build` at a size that runs here.")
    encoder, whole_config = is_masked_lm(config) or image is not None, config
    whole = None if encoder else _build(source, whole_config, num_layers(whole_config), dtype,
                                        "whole, to count its parameters")
    # with LoRA the embeddings are frozen: the first layer's input takes no gradient, so it saves
    # less than the layers after it (a tiny Llama's 241,920 bytes against 254,464): traced apart;
    # so is a first layer whose weights no later layer has (ModernBERT's decoder: no attention norm)
    # so is the first layer of a model that keeps its residual stream in float32 (Mamba 2's
    # residual_in_fp32): its input is the embedding's, in the model's dtype, the later layers' float32
    apart = (encoder or bool(source.lora_rank) or (whole is not None and _first_layer_unique(whole))
             or (bool(getattr(config, "residual_in_fp32", False)) and dtype != torch.float32))
    traced, kinds = hf_layer_kinds(config, num_layers(config), layers, first_apart=apart)
    values = traced_layer_values(config, num_layers(config), first_apart=apart)
    if values:  # the traced model's layers: two of each kind
        config = with_layer_values(config, values)
    how = "its first layer, then two of each kind of layer, copied" if apart else "two of each kind of layer, then copied"
    model = _build(source, _per_layer_lists_cut(config, traced), traced, dtype, how)
    _check_layers_found(model, source.label)
    if image is not None and "pixel_values" not in inspect.signature(model.forward).parameters:
        raise ValueError(f"{source.label}: {type(model).__name__} takes no pixel_values (ImageGPT's pixels are token "
                         "ids of colour clusters); the estimate prices image classifiers of pixel values. Measure it "
                         "with `remat profile path/to/file.py:build` at a size that runs here.")
    _check_experts_dtype(model, source.label, dtype)
    _check_positions(model, source.label, seq_len)
    batch_at = lambda b: hf_batch(config, micro_batch=b, seq_len=seq_len, dtype=dtype)  # noqa: E731
    tracer = _tracer(model, batch_at, None, fused, getattr(config, "base_model_tp_plan", None))
    facts, shape = _hf_facts(config)
    tokens = _layer_tokens(model, batch_at(1)) if image else None
    label = source.label + part + (
        f" (an image encoder, trained as an image classifier over {image[1]} x {image[2]} images: {tokens} tokens "
        "a layer, --seq unused)" if image else
        " (a text encoder, trained as a masked language model over --seq tokens)" if encoder else "")
    if fused and any(_unmodelled_state_space(m) for m in model.modules()):
        label += STATE_SPACE_NOTE
    elif fused and any(_state_space(m) for m in model.modules()):
        label += MAMBA2_NOTE
    if fused and any(_wkv(m) for m in model.modules()):
        _check_wkv_length(config, source.label, seq_len)
        label += WKV_NOTE
    if whole is not None and not _layers_share_weights(model):
        _check_copies(label, _copied_count(model, kinds), whole)  # before any trace: a count of shapes
        return _describe(label, model, tracer, kinds, seq_len, facts=facts, shape=shape)
    if whole is not None:  # which layers read the shared weights, a trace says (`Traced._layer_of`)
        described = _describe(label, model, tracer, kinds, seq_len, facts=facts, shape=shape)
        _check_copies(described.label, described.param_count, whole)
        return described
    checked = tuple(k for k in dict.fromkeys(kinds) if k >= 1 and kinds.count(k) > 1)
    described = _describe(label, model, tracer, kinds, None if image else seq_len, facts=facts, shape=shape,
                          checked=checked, tokens=tokens)
    whole = _build(source, whole_config, num_layers(whole_config), dtype, "whole, to count its parameters")
    described = replace(described, param_shapes=_outside_from(described, whole))
    _check_copies(described.label, described.param_count, whole)
    return described


def with_layer_values(config: Any, values: Mapping[str, Any]) -> Any:
    """A copy of ``config`` whose per-layer settings are ``values`` (`traced_layer_values`). A list
    the config computes from other settings (Jamba's ``layers_block_type`` and ``layers_num_experts``,
    from its periods and offsets, which cannot give two attention layers in a row) is set on a
    subclass of the config's own, of the same name (transformers' auto classes find the model by
    the config class's name), also where the list's name is an alias of it (RecurrentGemma's
    ``layer_types``, its ``layers_block_type``, computed from ``block_types``); a list of layer
    indices the config derived from another when it was made (Zamba 2's ``hybrid_layer_ids``, from
    ``layers_block_type``) is derived again."""
    config = copy.deepcopy(config)
    computed = {}
    for name, value in values.items():
        name = getattr(config, "attribute_map", {}).get(name, name)  # RecurrentGemma's layer_types: an alias
        if isinstance(getattr(type(config), name, None), property):
            computed[name] = value
        else:
            setattr(config, name, value)
    if computed:
        cls = type(config)
        made = {name: property(lambda _self, value=value: list(value) if isinstance(value, list) else value)
                for name, value in computed.items()}
        config.__class__ = type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                                       **made})
    if isinstance(getattr(config, "hybrid_layer_ids", None), list) and "layers_block_type" in values:
        config.hybrid_layer_ids = [i for i, kind in enumerate(config.layers_block_type) if kind == "hybrid"]
    return config


def _layers_share_weights(model: nn.Module) -> bool:
    """Whether two of ``model``'s layers hold one parameter (Zamba's hybrid layers, one transformer
    block); False where no layers are found (`_check_layers_found` says so)."""
    try:
        blocks = find_blocks(model)
    except ValueError:
        return False
    seen: set[int] = set()
    for _, block in blocks:
        held = {id(p) for p in block.parameters()}
        if held & seen:
            return True
        seen |= held
    return False


def _check_wkv_length(config: Any, label: str, seq_len: int) -> None:
    """Refuse more tokens than RWKV's WKV kernel is built for (``context_length``: it raises on a GPU)."""
    limit = getattr(config, "context_length", None)
    if isinstance(limit, int) and seq_len > limit:
        raise ValueError(f"{label}: --seq {seq_len} is more tokens than RWKV's WKV kernel is built for "
                         f"(context_length {limit}): a training step at that length fails on a GPU; pass --seq {limit} "
                         "or less, or a config with a larger context_length.")


def _first_layer_unique(whole: nn.Module) -> bool:
    """Whether the first layer of ``whole`` has weights of shapes no later layer has (ModernBERT's
    decoder: no attention norm; ZAYA's first router: no state scale), so that no copy of a later
    layer stands for it; False where no layers are found (`_check_layers_found` says so)."""
    try:
        blocks = find_blocks(whole)
    except ValueError:
        return False

    def shapes(block: nn.Module) -> frozenset:
        return frozenset((name, tuple(p.shape)) for name, p in block.named_parameters())

    first = shapes(blocks[0][1])
    return len(blocks) > 1 and all(shapes(block) != first for _, block in blocks[1:])


def _outside_from(traced: Traced, whole: nn.Module) -> dict[str, Shape]:
    """The traced layers' parameter shapes and, outside the layers, the whole model's: a part whose
    size follows the layer count (ESM's contact head, a weight per layer and head) is counted as
    the full model has it."""
    stacks = {name.rsplit(".", 1)[0] + "." for name in traced.layer_names}
    inside = {n: s for n, s in traced.param_shapes.items() if any(n.startswith(p) for p in stacks)}
    outside = {n: s for n, s in _unique_shapes(whole).items() if not any(n.startswith(p) for p in stacks)}
    return {**inside, **outside}


def _meta_forward(model: nn.Module, batch: Mapping[str, Any]) -> None:
    """A forward of ``model`` on the meta device without gradients, for what its hooks see; the
    model's own failure as one line (`_untraceable`)."""
    try:
        with torch.no_grad(), no_packed_sequence_check():
            model(**batch)
    except _MODEL_ERRORS as error:
        raised = _untraceable(model, error)
        if raised is error:
            raise
        raise raised from error


def _layer_tokens(model: nn.Module, batch: Mapping[str, Any]) -> int:
    """The tokens each layer of an image encoder runs over (its patches, a class token, registers):
    the second dimension of the first layer's input, in a forward on the meta device."""
    first = find_blocks(model)[0][1]
    seen: list[int] = []

    def look(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(hidden, torch.Tensor) and hidden.dim() == 3 and not seen:
            seen.append(int(hidden.shape[1]))

    handle = first.register_forward_pre_hook(look, with_kwargs=True)
    try:
        _meta_forward(model, batch)
    finally:
        handle.remove()
    if not seen:
        raise ValueError(f"{type(model).__name__}'s first layer is not called with (batch, tokens, hidden) states; the "
                         "estimate copies the layers of a transformer encoder. Measure it with `remat profile "
                         "path/to/file.py:build` at a size that runs here.")
    return seen[0]


def _without_advice(error: ValueError) -> str:
    """`find_blocks`'s error up to its advice to name the blocks, which the estimate cannot take."""
    return " ".join(str(error).split(". Name the blocks")[0].split())


def _check_layers_found(model: nn.Module, label: str) -> None:
    """Refuse a model in which remat finds no stack of layers to copy (ALBERT, whose one layer
    runs as every layer, its weights shared), in the estimate's words."""
    try:
        find_blocks(model)
    except ValueError as error:
        said = _without_advice(error)
        raise ValueError(
            f"{label}: the estimate copies a traced layer to every layer of the model, and {said}. A model that "
            "runs one layer's weights as every layer (ALBERT) has no layers to copy: measure it with `remat profile "
            "path/to/file.py:build` at a size that runs here, where each call of the shared layer is a block.") from None


_UNIFORM_LISTS = ("attention_window",)
"""Per-layer settings of transformers configs that must list exactly as many layers as the model
has (Longformer's attention windows); the estimate's model of fewer layers takes the first ones
(one kind of layer: every entry alike, else refused)."""


def _per_layer_lists_cut(config: Any, traced: int) -> Any:
    """``config`` with each per-layer list of `_UNIFORM_LISTS` cut to the ``traced`` layers; a list
    whose entries differ is refused (its layers are not copies of one)."""
    cut = {}
    for name in _UNIFORM_LISTS:
        value = getattr(config, name, None)
        if isinstance(value, (list, tuple)) and len(value) > traced:
            if len(set(value)) > 1:
                raise ValueError(
                    f"{type(config).__name__}'s {name} differs between layers ({list(value)[:8]}...); the estimate "
                    "copies one traced layer to every other. Estimate it from a file.py:build that builds the whole "
                    "model (--model path/to/file.py:build).")
            cut[name] = list(value[:traced])
    if not cut:
        return config
    config = copy.deepcopy(config)
    for name, value in cut.items():
        setattr(config, name, value)
    return config


def _build(source: ModelSource, config: Any, layers: int, dtype: torch.dtype, how: str) -> nn.Module:
    """`build_hf_on_meta`, transformers' failures to build it in one line: no SDPA attention for
    the model (the way: --explicit-attention), or any other (the way: a file.py:build)."""
    try:
        model = build_hf_on_meta(config, layers=layers, dtype=dtype)
    except Exception as error:  # noqa: BLE001 - transformers' own failures, for a model it builds its own way
        said = " ".join(str(error).split())
        if isinstance(error, ValueError) and source.attention != "eager" and (
                "attn_implementation" in said or "scaled_dot_product_attention" in said):
            raise ValueError(
                f"{source.label}: transformers offers no SDPA attention for {type(config).__name__} (it runs attention "
                "code of its own, or none: a state-space model), which the estimate traces by default (as "
                "FlashAttention); pass --explicit-attention to trace its own attention code (eager). A state-space or "
                "recurrent model (Mamba, RWKV, xLSTM) has no attention to trace that way: measure it with `remat "
                "profile path/to/file.py:build` at a size that runs here.") from None
        if isinstance(error, ValueError) and _raised_in_remat(error):
            raise  # remat's own refusal (a causal LM the config has not), already in words
        raise ValueError(
            f"{source.label}: {type(config).__name__} cannot be built on the meta device as the estimate builds it "
            f"({how}): {type(error).__name__}: {said[:300].rstrip('.')}. Estimate it from a "
            "file.py:build that builds the whole model (--model path/to/file.py:build), or measure it with `remat "
            "profile` at a size that runs here.") from error
    if source.lora_rank:
        from remat.models.lora import add_lora

        add_lora(model, source.lora_rank, targets=source.lora_targets, dropout=source.lora_dropout)
        if source.quantize:
            from remat.models.qlora import quantize_base

            quantize_base(model)
    return model


def _trace_encoder_decoder(source: ModelSource, config: Any, *, seq_len: int, dtype: torch.dtype,
                           fused: bool) -> Traced:
    """An encoder-decoder (`is_encoder_decoder`): its seq2seq LM with three layers per stack
    (`encoder_decoder_kinds`), both stacks at ``seq_len`` tokens; what runs between the stacks counts
    once, before the layers (`remat.estimate.dataflow.classify`'s ``stack_ends``), and so does the
    encoder's output, which every decoder layer reads."""
    encoder, decoder = stack_layers(config)
    check_num_layers(encoder + decoder, source.label)
    if traced_layer_values(config, encoder) or traced_layer_values(config, decoder):
        raise ValueError(f"{source.label}: {type(config).__name__} is an encoder-decoder whose layers are of several "
                         "kinds; the estimate copies one layer per stack. Estimate it from a file.py:build that builds "
                         "the whole model (--model path/to/file.py:build).")
    per_stack, kinds, checked = encoder_decoder_kinds(encoder, decoder)
    model = _build(source, config, per_stack, dtype, f"{per_stack} layers per stack, then copied")
    blocks = find_blocks(model)
    te = min(per_stack, encoder)
    if len(blocks) != te + min(per_stack, decoder):
        raise ValueError(
            f"{source.label}: remat finds {len(blocks)} blocks in {type(model).__name__} built with {te} encoder and "
            f"{min(per_stack, decoder)} decoder layers ({', '.join(n for n, _ in blocks[:8])}); the estimate copies "
            "each stack's layers and needs them found as its blocks. Estimate it from a file.py:build that builds the "
            "whole model (--model path/to/file.py:build).")
    _check_positions(model, source.label, seq_len, skip=model.get_encoder() if speech_features(config) else None)
    batch_at = lambda b: hf_batch(config, micro_batch=b, seq_len=seq_len, dtype=dtype)  # noqa: E731
    tracer = _tracer(model, batch_at, None, fused, getattr(config, "base_model_tp_plan", None),
                     stack_ends=frozenset({te - 1}))
    facts, shape = _hf_facts(config)
    features = speech_features(config)
    over = (f"the encoder over {features[1]} frames of {features[0]} mel bins, the decoder over --seq tokens"
            if features else "each of --seq tokens")
    label = f"{source.label} (encoder-decoder: {encoder} encoder and {decoder} decoder layers, {over})"
    traced = _describe(label, model, tracer, kinds, seq_len, facts=facts, shape=shape, encoder_layers=encoder,
                       checked=checked)
    _check_copies(traced.label, traced.param_count,
                  _build(source, config, max(encoder, decoder), dtype, "whole, to count its parameters"))
    return traced


def _trace_speech_encoder(source: ModelSource, config: Any, *, seq_len: int, dtype: torch.dtype,
                          fused: bool) -> Traced:
    """A speech encoder trained with CTC (`remat.estimate.sources.speech_ctc`): transformers' CTC model
    over the audio samples that make ``seq_len`` frames (`audio_samples`), its CTC loss priced by
    `ctc_loss_fn`. Each layer of the convolutional feature encoder is traced as itself (their
    kernels, strides and norms differ), then the first transformer layer, then two more, the
    second of them copied to the rest."""
    full = num_layers(config)
    check_num_layers(full, source.label)
    if traced_layer_values(config, full):
        raise ValueError(f"{source.label}: {type(config).__name__} is a speech encoder whose layers are of several "
                         "kinds; the estimate copies one layer. Estimate it from a file.py:build that builds the "
                         "whole model (--model path/to/file.py:build).")
    traced = min(3, full)
    model = _build(source, config, traced, dtype, f"its feature encoder and {traced} layers, copied")
    if "input_values" not in inspect.signature(model.forward).parameters:
        raise ValueError(f"{source.label}: {type(model).__name__} takes no input_values (raw audio); the estimate "
                         "prices CTC encoders of raw audio (wav2vec 2.0, HuBERT, WavLM). Measure it with `remat profile "
                         "path/to/file.py:build` at a size that runs here.")
    blocks = find_blocks(model)
    stack = blocks[-1][0].rsplit(".", 1)[0]
    layers = [i for i, (name, _) in enumerate(blocks) if name.rsplit(".", 1)[0] == stack]
    others = len(blocks) - traced
    if layers != list(range(others, len(blocks))):
        raise ValueError(
            f"{source.label}: remat finds {len(blocks)} blocks in {type(model).__name__} built with {traced} layers, "
            f"the last {len(layers)} of them in {stack} ({', '.join(n for n, _ in blocks[:10])}); the estimate copies "
            "the layers and needs them found as the last blocks. Estimate it from a file.py:build that builds the "
            "whole model (--model path/to/file.py:build).")
    # the feature encoder's convolutions (and a positional convolution's, Data2Vec-audio's) each as itself
    kinds = tuple(range(others)) + (others,) + (others + traced - 1,) * (full - 1)
    checked = (others + traced - 1,) if traced == 3 else ()
    register_meta_ctc_kernels()
    batch_at = lambda b: hf_batch(config, micro_batch=b, seq_len=seq_len, dtype=dtype)  # noqa: E731
    tracer = _tracer(model, batch_at, ctc_loss_fn(config, model), fused, getattr(config, "base_model_tp_plan", None))
    facts, shape = _hf_facts(config)
    samples = audio_samples(config, seq_len)
    label = (f"{source.label} (a speech encoder, trained with CTC over {samples} audio samples: {seq_len} frames a "
             f"layer (--seq), a target every {CTC_FRAMES_PER_TARGET} frames; its {others} convolutional blocks "
             "counted as layers)")
    described = _describe(label, model, tracer, kinds, None, facts=facts, shape=shape, checked=checked,
                          outside_grads_between=True)
    whole = _build(source, config, full, dtype, "whole, to count its parameters")
    described = replace(described, param_shapes=_outside_from(described, whole))
    _check_copies(described.label, described.param_count, whole)
    return described


def _run_order(model: nn.Module, batch: Mapping[str, Any]) -> list[tuple[str, nn.Module]]:
    """The model's blocks in the order a forward on the meta device first calls them (CLIP runs its
    vision tower first, though its text tower comes first among its modules)."""
    blocks = find_blocks(model)
    called: list[int] = []
    handles = [module.register_forward_pre_hook(lambda *_, i=i: called.append(i)) for i, (_, module) in enumerate(blocks)]
    try:
        _meta_forward(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    order = list(dict.fromkeys(called))
    return [blocks[i] for i in order] + [b for i, b in enumerate(blocks) if i not in set(order)]


def _trace_two_towers(source: ModelSource, config: Any, *, seq_len: int, dtype: torch.dtype, fused: bool) -> Traced:
    """A two-tower model trained contrastively (`remat.estimate.sources.two_towers`: CLIP, SigLIP):
    transformers' model with its contrastive loss (``return_loss``) over a batch of images at the
    vision config's size and texts of ``seq_len`` tokens, three layers per tower traced as an
    encoder-decoder's stacks are (`encoder_decoder_kinds`), the towers in the order the forward runs
    them; what runs between them counts once, before the layers."""
    towers = {name: getattr(config, name) for name in two_towers(config)}
    counts = {name: sub.num_hidden_layers for name, sub in towers.items()}
    for name, sub in towers.items():
        check_num_layers(counts[name], f"{source.label} ({name})")
        if traced_layer_values(sub, counts[name]):
            raise ValueError(f"{source.label}: the {name} tower's layers are of several kinds; the estimate copies one "
                             "layer per tower. Estimate it from a file.py:build that builds the whole model "
                             "(--model path/to/file.py:build).")
    per_tower = max(min(3, max(counts.values())), 1)
    model = _build(source, config, per_tower, dtype, f"{per_tower} layers per tower, then copied")
    batch_at = lambda b: hf_batch(config, micro_batch=b, seq_len=seq_len, dtype=dtype)  # noqa: E731
    vision = model.vision_model if isinstance(getattr(model, "vision_model", None), nn.Module) else None
    _check_positions(model, source.label, seq_len, skip=vision)
    blocks = _run_order(model, batch_at(1))
    vision_blocks = {id(m) for m in vision.modules()} if vision is not None else set()
    first_is_vision = id(blocks[0][1]) in vision_blocks
    first, second = (("vision_config", "text_config") if first_is_vision else ("text_config", "vision_config"))
    traced_first = sum(1 for _, m in blocks if (id(m) in vision_blocks) == first_is_vision)
    if traced_first != min(per_tower, counts[first]) or len(blocks) != traced_first + min(per_tower, counts[second]):
        raise ValueError(
            f"{source.label}: remat finds {len(blocks)} blocks in {type(model).__name__} built with {per_tower} layers "
            f"per tower ({', '.join(n for n, _ in blocks[:8])}); the estimate copies each tower's layers and needs them "
            "found as its blocks. Estimate it from a file.py:build that builds the whole model "
            "(--model path/to/file.py:build).")
    _, kinds, checked = encoder_decoder_kinds(counts[first], counts[second], per_tower)
    tracer = _tracer(model, batch_at, None, fused, None, stack_ends=frozenset({traced_first - 1}), blocks=blocks)
    text, image = towers["text_config"], towers["vision_config"]
    heads = math.gcd(int(getattr(text, "num_attention_heads", 0) or 0), int(getattr(image, "num_attention_heads", 0) or 0))
    size = image.image_size
    label = (f"{source.label} (two towers, trained contrastively: {counts['vision_config']} vision layers over "
             f"{size} x {size} images and {counts['text_config']} text layers over --seq tokens, the "
             f"{first.split('_')[0]} tower first)")
    traced = _describe(label, model, tracer, kinds, seq_len, blocks=blocks, shape=ModelShape(heads=heads, kv_heads=heads),
                       encoder_layers=counts[first], checked=checked, whole_batch_loss=True)
    _check_copies(traced.label, traced.param_count,
                  _build(source, config, max(counts.values()), dtype, "whole, to count its parameters"))
    return traced


def _copied_count(model: nn.Module, kinds: tuple[int, ...]) -> int:
    """Parameters of the full model as the copies of ``model``'s traced layers count them
    (``kinds``: the traced layer of each layer), from the shapes alone: what `Traced.param_count`
    gives after a trace."""
    shapes = _unique_shapes(model)
    blocks = find_blocks(model)
    names = [name + "." for name, _ in blocks]
    per_layer = [sum(math.prod(shape) for n, shape in shapes.items() if n.startswith(prefix)) for prefix in names]
    outside = sum(math.prod(shape) for n, shape in shapes.items() if not n.startswith(tuple(names)))
    quantized = [_quantized_elements(block) for _, block in blocks]
    return (outside + sum(per_layer[k] for k in kinds) + _quantized_elements(model) - sum(quantized)
            + sum(quantized[k] for k in kinds))


def _check_copies(label: str, copied: int, whole: nn.Module) -> None:
    """Refuse a model whose copied layers do not add up to its own parameters (built whole on the
    meta device, which costs no memory): its later layers differ from the traced ones in a way no
    config list names (NLLB-MoE's and Switch Transformers' experts every ``sparse_step`` layers)."""
    count = sum(p.numel() for p in whole.parameters()) + _quantized_elements(whole)
    if copied != count:
        why = ("its layers differ beyond the ones traced (a mixture of experts every few layers, as NLLB-MoE's "
               "sparse_step), or it has layers beside the ones its config counts (an image encoder's)"
               if copied < count else
               "it has fewer layers' weights than layers it runs (a module run several times with the same weights, as "
               "HRM's reasoning modules), or its layers differ beyond the ones traced")
        raise ValueError(
            f"{label}: copying its traced layers counts {copied:,} parameters and the model has "
            f"{count:,}: {why}. Estimate it from a file.py:build that builds the whole model "
            "(--model path/to/file.py:build).")


def _check_positions(model: nn.Module, label: str, seq_len: int | None, skip: nn.Module | None = None) -> None:
    """Refuse a sequence longer than a learned position table (GPT-2's ``wpe``, BERT's and
    RoBERTa's ``position_embeddings``): the step fails there on a GPU, where the meta device,
    which checks no index, traced it. ``skip``: a part whose positions are not the tokens' (a
    speech encoder's, over its frames)."""
    if not seq_len:
        return
    skipped = set(skip.modules()) if skip is not None else set()
    for name, module in model.named_modules():
        if module in skipped:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Embedding) and ("position" in leaf or leaf == "wpe"):
            # RoBERTa's positions start after its padding index
            usable = module.num_embeddings - (module.padding_idx + 1 if module.padding_idx is not None else 0)
            if seq_len > usable:
                raise ValueError(
                    f"{label}: --seq {seq_len} is longer than the {usable} learned positions of {name} "
                    f"({type(model).__name__}): a training step at that length fails on any device; pass --seq "
                    f"{usable} or less, or a config with more positions (max_position_embeddings, n_positions).")


def _check_experts_dtype(model: nn.Module, label: str, dtype: torch.dtype) -> None:
    """transformers runs stacked routed experts (one 3-d weight for all of them) with
    ``grouped_mm``, whose kernel takes bfloat16 only, on a GPU as on the meta device: in another
    dtype the trace raised from inside transformers."""
    if dtype == torch.bfloat16:
        return
    experts = next((name for name, p in model.named_parameters() if p.dim() == 3 and "expert" in name), None)
    if experts is not None:
        raise ValueError(
            f"{label} runs its routed experts ({experts.rsplit('.', 1)[0]}) with grouped_mm, whose kernel takes bfloat16 "
            f"only, and the estimate is asked for {str(dtype).removeprefix('torch.')}: estimate it with --dtype bf16, "
            "the dtype such models train in (with fp32 master weights unless --no-master-weights).")


def _trace_builtin(source: ModelSource, *, seq_len: int, dtype: torch.dtype, layers: int, fused: bool) -> Traced:
    from remat.models import SIZE_OPTIONS, build, model_sizes

    known = model_sizes(source.builtin)
    layer_key = next((k for k in SIZE_OPTIONS["layers"] if k in known), None)
    if layer_key is None or "batch_size" not in known:
        raise ValueError(f"built-in model {source.builtin!r} has no layer count or batch size to vary; "
                         "estimate it from a file.py:build instead.")
    sizes = dict(source.sizes)
    full = int(sizes.pop(layer_key, known[layer_key]))
    check_num_layers(full, f"--model {source.builtin}")
    if "seq_len" in known:
        sizes["seq_len"] = seq_len
    traced = min(layers, full)
    built = {}

    def make(micro_batch: int) -> Any:
        if micro_batch not in built:
            with torch.device("meta"):
                built[micro_batch] = build(source.builtin, optimizer="none", batch_size=micro_batch,
                                           **{layer_key: traced}, **sizes)
            built[micro_batch].model.to(dtype)
        return built[micro_batch]

    def trace(micro_batch: int) -> tuple[Profile, Classified]:
        one = make(micro_batch)
        return _tracer(one.model, lambda _: _cast_batch(one.batch, dtype), one.loss_fn, fused, None)(micro_batch)

    heads = int(sizes.get("num_heads", known.get("num_heads", 0)) or 0)
    return _describe(source.builtin, make(1).model, trace, (traced - 1,) * full,
                     seq_len if "seq_len" in known else None, shape=ModelShape(heads=heads, kv_heads=heads))


def _cast_batch(batch: Any, dtype: torch.dtype) -> Any:
    """Floating-point batch tensors in ``dtype`` (token ids and masks unchanged)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {k: _cast_batch(v, dtype) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_cast_batch(v, dtype) for v in batch)
    return batch


def _trace_file(source: ModelSource, dtype: torch.dtype, fused: bool) -> Traced:
    from remat.models import load_target

    with torch.device("meta"):
        built = load_target(source.file)
    built.model.to(dtype)
    batch = _cast_batch(built.batch, dtype)
    try:
        find_blocks(built.model)
    except ValueError as error:
        said = _without_advice(error)
        raise ValueError(
            f"{source.file}: the estimate finds the layers it plans from the model's structure alone, and {said}. A model "
            "that runs one layer at several depths or time steps (a Universal Transformer, ALBERT, a recurrent cell) is "
            f"measured and planned call by call on a device it runs on: `remat run --model {source.file}` (or `remat "
            "profile`) at a size that runs here.") from None
    tracer = _tracer(built.model, lambda _: batch, built.loss_fn, fused, None)
    count = len(find_blocks(built.model))
    optimizer = optimizer_name_of(built.optimizer) if built.optimizer is not None else None
    return _describe(source.file, built.model, tracer, tuple(range(count)), None, whole=True, optimizer_name=optimizer)


__all__ = ["DTYPES", "ModelShape", "TRACE_CACHE_SIZE", "TRACED_MICRO_BATCHES", "Traced", "check_alike", "clear_trace_cache",
           "dtype_of", "encoder_decoder_kinds", "hf_layer_kinds", "trace_profile", "trace_source", "traced_layer_values"]
