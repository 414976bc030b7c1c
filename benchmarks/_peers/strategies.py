"""The peers: what people use today to trade compute for activation memory.

Each peer is a small frozen dataclass with one verb, ``prepare(model) -> callable module``.
Eager peers change the model in place and return it; compiled peers return the
`torch.compile` wrapper. A peer that cannot run here raises `PeerUnavailable` with the exact reason.
"""

from __future__ import annotations

import abc

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
)

from benchmarks._peers.workloads import block_list, recipe_blocks

EAGER = "eager"
COMPILED = "compile"


class PeerUnavailable(RuntimeError):
    """The peer cannot run on this machine; the message says exactly what stops it."""


@dataclass(kw_only=True, frozen=True)
class Peer(abc.ABC):
    """A strategy to compare against; subclasses implement `prepare`."""

    name: str
    """Row label in the tables."""
    mode: str = EAGER
    """Execution mode: ``eager`` or ``compile``; remat is compared within the same mode."""

    @abc.abstractmethod
    def prepare(self, model: nn.Module, batch: Any) -> nn.Module:
        """The model with this strategy applied (in place or wrapped)."""

    def describe(self) -> str:
        """One line for the table: what the peer does."""
        return (type(self).__doc__ or "").strip().splitlines()[0]


@dataclass(kw_only=True, frozen=True)
class NoRecompute(Peer):
    """Autograd keeps everything it saves: the reference for time and gradients."""

    def prepare(self, model: nn.Module, batch: Any) -> nn.Module:
        return model


class _Checkpointed(nn.Module):
    """A block whose forward runs under non-reentrant `torch.utils.checkpoint`."""

    def __init__(self, block: nn.Module, context_fn: Callable[[], Any] | None = None) -> None:
        super().__init__()
        self.block = block
        self.context_fn = context_fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.context_fn is None:
            return checkpoint(self.block, *args, use_reentrant=False, **kwargs)
        return checkpoint(self.block, *args, use_reentrant=False, context_fn=self.context_fn, **kwargs)


def _wrap_blocks(model: nn.Module, context_fn: Callable[[], Any] | None = None) -> None:
    """Every block of every innermost stack (`workloads.recipe_blocks`) under its own checkpoint."""
    for name, block in recipe_blocks(model):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        parent._modules[attr] = _Checkpointed(block, context_fn)


@dataclass(kw_only=True, frozen=True)
class PerBlockCheckpoint(Peer):
    """Full checkpointing of every block, as Hugging Face applies it.

    HF models: ``model.gradient_checkpointing_enable()`` with its defaults. Built-in models:
    each block of every innermost stack (`workloads.recipe_blocks`: a U-Net's down and up blocks)
    wrapped in non-reentrant `torch.utils.checkpoint` (what HF's layer does).
    """

    def prepare(self, model: nn.Module, batch: Any) -> nn.Module:
        # transformers 5 names it activation_checkpointing_enable (the old name warns, goes in v6)
        enable = getattr(model, "activation_checkpointing_enable", None) or getattr(model, "gradient_checkpointing_enable", None)
        if enable is not None:
            enable()
        else:
            _wrap_blocks(model)
        return model

    def describe(self) -> str:
        return "HF: gradient_checkpointing_enable(); built-ins: checkpoint(use_reentrant=False) per block"


class _BlockCall(nn.Module):
    """One block with the extra arguments of this forward bound: ``x -> block(x, *args, **kwargs)``."""

    def __init__(self, block: nn.Module, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.block, self.args, self.kwargs = block, args, kwargs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x, *self.args, **self.kwargs)


class _SequentialChain(nn.Module):
    """All blocks as one chain run by `checkpoint_sequential` (stands in for the block list)."""

    def __init__(self, blocks: nn.ModuleList, num_segments: int) -> None:
        super().__init__()
        self.blocks = blocks
        self.num_segments = num_segments

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls = [_BlockCall(block, args, kwargs) for block in self.blocks]
        return checkpoint_sequential(calls, self.num_segments, x, use_reentrant=False)


def sqrt_segments(num_blocks: int) -> int:
    """``round(sqrt(N))`` segments, at least 1 (Chen et al. 2016, the sqrt(N) schedule)."""
    return max(1, round(math.sqrt(num_blocks)))


@dataclass(kw_only=True, frozen=True)
class SqrtSequential(Peer):
    """`checkpoint_sequential` over the blocks with sqrt(N) segments.

    The blocks form a chain: each takes the previous block's output as its first argument
    (the models' forwards loop ``x = block(x, ...)``). The block list is replaced by a
    one-element list holding a chain module, so the model's own loop calls the chain once with
    the first block's input and the shared extra arguments (HF: mask, positions). As in
    `checkpoint_sequential`, the last segment is not checkpointed.
    """

    def prepare(self, model: nn.Module, batch: Any) -> nn.Module:
        parent, attr, blocks = block_list(model)
        chain = _SequentialChain(blocks, sqrt_segments(len(blocks)))
        setattr(parent, attr, nn.ModuleList([chain]))
        return model

    def describe(self) -> str:
        return "blocks chained x -> block(x, ...), round(sqrt(N)) segments, last one kept"


def _ops(*names: str) -> frozenset:
    """Op overloads by ``namespace.op.overload`` name; names this torch build lacks are skipped."""
    found = []
    for name in names:
        namespace, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None and hasattr(packet, overload):
            found.append(getattr(packet, overload))
    return frozenset(found)


