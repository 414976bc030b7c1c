"""A planned head on Hugging Face encoder-decoders (`remat.head.site.HFSeq2SeqLMHead`): T5 and
M2M-100 built from configs, their loss the cross-entropy of the decoder's logits against the
labels as given; gradients against the model without a plan, peaks against `remat.verify`."""

from __future__ import annotations

import pytest
import torch
import transformers

import remat
from remat.head.strategies import FP32_REASSOCIATION_RTOL
from remat.measure.profile import profile
from remat.plan.planners import plan
from remat.verify import max_rel_diff
from head_models import assert_heads_verified, planned_step, relative_error as _rel, seeded_step as _step

V, S, B = 300, 16, 2
"""32 tokens of 300-way logits: the head outweighs a layer's activations."""
CONFIGS = {
    "t5": dict(d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2, d_kv=16, vocab_size=V,
               dropout_rate=0.0, decoder_start_token_id=0),
    "m2m_100": dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                    encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=V, dropout=0.0, attention_dropout=0.0,
                    activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0, max_position_embeddings=64),
    "bart": dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                 encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=V, dropout=0.0, max_position_embeddings=64),
}


def _built(model_type: str, cls=None, **overrides):
    config = transformers.AutoConfig.for_model(model_type, **{**CONFIGS[model_type], **overrides})
    config.use_cache = False
    torch.manual_seed(0)
    model = transformers.AutoModelForSeq2SeqLM.from_config(config) if cls is None else cls(config)
    model.train()
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(3, V, (B, S), generator=g)
    labels[0, :3] = -100
    batch = {"input_ids": torch.randint(3, V, (B, S), generator=g), "labels": labels}
    return model, batch


@pytest.mark.parametrize("model_type, overrides", [("t5", {}), ("t5", {"dropout_rate": 0.1}), ("m2m_100", {})],
                         ids=["t5", "t5-dropout", "m2m_100"])
def test_head_strategies_against_the_model_without_a_plan(model_type, overrides) -> None:
    """The head was the fixed part's (the causal LM's loss is not theirs). Recompute: loss and every
    gradient bit-identical, the logits never kept; chunked: within its tolerance; with dropout the
    profile's check (the call without labels gives the projection the same hidden states) runs
    both calls from one random state, and the recomputed head stays bit-identical."""
    model, batch = _built(model_type, **overrides)
    optimizer = torch.optim.AdamW(model.parameters())
    prof = profile(model, batch, None, optimizer, repeats=1, head_chunks=(7,))
    assert prof.head is not None and prof.head.kind == "hf-seq2seq-lm", prof.head_note
    _, loss, grads = _step(model, batch)
    assert len(grads) == len(list(model.parameters()))
    for head in ("recompute", "chunked:7"):
        output, planned_loss, planned = planned_step(model, batch, plan(prof, strategy="none", head=head))
        assert output.logits is None and planned.keys() == grads.keys()
        if head == "recompute":
            assert torch.equal(loss, planned_loss) and all(torch.equal(grads[n], planned[n]) for n in grads)
        else:
            assert _rel(planned_loss, loss) <= FP32_REASSOCIATION_RTOL
            assert max_rel_diff([planned[n] for n in grads], [grads[n] for n in grads]) <= FP32_REASSOCIATION_RTOL


@pytest.mark.parametrize("model_type", ["t5", "m2m_100"])
def test_planned_heads_are_verified_to_the_byte(model_type) -> None:
    assert_heads_verified(*_built(model_type), chunk=7)


def test_a_head_the_model_transforms_stays_in_the_fixed_part() -> None:
    """BART adds ``final_logits_bias`` to the projection's output."""
    model, batch = _built("bart")
    prof = profile(model, batch, None, None, repeats=1)
    assert prof.head is None and "does not return the output projection's own output" in prof.head_note


class _OtherDecoderInput(transformers.T5ForConditionalGeneration):
    """Makes its decoder's input of its labels one way when called with them (``_shift_right``)
    and says another (shifted by two) to whoever asks."""

    def prepare_decoder_input_ids_from_labels(self, labels):
        return self._shift_right(self._shift_right(labels))


def test_a_decoder_input_made_otherwise_than_the_model_makes_it_is_refused() -> None:
    """The head kind calls the model without labels, with the decoder input it makes of them: had
    that input differed from the model's own, the planned head would have trained on other hidden
    states, silently. The profile compares the projection's input of both calls."""
    model, batch = _built("t5", cls=_OtherDecoderInput)
    prof = profile(model, batch, None, None, repeats=1)
    assert prof.head is None and "other hidden states than the call with them" in prof.head_note
