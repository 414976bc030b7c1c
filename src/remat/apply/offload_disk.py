"""Disk store for offloaded activations: one file per saved storage, written by a thread pool.

Files live in a private directory (mode 0700) created with `tempfile.mkdtemp` inside the
directory the user chose (default: the system temporary directory); each file is created with
``O_EXCL`` and mode 0600. A write is ``write`` + ``fdatasync`` + ``POSIX_FADV_DONTNEED``, so the
bytes really leave memory (dirty page cache is not free memory); the bandwidth probe in
`remat.measure.bandwidth` does the same, so the planner's disk rates describe this exact path.

Every file carries a CRC-32 (`zlib.crc32`) of its bytes, computed while writing and checked
after reading. A missing file, a short or long file, a checksum mismatch, a full disk or an
unwritable directory raises `OffloadError` naming the file and the block; the store then deletes
every file it owns and its private directory (`purge`), and starts a fresh directory on next use.
A file is deleted as soon as it is read; a ticket dropped unread (graph freed without backward)
deletes its file through a `weakref.finalize`; `close`, garbage collection of the store and
interpreter exit (finalizers run at exit) delete the directory.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
import threading
import weakref
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

CHUNK_BYTES = 8 << 20
"""Bytes per write/read system call (and per CRC update)."""


class OffloadError(RuntimeError):
    """An offloaded tensor could not be stored or restored; the message names the file and block."""


def write_file(path: str, data: torch.Tensor) -> int:
    """Write a 1-D uint8 CPU tensor to a new 0600 file, durably; return the CRC-32 of its bytes."""
    view = memoryview(data.numpy()).cast("B")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        crc, pos = 0, 0
        while pos < len(view):
            written = os.write(fd, view[pos : pos + CHUNK_BYTES])
            crc = zlib.crc32(view[pos : pos + written], crc)
            pos += written
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return crc


def read_file(path: str, nbytes: int, block: str) -> tuple[torch.Tensor, int]:
    """Read a whole file into a new uint8 tensor; return it with the CRC-32 of what was read."""
    out = torch.empty(nbytes, dtype=torch.uint8)
    view = memoryview(out.numpy()).cast("B")
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size != nbytes:
            raise OffloadError(
                f"offload file {path} of block {block!r} holds {size} bytes but {nbytes} were "
                "written (short or truncated file); the saved activations are lost: run the step again."
            )
        crc, pos = 0, 0
        while pos < nbytes:
            got = f.readinto(view[pos : pos + CHUNK_BYTES])
            if not got:
                raise OffloadError(
                    f"short read from offload file {path} of block {block!r}: {pos} of {nbytes} "
                    "bytes; the saved activations are lost: run the step again."
                )
            crc = zlib.crc32(view[pos : pos + got], crc)
            pos += got
    return out, crc


def _safe_name(block: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", block)[:80] or "block"


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _discard(path: str, write: Future, live: set[str], lock: threading.Lock) -> None:
    """Delete a ticket's file once its write (if any) has stopped; forget the path."""
    if not write.cancel() and not write.done():
        write.add_done_callback(lambda _f: _unlink(path))
    else:
        _unlink(path)
    with lock:
        live.discard(path)


def _remove_tree(state: dict) -> None:
    """Finalizer of a store: remove its private directory and the user dir it created."""
    private = state.get("private")
    if private:
        shutil.rmtree(private, ignore_errors=True)
        state["private"] = None
    made = state.get("made_root")
    if made:
        try:
            os.rmdir(made)
        except OSError:
            pass
        state["made_root"] = None


class DiskTicket:
    """One storage on its way to, on, or back from disk."""

    def __init__(self, store: DiskStore, path: str, nbytes: int, block: str, write: Future) -> None:
        self.path = path
        self.nbytes = nbytes
        self.block = block
        self.generation = store._generation
        self._store = store
        self._write = write
        self._read: Future | None = None
        self._crc: int | None = None
        self._finalizer = weakref.finalize(self, _discard, path, self._write, store._live, store._lock)

    def _check_generation(self) -> None:
        if self.generation != self._store._generation:
            raise OffloadError(
                f"offload file {self.path} of block {self.block!r} was deleted after an earlier "
                "offload error; the saved activations of that step are lost: run the step again."
            )

    def prefetch(self) -> None:
        """Start reading the file back (after its write ends) in the background."""
        with self._store._lock:
            if self._read is not None:
                return
            self._read = Future()
        self._write.add_done_callback(self._start_read)

    def _start_read(self, write: Future) -> None:
        error = write.exception() if not write.cancelled() else OffloadError(
            f"the write of offload file {self.path} of block {self.block!r} was cancelled."
        )
        if error is not None:
            self._read.set_exception(error)
            return
        self._crc = write.result()
        try:
            self._store._pool().submit(self._read_job)
        except RuntimeError as exc:  # pool shut down by close()
            self._read.set_exception(OffloadError(f"offload store closed before reading {self.path}: {exc}"))

    def _read_job(self) -> None:
        try:
            data, crc = read_file(self.path, self.nbytes, self.block)
            if crc != self._crc:
                raise OffloadError(
                    f"checksum mismatch in offload file {self.path} of block {self.block!r}: "
                    f"crc32 {crc:#010x} read, {self._crc:#010x} written; the file was changed on "
                    "disk, the saved activations are not trusted: run the step again."
                )
            _unlink(self.path)
            with self._store._lock:
                self._store._live.discard(self.path)
            self._read.set_result(data)
        except FileNotFoundError as exc:
            self._read.set_exception(OffloadError(
                f"offload file {self.path} of block {self.block!r} is missing (deleted between "
                f"forward and backward?): {exc.strerror}; run the step again."
            ))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread by get()
            self._read.set_exception(exc)

    def get(self) -> torch.Tensor:
        """The stored bytes (a 1-D uint8 CPU tensor); raises `OffloadError` on any fault."""
        self._check_generation()
        self.prefetch()
        try:
            return self._read.result()
        except OffloadError:
            raise
        except OSError as exc:
            raise _io_error(exc, f"offload file {self.path}", self.block, "read") from exc


