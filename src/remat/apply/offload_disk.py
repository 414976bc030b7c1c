"""Disk store for offloaded activations: one file per block forward, written by a thread pool.

Files live in a private directory (mode 0700, ``remat-offload-<pid>-...``, see
`remat._diskio.make_private_dir`) inside the directory the user chose (default: the system
temporary directory); of that directory only the last component is ever created. A block's
forward opens one file (``O_EXCL | O_NOFOLLOW``, mode 0600); each saved storage becomes a *record* at an offset reserved in the main
thread and written with ``pwrite`` by the pool, so records of one block are written in parallel
and land sequentially. When the block's forward ends, a sealing job waits for its writes, then
``fdatasync`` + ``POSIX_FADV_DONTNEED``: the bytes really leave memory (dirty page cache is not
free memory). The raw I/O is `remat._diskio`'s, which `remat.measure.bandwidth` times, so the
planner's disk rates describe this path.

Every record carries a SHA-256 computed while writing and checked after reading (a deliberate
edit cannot keep it).
A missing file, a file too short for a record, a checksum mismatch, a full disk or an
unwritable directory raises `OffloadError` naming the file and the block; the store then
deletes every file and its private directory (`purge`) and makes a fresh directory on next use.
A file is deleted as soon as its last record is read; a file whose records are dropped unread
(graph freed without backward) is deleted by a `weakref.finalize`; `close`, garbage collection
of the store, interpreter exit and SIGTERM delete the directory; one left by SIGKILL is swept
by the next store that writes in the same directory.
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from remat._diskio import OffloadError, check_offload_root, flush, make_private_dir, read_at, remove_private_dir, write_at
from remat.measure.tracker import note_allocated


def _io_error(exc: OSError, what: str, block: str, verb: str) -> OffloadError:
    if exc.errno == errno.ENOSPC:
        hint = "the disk is full: free space or choose another --offload-dir."
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = "the directory is not writable: choose a writable --offload-dir."
    else:
        hint = "check the disk or choose another --offload-dir."
    return OffloadError(f"could not {verb} {what} for block {block!r}: {exc.strerror or exc} (errno {exc.errno}); {hint}")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class _Fd:
    """A file descriptor closed exactly once, never while one of its writes still runs."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd
        self.lock = threading.Lock()

    def try_close(self) -> None:
        """Close now unless the sealing job holds it (it then closes it itself)."""
        if self.lock.acquire(blocking=False):
            try:
                if self.fd is not None:
                    os.close(self.fd)
                    self.fd = None
            finally:
                self.lock.release()


def _when_all_done(futures: list[Future], then) -> None:
    """Call ``then()`` once every future has finished or been cancelled, without blocking
    (`concurrent.futures.wait` never returns for a future cancelled by ``shutdown``)."""
    if not futures:
        then()
        return
    remaining, count_lock = [len(futures)], threading.Lock()

    def one_done(_f: Future) -> None:
        with count_lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            then()

    for f in futures:
        f.add_done_callback(one_done)


def _discard_file(path: str, fd: _Fd, writes: list[Future], live: set[str]) -> None:
    """Finalizer of a block file: delete it, cancel its queued writes, close it after the running
    ones. It never blocks and takes no shared lock: it may run inside any code that drops the last
    reference (or in the garbage collector), in any thread."""
    live.discard(path)
    _unlink(path)  # a write still running lands in the unlinked inode, freed on close
    _when_all_done([f for f in writes if not f.cancel()], fd.try_close)


