"""Selective policies on a hand-written attention block's op list."""

import pytest

from remat.plan.policies import POLICIES, attention_core, has_attention_core, knapsack, knapsack_frontier, save_matmuls, saved_ops_for

from plan_toys import block, op

# x -> layer_norm -> qkv addmm -> view/transpose -> QK^T bmm -> div -> softmax -> dropout -> @V bmm
#   -> out-proj addmm -> add; every number is an output/saved byte count or a time in ms.
ATTN_OPS = (
    op("aten.native_layer_norm.default#0", 16, 16, 0.25),
    op("aten.addmm.default#0", 48, 48, 2.0, 300),
    op("aten.view.default#0", 0, 0, 0.0, is_view=True),
    op("aten.bmm.default#0", 64, 0, 1.0, 100),
    op("aten.div.Tensor#0", 64, 0, 0.25),
    op("aten._softmax.default#0", 64, 64, 0.5),
    op("aten.native_dropout.default#0", 80, 80, 0.5, is_random=True),
    op("aten.bmm.default#1", 16, 16, 1.0, 100),
    op("aten.addmm.default#1", 16, 0, 1.0, 100),
    op("aten.add.Tensor#0", 16, 0, 0.125),
)
ATTN = block(0, input_bytes=16, saved_bytes=224, ops=ATTN_OPS)


def test_registry_names():
    assert {"attention-core", "save-matmuls", "knapsack"} <= set(POLICIES)
    with pytest.raises(ValueError, match=r"unknown selective policy 'nope'; allowed: \["):
        saved_ops_for("nope", ATTN)


def test_attention_core_replays_scores_softmax_dropout_and_av():
    # core = bmm#0 .. bmm#1 (QK^T, scale, softmax, dropout, @V); outside it, the ops autograd
    # saves are layer_norm and the qkv projection, and the out-projection is saved as a matmul
    # (autograd keeps nothing of it); the residual add is replayed.
    assert attention_core(ATTN) == ("aten.native_layer_norm.default#0", "aten.addmm.default#0", "aten.addmm.default#1")


def test_attention_core_without_softmax_saves_everything_saved():
    mlp = block(0, input_bytes=4, saved_bytes=8, ops=(op("aten.addmm.default#0", 8, 4, 1.0), op("aten.relu.default#0", 8, 8, 0.5)))
    assert attention_core(mlp) == ("aten.addmm.default#0", "aten.relu.default#0")
    assert has_attention_core(ATTN) and not has_attention_core(mlp)
    # a matmul autograd keeps nothing of (it feeds a dropout) is saved all the same
    drop = block(0, input_bytes=4, saved_bytes=8, ops=(op("aten.addmm.default#0", 8, 0, 1.0),
                                                       op("aten.native_dropout.default#0", 10, 2, 0.5, is_random=True)))
    assert attention_core(drop) == ("aten.addmm.default#0", "aten.native_dropout.default#0")


def test_save_matmuls_includes_cpu_fused_attention():
    assert save_matmuls(ATTN) == ("aten.addmm.default#0", "aten.bmm.default#0", "aten.bmm.default#1", "aten.addmm.default#1")
    fused = block(0, input_bytes=4, saved_bytes=8, ops=(
        op("aten._scaled_dot_product_flash_attention_for_cpu.default#0", 8, 8, 2.0),
        op("aten.gelu.default#0", 8, 8, 0.5),
        op("aten.convolution.default#0", 8, 8, 3.0),
    ))
    assert save_matmuls(fused) == ("aten._scaled_dot_product_flash_attention_for_cpu.default#0", "aten.convolution.default#0")


def test_save_matmuls_saves_the_experts_grouped_matmuls():
    """Hugging Face's MoE layers (Mixtral, Qwen2-MoE, OLMoE in transformers 5) run their experts
    as ``_grouped_mm``: the heaviest calls of the layer, replayed by save-matmuls before."""
    import torch

    import remat
    from tests.zoo.zoo_models import build_zoo

    torch.set_num_threads(1)
    z = build_zoo("mixtral")
    prof = remat.profile(z.model, z.batch, z.loss_fn, z.optimizer, warmup=0, repeats=1)
    experts = [o.key for o in prof.blocks[0].ops if o.name == "aten._grouped_mm.default"]
    assert experts  # the zoo's Mixtral runs them so on the CPU
    saved = remat.plan(prof, strategy="selective:save-matmuls").segments[0].saved_ops
    assert set(experts) <= set(saved)


def _brute_force(block, target):
    import itertools

    items = [o for o in block.ops if not o.is_view]
    best = 0.0
    for r in range(len(items) + 1):
        for combo in itertools.combinations(items, r):
            if sum(o.output_bytes for o in combo) <= target:
                best = max(best, sum(o.time_ms for o in combo))
    return best


@pytest.mark.parametrize("target", [0, 16, 47, 48, 64, 100, 160, 1000])
def test_knapsack_is_exact(target):
    keys = knapsack(ATTN, target_bytes=target)
    chosen = [o for o in ATTN.ops if o.key in keys]
    assert sum(o.output_bytes for o in chosen) <= target
    assert sum(o.time_ms for o in chosen) == _brute_force(ATTN, target)


def test_knapsack_by_hand():
    # 64 bytes: qkv addmm (48 B, 2 ms) + layer_norm (16 B, 0.25 ms) = 2.25 ms, or
    # addmm#0 + bmm#1 (16 B, 1 ms) = 3 ms, or addmm#0 + addmm#1 = 3 ms: the DP finds 3 ms.
    keys = knapsack(ATTN, target_bytes=64)
    assert sum(o.time_ms for o in ATTN.ops if o.key in keys) == 3.0
    assert "aten.addmm.default#0" in keys


def test_knapsack_frontier_is_monotone():
    frontier = knapsack_frontier(ATTN)
    assert frontier[0] == (0, 0.0, ())
    assert all(a[0] < b[0] and a[1] < b[1] for a, b in zip(frontier, frontier[1:]))
    assert frontier[-1][1] == pytest.approx(sum(o.time_ms for o in ATTN.ops))


def test_knapsack_needs_a_target():
    with pytest.raises(ValueError, match="needs a byte target >= 0 for block 'blocks.0', got None"):
        knapsack(ATTN)
