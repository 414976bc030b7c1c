"""The CUDA caching allocator's view of one planned training step, against remat's prediction.

remat predicts the peak of live storages (`remat.measure.tracker`'s account: parameters,
buffers, gradients, optimizer state, activations, temporaries). The allocator sees more: the
batch, library workspaces (cuBLAS, cuDNN), allocations inside kernels that never surface as a
tensor, its 512-byte rounding; and it reserves more than it allocates (whole segments, cached
free blocks, fragmentation). This module measures both of its figures on a fresh copy of the
model with only that copy on the device:

- ``max_allocated_bytes``: `torch.cuda.max_memory_allocated` over one step;
- ``max_reserved_bytes``: `torch.cuda.max_memory_reserved` over the same step, after
  `torch.cuda.empty_cache` (so only what the step itself needs stays reserved);
- ``outside_bytes``: what was allocated before the step less the model state the prediction
  counts (parameters, buffers, gradients, optimizer state): the batch, workspaces, leftovers.

Both are compared with the prediction after taking ``outside_bytes`` off, so the error is the
allocator's difference from the live-storage account, not the batch's size.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from remat._batch import call_model, compute_loss
from remat.apply.api import apply_, remove_
from remat.models import load_target
from remat.plan.types import Plan


def _train_step(built: Any) -> None:
    (built.optimizer or built.model).zero_grad(set_to_none=True)
    loss = compute_loss(call_model(built.model, built.batch), built.batch, built.loss_fn)
    loss.backward()
    del loss  # the optimizer step starts from the model state alone, as in remat's step
    if built.optimizer is not None:
        built.optimizer.step()


def state_bytes(built: Any, device: torch.device) -> int:
    """Bytes on ``device`` of the storages of parameters, buffers, gradients and optimizer state,
    each storage once (what remat's prediction counts as model state)."""
    tensors = [*built.model.parameters(), *built.model.buffers()]
    tensors += [p.grad for p in built.model.parameters() if p.grad is not None]
    if built.optimizer is not None:
        tensors += [v for state in built.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    on_device = [t for t in tensors if t.device.type == device.type and device.index in (None, t.device.index)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in on_device}
    return sum(storages.values())


def _pct(measured: float, predicted: float) -> float | None:
    return 100.0 * (measured - predicted) / predicted if predicted > 0 else None


def allocator_peaks(model_name: str, sizes: dict[str, Any], plan: Plan, *, device: str, seed: int = 0) -> dict[str, Any]:
    """Build ``model_name`` afresh on the CUDA ``device``, apply ``plan``, take one warm-up step
    (optimizer state, library handles), then measure one step with the allocator's counters."""
    built = load_target(model_name, seed=seed, device=device, **sizes)
    apply_(built.model, plan, batch=built.batch)
    try:
        torch.manual_seed(seed)
        _train_step(built)
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        outside = torch.cuda.memory_allocated(device) - state_bytes(built, torch.device(device))
        _train_step(built)
        torch.cuda.synchronize(device)
        allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    finally:
        remove_(built.model)
    predicted = plan.prediction.peak_bytes
    return {
        "max_allocated_bytes": allocated,
        "max_reserved_bytes": reserved,
        "outside_bytes": outside,
        "allocated_error_pct": _pct(allocated - outside, predicted),
        "reserved_error_pct": _pct(reserved - outside, predicted),
    }
