"""apply_ / remove_: errors leave the model untouched, remove_ restores exactly, exact recompute
counts on a toy model, blocks with extra arguments, keyword arguments and tuple outputs."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import nn

from apply_helpers import LinearReluBlock, assert_identical, block_op_counts, make_plan, seg, train
from remat.apply.api import apply_, is_applied, remove_
from remat.apply.opcount import BlockOpCounter, expected_extra_calls

WIDTH = 8


class Toy(nn.Module):
    """Not an nn.Sequential: a ModuleList driven by the model's own loop."""

    def __init__(self, num_blocks: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LinearReluBlock(WIDTH) for _ in range(num_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def _toy(num_blocks: int = 6):
    torch.manual_seed(0)
    model = Toy(num_blocks)
    batch = torch.randn(4, WIDTH)
    return model, batch, [f"layers.{i}" for i in range(num_blocks)]


def _addmm_relu(counter: BlockOpCounter) -> list[tuple[int, int]]:
    return [(c["aten.addmm.default"], c["aten.relu.default"]) for c in counter.total]


@pytest.mark.parametrize("label,segments,expected", [
    ("keep", [seg(0, 6, "keep")], [(1, 1)] * 6),
    ("full", [seg(i, i + 1) for i in range(6)], [(2, 2)] * 6),
    ("every:3", [seg(0, 3), seg(3, 6)], [(2, 2)] * 6),
    ("sqrt-nested", [seg(0, 6, "recompute", seg(0, 2), seg(4, 6))], [(3, 3), (3, 3), (2, 2), (2, 2), (3, 3), (3, 3)]),
    ("two-levels", [seg(0, 6, "recompute", seg(0, 4, "recompute", seg(1, 2)))], [(3, 3), (4, 4), (3, 3), (3, 3), (2, 2), (2, 2)]),
    ("selective-save-addmm", [seg(i, i + 1, "selective:m", saved_ops=("aten.addmm.default#0",)) for i in range(6)], [(1, 2)] * 6),
    ("selective-none", [seg(i, i + 1, "selective:n") for i in range(6)], [(2, 2)] * 6),
    ("mixed", [seg(0, 2, "keep"), seg(2, 3, "selective:m", saved_ops=("aten.relu.default#0",)), seg(3, 6)], [(1, 1), (1, 1), (2, 1), (2, 2), (2, 2), (2, 2)]),
])
def test_exact_recompute_counts(label, segments, expected):
    model, batch, names = _toy()
    baseline = block_op_counts(model, batch, names)
    assert _addmm_relu(baseline) == [(1, 1)] * 6
    assert baseline.forward_keys[0] == ["aten.t.default#0", "aten.addmm.default#0", "aten.relu.default#0"]
    plan = make_plan(model, batch, names, segments, label)
    apply_(model, plan)
    counter = block_op_counts(model, batch, names)
    assert _addmm_relu(counter) == expected
    extra = expected_extra_calls(plan, baseline.forward_keys, baseline.stop_keys)
    assert [baseline.total[i] + extra[i] for i in range(6)] == counter.total


def test_every_op_of_a_block_counts_forward_and_backward():
    model, batch, names = _toy(2)
    counter = block_op_counts(model, batch, names)
    # forward: t, addmm, relu; backward: threshold_backward, 2 mm (grad input, grad weight) with
    # their transposes (4 t), sum + view (grad bias)
    assert counter.total[1] == Counter({"aten.t.default": 5, "aten.addmm.default": 1, "aten.relu.default": 1,
                                         "aten.threshold_backward.default": 1, "aten.mm.default": 2,
                                         "aten.sum.dim_IntList": 1, "aten.view.default": 1})


def test_apply_twice_is_an_error_and_keeps_the_first_plan():
    model, batch, names = _toy()
    plan = make_plan(model, batch, names, [seg(0, 6)])
    apply_(model, plan)
    forwards = [layer.__dict__["forward"] for layer in model.layers]
    with pytest.raises(ValueError, match=r"already has a remat plan applied.*remove_"):
        apply_(model, make_plan(model, batch, names, [seg(i, i + 1) for i in range(6)]))
    assert [layer.__dict__["forward"] for layer in model.layers] == forwards


def test_mismatched_plans_leave_the_model_untouched():
    model, batch, names = _toy()
    other, _, _ = _toy(5)
    cases = [
        (make_plan(other, batch, names[:5], [seg(0, 5)]), None, "model structure"),
        (make_plan(copy.deepcopy(model).double(), batch, names, [seg(0, 6)]), None, "dtype"),
        (make_plan(model, batch[:2], names, [seg(0, 6)]), batch, r"batch shapes was \('2x8:float32',\)"),
    ]
    for plan, check_batch, message in cases:
        with pytest.raises(ValueError, match=message):
            apply_(model, plan, batch=check_batch)
        assert not is_applied(model)
        assert all("forward" not in layer.__dict__ for layer in model.layers)
    bad_name = make_plan(model, batch, names, [seg(0, 6)])
    bad_name = type(bad_name)(**{**bad_name.__dict__, "block_names": (*names[:5], "head")})
    with pytest.raises(ValueError, match="names block 'head'"):
        apply_(model, bad_name)
    assert all("forward" not in layer.__dict__ for layer in model.layers)


def test_remove_restores_state_dict_and_forward_exactly():
    model, batch, names = _toy()
    own_forward = model.layers[2].forward  # a pre-existing instance attribute must come back as it was
    model.layers[2].forward = own_forward
    keys, values = list(model.state_dict()), {k: v.clone() for k, v in model.state_dict().items()}
    apply_(model, make_plan(model, batch, names, [seg(0, 3), seg(3, 6, "recompute", seg(4, 5))]))
    assert list(model.state_dict()) == keys
    model(batch).backward()
    remove_(model)
    assert not is_applied(model)
    assert model.layers[2].__dict__["forward"] is own_forward
    assert all("forward" not in model.layers[i].__dict__ for i in (0, 1, 3, 4, 5))
    assert list(model.state_dict()) == keys
    assert all(torch.equal(values[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="has no remat plan applied"):
        remove_(model)


def test_bad_arguments_are_type_errors():
    model, batch, names = _toy()
    with pytest.raises(TypeError, match="needs an nn.Module"):
        apply_("model", make_plan(model, batch, names, [seg(0, 6)]))
    with pytest.raises(TypeError, match=r"needs a remat Plan.*Plan\.load\(path\)"):
        apply_(model, {"segments": []})


def test_deepcopy_of_an_applied_model_runs_its_own_blocks():
    model, batch, names = _toy()
    apply_(model, make_plan(model, batch, names, [seg(0, 6, "recompute", seg(0, 3))]))
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(2)
    assert not torch.equal(clone(batch), model(batch))
    assert clone.layers[0].forward.runtime.blocks[0] is clone.layers[0]


@pytest.mark.parametrize("name", ["gpt", "hf:llama"])
def test_an_applied_model_saved_whole_loads_with_its_plan(name):
    """``torch.save(model)`` of any model with a plan applied raised "Can't pickle local object
    'CacheOff.drop_in.<locals>.hook'" (the hook that hands replayed blocks no empty cache).
    Loaded, the model has the plan applied and trains to the gradients of the model without it,
    to the bit; `remove_` on it restores every forward."""
    import io

    from remat.apply.api import applied_plan
    from remat.models import build

    built = build(name, num_layers=3, d_model=32, num_heads=2, seq_len=16, batch_size=2, vocab_size=64)
    names = [f"{'model.layers' if name.startswith('hf:') else 'blocks'}.{i}" for i in range(3)]
    plan = make_plan(built.model, built.batch, names, [seg(0, 2, "recompute", seg(0, 1)), seg(2, 3, "keep")])
    expected = train(built.model, built.batch, built.loss_fn)
    apply_(built.model, plan)
    saved = io.BytesIO()
    torch.save(built.model, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    assert is_applied(loaded) and applied_plan(loaded).segments == plan.segments
    assert_identical(expected, train(loaded, built.batch, built.loss_fn))
    remove_(loaded)
    assert not is_applied(loaded) and not any("forward" in m.__dict__ for m in loaded.modules())
    assert_identical(expected, train(loaded, built.batch, built.loss_fn))


class MaskedBlock(nn.Module):
    """Takes a mask positionally and a scale by keyword; returns a tuple like Hugging Face layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(0.5)

    def forward(self, x, mask, *, scale=1.0, position_ids=None):
        h = self.drop(torch.tanh(self.fc(x))) * mask * scale + position_ids.unsqueeze(-1)
        return (x + h, h.detach().mean())


class MaskedModel(nn.Module):
    def __init__(self, per_layer_scale: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MaskedBlock() for _ in range(4))
        self.per_layer_scale = per_layer_scale

    def forward(self, x, mask):
        positions = torch.arange(x.size(0), dtype=x.dtype)
        for i, layer in enumerate(self.layers):
            scale = 1.0 + i if self.per_layer_scale else 0.5
            x = layer(x, mask, scale=scale, position_ids=positions)[0]
        return x.pow(2).mean()


def test_blocks_with_masks_kwargs_and_tuple_outputs():
    torch.manual_seed(0)
    model = MaskedModel()
    batch = (torch.randn(4, WIDTH), (torch.rand(4, WIDTH) > 0.3).float())
    names = [f"layers.{i}" for i in range(4)]
    baseline = train(model, batch)
    for segments in ([seg(0, 4)], [seg(0, 4, "recompute", seg(1, 3))], [seg(0, 2), seg(2, 4, "recompute", seg(3, 4, "selective:x"))]):
        assert_identical(baseline, train(model, batch, plan=make_plan(model, batch, names, segments)))


def test_a_segment_whose_blocks_get_different_arguments_is_an_error():
    torch.manual_seed(0)
    model = MaskedModel(per_layer_scale=True)
    batch = (torch.randn(4, WIDTH), torch.ones(4, WIDTH))
    names = [f"layers.{i}" for i in range(4)]
    apply_(model, make_plan(model, batch, names, [seg(0, 2), seg(2, 4)]))
    with pytest.raises(ValueError, match=r"block 'layers.1' runs inside a multi-block segment.*single-block segments"):
        model(*batch)
    remove_(model)
    apply_(model, make_plan(model, batch, names, [seg(i, i + 1) for i in range(4)]))
    model(*batch).backward()


def test_eval_and_no_grad_run_the_blocks_plainly():
    model, batch, names = _toy()
    expected = model(batch)
    apply_(model, make_plan(model, batch, names, [seg(0, 6, "recompute", seg(2, 4))]))
    with torch.no_grad():
        assert torch.equal(model(batch), expected)
    counter = block_op_counts(model, batch, names)
    assert _addmm_relu(counter)[0] == (2, 2)


def test_auto_profiles_plans_and_applies_within_the_budget():
    from remat.apply.api import applied_plan, auto_
    from remat.models import build

    built = build("gpt", num_layers=3, d_model=16, num_heads=2, seq_len=32, batch_size=2, vocab_size=32)
    baseline = train(built.model, built.batch, steps=1)
    before = {k: v.clone() for k, v in built.model.state_dict().items()}
    plan = auto_(built.model, built.batch, optimizer=built.optimizer, budget="85%", strategy="full")
    assert applied_plan(built.model) is plan and plan.strategy_name == "full"
    assert plan.budget_bytes is not None and plan.prediction.peak_bytes <= plan.budget_bytes
    assert all(torch.equal(before[k], v) for k, v in built.model.state_dict().items())
    assert_identical(baseline, train(built.model, built.batch, steps=1))
    with pytest.raises(ValueError, match="already has a remat plan applied"):
        auto_(built.model, built.batch, budget="85%")


class _Named(torch.nn.Module):
    """Blocks in a ModuleDict iterated by key: no stack is found, the user names them."""

    def __init__(self) -> None:
        super().__init__()
        self.stages = torch.nn.ModuleDict({k: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for k in "abc"})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages.values():
            x = x + stage(x)
        return x.square().mean()


def test_auto_takes_the_blocks_the_user_names():
    """``auto_`` had no ``blocks=``: a model whose blocks remat cannot find (the error says to
    pass ``blocks=``) could be profiled and applied by hand, never by ``auto_``."""
    from remat.apply.api import applied_plan, auto_

    torch.manual_seed(0)
    model, x = _Named(), torch.randn(512, 8)
    with pytest.raises(ValueError, match="no blocks found"):
        auto_(model, x, budget="90%")
    assert applied_plan(model) is None
    plan = auto_(model, x, budget="90%", strategy="full", blocks="stages.*")
    assert plan.block_names == ("stages.a", "stages.b", "stages.c") and applied_plan(model) is plan


def test_offload_to_disk_moves_saved_tensors_and_keeps_gradients(tmp_path):
    from remat.apply.api import RUNTIME_ATTR
    from remat.models import build

    # attention scores of 4 x 2 heads x 256 x 256 float32 = 2 MiB: above the 1 MiB offload threshold
    built = build("gpt", num_layers=2, d_model=16, num_heads=2, seq_len=256, batch_size=4, vocab_size=32)
    names = ["blocks.0", "blocks.1"]
    plan = make_plan(built.model, built.batch, names, [seg(0, 1, "offload:disk"), seg(1, 2)])
    model = copy.deepcopy(built.model)
    apply_(model, plan, batch=built.batch, offload_dir=str(tmp_path))
    engine = model.__dict__[RUNTIME_ATTR].options["offload_engines"]["disk"]
    torch.manual_seed(1)
    loss = model(*built.batch)
    engine.wait_writes()
    assert engine.stats().offloaded_bytes >= 2 * 2**20
    loss.backward()
    torch.manual_seed(1)
    reference = copy.deepcopy(built.model)
    reference(*built.batch).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
    remove_(model)
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_autocast_state_is_replayed():
    model, batch, names = _toy()
    reference = copy.deepcopy(model)
    apply_(model, make_plan(model, batch, names, [seg(0, 6, "recompute", seg(0, 3)), ]))
    for m in (model, reference):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m(batch).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, q.grad), name
