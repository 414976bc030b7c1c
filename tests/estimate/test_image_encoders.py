"""`remat estimate` on plain vision transformers (ViT, DeiT, BEiT, DINOv2): built as transformers'
image classifier over the config's image size, the first layer traced as itself, the rest
copied, the step priced against `remat.profile` of the whole model on the CPU."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from remat.estimate import ModelSource, Parallelism, estimate
from remat.measure.profile import profile
from remat.plan.planners import plan

B = 2
BASE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, image_size=32,
            patch_size=8, num_channels=3)


def _path(tmp_path, model_type: str, **extra) -> str:
    path = tmp_path / f"{model_type}.json"
    path.write_text(json.dumps(dict(model_type=model_type, **BASE, **extra)))
    return str(path)


# (model type, attention, extra config, tokens a layer, over without / with recomputation: bound, 0 exact)
CASES = [
    ("vit", "sdpa", {}, 17, 0.0, 0.0),  # 4 x 4 patches and a class token
    ("deit", "sdpa", {}, 18, 0.0, 0.0),  # and a distillation token; its classifier without the teacher
    # relative position biases, stochastic depth from 0 in the first layer to 0.1 (a drop path the
    # first layer has not)
    ("beit", "eager", dict(use_relative_position_bias=True, drop_path_rate=0.1), 17, 0.0, 0.0),
    ("dinov2", "sdpa", {}, 17, 0.0002, 0.0002),
]


@pytest.mark.parametrize("model_type, attention, extra, tokens, none_over, full_over", CASES, ids=[c[0] for c in CASES])
def test_parameters_and_peaks_against_the_measured_step(tmp_path, model_type, attention, extra, tokens, none_over,
                                                        full_over) -> None:
    """Every parameter counted once; the tokens a layer runs over reported in place of --seq; the
    peak with no recomputation and with every layer recomputed against `remat.plan`'s prediction
    from a CPU profile of the whole model (equal to the measured peak). Before, every image
    encoder was refused ("has no causal language model")."""
    source = ModelSource(hf_config_path=_path(tmp_path, model_type, **extra), attention=attention)
    result = estimate(source, seq_len=4096, micro_batch=B, dtype="fp32", gpu_kernels=False)
    assert f"an image encoder, trained as an image classifier over 32 x 32 images: {tokens} tokens a layer" in result.model
    assert result.seq_len == tokens
    config = transformers.AutoConfig.for_model(model_type, **BASE, **extra)
    config._attn_implementation = attention
    config.architectures = ["DeiTForImageClassification"] if model_type == "deit" else None
    torch.manual_seed(0)
    model = transformers.AutoModelForImageClassification.from_config(config).train()
    assert result.param_count == sum(p.numel() for p in model.parameters())
    images = torch.randn(B, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    prof = profile(model, {"pixel_values": images, "labels": torch.tensor([0, 1])}, None,
                   torch.optim.AdamW(model.parameters(), fused=True), repeats=1)
    assert prof.num_blocks == 4
    rows = {s.strategy: s for s in result.devices[0].strategies}
    for strategy, bound in (("none", none_over), ("full", full_over)):
        over = rows[strategy].peak_bytes / plan(prof, strategy=strategy).prediction.peak_bytes - 1
        assert (over == 0.0) if bound == 0.0 else (0.0 <= over <= bound), (strategy, over)


def test_image_models_the_estimate_cannot_copy_are_refused_in_one_line(tmp_path) -> None:
    """Stages of different widths (ConvNeXt) and ImageGPT's colour-cluster ids are refused by name;
    context parallelism, priced over --seq, is refused for a model whose tokens its images set."""
    convnext = tmp_path / "convnext.json"
    convnext.write_text(json.dumps({"model_type": "convnext"}))
    with pytest.raises(ValueError, match=r"ConvNextConfig is an image model of stages that differ \(depths "
                                         r"\[3, 3, 9, 3\]: Swin, ConvNeXt, ResNet\.\.\.\)"):
        estimate(ModelSource(hf_config_path=str(convnext)), seq_len=64, micro_batch=1)
    with pytest.raises(ValueError, match=r"ImageGPTForImageClassification takes no pixel_values"):
        estimate(ModelSource(hf_config_path=_path(tmp_path, "imagegpt"), attention="eager"), seq_len=64, micro_batch=1)
    with pytest.raises(ValueError, match=r"context-parallel size 2: .* runs 17 tokens a layer, set by the model, not "
                                         r"--seq.*Pass --context-parallel 1"):
        estimate(ModelSource(hf_config_path=_path(tmp_path, "vit")), seq_len=64, micro_batch=1,
                 parallelism=Parallelism(context=2))
