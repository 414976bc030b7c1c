"""NF4 base weights under LoRA (`remat.models.qlora`): bitsandbytes' layout by hand, values
within NF4's rounding, a step bit-identical to LoRA over the dequantized weights, and what the
tracker sees of the dequantization (its output only, as of a GPU kernel)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

from remat.measure.tracker import LiveTracker
from remat.models.lora import LoRALinear, add_lora
from remat.models.qlora import (DYNAMIC_MAP, NF4_VALUES, NF4LoRALinear, dequantize_nf4, nf4_bytes, quantize_base,
                                quantize_nf4)

CFG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=96)


def test_the_layout_by_hand() -> None:
    """A 64 x 64 weight: 4096 codes two to a byte (2048), 64 absmax codes (one per 64 elements), one
    nested fp32 absmax (64 absmax values make one block of 256), the fp32 offset and the 16 fp32
    NF4 values: 2048 + 64 + 4 + 4 + 64 = 2184 bytes, bitsandbytes' `quantize_4bit` with
    `compress_statistics=True` to the byte. Llama-3-70B's MLP weight (28672 x 8192): 0.5159 bytes
    an element."""
    buffers = quantize_nf4(torch.randn(64, 64))
    sizes = {k: v.numel() * v.element_size() for k, v in buffers.items()}
    assert sizes == {"weight_nf4": 2048, "absmax": 64, "nested_absmax": 4, "offset": 4, "quant_map": 64}
    assert buffers["weight_nf4"].shape == (2048, 1) and buffers["weight_nf4"].dtype == torch.uint8
    assert nf4_bytes(64 * 64) == 2184 == sum(sizes.values())
    assert nf4_bytes(28672 * 8192) == 117_440_512 + 3_670_016 + 4 * 14_336 + 68
    meta = quantize_nf4(torch.empty(28672, 8192, device="meta"))
    assert sum(v.numel() * v.element_size() for v in meta.values()) == nf4_bytes(28672 * 8192)
    # bitsandbytes' signed dynamic map: 127 negative values from -0.99297, one zero, 127 positive, 1
    assert len(DYNAMIC_MAP) == 256 and float(DYNAMIC_MAP[0]) == pytest.approx(-0.99297, abs=1e-5)
    assert DYNAMIC_MAP[-1] == 1 and int((DYNAMIC_MAP == 0).sum()) == 1 and int((DYNAMIC_MAP < 0).sum()) == 127 and len(NF4_VALUES) == 16


def test_values_round_to_the_nearest_code() -> None:
    """Every element dequantizes to an NF4 value times its block's absmax, the nearest one up to
    the absmax's own 8-bit rounding: off by at most half the widest gap of the NF4 values (0.1604
    of the block's largest magnitude) plus that rounding."""
    weight = torch.randn(256, 128, generator=torch.Generator().manual_seed(0))
    b = quantize_nf4(weight)
    back = dequantize_nf4(b["weight_nf4"], b["absmax"], b["nested_absmax"], b["offset"], b["quant_map"], 256, 128,
                          torch.float32)
    blocks = weight.view(-1, 64)
    error = (back.view(-1, 64) - blocks).abs().amax(dim=1) / blocks.abs().amax(dim=1)
    gap = max(b - a for a, b in zip(NF4_VALUES, NF4_VALUES[1:])) / 2
    assert float(error.max()) <= gap + 0.02 and float(error.max()) > 0.01
    exact = torch.tensor(NF4_VALUES).repeat(4)  # a weight whose blocks' absmax is 1: codes exact
    b = quantize_nf4(exact.view(1, 64))
    assert torch.equal(b["weight_nf4"].flatten(), torch.tensor([(2 * i) << 4 | (2 * i + 1) for i in range(8)] * 4,
                                                           dtype=torch.uint8))


def _llama(rank: int = 4) -> nn.Module:
    torch.manual_seed(0)
    model = add_lora(transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)), rank)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    return model


