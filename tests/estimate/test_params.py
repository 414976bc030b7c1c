"""Parameter counts of traced models equal those of the Hugging Face models built from the same configs."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers

from remat.estimate.sources import ModelSource, hf_config
from remat.estimate.trace import trace_source

SMALL = {
    "gpt2": dict(hidden=64, layers=5, heads=4, vocab=100),
    "llama": dict(hidden=64, layers=5, heads=4, kv_heads=2, intermediate=96, vocab=100),
    "mistral": dict(hidden=64, layers=5, heads=8, kv_heads=2, intermediate=160, vocab=100),
}


def _hf_param_count(config) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


@pytest.mark.parametrize("family", sorted(SMALL))
def test_param_count_equals_hf_model(family: str) -> None:
    source = ModelSource(hf_family=family, sizes={**SMALL[family], "seq": 16})
    traced = trace_source(source, seq_len=16)
    assert traced.num_layers == 5
    assert traced.param_count == _hf_param_count(hf_config(source))


def test_config_json_source(tmp_path) -> None:
    cfg = dict(model_type="llama", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=4, intermediate_size=128, vocab_size=50, tie_word_embeddings=True)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    source = ModelSource(hf_config_path=str(path))
    traced = trace_source(source, seq_len=8)
    assert traced.param_count == _hf_param_count(hf_config(source))
    # by hand: tied embedding 50*64; per layer q,k,v,o 4*64*64 + MLP 3*64*128 + 2 norms 2*64; final norm 64
    assert traced.param_count == 50 * 64 + 3 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64


def test_llama_70b_parameter_count_by_hand() -> None:
    """Llama-3-70B sizes: the count is exact arithmetic (80 layers are built on the meta device only,
    where the count is checked against the copies: no memory)."""
    h, layers, kv, inter, vocab = 8192, 80, 1024, 28672, 128256
    source = ModelSource(hf_family="llama", sizes=dict(hidden=h, layers=layers, heads=64, kv_heads=8,
                                                        intermediate=inter, vocab=vocab, seq=16))
    traced = trace_source(source, seq_len=16)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h
    assert traced.param_count == 2 * vocab * h + layers * per_layer + h == 70_553_706_496


def test_bad_sources(tmp_path) -> None:
    with pytest.raises(ValueError, match="name exactly one model source"):
        ModelSource(hf_family="llama", builtin="gpt")
    with pytest.raises(ValueError, match="unknown Hugging Face family 'bert'; allowed: gpt2, llama, mistral"):
        ModelSource(hf_family="bert")
    with pytest.raises(ValueError, match=r"unknown size\(s\) \['depth'\] for --hf llama"):
        hf_config(ModelSource(hf_family="llama", sizes=dict(depth=3)))
    (tmp_path / "c.json").write_text("{}")
    with pytest.raises(ValueError, match="has no 'model_type'"):
        hf_config(ModelSource(hf_config_path=str(tmp_path / "c.json")))


def _config_file(tmp_path, config) -> ModelSource:
    path = tmp_path / "config.json"
    config.to_json_file(str(path))
    return ModelSource(hf_config_path=str(path))


def test_a_composite_config_is_estimated_by_its_language_model(tmp_path) -> None:
    """Gemma 3 keeps its layers in ``text_config`` beside a vision tower: the estimate crashed on
    ``num_hidden_layers`` (so did Llama 4, Qwen3.5, Qwen2-Audio and 30 more). It prices the
    language model and says what it leaves out."""
    text = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=96, vocab_size=128)
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32,
                  patch_size=8)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision)
    source = _config_file(tmp_path, config)
    traced = trace_source(source, seq_len=8)
    assert traced.label == f"{source.label} (its language model, Gemma3TextConfig; vision_config left out)"
    assert traced.num_layers == 4
    assert traced.param_count == _hf_param_count(transformers.Gemma3TextConfig(**text))
    assert hf_config(source).model_type == "gemma3_text"


def test_configs_the_estimate_cannot_build_are_refused_in_one_line(tmp_path) -> None:
    # no language model anywhere: refused with what the estimate prices
    perceiver = transformers.PerceiverConfig(num_latents=4, d_latents=16, d_model=16, num_blocks=1,
                                             num_self_attends_per_block=1)
    with pytest.raises(ValueError, match=r"PerceiverConfig \(model_type 'perceiver'\) keeps no decoder layers in "
                                         r"num_hidden_layers, nor a causal language model in a sub-config"):
        hf_config(_config_file(tmp_path, perceiver))
    # transformers' own failure to build it with fewer layers (DBRX's default config)
    (tmp_path / "dbrx").mkdir()
    with pytest.raises(ValueError, match=r"DbrxConfig cannot be built on the meta device as the estimate builds "
                                         r"it \(whole, to count its parameters\): "
                                         r"AttributeError: 'DbrxAttentionConfig' object has no attribute 'rope_theta'"):
        trace_source(_config_file(tmp_path / "dbrx", transformers.DbrxConfig()), seq_len=8)
    # ProphetNet (an encoder-decoder, estimated as one now: `test_encoder_decoder.py`): no SDPA attention, so
    # its own is traced, as with --explicit-attention, and its forward reads tensor values
    prophetnet = transformers.ProphetNetConfig(hidden_size=32, encoder_ffn_dim=64, decoder_ffn_dim=64, num_encoder_layers=2,
                                               num_decoder_layers=2, num_encoder_attention_heads=2,
                                               num_decoder_attention_heads=2, vocab_size=64)
    path = _config_file(tmp_path, prophetnet)
    for source in (path, dataclasses.replace(path, attention="eager")):
        with pytest.raises(ValueError, match=r"ProphetNetForConditionalGeneration's training step cannot be traced on the "
                                             r"meta device.*Tensor.item\(\) cannot be called on meta tensors"):
            trace_source(source, seq_len=8).profile(1)


def test_a_config_that_sets_each_heads_width_is_not_held_to_hidden_over_heads(tmp_path) -> None:
    """mT5's d_kv, Gemma's and GLM-4.5's head_dim project to heads x head_dim: a hidden size that
    is no multiple of the heads was refused."""
    cfg = dict(model_type="qwen3", hidden_size=60, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
               head_dim=16, intermediate_size=96, vocab_size=50, tie_word_embeddings=False)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    source = ModelSource(hf_config_path=str(path))
    traced = trace_source(source, seq_len=8)
    # embedding and head 50 x 60, per layer q 60x128, k and v 60x32 each, o 128x60, MLP 3 x 60x96, two norms and
    # the q and k norms of a head's width; the final norm
    assert traced.param_count == 2 * 50 * 60 + 2 * (60 * 128 + 2 * 60 * 32 + 128 * 60 + 3 * 60 * 96 + 2 * 60 + 2 * 16) + 60
    assert traced.param_count == _hf_param_count(hf_config(source))
    # sizes given as flags set no head width: each head gets hidden / heads, which must divide
    with pytest.raises(ValueError, match="hidden size 60 is not a multiple of 8 attention heads"):
        ModelSource(hf_family="llama", sizes=dict(hidden=60, heads=8))


def test_a_config_transformers_wrote_with_an_infinity_is_read(tmp_path) -> None:
    """transformers writes Mamba 2's time-step limit (0, inf) as ``{"__float__": "Infinity"}``:
    the estimate refused Bamba, Falcon-H1, Nemotron-H and Granite 4 hybrids' own config files."""
    config = transformers.Mamba2Config(hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, vocab_size=64,
                                       state_size=8, n_groups=1, expand=2)
    source = _config_file(tmp_path, config)
    assert '"__float__": "Infinity"' in (tmp_path / "config.json").read_text()
    assert tuple(hf_config(source).time_step_limit) == (0.0, float("inf"))


