"""A model in eval mode (Hugging Face's ``from_pretrained`` returns one) was profiled as it ran, its
dropout saving no masks, with no word: a plan made from it held less than the training step in
train mode. `remat.profile` says so where the step would run otherwise, and measures the model as
it is (a model trained in eval mode on purpose, dropout off, is that step)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from remat.measure.profile import eval_mode_differences, profile
from remat.models import build


def _profile_quietly(built):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        measured = profile(built.model, built.batch, built.loss_fn, built.optimizer, repeats=1)
    return measured, [str(w.message) for w in caught if "eval mode" in str(w.message)]


def test_a_model_in_eval_mode_is_measured_as_it_is_and_said_to_be():
    built = build("gpt", num_layers=2, d_model=32, num_heads=2, seq_len=16, batch_size=2, vocab_size=64, dropout=0.1)
    trained, said = _profile_quietly(built)
    assert said == []
    built.model.eval()
    evaluated, said = _profile_quietly(built)
    assert said == [
        "GPT is in eval mode (model.training is False, as Hugging Face's from_pretrained returns a model), so the step "
        "remat.profile measures runs as evaluation does: 7 dropout layers (p > 0) save no mask. A plan made from it "
        "holds less than that step in train mode. Call model.train() before remat.profile to plan training in train "
        "mode; if you train in eval mode on purpose (dropout off), this is that step."]
    assert not built.model.training  # measured as it is, left as it was
    # in train mode each block saved more: on the CPU a dropout's mask is fp32, one for the attention's
    # probabilities (2 x 2 heads x 16 x 16) and the dropped probabilities the product with V keeps, one
    # each for the attention's and the MLP's outputs (2 x 16 x 32)
    masks = [t.saved_bytes - e.saved_bytes for t, e in zip(trained.blocks, evaluated.blocks)]
    assert masks == [4 * (2 * (2 * 2 * 16 * 16) + 2 * (2 * 16 * 32))] * 2


def test_only_what_would_run_otherwise_is_named():
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Dropout(0.0)).eval()
    assert eval_mode_differences(plain) == []  # nothing runs otherwise: no warning
    normed = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Dropout(0.5)).eval()
    assert eval_mode_differences(normed) == ["2 dropout layers (p > 0) save no mask",
                                             "1 norm layer uses its running statistics"]
    assert eval_mode_differences(normed.train()) == []


def test_a_hugging_face_attention_dropout_rate_is_named():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, attention_dropout=0.1)
    model = transformers.LlamaForCausalLM(config).eval()
    assert eval_mode_differences(model) == ["its config's attention_dropout 0.1 not applied"]
