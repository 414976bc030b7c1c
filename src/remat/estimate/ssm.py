"""Mamba-2's fused training kernel as a GPU runs it, for the estimate's trace on the meta device.

In training, a Hugging Face Mamba-2 mixer (Mamba 2, and the hybrids Bamba, Granite 4, Nemotron-H,
Falcon-H1, Zamba 2) hands its input projection to ``mamba_split_conv1d_scan_combined`` of
``mamba_ssm`` (through transformers' kernel hub, or the package) where it runs: one autograd
function for the causal convolution, the chunked scan, the gated RMSNorm and the output projection.
Where it does not run (the CPU, the meta device), transformers takes the mixer's PyTorch code,
which saves several times as much (every chunk's states and decays: 7.4 times on a tiny mixer).

`FusedMamba2` stands in for that function while `remat.estimate.kernels.GpuKernels` is active: it
saves what ``MambaSplitConv1dScanCombinedFn.forward`` saves (``ctx.save_for_backward(zxbcdt,
conv1d_weight, conv1d_bias, out_x, A, D, dt_bias, initial_states, seq_idx, rmsnorm_weight, rstd,
outproj_weight, outproj_bias)``): of activations the projected input ``zxbcdt``, the scan's output
``out_x`` (batch, seqlen, heads, head width) in the activations' dtype and the norm's float32
reciprocal deviations ``rstd`` (one per token and group), and makes the forward's larger
intermediates (the convolved ``xBC``, the per-chunk time steps and their cumulative decays, and
every chunk's states in float32) and frees them, as the kernel does. Its backward returns
gradients of the inputs' shapes (the meta device computes nothing).

A call with packed sequences (``seq_idx``, ``cu_seqlens``) or initial states is left to the model's
code. Mamba-1 mixers (Mamba, Falcon-Mamba, Jamba, Zamba) call other kernels (``mamba_inner_fn``,
``selective_scan_fn``), not modelled: the estimate refuses or marks them
(`remat.estimate.trace`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

KERNEL = "mamba2_split_conv1d_scan_combined"
"""The name a transformers modeling module gives the fused Mamba-2 function."""


class FusedMamba2(torch.autograd.Function):
    """``MambaSplitConv1dScanCombinedFn`` of ``mamba_ssm`` by what it saves and returns (module docstring)."""

    @staticmethod
    def forward(ctx: Any, zxbcdt: torch.Tensor, conv1d_weight: torch.Tensor, conv1d_bias: torch.Tensor | None,
                dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor, rmsnorm_weight: torch.Tensor | None,
                outproj_weight: torch.Tensor | None, outproj_bias: torch.Tensor | None, headdim: int, ngroups: int,
                chunk_size: int) -> torch.Tensor:
        batch, seqlen, width = zxbcdt.shape
        nheads = D.shape[0]
        dim = nheads * headdim
        dstate = (conv1d_weight.shape[0] - dim) // ngroups // 2
        d_nonssm = (width - 2 * dim - 2 * ngroups * dstate - nheads) // 2
        chunks = -(-seqlen // chunk_size)
        # the forward's intermediates, freed by its end: xBC convolved, dt and its cumulative decay per
        # chunk, every chunk's states (float32)
        made = [zxbcdt.new_empty(batch, seqlen, dim + 2 * ngroups * dstate),
                zxbcdt.new_empty(batch, nheads, chunks, chunk_size, dtype=torch.float32),
                zxbcdt.new_empty(batch, nheads, chunks, chunk_size, dtype=torch.float32),
                zxbcdt.new_empty(batch, chunks, nheads, headdim, dstate, dtype=torch.float32)]
        out_x = zxbcdt.new_empty(batch, seqlen, nheads, headdim)
        rstd = None
        if rmsnorm_weight is not None:
            rstd = zxbcdt.new_empty(ngroups * batch * seqlen, dtype=torch.float32)
        out = zxbcdt.new_empty(batch, seqlen, d_nonssm + dim)
        del made
        if outproj_weight is not None:
            out = F.linear(out, outproj_weight.to(out.dtype),
                           outproj_bias.to(out.dtype) if outproj_bias is not None else None)
        ctx.save_for_backward(zxbcdt, conv1d_weight, conv1d_bias, out_x, A, D, dt_bias, rmsnorm_weight, rstd,
                              outproj_weight, outproj_bias)
        ctx.chunk_size, ctx.ngroups = chunk_size, ngroups
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        saved = ctx.saved_tensors
        zxbcdt = saved[0]
        # the backward recomputes xBC convolved and makes every chunk's state gradients (float32)
        batch, seqlen, _ = zxbcdt.shape
        conv_dim, nheads, headdim = saved[1].shape[0], saved[3].shape[2], saved[3].shape[3]
        chunks = -(-seqlen // ctx.chunk_size)
        made = [zxbcdt.new_empty(batch, seqlen, conv_dim),
                zxbcdt.new_empty(batch, chunks, nheads, headdim, (conv_dim - nheads * headdim) // ctx.ngroups // 2,
                                 dtype=torch.float32)]
        del made
        grads = []
        for i, s in enumerate(_SAVED_OF_INPUT):
            t = saved[s]
            grads.append(None if t is None or not ctx.needs_input_grad[i] else torch.empty_like(t))
        return (*grads, None, None, None)


_SAVED_OF_INPUT = (0, 1, 2, 6, 4, 5, 7, 9, 10)
"""For each tensor input of `FusedMamba2` (zxbcdt, conv1d weight and bias, dt_bias, A, D, the norm's
weight, the output projection's weight and bias), its place among the saved tensors."""


def fused_mamba2(zxbcdt: torch.Tensor, conv1d_weight: torch.Tensor, conv1d_bias: torch.Tensor | None,
                 dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor, chunk_size: int,
                 initial_states: torch.Tensor | None = None, dt_limit: Any = None, return_final_states: bool = False,
                 activation: str = "silu", rmsnorm_weight: torch.Tensor | None = None, rmsnorm_eps: float = 1e-6,
                 outproj_weight: torch.Tensor | None = None, outproj_bias: torch.Tensor | None = None,
                 headdim: int | None = None, ngroups: int = 1, norm_before_gate: bool = True,
                 **kwargs: Any) -> torch.Tensor | None:
    """The signature of transformers' ``mamba2_split_conv1d_scan_combined``; None (the model's own
    code) where the call is one the emulation does not cover (module docstring)."""
    if (initial_states is not None or return_final_states or D.dim() != 1 or headdim is None
            or any(kwargs.get(name) is not None for name in ("seq_idx", "cu_seqlens"))):
        return None
    return FusedMamba2.apply(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, rmsnorm_weight, outproj_weight,
                             outproj_bias, headdim, ngroups, chunk_size)


class Mamba2Kernels:
    """Context manager: `fused_mamba2` in place of ``mamba2_split_conv1d_scan_combined`` in every
    loaded transformers modeling module that has one, put back on exit."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, Any]] = []

    def __enter__(self) -> Mamba2Kernels:
        for name, module in list(sys.modules.items()):
            if name.startswith("transformers.models.") and module is not None and hasattr(module, KERNEL):
                self._saved.append((module, getattr(module, KERNEL)))
                setattr(module, KERNEL, fused_mamba2)
        return self

    def __exit__(self, *exc: object) -> None:
        for module, original in self._saved:
            setattr(module, KERNEL, original)
        self._saved.clear()


def has_fused_mamba2(module: torch.nn.Module) -> bool:
    """Whether ``module``'s modeling code calls the fused Mamba-2 function `Mamba2Kernels` replaces."""
    return hasattr(sys.modules.get(type(module).__module__), KERNEL)


__all__ = ["FusedMamba2", "KERNEL", "Mamba2Kernels", "fused_mamba2", "has_fused_mamba2"]
