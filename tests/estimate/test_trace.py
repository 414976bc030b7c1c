"""The meta-device trace: published activation formula, meta == CPU, micro-batch line, copied layers."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from remat.estimate.dataflow import classify
from remat.estimate.shares import combine, split_by_tokens
from remat.estimate.sources import ModelSource
from remat.estimate.trace import check_alike, trace_profile, trace_source
from remat.measure.blocks import find_blocks
from remat.measure.profile import profile
from remat.models import build
from remat.plan.costs import cost_of
from remat.plan.policies import attention_core
from remat.plan.types import Segment

H, A, B = 64, 4, 2  # hidden, heads, micro-batch


def _gpt_bf16_layer(seq: int, *, gpu_kernels: bool):
    with torch.device("meta"):
        built = build("gpt", optimizer="none", num_layers=2, d_model=H, num_heads=A, seq_len=seq, batch_size=B,
                      vocab_size=128, dropout=0.1, attention="explicit")
    built.model.to(torch.bfloat16)
    return trace_profile(built.model, built.batch, gpu_kernels=gpu_kernels)


@pytest.mark.parametrize("seq", [32, 64])
def test_gpt_layer_matches_korthikanti(seq: int) -> None:
    """Korthikanti et al. 2022 (section 4.1): a transformer layer with 16-bit activations and
    1-byte dropout masks saves s*b*h*(34 + 5*a*s/h) bytes. PyTorch's kernels differ by:
    1. LayerNorm also saves its fp32 mean and 1/std per token: 2 norms x 2 x 4 bytes x s*b = 16*s*b;
    2. the built-in GPT's ``masked_fill`` saves the negated causal mask it builds: s*s bool bytes
       (once per layer, not per sequence);
    3. with GPU kernels dropout masks are 1-byte bool (``native_dropout``), as the paper assumes;
       the CPU's dropout saves its mask in the activation dtype, 2 bytes per element: +a*s*s*b
       for the attention dropout and +2*s*b*h for the two residual dropouts;
    4. (no byte difference) the matmuls save copies of Q, K and V (PyTorch's reshape of a
       transposed tensor copies); at micro-batch 1 the reshape is a view and they save views of
       the QKV projection's output instead: one 6*s*b*h storage, the same bytes.
    Everything else (QKV input, Q and K copies, softmax output, attention-dropout output, V copy,
    projection input, GELU input, FC2 input, LayerNorm inputs) matches the paper term by term.
    """
    s, b, h, a = seq, B, H, A
    paper = s * b * h * (34 + 5 * a * s // h)
    gpu = _gpt_bf16_layer(seq, gpu_kernels=True).blocks[1]
    assert gpu.saved_bytes == paper + 16 * s * b + s * s
    cpu = _gpt_bf16_layer(seq, gpu_kernels=False).blocks[1]
    assert cpu.saved_bytes == paper + 16 * s * b + s * s + a * s * s * b + 2 * s * b * h


def _attention_core_retained(seq: int) -> tuple[int, int]:
    prof = _gpt_bf16_layer(seq, gpu_kernels=True)
    block = prof.blocks[1]
    seg = Segment(start=1, stop=2, strategy="selective:attention-core", saved_ops=attention_core(block))
    return block.saved_bytes, cost_of(prof, 1, seg).retained_bytes


def test_attention_core_recomputation_removes_the_quadratic_term() -> None:
    """Kept bytes grow with s^2 (the 5as/h term); with the attention core replayed what a layer
    holds is linear in s: doubling s exactly doubles it. It holds the block's input (2sbh), the
    paper's 34sbh and LayerNorm's statistics (16sb), and the outputs of the three matmuls outside
    the core that autograd does not keep (QKV 6sbh, out-projection 2sbh, FC2 2sbh), saved so that
    the replay runs no GEMM outside the core. That pays from 5as/h > 12: not at s = 32 (5as/h =
    10), at s = 64 (20)."""
    keep_32, core_32 = _attention_core_retained(32)
    keep_64, core_64 = _attention_core_retained(64)
    for s, core in ((32, core_32), (64, core_64)):
        assert core == s * B * H * (2 + 34 + 6 + 2 + 2) + 16 * s * B
    assert keep_64 - 2 * keep_32 == 5 * A * B * (64**2 - 2 * 32**2) + (64**2 - 2 * 32**2)
    assert core_32 > keep_32 and core_64 < keep_64


def _gpt_cpu_and_meta(batch_size: int, num_layers: int = 2):
    sizes = dict(num_layers=num_layers, d_model=32, num_heads=2, seq_len=16, batch_size=batch_size, vocab_size=64)
    cpu = build("gpt", optimizer="none", **sizes)
    with torch.device("meta"):
        meta = build("gpt", optimizer="none", **sizes)
    return cpu, meta


def _bytes_and_flops(prof):
    blocks = [
        (b.name, b.input_bytes, b.output_bytes, b.saved_bytes, b.bwd_temp_bytes, b.fwd_flops,
         tuple((op.key, op.output_bytes, op.saved_bytes, op.flops, op.is_view, op.is_random) for op in b.ops))
        for b in prof.blocks
    ]
    fixed = (prof.fixed_pre_saved_bytes, prof.fixed_post_saved_bytes, prof.fixed_post_bwd_temp_bytes,
             prof.fixed_flops, prof.param_bytes, prof.grad_bytes, prof.buffer_bytes)
    return blocks, fixed


def test_meta_trace_equals_cpu_profile_byte_for_byte() -> None:
    torch.manual_seed(0)
    cpu, meta = _gpt_cpu_and_meta(batch_size=2)
    measured = profile(cpu.model, cpu.batch, warmup=1, repeats=1)
    forwards = []
    hook = meta.model.register_forward_hook(lambda *_: forwards.append(1))
    traced = trace_profile(meta.model, meta.batch)  # the estimate's trace, CPU kernels
    hook.remove()
    assert _bytes_and_flops(traced) == _bytes_and_flops(measured)
    assert traced.blocks[1].saved_bytes > 0
    # the blocks' discovery, the warm-up step and the accounting step; no timed step (5 forwards
    # before): nothing on the meta device has a time to take
    assert len(forwards) == 3 and measured.step_ms > 0
    assert traced.step_ms == 0 and all(b.fwd_ms == b.bwd_ms == 0 for b in traced.blocks)


def _flow(batch_size: int, num_layers: int = 2):
    _, meta = _gpt_cpu_and_meta(batch_size=batch_size, num_layers=num_layers)
    return classify(meta.model, meta.batch, find_blocks(meta.model)).flow


def test_micro_batch_line_is_exact() -> None:
    """Shares traced at micro-batch 2 and 3 give micro-batch 5 exactly (bytes and FLOPs, every
    bucket of every segment): the per-token part on the line, plus the constant part."""
    flows = {b: _flow(b) for b in (2, 3, 5)}
    split = split_by_tokens(None, flows[2], flows[3], 5)
    assert combine(split.per_token, split.constant, lambda x, k: x + k) == flows[5]
    assert split.constant.layers[1].saved.total > 0  # the causal mask: one per layer, whatever the batch
    with pytest.raises(ValueError, match="micro-batch 1 needs its own trace"):
        split_by_tokens(None, flows[2], flows[3], 1)


def test_traced_layers_equal_the_whole_models() -> None:
    """The 6 layers of the real model are alike to the byte and FLOP, and equal the second of 2
    traced layers: what estimate copies; the parts before and after the layers are the same."""
    six, two = _flow(2, num_layers=6), _flow(2)
    assert all(layer == two.layers[1] for layer in six.layers)
    assert six.pre == two.pre and six.post == two.post
    _, meta = _gpt_cpu_and_meta(batch_size=2)
    traced = trace_profile(meta.model, meta.batch)
    check_alike(traced)
    with pytest.raises(ValueError, match="run different ops"):
        check_alike(replace(traced, blocks=(traced.blocks[0], replace(traced.blocks[1], fwd_flops=1))))


def test_llama_with_flash_attention_has_no_quadratic_term() -> None:
    """Llama through SDPA as FlashAttention saves no seq x seq matrix: a layer's saved bytes are
    linear in the sequence, k*s + 24, the 24 bytes being the kernel's RNG seed and offset
    (uint64 tensors of 2 and 1 elements)."""
    saved = {}
    for seq in (32, 64):
        source = ModelSource(hf_family="llama", sizes=dict(hidden=64, layers=2, heads=4, kv_heads=2,
                                                            intermediate=128, vocab=96, seq=seq))
        saved[seq] = trace_source(source, seq_len=seq).profile(2).blocks[-1].saved_bytes
    assert saved[64] - 24 == 2 * (saved[32] - 24)


def _counting_traces(monkeypatch) -> list[int]:
    """The batch size of every `trace_profile` call from here on (one per traced micro-batch)."""
    from remat.estimate import trace as trace_module

    calls: list[int] = []
    real = trace_module.trace_profile

    def counted(model, batch, *args, **kwargs):
        calls.append(int(batch["input_ids"].shape[0]) if isinstance(batch, dict) else -1)
        return real(model, batch, *args, **kwargs)

    monkeypatch.setattr(trace_module, "trace_profile", counted)
    return calls


def test_one_source_is_traced_once_per_process(tmp_path, monkeypatch) -> None:
    """`remat.estimate` of one config at several micro-batches, layouts and devices traces it once:
    micro-batch 1 (its parameters), 2 and 3 (the line) and 4 (that the line holds). The answers
    equal a fresh trace's. An edited config, another sequence length and a ``file.py:build``
    model, whose code may change between calls, are traced anew; `clear_trace_cache` forgets."""
    import json

    from remat._serialize import to_dict
    from remat.estimate import Parallelism, estimate
    from remat.estimate.trace import clear_trace_cache

    calls = _counting_traces(monkeypatch)
    config = tmp_path / "config.json"
    sizes = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
                 num_hidden_layers=4, vocab_size=64)
    config.write_text(json.dumps(sizes))
    source = ModelSource(hf_config_path=str(config))
    first = estimate(source, micro_batch=2, seq_len=16)
    assert sorted(calls) == [1, 2, 3, 4]
    again = [estimate(source, micro_batch=2, seq_len=16),
             estimate(ModelSource(hf_config_path=str(config)), micro_batch=8, seq_len=16, devices=("A100-40GB",)),
             estimate(source, micro_batch=2, seq_len=16, parallelism=Parallelism(tensor=2))]
    assert len(calls) == 4
    assert to_dict(again[0]) == to_dict(first)
    clear_trace_cache()
    fresh = [estimate(source, micro_batch=2, seq_len=16),
             estimate(source, micro_batch=8, seq_len=16, devices=("A100-40GB",)),
             estimate(source, micro_batch=2, seq_len=16, parallelism=Parallelism(tensor=2))]
    assert len(calls) == 8 and [to_dict(e) for e in fresh] == [to_dict(e) for e in again]
    estimate(source, micro_batch=2, seq_len=32)
    assert len(calls) == 12
    config.write_text(json.dumps({**sizes, "hidden_size": 64}))
    edited = estimate(source, micro_batch=2, seq_len=16)
    assert len(calls) == 16 and edited.param_count > first.param_count
    build = tmp_path / "tiny.py"
    build.write_text(
        "import torch, transformers\n"
        "def build():\n"
        f"    config = transformers.LlamaConfig(**{ {k: v for k, v in sizes.items() if k != 'model_type'}!r})\n"
        "    model = transformers.AutoModelForCausalLM.from_config(config)\n"
        "    ids = torch.randint(0, 64, (2, 16))\n"
        "    return model, {'input_ids': ids, 'labels': ids}\n")
    for _ in range(2):
        estimate(ModelSource(file=f"{build}:build"), seq_len=16)
    assert len(calls) == 18