def test_a_sequence_longer_than_the_learned_positions_is_refused(tmp_path) -> None:
    """The meta device checks no index: GPT-2 at 2048 tokens of its 1024 positions was priced."""
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32)
    source = _config_file(tmp_path, config)
    assert trace_source(source, seq_len=32).num_layers == 2
    with pytest.raises(ValueError, match=r"--seq 33 is longer than the 32 learned positions of transformer\.wpe "
                                         r"\(GPT2LMHeadModel\): a training step at that length fails on any device; "
                                         r"pass --seq 32 or less"):
        trace_source(source, seq_len=33)


def test_layers_named_dense_and_sparse_are_traced_each(tmp_path) -> None:
    """transformers 5 names each layer's feed-forward in ``mlp_layer_types`` (29 configs: EXAONE-MoE,
    Kimi Linear, Hunyuan 3...), beside ``layer_types``: the estimate traced layers of one kind and
    refused ("traced layers run different ops"). A kind is now a layer's entry in every list."""
    from remat.estimate.trace import hf_layer_kinds, traced_layer_values

    layer_types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    mlp_types = ["dense", "sparse", "sparse", "sparse", "sparse"]
    config = transformers.AutoConfig.for_model(
        "exaone_moe", hidden_size=32, num_hidden_layers=5, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
        intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, vocab_size=64,
        layer_types=layer_types, mlp_layer_types=mlp_types, first_k_dense_replace=1, sliding_window=8)
    # kinds in the order they come: (sliding, dense), (sliding, sparse), (full, sparse)
    assert hf_layer_kinds(config, 5, 2) == (6, (1, 3, 5, 3, 5))
    assert traced_layer_values(config, 5) == {
        "layer_types": ["sliding_attention"] * 4 + ["full_attention"] * 2,
        "mlp_layer_types": ["dense"] * 2 + ["sparse"] * 4}
    source = _config_file(tmp_path, config)
    traced = trace_source(source, seq_len=8, dtype="bf16")
    assert traced.num_layers == 5
    assert traced.param_count == _hf_param_count(hf_config(source))


