"""Disk offload: identical gradients, exact bytes moved and freed, private files, cleanup."""

from __future__ import annotations

import gc
import os
import stat
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from remat.apply import offload_disk
from remat._batch import call_model, compute_loss
from remat.apply.offload import MIN_BYTES, OffloadEngine
from remat.measure.tracker import track_step
from remat.models import build

from offload_helpers import (
    MID_BYTES, NUM_BLOCKS, ROW_BYTES, TOY_FILES, TOY_STORAGES, LiveStorages, Wrapped, assert_grads_equal, dir_entries,
    toy_blocks, toy_step,
)

# what the toy's blocks save, by hand: block 0 saves its two (64, 512) activations (GELU's input
# and output; its own input x is a leaf the user holds), blocks 1..3 also their (64, 256) input.
TOY_OFFLOADED_BYTES = NUM_BLOCKS * 2 * MID_BYTES + (NUM_BLOCKS - 1) * ROW_BYTES
TOY_OFFLOADED_STORAGES = TOY_STORAGES


def test_toy_gradients_bit_identical_and_bytes_exact(toy, tmp_path):
    blocks, x = toy
    want = toy_step(blocks, x, None)
    engine = OffloadEngine("disk", directory=tmp_path, min_bytes=1)
    got = toy_step(blocks, x, engine)
    assert_grads_equal(got, want)
    stats = engine.stats()
    assert stats.offloaded_bytes == TOY_OFFLOADED_BYTES == 1_245_184
    assert stats.offloaded_storages == TOY_OFFLOADED_STORAGES == 11
    assert stats.kept_tensors == 2 * NUM_BLOCKS + 1  # 8 weight views + the leaf input x
    assert stats.restored_tensors == TOY_OFFLOADED_STORAGES  # each saved tensor is its own storage here
    engine.close()


def test_offloaded_bytes_are_gone_during_the_step(toy, tmp_path):
    """Live storages after the forward: the offload holds exactly the offloaded bytes fewer."""
    blocks, x = toy
    live = {}

    def forward_live(engine):
        tracker = LiveStorages(exclude=list(blocks.parameters()))

        def after_forward():
            if engine is not None:
                engine.wait_writes()
            gc.collect()
            live[engine is None] = tracker.live_bytes()

        with tracker:
            toy_step(blocks, x, engine, after_forward)

    forward_live(None)
    engine = OffloadEngine("disk", directory=tmp_path, min_bytes=1)
    forward_live(engine)
    assert live[True] - live[False] == TOY_OFFLOADED_BYTES
    # what stays without offload: the loss's saved input (64x256) and the loss itself
    assert live[False] == ROW_BYTES + 4
    engine.close()


def test_threshold_keeps_small_tensors(toy, tmp_path):
    blocks, x = toy
    want = toy_step(blocks, x, None)
    engine = OffloadEngine("disk", directory=tmp_path, min_bytes=MID_BYTES)  # (64, 256) inputs stay
    assert_grads_equal(toy_step(blocks, x, engine), want)
    assert engine.stats().offloaded_bytes == NUM_BLOCKS * 2 * MID_BYTES
    assert engine.stats().kept_tensors == 2 * NUM_BLOCKS + 1 + NUM_BLOCKS - 1
    engine.close()
    assert MIN_BYTES == 64 << 10


def test_files_private_and_deleted_after_the_step(toy, tmp_path):
    blocks, x = toy
    engine = OffloadEngine("disk", directory=tmp_path / "offload", min_bytes=1)
    seen = {}

    def after_forward():
        engine.wait_writes()
        private = engine.store.private_dir
        seen["dir_mode"] = stat.S_IMODE(os.stat(private).st_mode)
        seen["file_modes"] = {stat.S_IMODE(os.stat(os.path.join(private, f)).st_mode) for f in dir_entries(private)}
        seen["num_files"] = len(dir_entries(private))

    toy_step(blocks, x, engine, after_forward)
    assert seen == {"dir_mode": 0o700, "file_modes": {0o600}, "num_files": TOY_FILES}
    # each file deleted once read: by the I/O thread that finishes the read, which a loaded machine
    # may run a moment after the backward returns
    deadline = time.monotonic() + 5.0
    while dir_entries(engine.store.private_dir) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dir_entries(engine.store.private_dir) == []
    engine.close()
    assert not (tmp_path / "offload").exists()  # we made it, we removed it
    assert engine.store.private_dir is None


def test_graph_dropped_without_backward_deletes_files(toy, tmp_path):
    blocks, x = toy
    engine = OffloadEngine("disk", directory=tmp_path, min_bytes=1)
    h = x
    for i, block in enumerate(blocks):
        h = Wrapped(block, f"blocks.{i}", engine)(h)
    engine.wait_writes()
    assert len(engine.store.live_files()) == TOY_FILES
    del h
    gc.collect()
    assert engine.store.live_files() == []
    assert dir_entries(engine.store.private_dir) == []
    engine.close()
    assert dir_entries(tmp_path) == []


