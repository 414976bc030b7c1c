"""Peak memory of one step, two ways.

- `tracked_peak_bytes`: remat's live-storage tracker (`remat.measure.tracker.track_step`), a
  dispatch mode that sees every aten op's outputs. It is the measure of the eager comparison.
  Under torch.compile, inductor's kernels allocate their buffers without going through the
  dispatcher, so the tracker does not see them.
- `allocator_peak_bytes`: the CPU/CUDA caching allocator's own allocation events, recorded by
  `torch.profiler` with ``profile_memory=True``, which sees compiled kernels' buffers too.
  It is the measure of the torch.compile comparison, and a cross-check of the tracker on eager
  runs. Resident bytes (parameters, buffers) are added to the allocation peak of the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from remat.measure.tracker import allocator_net_peak_bytes, track_step


def tracked_peak_bytes(model: nn.Module, step: Callable[[], Any], batch: Any = None) -> int:
    """Peak live storage bytes of ``step()`` (parameters, gradients, activations, temporaries)."""
    return track_step(step, model=model, batch=batch).peak_bytes


def _resident_bytes(model: nn.Module, device: torch.device) -> int:
    storages = {}
    for t in [*model.parameters(), *model.buffers()]:
        if t.device == device:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def allocator_peak_bytes(model: nn.Module, step: Callable[[], Any], device: torch.device) -> int:
    """Resident model bytes + peak net bytes the allocator handed out on ``device`` during ``step()``."""
    return _resident_bytes(model, device) + allocator_net_peak_bytes(step, device)
