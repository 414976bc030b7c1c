"""Models transformers offers no SDPA attention: the estimate refused them ("pass
--explicit-attention"), 64 model types of transformers 5.25.0 among them Gemma 2, GPT-OSS, BLOOM,
MPT and DeBERTa. It now traces the attention a GPU trains them with: FlashAttention where the
model takes transformers' attention functions and FlashAttention (Gemma 2's logit softcap and
GPT-OSS's sinks are the kernel's arguments; `remat.estimate.kernels.flash_attention_forward`),
else the model's own code (eager), and says which."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from remat.estimate import ModelSource, estimate
from remat.estimate.trace import trace_source
from remat.measure.profile import profile

H, A, S = 64, 4, 32


def _config(tmp_path, **cfg) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _measured_layers(cfg: dict, attention: str) -> list[int]:
    """Each layer's saved bytes, measured by `remat.profile` on the CPU (fp32)."""
    config = transformers.AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    config._attn_implementation, config.use_cache = attention, False
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(0, config.vocab_size, (2, S))
    return [b.saved_bytes for b in profile(model, {"input_ids": ids, "labels": ids.clone()}, None, None, repeats=1).blocks]


def _traced_layers(path: str, gpu_kernels: bool = True, attention: str = "sdpa") -> tuple[str, list[int]]:
    traced = trace_source(ModelSource(hf_config_path=path, attention=attention), seq_len=S, dtype="fp32",
                          gpu_kernels=gpu_kernels)
    return traced.label, [b.saved_bytes for b in traced.tracer(2)[0].blocks]


BLOOM = dict(model_type="bloom", hidden_size=H, n_layer=2, n_head=A, vocab_size=96)
GEMMA2 = dict(model_type="gemma2", hidden_size=H, num_hidden_layers=4, num_attention_heads=A, num_key_value_heads=2,
              head_dim=16, intermediate_size=128, vocab_size=96, max_position_embeddings=128)


def test_a_model_with_attention_of_its_own_is_traced_with_it(tmp_path) -> None:
    """BLOOM (ALiBi in its own attention code): what the CPU runs, measured, is what the estimate
    traces, on the GPU's kernels (no dropout: the same ops) and the CPU's, to the byte."""
    path = _config(tmp_path, **BLOOM)
    label, on_gpu = _traced_layers(path)
    assert "attention as the model's own code, eager: transformers offers it neither SDPA nor FlashAttention" in label
    _, on_cpu = _traced_layers(path, gpu_kernels=False)
    assert on_gpu == on_cpu == _measured_layers(BLOOM, "eager")
    result = estimate(ModelSource(hf_config_path=path), seq_len=S, micro_batch=2, dtype="fp32")
    assert result.layer_saved_bytes == on_gpu[-1]


def test_a_model_that_takes_flash_attention_is_traced_with_it(tmp_path, monkeypatch) -> None:
    """Gemma 2 (a logit softcap SDPA cannot take, sliding-window layers) on a GPU: FlashAttention,
    which saves the same with and without the softcap and the window. Equal to the byte to the same
    model without them traced through transformers' SDPA path (as FlashAttention, as every model
    that offers SDPA is), made to offer SDPA; its own attention code saves each head's seq x seq
    scores on top. On the CPU (--cpu-kernels) its own code runs, as `remat.profile` measures."""
    path = _config(tmp_path, **GEMMA2)
    label, flash = _traced_layers(path)
    assert "attention as FlashAttention" in label
    (tmp_path / "plain").mkdir()
    plain = _config(tmp_path / "plain", **GEMMA2, attn_logit_softcapping=None,
                    layer_types=["full_attention"] * 4)
    monkeypatch.setattr(transformers.Gemma2PreTrainedModel, "_supports_sdpa", True)
    plain_label, through_sdpa = _traced_layers(plain)
    assert "attention as" not in plain_label
    # two layers of each kind traced (sliding-window and global) against two of one: alike to the byte
    assert len(flash) == 4 and flash == [through_sdpa[0]] + [through_sdpa[1]] * 3
    _, own = _traced_layers(path, attention="eager")
    assert all(o - f >= 2 * A * S * S * 4 for o, f in zip(own, flash))  # the scores and probabilities, per head
    monkeypatch.undo()
    label, on_cpu = _traced_layers(path, gpu_kernels=False)
    assert "attention as the model's own code, eager: transformers offers it no SDPA on the CPU" in label
    assert on_cpu == _measured_layers(GEMMA2, "eager")


def test_a_weight_made_without_a_device_is_built_on_the_meta_device() -> None:
    """XLNet (no SDPA: traced with its own attention now) makes its mask embedding with
    ``torch.FloatTensor(...)``, which takes no device: built on the CPU beside a meta model, the
    estimate refused it as if the caller had put the batch on the wrong device ("move the batch with
    .to('cpu')")."""
    from remat.estimate.sources import build_hf_on_meta

    config = transformers.XLNetConfig(d_model=H, n_layer=2, n_head=A, d_inner=128, vocab_size=96)
    config._attn_implementation = "eager"
    model = build_hf_on_meta(config, layers=2, dtype=torch.bfloat16)
    assert all(t.is_meta for t in (*model.parameters(), *model.buffers()))


def test_a_hybrid_says_its_state_space_layers_are_over_priced(tmp_path) -> None:
    """Granite 4 (`granitemoehybrid`: Mamba-2 and attention layers) offers SDPA, so its attention is
    traced as before; its Mamba layers run their PyTorch code on the meta device, which saves
    several times what the GPU's fused kernels save: the output says so."""
    from remat.estimate.trace import STATE_SPACE_NOTE

    path = _config(tmp_path, model_type="granitemoehybrid", hidden_size=H, num_hidden_layers=4, num_attention_heads=A,
                   num_key_value_heads=2, intermediate_size=128, vocab_size=96, mamba_n_heads=8, mamba_d_head=16,
                   mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16, num_local_experts=0,
                   layer_types=["mamba", "attention", "mamba", "attention"])
    label, _ = _traced_layers(path)
    assert label.endswith(STATE_SPACE_NOTE)
    assert "attention as" not in label
