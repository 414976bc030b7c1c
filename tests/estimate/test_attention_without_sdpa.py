"""Models transformers offers no SDPA attention: the estimate refused them ("pass
--explicit-attention"), 64 model types of transformers 5.25.0 among them Gemma 2, GPT-OSS, BLOOM,
MPT and DeBERTa. It now traces the attention a GPU trains them with: FlashAttention where the
model takes transformers' attention functions and FlashAttention (Gemma 2's logit softcap and
GPT-OSS's sinks are the kernel's arguments; `remat.estimate.kernels.flash_attention_forward`),
else the model's own code (eager), and says which."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers

from typing import Any

from remat.estimate import ModelSource, estimate
from remat.estimate.trace import MAMBA2_NOTE, trace_source
from remat.measure.profile import profile

H, A, S = 64, 4, 32


def _config(tmp_path, **cfg) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _measured_layers(cfg: dict, attention: str, auto: Any = transformers.AutoModelForCausalLM) -> list[int]:
    """Each layer's saved bytes, measured by `remat.profile` on the CPU (fp32)."""
    config = transformers.AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    config._attn_implementation, config.use_cache = attention, False
    torch.manual_seed(0)
    model = auto.from_config(config).train() if auto is transformers.AutoModelForCausalLM else auto(config).train()
    ids = torch.randint(0, config.vocab_size, (2, S))
    return [b.saved_bytes for b in profile(model, {"input_ids": ids, "labels": ids.clone()}, None, None, repeats=1).blocks]


def _traced_layers(path: str, gpu_kernels: bool = True, attention: str = "sdpa") -> tuple[str, list[int]]:
    traced = trace_source(ModelSource(hf_config_path=path, attention=attention), seq_len=S, dtype="fp32",
                          gpu_kernels=gpu_kernels)
    return traced.label, [b.saved_bytes for b in traced.profile(2).blocks]


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


MAMBA2 = dict(model_type="mamba2", hidden_size=H, num_hidden_layers=2, num_heads=8, head_dim=16, state_size=16,
              n_groups=1, expand=2, vocab_size=96, chunk_size=16)


def test_a_mamba2_layer_saves_what_the_fused_kernel_saves(tmp_path) -> None:
    """Mamba 2 was refused (no SDPA). On a GPU its mixer runs ``mamba_ssm``'s fused function, which
    saves its projected input, the scan's output and the gated norm's statistics
    (`remat.estimate.ssm`); its PyTorch code, which the CPU runs (and the meta device would trace),
    saves every chunk's states and decays: 5.4 times the layer here. By hand, a layer of width 64 at
    2 x 32 tokens (fp32): the block's RMSNorm saves its input, the input over its deviation, its
    output and that deviation (3 x 8,192 + 256 bytes); the fused function the projection
    (2 x 32 x 296 x 4: 2 x 128 gate and input, 2 x 16 B and C, 8 heads' time steps), the scan's
    output (8 heads of 16: 16,384) and one float32 deviation per token (256); A = -exp(A_log) two 8-head vectors."""
    path = _config(tmp_path, **MAMBA2)
    label, on_gpu = _traced_layers(path)
    assert label.endswith(MAMBA2_NOTE) and "attention" not in label
    by_hand = 3 * 2 * S * H * 4 + 2 * S * 4 + 2 * S * 296 * 4 + 2 * S * 8 * 16 * 4 + 2 * S * 4 + 2 * 8 * 4
    assert on_gpu == [by_hand] * 2
    _, on_cpu = _traced_layers(path, gpu_kernels=False)
    assert on_cpu == _measured_layers(MAMBA2, "eager", transformers.Mamba2ForCausalLM)
    assert min(on_cpu) > 5 * by_hand


def test_a_mamba2_in_bf16_keeps_its_residual_stream_in_float32(tmp_path) -> None:
    """Mamba 2 keeps its residual stream in float32 (``residual_in_fp32``): in bf16 its first layer
    takes the embedding's bf16, the others float32, so the first is traced apart; a 2-layer model
    was refused, its two traced layers compared though neither is copied. Its later layers are
    priced alike whatever the model's depth."""
    saved = []
    for layers in (2, 4):
        (tmp_path / str(layers)).mkdir()
        path = _config(tmp_path / str(layers), **{**MAMBA2, "num_hidden_layers": layers})
        saved.append(estimate(ModelSource(hf_config_path=path), seq_len=S, micro_batch=2, dtype="bf16").layer_saved_bytes)
    assert saved[0] == saved[1] > 0


