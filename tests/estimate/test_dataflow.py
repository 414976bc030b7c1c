"""Which traced bytes and FLOPs each parallelism divides, counted by hand on small models."""

from __future__ import annotations

import json

import pytest
import torch

from remat.estimate.dataflow import classify, plan_role
from remat.estimate.kernels import GpuKernels, no_packed_sequence_check
from remat.estimate.sources import ModelSource, build_hf_on_meta, hf_batch, hf_config
from remat.measure.blocks import find_blocks
from remat.models import build

H, A, B, S = 64, 4, 2, 64  # hidden, heads, micro-batch, sequence
SBH = S * B * H


def _gpt():
    with torch.device("meta"):
        built = build("gpt", optimizer="none", num_layers=2, d_model=H, num_heads=A, seq_len=S, batch_size=B,
                      vocab_size=128, dropout=0.1, attention="explicit")
    built.model.to(torch.bfloat16)
    with GpuKernels():
        return classify(built.model, built.batch, find_blocks(built.model), loss_fn=built.loss_fn)


def test_gpt_layer_splits_as_korthikanti_counts() -> None:
    """Korthikanti et al. 2022, section 4.1 and Table 2 with t: of a layer's sbh(34 + 5as/h) bytes,
    10sbh stay whole (LayerNorm inputs 4, QKV and FC1 inputs 4, two 1-byte dropout masks 2), 24sbh
    are split (Q, K, V copies 6, projection input 2, GeLU input 8, FC2 input 8), and 5as^2b are
    the attention core's (softmax 2, dropout mask 1, dropout output 2). PyTorch adds whole bytes
    the paper leaves out: LayerNorm's fp32 mean and 1/std per token (2 x 2 x 4 x sb) and the
    negated causal mask ``masked_fill`` saves (s^2 bool)."""
    flow = _gpt().flow
    for layer in flow.layers:  # no tensor is shared by the two layers
        assert layer.saved.split == 24 * SBH
        assert layer.saved.whole == 10 * SBH + 16 * S * B + S * S
        assert layer.saved.core == 5 * A * S * S * B
        assert layer.input_bytes == 2 * SBH
        # FLOPs: QKV 6bsh^2, projection 2bsh^2, MLP 16bsh^2, all split; the core's two bmm 4bs^2h
        assert layer.flops.split == 24 * B * S * H * H and layer.flops.whole == 0
        assert layer.flops.core == 4 * B * S * S * H
    # before the layers: the embedding dropout's 1-byte mask and the positions (arange, int64)
    assert flow.pre.saved.whole == SBH + 8 * S and flow.pre.saved.split == 0
    # the head's logits (bf16, vocabulary split) and the loss; the final norm's input and output whole
    assert flow.post.flops.split == 2 * B * S * H * 128


def test_parameter_roles_follow_megatron() -> None:
    roles = _gpt().roles
    assert roles["tok_emb.weight"] == "vocab" and roles["head.weight"] == "vocab"
    assert roles["pos_emb.weight"] == "whole"  # learned positions are whole on every rank
    assert roles["blocks.1.attn.qkv.weight"] == roles["blocks.1.attn.qkv.bias"] == "tensor"  # column-parallel
    assert roles["blocks.1.attn.proj.weight"] == "tensor" and roles["blocks.1.attn.proj.bias"] == "whole"  # row
    assert roles["blocks.1.ln1.weight"] == "whole"


def _hf(sizes: dict | None = None, config_path: str | None = None, attention: str = "sdpa"):
    source = ModelSource(hf_config_path=config_path, attention=attention) if config_path else ModelSource(
        hf_family="llama", sizes=sizes, attention=attention)
    config = hf_config(source)
    config.use_cache = False
    model = build_hf_on_meta(config, layers=2, dtype=torch.bfloat16)
    with no_packed_sequence_check(), GpuKernels():
        result = classify(model, hf_batch(config, micro_batch=B, seq_len=S), find_blocks(model),
                          plan=config.base_model_tp_plan)
    return config, result


LLAMA = dict(hidden=H, layers=2, heads=A, kv_heads=2, intermediate=128, vocab=96)


