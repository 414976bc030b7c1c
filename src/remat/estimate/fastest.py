"""How to train a model on N GPUs of one kind: the fastest layouts that fit.

`search` traces the model once (`remat.estimate.trace`) and prices every layout of the space
(`SearchSpace`): tensor parallelism t (with sequence parallelism when t > 1: it moves the same
bytes as t's all-reduces and holds less, Korthikanti et al. 2022, section 4.2.2), pipeline
parallelism p (1F1B, and interleaved with v = 2 where the micro-batches allow; where p does not
divide the layers, an uneven split with the first and last stages lighter,
`remat.estimate.parallel.uneven_split`), context
parallelism c, expert parallelism e (MoE models), data parallelism d = N / (t p c), ZeRO stage
(1 = Megatron-LM's distributed optimizer, 3 = FSDP), micro-batch b with ``m = G / (d b)``
micro-batches per step for a global batch of G sequences; and per layout every recomputation
strategy (`remat.estimate.strategies`: none, selective, full and the optimal per-layer mix with
offload), with the head and loss kept as the model runs them or chunked (`remat.estimate.head`:
``chunked`` at its default chunk; one more projection in the backward, the full logits never
held). It keeps the fastest strategy and head that fit per layout and returns the fastest layouts.

Step time is the model of `remat.estimate.pricing`: ``m`` micro-batches of (forward + backward +
replayed FLOPs) / (MFU x peak FLOP/s) plus the communication of `remat.estimate.comms` at the
device table's link bandwidths, the pipeline bubble, and the optimizer step at memory
bandwidth. Tensor and context parallelism stay inside a node (their collectives run every
layer); a layout whose model state alone does not fit is dropped before its activations are
priced.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

from remat.estimate.devices import DeviceSpec, resolve_devices
from remat.estimate.head import check_head, head_candidates
from remat.estimate.parallel import Parallelism, uneven_split
from remat.estimate.pricing import Pricing
from remat.estimate.sharding import StateRecipe
from remat.estimate.api import precision_name
from remat.estimate.sources import ModelSource, as_source
from remat.estimate.strategies import STRATEGY_NAMES
from remat.estimate.trace import Traced, trace_source
from remat.memory.allowance import Allowance
from remat.memory.optimizer_state import optimizer_layout

_TENSOR = (1, 2, 4, 8)
_CONTEXT = (1, 2, 4, 8)
_MICRO_BATCH = (1, 2, 4, 8)
_ZERO = (1, 3)


@dataclass(kw_only=True, frozen=True)
class SearchSpace:
    """The layouts `search` prices."""

    gpus: int
    """GPUs of the job."""
    global_batch: int
    """Sequences per optimizer step."""
    seq_len: int
    """Tokens per sequence."""
    tensor: tuple[int, ...] = _TENSOR
    """Tensor-parallel sizes tried (those above the GPUs of a node are skipped)."""
    context: tuple[int, ...] = _CONTEXT
    """Context-parallel sizes tried (t x c stays inside a node)."""
    micro_batch: tuple[int, ...] = _MICRO_BATCH
    """Micro-batches tried."""
    zero: tuple[int, ...] = _ZERO
    """ZeRO stages tried."""
    max_pipeline: int = 32
    """Largest pipeline size tried."""

    def __post_init__(self) -> None:
        for name in ("gpus", "global_batch", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")


@dataclass(kw_only=True, frozen=True)
class Candidate:
    """One layout that fits, with its fastest strategy."""

    parallelism: Parallelism
    """The layout (data = GPUs / (t p c))."""
    zero_stage: int
    """ZeRO stage over the data-parallel ranks."""
    micro_batch: int
    """Sequences per micro-batch."""
    micro_batches: int
    """Micro-batches per step per pipeline."""
    strategy: str
    """The fastest strategy that fits, as `remat.estimate.strategies.Choice.label` says it."""
    peak_bytes: int
    """Predicted allocated peak per GPU."""
    step_s: float
    """Predicted step time."""
    tokens_per_s_per_gpu: float
    """Global batch tokens / step time / GPUs."""
    mfu: float
    """Model FLOPs of the step (forward + backward, no recomputation) / (step time x GPUs x peak)."""
    head: str = "keep"
    """How the head and loss run (`remat.estimate.head`)."""


def layouts(space: SearchSpace, traced: Traced, gpus_per_node: int) -> Iterator[tuple[Parallelism, int, int]]:
    """Every (layout, micro-batch, micro-batches per step) of ``space`` the model can be split by."""
    layers, experts = traced.num_layers, traced.shape.experts
    for t in space.tensor:
        if t > gpus_per_node or not _divides_heads(traced, t) or (t > 1 and traced.quantized):
            continue
        for c in space.context:
            if t * c > gpus_per_node or space.seq_len % c or space.gpus % (t * c) or (c > 1 and (traced.encoder_layers or traced.tokens)):
                continue
            for p in range(1, min(space.max_pipeline, layers) + 1):
                if space.gpus % (t * c * p) or (p > 1 and traced.encoder_layers):
                    continue
                d = space.gpus // (t * c * p)
                for ends in _stage_ends(layers, p):
                    # the experts fold into a stage's t x c x d ranks split t ways (their tensor
                    # parallelism is the layers'): e must divide c x d (`Parallelism.check_experts`)
                    for e in _expert_sizes(experts, c * d):
                        par = Parallelism(data=d, tensor=t, sequence_parallel=t > 1, pipeline=p, context=c, expert=e,
                                          first_stage_layers=ends[0], last_stage_layers=ends[1])
                        yield from _batches(space, par, layers, traced.whole_batch_loss)


def _stage_ends(layers: int, p: int) -> list[tuple[int | None, int | None]]:
    """(first, last) stage layers to try with ``p`` stages: even where ``p`` divides the layers;
    else `remat.estimate.parallel.uneven_split` (the stages between at ``ceil(L/p)``), each way
    round when the first and the last differ; none when no split exists."""
    if layers % p == 0:
        return [(None, None)]
    split = uneven_split(layers, p)
    if split is None:
        return []
    return list(dict.fromkeys([split, split[::-1]]))


def _divides_heads(traced: Traced, t: int) -> bool:
    shape = traced.shape
    return all(not v or v % t == 0 for v in (shape.heads, shape.kv_heads))


def _expert_sizes(experts: int, ranks: int) -> list[int]:
    if not experts:
        return [1]
    return [e for e in (1, 2, 4, 8, 16, 32, 64) if experts % e == 0 and ranks % e == 0]


def _batches(space: SearchSpace, par: Parallelism, layers: int,
             one_per_step: bool = False) -> Iterator[tuple[Parallelism, int, int]]:
    if one_per_step:  # the loss couples the batch (CLIP's): the rank's whole share in one micro-batch
        if space.global_batch % par.data == 0:
            yield par, space.global_batch // par.data, 1
        return
    for b in space.micro_batch:
        if space.global_batch % (par.data * b):
            continue
        m = space.global_batch // (par.data * b)
        yield par, b, m
        if par.pipeline > 1 and m % par.pipeline == 0 and all(n % 2 == 0 for n in par.stage_sizes(layers)):
            yield replace(par, virtual_stages=2), b, m


def search(traced: Traced, spec: DeviceSpec, space: SearchSpace, *, recipe: StateRecipe, mfu: float,
           allowance: Allowance, network_bytes_per_s: float | None = None, top: int = 5,
           heads: tuple[str, ...] | None = None) -> list[Candidate]:
    """The ``top`` fastest layouts of ``space`` that fit ``spec``, fastest first (module docstring);
    ``heads``: the head strategies tried (default `remat.estimate.head.head_candidates`)."""
    if not traced.scalable:
        raise ValueError(f"search varies the micro-batch; {traced.label} is a file model with a fixed batch. "
                         "Estimate it with fixed options instead, or build it from sizes (--model, --hf, --config).")
    budget = allowance.max_allocated_bytes(spec.memory_bytes)
    found: list[Candidate] = []
    for par, b, m in layouts(space, traced, spec.gpus_per_node or 8):
        for zero in space.zero:
            pricing = Pricing(traced=traced, micro_batch=b, micro_batches=m, recipe=replace(recipe, zero_stage=zero),
                              parallelism=par, mfu=mfu, allowance=allowance, strategies=STRATEGY_NAMES,
                              network_bytes_per_s=network_bytes_per_s)
            bound = found[top - 1].step_s if len(found) >= top else math.inf
            best = _fastest_head(pricing, heads or head_candidates(traced.head), spec, budget, bound)
            if best is not None:
                found = sorted([*found, _candidate(best[0], spec, space, *best[1:])], key=lambda c: c.step_s)
    return found[:top]


def _fastest_head(pricing: Pricing, heads: tuple[str, ...], spec: DeviceSpec, budget: int, bound: float):
    """(pricing with its head, strategy label, peak, step s) of the fastest head and strategy that
    fit, None when none does or beats ``bound``; a head that fits with no recomputation ends the
    search (the heads come fastest first: keep, then chunked)."""
    best = None
    for head in heads:
        pricing = pricing.with_head(head)  # shares the traced shares and model state of the one before
        one = _fastest(pricing, spec, budget, bound if best is None else min(bound, best[3]))
        if one is not None and (best is None or one[2] < best[3]):
            best = (pricing, *one[:3])
            if one[3] == "none":
                break
    return best


def _fastest(pricing: Pricing, spec: DeviceSpec, budget: int, bound: float):
    """(strategy label, peak, step s, strategy name) of the fastest strategy that fits, None when
    none does or when it cannot beat ``bound``: every strategy adds time to no recomputation
    (replays, transfers; more backward hides no more data-parallel traffic than it adds), so
    ``none``'s step is a lower bound, and when ``none`` fits it is the fastest."""
    if any(pricing.state(k).total_bytes > budget for k in pricing.stage_indices()):
        return None
    best = None
    for name in ("none", "selective", "full", "optimal"):
        priced = pricing.price(spec, name, pricing.micro_batch, budget)
        if name == "none" and priced.time.total_s >= bound:
            return None
        peak = max(p.peak_bytes for p in priced.peaks)
        if peak <= budget and (best is None or priced.time.total_s < best[2]):
            best = (_label(priced), int(peak), priced.time.total_s, name)
            if name == "none":
                return best
    return best


