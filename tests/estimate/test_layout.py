"""Parallel layouts: validation, micro-batches in flight, model state per GPU, communication times."""

from __future__ import annotations

import pytest

from remat.estimate.comms import Network, all_reduce_s, bubble_s, data_parallel_s, gather_s
from remat.estimate.parallel import Parallelism
from remat.estimate.sharding import ModelParams, RoleShapes, StateRecipe, check_layers, gpu_state
from benchmarks.published_formulas import interleaved_in_flight, zero_per_rank

MEGATRON = StateRecipe(optimizer="adamw", precision="mixed", zero_stage=1, fp32_grads=True)


def test_in_flight_micro_batches() -> None:
    """1F1B: the first stage holds min(m, p) micro-batches; interleaved: p (1 + (p - 1)/(p v))."""
    assert Parallelism().in_flight(8) == 1.0
    assert Parallelism(pipeline=4).in_flight(2) == 2.0 and Parallelism(pipeline=4).in_flight(16) == 4.0
    assert Parallelism(pipeline=4, virtual_stages=2).in_flight(16) == interleaved_in_flight(4, 2) == 5.5


def test_layout_arithmetic() -> None:
    par = Parallelism(data=16, tensor=2, pipeline=2, context=2, expert=4, expert_tensor=1, sequence_parallel=True)
    assert par.gpus == 128 and par.expert_data == 2 * 2 * 16 // 4 and par.sequence_divisor == 2
    assert par.describe() == "dp16 tp2+sp pp2 cp2 ep4"
    assert Parallelism(tensor=4).expert_tensor_size == 4  # Megatron-LM's default: the tensor-parallel size


def test_bad_layouts() -> None:
    with pytest.raises(ValueError, match="tensor must be an integer >= 1, got 0"):
        Parallelism(tensor=0)
    with pytest.raises(ValueError, match="needs tensor parallelism above 1"):
        Parallelism(sequence_parallel=True)
    with pytest.raises(ValueError, match="virtual_stages=2 interleaves pipeline stages"):
        Parallelism(virtual_stages=2)
    with pytest.raises(ValueError, match=r"expert_load must be >= 1.0 .* got 0.5"):
        Parallelism(expert_load=0.5)
    with pytest.raises(ValueError, match=r"expert tensor x expert parallel = 1 x 8 = 8 must divide tensor x context x data = 4"):
        Parallelism(data=4, expert=8).check_experts()
    with pytest.raises(ValueError, match="4 micro-batch\\(es\\) per step is not a multiple of 8"):
        Parallelism(pipeline=8, virtual_stages=2).check_micro_batches(4)
    with pytest.raises(ValueError, match="80 layers do not split evenly over 3 pipeline stage"):
        check_layers(80, Parallelism(pipeline=3))


def _one_tensor(psi: int) -> ModelParams:
    return ModelParams(pre=RoleShapes(), post=RoleShapes(), tied=RoleShapes(), layers=(RoleShapes(whole=((psi,),)),))


@pytest.mark.parametrize("n", [1, 4, 16, 64, 256, 1024])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_table_1(n: int, stage: int) -> None:
    """Rajbhandari et al. 2020, Table 1 (7.5B parameters, mixed-precision Adam) per data-parallel
    degree; ZeRO-3 without the all-gathered unit, which the table leaves out."""
    psi = 7_500_000_000
    state = gpu_state(_one_tensor(psi), Parallelism(data=n), 0,
                      StateRecipe(optimizer="adam", precision="mixed", zero_stage=stage))
    assert state.total_bytes - state.gathered_bytes == pytest.approx(zero_per_rank(psi, n, stage), abs=4)


def test_megatron_expert_sharding() -> None:
    """Megatron-LM's own case (``tests/unit_tests/training/test_weight_and_optimizer_memory.py``,
    ``_make_args``: hidden 8, 2 layers of which the second is MoE with 4 experts of ffn 16 and a
    shared expert of 8, RMSNorm, vocabulary 32 tied, TP 2, EP 2, expert TP 4, DP 16, distributed
    optimizer) at one pipeline stage: tensor-sharded 256 + 256 attention, 256 dense MLP, 128 shared
    expert and 256 embedding over TP; 72 replicated; 1024 routed-expert parameters over ETP x EP;
    6 + 12/16 bytes per dense parameter and 6 + 12/4 per expert parameter (expert data-parallel 4)."""
    dense = RoleShapes(tensor=((256,), (256,)), whole=((16,),))
    moe = RoleShapes(tensor=((256,), (128,)), whole=((16,), (32,)), expert=((1024,),))
    params = ModelParams(pre=RoleShapes(), post=RoleShapes(whole=((8,),)), tied=RoleShapes(vocab=((256,),)),
                         layers=(dense, moe))
    par = Parallelism(data=16, tensor=2, expert=2, expert_tensor=4)
    assert par.expert_data == 4
    state = gpu_state(params, par, 0, MEGATRON)
    tp_sharded, replicated, expert = (256 + 256 + 256 + 128 + 256) / 2, 16 + 16 + 32 + 8, 1024 / (4 * 2)
    assert state.total_bytes == (tp_sharded + replicated) * (6 + 12 / 16) + expert * (6 + 12 / 4)


