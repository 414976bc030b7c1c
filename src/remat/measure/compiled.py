"""Compiled mode: the blocks' figures as ``torch.compile`` runs them (`remat.profile(..., compiled=True)`).

An eager profile prices a replay by the eager ops it reruns and the checkpoint's Python cost;
under ``torch.compile`` the replay is traced into the compiled backward, where the cheap ops it
reruns (pointwise, norms, softmax, dropout) fuse into the kernels that read them and the
checkpoint's Python runs once, at trace time. The compiled graph also saves other tensors than
eager autograd: the partitioner recomputes cheap ops of kept blocks as well.

So each block runs alone on the inputs it received in the model's forward, compiled with
``fullgraph=True`` under the chosen backend, forward then backward with ones as the output
gradient, in three ways per repeat (interleaved, paired differences):

- ``plain``: the block as written: its compiled forward and backward times, and the bytes of
  the storages its compiled backward node holds (parameters and buffers excluded), beside the
  same count for the block run eagerly;
- ``recompute``: inside `remat.checkpointing.region.checkpointed`, as a plan runs it:
  ``replay_ms`` = recompute - plain;
- ``selective``: the same with a policy that saves the outputs of the matmul-class ops
  (`remat.checkpointing.cacheable.MATMUL_OPS`) and recomputes the others:
  ``cheap_replay_ms`` = selective - plain (at most ``replay_ms``).

`with_compiled` turns an eager profile into a compiled one: the block's ``fwd_ms`` and
``bwd_ms`` become the compiled ones; its op times are rescaled so the cheap ops add up to
``cheap_replay_ms`` and the matmul-class ops to the rest of ``replay_ms``, at least their share
of the compiled forward (`matmul_replay_ms`; a selective plan's replay is then priced as the
compiler runs it); ``recompute_overhead_ms`` is what the compiled
replay costs beyond ``fwd_ms`` (never negative); the selective and checkpoint-call overheads are
0 (their Python runs at trace time); ``saved_bytes`` drops by what the compiled graph saves less
than eager autograd on the block alone, for a kept block: a replay in the compiled backward holds
what the eager replay holds (``replay_saved_extra_bytes`` counts the difference back).

The part of the step before the first block (embeddings, a patch embedding's convolution) is
measured compiled too, by the allocator, which sees inside compiled kernels (`measure_pre_part`):
inductor on the CPU runs a convolution channels-last, and its graph saves channels-last copies of
the convolution's input and weight for the backward, where eager autograd saves the tensors
themselves (the batch, a parameter). The copies are live from the pre part's forward to its
backward, the step's last phase, whatever the plan: a tiny ViT's compiled step peaked there for
every plan, 33 % above the prediction of no recomputation and 45 % above full recomputation's.
The other memory terms of the step around the blocks (the code between and after the blocks)
stay the eager accounting's.

Alike blocks (same class, op calls, parameter and input shapes) are compiled and measured once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import statistics
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from remat._batch import model_device
from remat.checkpointing.cacheable import MATMUL_OPS, op_packet
from remat.checkpointing.region import BufferGuard, call_with_first, checkpointed, first_argument
from remat.measure.blocks import Blocks
from remat.measure.boundaries import Boundary, StepBoundaries
from remat.measure.budget import lockstep
from remat.measure.probes import failure_reason
from remat.measure.overhead import BlockInputs, _alike_key
from remat.measure.storage import storage_key, storage_keys
from remat.measure.timing import Clock
from remat.measure.tracker import allocator_mark, allocator_timeline
from remat.measure.types import BlockProfile, CompiledBlock, OpRecord, Profile

__all__ = ["backend_name", "matmul_replay_ms", "measure_compiled", "measure_pre_part", "with_compiled",
           "saved_storage_bytes", "PrePart"]

_VARIANTS = ("plain", "recompute", "selective")
MIN_MEASURE_S = 1.0
"""Rounds go on until the three variants have run this long: a replay is a paired difference of
two compiled steps, and one measurement stands for every alike block (`remat.measure.overhead`
measures its eager probes in a share of a few steps)."""
MAX_ROUNDS = 400
"""Rounds at most, however fast the block."""


def backend_name(compiled: bool | str) -> str:
    """The ``torch.compile`` backend ``compiled`` asks for: '' for False, ``inductor`` for True,
    else a registered backend's name."""
    if compiled is False:
        return ""
    if compiled is True:
        return "inductor"
    if isinstance(compiled, str):
        known = torch._dynamo.list_backends(exclude_tags=())
        if compiled in known:
            return compiled
        raise ValueError(f"compiled={compiled!r} is not a torch.compile backend; known: {', '.join(known)}. "
                         "Pass compiled=True for inductor, or one of those names.")
    raise TypeError(f"compiled={compiled!r} must be a bool or a torch.compile backend name (str).")


