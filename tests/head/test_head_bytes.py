"""The head's bytes by hand, by formula (`remat.memory.head`) and measured (`remat.profile`): equal.

The toy head: the built-in GPT's, T = 2 x 16 = 32 tokens, H = 32, V = 300, fp32, no shift and
no upcast (its loss is F.cross_entropy of the logits as they are). One row of logits is 300 x 4 =
1200 bytes, all of them L = 32 x 1200 = 38400, the hidden states 32 x 32 x 4 = 4096; the loss and
nll_loss's total weight are 4-byte scalars, and so is the gradient seed of the backward.
"""

from __future__ import annotations

import pytest
import torch

from remat.measure.profile import profile
from remat.memory.head import HeadShape, chunked_bytes, head_bytes, keep_bytes, logits_bytes, projection_flops, recompute_bytes
from head_models import tiny

HIDDEN, LOGITS, SCALAR = 4096, 38400, 4


def test_the_toy_head_by_hand():
    shape = HeadShape(batch_size=2, seq_len=16, hidden_size=32, vocab_size=300, dtype_bytes=4, upcast=False,
                      shift=False, tied=False)
    keep = keep_bytes(shape)
    # forward: hidden, logits, log-probabilities, loss and total weight
    assert keep.fwd_peak_bytes == HIDDEN + 2 * LOGITS + 2 * SCALAR == 80904
    # between: hidden, log-probabilities (log_softmax and nll_loss keep them), total weight, loss
    assert keep.held_bytes == HIDDEN + LOGITS + 2 * SCALAR == 42504
    # backward: log-probabilities, their gradient and the logits' gradient at once, loss and seed
    assert keep.bwd_peak_bytes == HIDDEN + 3 * LOGITS + 2 * SCALAR == 119304
    recompute = recompute_bytes(shape)
    assert (recompute.held_bytes, recompute.fwd_peak_bytes, recompute.bwd_peak_bytes) == (HIDDEN + SCALAR, 80904, 119304)
    chunk = 8 * 300 * 4  # 8 rows of logits: 9600 bytes
    chunked = chunked_bytes(shape, 8)
    # forward: hidden, the fp32 count and the running total, one chunk's logits and log-probs, two scalars
    assert chunked.fwd_peak_bytes == HIDDEN + 2 * SCALAR + 2 * chunk + 2 * SCALAR == 23312
    assert chunked.held_bytes == HIDDEN + SCALAR + SCALAR == 4104  # hidden, count, loss
    # backward: hidden, count, loss, seed; the hidden states' gradient (4096) and the weight's
    # (300 x 32 x 4 = 38400); one chunk's log-probs, their gradient and the logits' gradient
    assert chunked.bwd_peak_bytes == HIDDEN + 3 * SCALAR + HIDDEN + 38400 + 3 * chunk == 75404
    assert logits_bytes(shape) == LOGITS and projection_flops(32, 32, 300) == 2 * 32 * 32 * 300


def test_the_toy_head_frozen_by_hand():
    """A frozen projection (LoRA's head) saves its weight alone: keep holds no hidden states to the
    backward, and no strategy makes the weight's gradient (38400 bytes); recompute's checkpoint
    still holds the hidden states through its backward."""
    shape = HeadShape(batch_size=2, seq_len=16, hidden_size=32, vocab_size=300, dtype_bytes=4, upcast=False,
                      shift=False, tied=False, trained=False)
    keep = keep_bytes(shape)
    assert (keep.held_bytes, keep.fwd_peak_bytes, keep.bwd_peak_bytes) == (LOGITS + 2 * SCALAR, 80904, 3 * LOGITS + 2 * SCALAR)
    recompute = recompute_bytes(shape)
    assert (recompute.held_bytes, recompute.bwd_peak_bytes) == (HIDDEN + SCALAR, HIDDEN + 3 * LOGITS + 2 * SCALAR)
    assert chunked_bytes(shape, 8).bwd_peak_bytes == 75404 - 38400


@pytest.fixture(scope="module")
def measured():
    """Profiles of the toy heads, with chunks of 7 (uneven), 8 and 64 (more than every row)."""
    cases = {"gpt": ("gpt", None), "llama": ("hf:llama", None), "gpt2-tied": ("hf:gpt2", None),
             "llama-bf16": ("hf:llama", torch.bfloat16), "gpt-bf16": ("gpt", torch.bfloat16)}
    out = {}
    for label, (name, dtype) in cases.items():
        built = tiny(name, optimizer="none", dtype=dtype)
        out[label] = profile(built.model, built.batch, built.loss_fn, None, repeats=1, head_chunks=(7, 8, 64))
    return out


