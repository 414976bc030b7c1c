"""LayerDrop off while remat measures: every layer runs in the profile and in verify, the
rates come back after, and the blocks of such a model are not joined into multi-block segments
(training skips layers, so a block may not be fed by the one before it)."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn

import remat
from remat.measure.layerdrop import LayerDropOff


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class Dropping(nn.Module):
    """Skips each layer with probability ``self.layerdrop`` in training (BART's encoder loop), and
    carries a config with the rates Hugging Face's wav2vec2 and BART configs have."""

    def __init__(self, rate: float) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(layerdrop=rate, encoder_layerdrop=rate, decoder_layerdrop=0.0, hidden=8)
        self.layerdrop = rate
        self.layers = nn.ModuleList(Layer() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and torch.rand([]) < self.layerdrop:
                continue
            x = layer(x)
        return x


def test_rates_are_zero_inside_and_restored_after():
    model = Dropping(0.5)
    with LayerDropOff(model) as off:
        assert (model.layerdrop, model.config.layerdrop, model.config.encoder_layerdrop) == (0.0, 0.0, 0.0)
        assert sorted(off.changed) == ["Dropping.layerdrop", "SimpleNamespace.encoder_layerdrop", "SimpleNamespace.layerdrop"]
    assert (model.layerdrop, model.config.layerdrop, model.config.encoder_layerdrop) == (0.5, 0.5, 0.5)
    assert model.config.decoder_layerdrop == 0.0 and model.config.hidden == 8  # a 0 rate and other fields untouched


def test_any_rate_named_layerdrop_is_zero_inside():
    """SeamlessM4T's speech encoder reads ``config.speech_encoder_layerdrop``: left on, its
    profile failed or left the encoder out on some seeds, and its peaks were 8-23 % off."""
    model = Dropping(0.5)
    model.config.speech_encoder_layerdrop = 0.1
    model.text_layerdrop = 0.2
    with LayerDropOff(model) as off:
        assert (model.config.speech_encoder_layerdrop, model.text_layerdrop) == (0.0, 0.0)
        assert {"SimpleNamespace.speech_encoder_layerdrop", "Dropping.text_layerdrop"} <= set(off.changed)
    assert (model.config.speech_encoder_layerdrop, model.text_layerdrop) == (0.1, 0.2)


def test_a_model_that_drops_layers_profiles_plans_single_blocks_and_trains_as_without_remat():
    torch.manual_seed(0)
    model = Dropping(0.5)
    batch = torch.randn(4, 8)
    loss_fn = lambda out, _: out.square().sum()  # noqa: E731
    for seed in range(4):  # whatever the forward's draws: each layer is skipped half the time
        torch.manual_seed(seed)
        prof = remat.profile(model, batch, loss_fn, repeats=1)
        assert [b.name for b in prof.blocks] == [f"layers.{i}" for i in range(4)]
        assert model.layerdrop == 0.5 and model.config.layerdrop == 0.5
    assert not any(b.follows_previous for b in prof.blocks)
    plans = list(remat.pareto(prof)) + [remat.plan(prof, strategy=s) for s in ("full", "sqrt")]
    assert all(s.stop - s.start == 1 for p in plans for s in p.segments)  # no multi-block segment
    check = remat.verify(model, batch, remat.plan(prof, strategy="full"), loss_fn, repeats=1)
    assert check.ok and check.grads_identical and check.measured_peak_bytes == check.predicted_peak_bytes
    assert check.recompute_counts_match and model.layerdrop == 0.5
    reference = copy.deepcopy(model)
    remat.apply_(model, remat.plan(prof, strategy="sqrt"))
    for step in range(4):  # layers skipped at random under the plan, as without it
        grads = []
        for m in (reference, model):
            torch.manual_seed(100 + step)
            m.zero_grad(set_to_none=True)
            loss_fn(m(batch), batch).backward()
            grads.append([p.grad for p in m.parameters()])
        for a, b in zip(*grads):
            assert (a is None and b is None) or torch.equal(a, b)


def test_wav2vec2_with_layerdrop_finds_every_encoder_layer():
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(
        vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16, 16), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, mask_time_prob=0.0, layerdrop=0.9, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ForCTC(config).train()
    g = torch.Generator().manual_seed(0)
    batch = {"input_values": torch.randn(2, 1600, generator=g), "labels": torch.randint(1, 32, (2, 6), generator=g)}
    prof = remat.profile(model, batch, repeats=1)
    assert [b.name for b in prof.blocks][-2:] == ["wav2vec2.encoder.layers.0", "wav2vec2.encoder.layers.1"]
    assert model.config.layerdrop == 0.9


def test_a_rate_per_layer_is_zero_inside():
    """x-transformers' ``AttentionLayers`` keeps a rate per layer (``self.layer_dropouts``, a
    tuple) and skips a layer on ``random() < rate``: left on, its profile found no blocks
    ("do not run each member exactly once per step")."""
    model = Dropping(0.0)
    model.layer_dropouts = (0.3, 0.0, 0.5, 0.0)
    model.config.layer_dropout = [0.0, 0.1]
    model.flags_layerdrop = (True, False)  # not rates: left alone
    model.text_layer_drop = (0.0, 0.0)  # rates already 0: left alone
    with LayerDropOff(model) as off:
        assert model.layer_dropouts == (0.0, 0.0, 0.0, 0.0) and model.config.layer_dropout == [0.0, 0.0]
        assert sorted(off.changed) == ["Dropping.layer_dropouts", "SimpleNamespace.layer_dropout"]
        assert model.flags_layerdrop == (True, False) and model.text_layer_drop == (0.0, 0.0)
    assert model.layer_dropouts == (0.3, 0.0, 0.5, 0.0) and model.config.layer_dropout == [0.0, 0.1]
