"""Op calls whose output sizes follow the data: a mixture of experts' calls per expert.

A router sends each token to some experts, and the code gathers each expert's tokens
(``hidden[token_idx]``, a split by counts read back with ``tolist()``) before its matmuls.
Those calls' output sizes follow the routing, so they change from one batch to the next,
while the total over the experts does not (every token goes to its k experts). A selective
plan that caches expert 0's matmul keeps the bytes of expert 0's tokens in this batch: a
JetMoE layer caching one expert's matmul measured 64 to 512 bytes above its prediction, the
tokens of a step after an optimizer step moved.

A profile sees one batch, so it finds these calls where two blocks of one structure
(`remat.measure.sharing.structure_key`: same class, parameters and argument shapes) ran the same
calls on arguments of other shapes or made outputs of other sizes: the routing of each layer
is its own. The first block of a structure with a call whose output shape follows values
(`shape_from_values`: ``nonzero``) is also run three more times on other inputs
(`another_draw`) and compared with those runs: a block alone of its structure has no other. Each such call belongs to a *family*: the op and its tensor
arguments' shapes less their first dimension (the tokens), so that one projection's matmuls over
every expert are one family. Every call of the block in a varying call's family is a member (an expert that got
the same tokens in both blocks too). Where the family's output bytes add up to the same total
in every block of the structure, caching all of it holds a total that does not follow the
routing: `remat.plan.policies` offers the family as one item, whole or not at all. Where
the total differs too (a router that drops tokens past a capacity), no call of it is cached.

A loop over the experts a batch hits (Mixtral's eager kernel: ``for e in expert_hit``, an
``unbind`` along the first dimension of a ``nonzero``'s output) runs as many passes as experts
hit, so its calls, and those after it, have other keys (``"aten.mm.default#5"``) on a batch that
hits fewer: from that ``nonzero`` on, nothing is cached (`UNCACHED`). So too where the blocks of
a structure, or their runs, made other calls, from their first call whose shape follows values.
A call whose output shape follows values outside a family is never cached either: blocks that
agree may agree by chance. A block with no such call and no other block of its structure keeps
every call's size as measured (`OpRecord.size_group` -1): a lone layer that routes by sorting
and splits by counts read back with ``tolist()`` (JetMoE's, one layer) shows nothing to compare.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from remat.measure.ops import OpRecorder
from remat.measure.types import OpRecord

__all__ = ["FIXED", "UNCACHED", "another_draw", "family_key", "shape_from_values", "shapes",
           "size_groups"]

FIXED = -1
"""`OpRecord.size_group` of a call whose output size did not follow the data."""
UNCACHED = -2
"""`OpRecord.size_group` of a call never cached: its family's total followed the data too, its
output shape follows values outside a family, or a loop over the experts hit runs it."""


def family_key(name: str, args: Any) -> tuple[Any, ...]:
    """The op ``name`` and `remat.measure.sharing.args_signature` ``args`` as `shapes` with every
    tensor's first dimension dropped: the calls of one projection over every expert share it."""
    return (name, _without_first(shapes(args)))


def shapes(args: Any) -> Any:
    """`remat.measure.sharing.args_signature` ``args`` with each tensor's gradient flag and each
    number's value left out (its type kept): a shift by a delay the data picks (Autoformer's
    ``roll``) or a scale each layer computes (DiffLlama's lambda) changes no size, and where a
    number does (a ``narrow``'s length), the outputs' bytes say so."""
    if isinstance(args, tuple) and len(args) in (3, 4) and isinstance(args[0], tuple) and isinstance(args[1], torch.dtype):
        return (args[0], args[1], args[-1])  # (shape, dtype, device): as given, or already so
    if isinstance(args, tuple):
        return tuple(shapes(v) for v in args)
    if isinstance(args, (bool, int, float)):
        return type(args).__name__
    return args