class BlockFile:
    """The file of one block's forward: records appended by offset, sealed when the block ends."""

    def __init__(self, store: DiskStore, path: str, block: str, fd: int) -> None:
        self.path, self.block, self.store = path, block, store
        self.generation = store._generation
        self.size_bytes = 0
        self.unread_records = 0
        self._fd = _Fd(fd)
        self._writes: list[Future] = []
        self._finalizer = weakref.finalize(self, _discard_file, path, self._fd, self._writes, store._live)

    def put(self, data: torch.Tensor) -> DiskTicket:
        """Queue ``data`` (1-D uint8, any device) as the next record; the job holds it until written."""
        offset, self.size_bytes = self.size_bytes, self.size_bytes + data.numel()
        holder = [data]  # the only reference to the bytes: the write job empties it when done
        job = self.store._submit(self._write_job, offset, holder)
        self._writes.append(job)
        self.unread_records += 1
        return DiskTicket(self, offset, data.numel(), job, holder)

    def _write_job(self, offset: int, holder: list[torch.Tensor]) -> int:
        data = holder[0]
        try:
            return write_at(self._fd.fd, offset, data.cpu() if data.device.type != "cpu" else data)
        except OSError as exc:
            error = _io_error(exc, f"offload file {self.path}", self.block, "write")
            self.store._fail(error)
            raise error from exc
        finally:
            holder.clear()
            del data

    def seal(self) -> None:
        """After the block's forward: flush and close the file once its writes have ended."""
        self.store._submit(self._flush_job, list(self._writes))

    def _flush_job(self, writes: list[Future]) -> None:
        for f in writes:  # FIFO pool: each earlier job has started, so waiting cannot deadlock
            try:
                f.result()  # unlike concurrent.futures.wait, returns for futures cancelled by shutdown
            except BaseException:  # noqa: BLE001 - a failed write reports itself
                pass
        with self._fd.lock:
            if self._fd.fd is None:
                return
            try:
                flush(self._fd.fd)
            except OSError as exc:
                self.store._fail(_io_error(exc, f"offload file {self.path}", self.block, "flush"))
            finally:
                os.close(self._fd.fd)
                self._fd.fd = None

    def record_read(self) -> None:
        """Count one record read back; the file goes when the last one is."""
        with self.store._lock:
            self.unread_records -= 1
            done = self.unread_records == 0
        if done:
            self._finalizer()


class DiskTicket:
    """One record of a block file: on its way to disk, on disk, or read back. Only the pending
    write job holds the bytes (through ``holder``), so they are freed as soon as they are written."""

    def __init__(self, file: BlockFile, offset: int, nbytes: int, write: Future, holder: list[torch.Tensor]) -> None:
        self.file, self.offset, self.nbytes = file, offset, nbytes
        self._write = write
        self._holder = holder
        self._read: Future | None = None

    def prefetch(self) -> None:
        """Start reading the record back (after its write ends) in the background. A write that
        has not started yet is cancelled instead: the bytes never left memory (the last blocks
        of a forward, needed again at once by backward), so they are used as they are."""
        with self.file.store._lock:
            if self._read is not None:
                return
            self._read = Future()
        if self._write.cancel():
            self._read.set_result(self._holder.pop())
            self.file.record_read()
            return
        self._write.add_done_callback(self._start_read)

    def _start_read(self, write: Future) -> None:
        if write.cancelled() or write.exception() is not None:
            self._read.set_exception(write.exception() if not write.cancelled() else OffloadError(
                f"the write to offload file {self.file.path} of block {self.file.block!r} was cancelled."))
            return
        try:
            self.file.store._submit(self._read_job, write.result())
        except RuntimeError as exc:  # the pool was shut down by purge or close
            self._read.set_exception(OffloadError(f"offload store closed before reading {self.file.path}: {exc}"))

    def _read_job(self, written_digest: bytes) -> None:
        path, block = self.file.path, self.file.block
        try:
            # made on this reading thread, where remat's live-memory trackers (dispatch modes of the
            # step's thread) do not see it: told of it (a plan was verified 15 % under its peak)
            buffer = torch.empty(self.nbytes, dtype=torch.uint8)
            note_allocated(buffer)
            data, digest = read_at(path, self.offset, self.nbytes, block, out=buffer)
            if digest != written_digest:
                raise OffloadError(
                    f"checksum mismatch in offload file {path} of block {block!r} at offset {self.offset}: "
                    f"sha256 {digest.hex()[:16]}... read, {written_digest.hex()[:16]}... written; the file was "
                    "changed on disk and the saved activations are not trusted: run the step again."
                )
            self._read.set_result(data)
            self.file.record_read()
        except FileNotFoundError as exc:
            self._read.set_exception(OffloadError(
                f"offload file {path} of block {block!r} is missing (deleted between forward and "
                f"backward?): {exc.strerror}; run the step again."
            ))
        except OSError as exc:
            self._read.set_exception(_io_error(exc, f"offload file {path}", block, "read"))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread by get()
            self._read.set_exception(exc)

    def get(self) -> torch.Tensor:
        """The record's bytes (a 1-D uint8 CPU tensor); raises `OffloadError` on any fault."""
        if self.file.generation != self.file.store._generation:
            raise OffloadError(
                f"offload file {self.file.path} of block {self.file.block!r} was deleted after an "
                "earlier offload error; the saved activations of that step are lost: run it again."
            )
        self.prefetch()
        return self._read.result()


