"""Mamba's and Mamba-2's fused training kernels as a GPU runs them, for the estimate's trace on the
meta device.

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

A Mamba (Mamba-1) mixer hands its projection to ``mamba_inner_fn`` the same way; `FusedMamba`
stands in for it as ``MambaInnerFn.forward`` saves (``checkpoint_lvl=1``, the default: the
convolution's output and the time steps recomputed in the backward): the projection made
contiguous ``xz`` (batch, 2 x inner width, seqlen), ``x_dbl`` (tokens, time-step rank + 2 x state
size), B and C made contiguous (batch, 1, state size, seqlen), the scan's chunk states
``scan_intermediates`` (batch, inner width, chunks of 2,048, 2 x state size) in float32 and its
output (batch, inner width, seqlen), with the weights and ``A``, ``D`` and the time-step bias.

Mamba-1 mixers that normalize their time steps, B and C (Falcon-Mamba, Jamba, Zamba) run the
convolution and the scan apart, through ``causal_conv1d_fn`` of ``causal_conv1d`` and
``selective_scan_fn`` of ``mamba_ssm``. `FusedConv1d` saves what ``CausalConv1dFn`` saves (its
input, the activation fused: no convolution output or activation input saved); `FusedScan` what
``SelectiveScanFn`` saves (the input, the time steps, B and C, the gate, each made contiguous
where it is not, the chunk states in float32 and, with a gate, the ungated output).

A call with packed sequences (``seq_idx``, ``cu_seqlens``) or initial states is left to the model's
code.

RWKV's time mixing runs, on a GPU, the WKV CUDA kernel transformers loads from its kernel hub, through
``RwkvLinearAttention`` (``rwkv_linear_attention``): its ``forward`` saves ``time_decay`` as
``-exp`` of it in float32 (one value per channel), ``time_first``, the key and the value made
contiguous (float32 where they are float16) and the kernel's output, an empty tensor of the key's
shape it fills. `FusedWkv` stands in for it; the model's code without the kernel (the CPU's, the
meta device's) runs a loop over the tokens that saves every step's state.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F

KERNEL = "mamba2_split_conv1d_scan_combined"
"""The name a transformers modeling module gives the fused Mamba-2 function."""
KERNEL_1 = "mamba_inner_fn"
"""And Mamba's."""
CONV = "causal_conv1d_fn"
"""The causal depthwise convolution of a Mamba-1 mixer that runs it apart (Falcon-Mamba's)."""
SCAN = "mamba_selective_scan"
"""And its selective scan."""
WKV = "rwkv_linear_attention"
"""RWKV's time mixing (`FusedWkv`)."""


