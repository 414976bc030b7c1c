"""4-bit NormalFloat base weights under LoRA (QLoRA, Dettmers et al. 2023), stored and run as
bitsandbytes stores and runs them in training.

`quantize_base` turns the frozen weight of every LoRA-adapted linear (`remat.models.lora`) into
bitsandbytes' NF4 layout with double quantization (``bnb_4bit_quant_type="nf4"``,
``bnb_4bit_use_double_quant=True``, the QLoRA recipe), as buffers of the module:

- ``weight_nf4``: the 4-bit codes, two to a byte (the first in the high nibble), ``ceil(n / 2)``
  bytes as a ``(ceil(n / 2), 1)`` uint8 tensor, where ``n`` is the weight's out x in elements;
- ``absmax``: each block of 64 elements' largest magnitude, less their mean, quantized to 8 bits
  with bitsandbytes' dynamic map: ``ceil(n / 64)`` bytes;
- ``nested_absmax``: each block of 256 of those, its largest magnitude in fp32: 4 bytes a block;
- ``offset``: the mean, fp32, 4 bytes; ``quant_map``: the 16 NF4 values, fp32, 64 bytes.

That is bitsandbytes' `quantize_4bit` to the byte (checked against bitsandbytes 0.50.2 in
``benchmarks/qlora_layout.py``; its 1 KiB dynamic map is shared by every weight, here a constant),
about 4.13 bits an element. The codes are the nearest NF4 values and absmax codes the nearest
dynamic-map values: bitsandbytes' own kernels may round a tie the other way.

Training, the forward and the backward each dequantize the weight in the model's dtype and
multiply by it (bitsandbytes' ``MatMul4Bit`` past 1536 rows, its dequantize-then-``linear`` path):
the dequantized weight (``n`` elements in the model's dtype) and the absmax in fp32 (``4 n / 64``
bytes) are live while the product runs, and nothing is saved for the backward but the quantized
buffers (the base weight takes no gradient, so its input is not kept for it). The module's
``weight`` is the dequantized weight, made when read: model code that reads a linear's
``weight.dtype`` (Ergo's layers) or multiplies by it sees the weight in the model's dtype.
`dequantize_nf4` is one operator (``remat::dequantize_nf4``), as bitsandbytes' is a kernel: what
it computes on the way is not seen by `remat.measure`'s tracker, only its output, as on a GPU.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from remat.models.lora import LoRALinear, conv1d_class, is_lora, plain_linear

BLOCK = 64
"""Elements per absmax block (bitsandbytes' ``blocksize`` for 4-bit weights)."""
NESTED_BLOCK = 256
"""Absmax values per block of the double quantization."""
NF4_VALUES = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023,
              1.0)
"""The NF4 code values (bitsandbytes' ``get_4bit_type("nf4")``)."""


def _dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed dynamic 8-bit map (``create_dynamic_map()``), sorted: 256 values in [-1, 1]."""
    data: list[float] = []
    bits, exponent_bits = 7, 7
    for i in range(exponent_bits):
        items = int(2 ** (i + bits - exponent_bits) + 1)
        boundaries = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        scale = 10 ** (-(exponent_bits - 1) + i)
        data += (scale * means).tolist() + (-scale * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (256 - len(data))
    return torch.tensor(sorted(data), dtype=torch.float32)


DYNAMIC_MAP = _dynamic_map()


def nf4_bytes(numel: int) -> int:
    """Bytes of one weight of ``numel`` elements in the NF4 layout with double quantization
    (module docstring): codes, absmax codes, nested absmax, offset and the NF4 values."""
    blocks = math.ceil(numel / BLOCK)
    return math.ceil(numel / 2) + blocks + 4 * math.ceil(blocks / NESTED_BLOCK) + 4 + 4 * len(NF4_VALUES)


def _nearest(values: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of the sorted ``table`` for each of ``values``."""
    mids = (table[1:] + table[:-1]) / 2
    return torch.bucketize(values, mids)


