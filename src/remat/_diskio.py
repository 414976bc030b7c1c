"""Raw I/O of the offload files: positioned writes and reads with a SHA-256, a durable flush, and
the private directories that hold the files.

Below every stage: the disk offload (`remat.apply.offload_disk`) stores activations through it
and the bandwidth probe (`remat.measure.bandwidth`) times it, so the planner's disk rates
describe the path the offload takes.

Directories: every file lives in a private directory (mode 0700) named
``remat-offload-<pid>-<host>-<random>`` inside the directory the user named (`make_private_dir`);
``<host>`` tells this boot of this machine and its pid namespace from others that may share the
directory (a network file system, containers), whose pids say nothing here. Only
that leaf may be created, never its parents (`check_offload_root`). A private directory is removed
by its owner when done, at interpreter exit (`atexit`) and on SIGTERM (a handler that removes every
live one, then hands the signal to the handler installed before it); one left by a process killed
with SIGKILL is swept by the next `make_private_dir` in the same directory once its pid is dead
and its ``<host>`` is ours (`sweep_stale`). Files are opened with ``O_NOFOLLOW``: a symlink put in place of one is refused.

Checksum: SHA-256 of each record, computed while writing and checked after reading. Unlike a
CRC it cannot be matched by a deliberate edit; it was the fastest of SHA-256, BLAKE2b and BLAKE2s
measured here (about 1.3 GB/s per thread with SHA extensions, the writer threads hash in parallel
as hashlib releases the GIL).
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import os
import re
import shutil
import signal
import tempfile
import threading
from pathlib import Path

import torch

__all__ = [
    "CHUNK_BYTES", "PRIVATE_PREFIX", "OffloadError", "check_offload_root", "flush", "live_private_dirs",
    "host_token", "make_private_dir", "read_at", "remove_private_dir", "sweep_stale", "write_at",
]

CHUNK_BYTES = 8 << 20
"""Bytes per write/read system call (and per checksum update)."""

PRIVATE_PREFIX = "remat-offload-"
"""Name prefix of the private directories; the pid of the owner and `host_token` follow it."""

_STALE = re.compile(re.escape(PRIVATE_PREFIX) + r"(\d+)-([0-9a-f]{8})-[A-Za-z0-9_]+$")


def host_token() -> str:
    """8 hex digits naming this boot of this machine and this pid namespace: a pid means something
    only where both match (another host on a shared file system, another container)."""
    parts = [os.uname().nodename]
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            parts.append(f.read().strip())
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:
        pass
    return hashlib.blake2b("|".join(parts).encode(), digest_size=4).hexdigest()


class OffloadError(RuntimeError):
    """An offloaded tensor could not be stored or restored; the message names the file and block."""


def _digest() -> hashlib._Hash:
    return hashlib.sha256()


def write_at(fd: int, offset: int, data: torch.Tensor) -> bytes:
    """``pwrite`` a 1-D uint8 CPU tensor at ``offset``; return the SHA-256 of its bytes."""
    view = memoryview(data.numpy()).cast("B")
    digest, pos = _digest(), 0
    while pos < len(view):
        written = os.pwrite(fd, view[pos : pos + CHUNK_BYTES], offset + pos)
        digest.update(view[pos : pos + written])
        pos += written
    return digest.digest()


def flush(fd: int) -> None:
    """Make the file durable and drop its pages from the cache."""
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def read_at(path: str, offset: int, nbytes: int, block: str, out: torch.Tensor | None = None) -> tuple[torch.Tensor, bytes]:
    """Read ``nbytes`` at ``offset`` into ``out`` (a uint8 tensor of ``nbytes``; None: a new one);
    return it and the SHA-256 read. A symlink at ``path`` is refused (``O_NOFOLLOW``), as is
    anything but a regular file."""
    out = torch.empty(nbytes, dtype=torch.uint8) if out is None else out
    view = memoryview(out.numpy()).cast("B")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the last component is a symlink
            raise OffloadError(
                f"offload file {path} of block {block!r} was replaced by a symlink; it is not followed and "
                "the saved activations are not trusted: run the step again in a directory only you can write."
            ) from exc
        raise
    try:
        st = os.fstat(fd)
        if not (st.st_mode & 0o170000 == 0o100000):
            raise OffloadError(f"offload file {path} of block {block!r} is no longer a regular file; run the step again.")
        if st.st_size < offset + nbytes:
            raise OffloadError(
                f"offload file {path} of block {block!r} holds {st.st_size} bytes but its record at "
                f"offset {offset} needs {offset + nbytes} (short or truncated file); the saved "
                "activations are lost: run the step again."
            )
        digest, pos = _digest(), 0
        while pos < nbytes:
            got = os.preadv(fd, [view[pos : pos + CHUNK_BYTES]], offset + pos)
            if not got:
                raise OffloadError(f"short read from offload file {path} of block {block!r} at offset {offset + pos}.")
            digest.update(view[pos : pos + got])
            pos += got
    finally:
        os.close(fd)
    return out, digest.digest()


# ----------------------------------------------------------------------------- private directories

_live_lock = threading.RLock()  # re-entrant: the SIGTERM handler may interrupt its holder in the main thread
_live: set[str] = set()
_previous_sigterm: list = []  # [handler] once ours is installed


def live_private_dirs() -> list[str]:
    """Private directories of this process not yet removed."""
    with _live_lock:
        return sorted(_live)


def check_offload_root(root: str | os.PathLike) -> Path:
    """``root`` as a Path once it is usable: an existing directory, or a missing leaf whose parent
    is an existing directory (only that leaf will be made). Raises ValueError otherwise."""
    root = Path(root)
    if root.exists():
        if not root.is_dir():
            raise ValueError(f"offload directory {str(root)!r} exists but is not a directory; name a directory.")
        return root
    parent = root.parent
    if not parent.is_dir():
        raise ValueError(
            f"offload directory {str(root)!r} cannot be made: its parent {str(parent)!r} is not an existing directory "
            "(only the last component is created); create the parent first or name an existing directory."
        )
    return root


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def sweep_stale(root: str | os.PathLike) -> list[str]:
    """Remove private directories in ``root`` left by processes that died without cleaning up
    (SIGKILL): only real directories (not symlinks) named ``remat-offload-<pid>-<host>-...`` with
    this host's `host_token`, owned by this user, whose pid is dead. Returns the paths removed."""
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    uid, host = os.geteuid(), host_token()
    for entry in entries:
        match = _STALE.match(entry.name)
        if match is None or match.group(2) != host or int(match.group(1)) == os.getpid():
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if st.st_mode & 0o170000 != 0o040000 or st.st_uid != uid or _pid_alive(int(match.group(1))):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


