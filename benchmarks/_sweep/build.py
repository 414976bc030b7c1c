"""Tiny Hugging Face models of any model type: the config class's defaults shrunk by generic
rules (`shrink`), a model class picked by task, a batch made from its forward signature, random
weights, fixed seeds, nothing downloaded.

`build(model_type)` returns a `Built` or raises; the sweep records what it raises as ``unbuilt``
(the harness's limit at this size, not remat's)."""

from __future__ import annotations

import copy
import inspect
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

BATCH = 2
SEQ = 16
HIDDEN = 32
HEADS = 2
HEAD_DIM = HIDDEN // HEADS
FFN = 64
VOCAB = 99
LAYERS = 2
IMAGE = 32
PATCH = 4
NUM_LABELS = 3
AUDIO_SAMPLES = 4000
MAX_POSITIONS = 128
FRAMES = 4

LAYER_KEYS = frozenset({
    "num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
    "num_encoder_layers", "num_decoder_layers", "decoder_num_hidden_layers", "num_text_layers",
    "num_vision_layers", "text_layers", "vision_layers", "num_self_attends_per_block", "depth",
    "num_blocks", "encoder_num_hidden_layers", "num_cross_layers", "cross_attention_layers_count",
})
HIDDEN_KEYS = frozenset({
    "hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "hidden_dim", "dim", "d_embed", "model_dim",
    "encoder_hidden_size", "decoder_hidden_size", "text_hidden_size", "vision_hidden_size", "embedding_size",
    "word_embed_proj_dim", "encoder_embed_dim", "decoder_embed_dim", "d_latents", "codebook_dim", "adapter_in_dim",
    "adapter_input_size", "out_hidden_size", "audio_hidden_size", "condition_dim", "adapter_out_dim",
})
HEAD_KEYS = frozenset({
    "num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads", "decoder_attention_heads",
    "attention_heads", "decoder_num_attention_heads", "encoder_num_attention_heads", "num_self_attention_heads",
    "num_cross_attention_heads", "mamba_n_heads", "mamba_num_heads", "linear_num_value_heads", "linear_num_key_heads",
})
KV_HEAD_KEYS = frozenset({"num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"})
HEAD_DIM_KEYS = frozenset({"head_dim", "d_kv", "d_head", "attention_head_size", "kv_channels", "attention_head_dim"})
FFN_KEYS = frozenset({
    "intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "n_inner", "d_inner",
    "ffn_hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size", "mlp_dim",
    "decoder_intermediate_size",
    "encoder_intermediate_size", "expert_intermediate_size", "ffn_config_hidden_size",
})
POSITION_KEYS = frozenset({
    "max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "n_ctx",
    "max_target_positions", "max_text_positions", "seq_length", "max_length", "max_seq_length",
})
EXPERT_KEYS = frozenset({"num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts", "n_experts"})
TOP_K_KEYS = frozenset({"num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token", "moe_k", "top_k_experts"})
SUBCONFIG_KEYS = frozenset({"encoder", "decoder", "encoder_config", "decoder_config"})
MLA = {"q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
       "n_group": 1, "topk_group": 1, "n_shared_experts": 1}


def _pick_layers(values: list, keep: int) -> list:
    """``keep`` entries of a per-layer list: the first, then the first unlike it (a hybrid keeps
    one layer of each kind), then the next ones."""
    picked = [0]
    other = next((i for i, v in enumerate(values) if v != values[0]), None)
    if other is not None:
        picked.append(other)
    picked += [i for i in range(len(values)) if i not in picked]
    return [values[i] for i in sorted(picked[:keep])]


MROPE_SECTION = (2, 3, 3)
"""The proportions of the M-RoPE sections (time, height, width) a config gets where its modeling code,
not the config, holds them (Qwen2-VL's 16, 24, 24; GLM's 8, 12, 12)."""


def _rotary_half(config: dict[str, Any]) -> int:
    """Half the rotary dimension of a shrunk config: the rope part of its heads (``qk_rope_head_dim``),
    else its head dimension (hidden over heads where it has none), times its ``partial_rotary_factor``."""
    head = config.get("qk_rope_head_dim")
    if not isinstance(head, int):
        head = config.get("head_dim")
    if not isinstance(head, int):
        hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
        head = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else HEAD_DIM
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    factor = config.get("partial_rotary_factor")
    if isinstance(rope, dict) and isinstance(rope.get("partial_rotary_factor"), (int, float)):
        factor = rope["partial_rotary_factor"]
    return max(1, int(head * (factor if isinstance(factor, (int, float)) else 1.0)) // 2)


def _shrink_rope(value: Any, half: int, default_sections: bool = False) -> Any:
    """A rope dict whose sections (M-RoPE) sum to ``half`` (half the shrunk rotary dimension), scaled
    in proportion; ``default_sections``: a config whose modeling code holds its sections gets
    `MROPE_SECTION`'s."""
    if not isinstance(value, dict):
        return value
    out = dict(value)
    if default_sections and not any(key in out for key in ("mrope_section", "mrope_sections")):
        out["mrope_section"] = list(MROPE_SECTION)
    for key in ("mrope_section", "mrope_sections"):
        sections = out.get(key)
        if isinstance(sections, list) and sections and all(isinstance(s, int) for s in sections):
            scaled = [max(1, s * half // sum(sections)) for s in sections]
            scaled[0] += half - sum(scaled)
            out[key] = scaled
    return out


def _splits_mrope(model_type: Any) -> bool:
    """Whether the config class of ``model_type`` takes M-RoPE sections its config may leave out (it
    ignores them at rope validation, or its modeling code reads them with a default of its own) and
    its model splits the rotary frequencies by them (not interleaved): they must then sum to half
    the rotary dimension."""
    import importlib.util

    import transformers

    if not isinstance(model_type, str) or model_type not in transformers.CONFIG_MAPPING:
        return False
    config_cls = transformers.CONFIG_MAPPING[model_type]
    ignored = getattr(config_cls, "ignore_keys_at_rope_validation", None) or ()
    if "mrope_interleaved" in ignored:
        return False
    if "mrope_section" in ignored:
        return True
    spec = importlib.util.find_spec(config_cls.__module__.replace(".configuration_", ".modeling_"))
    if spec is None or not spec.origin:
        return False
    with open(spec.origin, encoding="utf-8") as f:
        return 'rope_parameters.get("mrope_section", [' in f.read()  # PaddleOCR-VL's text model


def shrink(config: dict[str, Any]) -> dict[str, Any]:
    """A config's dict (``to_dict()``) shrunk to the sweep's tiny size, sub-configs recursively.

    Layers 2, hidden 32, 2 heads of 16 (key/value heads 1 where fewer than the heads, else 2),
    feed-forward 64, vocabulary 99 (special token ids outside it moved to its top), positions at
    most 128, images 32 with patches 4, 4 experts of which 2 are picked, per-layer lists cut to
    the kept layers; what the config derives from these follows them (M-RoPE sections summing to
    half the rotary dimension, a head dimension left None, a Mamba-2 head's width, SSM groups)."""
    out = dict(config)
    layers_before = None
    for key in LAYER_KEYS:
        if isinstance(out.get(key), int) and not isinstance(out[key], bool) and out[key] > LAYERS:
            layers_before = layers_before or out[key]
            out[key] = LAYERS
    if any(k in config for k in EXPERT_KEYS) and any(k in config for k in TOP_K_KEYS):
        # a mixture of experts whose defaults leave it unset (DeepSeek-V2, dots1): 4 experts, 2 picked
        for key in EXPERT_KEYS | TOP_K_KEYS | {"moe_intermediate_size"}:
            if key in config and config[key] is None:
                out[key] = 4 if key in EXPERT_KEYS else 2 if key in TOP_K_KEYS else FFN
    heads_before = next((config[k] for k in HEAD_KEYS if isinstance(config.get(k), int)), None)
    for key, value in config.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, dict) and "model_type" in value:
            out[key] = shrink(value)
        elif isinstance(value, int):
            if key in HIDDEN_KEYS and value > HIDDEN:
                out[key] = HIDDEN
            elif key in HEAD_KEYS and value > HEADS:
                out[key] = HEADS
            elif key in KV_HEAD_KEYS:
                out[key] = HEADS if heads_before is None or value >= heads_before else 1
            elif key in HEAD_DIM_KEYS and value > HEAD_DIM:
                out[key] = HEAD_DIM
            elif key in FFN_KEYS and value > FFN:
                out[key] = FFN
            elif key == "vocab_size" and value > VOCAB:
                out[key] = VOCAB
            elif key in POSITION_KEYS and value > MAX_POSITIONS:
                out[key] = MAX_POSITIONS
            elif key == "image_size" and value > IMAGE:
                out[key] = IMAGE
            elif key == "patch_size" and value > PATCH:
                out[key] = PATCH
            elif key in EXPERT_KEYS and value > 4:
                out[key] = 4
            elif key in TOP_K_KEYS and value > 2:
                out[key] = 2
            elif key in MLA and value > MLA[key]:
                out[key] = MLA[key]
            elif key in ("projection_dim", "num_mel_bins", "feature_size", "input_feat_per_channel", "model_in_dim") \
                    and value > 16:  # model_in_dim: a vocoder's mel bins
                out[key] = 16
            elif key in ("mask_time_length", "mask_feature_length") and value > 2:
                out[key] = 2
            elif key in ("block_size", "chunk_size") and value > MAX_POSITIONS:
                out[key] = MAX_POSITIONS
            elif key == "rotary_dim" and value > HEAD_DIM // 2:
                out[key] = HEAD_DIM // 2
            elif key == "sliding_window" and value > SEQ // 2:
                out[key] = SEQ // 2
            elif key in ("num_frames", "frames_per_clip") and value > FRAMES:
                out[key] = FRAMES  # a video model's clip
        elif isinstance(value, float) and key in ("width_coefficient", "depth_coefficient") and value > 0.25:
            out[key] = 0.25  # EfficientNet's scaling of its channels and repeats
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, int) and not isinstance(v, bool)
                                                              for v in value):
            if key in ("depths", "layers_per_stage", "num_layers_per_stage", "stage_depths", "num_block_repeats"):
                out[key] = [min(v, 1) for v in value]
            elif key in ("hidden_sizes", "embed_dims", "embedding_sizes", "channels", "stage_dims", "dims"):
                out[key] = [min(v, 16 * (i + 1)) for i, v in enumerate(value)]
            elif key in HEAD_KEYS:
                out[key] = [min(v, HEADS) for v in value]
            elif key == "conv_dim":
                out[key] = [min(v, 16) for v in value]
            elif key == "tubelet_size" and len(value) == 3:  # (frames, height, width) of a video patch
                out[key] = [min(value[0], 2), min(value[1], PATCH), min(value[2], PATCH)]
            elif layers_before is not None and len(value) == layers_before:
                out[key] = _pick_layers(list(value), LAYERS)
        elif isinstance(value, list) and layers_before is not None and len(value) == layers_before \
                and key != "out_features":  # a backbone's stages out (Swin's four), not one entry a layer
            out[key] = _pick_layers(value, LAYERS)
    # special token ids outside the vocabulary: moved to its top, each its own
    vocab = out.get("vocab_size")
    if isinstance(vocab, int):
        top = vocab - 1
        moved: dict[int, int] = {}
        for key, value in config.items():
            if not key.endswith(("_token_id", "_token_index", "_token_ids")):
                continue
            if isinstance(value, int) and not isinstance(value, bool) and value >= vocab:
                if value not in moved:
                    moved[value], top = top, top - 1
                out[key] = moved[value]
            elif isinstance(value, list) and all(isinstance(v, int) for v in value):
                fixed = []
                for v in value:
                    if v >= vocab and v not in moved:
                        moved[v], top = top, top - 1
                    fixed.append(moved.get(v, v))
                out[key] = fixed
    if "width_coefficient" in config and "hidden_dim" in config:  # EfficientNet's: its top convolution's width
        out["hidden_dim"] = int(1280 * out["width_coefficient"] / 8 + 0.5) * 8
    if isinstance(out.get("mamba_d_head"), int) and isinstance(out.get("mamba_n_heads"), int):  # Bamba's
        out["mamba_d_head"] = out.get("mamba_expand", 2) * out.get("hidden_size", HIDDEN) // out["mamba_n_heads"]
    if all(isinstance(out.get(k), int) for k in ("num_heads", "head_dim", "expand", "n_groups")):  # Mamba-2's heads
        out["head_dim"] = out["expand"] * out.get("hidden_size", HIDDEN) // out["num_heads"]  # span expand x hidden
    heads = [out[k] for k in HEAD_KEYS if isinstance(out.get(k), int) and not isinstance(out[k], bool)]
    for key in ("n_groups", "mamba_n_groups", "mamba_ngroups"):  # SSM groups: as many as the heads at most
        if heads and isinstance(out.get(key), int) and out[key] > min(heads):
            out[key] = 1
    if isinstance(out.get("qk_rope_head_dim"), int) and "head_dim" in out:  # multi-head latent attention
        out["head_dim"] = out["qk_rope_head_dim"]
    if "qk_head_dim" in out and isinstance(out.get("qk_nope_head_dim"), int):
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    if isinstance(out.get("backbone_config"), dict) and out["backbone_config"].get("model_type") == "timm_backbone":
        out["backbone_config"] = dict(TINY_RESNET)  # DETR's family: transformers' own ResNet, tiny, not timm's
    if "head_dim" in config and config["head_dim"] is None and isinstance(out.get("hidden_size"), int) \
            and isinstance(out.get("num_attention_heads"), int):  # a head dimension left None (HunYuan, Ministral)
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]  # that its attention reads as None
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(out.get(key), dict):
            out[key] = _shrink_rope(out[key], _rotary_half(out), key == "rope_parameters"
                                    and _splits_mrope(config.get("model_type")))
    if "max_source_positions" in config and "num_mel_bins" in config and "vocab_size" not in config:
        out["max_source_positions"] = SEQ  # a Whisper-like audio encoder: its frames are twice its positions
    features, stages = config.get("out_features"), config.get("stage_names")
    if layers_before is not None and isinstance(features, list) and features and isinstance(stages, list) \
            and len(stages) == layers_before + 1 and "depths" not in config:
        # a ViT backbone's stages are its layers: as many layers as the stages it outputs, the last ones
        kept = max(LAYERS, len(features))
        for key in LAYER_KEYS:
            if out.get(key) == LAYERS:
                out[key] = kept
        out["out_features"] = [f"stage{i}" for i in range(kept - len(features) + 1, kept + 1)]
        out.pop("out_indices", None)
    if "use_cache" in out:
        out["use_cache"] = False
    return out


