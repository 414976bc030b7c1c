"""The words estimate prints when a configuration does not fit, with numbers checked by hand."""

from __future__ import annotations

from remat.estimate.devices import DeviceSpec
from remat.estimate.explain import explain_activation_overflow, explain_state_overflow
from remat.estimate.results import StrategyEstimate
from remat.memory.model_state import model_state, shard_model_state

GIB = 2**30
DEVICE = DeviceSpec(name="Toy-24GB", memory_bytes=24 * GIB, peak_bf16_flops_per_s=1e14)


def test_state_overflow_names_remedies_at_this_setup() -> None:
    """2**32 parameters (4 Gi), mixed-precision AdamW: 2 + 2 + 4 + 8 = 16 bytes each = 64 GiB."""
    psi = 2**32
    whole = model_state([(psi,)], optimizer="adamw", precision_name="mixed")
    rank = shard_model_state(whole, world_size=2, zero_stage=1)  # 8 + 8 + (16 + 32) / 2 = 40 GiB
    text = explain_state_overflow(whole, rank, budget_bytes=19 * GIB, device=DEVICE, optimizer="adamw",
                                  world_size=2, zero_stage=1, param_count=psi)
    assert text.startswith("On Toy-24GB, model state per rank is 40.00 GiB with ZeRO-1 over 2 rank(s) (parameters "
                           "8.00 GiB, gradients 8.00 GiB, fp32 master weights 8.00 GiB, optimizer state 16.00 GiB)")
    assert "above the 19.00 GiB left for tensors (device 24.00 GiB minus the allowance)" in text
    assert "Activation recomputation does not remove parameters, gradients or optimizer-state storage" in text
    assert "- ZeRO-1: from 16 data-parallel ranks." in text  # 16 + 48/n <= 19  ->  n >= 16
    assert "- ZeRO-2: from 6 data-parallel ranks." in text  # 8 + 56/n <= 19  ->  n >= 5.09
    assert "- ZeRO-3 / FSDP: from 4 data-parallel ranks." in text  # 64/n <= 19  ->  n >= 3.37
    # 8-bit state: 2 bytes per parameter + absmax 2 x 4 bytes per 256 -> 8 GiB + 128 MiB (+ 2 KiB maps), halved
    assert "- 8-bit optimizer state (bitsandbytes Adam8bit) at this setup: 28.06 GiB per rank" in text
    assert "- optimizer offload to host at this setup: 16.00 GiB per rank on the device, 24.00 GiB per rank in host memory; fits." in text


def test_activation_overflow_sentence() -> None:
    row = StrategyEstimate(strategy="selective", plan_strategy="selective:attention-core", fits=False,
                           peak_bytes=30 * GIB, allowance_bytes=GIB, activation_bytes=10 * GIB, peak_phase="block",
                           recompute_flops=0, step_s=1.0, max_micro_batch=3)
    rank = model_state([(2**30,)], optimizer="adamw", precision_name="bf16")  # 2 + 2 + 4 bytes = 8 GiB
    text = explain_activation_overflow(row, rank, budget_bytes=20 * GIB, device=DEVICE, micro_batch=8)
    assert text == (
        "On Toy-24GB with selective (selective:attention-core), the step peaks at 30.00 GiB during the block "
        "phase: model state 8.00 GiB per rank plus 10.00 GiB of activations and temporaries at micro-batch 8, "
        "10.00 GiB above the 20.00 GiB left for tensors. The largest micro-batch that fits with selective is 3."
    )