def measure_compiled(block_list: Blocks, inputs: Sequence[BlockInputs], op_keys: Sequence[frozenset[str]], *,
                     backend: str, repeats: int, clock: Clock) -> tuple[CompiledBlock, ...]:
    """`CompiledBlock` of every block (``inputs`` from
    `remat.measure.overhead.capture_block_inputs`, ``op_keys[i]``: block i's op-call keys, which
    tell alike blocks apart); one compile and measurement per group of alike blocks."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, (_, module) in enumerate(block_list):
        groups.setdefault(_alike_key(module, inputs[i], op_keys[i]), []).append(i)
    found: dict[int, CompiledBlock] = {}
    # every group compiles the forward code of its class again (guards on the module): raise
    # dynamo's per-code limit for the probes, or alike classes past 8 would run eager
    limit = max(torch._dynamo.config.recompile_limit, 3 * len(groups) + 8)
    writers: list[str] = []
    with torch._dynamo.config.patch(recompile_limit=limit):
        for members in groups.values():
            name, module = block_list[members[0]]
            try:
                try:
                    shared = _measure_block(module, inputs[members[0]], backend, repeats, clock)
                except Exception as exc:
                    if not _side_effect(exc):
                        raise
                    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
                        shared = _measure_block(module, inputs[members[0]], backend, repeats, clock)
                    writers.append(name)
            except Exception as exc:  # a block that cannot compile whole: the model cannot either
                reason = failure_reason(exc)
                raise ValueError(
                    f"block {name!r} does not run under torch.compile(fullgraph=True, backend={backend!r}): "
                    f"{reason}. Profile with compiled=False, or make the block compile without graph breaks."
                ) from exc
            found.update((i, shared) for i in members)
    if writers and not torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint:
        warnings.warn(_side_effect_message(writers), UserWarning, stacklevel=3)
    return tuple(found[i] for i in range(len(block_list)))


SIDE_EFFECT = "HOP: Unsafe side effect"
"""What torch.compile says of a checkpoint whose forward writes Python state outside it."""


def _side_effect(exc: BaseException) -> bool:
    """``exc`` (or its cause) is torch.compile refusing a checkpointed region that writes Python
    state outside it, which it cannot replay in the backward."""
    while exc is not None:
        if SIDE_EFFECT in str(exc):
            return True
        exc = exc.__cause__
    return False


def _side_effect_message(writers: list[str]) -> str:
    """The warning for blocks whose compiled replays needed dynamo to skip their forward's writes."""
    shown = ", ".join(repr(name) for name in writers[:3]) + (", ..." if len(writers) > 3 else "")
    return (
        f"block {shown} writes Python state outside itself in its forward (as Hugging Face's attention does "
        "where the kernels package is installed: it sets a context variable and resets it at the end), which "
        "torch.compile cannot replay inside a checkpoint: it refuses the checkpoint ('HOP: Unsafe side "
        "effect'), as it refuses Hugging Face's own gradient checkpointing. remat measured the block's compiled "
        "replays with torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True: the write "
        "runs in the forward and not again in the replay, which changes nothing where the forward undoes its "
        "own write (a value set, then reset). Set it before you compile the applied model, or the compile "
        "fails the same way: torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True."
    )


