"""Blocks smaller than a layer: the built-in GPT's attention cores named as remat's blocks.

Recomputing every core is Megatron-LM's selective recomputation: each core's checkpoint keeps q,
k and v (views of the qkv projection's output) and the rest of the layer is kept as autograd
saves it. Tiny GPT: 2 layers, batch 2, 2 heads, 16 tokens, head width 16, float32.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

import remat
from remat.models import build
from remat.plan.planners import make_plan
from remat.plan.types import Segment

SIZES = dict(num_layers=2, d_model=32, num_heads=2, seq_len=16, batch_size=2, vocab_size=64)
HEAD_BYTES = 2 * 2 * 16 * 16 * 4
"""One (batch x heads) x 16 x 16 float32 tensor: q, k or v per head, or the scores."""
QKV_BYTES = 2 * 16 * 96 * 4
"""The qkv projection's output (batch x tokens x 3 d_model), which q, k and v view."""


def _gpt():
    return build("gpt", seed=0, optimizer="none", **SIZES)


def _cores_plan(profile):
    segments = tuple(Segment(start=i, stop=i + 1, strategy="recompute") for i in range(profile.num_blocks))
    return make_plan(profile, segments, "every attention core recomputed", None)


def test_attention_cores_are_blocks_with_three_inputs_and_exact_saved_bytes() -> None:
    """Each core is called with q, k, v (one storage, the qkv output); autograd saves, by hand:
    the q and k^T operand copies of the score bmm, the negated mask (bool 16 x 16), the softmax
    output, the dropout mask, and the copies of probs and v for the product with v."""
    built = _gpt()
    profile = remat.profile(built.model, built.batch, loss_fn=built.loss_fn, blocks="blocks.*.attn.core")
    assert [b.name for b in profile.blocks] == ["blocks.0.attn.core", "blocks.1.attn.core"]
    for block in profile.blocks:
        assert block.class_name == "AttentionCore"
        assert [i.argument for i in block.inputs] == ["args[0]", "args[1]", "args[2]"]
        assert {i.storage_bytes for i in block.inputs} == {QKV_BYTES}
        assert len({i.storage for i in block.inputs}) == 1
        assert block.saved_bytes == 6 * HEAD_BYTES + 16 * 16


def test_recomputing_every_core_frees_what_the_cores_save_less_the_qkv_they_keep() -> None:
    """Measured peak = predicted = baseline - 2 x (saved - qkv output); gradients bit-identical;
    the replay runs one bmm per core (it stops once probs, the last saved tensor, exists)."""
    built = _gpt()
    profile = remat.profile(built.model, built.batch, loss_fn=built.loss_fn, blocks="blocks.*.attn.core")
    plan = _cores_plan(profile)
    result = remat.verify(built.model, built.batch, plan, loss_fn=built.loss_fn, repeats=1)
    assert result.grads_identical and result.recompute_counts_match
    freed = 2 * (6 * HEAD_BYTES + 16 * 16 - QKV_BYTES)
    assert result.baseline_peak_bytes - result.measured_peak_bytes == freed
    assert result.measured_peak_bytes == result.predicted_peak_bytes
    bmm = {c.block: (c.baseline_count, c.planned_count) for c in result.op_counts if c.op == "aten.bmm.default"}
    assert bmm == {"blocks.0.attn.core": (6, 7), "blocks.1.attn.core": (6, 7)}


def test_remat_cores_give_the_gradients_of_checkpointing_the_core_by_hand() -> None:
    """remat's plan and `torch.utils.checkpoint` around each core's forward (Megatron's recipe)
    from the same weights and seed: the same loss and gradients, bit for bit."""
    from remat._batch import call_model, compute_loss

    built = _gpt()
    plan = _cores_plan(remat.profile(built.model, built.batch, loss_fn=built.loss_fn, blocks="blocks.*.attn.core"))
    ours = _gpt()
    remat.apply_(ours.model, plan)
    by_hand = _gpt()
    for block in by_hand.model.blocks:
        core = block.attn.core
        core.forward = lambda q, k, v, f=type(core).forward.__get__(core): checkpoint(f, q, k, v, use_reentrant=False)

    results = []
    for run in (ours, by_hand):
        torch.manual_seed(7)
        loss = compute_loss(call_model(run.model, run.batch), run.batch, run.loss_fn)
        loss.backward()
        results.append([loss.detach()] + [p.grad for p in run.model.parameters()])
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)
