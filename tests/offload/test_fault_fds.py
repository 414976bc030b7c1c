"""A failed offload closes its files' descriptors itself: a deleted file keeps its disk space while
one is open, and the failed step's records, which a traceback the caller keeps may hold, are
collected whenever Python gets to them."""

from __future__ import annotations

import errno
import gc
import os

import pytest

from remat.apply import offload_disk
from remat.apply.offload import OffloadEngine, OffloadError

from offload_helpers import toy_step


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
    real_write, calls = offload_disk.write_at, []

    def write_at_then_enospc(fd, offset, data):
        calls.append(offset)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, offset, data)

    monkeypatch.setattr(offload_disk, "write_at", write_at_then_enospc)
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