def test_tied_embedding_is_copied_to_the_last_stage_and_zero3_gathers_a_unit() -> None:
    layer = RoleShapes(tensor=((400,),), whole=((8,),))
    params = ModelParams(pre=RoleShapes(whole=((16,),)), post=RoleShapes(whole=((4,),)),
                         tied=RoleShapes(vocab=((1000,),)), layers=(layer,) * 4)
    recipe = StateRecipe(optimizer="sgd", precision="fp32", zero_stage=0)  # 4 + 4 bytes per parameter
    first = gpu_state(params, Parallelism(tensor=2, pipeline=2), 0, recipe)
    last = gpu_state(params, Parallelism(tensor=2, pipeline=2), 1, recipe)
    assert first.total_bytes == 8 * (2 * (200 + 8) + 16 + 500)
    assert last.total_bytes == 8 * (2 * (200 + 8) + 4 + 500)  # its own copy of the tied head
    zero3 = gpu_state(params, Parallelism(data=4), 0, StateRecipe(optimizer="sgd", precision="fp32", zero_stage=3))
    unit = 8 * 1000  # the largest unit: the tied embedding, weights and gradients
    assert zero3.gathered_bytes == 2 * unit  # FSDP2: this unit's, the next's weights, the last reduce-scatter


def test_parameters_without_a_gradient_hold_their_weights_alone() -> None:
    """Under mixed precision a trained parameter holds 2 (bf16) + 2 (gradient) + 4 (fp32 master)
    + 8 (AdamW's moments) bytes; one the step gives no gradient, outside the layers or in a layer,
    its 2 bytes of weights alone: the master copy is the optimizer's, of what it updates. On the
    stage that holds it: the layer's on the second stage."""
    layer = RoleShapes(whole=((100,),))
    params = ModelParams(pre=RoleShapes(whole=((10,),)), post=RoleShapes(), tied=RoleShapes(), layers=(layer,) * 2,
                         gradless=RoleShapes(whole=((1000,),)),
                         layer_gradless=(RoleShapes(), RoleShapes(whole=((50,),))))
    recipe = StateRecipe(optimizer="adamw", precision="mixed", zero_stage=0)
    par = Parallelism(pipeline=2)
    first, second = gpu_state(params, par, 0, recipe), gpu_state(params, par, 1, recipe)
    assert (first.param_bytes, first.grad_bytes, first.master_bytes, first.optimizer_state_bytes) == (
        2 * (110 + 1000), 2 * 110, 4 * 110, 8 * 110)
    assert (second.param_bytes, second.grad_bytes, second.master_bytes, second.optimizer_state_bytes) == (
        2 * (100 + 50), 2 * 100, 4 * 100, 8 * 100)
    assert params.count == 10 + 2 * 100 + 1000 + 50


def test_ring_collectives_and_links() -> None:
    """Thakur et al. 2005 ring algorithms: all-reduce 2(g-1)/g, all-gather (g-1)/g of the buffer."""
    net = Network(intra_node_bytes_per_s=400e9, inter_node_bytes_per_s=50e9, gpus_per_node=8)
    assert net.bandwidth(8, 1) == 400e9 and net.bandwidth(2, 8) == 50e9 and net.bandwidth(4, 2) == 400e9
    assert all_reduce_s(4e9, 8, 400e9) == pytest.approx(2 * 7 / 8 * 4e9 / 400e9)
    assert gather_s(4e9, 4, 50e9) == pytest.approx(3 / 4 * 4e9 / 50e9) and gather_s(1.0, 1, 1.0) == 0.0
    par = Parallelism(data=4, tensor=2)  # data-parallel ranks 2 apart: 8 GPUs, inside a node
    assert data_parallel_s(param_bytes=8e9, grad_bytes=16e9, zero_stage=0, par=par, net=net) == all_reduce_s(16e9, 4, 400e9)
    assert data_parallel_s(param_bytes=8e9, grad_bytes=16e9, zero_stage=1, par=par, net=net) == pytest.approx(
        gather_s(16e9, 4, 400e9) + gather_s(8e9, 4, 400e9))
    assert data_parallel_s(param_bytes=8e9, grad_bytes=16e9, zero_stage=3, par=par, net=net) == pytest.approx(
        2 * gather_s(8e9, 4, 400e9) + gather_s(16e9, 4, 400e9))
    assert bubble_s(Parallelism(pipeline=4, virtual_stages=2), 2.0) == pytest.approx(3 / 2 * 2.0)