def test_a_mamba_layer_saves_what_the_fused_kernel_saves(tmp_path) -> None:
    """Mamba (Mamba-1) was refused (no SDPA). On a GPU its mixer runs ``mamba_ssm``'s
    ``mamba_inner_fn`` (`remat.estimate.ssm.FusedMamba`). By hand, width 64, inner width 128, state
    16, time-step rank 4, 2 x 32 tokens (fp32): the block's RMSNorm and the input projection's input
    as Mamba 2's (3 x 8,192 + 256); A = -exp(A_log) and its exponential (2 x 128 x 16 x 4); the
    projection made contiguous (2 x 256 x 32 x 4), x_dbl (64 tokens x 36 x 4), B and C (2 x 2 x 16 x 32
    x 4), the scan's chunk states (2 x 128 x 1 chunk x 32 x 4) and output (2 x 128 x 32 x 4). Its
    PyTorch code, which the CPU runs and `remat.profile` measures, saves 9.3 times as much."""
    cfg = dict(model_type="mamba", hidden_size=H, num_hidden_layers=2, state_size=16, expand=2, vocab_size=96,
               time_step_rank=4)
    path = _config(tmp_path, **cfg)
    label, on_gpu = _traced_layers(path)
    assert label.endswith(MAMBA2_NOTE)
    by_hand = (3 * 2 * S * H * 4 + 2 * S * 4 + 2 * 128 * 16 * 4 + 2 * 256 * S * 4 + 2 * S * 36 * 4
               + 2 * 2 * 16 * S * 4 + 2 * 128 * 32 * 4 + 2 * 128 * S * 4)
    assert on_gpu == [by_hand] * 2
    _, on_cpu = _traced_layers(path, gpu_kernels=False)
    assert on_cpu == _measured_layers(cfg, "eager", transformers.MambaForCausalLM)
    assert min(on_cpu) > 9 * by_hand


def test_the_scan_and_convolution_stand_ins_save_what_the_kernels_save() -> None:
    """Falcon-Mamba's mixer runs ``causal_conv1d_fn`` and ``selective_scan_fn`` apart. By their
    ``save_for_backward``: the convolution its input (here a channel-last view of the input
    projection, which it takes as it is: the projection's whole storage), the scan its input and
    time steps (contiguous already), B, C and the gate made contiguous (they are views of other
    layouts), A, D, the time-step bias, the float32 chunk states and the ungated output."""
    from remat.estimate.ssm import fused_conv1d, fused_selective_scan

    batch, width, seqlen, state = 2, 128, 32, 16
    meta = dict(device="meta")
    projection = torch.empty(batch, seqlen, 2 * width, **meta, requires_grad=True).transpose(1, 2)
    x, gate = projection.chunk(2, dim=1)
    weight = torch.empty(width, 4, **meta, requires_grad=True)
    saved: list[tuple[tuple[int, ...], int]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(t.shape), t.untyped_storage().nbytes()))
        return t

    unused = lambda *args, **kwargs: pytest.fail("the stand-in fell back to the code")  # noqa: E731
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        conv = fused_conv1d(unused)(x, weight, None, activation="silu")
    assert saved == [((batch, width, seqlen), batch * seqlen * 2 * width * 4), ((width, 4), width * 4 * 4)]
    assert conv.shape == (batch, width, seqlen)
    saved.clear()
    delta = torch.empty(batch, width, seqlen, **meta, requires_grad=True)
    A = torch.empty(width, state, **meta, requires_grad=True)
    B, C = (torch.empty(batch, seqlen, state, **meta, requires_grad=True).transpose(1, 2) for _ in range(2))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fused_selective_scan(unused)(conv, delta, A, B, C, D=None, z=gate, delta_bias=None, delta_softplus=True)
    full = batch * width * seqlen * 4
    assert saved == [((batch, width, seqlen), full), ((batch, width, seqlen), full), ((width, state), width * state * 4),
                     ((batch, state, seqlen), batch * state * seqlen * 4), ((batch, state, seqlen), batch * state * seqlen * 4),
                     ((batch, width, seqlen), full), ((batch, width, 1, 2 * state), batch * width * 2 * state * 4),
                     ((batch, width, seqlen), full)]
    assert out.shape == (batch, width, seqlen)
    out.sum().backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (delta, A))


def test_falcon_mamba_is_priced_as_its_kernels_on_a_gpu(tmp_path) -> None:
    """Falcon-Mamba was refused (no SDPA). Its layers are priced as the kernels save (above), its
    time-step, B and C norms and projections as its code runs them: 5.3 times less than its code
    saves whole on a tiny layer, which the CPU trace equals to `remat.profile`'s measurement. RWKV
    and xLSTM, whose kernels the estimate does not stand in for, are still refused on a GPU."""
    from remat.estimate.trace import _unmodelled_state_space

    cfg = dict(model_type="falcon_mamba", hidden_size=H, num_hidden_layers=2, state_size=16, expand=2, vocab_size=96,
               time_step_rank=4)
    path = _config(tmp_path, **cfg)
    label, on_gpu = _traced_layers(path)
    assert label.endswith(MAMBA2_NOTE)
    _, on_cpu = _traced_layers(path, gpu_kernels=False)
    assert on_cpu == _measured_layers(cfg, "eager", transformers.FalconMambaForCausalLM)
    assert on_gpu == [379_904] * 2 and min(on_cpu) > 5 * max(on_gpu)
    with torch.device("meta"):
        falcon = transformers.FalconMambaForCausalLM(transformers.FalconMambaConfig(**{k: v for k, v in cfg.items()
                                                                                      if k != "model_type"}))
    assert not any(_unmodelled_state_space(m) for m in falcon.modules())


