"""Offload directories that cannot hurt: removed on SIGTERM (chained to the previous handler) and at
exit, stale ones of killed processes swept (only remat's own), symlinks refused, only the named leaf
ever made."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys

import pytest

from remat._diskio import PRIVATE_PREFIX, host_token, live_private_dirs, sweep_stale
from remat.apply.offload import OffloadEngine, OffloadError

from offload_helpers import assert_grads_equal, dir_entries, toy_step

_CHILD = """
import os, signal, sys, time, torch
from remat.apply.offload import OffloadEngine
if sys.argv[2] == "chain":
    def previous(signum, frame):
        open(os.path.join(sys.argv[1], "..", "previous-ran"), "w").close()
        sys.exit(7)
    signal.signal(signal.SIGTERM, previous)
engine = OffloadEngine("disk", directory=sys.argv[1], min_bytes=1)
x = torch.randn(64, 64, requires_grad=True)
with engine.block_context("blocks.0"):
    y = (x * 2).exp().sum()
engine.wait_writes()
print(engine.store.private_dir, len(engine.store.live_files()), flush=True)
time.sleep(60)
"""


def _terminated_child(directory, mode):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(directory), mode], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    private, num_files = child.stdout.readline().split()
    assert int(num_files) == 1 and len(dir_entries(private)) == 1  # the activation is on disk
    child.send_signal(signal.SIGTERM)
    child.wait(timeout=60)
    child.stdout.close()
    child.stderr.close()
    return child.returncode, private


def test_sigterm_removes_the_files_and_dies_of_the_signal(tmp_path):
    returncode, private = _terminated_child(tmp_path, "plain")
    assert returncode == -signal.SIGTERM
    assert os.path.basename(private).startswith(PRIVATE_PREFIX) and f"-{host_token()}-" in private
    assert not os.path.exists(private)
    assert dir_entries(tmp_path) == []


def test_sigterm_chains_to_the_previous_handler(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    returncode, private = _terminated_child(work, "chain")
    assert returncode == 7 and (tmp_path / "previous-ran").exists()  # the program's own handler ran
    assert dir_entries(work) == []


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_stale_directories_of_dead_processes_are_swept_and_nothing_else(toy, tmp_path):
    dead, host = _dead_pid(), host_token()
    stale = tmp_path / f"{PRIVATE_PREFIX}{dead}-{host}-abc123"
    stale.mkdir(mode=0o700)
    (stale / "00000001-blocks.0.bin").write_bytes(b"\0" * 100)
    alive = tmp_path / f"{PRIVATE_PREFIX}{os.getppid()}-{host}-def456"  # a live process's: kept
    alive.mkdir()
    elsewhere = tmp_path / f"{PRIVATE_PREFIX}{dead}-{'0' * 8 if host != '0' * 8 else '1' * 8}-ghi789"
    elsewhere.mkdir()  # another host or container: its pid says nothing here, kept
    other = tmp_path / "remat-offload-notapid"  # not remat's pattern: kept
    other.mkdir()
    target = tmp_path / "precious"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    link = tmp_path / f"{PRIVATE_PREFIX}{dead}-{host}-link00"  # a symlink with remat's name: not followed, kept
    link.symlink_to(target)
    blocks, x = toy
    want = toy_step(blocks, x, None)
    engine = OffloadEngine("disk", directory=tmp_path, min_bytes=1)
    assert_grads_equal(toy_step(blocks, x, engine), want)
    engine.close()
    assert not stale.exists()
    assert dir_entries(tmp_path) == sorted([alive.name, elsewhere.name, other.name, "precious", link.name])
    assert dir_entries(target) == ["keep.txt"]
    assert sweep_stale(tmp_path) == []  # nothing more to sweep


def test_a_symlink_in_place_of_a_file_is_refused(toy, tmp_path):
    blocks, x = toy
    engine = OffloadEngine("disk", directory=tmp_path / "off", min_bytes=1)
    decoy = tmp_path / "decoy.bin"

    def swap_for_symlink():
        engine.wait_writes()
        path = engine.store.live_files()[0]
        with open(path, "rb") as f:
            decoy.write_bytes(f.read())  # the very same bytes: only O_NOFOLLOW catches it
        os.unlink(path)
        os.symlink(decoy, path)

    with pytest.raises(OffloadError, match=r"offload file \S+-blocks\.0\.bin of block 'blocks\.0' was replaced by a "
                       r"symlink; it is not followed"):
        toy_step(blocks, x, engine, swap_for_symlink)
    assert dir_entries(tmp_path) == ["decoy.bin"]  # private directory and the leaf it made: gone
    engine.close()


def test_only_the_named_leaf_is_made_and_only_when_its_parent_exists(toy, tmp_path):
    with pytest.raises(ValueError, match=rf"offload directory '{tmp_path}/a/b' cannot be made: its parent "
                       rf"'{tmp_path}/a' is not an existing directory \(only the last component is created\); "
                       "create the parent first or name an existing directory"):
        OffloadEngine("disk", directory=tmp_path / "a" / "b")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"offload directory '.*/file' exists but is not a directory; name a directory"):
        OffloadEngine("disk", directory=tmp_path / "file")
    assert dir_entries(tmp_path) == ["file"]
    blocks, x = toy
    engine = OffloadEngine("disk", directory=tmp_path / "leaf", min_bytes=1)
    seen = {}

    def look():
        seen["leaf"] = stat.S_IMODE(os.stat(tmp_path / "leaf").st_mode)
        seen["private"] = stat.S_IMODE(os.stat(engine.store.private_dir).st_mode)
        seen["live"] = live_private_dirs()

    toy_step(blocks, x, engine, look)
    assert seen == {"leaf": 0o700, "private": 0o700, "live": [engine.store.private_dir]}
    engine.close()
    assert dir_entries(tmp_path) == ["file"] and live_private_dirs() == []


def test_a_parent_removed_after_construction_is_an_offload_error(toy, tmp_path):
    blocks, x = toy
    (tmp_path / "a").mkdir()
    engine = OffloadEngine("disk", directory=tmp_path / "a" / "b", min_bytes=1)
    (tmp_path / "a").rmdir()
    with pytest.raises(OffloadError, match=r"its parent '.*/a' is not an existing directory .*\(block 'blocks\.0'\)"):
        toy_step(blocks, x, engine)
    assert dir_entries(tmp_path) == []


def test_a_private_directory_that_cannot_be_removed_is_tried_again_at_exit(tmp_path, monkeypatch):
    """A file system turned read-only after a step: the purge could not remove the private
    directory, forgot it, and it stayed after `remove_` and after the process ended. It stays
    listed, and the exit's cleanup (here called by hand, the file system writable again) removes it."""
    from remat import _diskio

    monkeypatch.setattr(_diskio, "_live", set())  # this test's directory alone: the exit's cleanup takes all
    private, _ = _diskio.make_private_dir(str(tmp_path))
    (tmp_path / os.path.basename(private) / "block-0").write_bytes(b"x")
    real = _diskio.shutil.rmtree
    monkeypatch.setattr(_diskio.shutil, "rmtree", lambda path, ignore_errors=False: None)  # EROFS, ignored
    _diskio.remove_private_dir(private)
    assert private in live_private_dirs() and os.path.isdir(private)
    monkeypatch.setattr(_diskio.shutil, "rmtree", real)
    _diskio._remove_all()
    assert not os.path.exists(private) and private not in live_private_dirs()
