"""The fixed part's modules: what stays outside every block, and the parameter bytes it holds.

The fixed part is the largest modules that neither are inside a block nor contain one (an
embedding, a final norm, a pooler, a head), plus the parameters held directly by a module that
contains blocks (CLIP's ``logit_scale``). A parameter counts once, for the first of those modules
in module order that holds it (tied weights), and not at all when a block holds it too.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from remat.measure.storage import storage_key, storage_nbytes
from remat.measure.types import FixedModule

__all__ = ["fixed_modules"]


def fixed_modules(model: nn.Module, blocks: Sequence[nn.Module]) -> tuple[FixedModule, ...]:
    """The fixed part of ``model`` whose blocks are ``blocks``, in module order."""
    block_ids = {id(b) for b in blocks}
    holders = _holders(model, block_ids)
    counted = {storage_key(p) for b in blocks for p in b.parameters()}
    out: list[FixedModule] = []
    for name, module in model.named_modules():
        if id(module) in block_ids or _inside_block(name, holders, block_ids, model):
            continue
        if id(module) in holders:
            params = [(f"{name}.{p}" if name else p, "Parameter", [t]) for p, t in module.named_parameters(recurse=False)]
        elif _parent_holds(name, holders, model):
            params = [(name, type(module).__name__, list(module.parameters()))]
        else:
            continue
        for qualified, class_name, tensors in params:
            fresh = {storage_key(t): storage_nbytes(t) for t in tensors if storage_key(t) not in counted}
            counted |= set(fresh)
            out.append(FixedModule(name=qualified, class_name=class_name, param_bytes=sum(fresh.values())))
    return tuple(out)


def _holders(model: nn.Module, block_ids: set[int]) -> set[int]:
    """Ids of the modules with a block strictly inside them (the model itself included)."""
    found: set[int] = set()
    for name, module in model.named_modules():
        if id(module) in block_ids:
            parts = name.split(".") if name else []
            found |= {id(model.get_submodule(".".join(parts[:k]))) for k in range(len(parts))}
    return found


def _parent_holds(name: str, holders: set[int], model: nn.Module) -> bool:
    return bool(name) and id(model.get_submodule(name.rpartition(".")[0])) in holders


def _inside_block(name: str, holders: set[int], block_ids: set[int], model: nn.Module) -> bool:
    parts = name.split(".") if name else []
    return any(id(model.get_submodule(".".join(parts[:k]))) in block_ids for k in range(1, len(parts)))
