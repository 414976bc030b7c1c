"""A module's plain attributes: what its code keeps besides parameters, buffers and submodules.

A forward may change them along with its buffers: a lazily made cache keeps its table in a
buffer and how much of it is filled in an ``int`` (rotary_embedding_torch's ``cached_freqs`` and
``cached_freqs_seq_len``), a data-dependent initialisation its parameters and an ``initialized``
flag. Whoever puts the buffers back must put these back too, or the code reads a table it
believes filled and finds the values it started from (zeros: every rotation the identity).
`snapshot` records them; `put_back` makes a module's attributes what the snapshot holds again.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["AttributeSnapshot", "snapshot", "put_back"]

_INTERNALS = frozenset(vars(nn.Module()).keys())
"""The attributes every module has (``training``, ``_parameters``, the hook dictionaries...)."""
_SCALARS = (bool, int, float, complex, str, bytes, type(None))

AttributeSnapshot = list[tuple[nn.Module, dict[str, Any]]]
"""Per module, its plain attributes by name."""


def _plain(value: Any) -> bool:
    """A value the snapshot keeps: a scalar, a tensor (by reference) or a tuple of them."""
    if isinstance(value, _SCALARS) or isinstance(value, torch.Tensor):
        return True
    return isinstance(value, tuple) and all(_plain(v) for v in value)


def _attributes(module: nn.Module) -> dict[str, Any]:
    return {name: value for name, value in vars(module).items() if name not in _INTERNALS and _plain(value)}


def snapshot(modules: Iterable[nn.Module]) -> AttributeSnapshot:
    """The plain attributes of ``modules``: scalars, tensors (the objects, not their values) and
    tuples of them; other objects (a config, a list) are left alone."""
    return [(module, _attributes(module)) for module in modules]


def put_back(saved: AttributeSnapshot) -> None:
    """Give every module of ``saved`` its recorded plain attributes again, and remove the plain
    attributes it has gained since (a cache made by the forward: made again by the next one)."""
    for module, attributes in saved:
        now = vars(module)
        for name in [n for n, v in now.items() if n not in attributes and n not in _INTERNALS and _plain(v)]:
            del now[name]
        now.update(attributes)
