"""Disk offload faults: each is a clear error naming the file and block; nothing is left behind;
the model trains correctly afterwards."""

from __future__ import annotations

import errno
import gc
import os

import pytest

from remat.apply import offload_disk
from remat.apply.offload import OffloadEngine, OffloadError

from offload_helpers import CAN_MOUNT, TOY_FILES, assert_grads_equal, dir_entries, tmpfs, toy_step

BLOCK = r"block 'blocks\.\d'"


def _fault_after_forward(toy, tmp_path, damage, match):
    """Run a step whose files ``damage(path)`` hits between forward and backward."""
    blocks, x = toy
    want = toy_step(blocks, x, None)
    engine = OffloadEngine("disk", directory=tmp_path, min_bytes=1)

    def after_forward():
        engine.wait_writes()
        files = engine.store.live_files()
        assert len(files) == TOY_FILES
        damage(files[0])  # block 0's file (two 131072-byte records): read last

    with pytest.raises(OffloadError, match=match):
        toy_step(blocks, x, engine, after_forward)
    assert engine.store.live_files() == []
    assert dir_entries(tmp_path) == []  # every file and the private directory are gone
    blocks.zero_grad(set_to_none=True)  # the failed backward accumulated the later blocks' grads
    x.grad = None
    assert_grads_equal(toy_step(blocks, x, None), want)  # the model is fine
    assert_grads_equal(toy_step(blocks, x, engine), want)  # and so is the engine
    engine.close()
    assert dir_entries(tmp_path) == []


def test_missing_file(toy, tmp_path):
    _fault_after_forward(toy, tmp_path, os.unlink, rf"offload file {tmp_path}/\S+-blocks\.0\.bin of {BLOCK} is missing")


def test_corrupted_file(toy, tmp_path):
    def flip_byte(path):
        with open(path, "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))

    _fault_after_forward(toy, tmp_path, flip_byte, rf"checksum mismatch in offload file {tmp_path}/\S+-blocks\.0\.bin of {BLOCK} at offset 0")


def test_truncated_file(toy, tmp_path):
    def truncate(path):
        os.truncate(path, os.path.getsize(path) - 7)

    _fault_after_forward(
        toy, tmp_path, truncate, rf"offload file {tmp_path}/\S+ of {BLOCK} holds 262137 bytes but its record at offset 131072 needs 262144"
    )


def _fault_in_forward(toy, directory, match):
    blocks, x = toy
    want = toy_step(blocks, x, None)
    engine = OffloadEngine("disk", directory=directory, min_bytes=1)
    with pytest.raises(OffloadError, match=match):
        # wait for the writes before backward: a write still pending when backward reads its record
        # is served from memory, and its failure would then change nothing this test could see
        toy_step(blocks, x, engine, after_forward=engine.wait_writes)
    assert engine.store.live_files() == []
    assert dir_entries(directory) == []
    # a write that fails after the last block's forward has ended surfaces in backward (the first
    # read of its record), after the later blocks' grads were accumulated: clear them
    blocks.zero_grad(set_to_none=True)
    x.grad = None
    assert_grads_equal(toy_step(blocks, x, None), want)
    engine.close()


@pytest.mark.skipif(not CAN_MOUNT, reason="mounting a tmpfs needs root; test_disk_full_simulated covers ENOSPC")
def test_disk_full_real_tiny_filesystem(toy, tmp_path):
    """A 256 KiB tmpfs: the second (64, 512) activation no longer fits."""
    with tmpfs(tmp_path / "tiny", "256k") as tiny:
        _fault_in_forward(toy, tiny, rf"could not write offload file {tiny}/\S+ for {BLOCK}: No space left on device \(errno 28\); the disk is full")


def _disk_full_after_first_write(monkeypatch) -> None:
    """The record write raises ENOSPC after the first record, as a full disk does."""
    real_write, calls = offload_disk.write_at, []

    def write_at_then_enospc(fd, offset, data):
        calls.append(offset)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, offset, data)

    monkeypatch.setattr(offload_disk, "write_at", write_at_then_enospc)


def test_disk_full_simulated(toy, tmp_path, monkeypatch):
    """Without root: a simulated full disk."""
    _disk_full_after_first_write(monkeypatch)
    _fault_in_forward(toy, tmp_path, rf"could not write offload file {tmp_path}/\S+ for {BLOCK}: No space left on device")


def _open_under(directory) -> list[str]:
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            found.append(target)
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads the open descriptors from /proc")
def test_a_disk_full_leaves_no_descriptor_open(toy, tmp_path, monkeypatch):
    """A failed offload closes its files' descriptors itself: a deleted file keeps its disk space
    while one is open, and the failed step's records, which a traceback the caller keeps may
    hold, are collected whenever Python gets to them."""
    _disk_full_after_first_write(monkeypatch)
    blocks, x = toy
    engine = OffloadEngine("disk", directory=tmp_path, min_bytes=1)
    gc.disable()  # the failed step's records stay uncollected, as a kept traceback keeps them
    try:
        with pytest.raises(OffloadError, match="No space left on device") as caught:
            toy_step(blocks, x, engine, after_forward=engine.wait_writes)
        assert caught.value is not None and _open_under(tmp_path) == []
    finally:
        gc.enable()
    engine.close()


@pytest.mark.skipif(not CAN_MOUNT, reason="a read-only mount needs root (root ignores chmod); see the non-root variant")
def test_read_only_directory_mount(toy, tmp_path):
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as ro:
        _fault_in_forward(
            toy, ro, rf"could not create a private directory in offload directory {ro} for block 'blocks\.0': "
            r"Read-only file system \(errno 30\); the directory is not writable",
        )


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a 0500 directory; the mount variant covers root")
def test_read_only_directory_chmod(toy, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    _fault_in_forward(toy, ro, rf"could not create a private directory in offload directory {ro} .*Permission denied")


def test_interrupt_in_forward_leaves_nothing(toy, tmp_path):
    blocks, x = toy
    engine = OffloadEngine("disk", directory=tmp_path, min_bytes=1)
    with pytest.raises(KeyboardInterrupt):
        with engine.block_context("blocks.0", blocks[0]):
            blocks[0](x)
            raise KeyboardInterrupt
    assert engine.store.live_files() == [] and dir_entries(tmp_path) == []
    engine.close()


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"offload target 'gpu' is unknown; use 'cpu' or 'disk'"):
        OffloadEngine("gpu")
    with pytest.raises(ValueError, match=r"min_bytes=0 must be >= 1"):
        OffloadEngine("disk", min_bytes=0)
    with pytest.raises(ValueError, match=r"num_threads=0 must be >= 1"):
        OffloadEngine("disk", num_threads=0)
