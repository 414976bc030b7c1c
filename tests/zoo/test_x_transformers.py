"""x-transformers' models (`x_transformers`, built from their constructors' options): layers
that hand state to the next (residual attention scores, the first layer's values, several
residual streams), an encoder-decoder, and a rate per layer of skipping it in training. Each is
profiled, its least-peak plan and full recomputation verified: gradients bit-identical, the
peak as predicted to the byte."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F

import remat

x_transformers = pytest.importorskip("x_transformers")

VOCAB, LENGTH = 128, 32


def _lm_loss(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), batch.reshape(-1))


def _decoder(**options):
    layers = x_transformers.Decoder(dim=32, depth=3, heads=2, **options)
    return x_transformers.TransformerWrapper(num_tokens=VOCAB, max_seq_len=LENGTH, attn_layers=layers)


CASES = {
    "residual attention, value residual": lambda: _decoder(residual_attn=True, add_value_residual=True),
    "hyper-connections": lambda: _decoder(num_residual_streams=4),
    "rotary, GLU, RMSNorm, memory tokens": lambda: x_transformers.TransformerWrapper(
        num_tokens=VOCAB, max_seq_len=LENGTH, num_memory_tokens=2,
        attn_layers=x_transformers.Decoder(dim=32, depth=3, heads=2, rotary_pos_emb=True, ff_glu=True, use_rmsnorm=True)),
    "layer dropout": lambda: _decoder(layer_dropout=0.3, attn_dropout=0.1, ff_dropout=0.1),
}


def _check(model, batch, loss_fn, prof) -> None:
    for plan in (remat.pareto(prof)[-1], remat.plan(prof, strategy="full")):
        check = remat.verify(model, batch, plan, loss_fn, repeats=1)
        assert check.ok and check.grads_identical and check.grad_max_abs_diff == 0.0 and check.recompute_counts_match
        assert check.measured_peak_bytes == check.predicted_peak_bytes


@pytest.mark.parametrize("name", list(CASES))
def test_a_decoder_is_planned_and_verified(name):
    torch.manual_seed(0)
    model, batch = CASES[name](), torch.randint(0, VOCAB, (2, LENGTH))
    prof = remat.profile(model, batch, _lm_loss, repeats=1)
    assert len(prof.blocks) >= 6  # each layer's attention and feed-forward
    _check(model, batch, _lm_loss, prof)


def test_an_encoder_decoder_is_planned_and_verified():
    torch.manual_seed(0)
    model = x_transformers.XTransformer(dim=32, enc_num_tokens=VOCAB, enc_depth=2, enc_heads=2, enc_max_seq_len=LENGTH,
                                        dec_num_tokens=VOCAB, dec_depth=2, dec_heads=2, dec_max_seq_len=LENGTH)
    batch = (torch.randint(0, VOCAB, (2, LENGTH)), torch.randint(0, VOCAB, (2, LENGTH)))
    loss_fn = lambda out, _: out  # noqa: E731  (XTransformer returns its loss)
    prof = remat.profile(model, batch, loss_fn, repeats=1)
    names = [b.name for b in prof.blocks]
    assert any(n.startswith("encoder.") for n in names) and any(n.startswith("decoder.") for n in names)
    _check(model, batch, loss_fn, prof)


def test_layers_skipped_at_random_train_as_without_remat():
    """The profile runs every layer (the rates 0 while it measures, put back after); no
    segment joins two blocks, as training skips layers; under a plan, the layers skipped on
    the same draws give bit-identical gradients."""
    torch.manual_seed(0)
    model, batch = _decoder(layer_dropout=0.3), torch.randint(0, VOCAB, (2, LENGTH))
    prof = remat.profile(model, batch, _lm_loss, repeats=1)
    assert model.attn_layers.layer_dropouts == (0.3,) * 6
    assert not any(b.follows_previous for b in prof.blocks)
    plan = remat.plan(prof, strategy="sqrt")
    assert all(s.stop - s.start == 1 for s in plan.segments)
    reference = copy.deepcopy(model)
    remat.apply_(model, plan)
    skipped = set()
    for step in range(4):
        grads = []
        for m in (reference, model):
            random.seed(step)
            torch.manual_seed(step)
            m.zero_grad(set_to_none=True)
            _lm_loss(m(batch), batch).backward()
            grads.append([p.grad for p in m.parameters()])
        skipped.add(sum(g is None for g in grads[0]))
        for a, b in zip(*grads):
            assert (a is None and b is None) or torch.equal(a, b)
    assert len(skipped) > 1  # the draws skipped different layers