def _measure_block(module: nn.Module, inputs: BlockInputs, backend: str, repeats: int,
                   clock: Clock) -> CompiledBlock:
    # static shapes: every group of alike blocks compiles the same closures' code again, and a
    # recompile turns dynamo's automatic dynamic shapes on (Swin's window partition under symbolic
    # shapes kept inductor in sympy for over ten minutes; static, its profile took three, under load)
    runs = {name: torch.compile(fn, fullgraph=True, backend=backend, dynamic=False)
            for name, fn in _variants(module).items()}
    state = storage_keys([*module.parameters(), *module.buffers()])
    with inputs.call_context():
        out = runs["plain"](*inputs.args, **inputs.kwargs)
    saved = saved_storage_bytes(out, state)
    _backward(out)
    for name in ("recompute", "selective"):  # compile them before timing anything
        with inputs.call_context():
            out = runs[name](*inputs.args, **inputs.kwargs)
        _backward(out)
    eager = _eager_saved_bytes(_variants(module)["plain"], inputs, state)
    series = _timed(runs, inputs, repeats, clock)
    plain = [f + b for f, b in zip(series["plain_fwd"], series["plain_bwd"])]
    replay = _paired(series["recompute"], plain)
    return CompiledBlock(
        fwd_ms=statistics.median(series["plain_fwd"]), bwd_ms=statistics.median(series["plain_bwd"]),
        replay_ms=replay, cheap_replay_ms=min(replay, _paired(series["selective"], plain)),
        saved_bytes=saved, eager_saved_bytes=eager,
    )


def _variants(module: nn.Module) -> dict[str, Callable[..., Any]]:
    """The block as written, under a checkpoint, and under a selective checkpoint that saves the
    matmul-class ops; the block's own ``forward`` (no module hooks), as the runtime calls it."""
    forward = module.forward
    guard = BufferGuard([module], {})

    def plain(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    def recompute(*args: Any, **kwargs: Any) -> Any:
        first, extra, rest, key = first_argument(args, kwargs)
        return checkpointed(functools.partial(_call, forward, rest, key), first, extra, guard=guard)[0]

    def selective(*args: Any, **kwargs: Any) -> Any:
        first, extra, rest, key = first_argument(args, kwargs)
        return checkpointed(functools.partial(_call, forward, rest, key), first, extra, guard=guard,
                            context_fn=_save_matmuls_context)[0]

    return {"plain": plain, "recompute": recompute, "selective": selective}


def _call(forward: Callable[..., Any], kwargs: dict[str, Any], key: str | None, first: Any,
          extra: tuple[Any, ...]) -> list[Any]:
    return [call_with_first(forward, first, extra, kwargs, key)]


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op_packet(str(op)) in MATMUL_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _save_matmuls_context() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_save_matmuls)


def _grad_outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]


def _backward(out: Any) -> None:
    tensors = _grad_outputs(out)
    torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])


def saved_storage_bytes(out: Any, state: set[int]) -> int:
    """Bytes of the distinct storages the backward nodes of ``out`` hold (a compiled region's
    outputs share one node), storages in ``state`` (parameters, buffers) excluded."""
    storages: dict[Any, int] = {}
    for node in {t.grad_fn for t in _grad_outputs(out) if t.grad_fn is not None}:
        for tensor in getattr(node, "saved_tensors", ()):
            key = storage_key(tensor) if isinstance(tensor, torch.Tensor) else None
            if key is not None and key not in state:
                storages[key] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


def _eager_saved_bytes(fn: Callable[..., Any], inputs: BlockInputs, state: set[int]) -> int:
    """Bytes of the distinct storages autograd saves when the block runs eagerly, alone."""
    storages: dict[Any, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        if key is not None and key not in state:
            storages[key] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), inputs.call_context():
        out = fn(*inputs.args, **inputs.kwargs)
    del out
    return sum(storages.values())


def _timed(runs: dict[str, Callable[..., Any]], inputs: BlockInputs, repeats: int,
           clock: Clock) -> dict[str, list[float]]:
    """At least ``repeats`` rounds, more until `MIN_MEASURE_S` has passed; each round runs the
    three variants in turn (starting one later each round)."""
    series: dict[str, list[float]] = {"plain_fwd": [], "plain_bwd": [], "recompute": [], "selective": []}
    spent_s, rounds = 0.0, 0
    while rounds < repeats or (spent_s < MIN_MEASURE_S and rounds < MAX_ROUNDS and not lockstep()):
        for k in range(len(_VARIANTS)):
            name = _VARIANTS[(rounds + k) % len(_VARIANTS)]
            fwd_ms, bwd_ms = _one_run(runs[name], inputs, clock)
            spent_s += (fwd_ms + bwd_ms) / 1e3
            if name == "plain":
                series["plain_fwd"].append(fwd_ms)
                series["plain_bwd"].append(bwd_ms)
            else:
                series[name].append(fwd_ms + bwd_ms)
        rounds += 1
    return series


