"""`remat.verify` on head plans: the measured peak is the predicted one to the byte, and the
gradient check states the chunked head's own tolerance instead of loosening every plan's."""

from __future__ import annotations

import pytest

from remat.measure.profile import profile
from remat.plan.planners import plan
from remat.verify import verify
from head_models import tiny


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "hf:llama", "hf:gpt2"])
def test_head_plans_verified(name):
    built = tiny(name)
    prof = profile(built.model, built.batch, built.loss_fn, built.optimizer, repeats=1, head_chunks=(8,))
    for head in ("keep", "recompute", "chunked:8"):
        chosen = plan(prof, strategy="none", head=head)
        check = verify(built.model, built.batch, chosen, built.loss_fn, built.optimizer, repeats=1)
        assert check.head == head and check.recompute_counts_match
        # the post part (head backward) sets the peak of these steps: exact
        assert check.measured_peak_bytes == check.predicted_peak_bytes, head
        if head == "chunked:8":
            assert not check.grads_identical and check.ok
            assert check.relative_tolerance == 1e-5 and 0 < check.grad_max_rel_diff <= 1e-5
            assert "chunked:8 head sums the loss and the projection's gradients over tokens chunk by chunk" in check.tolerance_reason
        else:
            assert check.grads_identical and check.relative_tolerance == 0.0 and check.grad_max_rel_diff == 0.0
    keep = verify(built.model, built.batch, plan(prof, strategy="none"), built.loss_fn, built.optimizer, repeats=1)
    chunked = plan(prof, strategy="none", head="chunked:8")
    assert chunked.prediction.peak_bytes < keep.measured_peak_bytes  # the full logits no longer exist


def test_a_planned_head_with_a_loss_fn_is_refused_before_anything_runs():
    """A chunked or recomputed head returns no logits in training; a loss_fn reading them failed
    inside the user's code with "'NoneType' object is not subscriptable"."""
    built = tiny("hf:llama")
    prof = profile(built.model, built.batch, built.loss_fn, built.optimizer, repeats=1, head_chunks=(8,))
    chunked = plan(prof, strategy="none", head="chunked:8")

    def smoothed(output, batch):
        return output.logits[:, :-1].float().log_softmax(-1).mean()

    with pytest.raises(ValueError, match=r"the plan's head is 'chunked:8': the model's output carries no logits in "
                                         r"training.*Plan the head as keep"):
        verify(built.model, built.batch, chunked, smoothed, built.optimizer, repeats=1)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "hf:llama"])
def test_a_frozen_projection_prices_hidden_states_the_step_frees(name):
    """A frozen output projection (peft's LoRA freezes it) saves only its weight: the step frees
    the hidden states once the head's forward returns, while the head measured alone held them
    throughout. Priced against that keep head, a chunked head (which saves them) came out one
    hidden state (tokens x hidden x 4 = 4096 bytes here) under its measured peak."""
    built = tiny(name)
    projection = built.model.lm_head if name == "hf:llama" else built.model.head
    projection.weight.requires_grad_(False)
    prof = profile(built.model, built.batch, built.loss_fn, built.optimizer, repeats=1, head_chunks=(8,))
    keep = prof.head.option("keep")
    assert prof.head.post_head_bytes == prof.fixed_post_saved_bytes - keep.saved_bytes + keep.bwd_peak_bytes
    for head in ("keep", "chunked:8"):
        check = verify(built.model, built.batch, plan(prof, strategy="none", head=head), built.loss_fn,
                       built.optimizer, repeats=1)
        assert check.ok and check.measured_peak_bytes == check.predicted_peak_bytes, head
