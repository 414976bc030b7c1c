"""Tensors a block writes to a mutable container it is handed, which the model's code holds to the
end of its forward (Gemma 4's storing layers write their keys and values to ``shared_kv_states``,
the mapping every layer is handed): kept, they go as the forward returns, or live on where the
block saves them; recomputed, the block's checkpoint holds its arguments, the container with
them, to the end of its backward, and everything written there is live that long. A tiny Gemma 4
at full recomputation measured its two storing layers' keys and values, 8,192 bytes (2.6 %), above
its prediction."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import remat
from exact_plans import assert_plans_exact
from remat.plan.planners import make_plan
from remat.plan.policies import policy
from remat.plan.types import Segment

B, S, D, V = 4, 16, 8, 8
STORED = B * S * D * 4  # one layer's tensor in the container, float32


class Layer(nn.Module):
    def __init__(self, index: int, saves: bool) -> None:
        super().__init__()
        self.index, self.saves = index, saves
        self.key, self.up, self.down = nn.Linear(D, D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor, store: dict[str, torch.Tensor] | None) -> torch.Tensor:
        k = self.key(x)  # nothing saves it, unless ``saves``; the loss reaches it, as Gemma 4's keys
        if store is not None:  # None: a cache took the keys (`CachedNet`)
            store[f"k{self.index}"] = k
        h = self.down(torch.tanh(self.up(x)))
        return x + (h * k if self.saves else h + k)


class Net(nn.Module):
    def __init__(self, saves: bool, n: int = 3) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.layers = nn.ModuleList(Layer(i, saves) for i in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, store = self.emb(x), {}  # held to the forward's end, as Gemma 4's model holds its mapping
        for layer in self.layers:
            h = layer(h, store=store)
        return self.head(h)


def _loss(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, V), batch.reshape(-1))


@pytest.mark.parametrize("saves", [False, True])
def test_what_blocks_write_to_a_container_a_checkpoint_holds_is_predicted(saves: bool) -> None:
    """Full recomputation was predicted 3 x 2,048 bytes under its measured peak: nothing counted
    the layers' tensors the mapping holds through the backward. Every layout is exact now; where a
    kept layer saves its tensor, or a selective one caches it, that is counted once."""
    torch.manual_seed(0)
    model, x = Net(saves), torch.randint(0, V, (B, S))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = remat.profile(model, x, _loss, opt)
    assert_plans_exact(model, x, prof, opt, strategies=("none", "full", "sqrt"), loss_fn=_loss)
    cache = {"selective:save-matmuls": policy("save-matmuls")}  # which caches the tensor it stores (a matmul's)
    for layout in [("recompute", "keep", "keep"), ("keep", "recompute", "keep"), ("keep", "keep", "recompute"),
                   ("recompute", "keep", "recompute"), ("selective:save-matmuls", "recompute", "keep"),
                   ("keep", "selective:save-matmuls", "selective:save-matmuls")]:
        segments = tuple(Segment(start=i, stop=i + 1, strategy=s, saved_ops=cache[s](prof.blocks[i]) if s in cache else ())
                         for i, s in enumerate(layout))
        plan = make_plan(prof, segments, "layout", None)
        ver = remat.verify(model, x, plan, _loss, optimizer=opt, repeats=1)
        assert ver.grads_identical and ver.measured_peak_bytes == plan.prediction.peak_bytes, (layout, ver.measured_peak_bytes,
                                                                                               plan.prediction.peak_bytes)
    # every layer is handed the mapping, which holds all three layers' tensors as the last ends
    stored = tuple((i, STORED, STORED if saves else 0, 0) for i in range(3))
    assert [b.stored_held for b in prof.blocks] == [stored] * 3
    assert [b.stored_calls for b in prof.blocks] == [("aten.addmm.default#0",)] * 3


class CachedNet(Net):
    """`Net` as Gemma 4 is: with a key/value cache on (``config.use_cache``, True by default) the
    layers read shared keys from the cache, without one from the mapping they are handed."""

    def __init__(self) -> None:
        super().__init__(saves=False)
        self.config = SimpleNamespace(use_cache=True)

    def forward(self, x: torch.Tensor, use_cache: bool | None = None) -> torch.Tensor:
        use_cache = self.config.use_cache if use_cache is None else use_cache
        h, store = self.emb(x), {}
        for layer in self.layers:
            h = layer(h, store=None if use_cache else store)
        return self.head(h)


def test_the_container_is_seen_as_the_step_fills_it_with_the_cache_on_by_default() -> None:
    """remat turns the cache off in training (`CacheOff`), so the step fills the mapping; the forward
    without gradients that finds what the code holds left the cache on, saw the mapping empty and
    predicted full recomputation 3 x 2,048 bytes under its measured peak (Gemma 4's default)."""
    torch.manual_seed(0)
    model, x = CachedNet(), torch.randint(0, V, (B, S))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="use_cache=True is incompatible"):
        prof = remat.profile(model, x, _loss, opt)
    assert [b.stored_held for b in prof.blocks] == [tuple((i, STORED, 0, 0) for i in range(3))] * 3
    assert_plans_exact(model, x, prof, opt, strategies=("none", "full", "sqrt"), loss_fn=_loss)
