"""Host (pinned memory) offload for CUDA models; on a CPU-only machine it is a clear error."""

from __future__ import annotations

import pytest
import torch

from remat.apply.offload import OffloadEngine

from offload_helpers import TOY_STORAGES, assert_grads_equal, toy_blocks, toy_step

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="host offload moves CUDA tensors; no CUDA here")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA, so offload:cpu exists")
def test_cpu_only_machine_refuses_host_offload():
    with pytest.raises(ValueError, match=r"'offload:cpu' moves activations from an accelerator .* no CUDA device .* use 'offload:disk'"):
        OffloadEngine("cpu")


def _cuda_toy():
    blocks = toy_blocks().cuda()
    torch.manual_seed(1)
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    return blocks, x


@needs_cuda
@pytest.mark.cuda
def test_host_offload_gradients_identical_and_memory_freed():
    blocks, x = _cuda_toy()
    want = toy_step(blocks, x, None)
    live = {}

    def measure(key, engine):
        def after_forward():
            if engine is not None:
                engine.wait_writes()
            torch.cuda.synchronize()
            torch.empty(1, device="cuda")  # an allocation processes the side stream's finished frees
            live[key] = torch.cuda.memory_allocated()
        return after_forward

    toy_step(blocks, x, None, measure("keep", None))
    engine = OffloadEngine("cpu", min_bytes=1)
    got = toy_step(blocks, x, engine, measure("offload", engine))
    assert_grads_equal(got, want)
    assert engine.stats().offloaded_storages == TOY_STORAGES
    assert live["keep"] - live["offload"] == engine.stats().offloaded_bytes


@needs_cuda
@pytest.mark.cuda
def test_pinned_pool_is_reused_across_steps():
    blocks, x = _cuda_toy()
    engine = OffloadEngine("cpu", min_bytes=1)
    toy_step(blocks, x, engine)
    torch.cuda.synchronize()
    first = engine.store.pool.allocated_bytes
    for _ in range(3):
        toy_step(blocks, x, engine)
    torch.cuda.synchronize()
    assert first > 0 and engine.store.pool.allocated_bytes == first
    engine.close()


@needs_cuda
@pytest.mark.cuda
def test_disk_offload_of_cuda_tensors(tmp_path):
    blocks, x = _cuda_toy()
    want = toy_step(blocks, x, None)
    engine = OffloadEngine("disk", directory=tmp_path, min_bytes=1)
    assert_grads_equal(toy_step(blocks, x, engine), want)
    engine.close()
