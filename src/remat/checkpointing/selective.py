"""Selective recomputation: save exactly the op calls a plan names, recompute the rest.

Op calls are named like the profile's op table (`remat.measure.types.OpRecord.key`):
``"<aten overload>#<occurrence>"``, the occurrence counted per overload within one forward of
the block, from 0. The policy is handed to
`torch.utils.checkpoint.create_selective_checkpoint_contexts`; a fresh counter is made for every
checkpointed forward, so the n-th ``aten.mm.default`` of every step maps to the same key.

Under ``torch.compile`` the policy runs while AOT Autograd traces, where dropout is one
``aten.native_dropout`` call; the eager CPU forward the profile recorded runs it as
``empty_like``, ``bernoulli_``, ``div_`` and ``mul`` (CUDA runs ``native_dropout`` eagerly too).
So on the CPU the compiled call counts as those four and answers for the ``mul``, the eager
output: the keys a plan names mean the same calls compiled or not (saving it keeps the mask as
well, which the eager cache would replay).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.utils.checkpoint as tuc
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from remat.checkpointing.cacheable import RANDOM_OPS, cacheable, op_packet

__all__ = ["REPLAY_DIFFERS", "SavedOpsPolicy", "is_saved", "selective_context"]

_NATIVE_DROPOUT = "aten.native_dropout.default"
_EAGER_CPU_DROPOUT = ("aten.empty_like.default", "aten.bernoulli_.float", "aten.div_.Scalar", "aten.mul.Tensor")
"""What eager CPU autograd runs for one dropout (ATen's ``_dropout_impl``), the output last."""


_SAME_CALL = {"transformers.grouped_mm_fallback.default": "aten._grouped_mm.default"}
"""Overloads that stand for another's call, counted as it: Hugging Face's MoE layers run their
experts through ``aten._grouped_mm`` eagerly and through their own ``grouped_mm_fallback`` op
where ``_grouped_mm`` cannot run (traced for ``torch.compile``, float32 weights), one call for one."""

_NAMES: dict[Any, str] = {}
"""Op overload -> its name: the policy is asked about every op of every checkpointed forward and
replay, and ``str(op)`` formats the name anew each time (half of the policy's own time)."""


REPLAY_DIFFERS = (
    "the replay of a selectively recomputed block reached op call {call}, which its forward did not make{ran}: the "
    "forward took another path than its replay does, as a forward does that fills a cache "
    "on its first call (a rotary table computed, then read from the cache on later calls) that no module of the "
    "blocks holds (a module-level global; a cache the blocks' modules hold as a buffer, an attribute or a mapping "
    "is replayed as the forward found it). Selective recomputation "
    "needs the replay to repeat the forward's calls. Run one forward before the first training step with the plan "
    "applied (with torch.no_grad(): model(batch)), which fills such a cache, or plan without selective strategies "
    "(strategy='full').")
"""The error a replay that runs other calls than its forward gets (torch's own says "not found in storage")."""


class SavedOpsPolicy:
    """``policy(ctx, op, *args, **kwargs)``: MUST_SAVE for the named calls, PREFER_RECOMPUTE otherwise.

    It is asked about every op of every checkpointed forward and replay, so a call is decided
    by its overload's running count and a set of saved counts per overload (`_saved_counts`),
    without formatting its key."""

    def __init__(self, saved_ops: frozenset[str]) -> None:
        self.saved_ops = saved_ops
        self.saved = _saved_counts(saved_ops)
        self.counts: dict[str, int] = {}
        """Occurrences so far per overload, in the checkpointed forward."""
        self.replay_counts: dict[str, int] = {}
        """The same in the replay: torch before 2.12 asks the policy again there (with
        ``ctx.is_recompute``) and takes a cached output for each call it answers MUST_SAVE, so
        the replay's n-th call must get the forward's n-th answer. Counted on from the forward's
        counts, a replay would recompute every call and leave the cache held to the end of the
        block's backward: on an H200 (torch 2.11), 19 % over the predicted peak of a small
        convolutional net and 11 % over the predicted step time of the built-in GPT."""
        self.calls: list[tuple[str, int]] = []
        """(overload, occurrence) of every forward call the policy was asked about, in order."""

    @property
    def seen(self) -> list[str]:
        """Keys of every forward call the policy was asked about, in order (for diagnostics and tests)."""
        return [f"{name}#{index}" for name, index in self.calls]

    def _next(self, name: str, replay: bool) -> int:
        counts = self.replay_counts if replay else self.counts
        index = counts.get(name, 0)
        counts[name] = index + 1
        if not replay:
            self.calls.append((name, index))
        return index

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        name = _NAMES.get(op)
        if name is None:
            name = _NAMES[op] = _SAME_CALL.get(str(op), str(op))
        replay = bool(getattr(ctx, "is_recompute", False))
        if name == _NATIVE_DROPOUT and args and _traced_on_cpu(args[0]):
            for eager in _EAGER_CPU_DROPOUT:
                index = self._next(eager, replay)
            name = _EAGER_CPU_DROPOUT[-1]
        else:
            index = self._next(name, replay)
        saved = self.saved.get(name)
        if saved is None or index not in saved:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if replay:
            if index >= self.counts.get(name, 0):
                raise RuntimeError(REPLAY_DIFFERS.format(call=f"{name}#{index}", ran=f" (it made {self.counts.get(name, 0)})"))
            if op_packet(name) in _DRAWS and not _tracing():
                # torch before 2.12 takes the cached output and skips the call, which leaves the
                # generator where the forward's draw found it (`_cached_draw`, the same on 2.12):
                # run it, outside the replay's mode, and drop what it returns
                op(*args, **kwargs)
        return CheckpointPolicy.MUST_SAVE


@functools.lru_cache(maxsize=1024)
def _saved_counts(saved_ops: frozenset[str]) -> dict[str, frozenset[int]]:
    """``{"aten.mm.default#2", ...}`` -> ``{"aten.mm.default": {2, ...}}``, keeping only the
    calls `is_saved` keeps (cacheable overloads)."""
    counts: dict[str, set[int]] = {}
    for key in saved_ops:
        name, _, index = key.rpartition("#")
        if name and index.isdigit() and is_saved(key, saved_ops):
            counts.setdefault(_SAME_CALL.get(name, name), set()).add(int(index))
    return {name: frozenset(indices) for name, indices in counts.items()}


def _tracing() -> bool:
    """Whether the call is traced for ``torch.compile`` (AOT Autograd's proxy mode is on: torch
    before 2.12 calls the policy there with ``is_compiling()`` False; torch's own
    ``checkpoint._is_compiling`` asks the same)."""
    proxy = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY)
    return torch.compiler.is_compiling() or proxy is not None


