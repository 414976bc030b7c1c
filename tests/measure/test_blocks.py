"""Finding blocks: automatic detection and user patterns."""

import pytest
from torch import nn

from remat.measure.blocks import candidate_lists, find_blocks
from remat.models import build


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.short = nn.ModuleList([nn.ReLU(), nn.ReLU()])
        self.mixed = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.Tanh())
        self.long = nn.Sequential(*[nn.Linear(2, 2) for _ in range(3)])
        self.pair = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
        self.outer = nn.ModuleList([nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)) for _ in range(2)])


def test_every_outermost_same_class_list_with_parameters_is_a_stack():
    names = [name for name, _ in find_blocks(_Mixed())]
    # short holds no parameters (activations); mixed is not one class; outer.0 and outer.1 are
    # stacks inside outer's members: without a forward to watch, the outer list is kept
    assert names == ["long.0", "long.1", "long.2", "pair.0", "pair.1", "outer.0", "outer.1"]
    assert ("mixed", 4, "Linear") not in candidate_lists(_Mixed())


@pytest.mark.parametrize("name, expected", [
    ("gpt", ["blocks.0", "blocks.1"]),
    ("hf:gpt2", ["transformer.h.0", "transformer.h.1"]),
    ("hf:llama", ["model.layers.0", "model.layers.1"]),
])
def test_built_in_models(name, expected):
    if name.startswith("hf:"):
        pytest.importorskip("transformers")
    model = build(name, num_layers=2, d_model=16, num_heads=2, seq_len=8, batch_size=1, vocab_size=32).model
    assert [n for n, _ in find_blocks(model)] == expected


def test_glob_stays_within_a_segment_and_double_star_crosses():
    model = build("gpt", num_layers=2, d_model=16, num_heads=2, seq_len=8, batch_size=1, vocab_size=32).model
    assert [n for n, _ in find_blocks(model, "blocks.*")] == ["blocks.0", "blocks.1"]
    assert [n for n, _ in find_blocks(model, "**.mlp")] == ["blocks.0.mlp", "blocks.1.mlp"]
    assert [n for n, _ in find_blocks(model, ["blocks.1.attn", "blocks.0.attn"])] == ["blocks.0.attn", "blocks.1.attn"]


def test_class_name_pattern():
    model = build("convnet", num_blocks=3, channels=4, image_size=8, batch_size=1).model
    assert [n for n, _ in find_blocks(model, "ResidualUnit")] == ["blocks.0", "blocks.1", "blocks.2"]
