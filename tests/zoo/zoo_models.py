"""The model zoo: tiny Hugging Face models built from configs (random weights, no download) and
the built-in U-Net, each with a batch made in code, and the stacks remat must find in each."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.models import build

HIDDEN = 32
HEADS = 2
FFN = 64
VOCAB = 64
SEQ = 32
BATCH = 4


@dataclass(kw_only=True, frozen=True)
class ZooModel:
    """A zoo model ready to profile."""

    name: str
    model: nn.Module
    batch: Any
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    optimizer: torch.optim.Optimizer | None
    stacks: tuple[tuple[str, int], ...]
    """The stacks auto discovery must find, in run order: (name, number of blocks)."""
    hf_checkpointing: bool
    """Hugging Face's ``gradient_checkpointing_enable()`` supports the model."""


def _ids(generator: torch.Generator, length: int = SEQ) -> torch.Tensor:
    return torch.randint(3, VOCAB, (BATCH, length), generator=generator)


def _mask(ids: torch.Tensor) -> torch.Tensor:
    """Ones but the last token of the last sequence (padding): models then build a mask tensor
    that every layer takes, instead of skipping it."""
    mask = torch.ones_like(ids)
    mask[-1, -1] = 0
    return mask


def _lm_batch(generator: torch.Generator) -> dict[str, torch.Tensor]:
    ids = _ids(generator)
    return {"input_ids": ids, "attention_mask": _mask(ids), "labels": ids.clone()}


def _images(generator: torch.Generator, size: int = 32) -> torch.Tensor:
    return torch.randn((BATCH, 3, size, size), generator=generator)


def _decoder(config_cls: str, **extra: Any) -> Callable[[], tuple[nn.Module, Callable]]:
    """A causal LM of ``config_cls``: 2 layers, eager attention (its mask is a tensor every layer takes)."""

    def make() -> tuple[nn.Module, Callable]:
        import transformers

        config = getattr(transformers, config_cls)(
            hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=FFN,
            vocab_size=VOCAB, max_position_embeddings=4 * SEQ, use_cache=False, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, **extra)
        config._attn_implementation = "eager"
        model_cls = getattr(transformers, config_cls.replace("Config", "ForCausalLM"))
        return model_cls(config), _lm_batch

    return make


def _bert() -> tuple[nn.Module, Callable]:
    import transformers

    config = transformers.BertConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
                                     intermediate_size=FFN, vocab_size=VOCAB, max_position_embeddings=4 * SEQ)
    config._attn_implementation = "eager"
    return transformers.BertForMaskedLM(config), _lm_batch


def _t5() -> tuple[nn.Module, Callable]:
    import transformers

    config = transformers.T5Config(d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN, num_layers=2, num_decoder_layers=2,
                                   num_heads=HEADS, vocab_size=VOCAB, use_cache=False, decoder_start_token_id=0)
    config._attn_implementation = "eager"

    def batch(generator: torch.Generator) -> dict[str, torch.Tensor]:
        ids = _ids(generator)
        return {"input_ids": ids, "attention_mask": _mask(ids), "labels": _ids(generator)}

    return transformers.T5ForConditionalGeneration(config), batch


def _vit() -> tuple[nn.Module, Callable]:
    import transformers

    config = transformers.ViTConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
                                    intermediate_size=FFN, image_size=32, patch_size=4, num_labels=3)
    config._attn_implementation = "eager"
    return transformers.ViTForImageClassification(config), lambda g: {
        "pixel_values": _images(g), "labels": torch.randint(0, 3, (BATCH,), generator=g)}


def _whisper() -> tuple[nn.Module, Callable]:
    import transformers

    config = transformers.WhisperConfig(
        d_model=HIDDEN, encoder_layers=2, decoder_layers=2, encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, vocab_size=VOCAB, num_mel_bins=8,
        max_source_positions=SEQ, max_target_positions=4 * SEQ, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1, use_cache=False)
    config._attn_implementation = "eager"
    return transformers.WhisperForConditionalGeneration(config), lambda g: {
        "input_features": torch.randn((BATCH, 8, 2 * SEQ), generator=g), "labels": _ids(g)}


