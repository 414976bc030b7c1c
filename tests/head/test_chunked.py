"""The chunked projection + cross-entropy against the unchunked one.

What must hold: the loss and every gradient within the strategy's stated tolerance (sums over
tokens in another order; matrix products of chunks of rows, which a BLAS may reduce in another
order than all rows at once), and bit for bit when one chunk holds every row.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from remat.head.chunked import chunk_bounds, chunked_cross_entropy, num_chunks
from remat.head.loss import LossInputs, TokenLoss, reference_loss
from remat.head.strategies import FP32_REASSOCIATION_RTOL, HeadChunked

HF = TokenLoss(shift=True, upcast=True)
GPT = TokenLoss(shift=False, upcast=False)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _pair(batch, seq, hidden, vocab, chunk, loss, *, dtype=torch.float32, bias=False, num_items=None, seed=0):
    """(reference loss and grads, chunked loss and grads) from the same inputs."""
    gen = torch.Generator().manual_seed(seed)
    h0 = torch.randn(batch, seq, hidden, generator=gen).to(dtype)
    w0 = (torch.randn(vocab, hidden, generator=gen) * 0.1).to(dtype)
    b0 = (torch.randn(vocab, generator=gen) * 0.1).to(dtype) if bias else None
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[0, : seq // 3] = -100
    inputs = LossInputs(labels=labels, num_items_in_batch=num_items)
    out = []
    for chunked in (False, True):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        b = b0.clone().requires_grad_() if bias else None
        value = (chunked_cross_entropy(h, w, b, inputs, loss, chunk) if chunked
                 else reference_loss(F.linear(h, w, b), inputs, loss))
        value.backward()
        out.append((value.detach(), h.grad, w.grad, None if b is None else b.grad))
    return out


@pytest.mark.parametrize("loss", [HF, GPT], ids=["hf", "gpt"])
@pytest.mark.parametrize("shape", [(2, 64, 32, 1000, 32), (2, 256, 64, 32000, 128), (4, 33, 16, 77, 10), (2, 16, 8, 64, 1)],
                         ids=["1000-vocab", "32000-vocab", "uneven-chunks", "one-row-chunks"])
def test_fp32_loss_and_gradients_within_tolerance(loss, shape):
    (loss_a, h_a, w_a, _), (loss_b, h_b, w_b, _) = _pair(*shape, loss)
    assert _rel(h_b, h_a) <= FP32_REASSOCIATION_RTOL
    assert _rel(loss_b, loss_a) <= FP32_REASSOCIATION_RTOL
    assert _rel(w_b, w_a) <= FP32_REASSOCIATION_RTOL


def test_one_chunk_for_every_row_is_the_unchunked_head_bit_for_bit():
    (loss_a, h_a, w_a, _), (loss_b, h_b, w_b, _) = _pair(2, 16, 8, 64, 1000, HF)
    assert torch.equal(loss_a, loss_b) and torch.equal(h_a, h_b) and torch.equal(w_a, w_b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_weight_gradient_within_one_rounding_per_chunk(dtype):
    chunk, tokens = 10, 4 * 33
    strategy = HeadChunked(chunk_tokens=chunk)
    (loss_a, h_a, w_a, _), (loss_b, h_b, w_b, _) = _pair(4, 33, 16, 77, chunk, HF, dtype=dtype)
    # the stated tolerance: (chunks + 1) half-ulps of the dtype, 14 chunks here
    assert strategy.relative_tolerance(dtype, tokens) == (num_chunks(tokens, chunk) + 1) * torch.finfo(dtype).eps / 2
    assert _rel(h_b, h_a) <= strategy.relative_tolerance(dtype, tokens)
    assert _rel(w_b, w_a) <= strategy.relative_tolerance(dtype, tokens)
    assert _rel(loss_b, loss_a) <= strategy.relative_tolerance(dtype, tokens)


def test_bias_gradient_and_num_items_in_batch():
    (loss_a, h_a, w_a, b_a), (loss_b, h_b, w_b, b_b) = _pair(2, 40, 16, 50, 7, HF, bias=True, num_items=25)
    assert _rel(h_b, h_a) <= FP32_REASSOCIATION_RTOL
    assert _rel(b_b, b_a) <= FP32_REASSOCIATION_RTOL and _rel(w_b, w_a) <= FP32_REASSOCIATION_RTOL
    # the sum over the non-ignored targets divided by num_items_in_batch, not their mean
    assert _rel(loss_b, loss_a) <= FP32_REASSOCIATION_RTOL


def test_every_label_ignored_gives_nan_as_the_mean_does():
    h = torch.randn(1, 4, 8, requires_grad=True)
    w = torch.randn(10, 8, requires_grad=True)
    inputs = LossInputs(labels=torch.full((1, 4), -100))
    assert torch.isnan(reference_loss(F.linear(h, w), inputs, HF))
    assert torch.isnan(chunked_cross_entropy(h, w, None, inputs, HF, 2))


def test_chunk_bounds_cover_every_row_once():
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert num_chunks(10, 4) == 3 and num_chunks(8, 4) == 2


def test_bad_chunks_shapes_and_autocast_are_refused():
    h, w = torch.randn(1, 4, 8), torch.randn(10, 8)
    inputs = LossInputs(labels=torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"chunk_tokens=0 must be a positive int"):
        chunked_cross_entropy(h, w, None, inputs, HF, 0)
    with pytest.raises(ValueError, match=r"sees 4 rows of hidden states but 6 targets"):
        chunked_cross_entropy(h, w, None, LossInputs(labels=torch.zeros(1, 6, dtype=torch.long)), HF, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match=r"does not run under torch.autocast"):
        chunked_cross_entropy(h, w, None, inputs, HF, 2)