def _input_grads(ctx: Any, saved: tuple[Any, ...], places: Any) -> tuple[Any, ...]:
    """A stand-in's gradients: for each tensor input, at ``places`` among the saved tensors, one of
    its shape where it needs one (the meta device computes nothing)."""
    return tuple(None if saved[s] is None or not ctx.needs_input_grad[i] else torch.empty_like(saved[s])
                 for i, s in enumerate(places))


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernels' output projection, in the activations' dtype."""
    return F.linear(x, weight.to(x.dtype), bias.to(x.dtype) if bias is not None else None)


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
            out = _linear(out, outproj_weight, outproj_bias)
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
        return (*_input_grads(ctx, saved, _SAVED_OF_INPUT), None, None, None)


_SAVED_OF_INPUT = (0, 1, 2, 6, 4, 5, 7, 9, 10)
"""For each tensor input of `FusedMamba2` (zxbcdt, conv1d weight and bias, dt_bias, A, D, the norm's
weight, the output projection's weight and bias), its place among the saved tensors."""


class FusedMamba(torch.autograd.Function):
    """``MambaInnerFn`` of ``mamba_ssm`` by what it saves and returns (module docstring)."""

    @staticmethod
    def forward(ctx: Any, xz: torch.Tensor, conv1d_weight: torch.Tensor, conv1d_bias: torch.Tensor | None,
                x_proj_weight: torch.Tensor, delta_proj_weight: torch.Tensor, out_proj_weight: torch.Tensor,
                out_proj_bias: torch.Tensor | None, A: torch.Tensor, D: torch.Tensor | None,
                delta_bias: torch.Tensor | None) -> torch.Tensor:
        batch, _, seqlen = xz.shape
        width, state = conv1d_weight.shape[0], A.shape[-1]
        rank = delta_proj_weight.shape[1]
        if xz.stride(-1) != 1:
            xz = xz.contiguous()
        # the forward's intermediates, freed by its end (checkpoint_lvl=1): the convolution's output,
        # the time steps, the gated output
        made = [xz.new_empty(batch, width, seqlen) for _ in range(3)]
        x_dbl = xz.new_empty(batch * seqlen, rank + 2 * state)
        B, C = (xz.new_empty(batch, 1, state, seqlen) for _ in range(2))
        scan = xz.new_empty(batch, width, -(-seqlen // 2048), 2 * state, dtype=A.dtype)
        out = xz.new_empty(batch, width, seqlen)
        result = _linear(made[2].transpose(1, 2), out_proj_weight, out_proj_bias)
        del made
        ctx.save_for_backward(xz, conv1d_weight, conv1d_bias, x_dbl, x_proj_weight, delta_proj_weight,
                              out_proj_weight, out_proj_bias, A, B, C, D, delta_bias, scan, out)
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        saved = ctx.saved_tensors
        xz = saved[0]
        batch, _, seqlen = xz.shape
        width = saved[1].shape[0]
        # the backward recomputes the convolution's output and the time steps beside the gradients
        made = [xz.new_empty(batch, width, seqlen) for _ in range(3)]
        del made
        return _input_grads(ctx, saved, (0, 1, 2, 4, 5, 6, 7, 8, 11, 12))  # each tensor input's place


def fused_mamba_inner(xz: torch.Tensor, conv1d_weight: torch.Tensor, conv1d_bias: torch.Tensor | None,
                      x_proj_weight: torch.Tensor, delta_proj_weight: torch.Tensor, out_proj_weight: torch.Tensor,
                      out_proj_bias: torch.Tensor | None, A: torch.Tensor, B: torch.Tensor | None = None,
                      C: torch.Tensor | None = None, D: torch.Tensor | None = None,
                      delta_bias: torch.Tensor | None = None, delta_softplus: bool = True,
                      b_rms_weight: torch.Tensor | None = None, c_rms_weight: torch.Tensor | None = None,
                      dt_rms_weight: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """The signature of transformers' ``mamba_inner_fn``; None (the model's own code) where the call
    is one the emulation does not cover (fixed B or C, normalized time steps, packed sequences)."""
    if (B is not None or C is not None or A.is_complex() or conv1d_weight.dim() != 3
            or any(w is not None for w in (b_rms_weight, c_rms_weight, dt_rms_weight))
            or any(kwargs.get(name) is not None for name in ("seq_idx", "cu_seqlens"))):
        return None
    return FusedMamba.apply(xz, conv1d_weight.squeeze(1), conv1d_bias, x_proj_weight, delta_proj_weight,
                            out_proj_weight, out_proj_bias, A, D, delta_bias)


class FusedConv1d(torch.autograd.Function):
    """``CausalConv1dFn`` of ``causal_conv1d`` by what it saves and returns (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.stride(2) != 1 and x.stride(1) != 1:
            x = x.contiguous()
        ctx.save_for_backward(x, weight, bias)
        return x.new_empty(x.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _input_grads(ctx, ctx.saved_tensors, range(3))


class FusedScan(torch.autograd.Function):
    """``SelectiveScanFn`` of ``mamba_ssm`` by what it saves and returns (module docstring)."""

    @staticmethod
    def forward(ctx: Any, u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                D: torch.Tensor | None, z: torch.Tensor | None, delta_bias: torch.Tensor | None) -> torch.Tensor:
        u, delta, B, C = (t if t.stride(-1) == 1 else t.contiguous() for t in (u, delta, B, C))
        z = z if z is None or z.stride(-1) == 1 else z.contiguous()
        batch, width, seqlen = u.shape
        scan = u.new_empty(batch, width, -(-seqlen // 2048), 2 * A.shape[-1], dtype=A.dtype)
        out = u.new_empty(batch, width, seqlen)
        ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, scan, out if z is not None else None)
        return out if z is None else u.new_empty(batch, width, seqlen)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _input_grads(ctx, ctx.saved_tensors, range(8))


class FusedWkv(torch.autograd.Function):
    """``RwkvLinearAttention`` of transformers by what it saves and returns (module docstring)."""

    @staticmethod
    def forward(ctx: Any, time_decay: torch.Tensor, time_first: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor) -> torch.Tensor:
        dtype = key.dtype
        decay = -torch.exp(time_decay.float().contiguous())
        if dtype == torch.float16:
            time_first, key, value = time_first.float(), key.float(), value.float()
        time_first, key, value = time_first.contiguous(), key.contiguous(), value.contiguous()
        output = torch.empty_like(key, memory_format=torch.contiguous_format)
        ctx.save_for_backward(decay, time_first, key, value, output)
        ctx.dtype = dtype
        return output.to(dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        decay, time_first, key, value, _ = ctx.saved_tensors
        # the kernel's gradients, each in the inputs' dtype (the decay's in bfloat16 or float32 first)
        return tuple(None if not ctx.needs_input_grad[i] else torch.empty_like(t, dtype=ctx.dtype)
                     for i, t in enumerate((decay, time_first, key, value)))


def fused_wkv(original: Any) -> Any:
    """transformers' ``rwkv_linear_attention`` as `FusedWkv`, ``original`` where the kernel is not
    called: a state asked for or given (generation), or one token (transformers runs its own code)."""

    def wkv(time_decay: torch.Tensor, time_first: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            state: Any = None, return_state: bool = False) -> Any:
        if state is not None or return_state or key.size(1) == 1:
            return original(time_decay, time_first, key, value, state=state, return_state=return_state)
        return FusedWkv.apply(time_decay, time_first, key, value), None

    return wkv


def fused_conv1d(original: Any) -> Any:
    """transformers' ``causal_conv1d_fn`` as `FusedConv1d`, ``original`` for what ``causal_conv1d``
    does not take (an activation other than SiLU, packed sequences, initial states)."""

    def conv(hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             activation: str | None = None, **kwargs: Any) -> torch.Tensor:
        if activation not in (None, "silu", "swish") or weight.dim() != 2 or any(v is not None for v in kwargs.values()):
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        return FusedConv1d.apply(hidden_states, weight, bias)

    return conv


def fused_selective_scan(original: Any) -> Any:
    """transformers' ``mamba_selective_scan`` as `FusedScan`, ``original`` for what the stand-in does
    not cover (the last state asked for, a complex A, B or C fixed per channel, packed sequences)."""

    def scan(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             D: torch.Tensor | None = None, z: torch.Tensor | None = None, delta_bias: torch.Tensor | None = None,
             delta_softplus: bool = False, return_last_state: bool = False, **kwargs: Any) -> Any:
        if (return_last_state or A.is_complex() or B.dim() != 3 or C.dim() != 3
                or any(kwargs.get(name) is not None for name in ("seq_idx", "cu_seqlens"))):
            return original(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                            return_last_state=return_last_state, **kwargs)
        return FusedScan.apply(hidden_states, dt, A, B, C, D, z, delta_bias)

    return scan


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
    """Context manager: `fused_mamba2` in place of ``mamba2_split_conv1d_scan_combined``,
    `fused_mamba_inner` of ``mamba_inner_fn``, `fused_conv1d` of ``causal_conv1d_fn``,
    `fused_selective_scan` of ``mamba_selective_scan`` and `fused_wkv` of RWKV's
    ``rwkv_linear_attention`` in every loaded transformers modeling module that has one, put back
    on exit."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, Any]] = []

    def __enter__(self) -> Mamba2Kernels:
        for name, module in list(sys.modules.items()):
            if not name.startswith("transformers.models.") or module is None:
                continue
            stand_ins = ((KERNEL, lambda _: fused_mamba2), (KERNEL_1, lambda _: fused_mamba_inner),
                         (CONV, fused_conv1d), (SCAN, fused_selective_scan), (WKV, fused_wkv))
            for kernel, make in stand_ins:
                if hasattr(module, kernel):
                    original = getattr(module, kernel)
                    self._saved.append((module, kernel, original))
                    setattr(module, kernel, make(original))
        return self

    def __exit__(self, *exc: object) -> None:
        for module, kernel, original in self._saved:
            setattr(module, kernel, original)
        self._saved.clear()


def has_fused_mamba2(module: torch.nn.Module) -> bool:
    """Whether ``module``'s modeling code calls a fused function `Mamba2Kernels` replaces (Mamba's or
    Mamba-2's)."""
    code = sys.modules.get(type(module).__module__)
    return any(hasattr(code, kernel) for kernel in (KERNEL, KERNEL_1, SCAN))


__all__ = ["CONV", "FusedConv1d", "FusedMamba", "FusedMamba2", "FusedScan", "FusedWkv", "KERNEL", "KERNEL_1",
           "Mamba2Kernels", "SCAN", "WKV", "fused_conv1d", "fused_mamba2", "fused_mamba_inner", "fused_selective_scan",
           "fused_wkv", "has_fused_mamba2"]
