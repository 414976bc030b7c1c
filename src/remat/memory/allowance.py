"""The explicit allowance for device memory that no tensor accounts for.

Three named terms, each configurable, each printed next to the estimate (never a hidden
fudge factor):
- ``context_bytes``: the CUDA context, kernel images and the NCCL communicator live in device
  memory outside PyTorch's allocator (a few hundred MiB on a Hopper GPU with lazy module
  loading; ``nvidia-smi`` shows it, ``torch.cuda.memory_allocated`` does not);
- ``workspace_bytes``: library workspaces, e.g. cuBLAS: ``CUBLAS_WORKSPACE_CONFIG`` defaults
  to ``:4096:8`` on Hopper, 8 buffers of 4 MiB = 32 MiB per stream;
- ``fragmentation_fraction``: memory the caching allocator reserves but cannot hand out
  (split blocks of mixed sizes), as a share of the allocated peak; the gap between
  ``torch.cuda.max_memory_reserved`` and ``max_memory_allocated`` is what it stands for.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024**2


@dataclass(kw_only=True, frozen=True)
class Allowance:
    """Device memory set aside beyond the tensors of the training step."""

    context_bytes: int = 512 * MIB
    """CUDA context, kernels and communicators (outside the allocator)."""
    workspace_bytes: int = 32 * MIB
    """Library workspaces (cuBLAS...)."""
    fragmentation_fraction: float = 0.05
    """Allocator fragmentation as a share of the allocated peak."""

    def __post_init__(self) -> None:
        if self.context_bytes < 0 or self.workspace_bytes < 0:
            raise ValueError(
                f"context_bytes={self.context_bytes} and workspace_bytes={self.workspace_bytes} must be >= 0; "
                "pass 0 to leave a term out."
            )
        if not 0.0 <= self.fragmentation_fraction < 1.0:
            raise ValueError(
                f"fragmentation_fraction={self.fragmentation_fraction} must be in [0, 1); 0.05 means 5% of the "
                "allocated peak is set aside for fragmentation."
            )

    def bytes_for(self, allocated_peak_bytes: int) -> int:
        """Total allowance for an allocated peak of ``allocated_peak_bytes``."""
        fragmentation = int(self.fragmentation_fraction * allocated_peak_bytes)
        return self.context_bytes + self.workspace_bytes + fragmentation

    def max_allocated_bytes(self, device_bytes: int) -> int:
        """The largest allocated peak whose total with the allowance fits ``device_bytes``."""
        room = device_bytes - self.context_bytes - self.workspace_bytes
        if room <= 0:
            return 0
        peak = int(room / (1.0 + self.fragmentation_fraction))
        while self.bytes_for(peak + 1) + peak + 1 <= device_bytes:
            peak += 1
        while peak > 0 and self.bytes_for(peak) + peak > device_bytes:
            peak -= 1
        return peak


NO_ALLOWANCE = Allowance(context_bytes=0, workspace_bytes=0, fragmentation_fraction=0.0)
"""For comparing with a tracker that counts tensors only (tests, CPU)."""