def test_engine_reusable_after_close(toy, tmp_path):
    blocks, x = toy
    want = toy_step(blocks, x, None)
    engine = OffloadEngine("disk", directory=tmp_path, min_bytes=1)
    for _ in range(2):
        assert_grads_equal(toy_step(blocks, x, engine), want)
        engine.close()
        assert dir_entries(tmp_path) == []


def _gpt_grads(model, batch, wrap_with=None, strategies=None):
    blocks = model.blocks
    original = list(blocks)
    if wrap_with is not None:
        for i, block in enumerate(original):
            if strategies is None or strategies[i] == "offload":
                blocks[i] = Wrapped(block, f"blocks.{i}", wrap_with)
            elif strategies[i] == "recompute":
                blocks[i] = _Checkpointed(block)
    try:
        torch.manual_seed(123)  # dropout masks
        model(*batch).backward()
    finally:
        for i, block in enumerate(original):
            blocks[i] = block
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


class _Checkpointed(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False, preserve_rng_state=True)


@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
def test_gpt_gradients_bit_identical(tmp_path, attention):
    built = build("gpt", attention=attention, optimizer="none")
    want = _gpt_grads(built.model, built.batch)
    engine = OffloadEngine("disk", directory=tmp_path, min_bytes=4096)
    got = _gpt_grads(built.model, built.batch, engine)
    assert_grads_equal(got, want)
    assert engine.stats().offloaded_storages > 0
    assert engine.stats().restored_tensors >= engine.stats().offloaded_storages
    assert engine.store.live_files() == []
    engine.close()
    assert dir_entries(tmp_path) == []


def test_composes_with_recompute_in_one_step(tmp_path):
    """Blocks 0 and 2 recomputed, 1 and 3 offloaded; dropout masks and gradients unchanged."""
    built = build("gpt", optimizer="none")
    want = _gpt_grads(built.model, built.batch)
    engine = OffloadEngine("disk", directory=tmp_path, min_bytes=4096)
    got = _gpt_grads(built.model, built.batch, engine, ["recompute", "offload", "recompute", "offload"])
    assert_grads_equal(got, want)
    assert engine.stats().offloaded_storages > 0
    engine.close()


def test_files_removed_at_interpreter_exit(tmp_path):
    """No close(), the graph still alive, an uncaught KeyboardInterrupt: the finalizers clean up."""
    code = f"""
import torch
from remat.apply.offload import OffloadEngine
engine = OffloadEngine("disk", directory={str(tmp_path)!r}, min_bytes=1)
x = torch.randn(64, 64, requires_grad=True)
with engine.block_context("blocks.0"):
    y = (x * 2).exp().sum()
engine.wait_writes()
print(engine.store.private_dir, len(engine.store.live_files()), flush=True)
raise KeyboardInterrupt
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    private, num_files = result.stdout.split()
    assert result.returncode != 0 and "KeyboardInterrupt" in result.stderr
    assert int(num_files) == 1 and private.startswith(str(tmp_path))
    assert not os.path.exists(private)
    assert dir_entries(tmp_path) == []


class _ToyNet(torch.nn.Module):
    def __init__(self, engine):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Wrapped(b, f"blocks.{i}", engine) for i, b in enumerate(toy_blocks()))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_live_memory_tracker_sees_the_offloaded_bytes_gone(toy, tmp_path):
    """remat's own tracker: when backward starts, exactly the offloaded bytes are not live."""
    _, x = toy
    first_bwd = {}
    for engine in (None, OffloadEngine("disk", directory=tmp_path, min_bytes=1)):
        net = _ToyNet(engine)

        def step():
            loss = net(x).square().sum()
            if engine is not None:
                engine.wait_writes()
            loss.backward()

        tracked = track_step(step, model=net, batch=x)
        first_bwd[engine is None] = next(e.live_bytes for e in tracked.timeline if e.phase == "bwd")
        if engine is not None:
            assert engine.stats().restored_tensors == TOY_OFFLOADED_STORAGES
            engine.close()
    assert first_bwd[True] - first_bwd[False] == TOY_OFFLOADED_BYTES


def test_records_not_yet_written_are_used_from_memory(toy, tmp_path, monkeypatch):
    """One I/O thread held on block 0's first record: every later record is still queued when
    backward wants it, so it is cancelled and served from memory; only that one write happens."""
    blocks, x = toy
    want = toy_step(blocks, x, None)
    gate, calls, real_write = threading.Event(), [], offload_disk.write_at

    def gated_write(fd, offset, data):
        calls.append(offset)
        gate.wait(timeout=120)
        return real_write(fd, offset, data)

    monkeypatch.setattr(offload_disk, "write_at", gated_write)
    engine = OffloadEngine("disk", directory=tmp_path, min_bytes=1, num_threads=1)
    outs = [x]
    for i, block in enumerate(blocks):
        outs.append(Wrapped(block, f"blocks.{i}", engine)(outs[-1]))
    outs[1].register_hook(lambda grad: gate.set())  # block 1's backward done: block 0 is next
    outs[-1].square().sum().backward()
    got = [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()]
    assert_grads_equal(got, want)
    assert calls == [0]
    engine.wait_writes()
    assert engine.store.live_files() == []
    engine.close()
    assert dir_entries(tmp_path) == []