def _clip() -> tuple[nn.Module, Callable]:
    import transformers

    config = transformers.CLIPConfig(
        text_config=dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=FFN,
                         vocab_size=VOCAB, max_position_embeddings=SEQ, bos_token_id=1, eos_token_id=2, pad_token_id=0),
        vision_config=dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=FFN,
                           image_size=32, patch_size=4),
        projection_dim=16)
    config._attn_implementation = "eager"

    def batch(generator: torch.Generator) -> dict[str, Any]:
        ids = _ids(generator)
        return {"input_ids": ids, "attention_mask": _mask(ids), "pixel_values": _images(generator),
                "return_loss": True}

    return transformers.CLIPModel(config), batch


def _swin() -> tuple[nn.Module, Callable]:
    import transformers

    config = transformers.SwinConfig(image_size=32, patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[2, 2],
                                     window_size=2, num_labels=3)
    config._attn_implementation = "eager"
    return transformers.SwinForImageClassification(config), lambda g: {
        "pixel_values": _images(g), "labels": torch.randint(0, 3, (BATCH,), generator=g)}


def _funnel() -> tuple[nn.Module, Callable]:
    """Layers in a list of plain lists (one per pooling block of the encoder)."""
    import transformers

    config = transformers.FunnelConfig(d_model=HIDDEN, n_head=HEADS, d_head=HIDDEN // HEADS, d_inner=FFN,
                                       block_sizes=[1, 1], num_decoder_layers=2, vocab_size=VOCAB)
    config._attn_implementation = "eager"
    return transformers.FunnelForMaskedLM(config), lambda g: (lambda ids: {"input_ids": ids, "labels": ids.clone()})(_ids(g))


def _jamba() -> tuple[nn.Module, Callable]:
    """A hybrid: a Mamba layer, then an attention layer with a mixture of experts, in one list."""
    import transformers

    config = transformers.JambaConfig(
        hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=1, intermediate_size=FFN,
        vocab_size=VOCAB, num_experts=2, num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
        use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "eager"
    return transformers.JambaForCausalLM(config), _lm_batch


def _wav2vec2() -> tuple[nn.Module, Callable]:
    """CTC on raw audio: a convolutional feature extractor, LayerDrop, SpecAugment masks drawn
    with NumPy, and a loss whose forward needs more than its backward."""
    import transformers

    config = transformers.Wav2Vec2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=FFN,
        conv_dim=(16, 16, 16), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, mask_time_prob=0.2, mask_time_length=2, layerdrop=0.1, pad_token_id=0)
    config._attn_implementation = "eager"
    return transformers.Wav2Vec2ForCTC(config), lambda g: {
        "input_values": torch.randn((BATCH, 1600), generator=g), "labels": torch.randint(1, VOCAB, (BATCH, 6), generator=g)}


def _beit() -> tuple[nn.Module, Callable]:
    """Relative position bias: an index table built once and cached, which attention saves."""
    import transformers

    config = transformers.BeitConfig(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
                                     intermediate_size=FFN, image_size=32, patch_size=4, num_labels=3,
                                     use_relative_position_bias=True)
    config._attn_implementation = "eager"
    return transformers.BeitForImageClassification(config), lambda g: {
        "pixel_values": _images(g), "labels": torch.randint(0, 3, (BATCH,), generator=g)}


def _detr() -> tuple[nn.Module, Callable]:
    """Object detection with a frozen backbone stage: DETR freezes its ResNet's stem and first
    stage, so no gradient reaches those blocks and they have no backward; set-matching loss."""
    import transformers

    backbone = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic",
                                         out_features=["stage1", "stage2"])
    config = transformers.DetrConfig(use_timm_backbone=False, backbone_config=backbone, use_pretrained_backbone=False,
                                     d_model=HIDDEN, encoder_layers=2, decoder_layers=2, encoder_attention_heads=HEADS,
                                     decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN,
                                     num_queries=4, num_labels=3)
    config._attn_implementation = "eager"

    def batch(g: torch.Generator) -> dict[str, Any]:
        labels = [{"class_labels": torch.randint(0, 3, (2,), generator=g),
                   "boxes": torch.rand(2, 4, generator=g) * 0.5 + 0.25} for _ in range(BATCH)]
        return {"pixel_values": _images(g), "labels": labels}

    return transformers.DetrForObjectDetection(config), batch