def special_ids(config: Any) -> set[int]:
    """Every special token id of ``config`` and its sub-configs (the batch's ids avoid them)."""
    found: set[int] = set()

    def walk(d: dict[str, Any]) -> None:
        for key, value in d.items():
            if not isinstance(key, str):
                continue
            if isinstance(value, dict):
                walk(value)
            elif key.endswith(("_token_id", "_token_index", "_token_ids", "_id")) and not isinstance(value, bool):
                if isinstance(value, int):
                    found.add(value)
                elif isinstance(value, list):
                    found.update(v for v in value if isinstance(v, int))

    walk(config.to_dict())
    return found


# --- model classes -------------------------------------------------------------------------------

TASKS = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_FOR_CTC_MAPPING_NAMES",
    "MODEL_MAPPING_NAMES",
    "MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING_NAMES",  # MusicGen: its composite config takes no other class
)


def model_classes(model_type: str) -> list[tuple[str, type]]:
    """(task, class) candidates for ``model_type`` in the sweep's order; a type no task maps
    (a sub-model's config: ``clip_text_model``) takes the classes of its modeling module whose
    ``config_class`` is its config class."""
    import importlib

    import transformers
    from transformers.models.auto import modeling_auto

    out = []
    if model_type in CLASSES:
        return [(task, getattr(transformers, name)) for task, name in CLASSES[model_type]]
    for task in TASKS:
        names = getattr(modeling_auto, task).get(model_type)
        for name in (names,) if isinstance(names, str) else names or ():
            cls = getattr(transformers, name, None)
            if cls is not None:
                out.append((task.removeprefix("MODEL_FOR_").removesuffix("_MAPPING_NAMES").lower() or "base", cls))
    if not out:
        config_cls = transformers.CONFIG_MAPPING[model_type]
        module_name = config_cls.__module__.replace(".configuration_", ".modeling_")
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            return out
        found = [obj for obj in vars(module).values() if isinstance(obj, type) and issubclass(obj, nn.Module)
                 and getattr(obj, "config_class", None) is config_cls and "PreTrained" not in obj.__name__]
        found.sort(key=lambda c: (not c.__name__.endswith("Model"), len(c.__name__), c.__name__))
        out = [("model", c) for c in found]
    return out


CLASSES: dict[str, tuple[tuple[str, str], ...]] = {
    "nougat": (("model", "VisionEncoderDecoderModel"),),  # its config's model, which no task maps
    # its "classes" are its LM's yes/no logits: no class labels (a label per image), the logits' loss
    "shieldgemma2": (("model", "ShieldGemma2ForImageClassification"),),
    # a robot policy: its flow-matching loss over an action chunk (the action-expert model alone takes its embeddings)
    **{t: (("model", f"{name}ForConditionalGeneration"),) for t, name in (("pi0", "PI0"), ("pi05", "PI05"))},
}
"""model type -> (task, class name) candidates, where the task mappings name none."""


# --- overrides: where a generic rule fails ------------------------------------------------------------

TINY_RESNET = {"model_type": "resnet", "embedding_size": 16, "hidden_sizes": [16, 32, 48, 64], "depths": [1, 1, 1, 1],
               "layer_type": "basic"}
SWIN = {"image_size": IMAGE, "patch_size": 2, "embed_dim": 16, "depths": [2, 2], "num_heads": [2, 2], "window_size": 2}
COMPASS_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}}
QWEN4_INDEXER = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM, "indexer_budget": 8,
                 "indexer_compress_ratio": 4, "hc_lowrank": 8}
MIMI = {"upsample_groups": HIDDEN, "vector_quantization_hidden_dimension": HIDDEN, "num_quantizers": 4}
DIA_CROSS = {"cross_hidden_size": HIDDEN, "cross_num_attention_heads": HEADS, "cross_head_dim": HEAD_DIM,
             "cross_num_key_value_heads": HEADS}
# SAM 2: a Hiera of four stages at 16, 8, 4, 2 patches a side (images of 64), a global block not first in its
# stage (whose window the query pooling divides), its FPN at the prompts' width
SAM2_HIERA = {"image_size": [64, 64], "hidden_size": 16, "embed_dim_per_stage": [16, 32, 64, 128],
              "num_attention_heads_per_stage": [1, 1, 2, 2], "blocks_per_stage": [1, 1, 2, 1],
              "window_size_per_stage": [2, 2, 2, 2], "global_attention_blocks": [3],
              "window_positional_embedding_background_size": [2, 2]}
SAM2_VISION = {"backbone_config": SAM2_HIERA, "backbone_channel_list": [128, 64, 32, 16],
               "backbone_feature_sizes": [[16, 16], [8, 8], [4, 4]], "fpn_hidden_size": HIDDEN}
SAM3_VISION = {"fpn_hidden_size": HIDDEN, "backbone_config": {"window_size": 4, "global_attn_indexes": [1],
                                                             "pretrain_image_size": IMAGE}}
