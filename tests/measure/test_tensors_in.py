"""`remat.measure.storage.tensors_in` walks what a module holds, a config among it."""

from __future__ import annotations

import dataclasses

import torch

from remat.measure.storage import tensors_in


@dataclasses.dataclass
class _Guarded:
    """A config whose field raises when read as one value (Gemma 4's per-layer ``head_dim``)."""

    head_dim: int = 8
    scale: torch.Tensor = dataclasses.field(default_factory=lambda: torch.ones(3))

    def __getattribute__(self, name: str):
        if name == "head_dim":
            raise TypeError("'head_dim' is a per-layer attribute; read it from each layer's config")
        return super().__getattribute__(name)


def test_a_field_that_raises_is_skipped_and_the_others_walked():
    guarded = _Guarded()
    found = tensors_in({"config": guarded, "rows": [torch.zeros(2), (torch.zeros(1),)]})
    assert [tuple(t.shape) for t in found] == [(3,), (2,), (1,)]
    assert found[0] is guarded.scale