ZOO: dict[str, tuple[Callable[[], tuple[nn.Module, Callable]], tuple[tuple[str, int], ...], bool]] = {
    "bert": (_bert, (("bert.encoder.layer", 2),), True),
    "t5": (_t5, (("encoder.block", 2), ("decoder.block", 2)), True),
    "vit": (_vit, (("vit.layers", 2),), True),
    "mistral": (_decoder("MistralConfig", num_key_value_heads=1), (("model.layers", 2),), True),
    "qwen2": (_decoder("Qwen2Config", num_key_value_heads=1), (("model.layers", 2),), True),
    "mixtral": (_decoder("MixtralConfig", num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2),
                (("model.layers", 2),), True),
    "gpt_neox": (_decoder("GPTNeoXConfig"), (("gpt_neox.layers", 2),), True),
    "llama_dropout": (_decoder("LlamaConfig", attention_dropout=0.1), (("model.layers", 2),), True),
    "whisper": (_whisper, (("model.encoder.layers", 2), ("model.decoder.layers", 2)), True),
    "clip": (_clip, (("vision_model.encoder.layers", 2), ("text_model.encoder.layers", 2)), True),
    # the first stage's patch merging joins its blocks' run (`remat.measure.stacks._beside`)
    "swin": (_swin, (("swin.encoder.layers.0.blocks", 3), ("swin.encoder.layers.1.blocks", 2)), True),
    "funnel": (_funnel, (("funnel.encoder.blocks", 2), ("funnel.decoder.layers", 2)), False),
    "jamba": (_jamba, (("model.layers", 2),), True),
    "wav2vec2": (_wav2vec2, (("wav2vec2.feature_extractor.conv_layers", 3), ("wav2vec2.encoder.layers", 2)), True),
    "beit": (_beit, (("beit.layers", 2),), True),
    "granite": (_decoder("GraniteConfig", num_key_value_heads=1), (("model.layers", 2),), True),
    # its layers return their attention weights, which the model's loop holds through the next
    # layer's call (`remat.plan.phases.previous_held_bytes`)
    "gpt_neox_japanese": (_decoder("GPTNeoXJapaneseConfig", intermediate_multiple_size=2, hidden_dropout=0.0,
                                   attention_dropout=0.0), (("gpt_neox_japanese.layers", 2),), False),
    # the second stage's projection shortcut joins its layers' run (`remat.measure.stacks._beside`)
    "detr": (_detr, (("model.backbone.model.encoder.stages.0.layers.0.layer", 2),
                     ("model.backbone.model.encoder.stages.1.layers.0.layer", 3), ("model.encoder.layers", 2),
                     ("model.decoder.layers", 2), ("bbox_predictor.layers", 3)), True),
    "unet": (None, (("down", 3), ("up", 2)), False),
}
"""Name -> (builder, expected stacks in run order, HF checkpointing supported)."""


def build_zoo(name: str, seed: int = 0) -> ZooModel:
    """Zoo model ``name`` with deterministic weights and batch, AdamW on its parameters."""
    make, stacks, hf = ZOO[name]
    if make is None:
        built = build("unet", seed=seed, depth=3, channels=4, image_size=32, batch_size=BATCH)
        return ZooModel(name=name, model=built.model, batch=built.batch, loss_fn=built.loss_fn,
                        optimizer=built.optimizer, stacks=stacks, hf_checkpointing=hf)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, make_batch = make()
    model.train()
    batch = make_batch(torch.Generator().manual_seed(seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return ZooModel(name=name, model=model, batch=batch, loss_fn=None, optimizer=optimizer, stacks=stacks,
                    hf_checkpointing=hf)
