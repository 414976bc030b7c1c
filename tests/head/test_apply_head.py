"""A planned head applied in place: gradients against the model without a plan, the model left as
it was (classes, state_dict, tied weights, forward), refusals before any change."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import remat
from remat._batch import call_model, compute_loss
from remat.apply.api import is_applied
from remat.head.strategies import FP32_REASSOCIATION_RTOL
from remat.measure.profile import profile
from remat.models import build
from remat.plan.planners import plan
from head_models import tiny

MODELS = ("gpt", "hf:llama", "hf:gpt2")


def _profiled(name: str):
    built = tiny(name)
    return built, profile(built.model, built.batch, built.loss_fn, built.optimizer, repeats=1, head_chunks=(7,))


@pytest.fixture(scope="module")
def profiled():
    return {name: _profiled(name) for name in MODELS}


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    output = call_model(model, batch)
    loss = compute_loss(output, batch)
    loss.backward()
    return output, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _unplanned_and_planned(built, chosen):
    """One step without a plan, then one with ``chosen`` applied (removed afterwards)."""
    unplanned = _step(built.model, built.batch)
    remat.apply_(built.model, chosen)
    try:
        return unplanned, _step(built.model, built.batch)
    finally:
        remat.remove_(built.model)


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_recompute_head_is_bit_identical(profiled, name):
    built, prof = profiled[name]
    (_, loss, grads), (output, planned_loss, planned) = _unplanned_and_planned(built, plan(prof, strategy="none", head="recompute"))
    assert torch.equal(loss, planned_loss)
    assert all(torch.equal(grads[n], planned[n]) for n in grads)
    if name != "gpt":
        assert output.logits is None and output.loss is not None  # the logits were never kept


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_chunked_head_with_ignored_labels_within_its_tolerance(profiled, name):
    built, prof = profiled[name]
    (_, loss, grads), (_, planned_loss, planned) = _unplanned_and_planned(built, plan(prof, strategy="full", head="chunked:7"))
    assert _rel(planned_loss, loss) <= FP32_REASSOCIATION_RTOL
    assert max(_rel(planned[n], grads[n]) for n in grads) <= FP32_REASSOCIATION_RTOL


@pytest.mark.slow
def test_the_model_is_left_as_it_was(profiled):
    built, prof = profiled["hf:gpt2"]
    model = built.model
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    with torch.no_grad():
        before = model(input_ids=built.batch["input_ids"]).logits
    remat.apply_(model, plan(prof, strategy="none", head="chunked:7"))
    assert type(model).__name__ == "GPT2LMHeadModel" and "forward" in model.__dict__
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    assert model.state_dict().keys() == state.keys() and all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():  # without gradients, the model's own forward: logits and loss
        output = model(**built.batch)
    assert output.logits is not None and output.loss is not None
    remat.remove_(model)
    assert "forward" not in model.__dict__ and "forward" not in model.lm_head.__dict__
    with torch.no_grad():
        assert torch.equal(model(input_ids=built.batch["input_ids"]).logits, before)
    model.train()


def test_a_head_strategy_for_a_model_without_a_head_part_changes_nothing():
    built = build("mlp", depth=2, width=8, batch_size=2, optimizer="none")
    prof = profile(built.model, built.batch, built.loss_fn, repeats=1)
    assert prof.head is None
    with pytest.raises(ValueError, match=r"head strategy 'chunked:4' needs a head part, and this profile has none"):
        plan(prof, head="chunked:4")
    forced = dataclasses.replace(plan(prof, strategy="full"), head="chunked:4")
    with pytest.raises(ValueError, match=r"the plan runs the head as 'chunked:4', but DeepMLP is not a language model"):
        remat.apply_(built.model, forced)
    assert not is_applied(built.model)
    assert all("forward" not in m.__dict__ for m in built.model.modules())


@pytest.mark.slow
def test_num_items_in_batch_reaches_the_chunked_loss(profiled):
    built, prof = profiled["hf:llama"]
    batch = {**built.batch, "num_items_in_batch": 50}  # the loss is the sum over 50 items, not the mean
    unplanned = _step(built.model, batch)
    remat.apply_(built.model, plan(prof, strategy="none", head="chunked:7"))
    try:
        planned = _step(built.model, batch)
    finally:
        remat.remove_(built.model)
    mean = _step(built.model, built.batch)[1]
    assert not torch.allclose(unplanned[1], mean)  # the keyword changes the loss...
    assert _rel(planned[1], unplanned[1]) <= FP32_REASSOCIATION_RTOL  # ...and the chunked head computes it so
    assert max(_rel(planned[2][n], unplanned[2][n]) for n in unplanned[2]) <= FP32_REASSOCIATION_RTOL


def test_auto_takes_the_head_chunks_a_short_batch_needs():
    """64 tokens are too few for the profile's default chunk sizes: the least peak, a chunked
    head's, was out of `auto_`'s reach (its error then blamed the model state)."""
    import remat

    built = tiny("hf:llama", optimizer="sgd", vocab_size=2048)  # the logits set the least peak
    tokens = built.batch["labels"].numel()
    assert tokens < 128  # below the default chunks' reach
    prof = profile(built.model, built.batch, built.loss_fn, built.optimizer, repeats=1, head_chunks=(8,))
    least = remat.pareto(prof)[-1]
    assert least.head == "chunked:8"
    chosen = remat.auto_(built.model, built.batch, built.loss_fn, built.optimizer, budget=least.prediction.peak_bytes,
                         head_chunks=(8,))
    try:
        assert chosen.head == "chunked:8" and chosen.prediction.peak_bytes <= least.prediction.peak_bytes
    finally:
        remat.remove_(built.model)