# torchtitan's op save list (torchtitan/distributed/activation_checkpoint.py, ``_save_list``),
# plus the CPU flash-attention kernel SDPA dispatches to on this device.
TITAN_SAVE_OPS = _ops(
    "aten.mm.default",
    "aten.addmm.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_attention_math.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "aten.max.default",
)
# The matmuls of the every-other rule. torchtitan's models have bias-free Linears, which
# dispatch to aten.mm; the built-in models' Linears carry a bias and dispatch to aten.addmm,
# so addmm counts as mm here.
TITAN_MM_OPS = _ops("aten.mm.default", "aten.addmm.default")


def titan_policy(meta: dict[str, int]) -> Callable[..., CheckpointPolicy]:
    """torchtitan's selective policy: save the listed ops' outputs except every second matmul."""

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        key = "recompute_mm_count" if ctx.is_recompute else "forward_mm_count"
        if func in TITAN_MM_OPS:
            meta[key] += 1
        save = func in TITAN_SAVE_OPS and not (func in TITAN_MM_OPS and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _titan_context() -> Any:
    return create_selective_checkpoint_contexts(titan_policy(defaultdict(int)))


@dataclass(kw_only=True, frozen=True)
class TitanSelective(Peer):
    """torchtitan's op-level selective checkpointing, one checkpoint per block."""

    def prepare(self, model: nn.Module, batch: Any) -> nn.Module:
        _wrap_blocks(model, _titan_context)
        return model

    def describe(self) -> str:
        return "per block: save mm/addmm/SDPA outputs except every 2nd matmul, recompute the rest"


class _CoreCheckpoint:
    """An attention core's forward (q @ k^T, scale, mask, softmax, dropout, @ v) under
    non-reentrant `torch.utils.checkpoint`; an instance attribute, so the class keeps its own."""

    def __init__(self, core: Callable[..., torch.Tensor]) -> None:
        self.core = core

    def __call__(self, *args: Any) -> torch.Tensor:
        return checkpoint(self.core, *args, use_reentrant=False)


@dataclass(kw_only=True, frozen=True)
class AttentionCoreCheckpoint(Peer):
    """Megatron-LM's selective recomputation: only the attention core is checkpointed.

    Megatron (``--recompute-granularity selective``) runs its ``core_attention`` under its
    checkpoint and keeps everything else. Here: the built-in GPT's explicit attention core
    (`remat.models.gpt.AttentionCore`, from q, k and v) under non-reentrant `checkpoint`.
    """

    def prepare(self, model: nn.Module, batch: Any) -> nn.Module:
        from remat.models.gpt import CausalSelfAttention

        cores = [m for m in model.modules() if isinstance(m, CausalSelfAttention) and m.attention == "explicit"]
        if not cores:
            raise PeerUnavailable(
                f"{type(model).__name__} has no explicit attention core to checkpoint (the recipe is written "
                "for the built-in GPT with attention='explicit')"
            )
        for module in cores:
            module.core.forward = _CoreCheckpoint(type(module.core).forward.__get__(module.core))
        return model

    def describe(self) -> str:
        return "checkpoint(use_reentrant=False) around each attention core (q k^T ... softmax, dropout, @ v)"


def budget_backend(budget: float) -> Callable[..., Any]:
    """An inductor backend that partitions with ``activation_memory_budget=budget``.

    A distinct backend object per compiled model keeps dynamo's caches apart (it guards on the
    backend), so each model is partitioned under its own budget.
    """
    from torch._inductor.compile_fx import compile_fx

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return compile_fx(gm, example_inputs)

    return backend


def compile_module(model: nn.Module, budget: float = 1.0) -> nn.Module:
    """``torch.compile(model)`` with inductor under the given activation memory budget."""
    return torch.compile(model, backend=budget_backend(budget))


@dataclass(kw_only=True, frozen=True)
class CompileBudget(Peer):
    """torch.compile with `torch._functorch.config.activation_memory_budget` (1.0: no budget)."""

    budget: float = 1.0
    """Fraction of the activation memory of the default partition that may be kept."""
    mode: str = COMPILED

    def prepare(self, model: nn.Module, batch: Any) -> nn.Module:
        return compile_module(model, self.budget)

    def describe(self) -> str:
        return f"inductor, activation_memory_budget={self.budget}"


@dataclass(kw_only=True, frozen=True)
class Rockmate(Peer):
    """Rockmate 2.0.0 from PyPI at a byte budget (``rockmate.Rockmate(model, inputs, budget)``)."""

    budget_bytes: int | None = None
    """The budget Rockmate plans for."""

    def prepare(self, model: nn.Module, batch: Any) -> nn.Module:
        try:
            import rockmate
        except Exception as exc:  # any failure to import is the reason it cannot run
            raise PeerUnavailable(f"`import rockmate` fails: {type(exc).__name__}: {exc}") from exc
        if not torch.cuda.is_available():
            raise PeerUnavailable("Rockmate 2.0.0 hard-codes torch.device('cuda'); no CUDA device here")
        return rockmate.Rockmate(model, batch, budget=self.budget_bytes)

    def describe(self) -> str:
        return "Rockmate 2.0.0 (PyPI)"


def default_peers(*, with_compile: bool, compile_budgets: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7)) -> list[Peer]:
    """Every peer of the comparison, eager first; ``compile_budgets``: the activation memory
    budgets of the compiled peers besides plain ``compile`` (1.0)."""
    peers: list[Peer] = [
        NoRecompute(name="none"),
        PerBlockCheckpoint(name="per-block checkpoint"),
        SqrtSequential(name="checkpoint_sequential sqrt(N)"),
        TitanSelective(name="torchtitan selective"),
        AttentionCoreCheckpoint(name="Megatron attention core"),
        Rockmate(name="rockmate 2.0.0"),
    ]
    if with_compile:
        peers.append(CompileBudget(name="compile", budget=1.0))
        peers += [CompileBudget(name=f"compile budget {b}", budget=b) for b in compile_budgets]
    return peers
