"""Hugging Face models whose forward writes into an op's output after the op ran (T5's relative
position buckets, Mixtral's router weights): the profile's probes and selective plans must not
cache those calls. Tiny configs, random weights, nothing downloaded."""

from __future__ import annotations

import pytest
import torch

import remat
from remat.checkpointing.cacheable import cacheable
from remat.plan.planners import plan

transformers = pytest.importorskip("transformers")


def _t5():
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, decoder_start_token_id=0, pad_token_id=0)
    return transformers.T5ForConditionalGeneration(config)


def _mixtral():
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64)
    config._attn_implementation = "eager"
    return transformers.MixtralForCausalLM(config)


WRITTEN_LATER = {
    # T5Attention._relative_position_bucket: relative_buckets += ... (the first layer alone
    # computes the position bias; the decoder's, causal, adds nothing in place)
    "t5": {"encoder.block.0": {"aten.add.Tensor#2"}, "encoder.block.1": set(), "decoder.block.0": set(),
           "decoder.block.1": set()},
    # MixtralTopKRouter: router_top_value /= router_top_value.sum(...)
    "mixtral": {"model.layers.0": {"aten.topk.default#0"}, "model.layers.1": {"aten.topk.default#0"}},
}


@pytest.mark.slow
@pytest.mark.parametrize("name,build", [("t5", _t5), ("mixtral", _mixtral)])
def test_profile_and_selective_plans_of_models_that_write_into_outputs(name, build):
    torch.manual_seed(0)
    model = build()
    ids = torch.randint(1, 64, (2, 16))
    batch = {"input_ids": ids, "labels": ids.clone()}
    prof = remat.profile(model, batch, repeats=1)
    written = {b.name: {op.key for op in b.ops if op.mutated_later and cacheable(op.name)} for b in prof.blocks}
    assert written == WRITTEN_LATER[name]
    for strategy in ("selective:save-matmuls", "selective:attention-core"):
        chosen = plan(prof, strategy=strategy)
        assert any(seg.saved_ops for seg in chosen.segments)
        assert all(not set(seg.saved_ops) & written[chosen.block_names[seg.start]] for seg in chosen.segments)
        check = remat.verify(model, batch, chosen, repeats=1)
        assert check.grads_identical, (strategy, check.grad_max_abs_diff)
        assert check.recompute_counts_match, strategy  # Mixtral's cache is off (remat.checkpointing.caches)