def test_llama4s_moe_and_no_rope_layers_are_kinds(tmp_path) -> None:
    """Llama 4 names its MoE layers by index (``moe_layers``) and its layers without rotary
    embeddings per layer (``no_rope_layers``): refused before as layers that run different ops."""
    from remat.estimate.trace import traced_layer_values

    config = transformers.Llama4TextConfig(
        hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, num_local_experts=2, num_experts_per_tok=1, vocab_size=64,
        moe_layers=[1, 3], no_rope_layers=[1, 1, 1, 0], attention_chunk_size=8)
    values = traced_layer_values(config, 4)
    # kinds: (rope, dense), (rope, MoE), (no rope, MoE), two layers each
    assert values["no_rope_layers"] == [1, 1, 1, 1, 0, 0] and values["moe_layers"] == [2, 3, 4, 5]
    source = _config_file(tmp_path, config)
    traced = trace_source(source, seq_len=8, dtype="bf16")
    assert traced.num_layers == 4
    assert traced.param_count == _hf_param_count(hf_config(source))


@pytest.mark.parametrize("model_type, kinds", [
    ("afmoe", dict(num_dense_layers=1, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8,
                   num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)),
    ("ernie4_5_moe", dict(moe_layer_start_index=1, moe_layer_end_index=3, moe_layer_interval=1, moe_num_experts=4,
                          moe_k=2, moe_intermediate_size=16)),
])
def test_moe_layers_named_by_count_or_range_are_a_kind(tmp_path, model_type: str, kinds: dict) -> None:
    """AFMoE names its first dense layers by count (``num_dense_layers``), ERNIE 4.5 its MoE layers by
    range and step: refused before as layers that run different ops."""
    config = transformers.AutoConfig.for_model(
        model_type, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
        intermediate_size=64, vocab_size=64, **kinds)
    source = _config_file(tmp_path, config)
    traced = trace_source(source, seq_len=8, dtype="bf16")
    assert traced.num_layers == 4
    assert traced.param_count == _hf_param_count(hf_config(source))


