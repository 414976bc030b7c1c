"""Tiny diffusers models from configs: U-Nets (2D, conditional, 1D, 3D), a ControlNet, two
autoencoders and eleven diffusion transformers, random weights (every parameter diffusers
initialises to zero drawn small, so that every gradient is exercised), batches made in code,
nothing downloaded. diffusers is no dependency of remat: `build` raises ImportError without it
(``pip install --no-deps diffusers`` beside transformers suffices)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _tensors(x: Any):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)
    elif hasattr(x, "values"):
        for y in x.values():
            yield from _tensors(y)
    elif hasattr(x, "sample"):
        yield from _tensors(x.sample)


def loss_fn(out: Any, _batch: Any) -> torch.Tensor:
    """Mean square of every output tensor that needs a gradient (a U-Net's sample, a ControlNet's
    residuals, an autoencoder's reconstruction and posterior)."""
    return sum((t.float() ** 2).mean() for t in _tensors(out) if t.requires_grad)


def _unet2dcond():
    import diffusers

    m = diffusers.UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    )
    b = {
        "sample": torch.randn(2, 4, 16, 16),
        "timestep": torch.tensor([10, 20]),
        "encoder_hidden_states": torch.randn(2, 6, 32),
    }
    return m, b


def _unet2d():
    import diffusers

    m = diffusers.UNet2DModel(
        sample_size=16,
        in_channels=3,
        out_channels=3,
        layers_per_block=2,
        block_out_channels=(16, 32, 32),
        down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
        attention_head_dim=8,
    )
    return m, {"sample": torch.randn(2, 3, 16, 16), "timestep": torch.tensor([3, 7])}


def _unet1d():
    import diffusers

    m = diffusers.UNet1DModel(
        sample_size=64,
        in_channels=2,
        out_channels=2,
        block_out_channels=(16, 32, 32),
        extra_in_channels=32,
        down_block_types=("DownBlock1DNoSkip", "DownBlock1D", "AttnDownBlock1D"),
        up_block_types=("AttnUpBlock1D", "UpBlock1D", "UpBlock1DNoSkip"),
        mid_block_type="UNetMidBlock1D",
        use_timestep_embedding=False,
        flip_sin_to_cos=False,
        time_embedding_type="fourier",
        layers_per_block=1,
    )
    return m, {"sample": torch.randn(2, 2, 64), "timestep": torch.tensor([3.0, 7.0])}


def _unet3d():
    import diffusers

    m = diffusers.UNet3DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
        up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    )
    return m, {
        "sample": torch.randn(1, 4, 3, 8, 8),
        "timestep": torch.tensor([10]),
        "encoder_hidden_states": torch.randn(1, 6, 32),
    }


def _controlnet():
    import diffusers

    m = diffusers.ControlNetModel(
        in_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
        conditioning_embedding_out_channels=(8, 16),
    )
    b = {
        "sample": torch.randn(2, 4, 16, 16),
        "timestep": torch.tensor([10, 20]),
        "encoder_hidden_states": torch.randn(2, 6, 32),
        "controlnet_cond": torch.randn(2, 3, 32, 32),
    }
    return m, b


def _vae():
    import diffusers

    m = diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(16, 32),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
    )
    return m, {"sample": torch.randn(2, 3, 32, 32)}


def _vq():
    import diffusers

    m = diffusers.VQModel(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(16, 32),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
        num_vq_embeddings=32,
        vq_embed_dim=4,
    )
    return m, {"sample": torch.randn(2, 3, 32, 32)}


def _dit():
    import diffusers

    m = diffusers.DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=8,
        num_layers=4,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=10,
    )
    return m, {
        "hidden_states": torch.randn(2, 4, 8, 8),
        "timestep": torch.tensor([1, 2]),
        "class_labels": torch.tensor([0, 3]),
    }


def _pixart():
    import diffusers

    m = diffusers.PixArtTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=8,
        num_layers=4,
        sample_size=8,
        patch_size=2,
        cross_attention_dim=32,
        caption_channels=24,
        use_additional_conditions=False,
    )
    return m, {
        "hidden_states": torch.randn(2, 4, 8, 8),
        "timestep": torch.tensor([1, 2]),
        "encoder_hidden_states": torch.randn(2, 5, 24),
        "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
    }


def _sd3():
    import diffusers

    m = diffusers.SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=4,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=32,
        caption_projection_dim=32,
        pooled_projection_dim=16,
        out_channels=4,
        pos_embed_max_size=16,
    )
    return m, {
        "hidden_states": torch.randn(2, 4, 8, 8),
        "encoder_hidden_states": torch.randn(2, 6, 32),
        "pooled_projections": torch.randn(2, 16),
        "timestep": torch.tensor([1, 2]),
    }


def _flux():
    import diffusers

    m = diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=3,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=16,
        axes_dims_rope=(4, 6, 6),
    )
    return m, {
        "hidden_states": torch.randn(1, 16, 16),
        "encoder_hidden_states": torch.randn(1, 6, 32),
        "pooled_projections": torch.randn(1, 16),
        "timestep": torch.tensor([1.0]),
        "img_ids": torch.randn(16, 3),
        "txt_ids": torch.randn(6, 3),
    }


