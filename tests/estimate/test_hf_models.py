"""`remat.estimate` on Hugging Face configs: MoE with expert parallelism, DeepSeek's dense-first
layers, explicit attention's shared mask, ``use_cache: false``, and layouts a model cannot take."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from remat.estimate import DeviceSpec, ModelSource, Parallelism, estimate
from remat.estimate.pricing import Pricing
from remat.estimate.sharding import StateRecipe
from remat.estimate.strategies import STRATEGY_NAMES
from remat.estimate.trace import trace_source
from remat.memory.allowance import NO_ALLOWANCE

H, A, S = 64, 4, 32
DEVICE = DeviceSpec(name="Big", memory_bytes=2**40, peak_bf16_flops_per_s=1e15, memory_bytes_per_s=1e12)
MIXTRAL = dict(model_type="mixtral", hidden_size=H, num_hidden_layers=4, num_attention_heads=A, num_key_value_heads=2,
               intermediate_size=96, num_local_experts=8, num_experts_per_tok=2, vocab_size=96)


def _config(tmp_path, **cfg) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _hf_param_count(path: str) -> int:
    data = json.loads(Path(path).read_text())
    config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.slow
def test_mixtral_with_expert_parallelism(tmp_path) -> None:
    """Experts over 2 and 4 ranks: the routed experts' weights per GPU halve and quarter (every
    other parameter stays); a router twice as loaded on the busiest rank doubles the experts'
    activations and FLOPs. Every strategy is priced without the planner's search, which took over
    300 s on a Mixtral config (the pricing's time: BENCHMARKS.md, "Test suite")."""
    path = _config(tmp_path, **MIXTRAL)
    traced = trace_source(ModelSource(hf_config_path=path), seq_len=S)
    assert traced.param_count == _hf_param_count(path)
    params = {e: _pricing(traced, Parallelism(data=4, expert=e)).state(0).param_bytes for e in (1, 2, 4)}
    experts = 4 * 8 * (2 * 96 * H + H * 96)  # 4 layers x 8 experts x (gate_up + down) parameters, bf16
    assert params[1] - params[2] == 2 * experts // 2 and params[1] - params[4] == 2 * experts * 3 // 4
    even = _pricing(traced, Parallelism(data=4, expert=2)).layer(2, 1)
    loaded = _pricing(traced, Parallelism(data=4, expert=2, expert_load=2.0)).layer(2, 1)
    split = traced.split(2)
    saved = [part.layers[1].saved for part in (split.per_token, split.constant)]
    assert loaded.saved_bytes - even.saved_bytes == sum(x.expert_split + x.expert_whole for x in saved)
    assert loaded.expert_flops == 2 * even.expert_flops
    rows = _pricing(traced, Parallelism(data=4, expert=2)).on_device(DEVICE).strategies
    assert [r.strategy for r in rows] == list(STRATEGY_NAMES) and all(r.fits for r in rows)


def _pricing(traced, par: Parallelism) -> Pricing:
    return Pricing(traced=traced, micro_batch=2, micro_batches=1, parallelism=par, mfu=0.4, allowance=NO_ALLOWANCE,
                   recipe=StateRecipe(optimizer="adamw", precision="mixed", zero_stage=0), strategies=STRATEGY_NAMES)


def test_deepseek_dense_first_layers_and_latent_attention(tmp_path) -> None:
    """DeepSeek-V3's first ``first_k_dense_replace`` layers are dense: traced as such (layer 0),
    the MoE layers copied from the last traced layer; multi-head latent attention's values are
    narrower than its queries (run as the memory-efficient kernel)."""
    path = _config(tmp_path, model_type="deepseek_v3", hidden_size=H, num_hidden_layers=4, num_attention_heads=A,
                   num_key_value_heads=A, intermediate_size=128, moe_intermediate_size=32, n_shared_experts=1,
                   n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1,
                   q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                   vocab_size=96)
    traced = trace_source(ModelSource(hf_config_path=path), seq_len=S)
    assert traced.layer_kinds == (0, 2, 2, 2) and traced.param_count == _hf_param_count(path)
    pricing = _pricing(traced, Parallelism())
    dense, moe = pricing.layer(1, 0), pricing.layer(1, 2)
    assert dense.expert_flops == 0 < moe.expert_flops
    assert all(p.peak_bytes < 2**30 for p in pricing.price(DEVICE, "none", 1, 2**40).peaks)


@pytest.mark.slow
def test_explicit_attention_mask_counts_once_and_no_cache(tmp_path) -> None:
    """A Llama with eager attention passes one (b, 1, s, s) mask to every layer: the layer's input
    is its hidden states alone, 2sbh. ``use_cache: false`` (how models train) traces too."""
    sizes = dict(hidden=H, layers=4, heads=A, kv_heads=2, intermediate=128, vocab=96, seq=S)
    eager = estimate(ModelSource(hf_family="llama", sizes=sizes, attention="eager"), seq_len=S, micro_batch=2,
                     strategies=("full",))
    assert eager.layer_input_bytes == 2 * S * 2 * H
    path = _config(tmp_path, model_type="llama", hidden_size=H, num_hidden_layers=2, num_attention_heads=A,
                   num_key_value_heads=A, intermediate_size=128, vocab_size=96, use_cache=False)
    assert estimate(ModelSource(hf_config_path=path), seq_len=S, strategies=("none",)).devices[0].strategies[0].fits


def test_layouts_the_model_cannot_take(tmp_path) -> None:
    llama = ModelSource(hf_family="llama", sizes=dict(hidden=H, layers=4, heads=A, kv_heads=2, intermediate=128,
                                                      vocab=96, seq=S))
    with pytest.raises(ValueError, match="tensor-parallel size 4 does not divide the model's 2 key/value heads"):
        estimate(llama, seq_len=S, parallelism=Parallelism(tensor=4))
    with pytest.raises(ValueError, match="4 layers do not split evenly over 3 pipeline stage"):
        estimate(llama, seq_len=S, parallelism=Parallelism(pipeline=3))
    with pytest.raises(ValueError, match="context-parallel size 3 does not divide the sequence of 32 tokens"):
        estimate(llama, seq_len=S, parallelism=Parallelism(context=3))
    with pytest.raises(ValueError, match=r"expert-parallel size 2 must divide the model's routed experts \(none"):
        estimate(llama, seq_len=S, world_size=2, parallelism=Parallelism(expert=2))
    with pytest.raises(ValueError, match="the data-parallel size is given twice: world_size=2 and parallelism.data=4"):
        estimate(llama, seq_len=S, world_size=2, parallelism=Parallelism(data=4))
    model = tmp_path / "mlp_model.py"
    model.write_text(MLP_FILE)
    with pytest.raises(ValueError, match=r"tensor-parallel size 64 does not divide the width 96 that 0\.0\.weight"):
        estimate(f"{model}:build", seq_len=S, parallelism=Parallelism(tensor=64))


MLP_FILE = """
import torch
from torch import nn


def build():
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(48, 96), nn.ReLU(), nn.Linear(96, 48)) for _ in range(2)])
    return blocks, torch.ones(4, 48), lambda out, batch: out.sum()
"""


def test_searched_expert_layouts_fold_into_their_ranks(tmp_path) -> None:
    """The search offered t = 4 with e = 8 on 8 GPUs (8 % 8 == 0 over t x c x d), whose experts
    need t x e = 32 ranks: every `remat estimate --search` of an MoE config ended in "world_size
    must be an integer >= 1, got 0". Every layout it yields now passes the check a hand-typed one
    gets, with at least one rank per expert shard."""
    from remat.estimate import SearchSpace
    from remat.estimate.fastest import layouts

    traced = trace_source(ModelSource(hf_config_path=_config(tmp_path, **MIXTRAL)), seq_len=S)
    space = SearchSpace(gpus=8, global_batch=16, seq_len=S, micro_batch=(1,))
    found = [par for par, _, _ in layouts(space, traced, 8)]
    assert {par.expert for par in found} == {1, 2, 4, 8}
    for par in found:
        par.check_experts()
        assert par.expert_data >= 1 and par.tensor * par.context * par.data % (par.tensor * par.expert) == 0
    assert (4, 8) not in {(par.tensor, par.expert) for par in found}
    assert (1, 8) in {(par.tensor, par.expert) for par in found}


def _estimated_and_measured_layer(tmp_path, gpu_kernels: bool = True, **cfg) -> tuple[int, int]:
    """The last layer's saved bytes: estimated (the GPU's kernels, or the CPU's, traced on the
    meta device) and measured by `remat.profile` on the CPU, whose SDPA is a fused kernel too,
    fp32 both."""
    path = _config(tmp_path, **cfg)
    layer = estimate(ModelSource(hf_config_path=path), seq_len=S, micro_batch=2, dtype="fp32",
                     gpu_kernels=gpu_kernels).layer_saved_bytes
    fields = {k: v for k, v in cfg.items() if k != "model_type"}
    config = transformers.AutoConfig.for_model(cfg["model_type"], **fields)
    config._attn_implementation, config.use_cache = "sdpa", False
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(0, config.vocab_size, (2, S))
    from remat.measure.profile import profile

    measured = profile(model, {"input_ids": ids, "labels": ids.clone()}, None, None, repeats=1).blocks[-1].saved_bytes
    return layer, measured


@pytest.mark.parametrize("kv_heads, window", [(4, None), (2, None), (1, None), (4, 16)],
                         ids=["heads", "grouped", "multi-query", "sliding-window"])
def test_a_layer_saves_what_the_fused_kernels_keep(tmp_path, kv_heads, window) -> None:
    """Grouped-query attention's K and V were counted repeated to every query head (5-14 % over
    per layer on 13 families, 8.75 GiB over Llama-70B's 80 layers), and an attention mask (a
    sliding window) sent the call down PyTorch's math path, whose seq x seq scores no GPU kernel
    keeps (Mistral-7B with a 4096 window: 10048 MiB a layer at 8192 tokens, 1793 now). Equal to
    the byte but the GPU kernel's RNG seed and offset, which the CPU's has not: FlashAttention's
    (uint64, 2 and 1 elements: 24 bytes), the memory-efficient kernel's for a mask (two int64: 16)."""
    cfg = dict(model_type="mistral", hidden_size=H, num_hidden_layers=2, num_attention_heads=A,
               num_key_value_heads=kv_heads, intermediate_size=128, vocab_size=96, max_position_embeddings=128,
               sliding_window=window, tie_word_embeddings=False)
    estimated, measured = _estimated_and_measured_layer(tmp_path, **cfg)
    assert estimated - measured == (16 if window else 24)
    # --cpu-kernels traced the math path, every head's scores saved (+29 % a layer): now the CPU's fused kernel
    on_cpu, measured = _estimated_and_measured_layer(tmp_path, gpu_kernels=False, **cfg)
    assert on_cpu == measured


def test_a_mask_bias_is_whole_under_sequence_parallelism(tmp_path) -> None:
    """The (b, 1, s, s) bias a sliding window's mask becomes is not split by sequence parallelism
    (attention runs on the gathered sequence) nor by heads: under --sp it was halved with t = 2,
    3.5 GiB a GPU short for Mistral-7B at 8192 tokens, t = 8. What the window adds to a layer is
    the same with and without --sp."""
    base = dict(model_type="mistral", hidden_size=H, num_hidden_layers=2, num_attention_heads=A, num_key_value_heads=2,
                intermediate_size=128, vocab_size=96, max_position_embeddings=128, tie_word_embeddings=False)
    layer = {}
    for window in (None, 16):
        (tmp_path / str(window)).mkdir()
        path = _config(tmp_path / str(window), **base, sliding_window=window)
        for sp in (False, True):
            par = Parallelism(tensor=2, sequence_parallel=sp)
            layer[window, sp] = estimate(ModelSource(hf_config_path=path), seq_len=S, micro_batch=2, dtype="fp32",
                                         parallelism=par).layer_saved_bytes
    assert layer[16, True] - layer[None, True] == layer[16, False] - layer[None, False] > 2 * S * S * 4


def test_layers_of_several_kinds_are_traced_each(tmp_path) -> None:
    """Gemma 3 (five sliding-window layers to one global): the trace copied its first layers'
    kind to every layer (the global ones +12 % a layer, the peak +1.4 %), and a config whose two
    layers differed was refused. Two layers of each kind are traced, each layer priced as its own
    kind: the step's peak within 0.3 % of `remat.profile`'s on the CPU, with and without
    recomputation."""
    from remat.estimate.trace import hf_layer_kinds

    cfg = dict(model_type="gemma3_text", hidden_size=H, num_hidden_layers=6, num_attention_heads=A,
               num_key_value_heads=A, head_dim=16, intermediate_size=128, vocab_size=96, max_position_embeddings=128,
               sliding_window=16)
    config = transformers.AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    assert hf_layer_kinds(config, 6, 2) == (4, (1, 1, 1, 1, 1, 3))
    path = _config(tmp_path, **cfg)
    strategies = {s.strategy: s for s in estimate(ModelSource(hf_config_path=path), seq_len=S, micro_batch=2,
                                                  dtype="fp32").devices[0].strategies}
    config._attn_implementation, config.use_cache = "sdpa", False
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(0, 96, (2, S))
    from remat.measure.profile import profile
    from remat.plan.planners import plan

    prof = profile(model, {"input_ids": ids, "labels": ids.clone()}, None, torch.optim.AdamW(model.parameters(), fused=True),
                   repeats=1)
    for strategy in ("none", "full"):
        measured = plan(prof, strategy=strategy).prediction.peak_bytes
        assert abs(strategies[strategy].peak_bytes / measured - 1) < 0.003, strategy


JAMBA = dict(model_type="jamba", hidden_size=H, num_hidden_layers=8, num_attention_heads=A, num_key_value_heads=2,
             intermediate_size=128, vocab_size=96, num_experts=4, num_experts_per_tok=4, expert_layer_period=2,
             expert_layer_offset=1, attn_layer_period=4, attn_layer_offset=2, mamba_d_state=8, mamba_d_conv=4,
             mamba_expand=2, mamba_dt_rank=4)
HYBRID = ["mamba", "mamba", "hybrid", "mamba", "mamba", "hybrid", "mamba", "hybrid"]
ZAMBA = dict(model_type="zamba", hidden_size=H, num_hidden_layers=8, num_attention_heads=A, num_key_value_heads=A,
             intermediate_size=128, vocab_size=96, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
             n_mamba_heads=2, attention_head_dim=32, layers_block_type=HYBRID)
ZAMBA2 = dict(model_type="zamba2", hidden_size=H, num_hidden_layers=8, num_attention_heads=A, num_key_value_heads=A,
              intermediate_size=128, vocab_size=96, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, n_mamba_heads=8,
              mamba_headdim=16, mamba_ngroups=1, chunk_size=16, attention_head_dim=32, layers_block_type=HYBRID,
              use_shared_attention_adapter=True, adapter_rank=4)

RECURRENT_GEMMA = dict(model_type="recurrent_gemma", hidden_size=H, num_hidden_layers=6, num_attention_heads=A,
                       num_key_value_heads=1, head_dim=16, intermediate_size=192, vocab_size=96, lru_width=H,
                       attention_window_size=16, block_types=["recurrent", "recurrent", "attention"])


@pytest.mark.parametrize("cfg, kinds, dtype, seq", [
    # (mamba, dense), (mamba, 4 experts), (attention, dense): the attention layers at 2 and 6
    (JAMBA, (1, 3, 5, 3, 1, 3, 5, 3), torch.bfloat16, S),
    # mamba layers, and hybrid layers that run one transformer block, shared, beside their own mamba
    # (16 tokens: its scan runs a Python loop over them, in every trace and step)
    (ZAMBA, (1, 1, 3, 1, 1, 3, 1, 3), torch.float32, S // 2),
    # the same with an adapter of the shared block's attention per hybrid layer
    (ZAMBA2, (1, 1, 3, 1, 1, 3, 1, 3), torch.float32, S),
    # its layers' kinds computed from block_types, under an alias (layer_types: layers_block_type)
    (RECURRENT_GEMMA, (1, 1, 3, 1, 1, 3), torch.float32, S),
], ids=["jamba", "zamba", "zamba2", "recurrent_gemma"])
def test_hybrids_of_computed_or_shared_layers_are_priced_as_measured(tmp_path, cfg, kinds, dtype, seq) -> None:
    """Jamba computes its per-layer lists from its periods and offsets (properties, which the traced
    model's kinds could not be set on: refused); Zamba's and Zamba 2's hybrid layers run one
    transformer block their first hybrid layer holds, so copying the traced layers counted its
    weights never (Zamba's default config 6.87 B parameters of 7.23 B: refused); RecurrentGemma's
    computed list is named by an alias (a traceback). Traced on the CPU's
    kernels, every layer saves what `remat.profile` measures of the model built whole, the
    parameters are counted as the model has them, and the peaks equal the measured step's."""
    path = _config(tmp_path, **cfg)
    fp = "bf16" if dtype == torch.bfloat16 else "fp32"
    traced = trace_source(ModelSource(hf_config_path=path), seq_len=seq, dtype=fp, gpu_kernels=False)
    assert traced.layer_kinds == kinds
    config = transformers.AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    config.use_cache = False
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).train()
    assert traced.param_count == sum(p.numel() for p in model.parameters())
    from remat.measure.profile import profile
    from remat.plan.planners import plan

    ids = torch.randint(0, 96, (2, seq))
    prof = profile(model, {"input_ids": ids, "labels": ids.clone()}, None, torch.optim.AdamW(model.parameters()),
                   repeats=1)
    blocks = traced.profile(2).blocks
    assert [blocks[k].saved_bytes for k in kinds] == [b.saved_bytes for b in prof.blocks]
    if cfg is ZAMBA:  # the shared block: once, outside the layers, on each pipeline stage that runs it
        from remat.estimate.sharding import gpu_state, StateRecipe

        shared = sum(p.numel() for p in model.model.layers[2].shared_transf.parameters())
        assert [(readers, part.count) for readers, part in traced.params.shared] == [(frozenset({2, 5, 7}), shared)]
        recipe = StateRecipe(optimizer="adamw", precision="fp32", zero_stage=0)
        one = gpu_state(traced.params, Parallelism(), 0, recipe).param_bytes
        two = [gpu_state(traced.params, Parallelism(pipeline=2), k, recipe).param_bytes for k in (0, 1)]
        assert sum(two) == one + 4 * (shared + traced.params.tied.count)  # the tied embedding's copy too
    if dtype == torch.float32:  # the estimate's bf16 is mixed precision (fp32 master weights), the model's pure
        strategies = {s.strategy: s for s in estimate(ModelSource(hf_config_path=path), seq_len=seq, micro_batch=2,
                                                      dtype=fp, gpu_kernels=False).devices[0].strategies}
        for strategy in ("none", "full"):
            measured = plan(prof, strategy=strategy).prediction.peak_bytes
            assert abs(strategies[strategy].peak_bytes / measured - 1) < 0.003, strategy