FROZEN = {"llama-frozen": ("hf:llama", None, "lm_head"), "llama-bf16-frozen": ("hf:llama", torch.bfloat16, "lm_head"),
          "gpt2-tied-frozen": ("hf:gpt2", None, "transformer.wte"), "gpt-frozen": ("gpt", None, "head")}
"""Heads whose projection is frozen (LoRA's), the layers trained: (model, dtype, module frozen; the
tied GPT-2's head is its token embedding)."""


@pytest.fixture(scope="module")
def measured_frozen():
    out = {}
    for label, (name, dtype, frozen) in FROZEN.items():
        built = tiny(name, optimizer="none", dtype=dtype)
        built.model.get_submodule(frozen).requires_grad_(False)
        out[label] = profile(built.model, built.batch, built.loss_fn, None, repeats=1, head_chunks=(7, 8, 64))
    return out


@pytest.mark.slow
def test_the_measured_toy_head_is_the_hand_count(measured):
    options = {o.strategy: o for o in measured["gpt"].head.options}
    assert [(o.held_bytes, o.fwd_peak_bytes, o.bwd_peak_bytes) for o in (options["keep"], options["recompute"], options["chunked:8"])] == [
        (42504, 80904, 119304), (4100, 80904, 119304), (4104, 23312, 75404)]
    assert options["keep"].saved_bytes == HIDDEN + LOGITS + SCALAR  # what log_softmax and nll_loss save


@pytest.mark.slow
@pytest.mark.parametrize("label", ["gpt", "llama", "gpt2-tied", "llama-bf16", "gpt-bf16"])
def test_every_strategy_measured_is_its_formula(measured, label):
    _check_formulas(measured[label].head, trained=True)


@pytest.mark.slow
@pytest.mark.parametrize("label", list(FROZEN))
def test_a_frozen_head_measured_is_its_formula(measured_frozen, label):
    """The head's bytes with its projection frozen, every strategy, equal to the byte; the head
    inside the step is still the rest plus keep's head alone."""
    prof = measured_frozen[label]
    _check_formulas(prof.head, trained=False)
    keep = prof.head.option("keep")
    assert prof.head.post_head_bytes == prof.fixed_post_saved_bytes - keep.saved_bytes + keep.bwd_peak_bytes


def _check_formulas(head, *, trained: bool) -> None:
    shape = HeadShape(batch_size=2, seq_len=16, hidden_size=head.hidden_size, vocab_size=head.vocab_size,
                      dtype_bytes=torch.finfo(getattr(torch, head.dtype)).bits // 8, upcast=head.upcast,
                      shift=head.kind == "hf-causal-lm", tied=head.tied, trained=trained)
    assert [o.strategy for o in head.options] == ["keep", "recompute", "chunked:7", "chunked:8", "chunked:64"]
    for option in head.options:
        formula = head_bytes(shape, option.strategy)
        assert (option.held_bytes, option.fwd_peak_bytes, option.bwd_peak_bytes) == (
            formula.held_bytes, formula.fwd_peak_bytes, formula.bwd_peak_bytes), option.strategy


@pytest.mark.slow
@pytest.mark.parametrize("label", ["gpt", "llama", "gpt2-tied", "llama-bf16"])
def test_the_head_alone_is_the_head_inside_the_step(measured, label):
    """The step's own head backward (the post window up to the gradient of the hidden states) is
    the rest of the post part's saved bytes plus the keep head measured alone."""
    prof = measured[label]
    keep = prof.head.option("keep")
    rest = prof.fixed_post_saved_bytes - keep.saved_bytes
    assert prof.head.post_head_bytes == rest + keep.bwd_peak_bytes
    assert prof.fixed_post_saved_bytes + prof.fixed_post_bwd_temp_bytes == max(prof.head.post_head_bytes, prof.head.post_rest_bytes)


def test_unknown_strategies_have_no_formula():
    shape = HeadShape(batch_size=1, seq_len=4, hidden_size=2, vocab_size=3, dtype_bytes=4, upcast=True, shift=True, tied=False)
    for bad in ("chunked", "chunked:x", "fused", "keep:2"):
        with pytest.raises(ValueError, match="unknown head strategy"):
            head_bytes(shape, bad)
