"""Every profile `remat.profile` makes loads back (`Profile.load` checks what a measured profile
always holds): on models whose measurements broke those rules, it did not."""

from __future__ import annotations

import pytest
import torch

from remat.measure.profile import profile
from remat.measure.types import Profile

transformers = pytest.importorskip("transformers")


def _pegasus_x():
    """Block-local attention with global tokens: encoder layer 1's backward window opens with
    fewer bytes live than its saved bytes (a negative ``bwd_start_temp_bytes``, -16952)."""
    config = transformers.PegasusXConfig(
        vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=128,
        block_size=16, num_global_tokens=4, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        use_cache=False)
    config._attn_implementation = "eager"
    return transformers.PegasusXForConditionalGeneration(config)


def _switch():
    """A router whose path depends on the data: the probes' checkpointed forward of a sparse
    layer made another number of op calls than the traced one (a curve of 252 values for 229 ops)."""
    config = transformers.SwitchTransformersConfig(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        num_experts=4, expert_capacity=64, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
        decoder_start_token_id=0, dropout_rate=0.0, use_cache=False)
    return transformers.SwitchTransformersForConditionalGeneration(config)


@pytest.mark.parametrize("make", [_pegasus_x, _switch], ids=["pegasus_x", "switch_transformers"])
def test_a_profile_remat_makes_loads_back_the_same(tmp_path, make):
    torch.manual_seed(0)
    model = make().train()
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(3, 128, (2, 32), generator=g), "labels": torch.randint(3, 128, (2, 8), generator=g)}
    prof = profile(model, batch, None, torch.optim.AdamW(model.parameters()), repeats=1)
    for block in prof.blocks:
        assert len(block.checkpointed_fwd_live_bytes) in (0, len(block.ops)), block.name
        assert block.bwd_start_temp_bytes >= 0 and block.between_bwd_temp_bytes >= 0, block.name
    prof.save(tmp_path / "profile.json")
    assert Profile.load(tmp_path / "profile.json") == prof