def _without_first(value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 3 and isinstance(value[0], tuple) and isinstance(
            value[1], torch.dtype):  # a tensor's (shape, dtype, device), `shapes`
        return (value[0][1:], *value[1:])
    if isinstance(value, tuple):
        return tuple(_without_first(v) for v in value)
    return value


def size_groups(structure_of: Sequence[int], ops: Sequence[tuple[OpRecord, ...]], call_args: Sequence[Sequence[Any]],
                draws: Mapping[int, Sequence[tuple[tuple[OpRecord, ...], Sequence[Any]]]] | None = None
                ) -> list[tuple[int, ...]]:
    """Per block, per call, its `OpRecord.size_group`: `FIXED`, `UNCACHED`, or the index of the
    first call of its family (the group's id within the block). ``structure_of[i]``: the first
    block whose structure equals block i's; ``ops[i]`` and ``call_args[i]``: block i's recorded
    calls and their argument signatures, in call order (gradient flags aside: the first block's
    input, the batch, needs none). ``draws[i]``: the calls and signatures of block i run again on
    other inputs (`another_draw`), each compared as another block of its structure."""
    # a call whose output shape follows its inputs' values (``nonzero``, a boolean mask's gather) is
    # never cached where no comparison put it in a family: blocks that agree may agree by chance
    # (two of four experts hit in every layer of one batch, three in the next batch's)
    out = [tuple(UNCACHED if shape_from_values(op.name, args) else FIXED for op, args in zip(block, block_args))
           for block, block_args in zip(ops, call_args)]
    members: dict[int, list[int]] = defaultdict(list)
    for i, first in enumerate(structure_of):
        members[first].append(i)
    for blocks in members.values():
        sequences = {tuple(op.key for op in ops[i]) for i in blocks}
        extra = [draw for i in blocks for draw in (draws or {}).get(i, ())]
        sequences |= {tuple(op.key for op in draw[0]) for draw in extra}
        if len(sequences) > 1:  # a loop over the experts a batch hits: the calls' keys shift batch to batch
            for i in blocks:
                out[i] = _shifted(out[i])
            continue
        runs = [(ops[i], call_args[i]) for i in blocks]
        runs += extra
        found = _compare(runs) if len(runs) >= 2 else None
        for i in blocks if found is not None else ():
            out[i] = tuple(g if g != FIXED else before for g, before in zip(found, out[i]))
    for i, (block, block_args) in enumerate(zip(ops, call_args)):
        start = _loop_start(block, block_args)
        if start is not None:
            out[i] = out[i][:start] + (UNCACHED,) * (len(out[i]) - start)
    return out


def _loop_start(ops: Sequence[OpRecord], call_args: Sequence[Any]) -> int | None:
    """The call whose output a Python loop iterates (``unbind`` along its first dimension, what
    ``for expert in expert_hit`` runs) where that output's shape follows values: Mixtral's
    ``expert_hit = (...).nonzero()``, one pass per expert the batch hits. None where there is none."""
    made: dict[int, int] = {}
    for j, (op, args) in enumerate(zip(ops, call_args)):
        if shape_from_values(op.name, args):
            for storage in op.storage_ids:
                made.setdefault(storage, j)
        elif op.name == "aten.unbind.int" and _unbind_dim(args) == 0:
            found = [made[storage] for storage in op.storage_ids if storage in made]
            if found:
                return min(found)
    return None


def _unbind_dim(args: Any) -> Any:
    """The ``dim`` of an ``unbind`` call from its `args_signature` (0 where not given)."""
    positional, keywords = args if isinstance(args, tuple) and len(args) == 2 else ((), ())
    if isinstance(positional, tuple) and len(positional) > 2:
        return positional[2]
    given = dict(keywords[1:]) if isinstance(keywords, tuple) and keywords[:1] == ("dict",) else {}
    return given.get("dim", 0)


def _shifted(groups: tuple[int, ...]) -> tuple[int, ...]:
    """``groups`` of a block whose runs made other calls, with every call from its first call whose
    output shape follows values on `UNCACHED`: a loop that runs once per expert hit (Mixtral's,
    where 32 tokens meet 128 experts) makes as many calls as the batch hits experts, so a plan's
    ``"aten.mm.default#5"`` names another call the next batch, the calls after the loop too. A
    block with no such call (layers of one structure that branch on their index) keeps its groups."""
    start = next((j for j, g in enumerate(groups) if g == UNCACHED), len(groups))
    return groups[:start] + (UNCACHED,) * (len(groups) - start)


def _compare(runs: list[tuple[tuple[OpRecord, ...], Sequence[Any]]]) -> tuple[int, ...] | None:
    """The size groups of runs of one block's calls (same keys), or None where none varied."""
    args = [[shapes(a) for a in call_args] for _, call_args in runs]
    calls = len(runs[0][0])
    varying = [j for j in range(calls)
               if len({(a[j], ops[j].output_bytes, ops[j].storage_bytes) for (ops, _), a in zip(runs, args)}) > 1]
    if not varying:
        return None
    groups = _families(varying, [[family_key(ops[j].name, a[j]) for j in range(calls)] for (ops, _), a in zip(runs, args)],
                       [[op.output_bytes for op in ops] for ops, _ in runs])
    return tuple(groups.get(j, FIXED) for j in range(calls))


def _families(varying: list[int], families: list[list[Any]], output_bytes: list[list[int]]) -> dict[int, int]:
    """Call index -> group id (or `UNCACHED`) of the calls in the family of a varying call, given
    each alike block's family keys and output bytes per call."""
    groups: dict[int, int] = {}
    for j in varying:
        if j in groups:
            continue
        if len({block[j] for block in families}) > 1:  # sizes past the first dimension follow the data
            groups[j] = UNCACHED
            continue
        family = [k for k in range(len(families[0])) if all(block[k] == block[j] for block in families)]
        totals = {sum(sizes[k] for k in family) for sizes in output_bytes}
        for k in family:
            groups.setdefault(k, family[0] if len(totals) == 1 else UNCACHED)
    return groups


@lru_cache(maxsize=None)
def _dynamic(name: str) -> bool:
    """Whether the aten op ``name`` (``"aten.nonzero.default"``) makes outputs whose shape follows
    its inputs' values (``torch.Tag.dynamic_output_shape``: ``nonzero``, a boolean mask's ``index``)."""
    parts = name.split(".")
    if len(parts) != 3 or parts[0] != "aten":
        return False
    overload = getattr(getattr(torch.ops.aten, parts[1], None), parts[2], None)
    return overload is not None and torch.Tag.dynamic_output_shape in getattr(overload, "tags", ())


def shape_from_values(name: str, args: Any) -> bool:
    """Whether the call of ``name`` on arguments of signature ``args`` makes an output whose shape
    follows its inputs' values: an op of ``torch.Tag.dynamic_output_shape`` (``nonzero``,
    ``masked_select``, ``unique``), where ``index`` and ``index_put`` only with a boolean index (an
    integer index's shape is its output's)."""
    if not _dynamic(name):
        return False
    if name.split(".")[1] in ("index", "index_put", "index_put_", "_index_put_impl_"):
        return any(isinstance(v, tuple) and len(v) == 4 and v[1] in (torch.bool, torch.uint8) for v in _flat(args))
    return True


def _flat(value: Any) -> list[Any]:
    """The tensor signatures (`args_signature`'s 4-tuples) inside ``value``."""
    if isinstance(value, tuple) and len(value) == 4 and isinstance(value[0], tuple) and isinstance(value[1], torch.dtype):
        return [value]
    if isinstance(value, tuple):
        return [t for v in value for t in _flat(v)]
    return []


def another_draw(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], name: str,
                 context: Any = None, seed: int = 1) -> tuple[tuple[OpRecord, ...], tuple[Any, ...]] | None:
    """The calls and argument signatures of ``module``'s forward run once more, without gradients, on
    its inputs ``args`` and ``kwargs`` with noise of their own spread added to the floating ones
    that need gradients (the activations: a mask or a table is left as it is; the first floating one
    where none does, the batch that the first block takes), under ``context``
    (a `remat.measure.overhead.BlockInputs.call_context`): a router routes the tokens anew. None
    where the run raised. The random state is as before; the module's buffers too. An even ``seed``
    draws the rows (the last dimension's vectors, tokens) of those inputs again with replacement
    in place of the noise: real hidden states, some of them twice, which route to fewer experts than
    noisy ones, which spread over every expert."""
    generator = torch.Generator().manual_seed(seed)
    leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    # the first block's input, the batch, needs no gradient: then its first floating argument
    activations = [t for t in leaves if t.requires_grad] or [t for t in leaves if t.is_floating_point()][:1]

    def other(t: Any) -> Any:
        if not any(t is a for a in activations) or t.numel() < 2:
            return t
        if seed % 2 == 0 and t.dim() >= 2:  # its rows (tokens) drawn again with replacement: real hidden
            # states, some twice, route to fewer experts than noise does (which spreads them over all)
            rows = t.detach().reshape(-1, t.shape[-1])
            picked = torch.randint(0, rows.shape[0], (rows.shape[0],), generator=generator).to(t.device)
            value = rows[picked].reshape(t.shape)
        else:
            noise = torch.randn(t.shape, generator=generator).to(device=t.device, dtype=t.dtype)
            value = t.detach() + noise * t.detach().float().std()
        # in the input's strides: a transposed input makes the block copy it (OneFormer's decoder
        # layers ran a clone the draw did not)
        laid = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        return laid.copy_(value).requires_grad_(True)

    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    device = next((t.device for t in activations if t.device.type == "cuda"), None)
    recorder = OpRecorder(lambda: name)
    try:
        with torch.random.fork_rng(devices=[device] if device is not None else []):
            args, kwargs = tree_map(other, args), tree_map(other, kwargs)
            # without gradients: autograd saving an output without the profile's hooks adds a detach
            with context if context is not None else contextlib.nullcontext(), torch.no_grad(), recorder:
                module.forward(*args, **kwargs)
    except Exception:  # noqa: BLE001 - another draw is evidence where it runs, nothing where it does not
        return None
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                if buffer.shape == saved.shape:
                    buffer.copy_(saved)
    return recorder.records(name, {}), recorder.call_args(name)