def test_a_step_is_lora_over_the_dequantized_weights() -> None:
    """The quantized model's loss and every adapter gradient are bit-identical to LoRA whose base
    weights are the dequantized ones; the base weights are buffers (no parameter, no gradient)."""
    quantized = _llama()
    reference = copy.deepcopy(quantized)
    quantize_base(quantized)
    linears = [m for m in quantized.modules() if isinstance(m, NF4LoRALinear)]
    assert len(linears) == 2 * 7 and not any(isinstance(m, LoRALinear) and not isinstance(m, NF4LoRALinear)
                                             for m in quantized.modules())
    with torch.no_grad():
        for a, b in zip(quantized.modules(), reference.modules()):
            if isinstance(a, NF4LoRALinear):
                b.weight.copy_(a.dequantized(torch.float32))
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    loss_q, loss_r = (m(input_ids=ids, labels=ids).loss for m in (quantized, reference))
    loss_q.backward()
    loss_r.backward()
    grads_q = {n: p.grad for n, p in quantized.named_parameters() if p.grad is not None}
    grads_r = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    assert torch.equal(loss_q, loss_r) and grads_q.keys() == grads_r.keys() and len(grads_q) == 28
    assert all(torch.equal(grads_q[n], grads_r[n]) for n in grads_q)
    q = quantized.model.layers[0].self_attn.q_proj
    assert "model.layers.0.self_attn.q_proj.weight" not in dict(quantized.named_parameters())
    assert q.weight_nf4.dtype == torch.uint8 and "model.layers.0.self_attn.q_proj.weight_nf4" in dict(quantized.named_buffers())
    # the weight read from the module is the dequantized one, in the model's dtype (Ergo reads o_proj.weight.dtype)
    assert q.weight.dtype == torch.float32 and torch.equal(q.weight, reference.model.layers[0].self_attn.q_proj.weight)


def test_the_tracker_sees_the_dequantized_weight_alone() -> None:
    """Dequantizing a 128 x 64 weight in fp32 makes one 32,768-byte tensor: what the operator
    computes on the way (the codes unpacked to int64, the absmax in fp32) never surfaces, as in
    bitsandbytes' kernel."""
    b = quantize_nf4(torch.randn(128, 64))
    with LiveTracker(torch.device("cpu")) as tracker:
        out = dequantize_nf4(b["weight_nf4"], b["absmax"], b["nested_absmax"], b["offset"], b["quant_map"], 128, 64,
                             torch.float32)
    assert out.shape == (128, 64) and tracker.peak_bytes == 128 * 64 * 4


def test_refusals() -> None:
    with pytest.raises(ValueError, match="has no LoRA linear layer whose base weight to quantize; add LoRA first"):
        quantize_base(nn.Sequential(nn.Linear(4, 4)))
    model = quantize_base(_llama())
    layer = model.model.layers[0].self_attn.q_proj
    layer.bias = nn.Parameter(torch.zeros(64))
    with pytest.raises(ValueError, match="an NF4 base layer's bias must stay frozen"):
        layer(torch.randn(2, 64))


def test_the_planner_runs_a_qlora_model() -> None:
    """profile -> plan -> verify on a QLoRA Llama: every layer recomputed replays the dequantization
    too; gradients bit-identical and the peak as predicted, to the byte."""
    import remat
    from remat.plan.planners import plan

    model = quantize_base(_llama())
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids, "labels": ids.clone()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    prof = remat.profile(model, batch, None, optimizer, repeats=1)
    result = remat.verify(model, batch, plan(prof, strategy="full"), None, optimizer, repeats=1)
    assert result.ok and result.grads_identical and result.measured_peak_bytes == result.predicted_peak_bytes


