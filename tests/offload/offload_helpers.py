"""Shared pieces of the offload tests: a toy chain of blocks, block wrapping, exact live bytes."""

from __future__ import annotations

import gc
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from remat.apply.offload import OffloadEngine

WIDTH, HIDDEN, ROWS, NUM_BLOCKS = 256, 512, 64, 4
ROW_BYTES = ROWS * WIDTH * 4  # one (64, 256) float32 activation: 65536 bytes
MID_BYTES = ROWS * HIDDEN * 4  # one (64, 512) float32 activation: 131072 bytes
TOY_STORAGES = NUM_BLOCKS * 2 + NUM_BLOCKS - 1  # storages the toy offloads at min_bytes=1 (see test_disk)
TOY_FILES = NUM_BLOCKS  # one file per block forward


class Wrapped(nn.Module):
    """Runs ``inner`` under ``engine.block_context(name, inner)`` (or plainly without engine)."""

    def __init__(self, inner: nn.Module, name: str, engine: OffloadEngine | None) -> None:
        super().__init__()
        self.inner, self.name, self.engine = inner, name, engine

    def forward(self, *args):
        if self.engine is None:
            return self.inner(*args)
        with self.engine.block_context(self.name, module=self.inner):
            return self.inner(*args)


def toy_blocks(seed: int = 0) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList(
        nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH)) for _ in range(NUM_BLOCKS)
    )


def toy_step(blocks, x: torch.Tensor, engine: OffloadEngine | None, after_forward=None) -> list[torch.Tensor]:
    """Forward through the blocks (each offloaded when ``engine``), backward; every gradient."""
    h = x
    for i, block in enumerate(blocks):
        h = Wrapped(block, f"blocks.{i}", engine)(h)
    loss = h.square().sum()
    if after_forward is not None:
        after_forward()
    loss.backward()
    grads = [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()]
    blocks.zero_grad(set_to_none=True)
    x.grad = None
    return grads


def assert_grads_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
        assert torch.equal(g, w)


class LiveStorages(TorchDispatchMode):
    """Weak references to every storage an op returns (but ``exclude``'s): live bytes, exactly."""

    def __init__(self, exclude: list[torch.Tensor] = ()) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        self.excluded = {t.untyped_storage()._cdata for t in exclude}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                storage = t.untyped_storage()
                if storage._cdata not in self.excluded:
                        self.refs.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        return out

    def live_bytes(self) -> int:
        return sum(nbytes for ref, nbytes in self.refs.values() if not ref.expired())


def dir_entries(path) -> list[str]:
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def _can_mount() -> bool:
    if os.geteuid() != 0:
        return False
    probe = tempfile.mkdtemp(prefix="remat-mount-probe-")  # one per process: test workers run side by side
    try:
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", probe], capture_output=True).returncode == 0
        if ok:
            subprocess.run(["umount", probe], check=True)
    finally:
        os.rmdir(probe)
    return ok


CAN_MOUNT = _can_mount()


@contextmanager
def tmpfs(path, size: str, read_only: bool = False) -> Iterator[str]:
    """A real small tmpfs mounted at ``path`` (root only)."""
    os.makedirs(path, exist_ok=True)
    options = f"size={size},mode=0755" + (",ro" if read_only else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
    try:
        yield str(path)
    finally:
        _unmount(str(path))


def _unmount(path: str, tries: int = 50) -> None:
    """``umount`` once nothing holds the mount: a failed engine's files are closed by their
    finalizers, which a loaded machine may run a moment after the test's last line ("target is
    busy", exit 32); a file held open for good still fails here after 5 s."""
    for _ in range(tries - 1):
        gc.collect()
        if subprocess.run(["umount", path], capture_output=True).returncode == 0:
            return
        time.sleep(0.1)
    subprocess.run(["umount", path], check=True)


@pytest.fixture
def toy():
    blocks = toy_blocks()
    torch.manual_seed(1)
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    return blocks, x
