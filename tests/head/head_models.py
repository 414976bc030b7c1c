"""Tiny language models with a head part, built from configs (no download), labels partly -100."""

from __future__ import annotations

import torch

from remat._batch import call_model, compute_loss
from remat.models import build

SIZES = {"num_layers": 2, "d_model": 32, "num_heads": 2, "seq_len": 16, "batch_size": 2, "vocab_size": 300}
"""32 tokens of 300-way logits: the head's 38400-byte fp32 logits outweigh a block's activations."""
IGNORED = 3
"""Labels set to -100 at the start of the first sequence."""
MODELS = ("gpt", "hf:llama", "hf:gpt2")


def tiny(name: str, *, optimizer: str = "adamw", dtype: torch.dtype | None = None, **sizes):
    """``name`` at `SIZES` without dropout, its labels' first `IGNORED` positions -100."""
    extra = {} if name == "hf:llama" else {"dropout": 0.0}
    built = build(name, optimizer=optimizer, **{**SIZES, **extra, **sizes})
    if dtype is not None:
        built.model.to(dtype)
    labels = built.batch["labels"] if isinstance(built.batch, dict) else built.batch[1]
    labels[0, :IGNORED] = -100
    return built


def seeded_step(model, batch):
    """One step from the same random state: (output, loss, every gradient the step made)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(2)
    output = call_model(model, batch)
    loss = compute_loss(output, batch)
    loss.backward()
    return output, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def relative_error(a, b) -> float:
    """The largest difference of ``a`` from ``b`` over ``b``'s largest magnitude."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def planned_step(model, batch, the_plan):
    """`seeded_step` with ``the_plan`` applied, then removed."""
    import remat

    remat.apply_(model, the_plan)
    try:
        return seeded_step(model, batch)
    finally:
        remat.remove_(model)


def assert_heads_verified(model, batch, chunk: int) -> None:
    """`remat.verify` of recompute and chunked:``chunk`` heads, with no block recomputed and with
    every one: it passes, with the measured peak equal to the predicted to the byte."""
    import remat
    from remat.measure.profile import profile
    from remat.plan.planners import plan

    optimizer = torch.optim.AdamW(model.parameters())
    prof = profile(model, batch, None, optimizer, repeats=1, head_chunks=(chunk,))
    for strategy in ("none", "full"):
        for head in ("recompute", f"chunked:{chunk}"):
            result = remat.verify(model, batch, plan(prof, strategy=strategy, head=head), optimizer=optimizer, repeats=1)
            assert result.ok and result.head == head
            assert result.measured_peak_bytes == result.predicted_peak_bytes
