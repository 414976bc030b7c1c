"""Bandwidth probes: rates measured in the chosen directory, nothing left there."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from remat.apply.offload_disk import DiskStore
from remat.measure.bandwidth import WRITER_THREADS, measure_bandwidths, measure_disk

from offload_helpers import dir_entries


def test_disk_rates_measured_in_the_directory(tmp_path):
    bw = measure_bandwidths("cpu", tmp_path)
    for rate in (bw.disk_write_bytes_per_s, bw.disk_read_bytes_per_s):
        assert rate is not None and math.isfinite(rate) and rate > 0
    assert 0.0 <= bw.disk_overlap_fraction <= 1.0
    assert bw.disk_dir == str(tmp_path.resolve())
    assert bw.host_to_device_bytes_per_s is None and bw.overlap_fraction is None  # CPU: no host link
    assert dir_entries(tmp_path) == []


def test_the_overlap_probe_writes_with_as_many_threads_as_the_offload():
    assert WRITER_THREADS == inspect.signature(DiskStore).parameters["num_threads"].default


def test_nothing_measured_without_a_directory_on_cpu():
    bw = measure_bandwidths("cpu")
    assert (bw.disk_write_bytes_per_s, bw.disk_read_bytes_per_s, bw.host_to_device_bytes_per_s) == (None, None, None)


def test_missing_directory_is_an_error_for_the_probe_but_made_for_the_profile(tmp_path):
    with pytest.raises(ValueError, match=r"offload directory '.*/nope' does not exist; create it"):
        measure_disk(tmp_path / "nope")
    bw = measure_bandwidths("cpu", tmp_path / "dir")
    assert bw.disk_write_bytes_per_s > 0 and bw.disk_dir == str(tmp_path / "dir")
    assert dir_entries(tmp_path) == []  # the leaf it made is gone
    with pytest.raises(ValueError, match=r"offload directory '.*/new/dir' cannot be made: its parent '.*/new' is not an "
                       r"existing directory \(only the last component is created\); create the parent first"):
        measure_bandwidths("cpu", tmp_path / "new" / "dir")
    assert dir_entries(tmp_path) == []  # nothing made


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host<->device rates need CUDA")
@pytest.mark.cuda
def test_host_device_rates_on_cuda():
    """Pinned copies on a side stream run on the copy engines beside the matmuls: most of them is
    hidden (an H200 hid 86 % of a whole offloaded step's copies; the probe that synchronised the
    whole device after each matmul read 1 %)."""
    bw = measure_bandwidths("cuda")
    assert bw.host_to_device_bytes_per_s > 0 and bw.device_to_host_bytes_per_s > 0
    assert 0.5 <= bw.overlap_fraction <= 1.0


@pytest.mark.parametrize(("compute", "transfer", "together", "share"), [
    (4.0, 2.0, 4.0, 1.0),     # the copies vanish behind the compute
    (4.0, 2.0, 6.0, 0.0),     # one after the other
    (4.0, 2.0, 5.0, 0.5),     # half of the shorter hidden
    (1.0, 3.0, 3.5, 0.5),     # the shorter is the compute
    (4.0, 2.0, 6.5, 0.0),     # slower together than apart: nothing hidden, not less
    (4.0, 2.0, 3.0, 1.0),     # faster together (noise): all, not more
])
def test_overlap_share_is_what_the_cost_model_takes_back(compute, transfer, together, share):
    from remat.measure.bandwidth import overlap_share
    from remat.plan.offload_cost import exposed_ms

    assert overlap_share(compute, transfer, together) == share
    if 0.0 < share < 1.0:  # and the cost model's step is the measured one
        assert compute + exposed_ms(transfer, compute, share) == together


def test_a_disk_probe_that_fails_marks_disk_offload_unavailable_on_every_block(tmp_path, monkeypatch):
    """A disk that fails mid-probe (here: fdatasync raising EIO) leaves the profile's disk rates
    out and every block's offload:disk unavailable with the reason; a directory that cannot be
    made stays the caller's error."""
    import errno
    import os

    import remat.measure.bandwidth as bandwidth
    from remat.measure.profile import profile
    from remat.plan.planners import plan
    from remat.plan.search import block_options

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    prof = profile(model, torch.randn(2, 4), lambda out, batch: out.sum(), blocks="*", repeats=1)

    def failing_flush(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(bandwidth, "flush", failing_flush)
    got = bandwidth.with_bandwidths(prof, "cpu", tmp_path)
    assert got.bandwidths.disk_write_bytes_per_s is None and got.bandwidths.disk_dir is None
    assert [b.unavailable for b in got.blocks] == [(("offload:disk", "OSError: [Errno 5] Input/output error"),)] * 2
    assert all(s.strategy != "offload:disk" for i in range(2) for s in block_options(got, i))
    assert plan(got, strategy="none").block_strategies() == ("keep", "keep")
    assert dir_entries(tmp_path) == []  # the probe's file is gone
    with pytest.raises(OSError):
        bandwidth.measure_bandwidths("cpu", tmp_path)  # the plain probe still raises
    monkeypatch.undo()
    fine = bandwidth.with_bandwidths(prof, "cpu", tmp_path)
    assert fine.bandwidths.disk_write_bytes_per_s > 0 and all(b.unavailable == () for b in fine.blocks)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"its parent '.*/file' is not an existing directory"):
        bandwidth.with_bandwidths(prof, "cpu", tmp_path / "file" / "sub")
    with pytest.raises(ValueError, match=r"offload directory '.*/file' exists but is not a directory"):
        bandwidth.with_bandwidths(prof, "cpu", tmp_path / "file")
