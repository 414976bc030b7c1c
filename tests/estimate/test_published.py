"""Per-GPU figures against Korthikanti et al. 2022 Table 2 and Megatron-LM's theoretical memory.

The traced model is the built-in GPT with explicit attention (the paper's layer: LayerNorm,
GeLU MLP of 4h, dropout 0.1, bf16). Where the traced model saves exactly what the formula
counts, remat equals the formula to the byte; where PyTorch saves more, the difference is
named and equals the extra bytes, computed by hand:

- LayerNorm keeps its fp32 mean and 1/std per token: 2 norms x 2 x 4 bytes x sb = 16sb per
  layer (split along the sequence under sequence parallelism);
- ``masked_fill`` keeps the negated causal mask it builds: s^2 bool bytes per layer (one per
  layer, not per sequence: never split);
- before the layers, remat counts the positions (``arange``, int64, 8s bytes per micro-batch)
  and not the token ids (the batch is input, not an activation) that Megatron-LM counts as
  ``8sbp``.
"""

from __future__ import annotations

import pytest

from remat.estimate import ModelSource, Parallelism
from remat.estimate.layers import layer_cost
from remat.estimate.pricing import Pricing
from remat.estimate.sharding import StateRecipe
from remat.estimate.trace import trace_source
from remat.memory.allowance import NO_ALLOWANCE
from benchmarks.published_formulas import (
    korthikanti_full,
    korthikanti_layer,
    megatron_activation_sp_selective,
    megatron_weight_and_optimizer,
)

H, A, S, L, V = 64, 4, 64, 8, 128  # hidden, heads, sequence, layers, vocabulary
SOURCE = ModelSource(builtin="gpt", sizes=dict(num_layers=L, d_model=H, num_heads=A, vocab_size=V, dropout=0.1))


@pytest.fixture(scope="module")
def traced():
    return trace_source(SOURCE, seq_len=S)


def _pricing(traced, par: Parallelism, *, micro_batch: int = 2, micro_batches: int = 1, zero: int = 0) -> Pricing:
    recipe = StateRecipe(optimizer="adamw", precision="mixed", zero_stage=zero, fp32_grads=True)
    return Pricing(traced=traced, micro_batch=micro_batch, micro_batches=micro_batches, recipe=recipe, parallelism=par,
                   mfu=0.4, allowance=NO_ALLOWANCE, strategies=("none",))


LAYOUTS = [(1, False), (2, False), (4, False), (2, True), (4, True)]


@pytest.mark.parametrize(("t", "sp"), LAYOUTS)
@pytest.mark.parametrize("b", [1, 3])
def test_layer_bytes_equal_table_2(traced, t: int, sp: bool, b: int) -> None:
    """Every row of Table 2 at tensor-parallel sizes 1, 2, 4 with and without sequence parallelism."""
    layer = _pricing(traced, Parallelism(tensor=t, sequence_parallel=sp), micro_batch=b).layer(b, 1)
    extras = 16 * S * b / (t if sp else 1) + S * S
    kw = dict(s=S, b=b, h=H, a=A, t=t, sequence_parallel=sp)
    assert layer_cost(layer, "none").retained_bytes == korthikanti_layer(**kw) + extras
    assert layer_cost(layer, "selective").retained_bytes == korthikanti_layer(**kw, selective=True) + extras
    # full recomputation keeps the input: 2sbh, split along the sequence under sequence parallelism
    assert layer_cost(layer, "full").retained_bytes == korthikanti_full(s=S, b=b, h=H) / (t if sp else 1)


def test_context_parallelism_splits_every_token(traced) -> None:
    """Context parallelism c: each rank holds s/c tokens of every activation; the mask, made once
    per layer whatever the micro-batch, is not split."""
    one = _pricing(traced, Parallelism()).layer(2, 1)
    two = _pricing(traced, Parallelism(context=2)).layer(2, 1)
    assert two.saved_bytes == (one.saved_bytes - S * S) / 2 + S * S
    assert two.input_bytes == one.input_bytes / 2 and two.fwd_flops == one.fwd_flops / 2


@pytest.mark.parametrize(("t", "p", "v", "m"), [(2, 2, None, 8), (4, 4, None, 2), (2, 4, 2, 8), (4, 2, 2, 4)])
def test_first_stage_activations_equal_megatron(traced, t: int, p: int, v: int | None, m: int) -> None:
    """``compute_activation_memory`` (sequence parallelism, selective recomputation): the first
    stage holds the activations of min(m, p) micro-batches of L/p layers with 1F1B, and
    p (1 + (p - 1)/(p v)) with the interleaved schedule (Korthikanti et al. 2022, section 4.2.3)."""
    b = 2
    par = Parallelism(tensor=t, sequence_parallel=True, pipeline=p, virtual_stages=v or 1)
    pricing = _pricing(traced, par, micro_batch=b, micro_batches=m)
    stage = pricing.stages(b)[0]
    held = stage.in_flight * (stage.pre_bytes + sum(layer_cost(x, "selective").retained_bytes for x in stage.layers))
    megatron = megatron_activation_sp_selective(s=S, b=b, h=H, layers=L, t=t, p=p, virtual=v, micro_batches=m)
    factor = stage.in_flight / p
    extras = factor * (L * (16 * S * b / t + S * S) + p * 8 * S - 8 * S * b * p / t)
    assert held == pytest.approx(megatron + extras, rel=1e-12)


@pytest.mark.parametrize(("t", "p", "d", "zero"), [(1, 1, 1, 0), (2, 1, 4, 1), (4, 2, 2, 0), (2, 4, 8, 1), (8, 1, 2, 1)])
def test_weight_and_optimizer_bytes_equal_megatron(traced, t: int, p: int, d: int, zero: int) -> None:
    """``compute_weight_and_optimizer_memory`` on the most loaded (first) stage: 18 bytes per
    parameter (bf16 weight, fp32 gradient, fp32 master weight and two Adam moments), 6 + 12/d
    with the distributed optimizer (ZeRO-1). Megatron-LM's count leaves out the biases (QKV and
    FC1 biases split, projection and FC2 biases whole), the learned positions (whole) and puts
    1/p of the final LayerNorm on every stage, where the built-in GPT keeps it on the last."""
    pricing = _pricing(traced, Parallelism(tensor=t, pipeline=p, data=d), zero=zero)
    megatron = megatron_weight_and_optimizer(h=H, layers=L, vocab=V, t=t, p=p, d=d, distributed_optimizer=zero == 1,
                                             untied=True)
    per_param = 6 + 12 / d if zero == 1 else 18
    biases = L // p * (7 * H / t + 2 * H)
    final_norm = 0 if p == 1 else -2 * H / p
    state = pricing.state(0)
    assert state.total_bytes - state.buffer_bytes == pytest.approx(
        megatron + per_param * (biases + S * H + final_norm), rel=1e-12)