def _sana():
    import diffusers

    m = diffusers.SanaTransformer2DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=4,
        num_cross_attention_heads=2,
        cross_attention_head_dim=8,
        cross_attention_dim=16,
        caption_channels=16,
        sample_size=8,
        patch_size=1,
    )
    return m, {
        "hidden_states": torch.randn(2, 4, 8, 8),
        "encoder_hidden_states": torch.randn(2, 5, 16),
        "timestep": torch.tensor([1, 2]),
    }


def _auraflow():
    import diffusers

    m = diffusers.AuraFlowTransformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_mmdit_layers=2,
        num_single_dit_layers=3,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        caption_projection_dim=16,
        out_channels=4,
        pos_embed_max_size=64,
    )
    return m, {
        "hidden_states": torch.randn(2, 4, 8, 8),
        "encoder_hidden_states": torch.randn(2, 5, 16),
        "timestep": torch.tensor([1, 2]),
    }


def _cogvideox():
    import diffusers

    m = diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        time_embed_dim=8,
        text_embed_dim=16,
        num_layers=4,
        sample_width=8,
        sample_height=8,
        sample_frames=9,
        patch_size=2,
        temporal_compression_ratio=4,
        max_text_seq_length=6,
    )
    return m, {
        "hidden_states": torch.randn(1, 3, 4, 8, 8),
        "encoder_hidden_states": torch.randn(1, 6, 16),
        "timestep": torch.tensor([1]),
    }


def _ltx():
    import diffusers

    m = diffusers.LTXVideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        num_layers=4,
        caption_channels=16,
    )
    return m, {
        "hidden_states": torch.randn(1, 2 * 4 * 4, 8),
        "encoder_hidden_states": torch.randn(1, 5, 16),
        "timestep": torch.tensor([1]),
        "encoder_attention_mask": torch.ones(1, 5),
        "num_frames": 2,
        "height": 4,
        "width": 4,
    }


def _wan():
    import diffusers

    m = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=16,
        freq_dim=16,
        ffn_dim=32,
        num_layers=4,
        rope_max_seq_len=32,
    )
    return m, {
        "hidden_states": torch.randn(1, 4, 2, 8, 8),
        "encoder_hidden_states": torch.randn(1, 6, 16),
        "timestep": torch.tensor([1]),
    }


def _hunyuandit():
    import diffusers

    m = diffusers.HunyuanDiT2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        patch_size=2,
        sample_size=8,
        num_layers=4,
        cross_attention_dim=16,
        cross_attention_dim_t5=16,
        pooled_projection_dim=8,
        text_len=5,
        text_len_t5=6,
        hidden_size=16,
    )
    b = {
        "hidden_states": torch.randn(2, 4, 8, 8),
        "timestep": torch.tensor([1.0, 2.0]),
        "encoder_hidden_states": torch.randn(2, 5, 16),
        "text_embedding_mask": torch.ones(2, 5),
        "encoder_hidden_states_t5": torch.randn(2, 6, 16),
        "text_embedding_mask_t5": torch.ones(2, 6),
        "image_meta_size": torch.randn(2, 6),
        "style": torch.zeros(2, dtype=torch.long),
        "image_rotary_emb": None,
    }
    return m, b


def _lumina2():
    import diffusers

    m = diffusers.Lumina2Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        hidden_size=32,
        num_layers=3,
        num_refiner_layers=1,
        num_attention_heads=2,
        num_kv_heads=2,
        multiple_of=8,
        axes_dim_rope=(4, 6, 6),
        axes_lens=(64, 16, 16),
        cap_feat_dim=16,
    )
    return m, {
        "hidden_states": torch.randn(2, 4, 8, 8),
        "timestep": torch.tensor([0.1, 0.2]),
        "encoder_hidden_states": torch.randn(2, 5, 16),
        "encoder_attention_mask": torch.ones(2, 5, dtype=torch.bool),
    }


def _qwenimage():
    import diffusers

    m = diffusers.QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=3,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(4, 6, 6),
    )
    return m, {
        "hidden_states": torch.randn(1, 16, 16),
        "encoder_hidden_states": torch.randn(1, 5, 16),
        "encoder_hidden_states_mask": torch.ones(1, 5),
        "timestep": torch.tensor([1.0]),
        "img_shapes": [(1, 4, 4)],
    }


BUILDERS: dict[str, Callable[[], tuple[torch.nn.Module, dict[str, Any]]]] = {
    name[1:]: fn
    for name, fn in list(globals().items())
    if name.startswith("_")
    and callable(fn)
    and name not in ("_tensors",)
    and getattr(fn, "__module__", None) == __name__
}
"""Model name -> builder of (model, batch of keyword arguments)."""


def build(name: str) -> tuple[torch.nn.Module, dict[str, Any], Callable]:
    """(model, batch, loss_fn) of ``name`` (a key of `BUILDERS`), seeded."""
    if name not in BUILDERS:
        raise ValueError(f"unknown diffusers model {name!r}; choose one of {sorted(BUILDERS)}.")
    torch.manual_seed(0)
    model, batch = BUILDERS[name]()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() and not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model, batch, loss_fn