def test_a_hybrid_prices_its_mamba2_layers_as_the_fused_kernel(tmp_path) -> None:
    """Granite 4 (`granitemoehybrid`: Mamba-2 and attention layers) offers SDPA, so its attention is
    traced as before; its Mamba-2 layers were traced as their PyTorch code, several times what the
    GPU's fused kernel saves: as that kernel now, and the output says so."""

    path = _config(tmp_path, model_type="granitemoehybrid", hidden_size=H, num_hidden_layers=4, num_attention_heads=A,
                   num_key_value_heads=2, intermediate_size=128, vocab_size=96, mamba_n_heads=8, mamba_d_head=16,
                   mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16, num_local_experts=0,
                   layer_types=["mamba", "attention", "mamba", "attention"])
    label, on_gpu = _traced_layers(path)
    assert label.endswith(MAMBA2_NOTE)
    assert "attention as" not in label
    _, on_cpu = _traced_layers(path, gpu_kernels=False)
    # two Mamba-2 layers, then two attention layers: alike but FlashAttention's RNG seed and offset
    # (24 bytes: `test_hf_models.py`)
    assert on_gpu[0] == on_gpu[1] < on_cpu[0] == on_cpu[1]
    assert on_gpu[2] - on_cpu[2] == on_gpu[3] - on_cpu[3] == 24


def _saved_storage_bytes(fn, *args: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype, int]]:
    """The tensors autograd saves in ``fn(*args)`` (parameters left out), one per storage: the
    first saved tensor's shape and dtype, and its storage's bytes."""
    seen, out = set(), []
    params = {t.untyped_storage().data_ptr() for t in args if isinstance(t, torch.nn.Parameter)}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in seen and key not in params:
            seen.add(key)
            out.append((tuple(t.shape), t.dtype, t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return out


def test_rwkv_time_mixing_is_priced_as_the_wkv_kernel(tmp_path, monkeypatch) -> None:
    """RWKV was refused on a GPU: its time mixing runs the WKV CUDA kernel there, which saves the
    decay (-exp of it, float32, one per channel), the key, the value and the kernel's output, where
    the code without it (the CPU's, the meta device's) loops over the tokens and saves every step's
    state. Its layers are priced as the kernel saves: each equal to `remat.profile`'s measurement
    on the CPU of the model run with the stand-in (`remat.estimate.ssm.FusedWkv`, whose saved
    tensors are the kernel's list), 178,688 bytes a layer under its code's here (a loop over 32
    tokens, whose 352 per-token states of 2 x 64 floats grow with the tokens; the layer 363,008
    bytes against 541,696). More tokens than the kernel is built for
    (``context_length``) are refused."""
    from transformers.models.rwkv import modeling_rwkv

    from remat.estimate.ssm import FusedWkv, fused_wkv
    from remat.estimate.trace import WKV_NOTE

    cfg = dict(model_type="rwkv", hidden_size=H, num_hidden_layers=3, attention_hidden_size=H, intermediate_size=128,
               vocab_size=96, context_length=64)
    path = _config(tmp_path, **cfg)
    label, on_gpu = _traced_layers(path)
    assert label.endswith(WKV_NOTE) and "attention as" not in label
    cpu_label, on_cpu = _traced_layers(path, gpu_kernels=False)
    assert cpu_label == path  # no attention to speak of, nor a kernel on the CPU
    assert on_cpu == _measured_layers(cfg, "eager", transformers.RwkvForCausalLM)
    decay, first = torch.nn.Parameter(torch.randn(H)), torch.nn.Parameter(torch.randn(H))
    key, value = (torch.randn(2, S, H, requires_grad=True) for _ in range(2))
    kernel = _saved_storage_bytes(FusedWkv.apply, decay, first, key, value)
    # ctx.save_for_backward(time_decay, time_first, key, value, output): time_first a parameter
    assert kernel == [((H,), torch.float32, H * 4), ((2, S, H), torch.float32, 2 * S * H * 4),
                      ((2, S, H), torch.float32, 2 * S * H * 4), ((2, S, H), torch.float32, 2 * S * H * 4)]
    monkeypatch.setattr(modeling_rwkv, "rwkv_linear_attention", fused_wkv(modeling_rwkv.rwkv_linear_attention))
    assert on_gpu == _measured_layers(cfg, "eager", transformers.RwkvForCausalLM)
    assert [c - g for c, g in zip(on_cpu, on_gpu)] == [178_688] * 3
    with pytest.raises(ValueError, match=r"--seq 128 is more tokens than RWKV's WKV kernel is built for "
                                         r"\(context_length 64\)"):
        trace_source(ModelSource(hf_config_path=path), seq_len=128, dtype="fp32")
    (tmp_path / "xlstm").mkdir()
    xlstm = _config(tmp_path / "xlstm", model_type="xlstm", hidden_size=H, num_hidden_layers=2, num_heads=4,
                    vocab_size=96)
    with pytest.raises(ValueError, match=r"runs no attention but state-space or recurrent layers \(xLSTM"):
        _traced_layers(xlstm)