def _one_run(run: Callable[..., Any], inputs: BlockInputs, clock: Clock) -> tuple[float, float]:
    clock.sync()
    start = clock.mark()
    with inputs.call_context():
        out = run(*inputs.args, **inputs.kwargs)
    middle = clock.mark()
    _backward(out)
    end = clock.mark()
    clock.sync()
    return clock.elapsed_ms(start, middle), clock.elapsed_ms(middle, end)


def _paired(series: list[float], plain: list[float]) -> float:
    return max(0.0, statistics.median(a - b for a, b in zip(series, plain)))


PRE_WARMUP = 2
"""Steps of each copy before the pre part is measured: the first compiles, the second runs with
the optimizer's state made (as `remat.verify_compiled.WARMUP`)."""


@dataclass(kw_only=True, frozen=True)
class PrePart:
    """The part before the first block compiled (`measure_pre_part`): what it saves more than
    eager (never negative; live from its forward through the whole backward), and the allocator's
    peaks of its forward and of its backward above the bytes out as the step began (the model's
    state, the last step's gradients included), as `remat.verify` measures the compiled step
    (None: not measured)."""

    saved_bytes: int = 0
    fwd_net_bytes: int | None = None
    bwd_net_bytes: int | None = None


def measure_pre_part(step: Any, block_list: Blocks, backend: str) -> PrePart:
    """The step's part before the first block, compiled with ``backend``: the allocator's bytes
    (`remat.measure.tracker.allocator_timeline`) through one step of ``step`` (a
    `remat.measure.profile._Step`) with the model compiled around its blocks, which run eagerly
    (dynamo breaks the graph at each block's call), and through one run eagerly, from the same
    state: its forward's peak (from the gradients' release to the first block's forward), its
    backward's (from the end of the first block's backward, its input's gradient ready, to the
    backward's end; none where that input needs no gradient) and, against the eager step, what
    it holds more as the first block starts: the same blocks ran, the difference is what the
    compiled pre part saves more. Where the function that runs the pre part also loops over the
    blocks, dynamo runs it eagerly (it does not resume a graph inside a loop) and the figures are
    the eager step's allocator's; a model that does not compile so keeps the eager figures and
    says why."""
    eager = _pre_timeline(step, block_list)
    try:
        with _opaque(block_list):  # static shapes, as the whole model compiles first: the code between alike
            # stages recompiles for the next stage's shapes, which would turn dynamic shapes on
            model = torch.compile(step.model, backend=backend, dynamic=False)
            compiled = _pre_timeline(dataclasses.replace(step, model=model), block_list)
    except Exception as exc:  # noqa: BLE001 - the blocks' figures stand; the pre part's stay eager
        warnings.warn(f"the part of the step before the first block could not run compiled with backend "
                      f"{backend!r} around the eager blocks ({failure_reason(exc)}): its figures stay the eager "
                      "step's.", UserWarning, stacklevel=3)
        return PrePart()
    return PrePart(saved_bytes=max(0, compiled["held"] - eager["held"]), fwd_net_bytes=compiled["fwd"],
                   bwd_net_bytes=compiled.get("bwd"))


def _pre_timeline(step: Any, block_list: Blocks) -> dict[str, int]:
    """Above the bytes out as the step starts, after `PRE_WARMUP` steps: ``held`` as the first
    block's forward starts, ``fwd`` the most from the gradients' release to there, ``bwd`` the
    most from the first block's backward's end to the backward's end (absent where its input
    gets no gradient)."""
    for _ in range(PRE_WARMUP):
        step.run()

    def listener(event: Boundary) -> None:
        allocator_mark(f"{event.kind}:{event.index}")

    def measured() -> None:
        with StepBoundaries(block_list, step.optimizer, [listener]) as marks:
            step.run(marks)

    timeline = allocator_timeline(measured, model_device(step.model), before=step.run)
    names = [name for name, _, _ in timeline]
    begin = names.index("fwd_begin:-1")
    first = names.index("fwd_start:0", begin)
    found = {"held": timeline[first][1], "fwd": max(peak for _, _, peak in timeline[begin + 1:first + 1])}
    ends = [i for i, name in enumerate(names) if name == "bwd_end:0"]
    if ends and "bwd_done:-1" in names[ends[-1]:]:
        done = names.index("bwd_done:-1", ends[-1])
        found["bwd"] = max(peak for _, _, peak in timeline[ends[-1] + 1:done + 1])
    return found


