"""A planned head on Hugging Face masked LMs (`remat.head.site.HFMaskedLMHead`,
`HFMaskedLMCrossEntropyHead`): BERT, RoBERTa, ModernBERT, ESM and DistilBERT built from configs,
their loss the cross-entropy of the logits against the labels as given, most labels -100 as in
a masked-LM batch; gradients against the model without a plan, peaks against `remat.verify`."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

import remat
from remat.apply.head import head_tolerance
from remat.head.chunked import chunked_cross_entropy
from remat.head.loss import LossInputs, TokenLoss
from remat.head.site import find_head
from remat.measure.profile import profile
from remat.memory.head import HeadShape, head_bytes
from remat.plan.planners import plan
from remat.verify import max_rel_diff
from head_models import assert_heads_verified, planned_step, relative_error as _rel, seeded_step as _step

V, S, B, H = 300, 32, 2, 64
"""64 tokens of 300-way logits: the head outweighs a layer's activations."""
MASKED = 0.15
"""The share of positions labelled (the others -100), as BERT's masking."""
BERT = dict(hidden_size=H, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=V,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
CONFIGS = {
    "bert": BERT,
    "roberta": dict(BERT, pad_token_id=1),
    "modernbert": dict(hidden_size=H, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128, vocab_size=V,
                       max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                       sep_token_id=2, global_attn_every_n_layers=2, local_attention=16),
    "esm": dict(BERT, pad_token_id=1, mask_token_id=2, position_embedding_type="rotary"),
    "distilbert": dict(dim=H, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=V, max_position_embeddings=64,
                       dropout=0.0, attention_dropout=0.0),
    "deberta": dict(BERT, legacy=False),
}
KINDS = {"bert": "hf-masked-lm-ce", "roberta": "hf-masked-lm-ce", "modernbert": "hf-masked-lm", "esm": "hf-masked-lm-ce",
         "distilbert": "hf-masked-lm-ce"}
"""ModernBERT calls transformers' ForMaskedLMLoss; the others CrossEntropyLoss() inline."""
PROJECTIONS = {"bert": "cls.predictions.decoder", "roberta": "lm_head.decoder", "modernbert": "decoder",
               "esm": "lm_head.decoder", "distilbert": "vocab_projector"}


def _built(model_type: str, cls=None, dtype: torch.dtype | None = None, **overrides):
    config = transformers.AutoConfig.for_model(model_type, **{**CONFIGS[model_type], **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForMaskedLM.from_config(config) if cls is None else cls(config)
    model.train()
    if dtype is not None:
        model.to(dtype)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, config.vocab_size, (B, S), generator=g)
    labels = torch.full_like(ids, -100)
    masked = torch.rand(B, S, generator=g) < MASKED
    labels[masked] = ids[masked]
    return model, {"input_ids": ids, "labels": labels}


def test_the_batch_is_a_masked_lm_batch() -> None:
    """What every test below trains on: 11 of the 64 labels are kept (83 % are -100)."""
    _, batch = _built("bert")
    assert int((batch["labels"] != -100).sum()) == 11


@pytest.mark.parametrize("model_type", list(KINDS))
def test_the_head_is_found(model_type) -> None:
    """The projection is get_output_embeddings(), tied to the word embeddings; the loss as the model
    computes it: ModernBERT's ForMaskedLMLoss upcasts the logits to fp32, the inline
    CrossEntropyLoss() does not; ESM adds ``lm_head.bias`` after a projection without one."""
    model, _ = _built(model_type)
    site, note = find_head(model)
    assert site is not None, note
    assert (site.kind, site.projection, site.tied) == (KINDS[model_type], PROJECTIONS[model_type], True)
    assert site.loss == TokenLoss(shift=False, upcast=model_type == "modernbert")
    assert site.logit_bias == ("lm_head.bias" if model_type == "esm" else "")


@pytest.mark.parametrize("model_type", list(KINDS))
def test_head_strategies_against_the_model_without_a_plan(model_type) -> None:
    """Recompute: loss and every gradient bit-identical, the logits never kept; chunked (7 rows, so
    that most chunks hold one or no labelled row): the loss divided by the 11 labelled rows, within
    the head's stated tolerance."""
    model, batch = _built(model_type)
    optimizer = torch.optim.AdamW(model.parameters())
    prof = profile(model, batch, None, optimizer, repeats=1, head_chunks=(7,))
    assert prof.head is not None and prof.head.kind == KINDS[model_type], prof.head_note
    assert (prof.head.num_tokens, prof.head.hidden_size, prof.head.vocab_size) == (B * S, H, V)
    _, loss, grads = _step(model, batch)
    assert len(grads) == len([n for n, _ in model.named_parameters() if "contact_head" not in n])  # ESM's is unused
    for head in ("recompute", "chunked:7"):
        output, planned_loss, planned = planned_step(model, batch, plan(prof, strategy="none", head=head))
        assert output.logits is None and planned.keys() == grads.keys()
        if head == "recompute":
            assert torch.equal(loss, planned_loss) and all(torch.equal(grads[n], planned[n]) for n in grads)
        else:
            rtol = head_tolerance(model, head, batch).relative_tolerance
            assert rtol == 1e-5
            assert _rel(planned_loss, loss) <= rtol
            assert max_rel_diff([planned[n] for n in grads], [grads[n] for n in grads]) <= rtol


@pytest.mark.parametrize("model_type", ["bert", "modernbert", "esm", "distilbert"])
def test_planned_heads_are_verified_to_the_byte(model_type) -> None:
    assert_heads_verified(*_built(model_type), chunk=16)


@pytest.mark.parametrize("model_type", ["bert", "modernbert"])
def test_bf16_losses_are_the_models_to_the_bit(model_type) -> None:
    """In bf16 the upcast decides the loss's bits: the profile's check (the convention's loss of the
    projection's output equals the model's bit for bit) passes with ModernBERT's fp32 upcast and
    with BERT's loss of the bf16 logits as they are; the recomputed head stays bit-identical."""
    model, batch = _built(model_type, dtype=torch.bfloat16)
    prof = profile(model, batch, None, None, repeats=1, head_chunks=(16,))
    assert prof.head is not None and prof.head.upcast == (model_type == "modernbert"), prof.head_note
    _, loss, grads = _step(model, batch)
    assert loss.dtype == (torch.float32 if model_type == "modernbert" else torch.bfloat16)
    remat.apply_(model, plan(prof, strategy="none", head="recompute"))
    try:
        _, planned_loss, planned = _step(model, batch)
    finally:
        remat.remove_(model)
    assert torch.equal(loss, planned_loss) and all(torch.equal(grads[n], planned[n]) for n in grads)


def test_num_items_in_batch_reaches_the_loss_as_the_model_passes_it() -> None:
    """ModernBERT hands ``num_items_in_batch`` to ForMaskedLMLoss (the sum over it, as gradient
    accumulation does): 20 items where the batch has 11 labels scales the loss by 11 / 20."""
    model, batch = _built("modernbert")
    batch = {**batch, "num_items_in_batch": torch.tensor(20)}
    prof = profile(model, batch, None, None, repeats=1, head_chunks=(16,))
    assert prof.head is not None, prof.head_note
    _, loss, grads = _step(model, batch)
    _, mean_loss, _ = _step(model, {k: v for k, v in batch.items() if k != "num_items_in_batch"})
    torch.testing.assert_close(loss, mean_loss * 11 / 20)
    for head in ("recompute", "chunked:16"):
        _, planned_loss, planned = planned_step(model, batch, plan(prof, strategy="none", head=head))
        rtol = 0.0 if head == "recompute" else 1e-5
        assert _rel(planned_loss, loss) <= rtol and max_rel_diff([planned[n] for n in grads], [grads[n] for n in grads]) <= rtol


def test_chunked_divides_by_the_labelled_rows() -> None:
    """The chunked loss of 64 rows, 53 of them -100, against F.cross_entropy's mean over the 11
    others: whole chunks without a label add nothing to the sum nor to the count."""
    g = torch.Generator().manual_seed(3)
    hidden, weight, bias = (torch.randn(B * S, H, generator=g), torch.randn(V, H, generator=g) / 8,
                            torch.randn(V, generator=g))
    _, batch = _built("bert")
    labels = batch["labels"].reshape(-1)
    expected = nn.functional.cross_entropy(nn.functional.linear(hidden, weight, bias), labels)
    for chunk in (1, 7, 64):
        loss = chunked_cross_entropy(hidden, weight, bias, LossInputs(labels=labels), TokenLoss(shift=False, upcast=False), chunk)
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0.0)


def test_heads_remat_cannot_stand_in_for_are_refused() -> None:
    """DeBERTa's non-legacy head multiplies by the word embeddings itself (get_output_embeddings()
    is a hidden-to-hidden dense layer); ModernBERT's sparse prediction projects the labelled rows
    alone, so the call without labels would project others."""
    deberta, _ = _built("deberta")
    site, note = find_head(deberta)
    assert site is None and "makes 64 outputs, not the vocabulary's 300" in note
    sparse, _ = _built("modernbert", sparse_prediction=True)
    site, note = find_head(sparse)
    assert site is None and "config.sparse_prediction=True" in note


class _SmoothedBert(transformers.BertForMaskedLM):
    """BERT whose masked-LM loss smooths the labels: not a default CrossEntropyLoss()."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        scores = self.cls(self.bert(input_ids, **kwargs)[0])
        loss = nn.CrossEntropyLoss(label_smoothing=0.1)(scores.view(-1, V), labels.view(-1)) if labels is not None else None
        return transformers.modeling_outputs.MaskedLMOutput(loss=loss, logits=scores)


class _ScaledLossBert(transformers.BertForMaskedLM):
    """BERT whose forward has a default CrossEntropyLoss(), but of its logits halved."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        scores = self.cls(self.bert(input_ids, **kwargs)[0])
        loss = torch.nn.CrossEntropyLoss()(scores.view(-1, V) / 2, labels.view(-1)) if labels is not None else None
        return transformers.modeling_outputs.MaskedLMOutput(loss=loss, logits=scores)


def test_another_loss_is_refused_by_structure_or_on_the_batch() -> None:
    """A loss that is not the default cross-entropy is refused by `find_head` where the forward
    shows it, and by the profile's check on the real batch where it does not."""
    smoothed, batch = _built("bert", cls=_SmoothedBert)
    site, note = find_head(smoothed)
    assert site is None and "neither by transformers' ForMaskedLMLoss" in note
    assert "CrossEntropyLoss()" in note
    scaled, batch = _built("bert", cls=_ScaledLossBert)
    assert find_head(scaled)[0] is not None
    prof = profile(scaled, batch, None, None, repeats=1)
    assert prof.head is None and "is not the token cross-entropy of its projection's output" in prof.head_note
    assert "the labels as given, logits as they are" in prof.head_note


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_byte_model_of_a_head_with_a_bias(tied) -> None:
    """`remat.memory.head` with the logits' bias, against every strategy measured on BERT's head at
    width 256 over 96 tokens (the projection's backward is the keep head's peak): exact, except an
    untied keep head's backward, priced one bias gradient (96 fp32) over, as RemBERT's peak needs."""
    model, batch = _built("bert", hidden_size=256, vocab_size=96, tie_word_embeddings=tied)
    prof = profile(model, batch, None, None, repeats=1, head_chunks=(16,))
    assert prof.head is not None and prof.head.tied == tied, prof.head_note
    shape = HeadShape(batch_size=B, seq_len=S, hidden_size=256, vocab_size=96, dtype_bytes=4, upcast=False, shift=False,
                      tied=tied, bias=True)
    over = {o.strategy: tuple(getattr(head_bytes(shape, o.strategy), f) - getattr(o, f)
                              for f in ("held_bytes", "fwd_peak_bytes", "bwd_peak_bytes")) for o in prof.head.options}
    bias = 0 if tied else 96 * 4
    assert over == {"keep": (0, 0, bias), "recompute": (0, 0, bias), "chunked:16": (0, 0, 0)}