def _remove_tree(state: dict) -> None:
    """Finalizer of a store: remove its private directory and the user directory it created."""
    private, made_root = state.get("private"), state.get("made_root")
    state["private"] = state["made_root"] = None
    remove_private_dir(private, made_root)


class DiskStore:
    """Block files under one private directory; a thread pool writes and reads the records."""

    def __init__(self, *, directory: str | os.PathLike | None = None, num_threads: int = 2) -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads={num_threads} must be >= 1; use 1 to 8 I/O threads.")
        self.root = check_offload_root(directory) if directory is not None else None
        self.num_threads = num_threads
        self._lock = threading.Lock()
        self._live: set[str] = set()
        self._fds: weakref.WeakSet[_Fd] = weakref.WeakSet()
        """The descriptors of the files opened for writing: `purge` closes those still open, so
        a deleted file's space comes back at once, not when the failed step's records (which a
        traceback the caller keeps may hold) are collected."""
        self._executor: ThreadPoolExecutor | None = None
        self._jobs: set[Future] = set()
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
        """Paths of block files not yet fully read back (or dropped)."""
        with self._lock:
            return sorted(self._live)

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.num_threads, thread_name_prefix="remat-offload")
        return self._executor

    def _submit(self, fn, *args) -> Future:
        """Run ``fn`` in the pool and remember it until it ends (for `wait_writes`)."""
        job = self._pool().submit(fn, *args)
        with self._lock:
            self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)
        return job

    def _fail(self, error: OffloadError) -> None:
        with self._lock:
            self._failure = self._failure or error

    def _ensure_dir(self, block: str) -> str:
        if self._state["private"] is None:
            root = self.root if self.root is not None else Path(tempfile.gettempdir())
            try:
                self._state["private"], self._state["made_root"] = make_private_dir(root)
            except ValueError as exc:
                raise OffloadError(f"{exc} (block {block!r})") from exc
            except OSError as exc:
                raise _io_error(exc, f"a private directory in offload directory {root}", block, "create") from exc
        return self._state["private"]

    def open_block(self, block: str) -> BlockFile:
        """A new 0600 file for one forward of ``block``."""
        self.check()
        private = self._ensure_dir(block)
        with self._lock:
            self._seq += 1
            path = os.path.join(private, f"{self._seq:08d}-{re.sub(r'[^A-Za-z0-9._-]', '_', block)[:80]}.bin")
            self._live.add(path)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            self.purge()
            raise _io_error(exc, f"offload file {path}", block, "create") from exc
        opened = BlockFile(self, path, block, fd)
        with self._lock:
            self._fds.add(opened._fd)
        return opened

    def check(self) -> None:
        """Raise the first background failure (after deleting every file)."""
        if self._failure is not None:
            failure, self._failure = self._failure, None
            self.purge()
            raise failure

    def wait_writes(self) -> None:
        """Block until every queued write, flush and read has ended; raise a failure if one occurred."""
        while True:
            with self._lock:
                jobs = list(self._jobs)
            if not jobs:
                break
            for job in jobs:
                try:
                    job.result()
                except BaseException:  # noqa: BLE001 - failures surface through check()
                    pass
        self.check()

    def purge(self) -> None:
        """Delete every file and the private directory; tickets issued before fail cleanly."""
        with self._lock:
            self._generation += 1
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        with self._lock:
            self._live.clear()
            fds = list(self._fds)
        for fd in fds:  # the writes have ended (the executor is shut down)
            fd.try_close()
        _remove_tree(self._state)

    def close(self) -> None:
        """Delete everything and stop the threads. The store may be used again afterwards."""
        self._failure = None
        self.purge()
