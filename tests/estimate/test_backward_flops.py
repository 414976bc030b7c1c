"""The backward's FLOPs in `remat estimate`: one product per gradient a linear gives, none where no
gradient is needed (a frozen weight, an input computed from no trained parameter), against counts by
hand and against ``torch.utils.flop_counter`` over the real step on the CPU
(`remat.measure.flops.step_flop_counter`)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from torch import nn

from remat.estimate import ModelSource, estimate
from remat.estimate.dataflow import classify
from remat.measure.flops import step_flop_counter
from remat.models.lora import add_lora

B, S = 2, 32
LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)


def _estimated(tmp_path, cfg: dict, dtype: str = "fp32", **source) -> int:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return estimate(ModelSource(hf_config_path=str(path), **source), seq_len=S, micro_batch=B, dtype=dtype,
                    gpu_kernels=False).train_flops


def _counted(model: nn.Module, batch: dict) -> int:
    with step_flop_counter() as counter:
        model(**batch).loss.backward()
    return counter.get_total_flops()


def _model(cfg: dict, cls=transformers.AutoModelForCausalLM, *, rank: int | None = None,
           dtype: torch.dtype = torch.float32) -> nn.Module:
    config = transformers.AutoConfig.for_model(**cfg)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = cls.from_config(config).to(dtype).train()
    return add_lora(model, rank) if rank else model


IDS = torch.randint(3, 90, (B, S), generator=torch.Generator().manual_seed(0))
TEXT = {"input_ids": IDS, "labels": IDS}


def test_a_frozen_linear_on_an_input_without_gradient_has_no_backward() -> None:
    """x -> frozen Linear(8, 16) -> ReLU -> trained Linear(16, 4) -> sum, 5 rows: the first linear's
    input is the batch and its weight frozen, so it has no backward; the second's input is computed
    from no trained parameter, so its backward is its weight's gradient alone, one product:
    forward 2 x 5 x 8 x 16 + 2 x 5 x 16 x 4 = 1280 + 640, backward 640. Trained, the first would add
    its weight's gradient (1280) and give the second its input's (640)."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to("meta")
    batch = torch.empty(5, 8, device="meta")

    def flops(frozen: bool) -> tuple[float, float]:
        model[0].requires_grad_(not frozen)
        flow = classify(model, batch, [("2", model[2])], loss_fn=lambda out, _: out.sum()).flow
        return flow.pre.flops.total + flow.layers[0].flops.total, flow.pre.bwd_flops.total + flow.layers[0].bwd_flops.total

    assert flops(frozen=True) == (1920, 640)
    assert flops(frozen=False) == (1920, 1280 + 640 + 640)


def test_lora_backward_by_hand_and_as_torch_counts_it(tmp_path) -> None:
    """A tiny Llama with LoRA adapters of rank 4, 2 x 32 tokens. Forward: the frozen linears
    64 x 2 x 36,864 = 4,718,592 a layer, attention 524,288, the adapters 64 x 2 x 4 x 1,024 = 524,288,
    the frozen head 786,432: 23,855,104. Backward: layers 1-3 run one product per frozen linear
    (the input's gradient) 4,718,592, attention twice its forward 1,048,576, the adapters two each
    1,048,576; layer 0, whose input from the frozen embeddings takes no gradient, runs none for the
    frozen q, k and v and their adapters' A only their weight's: 3,670,016 + 1,048,576 + 229,376
    + 720,896; the head its input's 786,432. In all 50,757,632 (3 x the forward, 71,565,312, before),
    what torch counts over the real step to the FLOP; the model trained whole, 3 x its forward."""
    lora = _estimated(tmp_path, LLAMA, lora_rank=4)
    assert lora == 23_855_104 + 3 * 6_815_744 + 5_668_864 + 786_432 == 50_757_632
    assert lora == _counted(_model(LLAMA, rank=4), TEXT)
    whole = _estimated(tmp_path, LLAMA)
    assert whole == 3 * (4 * (4_718_592 + 524_288) + 786_432) == _counted(_model(LLAMA), TEXT)


def test_an_image_encoders_patch_embedding_gives_the_pixels_no_gradient(tmp_path) -> None:
    """ViT over 32 x 32 images in 8 x 8 patches: the patch embedding's convolution (part of the first
    stage's time) has only its weight's gradient in backward, one product as long as its forward
    (786,432): frozen, the step runs that much less, and no more (3 x its forward before)."""
    cfg = dict(model_type="vit", hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
               image_size=32, patch_size=8, num_channels=3)
    images = torch.randn(B, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    model = _model(cfg, transformers.AutoModelForImageClassification)
    patches = 2 * B * 16 * (3 * 8 * 8) * 64  # the convolution's forward: 16 patches of 3 x 8 x 8 into 64
    assert _estimated(tmp_path, cfg) == _counted(model, {"pixel_values": images, "labels": torch.tensor([0, 1])})
    model.vit.embeddings.patch_embeddings.requires_grad_(False)
    assert _counted(model, {"pixel_values": images, "labels": torch.tensor([0, 1])}) == _estimated(tmp_path, cfg) - patches


@pytest.mark.parametrize("cfg", [
    dict(model_type="mixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, vocab_size=96, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2),
], ids=["mixtral"])
def test_routed_experts_as_torch_counts_them(tmp_path, cfg) -> None:
    """Grouped matmuls of routed experts (bf16, their kernel's dtype): forward and backward as torch
    counts them over the real step."""
    assert _estimated(tmp_path, cfg, dtype="bf16") == _counted(_model(cfg, dtype=torch.bfloat16), TEXT)