def make_private_dir(root: str | os.PathLike) -> tuple[str, str | None]:
    """Make a 0700 ``remat-offload-<pid>-...`` directory in ``root`` (made, 0700, when it is a
    missing leaf whose parent exists) and register it for removal at exit and on SIGTERM. Sweeps
    stale directories of dead processes first. Returns (private directory, root if made here).
    Raises ValueError for a root that cannot be used, OSError when the file system refuses."""
    root = check_offload_root(root)
    made = None
    if not root.exists():
        os.mkdir(root, 0o700)
        made = str(root)
    sweep_stale(root)
    try:
        private = tempfile.mkdtemp(prefix=f"{PRIVATE_PREFIX}{os.getpid()}-{host_token()}-", dir=root)
    except BaseException:
        if made is not None:
            os.rmdir(made)
        raise
    with _live_lock:
        _live.add(private)
    _install_sigterm()
    return private, made


def remove_private_dir(private: str | None, made_root: str | None = None) -> None:
    """Remove a private directory and everything in it, then ``made_root`` when empty."""
    if private is not None:
        shutil.rmtree(private, ignore_errors=True)
        if not os.path.lexists(private):  # else (a file system turned read-only) it stays listed:
            with _live_lock:          # exit and SIGTERM try again (it was left behind for good)
                _live.discard(private)
    if made_root is not None:
        try:
            os.rmdir(made_root)
        except OSError:
            pass


def _remove_all() -> None:
    with _live_lock:
        dirs = list(_live)
        _live.clear()
    for private in dirs:
        shutil.rmtree(private, ignore_errors=True)


def _on_sigterm(signum, frame) -> None:
    _remove_all()
    previous = _previous_sigterm[0] if _previous_sigterm else signal.SIG_DFL
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    else:  # SIG_DFL (or a handler not set from Python): die of the signal, as without us
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm() -> None:
    """Chain our SIGTERM handler in front of the current one (main thread only: Python allows
    signal handlers nowhere else; other threads rely on atexit and the owners' cleanup)."""
    if _previous_sigterm or threading.current_thread() is not threading.main_thread():
        return
    try:
        previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):
        return
    _previous_sigterm.append(previous if previous is not None else signal.SIG_DFL)


atexit.register(_remove_all)