def _traced_on_cpu(first: Any) -> bool:
    """Whether the call is traced (`_tracing`) on a CPU tensor."""
    return _tracing() and isinstance(first, torch.Tensor) and first.device.type == "cpu"


def is_saved(key: str, saved_ops: frozenset[str] | set[str]) -> bool:
    """Whether the op call ``key`` keeps its output under a plan saving ``saved_ops``: named and
    `remat.checkpointing.cacheable.cacheable` by its overload. Plans name no call whose output is
    written later (the planner reads that from the profile, `OpRecord.mutated_later`)."""
    return key in saved_ops and cacheable(key.rsplit("#", 1)[0])


def selective_context(saved_ops: frozenset[str]) -> tuple[Any, Any]:
    """The (forward, recompute) context pair for one checkpointed call."""
    forward, recompute = create_selective_checkpoint_contexts(SavedOpsPolicy(saved_ops))
    return forward, _explained(recompute)


_EXPLAINED: dict[type, type] = {}

_DRAWS = frozenset({*RANDOM_OPS, "aten.native_dropout"})
"""Calls that draw random numbers (`remat.checkpointing.cacheable.RANDOM_OPS`, and dropout's one
call where it runs eagerly, on CUDA, which a plan may cache)."""


def _cached_draw(mode: Any, func: Any, args: tuple) -> bool:
    """Whether the replay's call ``func`` draws random numbers and torch hands back its cached
    output (torch >= 2.12's storage: per call key, the forward's answer per occurrence). The
    replay restores the generator as its forward found it and runs every call it does not take
    from the cache, so a cached draw skipped there gives every later draw of the block other
    numbers than its forward's: a cached attention dropout, then timm's drop-path ``bernoulli_``,
    trained on another mask. Run, it advances the generator as the forward's call did."""
    name = _NAMES.get(func) or str(func)
    if op_packet(name) not in _DRAWS:
        return False
    storage_key = getattr(tuc, "_sac_storage_key", None)
    counter, storage = getattr(mode, "func_counter", None), getattr(mode, "storage", None)
    if storage_key is None or counter is None or storage is None:
        return False  # torch before 2.12 asks the policy again in the replay (`SavedOpsPolicy`)
    key = storage_key(func, args)
    calls = storage.get(key)
    if not isinstance(calls, dict):
        return False
    entry = calls.get(counter.get(key, 0))
    return entry is not None and entry is not getattr(tuc, "_RECOMPUTE", None) and entry is not getattr(tuc, "_CONSUMED", None)


def _explained(mode: Any) -> Any:
    """``mode``, torch's replay mode, as a subclass of its own class that says why a replay found
    no cached output (`REPLAY_DIFFERS`; torch >= 2.12 asks no policy in the replay, where
    `SavedOpsPolicy` would, and says only "not found in storage")."""
    base = type(mode)
    cls = _EXPLAINED.get(base)
    if cls is None:
        def __torch_dispatch__(self: Any, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            if _cached_draw(self, func, args):
                func(*args, **(kwargs or {}))  # advances the generator as the forward's call did; the output goes
            try:
                return base.__torch_dispatch__(self, func, types, args, kwargs)
            except RuntimeError as exc:
                if "not found in storage" not in str(exc):
                    raise
                raise RuntimeError(REPLAY_DIFFERS.format(call=str(func), ran="")) from exc

        cls = _EXPLAINED[base] = type(f"Explained{base.__name__}", (base,), {"__torch_dispatch__": __torch_dispatch__})
    mode.__class__ = cls
    return mode
