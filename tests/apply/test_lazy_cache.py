"""A cache a forward fills lazily, its table a buffer and its filled length a plain ``int``
(rotary_embedding_torch's ``cached_freqs`` and ``cached_freqs_seq_len``, used by many models):
putting the buffer back without the ``int`` leaves zeros the code believes filled. A profile did
(the model's outputs changed after `remat.profile`: every rotation the identity), and so did a
replay on the first step of a model never run (its gradients 1e-2 off, the next steps right).
Both now put back the modules' plain attributes with the buffers."""

from __future__ import annotations

import copy
from collections.abc import MutableMapping

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.checkpointing.attributes import put_back, snapshot

D, H, S, V = 32, 4, 16, 64


class Rotary(nn.Module):
    """rotary_embedding_torch's caching, reduced: the table in a buffer, its length in an int."""

    def __init__(self, dim: int, max_len: int = 64) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)
        self.register_buffer("cached", torch.zeros(max_len, dim), persistent=False)
        self.cached_len = 0

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        n = t.shape[-2]
        if n <= self.cached_len:
            f = self.cached[:n].detach()
        else:
            f = torch.outer(torch.arange(n, dtype=torch.float), self.inv_freq).repeat_interleave(2, dim=-1)
            self.cached[:n] = f.detach()
            self.cached_len = n
        rotated = torch.stack([-t[..., 1::2], t[..., 0::2]], dim=-1).flatten(-2)
        return t * f.cos() + rotated * f.sin()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.qkv, self.out = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.rope = Rotary(D // H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, H, d // H).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(self.rope(q), self.rope(k), v, is_causal=True)
        return x + self.out(a.transpose(1, 2).reshape(b, s, d))


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.blocks, self.head = nn.Embedding(V, D), nn.ModuleList(Block() for _ in range(3)), nn.Linear(D, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _loss(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out[:, :-1].reshape(-1, V), batch[:, 1:].reshape(-1))


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    _loss(model(x), x).backward()
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model, x = LM(), torch.randint(0, V, (2, S))
    return model, x


def test_a_profile_leaves_a_lazy_cache_as_it_found_it(setup):
    fresh, x = setup
    model = copy.deepcopy(fresh)
    remat.profile(model, x, _loss, torch.optim.SGD(model.parameters(), lr=0.1), repeats=1)
    rope = model.blocks[0].rope
    assert rope.cached_len == 0 and not rope.cached.any()  # empty, as the model came
    torch.testing.assert_close(model(x), fresh(x), rtol=0, atol=0)


@pytest.mark.parametrize("strategy", ["full", "selective:save-matmuls"])
def test_a_model_never_run_gets_the_plain_gradients_from_its_first_step(setup, strategy):
    fresh, x = setup
    plan = remat.plan(remat.profile(copy.deepcopy(fresh), x, _loss, repeats=1), strategy=strategy)
    reference = copy.deepcopy(fresh)
    planned = copy.deepcopy(fresh)
    remat.apply_(planned, plan)
    for step in range(2):  # the first fills the caches, the second reads them
        for got, want in zip(_grads(planned, x), _grads(reference, x)):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"step {step}")
    assert planned.blocks[0].rope.cached_len == S  # the forward's fill stands after the replay


def test_put_back_restores_the_scalars_and_tensor_references_of_the_modules_named():
    module, other = nn.Linear(2, 2), nn.Linear(2, 2)
    module.count, module.table, module.cfg, other.count = 0, None, {"a": 1}, 0
    saved = snapshot([module, other])
    module.count, module.table, module.extra, other.count = 3, torch.ones(2), 7, 5
    module.cfg["a"] = 2  # a mapping is no plain attribute: left as it is
    put_back(saved, [module])
    # an attribute gained since stays (a flag beside hooks a first forward installed)
    assert (module.count, module.table, module.cfg, module.extra) == (0, None, {"a": 2}, 7)
    assert other.count == 5  # its buffers were not put back: nor are its attributes
    assert isinstance(module.weight, nn.Parameter) and module.training


class DictRotary(nn.Module):
    """OLMo-core's cache: the table in a mapping the layers share, filled on the first call."""

    def __init__(self, dim: int, cache: MutableMapping) -> None:
        super().__init__()
        self.dim, self.cache = dim, cache

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        n = t.shape[-2]
        if "sin" in self.cache and self.cache["sin"].shape[0] >= n:  # later calls: a slice of the table
            sin, cos = self.cache["sin"][:n], self.cache["cos"][:n]
        else:  # the first: computed, kept, used as made
            inv = 1.0 / (10000 ** (torch.arange(0, self.dim, 2, dtype=torch.float) / self.dim))
            freqs = torch.outer(torch.arange(n, dtype=torch.float), inv)
            emb = torch.cat([freqs, freqs], dim=-1)
            sin, cos = emb.sin(), emb.cos()
            self.cache["sin"], self.cache["cos"] = sin, cos
        t1, t2 = t.chunk(2, dim=-1)
        return t * cos + torch.cat([-t2, t1], dim=-1) * sin


class NamespacedCache(MutableMapping):
    """OLMo-core's ``BufferCache``: a mapping (no dict) over data its namespaced views share."""

    def __init__(self, data: dict | None = None, namespace: str = "rope") -> None:
        self.data, self.namespace = data if data is not None else {}, namespace

    def __getitem__(self, key):
        return self.data.setdefault(self.namespace, {})[key]

    def __setitem__(self, key, value):
        self.data.setdefault(self.namespace, {})[key] = value

    def __delitem__(self, key):
        del self.data[self.namespace][key]

    def __iter__(self):
        return iter(list(self.data.get(self.namespace, {})))

    def __len__(self):
        return len(self.data.get(self.namespace, {}))


def _dict_lm(cache: MutableMapping) -> LM:
    model = LM()
    for block in model.blocks:
        block.rope = DictRotary(D // H, cache)
    return model


@pytest.mark.parametrize("cache", [dict, NamespacedCache])
@pytest.mark.parametrize("strategy", ["full", "selective:save-matmuls"])
def test_a_cache_the_layers_share_in_a_mapping_is_replayed_as_the_forward_found_it(cache, strategy):
    """A plan on a model never run: the first layer's forward computes the table, and its replay
    found the table filled and sliced it; a selective replay, whose calls must repeat the
    forward's, failed ("aten.alias.default invocation index 2 ... not found in storage"). The
    replay sees the mapping as its forward found it; the forward's table stays."""
    torch.manual_seed(0)
    fresh, x = _dict_lm(cache()), torch.randint(0, V, (2, S))
    plan = remat.plan(remat.profile(copy.deepcopy(fresh), x, _loss, repeats=1), strategy=strategy)
    planned, reference = copy.deepcopy(fresh), copy.deepcopy(fresh)
    remat.apply_(planned, plan)
    tables = []
    for step in range(2):  # the first fills the cache, the second reads it
        for got, want in zip(_grads(planned, x), _grads(reference, x)):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"step {step}")
        tables.append(planned.blocks[0].rope.cache["sin"])
    assert tables[0] is tables[1] and tables[0].shape == (S, D // H)  # the first forward's table


_TABLES: dict = {}
"""A cache at module level: no module holds it, so a replay finds it as the step left it."""


class GlobalRotary(DictRotary):
    def __init__(self, dim: int) -> None:
        nn.Module.__init__(self)
        self.dim = dim

    @property
    def cache(self) -> dict:
        return _TABLES


def test_a_replay_that_runs_other_calls_than_its_forward_says_why():
    """A cache in a global the replay cannot see as the forward found it: the error says what
    differs and what to do; after one forward without gradients (the cache filled) the plan's
    gradients are the plain ones."""
    torch.manual_seed(0)
    fresh, x = LM(), torch.randint(0, V, (2, S))
    for block in fresh.blocks:
        block.rope = GlobalRotary(D // H)
    _TABLES.clear()
    plan = remat.plan(remat.profile(copy.deepcopy(fresh), x, _loss, repeats=1), strategy="selective:save-matmuls")
    _TABLES.clear()
    planned, reference = copy.deepcopy(fresh), copy.deepcopy(fresh)
    remat.apply_(planned, plan)
    if hasattr(torch.utils.checkpoint, "_sac_storage_key"):  # torch >= 2.12: cached by call
        with pytest.raises(RuntimeError, match=r"reached op call aten\.\w+\.\w+, which its forward did not make"):
            _loss(planned(x), x).backward()
    else:
        # torch before 2.12 asks the policy per call in the replay and counts the saved calls
        # (matmuls) alone: the replay skips only the table's calls, and takes each matmul's cache
        _loss(planned(x), x).backward()
        first = [p.grad.clone() for p in planned.parameters()]
        _TABLES.clear()
        for got, want in zip(first, _grads(copy.deepcopy(reference), x)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    planned.zero_grad(set_to_none=True)  # what the failed backward accumulated
    _TABLES.clear()
    with torch.no_grad():
        planned(x)
    for got, want in zip(_grads(planned, x), _grads(reference, x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    _TABLES.clear()


class AlibiBias(nn.Module):
    """x-transformers' ALiBi: one module the model hands every attention layer; its bias is a
    buffer registered on the first call (None before), sliced on later calls."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bias", None, persistent=False)

    def forward(self, n: int) -> torch.Tensor:
        if self.bias is not None and self.bias.shape[-1] >= n:
            return self.bias[..., :n, :n]
        pos = torch.arange(n, dtype=torch.float32)
        bias = -(pos[None, :] - pos[:, None]).abs()
        self.register_buffer("bias", bias, persistent=False)
        return bias


class BiasedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor, rel: nn.Module) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / D ** 0.5 + rel(x.shape[1])
        return x + self.out(torch.softmax(scores, dim=-1) @ v)


class BiasedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.rel, self.head = nn.Embedding(V, D), AlibiBias(), nn.Linear(D, V)
        self.blocks = nn.ModuleList(BiasedAttention() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h, rel=self.rel)
        return self.head(h)


@pytest.mark.parametrize("strategy", ["selective:save-matmuls", "full"])
def test_a_cache_outside_the_blocks_filled_by_the_first_forward_is_replayed_cold(strategy):
    """The first forward of a fresh model computes the bias in the first block's call; its replay
    found it cached and sliced it: a selective replay failed ("reached op call aten.alias.default,
    which its forward did not make"), verify too, and the search picked such a plan as the least
    peak's. The replay of that call finds the module outside the blocks as its forward did; the
    first step's gradients are the plain ones, and the cache stays filled."""
    torch.manual_seed(0)
    fresh, x = BiasedLM(), torch.randint(0, V, (2, S))
    plan = remat.plan(remat.profile(copy.deepcopy(fresh), x, _loss, repeats=1), strategy=strategy)
    assert set(plan.block_strategies()) == {"recompute" if strategy == "full" else strategy}
    planned, reference = copy.deepcopy(fresh), copy.deepcopy(fresh)
    remat.apply_(planned, plan)
    for got, want in zip(_grads(planned, x), _grads(reference, x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert planned.rel.bias is not None and torch.equal(planned.rel.bias, reference.rel.bias)
    check = remat.verify(fresh, x, plan, _loss, repeats=1)
    assert check.grads_identical and fresh.rel.bias is None
