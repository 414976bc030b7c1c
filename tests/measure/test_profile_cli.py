"""`remat profile`: the table, the JSON file, user errors without a traceback."""

from pathlib import Path

from typer.testing import CliRunner

import pytest

from remat.cli import app
from remat.cli._app import console, err_console
from remat.measure.types import Profile

runner = CliRunner()


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    """Rich wraps at 80 columns when not on a terminal; the assertions read whole cell texts."""
    monkeypatch.setattr(console, "_width", 200)
    monkeypatch.setattr(err_console, "_width", 200)
TINY = ["--layers", "2", "--d-model", "16", "--heads", "2", "--seq", "8", "--batch", "2", "--vocab", "32",
        "--repeats", "1"]


def test_profile_gpt_table_and_json(tmp_path: Path):
    out = tmp_path / "p.json"
    result = runner.invoke(app, ["profile", "--model", "gpt", *TINY, "--json", str(out)])
    assert result.exit_code == 0, result.output
    for text in ("saved KiB", "fwd ms", "bwd ms", "GFLOPs", "share of step", "blocks.0", "blocks.1", "measured peak",
                 "stacks: blocks (2 x Block, blocks 0-1); chain breaks: 0",
                 # parameters by hand: tok_emb 32 x 16 fp32, pos_emb 8 x 16, ln_f 2 x 16, head 16 x 32 (no bias)
                 "fixed part: 5 module(s) outside blocks, parameters: tok_emb 2.00 KiB, pos_emb 512 B, ln_f 128 B, "
                 "head 2.00 KiB;",
                 "timing probes: run on 1 of 2 blocks (0); block 1 takes block 0's; measured apart because their "
                 "traced forward differed from an alike block's: none"):
        assert text in result.output
    profile = Profile.load(out)
    assert [b.name for b in profile.blocks] == ["blocks.0", "blocks.1"]
    # the head part: 2 x 8 tokens of 32 logits, too few for a default chunk (64 rows, under half the tokens)
    assert "head: head, 16 tokens x 32 vocabulary (float32); post part peak by head strategy: keep" in result.output
    assert [o.strategy for o in profile.head.options] == ["keep", "recompute"]


def test_profile_names_each_stack_and_the_code_between():
    result = runner.invoke(app, ["profile", "--model", "unet", "--layers", "3", "--d-model", "4", "--seq", "8",
                                 "--batch", "2", "--repeats", "1"])
    assert result.exit_code == 0, result.output
    assert "stacks: down (3 x DownBlock, blocks 0-2); up (2 x UpBlock, blocks 3-4); chain breaks: 4" in result.output
    # the head: a 1x1 convolution from 4 channels to 3, 12 weights + 3 biases in fp32
    assert "fixed part: 1 module(s) outside blocks, parameters: head 60 B; saved pre 0 B, between" in result.output
    assert "timing probes: run on 5 of 5 blocks (0-4); measured apart because" in result.output  # every level differs


def test_profile_file_target(tmp_path: Path):
    path = tmp_path / "mine.py"
    path.write_text(
        "import torch\nfrom torch import nn\n"
        "def build():\n"
        "    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])\n"
        "    return model, torch.randn(2, 4), lambda out, batch: out.sum(), torch.optim.SGD(model.parameters(), lr=0.1)\n"
    )
    result = runner.invoke(app, ["profile", f"{path}:build", "--repeats", "1"])
    assert result.exit_code == 0, result.output
    assert "SGD" in result.output and "2" in result.output


def test_profile_user_errors():
    result = runner.invoke(app, ["profile", "--model", "mlp", "--heads", "2"])
    assert result.exit_code == 2
    assert "option --heads does not apply to model 'mlp'" in result.output
    result = runner.invoke(app, ["profile", "--model", "gpt", *TINY, "--blocks", "nothing.*"])
    assert result.exit_code == 2 and "matches no module" in result.output
    result = runner.invoke(app, ["profile", "missing.py:build"])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_profile_and_plan_say_which_strategy_a_block_cannot_run_and_why(tmp_path: Path):
    path = tmp_path / "mine.py"
    path.write_text(
        "import torch\nfrom torch import nn\n"
        "from torch.utils._python_dispatch import _get_current_dispatch_mode\n"
        "class NoSelective(nn.Linear):\n"
        "    def forward(self, x):\n"
        "        if type(_get_current_dispatch_mode()).__name__ == '_CachingTorchDispatchMode':\n"
        "            raise RuntimeError('not under selective checkpointing')\n"
        "        return super().forward(x).relu()\n"
        "def build():\n"
        "    model = nn.Sequential(*[NoSelective(4, 4) for _ in range(3)])\n"
        "    return model, torch.randn(2, 4), lambda out, batch: out.sum()\n"
    )
    out = tmp_path / "p.json"
    result = runner.invoke(app, ["profile", f"{path}:build", "--repeats", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "strategies a block cannot run" in result.output
    assert result.output.count("RuntimeError: not under selective checkpointing") == 3
    result = runner.invoke(app, ["plan", str(out), "--strategy", "selective:save-matmuls"])
    assert result.exit_code == 0, result.output
    assert "RuntimeError: not under selective checkpointing" in result.output
    assert "ops saved)" not in result.output and result.output.count("│ recompute ") == 3  # no block selective