HIFIGAN = {"upsample_initial_channel": HIDDEN, "upsample_rates": [2, 2], "upsample_kernel_sizes": [4, 4]}
MOLMO2_VISION = {"image_size": [IMAGE, IMAGE], "num_position_embeddings": (IMAGE // PATCH) ** 2}
MUSE_SPARK_AUDIO = {"num_hidden_layers": 4, "patch_sizes": [4, 2, 2, 2]}
CLAP_AUDIO = {"spec_size": 64, "num_mel_bins": 32, "window_size": 2, "patch_embeds_hidden_size": 16, "hidden_size": 128}
DEFAULTS: dict[str, dict[str, Any]] = {
    "nougat": {"encoder": {"model_type": "donut-swin"}, "decoder": {"model_type": "mbart"}},
}
"""model type -> arguments its config class is built with before the shrink, where its own defaults fail."""

CONFIG_TYPES = {"nougat": "vision-encoder-decoder"}  # its config names its encoder's type misspelt (donut_swin)
"""model type -> the type whose config class builds it, where its own cannot."""

OVERRIDES: dict[str, dict[str, Any]] = {
    "whisper": {"max_source_positions": SEQ},
    "audio-spectrogram-transformer": {"max_length": 32, "num_mel_bins": 16},
    "speech_to_text": {"max_source_positions": 64},
    "bark": {"block_size": MAX_POSITIONS},
    "funnel": {"block_sizes": [1, 1], "block_repeats": [1, 1], "num_decoder_layers": 2},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},  # expands to num_layers' attention_layers
    "esm": {"vocab_size": 33, "pad_token_id": 1, "mask_token_id": 32},  # ESM-2's vocabulary; defaults leave None
    "nemotron": {"num_key_value_heads": 1},  # left None, which its attention divides by
    "xlstm": {"embedding_dim": HIDDEN},  # its hidden size's twin, not among the hidden keys
    # two hybrid layers: the shared transformer is tied across them (one leaves its tie matching nothing)
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["hybrid", "linear_attention", "hybrid"],
              "attention_hidden_size": 2 * HIDDEN, "mamba_dt_rank": HIDDEN // 16},
    "xmod": {"default_language": "en_XX"},  # its adapters' language, which its forward needs
    "lxmert": {"l_layers": 1, "x_layers": 1, "r_layers": 1, "visual_feat_dim": 16, "num_qa_labels": 10,
               "num_object_labels": 10, "num_attr_labels": 10},
    # layout models: a box's embeddings concatenated make the hidden size
    "layoutlmv3": {"coordinate_size": 6, "shape_size": 4, "input_size": IMAGE},  # 4 x 6 + 2 x 4 = 32
    "lilt": {"hidden_size": 48},  # its 6 box embeddings of hidden // 6 each, and a layout stream of hidden // 4
    "bros": {"hidden_size": 64},  # its box sinusoids' width is hidden // 32 (derived), an even one
    "encoder-decoder": {"pad_token_id": 0, "decoder_start_token_id": 2},  # its decoder inputs: labels shifted right
    "vision-text-dual-encoder": {"vision_config": {"pooler_output_size": HIDDEN}},  # ViT's pooler, projected
    # time series: a horizon (None by default), a context twice it, few lags, one time feature
    **{t: {"prediction_length": 4, "context_length": 8, "lags_sequence": [1, 2, 3], "num_time_features": 1}
       for t in ("informer", "time_series_transformer")},
    "autoformer": {"prediction_length": 4, "context_length": 8, "lags_sequence": [1, 2, 3], "num_time_features": 1,
                   "label_length": 4, "moving_average": 5},  # its decoder's start: the context's last 4 (at most 8)
    "timesfm": {"context_length": 64, "patch_length": 16, "horizon_length": 16},
    "timesfm2_5": {"context_length": 64, "patch_length": 16, "horizon_length": 16},
    "moonshine": {"encoder_num_key_value_heads": 2, "decoder_num_key_value_heads": 2},  # as many as the heads
    "wav2vec2-bert": {"feature_projection_input_dim": 16},  # its input features' width (stacked mel frames)
    "falcon_h1": {"mamba_d_ssm": 2 * HIDDEN, "mamba_d_state": 16, "mamba_chunk_size": SEQ},  # heads x head width
    # no layers sharing another's key/value cache (the kept 2 would share with none), per-layer inputs shrunk
    "gemma3n_text": {"num_kv_shared_layers": 0, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": VOCAB,
                     "laurel_rank": 8},
    # a sub-config read alone: the dropout its composite config would set on it
    **{t: {"dropout_rate": 0.0} for t in ("t5gemma2_text", "t5gemma2_decoder")},
    "t5gemma2_encoder": {"text_config": {"dropout_rate": 0.0}},
    "dots1": {"n_shared_experts": 1},  # left None, which its shared experts' width is multiplied by
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},  # left None; one dense layer
    "decision_transformer": {"max_ep_len": MAX_POSITIONS},  # its time steps' embedding
    "moshi_depth": {"input_size": HIDDEN},  # the main decoder's width, whose states it reads
    # rope per layer type (its defaults leave none), M-RoPE sections summing to half the head
    "cohere_compass_text": {"rope_parameters": COMPASS_ROPE},
    "cohere_compass": {"text_config": {"rope_parameters": COMPASS_ROPE}},
    "step3p5": {"sliding_window": SEQ // 2, "share_expert_dim": FFN},  # left None, its masks need it
    "step3p7": {"text_config": {"sliding_window": SEQ // 2, "share_expert_dim": FFN}},
    "qwen3_omni_moe_talker_text": {"shared_expert_intermediate_size": FFN},  # its composite's, read by its MoE
    "moonshine_streaming": {"num_key_value_heads": HEADS},
    # one layer of each kind: its indexed-attention layer the second, each layer its own key/value source
    "kolibri1_1": {"index_layers": [1], "kv_source_layers": [0, 1], "index_topk": 8, "index_pool_size": 64,
                   "index_compression": 4, "index_num_heads": 2, "index_num_local_tokens": 4,
                   "index_num_sink_tokens": 2, "mlp_only_layers": [0]},
    # its dict's layout (an attention and an mlp block per layer, counts doubled): 3 layers, one per stage
    "dory": {"num_hidden_layers": 6, "n_input_layers": 2, "n_recurrent_layers": 2, "n_output_layers": 2,
             "layer_types": ["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention", "mlp"]},
    "qwen4_exp_text": QWEN4_INDEXER,  # its indexer's sizes, left None by its defaults
    "qwen4_exp": {"text_config": QWEN4_INDEXER},
    # the global transformer's width its local encoder and decoder project to and from; a small hash vocabulary
    "blt": {"encoder_hash_byte_group_vocab": 64, "local_attention_window_len": SEQ // 2,
            "encoder_config": {"hidden_size_global": HIDDEN}, "decoder_config": {"hidden_size_global": HIDDEN}},
    # its rotary width is at least 32: heads of 32
    "clvp_encoder": {"hidden_size": 2 * HIDDEN},
    "clvp": {"text_config": {"hidden_size": 2 * HIDDEN}, "speech_config": {"hidden_size": 2 * HIDDEN},
             "decoder_config": {"num_mel_attn_blocks": 2}},
    # Mimi's codec: upsampling grouped per channel (groups = its width), 4 quantizers
    "mimi": MIMI,
    **{t: MIMI for t in ("mimi_decoder", "pocket_tts_audio_tokenizer", "pocket_tts_audio_tokenizer_decoder")},
    "kyutai_speech_to_text": {"num_codebooks": 4, "codec_config": MIMI},
    # its decoder's cross-attention: the encoder's width and heads
    "dia": {"decoder_config": DIA_CROSS},
    "rag": {"n_docs": 2},  # documents per question
    # its image then its audio tokens' ranges within the tiny vocabulary, end to end
    "apertus1p5": {"image_token_offset": 50, "audio_token_offset": 66, "vision_config": {"codebook_size": 16},
                   "audio_config": {"codebook_size": 16}},
    "pix2struct_text_model": {"initializer_range": 0.02},  # its composite's, read at init
    "unlimited_ocr_vision": {"sam_config": {"downsample_channels": [16, HIDDEN]}},  # as DeepSeek-OCR 2's
    # its FPN's maps: the 8 x 8 patches scaled by 4, 2 and 1
    "sam3_tracker": {"vision_config": {**SAM3_VISION, "backbone_feature_sizes": [[32, 32], [16, 16], [8, 8]]}},
    # its four stages kept (one entry a stage), each patch a few samples (its 16 x 6 x 5 x 4: 1,920 a token)
    "muse_spark_audio": MUSE_SPARK_AUDIO,
    "muse_spark": {"audio_config": MUSE_SPARK_AUDIO},
    # the text model's width its last layer projects to (6,144); its layers by the argument's name (its dict's
    # n_layers is not one)
    "inkling_vision": {"text_hidden_size": HIDDEN, "num_hidden_layers": LAYERS},
    "inkling_audio": {"text_hidden_size": HIDDEN},
    "fun_asr_nano": {"adaptor_config": {"intermediate_size": HIDDEN // 4}},  # its text width over 4
    # its DPT head at the tiny width (its 256-channel fusion upsampled to 4 x the image: minutes a plan)
    "chmv2": {"backbone_config": {"return_class_token": True}, "fusion_hidden_size": HIDDEN, "head_hidden_size": 16,
              "number_output_channels": HIDDEN, "post_process_channels": [16, 32, 64, 128]},
    "gemma4_vision": {"position_embedding_size": MAX_POSITIONS},  # its patches' x and y places (10,240 each)
    # the layers its adapter reads: its two; images of IMAGE, a position a patch (its 729 of 378 at patches of 14)
    "molmo2": {"adapter_config": {"vision_feature_layer": [-1, -2]}, "vision_config": MOLMO2_VISION},
    "molmo2_vision": MOLMO2_VISION,
    # DeepSeek-OCR 2: a dense layer and a sparse one (its defaults leave the kinds None); its SAM encoder's
    # downsampling convolutions ending at its vision encoder's width
    "deepseek_ocr2_text": {"mlp_layer_types": ["dense", "sparse"]},
    "deepseek_ocr2_vision": {"sam_config": {"downsample_channels": [16, HIDDEN]}},
    "deepseek_ocr2": {"text_config": {"mlp_layer_types": ["dense", "sparse"]},
                      "vision_config": {"sam_config": {"downsample_channels": [16, HIDDEN]}}},
    # its vision layers injected into its text layers (its defaults leave the map and the rate None); its
    # Q-Former's heads are the vision width over 64
    "granite4_vision": {"deepstack_layer_map": [[0, 0], [1, 1]], "downsample_rate": "1/2",
                        "spatial_target_layers": [0, 1, 0, 1], "vision_config": {"hidden_size": 64}},
    # HiFi-GAN vocoders: 32 channels, two upsamplings by 2 (its four by 4 or 8 from 512 channels: minutes a plan)
    **{t: HIFIGAN for t in ("speecht5_hifigan", "fastspeech2_conformer_hifigan")},
    "fastspeech2_conformer_with_hifigan": {"vocoder_config": HIFIGAN},
    "qwen2_5_omni_bigvgan": HIFIGAN,
    # its PaliGemma's image features projected to its text width (projection_dim, shrunk to 16 as CLIP's)
    **{t: {"vlm_config": {"vision_config": {"projection_dim": HIDDEN}}} for t in ("pi0", "pi05")},
    # its convolutions' channels at its width (its released 1024 are its hidden size's)
    "phi4_multimodal_audio": {"ext_pw_out_channel": HIDDEN, "depthwise_separable_out_channel": HIDDEN,
                              "nemo_conv_channels": HIDDEN},
    # two stages of 2 (its six make 3,200 samples a latent frame, at up to 2,048 channels)
    **{t: {"downsampling_ratios": [2, 2], "depths": [1, 1, 1]}
       for t in ("vibevoice_acoustic_tokenizer_encoder", "vibevoice_acoustic_tokenizer_decoder")},
    # its head reads every bridge stage side by side (its released config's; its default names the last alone)
    # its reflect padding (up to 18 a side at its bridges' dilations) needs maps wider than the tiny image's: zeros
    "uvdoc": {"backbone_config": {"out_features": [f"stage{i}" for i in range(1, 7)]}, "padding_mode": "zeros"},
    "janus_vqgan": {"num_patches": 2},  # its latent grid: the image's 32 downsampled 16 times
    # its image's 8 x 8 patches pooled to 4 x 4; its answer's tokens within the text model's vocabulary
    "shieldgemma2": {"mm_tokens_per_image": 16, "yes_token_index": VOCAB - 11, "no_token_index": VOCAB - 12},
    # its composite's, read by its rope's positions
    **{t: {"vision_start_token_id": VOCAB - 10} for t in ("qwen2_5_omni_thinker", "qwen3_omni_moe_thinker")},
    # its modeling code's sections (22, 22, 20): height and width alike, which it interleaves
    "ernie4_5_vl_moe_text": {"rope_parameters": {"mrope_section": [3, 3, 2]}},
    "ernie4_5_vl_moe": {"text_config": {"rope_parameters": {"mrope_section": [3, 3, 2]}}},
    "xcodec": {"codebook_dim": None},  # derived: its acoustic and semantic widths side by side
    # the global transformer's width, as in blt's; 2 layers (its default 1 makes no stack of blocks)
    "blt_local_encoder": {"hidden_size_global": HIDDEN, "num_hidden_layers": LAYERS},
    "blt_local_decoder": {"hidden_size_global": HIDDEN},
    "csm": {"codec_config": MIMI, "depth_decoder_config": {"backbone_hidden_size": HIDDEN}},
    "dia_decoder": DIA_CROSS,
    # its attention and FFN configs (no model type: not shrunk); rope_theta, clip_qkv: keys DBRX's release sets
    "dbrx": {"attn_config": {"kv_n_heads": 1, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"hidden_size": HIDDEN, "ffn_hidden_size": FFN}},
    "big_bird": {"attention_type": "original_full"},
    "bigbird_pegasus": {"attention_type": "original_full"},
    "longformer": {"attention_window": 4},
    "led": {"attention_window": 4},
    "reformer": {"axial_pos_shape": [4, 4], "axial_pos_embds_dim": [16, 16], "attn_layers": ["local", "lsh"],
                 "local_attn_chunk_length": 4, "lsh_attn_chunk_length": 4},
    "yolos": {"image_size": [IMAGE, IMAGE], "num_detection_tokens": 4},  # (512, 864) at patches of 4: 27,648 tokens
    "swin": SWIN,
    "swinv2": SWIN,
    "donut-swin": SWIN,
    "nougat": {"encoder": SWIN},
    "maskformer-swin": SWIN,
    # its frame pad: a border of a max-size image; its backbone's last map pooled by 2 once more: two stages
    "tvp": {"max_img_size": IMAGE, "visual_prompt_size": 4,
            "backbone_config": {"hidden_sizes": [16, 32], "depths": [1, 1], "out_features": ["stage2"]}},
    # queries picked from the encoder's tokens: fewer than its 21 at strides 8, 16, 32
    "rt_detr": {"num_queries": 10},
    "rt_detr_v2": {"num_queries": 10},
    # HGNet-V2's stages output its stage_out_channels, which its hidden_sizes (the channels it reports) name
    "d_fine": {"num_queries": 10, "backbone_config": {"hidden_sizes": [128, 512, 1024, 2048]}},
    **{t: {"num_queries": 10, "backbone_config": {"hidden_sizes": [128, 512, 1024, 2048]}}  # HGNet-V2's, as D-FINE's
       for t in ("pp_doclayout_v2", "pp_doclayout_v3", "pp_doclayout_v4")},
    "deimv2": {"num_queries": 10, "backbone_config": {"hidden_sizes": [128, 512, 1024, 2048]}},
    # the neck reads the backbone's hidden states at their width
    "depth_anything": {"reassemble_hidden_size": HIDDEN},
    "prompt_depth_anything": {"reassemble_hidden_size": HIDDEN},
    # its patch embedding pads by 2: patches of 8 make a whole grid of 4 x 4
    "vitpose": {"backbone_config": {"image_size": [IMAGE, IMAGE], "patch_size": [8, 8]}},
    "mask2former": {"feature_size": 32, "mask_feature_size": 32},  # its pixel decoder's group norms: 32 groups
    # the image embeddings and their positional encoding (2 x num_pos_feats): at the prompt encoder's width
    "sam": {"vision_config": {"output_channels": HIDDEN, "num_pos_feats": HIDDEN // 2}},
    "sam_hq": {"vision_config": {"output_channels": HIDDEN, "num_pos_feats": HIDDEN // 2},
               "mask_decoder_config": {"vit_dim": HIDDEN}},
    "sam2": {"vision_config": SAM2_VISION, "prompt_encoder_config": {"image_size": 64, "patch_size": 16}},
    "sam2_vision_model": SAM2_VISION,  # its vision tower alone, and its Hiera alone
    "sam2_hiera_det_model": SAM2_HIERA,
    # SAM 3: its FPN at the DETR's width; a window of 4 patches (the image's 8 a side whole windows), global last
    **{t: {"vision_config": SAM3_VISION, "detr_decoder_config": {"num_queries": 10}}
       for t in ("sam3", "sam3_lite_text")},
    "mgp-str": {"image_size": [IMAGE, IMAGE]},  # its 32 x 128 text lines: a square as the others
    "vitpose_backbone": {"image_size": [IMAGE, IMAGE], "patch_size": [8, 8]},  # as ViTPose's backbone
    # windows: image_size / num_windows a multiple of its side (sqrt num_windows)
    "lw_detr": {"num_queries": 10, "projector_scale_factors": [1.0], "backbone_config": {"num_windows": 4}},
    "lw_detr_vit": {"num_windows": 4},
    "rf_detr": {"num_queries": 10},  # queries picked from the encoder's tokens: fewer than them
    # the layers whose states it outputs: among its two; its output: those and the last, side by side
    "mllama_vision_model": {"num_global_layers": LAYERS, "intermediate_layers_indices": [0, 1],
                            "vision_output_dim": 3 * HIDDEN},
    "superglue": {"keypoint_detector_config": {"descriptor_decoder_dim": HIDDEN}},  # descriptors at its width
    # DepthPro: its encoders' image (its patch) IMAGE, the input 4 of them a side (its smallest scale, 0.25, one
    # patch); the layers it hooks: among its two
    "depth_pro": {"patch_size": IMAGE, "intermediate_hook_ids": [1, 0], "merge_padding_value": 1},
    "textnet": {"image_size": [IMAGE, IMAGE], "stem_out_channels": 16},  # its stem feeds its first stage
    # its adapter reads the pixel-shuffled patches: hidden / ratio**2 wide
    "llama4_vision_model": {"intermediate_size": 4 * HIDDEN, "projector_input_dim": HIDDEN,
                            "projector_output_dim": HIDDEN, "vision_output_dim": HIDDEN},
    # its key/value heads per layer: among its 2 query heads (a full layer first, a grouped one last)
    "sapiens2": {"num_key_value_heads_per_layer": [2, 1], "num_key_value_attention_heads": 1,
                 "num_first_full_attention_layers": 1, "num_last_full_attention_layers": 0},
    # its tokenizer's map of image tokens (read at init): the image placeholder's alone, text-only batches
    "chameleon": {"vocabulary_map": {"<image>": VOCAB - 1}},
    "emu3": {"vocabulary_map": {"<image>": VOCAB - 1, "<|extra_200|>": VOCAB - 2}},
    # queries picked from the encoder's tokens: fewer than them; the tiny ResNet's last three stages as its
    # three levels; its text projection reads the text tower's width
    "omdet-turbo": {"num_queries": 10, "encoder_in_channels": [32, 48, 64], "text_projection_in_dim": HIDDEN,
                    "text_projection_out_dim": HIDDEN, "class_embed_dim": HIDDEN,
                    "apply_layernorm_after_vision_backbone": False,  # a norm over Swin's channels-last maps
                    "backbone_config": {"out_features": ["stage2", "stage3", "stage4"]}},
    # LoFTR's coarse features: its last stage's channels, which it attends at; its 2-D rope (4 x its heads'
    # width) fills half of them: 8 heads, as its default
    "efficientloftr": {"out_features": [16, 16, 32, HIDDEN], "hidden_size": HIDDEN, "num_attention_heads": 8},
    "levit": {"patch_size": 16},  # its stem's four stride-2 convolutions: patches of 16
    "mobilevitv2": {"image_size": 64},  # output stride 32: a 2 x 2 map its last block unfolds in patches of 2
    "bit": {"num_groups": 4},  # group norms over 4 channels at least
    "vitmatte": {"backbone_config": {"patch_size": 16}},  # its fusion upsamples a stride-16 map onto stride 8
    # SegGPT: the prompt above the input, each IMAGE square; its decoder reads four layers' states
    "seggpt": {"image_size": [2 * IMAGE, IMAGE], "pretrain_image_size": IMAGE, "num_hidden_layers": 4,
               "intermediate_hidden_state_indices": [0, 1, 2, 3], "merge_index": 0},
    "grounding-dino": {"num_queries": 10},  # queries picked from the encoder's tokens: fewer than them
    "mm-grounding-dino": {"num_queries": 10},
    "siglip2": {"text_config": {"projection_size": HIDDEN}},  # the text head projects to the image's width
    "pix2struct": {"vision_config": {"patch_embed_hidden_size": 3 * PATCH * PATCH}},  # a flattened patch's values
    "pix2struct_vision_model": {"patch_embed_hidden_size": 3 * PATCH * PATCH},
    "align": {"projection_dim": 80},  # the image's pooled width: EfficientNet's last 320 channels x 0.25
    # its queries' image tokens stand in the text: a few of them
    "blip-2": {"num_query_tokens": 4, "image_token_index": VOCAB - 1},
    "instructblip": {"num_query_tokens": 4, "image_token_index": VOCAB - 1},
    "instructblipvideo": {"num_query_tokens": 4, "video_token_index": VOCAB - 1},
    "kosmos-2": {"latent_query_num": 4, "text_config": {"layers": LAYERS}},
    "bridgetower": {"hidden_size": 64, "text_config": {"hidden_size": 64},  # its link's heads: hidden // 64
                    "vision_config": {"hidden_size": 64}},
    "bridgetower_vision_model": {"hidden_size": 64},
    # its mel spectrogram is folded into a square of spec_size (spec_size / mel bins time chunks, at least
    # as many as its last stage's rows), windows within its last stage; its hidden size: its last stage's width
    "clap": {"audio_config": CLAP_AUDIO},
    "clap_audio_model": CLAP_AUDIO,
    # its multi-frame integration transformer works at the projection's width
    "xclip": {"vision_config": {"mit_hidden_size": 16, "mit_intermediate_size": FFN, "mit_num_attention_heads": HEADS}},
}
"""model type -> config values set after the generic shrink (top level); a value its config class
does not take as an argument is set on the built config (`_set_untaken`)."""


def _boxes(generator: torch.Generator, scale: int | None = None) -> torch.Tensor:
    """A box (x0, y0, x1, y1), its corners in order, per token: in [0, 1], or integers in [0, ``scale``]."""
    corners = torch.rand((BATCH, SEQ, 2, 2), generator=generator).sort(dim=2).values  # x0 <= x1, y0 <= y1
    boxes = corners.reshape(BATCH, SEQ, 4)
    return boxes if scale is None else (boxes * scale).long()


def _layout(config: Any, generator: torch.Generator, scale: int | None = None, image: bool = False) -> dict[str, Any]:
    """Text with its boxes (a document's words), and the page's image where the model reads it."""
    out = {"input_ids": _ids(config, generator), "bbox": _boxes(generator, scale)}
    if image:
        out["pixel_values"] = torch.randn((BATCH, config.num_channels, IMAGE, IMAGE), generator=generator)
    return out


def _series(config: Any, generator: torch.Generator) -> dict[str, Any]:
    """A forecaster's (Informer's kin's) window: the context and its lags, the horizon, one time feature."""
    past = config.context_length + max(config.lags_sequence)
    return {"past_values": torch.randn((BATCH, past), generator=generator),
            "past_time_features": torch.randn((BATCH, past, config.num_time_features), generator=generator),
            "past_observed_mask": torch.ones((BATCH, past)),
            "future_values": torch.randn((BATCH, config.prediction_length), generator=generator),
            "future_time_features": torch.randn((BATCH, config.prediction_length, config.num_time_features),
                                                generator=generator)}



def _siglip2(config: Any, generator: torch.Generator) -> dict[str, Any]:
    """NaFlex patches: each image's patches flattened, its mask and its grid of patches."""
    vision = getattr(config, "vision_config", config)
    side, patch = IMAGE // vision.patch_size, vision.patch_size
    return {"pixel_values": torch.randn((BATCH, side * side, vision.num_channels * patch * patch), generator=generator),
            "pixel_attention_mask": torch.ones((BATCH, side * side), dtype=torch.long),
            "spatial_shapes": torch.tensor([[side, side]] * BATCH)}


def _pix2struct(config: Any, generator: torch.Generator) -> dict[str, Any]:
    """Flattened patches: each patch's row and column (from 1) and its values, and their mask."""
    vision = getattr(config, "vision_config", config)
    side = IMAGE // PATCH // 2
    rows, cols = torch.meshgrid(torch.arange(1, side + 1), torch.arange(1, side + 1), indexing="ij")
    ids = torch.stack([rows.flatten(), cols.flatten()], -1).float().expand(BATCH, -1, -1)
    values = torch.randn((BATCH, side * side, vision.patch_embed_hidden_size), generator=generator)
    out = {"flattened_patches": torch.cat([ids, values], -1), "attention_mask": torch.ones((BATCH, side * side))}
    if hasattr(config, "text_config"):
        out.update(decoder_input_ids=_ids(config, generator), labels=_ids(config, generator))
    return out


def _image_tokens(config: Any, generator: torch.Generator, token: int, count: int) -> torch.Tensor:
    """Text ids that start with ``count`` image tokens (the places of a vision tower's queries)."""
    return torch.cat([torch.full((BATCH, count), token), _ids(config, generator)], 1)


def _blip2(config: Any, generator: torch.Generator, frames: int = 1) -> dict[str, Any]:
    token = getattr(config, "image_token_index", None)
    token = getattr(config, "video_token_index", None) if token is None else token
    ids = _image_tokens(config, generator, token, config.num_query_tokens * frames)
    size = config.vision_config.image_size
    shape = (BATCH, frames, 3, size, size) if frames > 1 else (BATCH, 3, size, size)
    out = {"pixel_values": torch.randn(shape, generator=generator), "input_ids": ids,
           "attention_mask": torch.ones_like(ids)}
    if hasattr(config, "qformer_config") and getattr(config, "model_type", "") != "blip-2":
        # InstructBLIP: the instruction again, in the Q-Former's own vocabulary
        out["qformer_input_ids"] = torch.randint(3, config.qformer_config.vocab_size, (BATCH, SEQ), generator=generator)
        out["qformer_attention_mask"] = torch.ones((BATCH, SEQ), dtype=torch.long)
    return out


def _kosmos2(config: Any, generator: torch.Generator) -> dict[str, Any]:
    """Images and text whose places 1 to latent_query_num take the image's embeddings."""
    ids = _ids(config, generator, SEQ + config.latent_query_num)
    where = torch.zeros_like(ids, dtype=torch.bool)
    where[:, 1:1 + config.latent_query_num] = True
    size = config.vision_config.image_size
    return {"pixel_values": torch.randn((BATCH, 3, size, size), generator=generator), "input_ids": ids,
            "attention_mask": torch.ones_like(ids), "image_embeds_position_mask": where}


def _clap_audio(config: Any, generator: torch.Generator) -> dict[str, Any]:
    """A mel spectrogram of spec_size x (spec_size / mel bins) frames: one square once folded."""
    audio = getattr(config, "audio_config", config)
    frames = audio.spec_size * (audio.spec_size // audio.num_mel_bins)
    return {"input_features": torch.randn((BATCH, 1, frames, audio.num_mel_bins), generator=generator)}


def _fastspeech2(config: Any, generator: torch.Generator) -> dict[str, Any]:
    """Text and the targets its training needs: 2 frames a token, its mel frames, pitch and energy a token."""
    config = getattr(config, "model_config", config)
    return {"input_ids": _ids(config, generator), "duration_labels": torch.full((BATCH, SEQ), 2),
            "spectrogram_labels": torch.randn((BATCH, 2 * SEQ, config.num_mel_bins), generator=generator),
            "pitch_labels": torch.randn((BATCH, SEQ, 1), generator=generator),
            "energy_labels": torch.randn((BATCH, SEQ, 1), generator=generator)}


def _gemma4_vision(config: Any, generator: torch.Generator) -> dict[str, Any]:
    """Each image's flattened patches and their (x, y) places: a grid two pooling windows a side."""
    side, patch = 2 * config.pooling_kernel_size, config.patch_size
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    return {"pixel_values": torch.rand((BATCH, side * side, 3 * patch * patch), generator=generator),
            "pixel_position_ids": torch.stack([cols.flatten(), rows.flatten()], -1).expand(BATCH, -1, -1).clone()}


def _pi0(config: Any, generator: torch.Generator) -> dict[str, Any]:
    """A robot policy's step: one camera's image (its tokens in the instruction), the robot's state (pi0's), the
    action chunk to predict, and its noise and time given (else drawn each step)."""
    vlm, vision = config.vlm_config, config.vlm_config.vision_config
    tokens = (vision.image_size // vision.patch_size) ** 2
    out = {"pixel_values": torch.randn((BATCH, 1, 3, vision.image_size, vision.image_size), generator=generator),
           "pixel_attention_mask": torch.ones((BATCH, 1), dtype=torch.bool),
           "input_ids": _image_tokens(vlm, generator, vlm.image_token_id, tokens),
           "actions": torch.randn((BATCH, config.chunk_size, config.max_action_dim), generator=generator),
           "noise": torch.randn((BATCH, config.chunk_size, config.max_action_dim), generator=generator),
           "timestep": torch.rand((BATCH,), generator=generator)}
    if hasattr(config, "max_state_dim"):
        out["state"] = torch.randn((BATCH, config.max_state_dim), generator=generator)
    return out


def _sam3_detr(config: Any, generator: torch.Generator, decoder: bool = False) -> dict[str, Any]:
    """SAM 3's DETR encoder or decoder alone: an 8 x 8 map of vision features with its position encoding (a level
    of maps for the encoder; its tokens flattened, and their grid, for the decoder) and the prompt's text features."""
    side, width = 8, config.hidden_size
    maps = [torch.randn((BATCH, width, side, side), generator=generator) for _ in range(2)]
    text = torch.randn((BATCH, SEQ, width), generator=generator)
    if not decoder:
        return {"vision_features": maps[:1], "vision_pos_embeds": maps[1:], "text_features": text}
    tokens = [m.flatten(2).transpose(1, 2) for m in maps]
    return {"vision_features": tokens[0], "vision_pos_encoding": tokens[1], "text_features": text,
            "spatial_shapes": torch.tensor([[side, side]])}


BATCH_OVERRIDES: dict[str, Callable[[Any, torch.Generator], dict[str, Any]]] = {
    # text, and the audio tokens of each of its channels
    "dia": lambda c, g: {"input_ids": _ids(c.encoder_config, g), "decoder_input_ids": torch.randint(
        0, c.decoder_config.vocab_size - 4, (BATCH, SEQ, c.decoder_config.num_channels), generator=g)},
    "dia_decoder": lambda c, g: {"input_ids": torch.randint(0, c.vocab_size - 4, (BATCH, SEQ, c.num_channels),
                                                            generator=g),
                                 "encoder_hidden_states": torch.randn((BATCH, SEQ, c.cross_hidden_size), generator=g)},
    # a text token and a token per codebook at each step
    "kyutai_speech_to_text": lambda c, g: {"input_ids": torch.randint(4, VOCAB - 4, (BATCH, SEQ, c.num_codebooks + 1),
                                                                      generator=g)},
    # no retriever: the question, and its retrieved documents (as generator input) with their scores
    "rag": lambda c, g: {"input_ids": _ids(c.question_encoder, g),
                         "context_input_ids": _ids(c.generator, g).repeat_interleave(c.n_docs, 0),
                         "context_attention_mask": torch.ones((BATCH * c.n_docs, SEQ), dtype=torch.long),
                         "doc_scores": torch.randn((BATCH, c.n_docs), generator=g)},
    # bytes in patches of 4 (a 2-D mask would be added to its attention's scores as they are: none)
    "blt_local_encoder": lambda c, g: {"input_ids": _ids(c, g), "num_patches": SEQ // 4,
                                       "patch_ids": (torch.arange(SEQ) // 4).repeat(BATCH, 1)},
    # the local encoder's byte states and the global transformer's patch states
    "blt_local_decoder": lambda c, g: {"inputs_embeds": torch.randn((BATCH, SEQ, c.hidden_size), generator=g),
                                       "patch_embeds": torch.randn((BATCH, SEQ // 4, c.hidden_size_global),
                                                                   generator=g)},
    "blt_global_transformer": lambda c, g: {"inputs_embeds": torch.randn((BATCH, SEQ, c.hidden_size), generator=g)},
    # text and the speech's mel features its decoder conditions on
    "clvp": lambda c, g: {"input_ids": _ids(c.text_config, g), "input_features": torch.randn(
        (BATCH, c.decoder_config.feature_size, 4 * SEQ), generator=g)},
    # the text model read alone: the delay's time embedding its composite passes each layer
    "voxtral_realtime_text": lambda c, g: {"input_ids": _ids(c, g),
                                           "t_cond": torch.randn((1, 1, c.hidden_size), generator=g)},
    # the talker reads the thinker's states, not token ids (it has no token embedding)
    "qwen3_omni_moe_talker_text": lambda c, g: {"inputs_embeds": torch.randn((BATCH, SEQ, c.hidden_size), generator=g)},
    # a token per codebook, the main decoder's states they are contextualised by, and the tokens to predict
    # (its logits' mean square grows past float range in 3 SGD steps; its cross-entropy does not)
    "moshi_depth": lambda c, g: {"input_ids": _ids(c, g, c.num_codebooks),
                                 "last_hidden_state": torch.randn((BATCH, c.num_codebooks, c.input_size), generator=g),
                                 "labels": _ids(c, g, c.num_codebooks)},
    # an offline RL batch: trajectories of states, actions, rewards, returns to go and their time steps
    "decision_transformer": lambda c, g: {
        "states": torch.randn((BATCH, SEQ, c.state_dim), generator=g),
        "actions": torch.randn((BATCH, SEQ, c.act_dim), generator=g),
        "rewards": torch.randn((BATCH, SEQ, 1), generator=g),
        "returns_to_go": torch.randn((BATCH, SEQ, 1), generator=g),
        "timesteps": torch.arange(SEQ).repeat(BATCH, 1),
        "attention_mask": torch.ones((BATCH, SEQ), dtype=torch.long)},
    # a codebook's row of tokens per codebook per item
    **{t: lambda c, g: {"input_ids": torch.randint(0, c.vocab_size - 1, (BATCH * c.num_codebooks, SEQ), generator=g)}
       for t in ("musicgen_decoder", "musicgen_melody_decoder")},
    # the composite model: a text prompt, and the audio tokens of each codebook the decoder continues
    **{t: lambda c, g: {"input_ids": _ids(c.text_encoder, g), "decoder_input_ids": torch.randint(
        0, c.decoder.vocab_size - 1, (BATCH * c.decoder.num_codebooks, SEQ), generator=g)}
       for t in ("musicgen", "musicgen_melody")},
    # a decoder read alone: the encoder's states it attends to
    "t5gemma2_decoder": lambda c, g: {"input_ids": _ids(c, g),
                                      "encoder_hidden_states": torch.randn((BATCH, SEQ, c.hidden_size), generator=g)},
    # mel features stacked two frames at a time, as its feature extractor makes them
    "wav2vec2-bert": lambda c, g: {"input_features": torch.randn((BATCH, 4 * SEQ, c.feature_projection_input_dim),
                                                                generator=g)},
    **{t: _series for t in ("informer", "autoformer", "time_series_transformer")},
    # a context of values per channel
    "patchtst": lambda c, g: {"past_values": torch.randn((BATCH, c.context_length, c.num_input_channels),
                                                         generator=g)},
    "patchtsmixer": lambda c, g: {"past_values": torch.randn((BATCH, c.context_length, c.num_input_channels),
                                                             generator=g)},
    # a context of values, none of it padding (and TimesFM's frequency class)
    "timesfm": lambda c, g: {"past_values": torch.randn((BATCH, c.context_length), generator=g),
                             "past_values_padding": torch.zeros((BATCH, c.context_length)),
                             "freq": torch.zeros((BATCH, 1), dtype=torch.long)},
    "timesfm2_5": lambda c, g: {"past_values": torch.randn((BATCH, c.context_length), generator=g),
                                "past_values_padding": torch.zeros((BATCH, c.context_length))},
    "layoutlmv3": lambda c, g: _layout(c, g, 1000, image=True),
    "lilt": lambda c, g: _layout(c, g, 1000),
    "bros": lambda c, g: _layout(c, g),
    "udop": lambda c, g: _layout(c, g, image=True),
    # a waveform, and the decoder's inputs given (its config has no pad id to shift the labels with)
    "speech-encoder-decoder": lambda c, g: {"inputs": torch.randn((BATCH, AUDIO_SAMPLES), generator=g),
                                            "decoder_input_ids": _ids(c.decoder, g)},
    # text and 4 detected objects: their features and boxes
    "lxmert": lambda c, g: {"input_ids": _ids(c, g), "visual_feats": torch.randn((BATCH, 4, c.visual_feat_dim),
                                                                             generator=g),
                           "visual_pos": torch.rand((BATCH, 4, c.visual_pos_dim), generator=g)},
    "siglip2": _siglip2,
    "siglip2_vision_model": _siglip2,
    "pix2struct": _pix2struct,
    "pix2struct_vision_model": _pix2struct,
    "blip-2": _blip2,
    "instructblip": _blip2,
    "instructblipvideo": lambda c, g: _blip2(c, g, frames=FRAMES),
    # the Q-Former alone: its queries and the image features they attend to
    "blip_2_qformer": lambda c, g: {"query_embeds": torch.randn((BATCH, 4, c.hidden_size), generator=g),
                                    "encoder_hidden_states": torch.randn((BATCH, SEQ, c.encoder_hidden_size),
                                                                         generator=g)},
    "kosmos-2": _kosmos2,
    # IDEFICS: one image per text, which every token attends to
    "idefics": lambda c, g: {"input_ids": _ids(c, g), "pixel_values": torch.randn(
        (BATCH, 1, 3, c.vision_config.image_size, c.vision_config.image_size), generator=g),
        "image_attention_mask": torch.ones((BATCH, SEQ, 1), dtype=torch.long)},
    "clap": lambda c, g: {"input_ids": _ids(c, g), **_clap_audio(c, g), "return_loss": True},
    "clap_audio_model": _clap_audio,
    # OmDet-Turbo: images, two class names each (a row of ids a class) and a task prompt each
    "omdet-turbo": lambda c, g: {
        "pixel_values": torch.randn((BATCH, 3, IMAGE, IMAGE), generator=g),
        "classes_input_ids": torch.randint(3, c.text_config.vocab_size, (2 * BATCH, 8), generator=g),
        "classes_attention_mask": torch.ones((2 * BATCH, 8), dtype=torch.long),
        "tasks_input_ids": torch.randint(3, c.text_config.vocab_size, (BATCH, 8), generator=g),
        "tasks_attention_mask": torch.ones((BATCH, 8), dtype=torch.long),
        "classes_structure": torch.full((BATCH,), 2)},
    "depth_pro": lambda c, g: {"pixel_values": torch.randn((BATCH, 3, 4 * c.patch_size, 4 * c.patch_size),
                                                           generator=g)},
    # image pairs to match: (batch, 2, channels, height, width)
    "superglue": lambda c, g: {"pixel_values": torch.randn((BATCH, 2, 3, IMAGE, IMAGE), generator=g)},
    "lightglue": lambda c, g: {"pixel_values": torch.randn((BATCH, 2, 3, IMAGE, IMAGE), generator=g)},
    "efficientloftr": lambda c, g: {"pixel_values": torch.randn((BATCH, 2, 3, 2 * IMAGE, 2 * IMAGE), generator=g)},
    # Mllama's vision tower: one image of one tile (aspect ratio id 1: 1 x 1) per sample, padded to its tiles
    "mllama_vision_model": lambda c, g: {
        "pixel_values": torch.randn((BATCH, 1, c.max_num_tiles, c.num_channels, c.image_size, c.image_size),
                                    generator=g),
        "aspect_ratio_ids": torch.ones((BATCH, 1), dtype=torch.long),
        "aspect_ratio_mask": torch.tensor([[[1] + [0] * (c.max_num_tiles - 1)]] * BATCH)},
    **{t: lambda c, g: {"pixel_values": torch.randn((BATCH, 3, 64, 64), generator=g)}
       for t in ("sam2", "sam2_vision_model", "sam2_hiera_det_model")},
    # SAM 3: images and the text prompt naming what to segment
    **{t: lambda c, g: {"pixel_values": torch.randn((BATCH, 3, c.vision_config.image_size, c.vision_config.image_size),
                                                    generator=g), "input_ids": _ids(c.text_config, g),
                        "attention_mask": torch.ones((BATCH, SEQ), dtype=torch.long)}
       for t in ("sam3", "sam3_lite_text")},
    "fastspeech2_conformer": _fastspeech2,
    "fastspeech2_conformer_with_hifigan": _fastspeech2,
    # an image (its 16 pooled tokens in the text) and the policy text it is judged against
    "shieldgemma2": lambda c, g: {"pixel_values": torch.randn((BATCH, 3, IMAGE, IMAGE), generator=g),
                                  "input_ids": _image_tokens(c, g, c.image_token_index, c.mm_tokens_per_image)},
    # sub-models read alone, whose forward names its input hidden_states: images (Florence-2's DaViT), a
    # waveform (VibeVoice's encoder), latents channels first (its decoder), features (Granite Speech's, Phi-4's)
    "florence_vision": lambda c, g: {"hidden_states": torch.randn((BATCH, 3, IMAGE, IMAGE), generator=g)},
    "vibevoice_acoustic_tokenizer_encoder": lambda c, g: {
        "hidden_states": torch.randn((BATCH, c.channels, AUDIO_SAMPLES), generator=g)},
    "vibevoice_acoustic_tokenizer_decoder": lambda c, g: {"hidden_states": torch.randn((BATCH, c.hidden_size, SEQ),
                                                                                      generator=g)},
    **{t: lambda c, g: {"hidden_states": torch.randn((BATCH, 4 * SEQ, c.input_dim), generator=g)}
       for t in ("granite_speech_encoder", "granite_speech_plus_encoder")},
    "phi4_multimodal_audio": lambda c, g: {"hidden_states": torch.randn((BATCH, 4 * SEQ, c.input_size), generator=g),
                                           "mask": None},
    # MiniCPM-V's vision tower: its images' patches packed in one row (a batch of one), each image's grid of them
    **{t: lambda c, g: {"pixel_values": torch.randn((1, c.num_channels, c.patch_size,
                                                     BATCH * (IMAGE // c.patch_size) ** 2 * c.patch_size), generator=g),
                        "target_sizes": torch.tensor([[IMAGE // c.patch_size] * 2] * BATCH)}
       for t in ("minicpm_ocr_vision", "minicpmv4_6_vision", "minicpmv4_7_vision")},
    # DeepSeek-OCR 2's vision encoder alone: its image tokens (attended both ways) then its queries (causally)
    "deepseek_ocr2_encoder": lambda c, g: {"inputs_embeds": torch.randn((BATCH, SEQ, c.hidden_size), generator=g),
                                           "num_patches": SEQ // 2},
    # PP-OCR's recognisers: a text line of 48 x 128 (their pooling of (3, 2) reads a map 3 high at least; the
    # mobile one's default backbone strides 32 down, not 16: 96 high)
    **{t: lambda c, g: {"pixel_values": torch.randn((BATCH, 3, 48, 4 * IMAGE), generator=g)}
       for t in ("pp_ocrv5_server_rec", "pp_ocrv6_small_rec", "pp_ocrv6_tiny_rec")},
    "pp_ocrv5_mobile_rec": lambda c, g: {"pixel_values": torch.randn((BATCH, 3, 96, 4 * IMAGE), generator=g)},
    # Molmo 2's vision tower: each image's flattened patches; the composite: text, its tokens' kinds (all text)
    "molmo2_vision": lambda c, g: {"pixel_values": torch.randn((BATCH, c.num_position_embeddings,
                                                                c.num_channels * c.patch_size ** 2), generator=g)},
    "molmo2": lambda c, g: {"input_ids": _ids(c, g), "attention_mask": torch.ones((BATCH, SEQ), dtype=torch.long),
                            "mm_token_type_ids": torch.zeros((BATCH, SEQ), dtype=torch.long)},
    "gemma4_vision": _gemma4_vision,
    # its subsampling's first channels count its mel bins (its projection's width is derived from them)
    "gemma4_audio": lambda c, g: {"input_features": torch.randn((BATCH, 4 * SEQ, c.subsampling_conv_channels[0]),
                                                                generator=g)},
    # Inkling's vision tower: patches as (frames, height, width, channels) it folds layer by layer; its audio
    # tower: a token per mel bin per frame
    "inkling_vision": lambda c, g: {"pixel_values": torch.randn(
        (4 * BATCH, c.temporal_patch_size, c.patch_size, c.patch_size, c.num_channels), generator=g)},
    "inkling_audio": lambda c, g: {"audio_input_ids": torch.randint(0, c.mel_vocab_size, (BATCH, SEQ, c.n_mel_bins),
                                                                    generator=g)},
    # Inkling 2's: a merged token's patches a row, its grid counted in merged tokens
    "inkling2_vision": lambda c, g: {
        "pixel_values": torch.rand((BATCH * (IMAGE // c.patch_size // c.spatial_merge_size) ** 2,
                                    c.patch_size * c.spatial_merge_size, c.patch_size * c.spatial_merge_size,
                                    c.num_channels), generator=g) * 2 - 1,
        "image_grid_thw": torch.tensor([[1] + [IMAGE // c.patch_size // c.spatial_merge_size] * 2] * BATCH)},
    # PaddleOCR-VL's vision tower: one sequence of its images' patches, each (channels, patch, patch)
    "paddleocr_vl_vision": lambda c, g: dict(zip(("pixel_values", "grid_thw"), (lambda p, t: (
        p.reshape(1, p.shape[0], c.num_channels, c.patch_size, c.patch_size), t))(*grid_patches(c, g)))),
    # Granite Speech 5's encoder: mel frames with their deltas, stacked in pairs (4 x its mel bins a row)
    **{t: lambda c, g: {"input_features": torch.randn((BATCH, 4 * SEQ, 4 * _first(c, "num_mel_bins")), generator=g)}
       for t in ("granite_speech5_encoder", "granite_speech5_ctc")},
    # Qwen2.5-Omni's vocoder: log mel frames, bins first
    "qwen2_5_omni_bigvgan": lambda c, g: {"mel_spectrogram": torch.randn((BATCH, c.mel_dim, SEQ), generator=g)},
    "pi0": _pi0,
    "pi05": _pi0,
    **{t: _sam3_detr for t in ("sam3_detr_encoder", "sam3_lite_text_detr_encoder")},
    **{t: lambda c, g: _sam3_detr(c, g, decoder=True) for t in ("sam3_detr_decoder", "sam3_lite_text_detr_decoder")},
    # its text encoder alone (its class names pixel_values its main input, as SAM 3's image model's)
    "sam3_lite_text_text_model": lambda c, g: {"input_ids": _ids(c, g),
                                               "attention_mask": torch.ones((BATCH, SEQ), dtype=torch.long)},
    # text and its audio, streamed: audio_length_per_tok mel frames (bins first) a text token
    "voxtral_realtime": lambda c, g: {"input_ids": _ids(c, g), "input_features": torch.randn(
        (BATCH, c.audio_config.num_mel_bins, c.audio_length_per_tok * SEQ), generator=g)},
    # SegGPT: the input, a prompt image and the prompt's mask (as an image)
    "seggpt": lambda c, g: {k: torch.randn((BATCH, 3, IMAGE, IMAGE), generator=g)
                            for k in ("pixel_values", "prompt_pixel_values", "prompt_masks")},
    "bridgetower_vision_model": lambda c, g: {"image": torch.randn((BATCH, 3, c.image_size, c.image_size),
                                                                   generator=g)},
    # TVP: one clip (its 2-D position embeddings view a batch of one) and its text
    "tvp": lambda c, g: {"pixel_values": torch.randn((1, c.num_frames, 3, c.max_img_size, c.max_img_size), generator=g),
                         "input_ids": torch.randint(3, c.vocab_size, (1, SEQ), generator=g)},
    # OneFormer: images and the task's prompt ("the task is semantic") as token ids
    "oneformer": lambda c, g: {"pixel_values": torch.randn((BATCH, 3, IMAGE, IMAGE), generator=g),
                               "task_inputs": torch.randint(3, c.text_encoder_vocab_size, (BATCH, c.task_seq_len),
                                                            generator=g)},
    # X-CLIP's vision tower alone: the clips' frames as one batch of images
    "xclip_vision_model": lambda c, g: {"pixel_values": torch.randn((BATCH * c.num_frames, c.num_channels,
                                                                     c.image_size, c.image_size), generator=g)},
    "audio-spectrogram-transformer": lambda c, g: {"input_values": torch.randn((BATCH, c.max_length, c.num_mel_bins),
                                                                               generator=g)},
}
"""model type -> the batch's main inputs (labels are added as for any model)."""


# --- batches ------------------------------------------------------------------------------------

def _sub(config: Any, name: str) -> Any:
    for key in ("vision_config", "audio_config", "encoder_config", "encoder"):
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, name):
            return getattr(sub, name)
    return getattr(config, name, None)


def _first(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = _sub(config, name)
        if value is not None:
            return value
    return default


def _ids(config: Any, generator: torch.Generator, length: int = SEQ) -> torch.Tensor:
    vocab = _first(config, "vocab_size", default=VOCAB)
    text = getattr(config, "text_config", None)
    if text is not None and getattr(text, "vocab_size", None):
        vocab = text.vocab_size
    allowed = torch.tensor([i for i in range(3, vocab) if i not in special_ids(config)] or [0])
    return allowed[torch.randint(0, len(allowed), (BATCH, length), generator=generator)]


def _int(value: Any) -> Any:
    return value[0] if isinstance(value, (list, tuple)) and value else value


def grid_patches(config: Any, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A vision tower's flattened patches and their grid (Qwen2-VL's and its kin's): ``BATCH``
    images, each one frame of `IMAGE` square cut in patches of the config's size (a side of whole
    merges where it merges patches), as (images, 3) rows of t, h, w and (patches, channels x
    temporal patch x patch x patch) values."""
    patch = _int(_first(config, "patch_size", default=PATCH))
    temporal = _int(_first(config, "temporal_patch_size", "patch_temporal", default=1))
    channels = _first(config, "in_channels", "num_channels", "in_chans", default=3)
    merge = _int(_first(config, "spatial_merge_size", "merge_size", "merge_kernel_size", default=1)) or 1
    side = max(merge, IMAGE // patch // merge * merge)
    grid = torch.tensor([[1, side, side]] * BATCH)
    return torch.randn((BATCH * side * side, channels * temporal * patch * patch), generator=generator), grid


def make_batch(model_type: str, model: nn.Module, config: Any, task: str, generator: torch.Generator,
               *, towers: bool = True) -> dict[str, Any]:
    """The batch from the model's main input name and forward signature; ``towers``: a model
    that takes token ids and images (CLIP's two towers) gets both."""
    params = inspect.signature(model.forward).parameters
    main = getattr(model, "main_input_name", "input_ids")
    batch: dict[str, Any] = {}

    def images() -> torch.Tensor:
        size = _first(config, "image_size", default=IMAGE)
        size = size[0] if isinstance(size, (list, tuple)) else size
        channels = _first(config, "num_channels", default=3)
        return torch.randn((BATCH, channels, size, size), generator=generator)

    def videos() -> torch.Tensor:  # (batch, frames, channels, height, width)
        frames = _first(config, "num_frames", "frames_per_clip", default=FRAMES)
        return images().unsqueeze(1).expand(-1, frames, -1, -1, -1).clone() + torch.randn(
            (BATCH, frames, 1, 1, 1), generator=generator)

    grid = next((n for n in ("grid_thw", "image_grid_thw") if n in params
                 and params[n].default is inspect.Parameter.empty), None)
    if model_type in BATCH_OVERRIDES:
        batch.update(BATCH_OVERRIDES[model_type](config, generator))
    elif grid is not None:  # a vision tower of flattened patches: they are its hidden states or its pixels
        patches, batch[grid] = grid_patches(config, generator)
        batch["hidden_states" if "hidden_states" in params else "pixel_values"] = patches
        if "merge_sizes" in params and params["merge_sizes"].default is inspect.Parameter.empty:  # VideoLLaMA 3's
            merge = _int(_first(config, "spatial_merge_size", "merge_size", "merge_kernel_size", default=1)) or 1
            batch["merge_sizes"] = torch.full((BATCH,), merge)
    elif main == "pixel_values_videos":
        batch["pixel_values_videos"] = videos()
    elif main == "pixel_values" and _first(config, "num_frames", "frames_per_clip") is not None:
        batch["pixel_values"] = videos()  # a video model's clip (VideoMAE, ViViT, TimeSformer)
    elif main == "pixel_values" or ("pixel_values" in params and "input_ids" not in params):
        batch["pixel_values"] = images()
    elif main == "spectrogram":  # a vocoder (HiFi-GAN): mel frames
        bins = _first(config, "model_in_dim", "num_mel_bins", default=16)
        batch["spectrogram"] = torch.randn((BATCH, SEQ, bins), generator=generator)
    elif main == "input_values":
        batch["input_values"] = torch.randn((BATCH, AUDIO_SAMPLES), generator=generator)
    elif main == "input_features" and _first(config, "num_mel_bins") and _first(config, "max_source_positions"):
        # a Whisper-like encoder: mel bins as channels, twice its positions of frames (its two convolutions)
        frames = 2 * _first(config, "max_source_positions")
        batch["input_features"] = torch.randn((BATCH, _first(config, "num_mel_bins"), frames), generator=generator)
    elif main == "input_features":
        bins = _first(config, "num_mel_bins", "feature_size", "input_feat_per_channel", default=16)
        batch["input_features"] = torch.randn((BATCH, 4 * SEQ, bins), generator=generator)
    else:
        ids = _ids(config, generator)
        batch["input_ids"] = ids
        if "attention_mask" in params:
            mask = torch.ones_like(ids)
            mask[-1, -1] = 0  # one padded token: models build a mask tensor every layer takes
            batch["attention_mask"] = mask
        if towers and "pixel_values" in params:
            batch["pixel_values"] = videos() if _first(config, "num_frames") is not None else images()
        if "return_loss" in params:
            batch["return_loss"] = True
    features = batch.get("input_features")
    if "feature_lens" in params and isinstance(features, torch.Tensor) and features.dim() == 3:
        # packed audio (Qwen2.5-Omni's encoder): the clips' frames end to end, and each clip's length
        batch["input_features"] = features.transpose(0, 1).reshape(features.shape[1], -1)
        batch["feature_lens"] = torch.full((BATCH,), features.shape[2], dtype=torch.long)
    required = {n for n, p in params.items() if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    width = _first(config, "hidden_size", "d_model", "embed_dim", default=HIDDEN)
    floats = [n for n in ("hidden_states", "inputs_embeds", "latents", "context") if n in required and n not in batch]
    for name in floats:  # a sub-model read alone: the states its composite would pass it
        shape = (BATCH, width, SEQ) if name == "latents" else (BATCH, SEQ, width)  # a codec's latents: channels first
        batch[name] = torch.randn(shape, generator=generator)
    if floats and "input_ids" not in params:
        batch.pop("input_ids", None)
        batch.pop("attention_mask", None)
    if floats and "attention_mask" in params and "attention_mask" not in batch:
        batch["attention_mask"] = torch.ones((BATCH, SEQ), dtype=torch.long)
    for name in required - batch.keys():  # an argument it must be given, which may be None (Phi-4's audio mask)
        if "None" in str(params[name].annotation):
            batch[name] = None
    if "input_values" in required and "input_values" not in batch:  # text and audio (PE Audio's two towers)
        batch["input_values"] = torch.randn((BATCH, AUDIO_SAMPLES), generator=generator)
    features = batch.get("input_features")
    if "input_features_mask" in params and isinstance(features, torch.Tensor) and features.dim() == 3 and (
            "input_features_mask" in required or model_type in FEATURE_MASKS):  # every frame real
        bins = _first(config, "num_mel_bins", "feature_size", default=None)
        frames = features.shape[2] if features.shape[1] == bins else features.shape[1]  # bins first (Whisper's)
        batch["input_features_mask"] = torch.ones((features.shape[0], frames), dtype=torch.long)
    if "input_ids" in required and "input_ids" not in batch:  # BLIP-2: images and the text they answer
        batch["input_ids"] = _ids(config, generator)
    if "pixel_values" in required and "pixel_values" not in batch:
        batch["pixel_values"] = videos() if _first(config, "num_frames") is not None else images()
    if "pixel_values_videos" in required and "pixel_values_videos" not in batch:
        batch["pixel_values_videos"] = videos()
    if "decoder_input_ids" in params and "decoder_input_ids" not in batch \
            and task not in ("seq_to_seq_causal_lm", "speech_seq_2_seq"):  # unless its batch override made them
        batch["decoder_input_ids"] = _ids(config, generator)
    if "labels" in params:
        if task in ("causal_lm", "masked_lm") and "input_ids" in batch:
            batch["labels"] = batch["input_ids"].clone()
        elif task in ("seq_to_seq_causal_lm", "speech_seq_2_seq", "causal_lm"):
            batch["labels"] = _ids(config, generator)
        elif task in ("image_classification", "audio_classification"):
            batch["labels"] = torch.randint(0, NUM_LABELS, (BATCH,), generator=generator)
        elif task == "ctc":
            vocab = _first(config, "vocab_size", default=VOCAB)
            batch["labels"] = torch.randint(1, vocab, (BATCH, 4), generator=generator)
    return batch


FEATURE_MASKS = frozenset({"audioflamingo3_encoder"})
"""Types whose forward takes its features' mask as optional but fails without it."""


MAIN_OUTPUTS = ("last_hidden_state", "logits", "logits_per_image", "prediction_logits", "audio_values",
                "reconstruction", "predicted_depth", "pooler_output")
"""Outputs the loss is made of first, where the model returns one: the first floating output may be
a side one no layer feeds (Deformable DETR's reference points come before its hidden states)."""


def loss_fn(output: Any, batch: Any) -> torch.Tensor:
    """The output's ``.loss`` where labels were given and it is a scalar; else the mean of squares
    of its main output (`MAIN_OUTPUTS`), or of the first floating output a gradient flows from."""
    loss = getattr(output, "loss", None) if not isinstance(output, dict) else output.get("loss")
    if isinstance(batch, dict) and "labels" in batch and isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.reshape(())
    if isinstance(output, dict):
        main = [output[k] for k in MAIN_OUTPUTS if isinstance(output.get(k), torch.Tensor)
                and output[k].is_floating_point() and output[k].requires_grad]
        if main:
            return main[0].float().pow(2).mean()
    from remat.verify import _float_tensors  # the floating tensors of an output, nested as verify reads them

    tensors = [t for t in _float_tensors(output) if t.requires_grad] or _float_tensors(output)
    if not tensors:
        raise TypeError(f"no floating output to make a loss of: {type(output).__name__}")
    return tensors[0].float().pow(2).mean()


class _NoCache:
    """A cache that keeps nothing: OmDet-Turbo's text embeddings made afresh each step (its LRU cache keeps
    them with their graph across steps, which a second backward then runs through: training turns it off)."""

    def has(self, key: Any) -> bool:
        return False

    def get(self, key: Any) -> None:
        return None

    def put(self, key: Any, value: Any) -> None:
        pass


def _omdet_turbo(model: nn.Module) -> None:
    for module in model.modules():
        for name in ("language_cache_class", "language_cache_prompt"):
            if hasattr(module, name):
                setattr(module, name, _NoCache())


AFTER_INIT: dict[str, Callable[[nn.Module], None]] = {"omdet-turbo": _omdet_turbo}
"""model type -> what training it needs done to the model built (a cache across steps turned off)."""


@dataclass(kw_only=True)
class Built:
    model_type: str
    task: str
    class_name: str
    model: nn.Module
    batch: dict[str, Any]
    config: Any


def experts_kernel(model: nn.Module, kernel: str) -> None:
    """Run the experts of ``model``'s Hugging Face MoE layers with ``kernel``: ``grouped_mm`` (the
    default: every expert in one call on the tokens sorted by expert), ``batched_mm`` or ``eager``
    (a loop over the experts, each on the tokens routed to it)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_experts_implementation"):
            config._experts_implementation = kernel


def seed(value: int = 0) -> None:
    random.seed(value)
    torch.manual_seed(value)
    try:
        import numpy

        numpy.random.seed(value)
    except ImportError:  # pragma: no cover
        pass


BASE_KEYS = frozenset({"transformers_version", "architectures", "output_hidden_states", "return_dict", "dtype",
                       "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type"})


def _init_keys(config_cls: type) -> set[str] | None:
    """The keyword arguments ``config_cls`` takes by name; None where it takes them all as ``**kwargs``."""
    names = {n for n, p in inspect.signature(config_cls.__init__).parameters.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}
    return names if names - BASE_KEYS else None


def as_kwargs(config_cls: type, shrunk: dict[str, Any]) -> dict[str, Any]:
    """``shrunk`` cut to what ``config_cls`` takes as arguments (values it derives in its
    ``__init__``, such as Swin's ``num_layers`` from its depths, are derived again), sub-configs alike."""
    import transformers
    from transformers.backbone_utils import BackboneConfigMixin

    keys = _init_keys(config_cls)
    if keys is not None and issubclass(config_cls, BackboneConfigMixin) \
            and shrunk.get("out_features") != config_cls().out_features:
        # a backbone's stages out that its parent or an override chose (its __post_init__ takes them from its
        # kwargs); its own default, its last stage, is derived again from its shrunk stages
        keys.add("out_features")
    out = {}
    for key, value in shrunk.items():
        if keys is not None and key not in keys:
            continue
        if key in ("id2label", "label2id", "transformers_version", "architectures"):
            continue
        if isinstance(value, dict) and value.get("model_type") in transformers.CONFIG_MAPPING:
            value = {"model_type": value["model_type"],
                     **as_kwargs(transformers.CONFIG_MAPPING[value["model_type"]], value)}
        out[key] = value
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _set_untaken(config: Any, overrides: dict[str, Any], taken: dict[str, Any]) -> None:
    """Overrides a config class does not take as arguments set on the built config, sub-configs
    alike, as a user would (a sub-config read alone: what its composite config would set on it)."""
    for key, value in overrides.items():
        sub = getattr(config, key, None)
        if isinstance(value, dict) and hasattr(sub, "to_dict"):
            _set_untaken(sub, value, taken.get(key) if isinstance(taken.get(key), dict) else {})
        elif key not in taken:
            setattr(config, key, value)


def tiny_config(model_type: str) -> Any:
    """The default config of ``model_type`` shrunk (`shrink`), with the type's `OVERRIDES`."""
    import transformers

    config_cls = transformers.CONFIG_MAPPING[CONFIG_TYPES.get(model_type, model_type)]
    shrunk = _merge(shrink(config_cls(**copy.deepcopy(DEFAULTS.get(model_type, {}))).to_dict()),
                    OVERRIDES.get(model_type, {}))
    kwargs = as_kwargs(config_cls, shrunk)
    config = config_cls(**kwargs)
    _set_untaken(config, OVERRIDES.get(model_type, {}), kwargs)
    config.num_labels = NUM_LABELS
    if getattr(config, "is_encoder_decoder", False) and getattr(config, "decoder_start_token_id", None) is None:
        pad = getattr(config, "pad_token_id", None)
        config.decoder_start_token_id = pad if isinstance(pad, int) else 0
    return config


def build(model_type: str) -> Built:
    """A tiny model of ``model_type`` that ran two plain forwards and backwards, with its batch;
    raises (the last candidate class's error) when none does."""
    config = tiny_config(model_type)
    candidates = model_classes(model_type)
    if not candidates:
        raise LookupError(f"no model class for {model_type!r} in the task mappings")
    error: BaseException | None = None
    for task, cls in candidates:
        for towers, channel in ((True, False), (False, False), (False, True)):
            try:
                seed(0)
                try:
                    model = cls._from_config(copy.deepcopy(config), attn_implementation="eager")
                except (ValueError, TypeError):
                    model = cls._from_config(copy.deepcopy(config))
                AFTER_INIT.get(model_type, lambda m: None)(model)
                model.train()
                batch = make_batch(model_type, model, model.config, task, torch.Generator().manual_seed(0),
                                   towers=towers)
                if channel:  # a codec's waveform: (batch, channels, samples); features' bins first; patches as images
                    if "input_values" in batch and batch["input_values"].dim() == 2:
                        batch["input_values"] = batch["input_values"].unsqueeze(1)
                    elif isinstance(batch.get("input_features"), torch.Tensor) and batch["input_features"].dim() == 3:
                        # mel bins as a convolution's channels (GLM-ASR's, Voxtral Realtime's encoders)
                        batch["input_features"] = batch["input_features"].transpose(1, 2).contiguous()
                    elif any(k in batch for k in ("grid_thw", "image_grid_thw")) and "pixel_values" in batch:
                        channels = _first(model.config, "in_channels", "num_channels", "in_chans", default=3)
                        patch = _int(_first(model.config, "patch_size", default=PATCH))
                        batch["pixel_values"] = batch["pixel_values"].reshape(-1, channels, patch, patch)
                    else:
                        continue
                seed(0)
                loss = loss_fn(model(**batch), batch)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"the plain step's loss is {loss.item()}")
                loss.backward()
                if not any(p.grad is not None for p in model.parameters()):
                    raise RuntimeError("no parameter gets a gradient")
                model.zero_grad(set_to_none=True)
                seed(0)  # a second step: a model that keeps a graph across steps (OmDet-Turbo's cache of text
                loss_fn(model(**batch), batch).backward()  # embeddings, unless turned off) cannot train, remat or not
                model.zero_grad(set_to_none=True)
                return Built(model_type=model_type, task=task, class_name=cls.__name__, model=model, batch=batch,
                             config=model.config)
            except Exception as e:  # noqa: BLE001 - the next class may run
                error = error if error is not None and not towers else e
    assert error is not None
    raise error