def _disk_plan(tmp_path, built):
    """A profile of ``built`` with the rates of ``tmp_path``'s disk, and a plan putting every
    block's saved tensors there."""
    import remat
    from remat.measure.bandwidth import with_bandwidths
    from remat.plan.planners import make_plan
    from remat.plan.types import Segment

    prof = with_bandwidths(remat.profile(built.model, built.batch, built.loss_fn, built.optimizer, repeats=1), "cpu",
                           tmp_path)
    segments = tuple(Segment(start=i, stop=i + 1, strategy="offload:disk") for i in range(prof.num_blocks))
    return prof, make_plan(prof, segments, "disk", None)


def test_a_tracker_counts_what_another_thread_makes_for_the_step_when_told():
    """The records a disk offload reads back are made by its reading threads, which a live-memory
    tracker (a dispatch mode: its own thread's ops) does not see: an all-disk plan of GPT-2 was
    measured at 11.1 MB beside a 16.8 MB prediction, the reads left out. `note_allocated` counts
    them, until they are freed, whichever thread frees them."""
    from remat.measure.tracker import LiveTracker, note_allocated

    made = []

    def read(told: bool) -> None:
        made.append(torch.empty(1 << 20, dtype=torch.uint8))
        if told:
            note_allocated(made[-1])

    with LiveTracker(torch.device("cpu")) as tracker:
        for told in (False, True):
            worker = threading.Thread(target=read, args=(told,))
            worker.start()
            worker.join()
        assert tracker.live_bytes == 1 << 20 and tracker.live_by_label == {"temporaries": 1 << 20}
        threading.Thread(target=made.clear).start()  # freed on another thread too
        gc.collect()
        for _ in range(100):
            if tracker.live_bytes == 0:
                break
            threading.Event().wait(0.01)
        assert tracker.live_bytes == 0 and tracker.peak_bytes == 1 << 20
    note_allocated(torch.empty(8))  # no tracker entered: nothing to tell


def test_verify_counts_no_replays_and_what_is_read_back(tmp_path):
    """The engine's own storage ops were counted as replays: every offload plan was reported as
    "ops replayed a different number of times than planned" (MISMATCH). Bit-identical, every
    count as planned, nothing left in the directory. (The measured peak now counts the reads,
    above; how far they have got at the peak depends on the threads and the disk.)"""
    import remat

    built = build("hf:gpt2")
    _, plan = _disk_plan(tmp_path, built)
    check = remat.verify(built.model, built.batch, plan, built.loss_fn, built.optimizer, repeats=1,
                         offload_dir=str(tmp_path))
    assert check.grads_identical and check.recompute_counts_match
    assert dir_entries(tmp_path) == []


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_of_a_model_offloading_to_disk_gets_an_engine_of_its_own(tmp_path, how):
    """An EMA copy (`copy.deepcopy` of the trained model, timm's ModelEmaV2), and the model saved
    whole and loaded (``torch.save(model)``), raised "cannot pickle '_thread.lock' object". The
    copy offloads through an engine of its own, to the same directory, and steps to the
    original's gradients; each leaves nothing behind."""
    import copy
    import io

    import remat

    built = build("gpt", optimizer="none")
    _, plan = _disk_plan(tmp_path, built)
    remat.apply_(built.model, plan, offload_dir=str(tmp_path))
    if how == "deepcopy":
        other = copy.deepcopy(built.model)
    else:
        saved = io.BytesIO()
        torch.save(built.model, saved)
        saved.seek(0)
        other = torch.load(saved, weights_only=False)
    engines = [m.__dict__["_remat_runtime"].options["offload_engines"]["disk"] for m in (built.model, other)]
    assert engines[0] is not engines[1] and engines[0].store is not engines[1].store
    assert engines[1].store.root == engines[0].store.root
    grads = []
    for model in (built.model, other):
        torch.manual_seed(0)  # the same dropout masks
        compute_loss(call_model(model, built.batch), built.batch, built.loss_fn).backward()
        grads.append([p.grad for p in model.parameters()])
        assert model.__dict__["_remat_runtime"].options["offload_engines"]["disk"].stats().offloaded_storages > 0
    assert_grads_equal(grads[1], grads[0])
    for model in (built.model, other):
        remat.remove_(model)
    assert dir_entries(tmp_path) == []