def _io_error(exc: OSError, what: str, block: str, verb: str) -> OffloadError:
    if exc.errno == errno.ENOSPC:
        hint = "the disk is full: free space or choose another --offload-dir."
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = "the directory is not writable: choose a writable --offload-dir."
    else:
        hint = "check the disk or choose another --offload-dir."
    return OffloadError(
        f"could not {verb} {what} for block {block!r}: {exc.strerror or exc} "
        f"(errno {exc.errno}); {hint}"
    )


class DiskStore:
    """Files of offloaded storages under one private directory; a thread pool writes and reads."""

    def __init__(self, *, directory: str | os.PathLike | None = None, num_threads: int = 2) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads={num_threads} must be >= 1; use 1 to 8 I/O threads.")
        self.root = Path(directory) if directory is not None else None
        self.num_threads = num_threads
        self._lock = threading.Lock()
        self._live: set[str] = set()
        self._executor: ThreadPoolExecutor | None = None
        self._generation = 0
        self._seq = 0
        self._failure: OffloadError | None = None
        self._state: dict = {"private": None, "made_root": None}
        self._finalizer = weakref.finalize(self, _remove_tree, self._state)

    @property
    def private_dir(self) -> str | None:
        """The 0700 directory holding this store's files (None until the first write)."""
        return self._state["private"]

    def live_files(self) -> list[str]:
        """Paths of files written or being written and not yet read back."""
        with self._lock:
            return sorted(self._live)

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.num_threads, thread_name_prefix="remat-offload")
        return self._executor

    def _ensure_dir(self, block: str) -> str:
        if self._state["private"] is not None:
            return self._state["private"]
        root = self.root if self.root is not None else Path(tempfile.gettempdir())
        try:
            if not root.exists():
                root.mkdir(mode=0o700, parents=True)
                self._state["made_root"] = str(root)
            self._state["private"] = tempfile.mkdtemp(prefix="remat-offload-", dir=root)
        except OSError as exc:
            raise _io_error(exc, f"a private directory in offload directory {root}", block, "create") from exc
        return self._state["private"]

    def put(self, data: torch.Tensor, block: str) -> DiskTicket:
        """Queue ``data`` (1-D uint8, any device) for writing; the ticket holds it until written."""
        self.check()
        private = self._ensure_dir(block)
        with self._lock:
            self._seq += 1
            path = os.path.join(private, f"{self._seq:08d}-{_safe_name(block)}.bin")
            self._live.add(path)
        job = self._pool().submit(self._write_job, path, data, block)
        return DiskTicket(self, path, data.numel(), block, job)

    def _write_job(self, path: str, data: torch.Tensor, block: str) -> int:
        try:
            return write_file(path, data.cpu() if data.device.type != "cpu" else data)
        except OSError as exc:
            _unlink(path)
            error = _io_error(exc, f"offload file {path}", block, "write")
            with self._lock:
                self._failure = self._failure or error
            raise error from exc

    def check(self) -> None:
        """Raise the first background write failure (after deleting every file)."""
        if self._failure is not None:
            failure, self._failure = self._failure, None
            self.purge()
            raise failure

    def wait_writes(self) -> None:
        """Block until every queued write has ended; raise a failure if one occurred."""
        if self._executor is not None:
            barrier = [self._executor.submit(lambda: None) for _ in range(self.num_threads)]
            for f in barrier:
                f.result()
        self.check()

    def purge(self) -> None:
        """Delete every file and the private directory; tickets issued before fail cleanly."""
        with self._lock:
            self._generation += 1
            self._live.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        _remove_tree(self._state)

    def close(self) -> None:
        """Delete everything and stop the threads. The store may be used again afterwards."""
        self._failure = None
        self.purge()

