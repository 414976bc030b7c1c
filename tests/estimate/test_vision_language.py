"""`remat estimate` on vision-language models whose language model transformers offers no causal
LM of its own (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V): refused before ("keeps no decoder layers
in num_hidden_layers, nor a causal language model in a sub-config"). Their language model is
built as their generative model runs it on text (`remat.estimate.text_lm.TextCausalLM`) and
priced against `remat.profile` of the whole vision-language model on the CPU, on text: every
parameter of its language model and head counted, and its peaks to the byte once the vision
tower's weights, which the estimate leaves out as it says, are taken off."""

from __future__ import annotations

import pytest
import torch
import transformers

from remat.estimate import ModelSource, estimate
from remat.estimate.text_lm import vision_language_of
from remat.estimate.trace import trace_source
from remat.measure.profile import profile
from remat.plan.planners import plan

S, B = 32, 2
TEXT = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=96, max_position_embeddings=128)
ROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)


def _config(model_type: str) -> transformers.PretrainedConfig:
    if model_type == "qwen2_vl":
        return transformers.Qwen2VLConfig(text_config=dict(**TEXT, rope_parameters=ROPE),
                                          vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2))
    if model_type == "qwen2_5_vl":
        return transformers.Qwen2_5_VLConfig(text_config=dict(**TEXT, rope_parameters=ROPE),
                                             vision_config=dict(**VISION, fullatt_block_indexes=[0]))
    if model_type == "qwen3_vl":
        return transformers.Qwen3VLConfig(text_config=dict(**TEXT, head_dim=16, rope_parameters=ROPE),
                                          vision_config=dict(**VISION, deepstack_visual_indexes=[0]))
    rope = {**ROPE, "mrope_section": [1, 1, 2], "partial_rotary_factor": 0.5}
    return transformers.Glm4vConfig(text_config=dict(**TEXT, rope_parameters=rope), vision_config=VISION)


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v"])
def test_the_language_model_against_the_whole_model_measured_on_text(tmp_path, model_type: str) -> None:
    config = _config(model_type)
    path = tmp_path / "config.json"
    config.to_json_file(path)
    result = estimate(ModelSource(hf_config_path=str(path), attention="sdpa"), seq_len=S, micro_batch=B, dtype="fp32",
                      gpu_kernels=False)
    text = type(config.get_text_config(decoder=True)).__name__
    assert f"(its language model, {text}, with the head and loss of {type(config).__name__}; vision_config left out)" \
        in result.model
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config).train()
    visual = model.model.visual
    assert result.param_count == sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in visual.parameters())
    left_out = sum(t.numel() * t.element_size() for t in (*visual.parameters(), *visual.buffers()))  # no gradient reaches them
    ids = torch.randint(3, 90, (B, S), generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="use_cache=True is incompatible"):
        prof = profile(model, {"input_ids": ids, "labels": ids.clone()}, None,
                       torch.optim.AdamW(model.parameters(), fused=True), repeats=1)
    assert prof.num_blocks == 4  # the vision tower, run by no op on text, is no stack
    rows = {s.strategy: s for s in result.devices[0].strategies}
    for strategy in ("none", "full"):
        assert rows[strategy].peak_bytes == plan(prof, strategy=strategy).prediction.peak_bytes - left_out, strategy


def test_which_configs_are_a_vision_language_models_language_model() -> None:
    assert vision_language_of(transformers.Qwen2_5_VLConfig().text_config) == "qwen2_5_vl"
    assert vision_language_of(transformers.Glm4vConfig().text_config) == "glm4v"
    assert vision_language_of(transformers.LlamaConfig()) is None  # a causal LM of its own
    assert vision_language_of(transformers.CLIPTextConfig()) is None  # a text tower, not a language model
    assert vision_language_of(transformers.Gemma3Config().text_config) is None  # Gemma3ForCausalLM


def test_a_moe_language_model_counts_every_expert(tmp_path) -> None:
    """Qwen3-VL-MoE's default config (its 30B-A3B): the language model's parameters as the whole
    model built on the meta device has them, less the vision tower's; its head planned."""
    config = transformers.Qwen3VLMoeConfig()
    path = tmp_path / "config.json"
    config.to_json_file(path)
    traced = trace_source(ModelSource(hf_config_path=str(path)), seq_len=64)
    with torch.device("meta"):
        whole = transformers.AutoModelForImageTextToText.from_config(config)
    visual = sum(p.numel() for p in whole.model.visual.parameters())
    assert traced.param_count == sum(p.numel() for p in whole.parameters()) - visual
    assert traced.num_layers == config.text_config.num_hidden_layers
    assert traced.head is not None and traced.head.projection == "lm_head"  # planned: keep, recompute, chunked
    assert traced.head.traced.vocab_size == config.text_config.vocab_size and not traced.head.traced.tied
