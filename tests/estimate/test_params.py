"""Parameter counts of traced models equal those of the Hugging Face models built from the same configs."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from remat.estimate.sources import ModelSource, hf_config
from remat.estimate.trace import trace_source

SMALL = {
    "gpt2": dict(hidden=64, layers=5, heads=4, vocab=100),
    "llama": dict(hidden=64, layers=5, heads=4, kv_heads=2, intermediate=96, vocab=100),
    "mistral": dict(hidden=64, layers=5, heads=8, kv_heads=2, intermediate=160, vocab=100),
}


def _hf_param_count(config) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


@pytest.mark.parametrize("family", sorted(SMALL))
def test_param_count_equals_hf_model(family: str) -> None:
    source = ModelSource(hf_family=family, sizes={**SMALL[family], "seq": 16})
    traced = trace_source(source, seq_len=16)
    assert traced.num_layers == 5
    assert traced.param_count == _hf_param_count(hf_config(source))


def test_config_json_source(tmp_path) -> None:
    cfg = dict(model_type="llama", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=4, intermediate_size=128, vocab_size=50, tie_word_embeddings=True)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    source = ModelSource(hf_config_path=str(path))
    traced = trace_source(source, seq_len=8)
    assert traced.param_count == _hf_param_count(hf_config(source))
    # by hand: tied embedding 50*64; per layer q,k,v,o 4*64*64 + MLP 3*64*128 + 2 norms 2*64; final norm 64
    assert traced.param_count == 50 * 64 + 3 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64


def test_llama_70b_parameter_count_by_hand() -> None:
    """Llama-3-70B sizes: the count is exact arithmetic (and 80 layers are never built)."""
    h, layers, kv, inter, vocab = 8192, 80, 1024, 28672, 128256
    source = ModelSource(hf_family="llama", sizes=dict(hidden=h, layers=layers, heads=64, kv_heads=8,
                                                        intermediate=inter, vocab=vocab, seq=16))
    traced = trace_source(source, seq_len=16)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h
    assert traced.param_count == 2 * vocab * h + layers * per_layer + h == 70_553_706_496


def test_bad_sources(tmp_path) -> None:
    with pytest.raises(ValueError, match="name exactly one model source"):
        ModelSource(hf_family="llama", builtin="gpt")
    with pytest.raises(ValueError, match="unknown Hugging Face family 'bert'; allowed: gpt2, llama, mistral"):
        ModelSource(hf_family="bert")
    with pytest.raises(ValueError, match=r"unknown size\(s\) \['depth'\] for --hf llama"):
        hf_config(ModelSource(hf_family="llama", sizes=dict(depth=3)))
    (tmp_path / "c.json").write_text("{}")
    with pytest.raises(ValueError, match="has no 'model_type'"):
        hf_config(ModelSource(hf_config_path=str(tmp_path / "c.json")))
