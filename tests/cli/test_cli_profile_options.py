"""`remat profile --head-chunks` and `--offload-dir`, and `remat.profile(offload_dir=)`: what a
plan needed a profile to have, which only Python (chunk sizes) or only `remat run` (the disk's
rates) could give it; the messages named options that did not exist."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import remat
from remat.cli import app
from remat.models import build
from remat.plan.types import Segment

runner = CliRunner()


def test_profile_measures_the_chunks_and_the_disk_it_is_given(tmp_path):
    pytest.importorskip("transformers")
    path, disk = tmp_path / "p.json", tmp_path / "disk"
    result = runner.invoke(app, ["profile", "--model", "hf:llama", "--layers", "2", "--seq", "32", "--batch", "2",
                                 "--head-chunks", "32,16", "--offload-dir", str(disk), "--json", str(path)])
    assert result.exit_code == 0, result.output
    prof = remat.Profile.load(path)
    assert [o.strategy for o in prof.head.options] == ["keep", "recompute", "chunked:32", "chunked:16"]
    assert prof.bandwidths.disk_write_bytes_per_s > 0 and prof.bandwidths.disk_read_bytes_per_s > 0
    assert not disk.exists()  # made for the probe, removed with it
    plan = remat.plan(prof, strategy="none", head="chunked:16")
    assert plan.head == "chunked:16"
    bad = runner.invoke(app, ["profile", "--model", "mlp", "--head-chunks", "64,x"])
    assert bad.exit_code == 2 and "--head-chunks '64,x': expected positive token counts" in " ".join(bad.output.split())


def test_an_unmeasured_chunk_names_the_options_that_measure_it(tmp_path):
    pytest.importorskip("transformers")
    built = build("hf:llama", num_layers=2, seq_len=32, batch_size=2)
    prof = remat.profile(built.model, built.batch, built.loss_fn, built.optimizer, repeats=1, head_chunks=(16,))
    with pytest.raises(ValueError, match=r"'chunked:8' was not measured; measured: keep, recompute, chunked:16\. "
                                         r"Profile with its chunk size named: remat\.profile\(\.\.\., head_chunks="
                                         r"\(\.\.\.\)\), remat profile --head-chunks N,\.\.\."):
        remat.plan(prof, strategy="none", head="chunked:8")


def test_auto_offloads_to_the_directory_it_is_given(tmp_path):
    """`remat.auto_` took no offload directory, so it could never offload. A profile taken with
    one plans disk offload, trained to the unplanned gradients; `auto_` passes it to the profile
    and to `apply_`; a directory that cannot be used fails before the model runs."""
    from remat.plan.planners import make_plan

    built = build("gpt", optimizer="none", dropout=0.0, seq_len=64, batch_size=4)
    prof = remat.profile(built.model, built.batch, built.loss_fn, None, repeats=1, offload_dir=str(tmp_path))
    segments = tuple(Segment(start=i, stop=i + 1, strategy="offload:disk") for i in range(prof.num_blocks))
    check = remat.verify(built.model, built.batch, make_plan(prof, segments, "disk", None), built.loss_fn, None,
                         repeats=1, offload_dir=str(tmp_path))
    assert check.grads_identical and check.recompute_counts_match
    chosen = remat.auto_(built.model, built.batch, built.loss_fn, None, budget="100%", offload_dir=str(tmp_path))
    assert chosen.prediction.peak_bytes <= chosen.budget_bytes
    remat.remove_(built.model)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(Exception, match="afile"):
        remat.profile(built.model, built.batch, built.loss_fn, None, repeats=1, offload_dir=str(tmp_path / "afile"))


STEM_FILE = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(8, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8))
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2))

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def build():
    torch.manual_seed(0)
    return Net(), torch.randn(64, 8)
"""


def test_a_fixed_part_saving_more_than_the_blocks_is_pointed_at(tmp_path):
    """CANINE's one-layer character encoders held 74 % of its saved activations, outside the
    blocks, with no word: here a stem of wide layers before a 2-block stack of narrow ones."""
    path = tmp_path / "stem.py"
    path.write_text(STEM_FILE)
    result = runner.invoke(app, ["profile", f"{path}:build", "--repeats", "1"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "the fixed part saves more than the blocks (" in text and "name the modules that save it as blocks too" in text
    named = runner.invoke(app, ["profile", f"{path}:build", "--repeats", "1", "--blocks", "stem.*",
                                "--blocks", "layers.*"], env={"COLUMNS": "400"})
    assert named.exit_code == 0, named.output
    assert "the fixed part saves more than the blocks" not in " ".join(named.output.split())