def _label(priced) -> str:
    """The strategy of every stage priced, once when they agree (``first: ...; last: ...``
    otherwise, with ``between: ...`` for the stages between of an uneven split)."""
    labels = [c.label for c in priced.choices]
    if len(set(labels)) == 1:
        return labels[0]
    names = ["first" if s.first else "last" if s.last else "between" for s in priced.stages]
    return "; ".join(f"{n}: {label}" for n, label in zip(names, labels))


def _candidate(pricing: Pricing, spec: DeviceSpec, space: SearchSpace, label: str, peak: int, step_s: float) -> Candidate:
    tokens = space.global_batch * space.seq_len
    return Candidate(parallelism=pricing.parallelism, zero_stage=pricing.recipe.zero_stage,
                     micro_batch=pricing.micro_batch, micro_batches=pricing.micro_batches, strategy=label,
                     peak_bytes=peak, step_s=step_s, tokens_per_s_per_gpu=tokens / step_s / space.gpus,
                     head=pricing.head_name,
                     mfu=model_flops(pricing.traced) * space.global_batch
                     / (step_s * space.gpus * spec.peak_flops_per_s(pricing.recipe.precision)))


def model_flops(traced: Traced) -> float:
    """Forward + backward FLOPs of one sequence through the whole model, from the per-token part of
    the trace at micro-batch 2."""
    flow = traced.split(2).per_token
    segments = [flow.pre, flow.post, *(flow.layers[k] for k in traced.layer_kinds)]
    return sum(s.flops.total + s.bwd_flops.total for s in segments) / 2