def test_llama_fused_core_is_its_log_sum_exp_and_shared_tensors_count_once() -> None:
    """With FlashAttention the core keeps no s x s matrix: what recomputing it frees is its fp32
    log-sum-exp per head and query (a x s x b x 4 bytes) and the kernel's RNG seed and offset
    (24 bytes); its output stays, the output projection saves it. The rotary cos and sin
    (bf16, s x head dim each) and the position ids are made before the layers and passed to
    every layer: counted once, before them."""
    _, result = _hf(LLAMA)
    head_dim = H // A
    for layer in result.flow.layers:
        assert layer.saved.core == A * S * B * 4 + 24
        assert layer.input_bytes == 2 * SBH
    assert result.flow.layers[0].saved == result.flow.layers[1].saved
    assert result.flow.pre.saved.whole == 2 * S * head_dim * 2 + 8 * S


def test_eager_mask_counts_once() -> None:
    """Explicit attention passes a (b, 1, s, s) bf16 mask to every layer: once, before the layers."""
    _, sdpa = _hf(LLAMA)
    _, eager = _hf(LLAMA, attention="eager")
    assert eager.flow.pre.saved.whole - sdpa.flow.pre.saved.whole == B * S * S * 2
    assert eager.flow.layers[1].input_bytes == 2 * SBH


MIXTRAL = dict(model_type="mixtral", hidden_size=H, num_hidden_layers=2, num_attention_heads=A, num_key_value_heads=2,
               intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, vocab_size=96)


def test_mixtral_experts_and_router(tmp_path) -> None:
    """Routed experts: their weights are expert-sharded, their grouped matmuls counted as
    2 x tokens x top-k x (h x 2i + i x h) FLOPs; the router stays whole."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MIXTRAL))
    _, result = _hf(config_path=str(path))
    roles = result.roles
    assert roles["model.layers.1.mlp.experts.gate_up_proj"] == roles["model.layers.1.mlp.experts.down_proj"] == "expert"
    assert roles["model.layers.1.mlp.gate.weight"] == "whole"
    assert roles["model.layers.1.self_attn.q_proj.weight"] == "tensor"
    inter, k = 96, 2
    layer = result.flow.layers[1]
    assert layer.flops.expert_split == 2 * B * S * k * (H * 2 * inter + inter * H)
    assert layer.saved.expert_split > 0 and layer.saved.expert_whole > 0


def test_qwen2_moe_shared_expert_is_tensor_parallel(tmp_path) -> None:
    """Qwen2-MoE's plan leaves its shared expert out: an expanding linear on a whole input is
    column-parallel and the one reading its split output row-parallel, as Megatron-LM shards
    shared experts; the gates (8 and 1 outputs) stay whole."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(model_type="qwen2_moe", hidden_size=H, num_hidden_layers=2, num_attention_heads=A,
                                    num_key_value_heads=2, intermediate_size=128, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                                    vocab_size=96)))
    _, result = _hf(config_path=str(path))
    prefix = "model.layers.1.mlp."
    assert result.roles[prefix + "shared_expert.up_proj.weight"] == "tensor"
    assert result.roles[prefix + "shared_expert.down_proj.weight"] == "tensor"
    assert result.roles[prefix + "shared_expert_gate.weight"] == result.roles[prefix + "gate.weight"] == "whole"


def test_plan_patterns() -> None:
    plan = {"layers.*.self_attn.q_proj": "colwise", "layers.*.mlp.experts.down_proj": "rowwise",
            "layers.*.mlp.experts": "moe_tp_experts"}
    assert plan_role(plan, "model.layers.3.self_attn.q_proj.weight") == "column"
    assert plan_role(plan, "model.layers.3.mlp.experts.down_proj") == "row"
    assert plan_role(plan, "model.layers.3.mlp.gate.weight") is None


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_widths_tensor_parallelism_divides(kind: str) -> None:
    widths = _gpt().split_widths if kind == "gpt" else _hf(LLAMA)[1].split_widths
    if kind == "gpt":
        assert widths["blocks.1.attn.qkv.weight"] == 3 * H and widths["blocks.1.mlp.proj.weight"] == 4 * H
    else:
        assert widths["model.layers.1.self_attn.k_proj.weight"] == 2 * H // A
        assert widths["model.layers.1.mlp.down_proj.weight"] == 128