class _Doubled(nn.Linear):
    """An ``nn.Linear`` subclass with a forward of its own (as Falcon's ``FalconLinear`` has)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


def test_linear_subclasses_are_adapted_and_attention_projections_are_not() -> None:
    """A subclass of ``nn.Linear`` takes adapters over its own forward (Falcon's layers were refused:
    "no nn.Linear"); ``nn.MultiheadAttention``'s output projection, whose weight the attention reads
    directly, is left alone; quantized, the subclass becomes an NF4 linear, as bitsandbytes' loading
    replaces it."""
    torch.manual_seed(0)
    model = nn.Sequential(_Doubled(8, 8), nn.ReLU(), nn.Linear(8, 4))
    attention = nn.MultiheadAttention(8, 2)
    model.append(nn.Identity())
    model.add_module("attention", attention)
    x = torch.randn(3, 8)
    before = model[0](x)
    add_lora(model, 2)
    assert type(model[0]).__name__ == "LoRA_Doubled" and isinstance(model[0], _Doubled)
    assert torch.equal(model[0](x), before)  # lora_B starts at zero
    with torch.no_grad():
        model[0].lora_B.weight.fill_(1.0)
    update = model[0].lora_B(model[0].lora_A(x)) * model[0].scaling
    torch.testing.assert_close(model[0](x), before + update, rtol=0, atol=0)
    assert not hasattr(attention.out_proj, "lora_A") and isinstance(model[2], LoRALinear)
    quantize_base(model)
    assert isinstance(model[0], NF4LoRALinear) and isinstance(model[2], NF4LoRALinear)


def test_linear_subclasses_that_compute_something_else_are_left_alone() -> None:
    """DeepSeek-V4's grouped output projection (an ``nn.Linear`` whose forward is a block-diagonal
    product over its input's groups) and Phi-MoE's router (an ``nn.Linear`` whose forward returns
    the routing weights and the experts picked) crashed the LoRA layer's forward ("The size of
    tensor a (1024) must match the size of tensor b (8192)", "can only concatenate tuple"): an
    ``in x out`` update cannot be added to what they return. They are neither adapted nor
    quantized, and stay frozen; Falcon's ``FalconLinear`` (a linear map of its own writing) and a
    subclass that keeps ``nn.Linear``'s forward are adapted, on the meta device too."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4GroupedLinear
    from transformers.models.falcon.modeling_falcon import FalconLinear
    from transformers.models.phimoe.modeling_phimoe import PhimoeTopKRouter

    from remat.models.lora import is_lora, plain_linear

    class Kept(nn.Linear):
        pass

    router = PhimoeTopKRouter(transformers.PhimoeConfig(hidden_size=16, num_local_experts=4, num_experts_per_tok=2))
    grouped = DeepseekV4GroupedLinear(8, 2 * 6, 2)
    assert not plain_linear(grouped) and not plain_linear(router) and not plain_linear(nn.Conv1d(4, 4, 1))
    assert plain_linear(FalconLinear(8, 4)) and plain_linear(Kept(8, 4)) and plain_linear(nn.Linear(8, 4))
    with torch.device("meta"):
        assert plain_linear(FalconLinear(8, 4)) and not plain_linear(DeepseekV4GroupedLinear(8, 12, 2))
    model = nn.ModuleDict(dict(grouped=grouped, router=router, falcon=FalconLinear(8, 4), kept=Kept(8, 4)))
    add_lora(model, 2)
    assert {n: is_lora(m) for n, m in model.items()} == {"grouped": False, "router": False, "falcon": True, "kept": True}
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"{n}.lora_{ab}.weight" for n in ("falcon", "kept") for ab in "AB"}
    x = torch.randn(3, 5, 2, 8)  # 3 x 5 tokens, 2 groups of 8
    assert grouped(x).shape == (3, 5, 2, 6)
    quantize_base(model)
    assert type(model["grouped"]) is DeepseekV4GroupedLinear and type(model["router"]) is PhimoeTopKRouter
    assert isinstance(model["falcon"], NF4LoRALinear) and isinstance(model["kept"], NF4LoRALinear)


def test_gpt2_conv1d_layers_are_quantized_transposed() -> None:
    """GPT-2's ``Conv1D`` (x @ weight + bias, weight in x out) becomes an NF4 linear of the weight
    transposed, as transformers' 4-bit loading makes it: c_attn 64 -> 192 is 192 x 64, and the
    quantized model's output is the LoRA model's over the dequantized weights within 1e-6 (a linear of
    the transposed weight sums in another order than Conv1D's addmm)."""
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=96, n_positions=64, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = add_lora(transformers.GPT2LMHeadModel(config), 4)
    reference = copy.deepcopy(model)
    quantize_base(model)
    c_attn = model.transformer.h[0].attn.c_attn
    assert isinstance(c_attn, NF4LoRALinear) and (c_attn.out_features, c_attn.in_features) == (192, 64)
    assert c_attn.weight_nf4.shape == (192 * 64 // 2, 1)
    with torch.no_grad():
        for a, b in zip(model.modules(), reference.modules()):
            if isinstance(a, NF4LoRALinear):
                b.weight.copy_(a.dequantized(torch.float32).t())
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=1e-6)