def search_source(source: ModelSource | str, device: str | DeviceSpec, *, gpus: int, global_batch: int, seq_len: int,
                  top: int = 5, dtype: str = "bf16", master_weights: bool = True, optimizer: str | None = None,
                  mfu: float = 0.4, allowance: Allowance | None = None, gpu_kernels: bool = True,
                  fp32_grads: bool = False, zero_stage: int = 0, network_bytes_per_s: float | None = None,
                  devices_file: str | None = None, head: str | None = None) -> list[Candidate]:
    """Trace ``source`` and `search` the layouts of ``gpus`` x ``device`` for ``global_batch``
    sequences of ``seq_len`` tokens per step (``zero_stage`` above 0 searches only that stage,
    else ZeRO-1 and ZeRO-3; ``head`` given: only that head strategy, else keep and chunked); the
    fastest ``top`` that fit, fastest first."""
    spec = device if isinstance(device, DeviceSpec) else resolve_devices([device], devices_file)[0]
    space = SearchSpace(gpus=gpus, global_batch=global_batch, seq_len=seq_len,
                        zero=(zero_stage,) if zero_stage else _ZERO)
    if optimizer is not None:
        optimizer_layout(optimizer)
    if head is not None:
        check_head(head)
    traced = trace_source(as_source(source), seq_len=seq_len, dtype=dtype, gpu_kernels=gpu_kernels)
    recipe = StateRecipe(optimizer=optimizer or traced.optimizer_name or "adamw",
                         precision=precision_name(dtype, master_weights), zero_stage=space.zero[0], fp32_grads=fp32_grads)
    if head not in (None, "keep") and traced.head is None:
        raise ValueError(f"head strategy {head!r} needs an LM head remat can price, and {traced.label} has none "
                         f"({traced.head_note}); search with head 'keep' or without --head.")
    return search(traced, spec, space, recipe=recipe, mfu=mfu, allowance=allowance or Allowance(),
                  network_bytes_per_s=network_bytes_per_s, top=top, heads=(head,) if head else None)


__all__ = ["Candidate", "SearchSpace", "layouts", "model_flops", "search", "search_source"]