def quantize_nf4(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The NF4 buffers of a 2-D ``weight`` (module docstring)."""
    n = weight.numel()
    blocks = math.ceil(n / BLOCK)
    device = weight.device
    if device.type == "meta":
        return {"weight_nf4": torch.empty((math.ceil(n / 2), 1), dtype=torch.uint8, device=device),
                "absmax": torch.empty(blocks, dtype=torch.uint8, device=device),
                "nested_absmax": torch.empty(math.ceil(blocks / NESTED_BLOCK), dtype=torch.float32, device=device),
                "offset": torch.empty((), dtype=torch.float32, device=device),
                "quant_map": torch.tensor(NF4_VALUES, dtype=torch.float32, device=device)}
    flat = weight.detach().float().flatten()
    flat = F.pad(flat, (0, blocks * BLOCK - n)).view(blocks, BLOCK)
    absmax = flat.abs().amax(dim=1)
    scaled = flat / absmax.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    codes = _nearest(scaled.flatten()[:n], torch.tensor(NF4_VALUES, device=device)).to(torch.uint8)
    codes = F.pad(codes, (0, n % 2))
    packed = (codes[0::2] << 4) | codes[1::2]
    offset = absmax.mean()
    centred = absmax - offset
    nested_blocks = math.ceil(blocks / NESTED_BLOCK)
    padded = F.pad(centred, (0, nested_blocks * NESTED_BLOCK - blocks)).view(nested_blocks, NESTED_BLOCK)
    nested = padded.abs().amax(dim=1)
    normal = (padded / nested.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).flatten()[:blocks]
    return {"weight_nf4": packed.view(-1, 1), "absmax": _nearest(normal, DYNAMIC_MAP.to(device)).to(torch.uint8),
            "nested_absmax": nested, "offset": offset,
            "quant_map": torch.tensor(NF4_VALUES, dtype=torch.float32, device=device)}


@torch.library.custom_op("remat::dequantize_nf4", mutates_args=())
def dequantize_nf4(weight: torch.Tensor, absmax: torch.Tensor, nested_absmax: torch.Tensor, offset: torch.Tensor,
                   quant_map: torch.Tensor, out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``(out_features, in_features)`` weight in ``dtype`` from its NF4 buffers (one operator)."""
    n = out_features * in_features
    blocks = absmax.numel()
    scales = DYNAMIC_MAP.to(absmax.device)[absmax.long()] * nested_absmax.repeat_interleave(NESTED_BLOCK)[:blocks] + offset
    codes = torch.stack((weight.flatten() >> 4, weight.flatten() & 15), dim=1).flatten()[:n].long()
    values = F.pad(quant_map[codes], (0, blocks * BLOCK - n)).view(blocks, BLOCK) * scales[:, None]
    return values.flatten()[:n].view(out_features, in_features).to(dtype)


@dequantize_nf4.register_fake
def _(weight: torch.Tensor, absmax: torch.Tensor, nested_absmax: torch.Tensor, offset: torch.Tensor,
      quant_map: torch.Tensor, out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    return weight.new_empty((out_features, in_features), dtype=dtype)


class _NF4Linear(torch.autograd.Function):
    """``linear(x, dequantized weight, bias)``; the backward dequantizes again for the input's
    gradient and saves nothing but the quantized buffers."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, module: NF4LoRALinear, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.module = module
        return F.linear(x, module.dequantized(x.dtype), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if not ctx.needs_input_grad[0]:
            return None, None, None
        return grad @ ctx.module.dequantized(grad.dtype), None, None


class NF4Linear(nn.Linear):
    """A frozen linear whose weight is stored in NF4 (module docstring): a layer LoRA does not adapt,
    which 4-bit loading quantizes all the same."""

    out_features: int
    in_features: int
    compute_dtype: torch.dtype
    """The dtype of the weight before quantization, the model's."""

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_nf4(self.weight_nf4, self.absmax, self.nested_absmax, self.offset, self.quant_map,
                              self.out_features, self.in_features, dtype)

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        """The weight in the model's dtype, dequantized when read (module docstring)."""
        return self.dequantized(self.compute_dtype)

    def base(self, x: torch.Tensor) -> torch.Tensor:
        """``linear(x, weight, bias)`` by `_NF4Linear`."""
        if self.bias is not None and self.bias.requires_grad:
            raise ValueError("an NF4 base layer's bias must stay frozen, as QLoRA leaves it; it requires grad.")
        return _NF4Linear.apply(x, self, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x)


class NF4LoRALinear(NF4Linear, LoRALinear):
    """A LoRA linear whose frozen weight is stored in NF4 (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def quantize_base(model: nn.Module) -> nn.Module:
    """``model`` (LoRA applied: `remat.models.lora.add_lora`) with the frozen weight of every linear
    layer but its output embeddings stored in NF4 (module docstring), in place; returns it: the
    LoRA layers become `NF4LoRALinear`, the others (those ``--lora-targets`` leaves out) `NF4Linear`,
    as transformers' 4-bit loading quantizes every linear layer whichever LoRA adapts. An
    ``nn.Linear`` subclass that computes a linear map (Falcon's; `remat.models.lora.plain_linear`) and
    transformers' ``Conv1D`` (GPT-2's, its weight transposed) become NF4 linears too, as that loading replaces them by bitsandbytes' layer. The modules a
    transformers model keeps in fp32 (``_keep_in_fp32_modules``: T5's ``wo``, whose input it casts to
    the weight's dtype) stay as they are, as that loading leaves them, and so do
    ``nn.MultiheadAttention``'s output projections, whose weight the attention reads itself."""
    kept = {*(getattr(model, "_keep_in_fp32_modules", None) or ()),
            *(getattr(model, "_keep_in_fp32_modules_strict", None) or ())}
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    conv1d = conv1d_class()
    linears = [m for name, m in model.named_modules()
               if (plain_linear(m) or (conv1d is not None and isinstance(m, conv1d))) and m is not head
               and not isinstance(m, NF4Linear) and type(m) is not nn.modules.linear.NonDynamicallyQuantizableLinear
               and not kept.intersection(name.split("."))]
    if not any(is_lora(m) for m in linears):
        raise ValueError(f"{type(model).__name__} has no LoRA linear layer whose base weight to quantize; add LoRA "
                         "first (remat.models.lora.add_lora, --lora R).")
    for linear in linears:
        if linear.weight.requires_grad:
            continue  # trained: a layer of the adapters themselves (lora_A, lora_B) or left trainable
        # a Conv1D computes x @ weight + bias: linear(x, weight.T, bias), as bitsandbytes loads it
        weight = linear.weight if isinstance(linear, nn.Linear) else linear.weight.t().contiguous()
        buffers = quantize_nf4(weight)
        dtype = weight.dtype
        adapted = is_lora(linear)
        del linear.weight
        linear.__class__ = NF4LoRALinear if adapted else NF4Linear
        linear.out_features, linear.in_features = weight.shape
        linear.compute_dtype = dtype
        for name, tensor in buffers.items():
            linear.register_buffer(name, tensor)
    return model


__all__ = ["BLOCK", "DYNAMIC_MAP", "NESTED_BLOCK", "NF4Linear", "NF4LoRALinear", "NF4_VALUES", "dequantize_nf4", "nf4_bytes",
           "quantize_base", "quantize_nf4"]
