"""load_target: built-in names, file:function targets, CLI size options."""

from pathlib import Path

import pytest
import torch

from remat.models import load_target, sizes_from_options

BUILD_FILE = '''
import torch
from torch import nn

def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    return model, torch.randn(2, 4), lambda out, batch: out.sum()

def bad():
    return 3
'''


def test_built_in_target_ignores_none_sizes():
    built = load_target("mlp", depth=2, width=None, batch_size=None, seed=3)
    assert len(built.model.blocks) == 2 and built.name == "mlp"


def test_file_target(tmp_path: Path):
    path = tmp_path / "mine.py"
    path.write_text(BUILD_FILE)
    built = load_target(f"{path}:build")
    assert isinstance(built.model, torch.nn.Sequential) and built.optimizer is None
    assert built.loss_fn(built.model(built.batch), built.batch).dim() == 0


def test_file_target_imports_its_neighbours(tmp_path: Path):
    (tmp_path / "helper_mod_for_remat.py").write_text("WIDTH = 6\n")
    (tmp_path / "main.py").write_text(
        "import torch\nfrom torch import nn\nfrom helper_mod_for_remat import WIDTH\n"
        "def build():\n    return nn.Sequential(nn.Linear(WIDTH, WIDTH)), torch.randn(1, WIDTH)\n"
    )
    built = load_target(f"{tmp_path / 'main.py'}:build")
    assert built.model[0].in_features == 6 and built.loss_fn is None


def test_file_target_errors(tmp_path: Path):
    path = tmp_path / "mine.py"
    path.write_text(BUILD_FILE)
    with pytest.raises(ValueError, match=r"file 'nope\.py' in 'nope\.py:build' does not exist"):
        load_target("nope.py:build")
    with pytest.raises(ValueError, match=r"has no function 'make'; callables found: bad, build"):
        load_target(f"{path}:make")
    with pytest.raises(ValueError, match=r"returned int; it must return a tuple \(model, batch"):
        load_target(f"{path}:bad")
    with pytest.raises(ValueError, match=r"size options \['layers'\] apply to built-in models only"):
        sizes_from_options(f"{path}:build", layers=3)


def test_size_options_map_to_each_model():
    assert sizes_from_options("gpt", layers=3, d_model=64, seq=None) == {"num_layers": 3, "d_model": 64}
    assert sizes_from_options("mlp", layers=3, d_model=64) == {"depth": 3, "width": 64}
    assert sizes_from_options("convnet", layers=3, seq=16) == {"num_blocks": 3, "image_size": 16}
    with pytest.raises(ValueError, match=r"option --heads does not apply to model 'mlp'; its size options: --batch, --d-model, --layers"):
        sizes_from_options("mlp", heads=2)


def test_device_moves_model_and_batch_and_keeps_the_optimizer_on_the_same_parameters():
    plain = load_target("gpt", num_layers=1, d_model=16, num_heads=2, seq_len=8, batch_size=2, vocab_size=32)
    moved = load_target("gpt", num_layers=1, d_model=16, num_heads=2, seq_len=8, batch_size=2, vocab_size=32,
                        device="cpu")
    # built on the CPU from the seed first: the same weights and batch wherever they go
    for a, b in zip(plain.model.parameters(), moved.model.parameters()):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(plain.batch, moved.batch))
    params = {id(p) for group in moved.optimizer.param_groups for p in group["params"]}
    assert params == {id(p) for p in moved.model.parameters()}


def test_bad_devices_are_refused_before_building():
    from remat.models.loading import move_to, resolve_device

    with pytest.raises(ValueError, match=r"device='nope' is not a device name torch knows; use cpu, cuda or cuda:N"):
        load_target("mlp", device="nope")
    with pytest.raises(ValueError, match=r"device='meta' runs nothing to measure"):
        resolve_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda:1' is not available here .*use --device cpu"):
            load_target("mlp", device="cuda:1")
    else:
        with pytest.raises(ValueError, match=r"this machine has \d+ cuda device"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")
    built = load_target("mlp", depth=1, width=4, batch_size=2)
    built.model(built.batch[0] if isinstance(built.batch, tuple) else built.batch).sum().backward()
    built.optimizer.step()
    with pytest.raises(ValueError, match="the optimizer already has state"):
        move_to(built, torch.device("cpu"))


def test_dtype_casts_parameters_and_floating_batch_tensors_only():
    mlp = load_target("mlp", depth=2, width=4, batch_size=3, dtype=torch.bfloat16)
    assert {p.dtype for p in mlp.model.parameters()} == {torch.bfloat16}
    assert all(t.dtype == torch.bfloat16 for t in (mlp.batch if isinstance(mlp.batch, tuple) else (mlp.batch,)))
    plain = load_target("mlp", depth=2, width=4, batch_size=3)
    for a, b in zip(plain.model.parameters(), mlp.model.parameters()):
        assert torch.equal(a.to(torch.bfloat16), b)  # the same seed's weights, rounded
    gpt = load_target("gpt", num_layers=1, d_model=16, num_heads=2, seq_len=8, batch_size=2, vocab_size=32,
                      dtype=torch.bfloat16)
    assert all(t.dtype == torch.int64 for t in gpt.batch)  # token ids keep their dtype
    assert gpt.model.blocks[0].attn.causal_mask.dtype == torch.bool
    params = {id(p) for group in gpt.optimizer.param_groups for p in group["params"]}
    assert params == {id(p) for p in gpt.model.parameters()}
    with pytest.raises(TypeError, match=r"dtype=torch\.int64 is not a floating torch\.dtype; pass e\.g\. torch\.bfloat16"):
        load_target("mlp", dtype=torch.int64)