@contextlib.contextmanager
def _opaque(block_list: Blocks) -> Iterator[None]:
    """Dynamo does not trace the blocks' calls (their hooks included): each breaks the graph and
    runs eagerly, so the code around them compiles as graphs of its own."""
    for _, module in block_list:
        module._call_impl = torch._dynamo.disable(module._call_impl)
    try:
        yield
    finally:
        for _, module in block_list:
            module.__dict__.pop("_call_impl", None)


def with_compiled(profile: Profile, figures: Sequence[CompiledBlock], backend: str,
                  pre: PrePart = PrePart()) -> Profile:
    """``profile`` with its blocks priced as the compiled runs measured them, and its pre part
    as ``pre`` measured it (module docstring): its saved bytes raised by what it saves more, its
    forward's and backward's peaks at least the allocator's (each phase of
    `remat.plan.predict` then holds what the compiled step's allocator measured there)."""
    blocks = tuple(_compiled_block(block, fig) for block, fig in zip(profile.blocks, figures, strict=True))
    saved = profile.fixed_pre_saved_bytes + pre.saved_bytes
    fwd, bwd = profile.fixed_pre_fwd_bytes, profile.fixed_pre_bwd_temp_bytes
    if pre.fwd_net_bytes is not None:  # the gradients were released: the step's start less them
        fwd = max(fwd, profile.grad_bytes + pre.fwd_net_bytes)
    if pre.bwd_net_bytes is not None:  # every gradient but the pre part's is back
        bwd = max(bwd, profile.fixed_pre_grad_bytes + pre.bwd_net_bytes - saved)
    return dataclasses.replace(
        profile, blocks=blocks, checkpoint_call_ms=0.0, compiled_backend=backend, compiled_blocks=tuple(figures),
        fixed_pre_saved_bytes=saved, fixed_pre_fwd_bytes=fwd, fixed_pre_bwd_temp_bytes=bwd)


def _compiled_block(block: BlockProfile, fig: CompiledBlock) -> BlockProfile:
    saved = min(block.saved_bytes, max(block.handoff_bytes,
                                       block.saved_bytes - max(0, fig.eager_saved_bytes - fig.saved_bytes)))
    return dataclasses.replace(
        block, fwd_ms=fig.fwd_ms, bwd_ms=fig.bwd_ms, saved_bytes=saved,
        replay_saved_extra_bytes=block.replay_saved_extra_bytes + block.saved_bytes - saved,
        ops=_rescaled(block.ops, heavy_ms=matmul_replay_ms(block.ops, fig), cheap_ms=fig.cheap_replay_ms),
        recompute_overhead_ms=max(0.0, fig.replay_ms - fig.fwd_ms),
        selective_overhead_ms=0.0, selective_cache_overhead_ms=0.0,
    )


def _heavy(op: OpRecord) -> bool:
    return op_packet(op.name) in MATMUL_OPS


def matmul_replay_ms(ops: Sequence[OpRecord], fig: CompiledBlock) -> float:
    """What replaying the block's matmul-class ops costs compiled: ``replay_ms - cheap_replay_ms``,
    and never less than their share of the compiled forward (their share of the eager forward's
    op time): fusion takes the cheap ops' replay away, not a GEMM's. On a loaded machine the
    paired difference can come out near 0, which would price a selective plan that replays
    matmuls as free."""
    heavy = sum(op.time_ms for op in ops if _heavy(op) and not op.is_view)
    total = sum(op.time_ms for op in ops if not op.is_view)
    share = heavy / total if total > 0 else 0.0
    return max(fig.replay_ms - fig.cheap_replay_ms, share * fig.fwd_ms)


def _rescaled(ops: tuple[OpRecord, ...], *, heavy_ms: float, cheap_ms: float) -> tuple[OpRecord, ...]:
    """Op times scaled so the matmul-class calls add up to ``heavy_ms`` and the others (views
    excluded: they are never replayed) to ``cheap_ms``; a group without eager time is left as is."""
    totals = {True: sum(op.time_ms for op in ops if _heavy(op) and not op.is_view),
              False: sum(op.time_ms for op in ops if not _heavy(op) and not op.is_view)}
    targets = {True: heavy_ms, False: cheap_ms}
    return tuple(op if op.is_view or totals[_heavy(op)] <= 0 else
                 dataclasses.replace(op, time_ms=op.time_ms * targets[_heavy(op)] / totals[_heavy(op)])
                 for op in ops)