def test_embeddings_sized_by_the_layer_count_are_refused(tmp_path) -> None:
    """Gemma 4's per-layer inputs come from an embedding of layers x hidden_size_per_layer_input
    columns: built with fewer layers, the default text model counted 3.25 B of its 5.08 B
    parameters."""
    config = transformers.AutoConfig.for_model("gemma4_text", hidden_size=32, num_hidden_layers=4,
                                               num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                               intermediate_size=64, vocab_size=64, hidden_size_per_layer_input=8)
    with pytest.raises(ValueError, match=r"Gemma4TextConfig gives every layer an input of its own, from embeddings "
                                         r"and a projection sized by the number of layers \(hidden_size_per_layer_input = 8\)"):
        hf_config(_config_file(tmp_path, config))


def test_a_first_layer_with_weights_of_its_own_is_traced_apart(tmp_path) -> None:
    """ModernBERT's decoder has no attention norm in its first layer: copied from the third, the
    default config counted 768 parameters more than its model (ZAYA's first router, without a
    state scale, 256). Such a first layer is traced as itself, as an encoder's is."""
    config = transformers.AutoConfig.for_model("modernbert-decoder", hidden_size=32, num_hidden_layers=4,
                                               num_attention_heads=2, intermediate_size=48, vocab_size=64,
                                               global_attn_every_n_layers=1, max_position_embeddings=64,
                                               pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                                               sep_token_id=2)
    traced = trace_source(_config_file(tmp_path, config), seq_len=8)
    assert traced.layer_kinds == (0, 2, 2, 2)  # the first layer, then copies of a later one
    assert traced.param_count == _hf_param_count(config)


def test_a_model_whose_layers_run_several_times_is_refused_not_miscounted(tmp_path) -> None:
    """HRM's text model runs two modules of ``num_layers_per_stack`` layers in cycles, so its
    ``num_hidden_layers`` (128 by default) is no count of layers with weights: the default config
    was estimated at 4.39 B parameters, its model has 1.45 B; and a file.py:build of it counted
    each layer's activations once. Refused from a config by the count of the model built whole on
    the meta device, and from a file because its traced step runs layers several times with
    gradients."""
    config = transformers.AutoConfig.for_model("hrm_text", hidden_size=32, intermediate_size=48, num_attention_heads=2,
                                               head_dim=16, num_layers_per_stack=2,
                                               vocab_size=64, max_position_embeddings=64)
    refusal = (r"HrmTextForCausalLM runs model\.L_module\.layers\.0 \(3 calls\), .*model\.H_module\.layers\.1 \(2 calls\) "
               r"several times per step with gradients")
    with pytest.raises(ValueError, match=r"copying its traced layers counts 4,392,224,256 parameters and the model has "
                                         r"1,447,822,848: it has fewer layers' weights than layers it runs"):
        trace_source(_config_file(tmp_path, transformers.AutoConfig.for_model("hrm_text")), seq_len=8)
    build = tmp_path / "hrm.py"
    build.write_text(
        "import torch, transformers\n"
        "def build():\n"
        f"    config = transformers.HrmTextConfig(**{config.to_diff_dict()!r})\n"
        "    model = transformers.AutoModelForCausalLM.from_config(config)\n"
        "    ids = torch.randint(0, 64, (2, 8))\n"
        "    return model, {'input_ids': ids, 'labels': ids}\n")
    with pytest.raises(ValueError, match=refusal):
        trace_source(ModelSource(file=f"{build}:build"), seq_len=8).profile(1)


def test_layers_the_copies_cannot_add_up_to_are_refused(tmp_path) -> None:
    """LongCat-Flash keeps two attention and feed-forward sub-layers in each of its ``num_layers``
    layers, which the copies do not follow: its default config was estimated at 26.0 B parameters,
    its model has 560.7 B. Decoders are now counted against the model built whole on the meta
    device, as encoders were."""
    config = transformers.AutoConfig.for_model("longcat_flash", hidden_size=32, num_layers=3, num_attention_heads=2,
                                               ffn_hidden_size=48, expert_ffn_hidden_size=16, n_routed_experts=4,
                                               moe_topk=2, zero_expert_num=2, vocab_size=64, q_lora_rank=16,
                                               kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    with pytest.raises(ValueError, match=r"copying its traced layers counts [\d,]+ parameters and the model has [\d,]+: "):
        trace_source(_config_file(tmp_path, config), seq_len=8)
