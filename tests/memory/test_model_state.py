"""Model state: ZeRO paper formulas, optimizer table vs real optimizers, the diagnosis."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat.memory.diagnose import explain_model_state_overflow, min_world_size, remedies
from remat.memory.model_state import ModelState, model_state, precision, shard_model_state
from remat.memory.optimizer_state import (
    BNB_QMAP_BYTES,
    adam8bit_tensor_bytes,
    optimizer_layout,
    optimizer_state_bytes,
    optimizer_state_bytes_of,
)

PSI = 7_000_000_000  # parameters (divisible by every N below)


@pytest.mark.parametrize("n", [1, 2, 4, 8, 64])
def test_zero_paper_formulas_mixed_precision_adam(n: int) -> None:
    """Rajbhandari et al. 2020, figure 1: 16*Psi, 4*Psi + 12*Psi/N, 2*Psi + 14*Psi/N, 16*Psi/N."""
    state = model_state([(PSI,)], optimizer="adam", precision_name="mixed")
    assert state.total_bytes == 16 * PSI
    per_rank = [shard_model_state(state, world_size=n, zero_stage=s).total_bytes for s in range(4)]
    assert per_rank == [16 * PSI, 4 * PSI + 12 * PSI // n, 2 * PSI + 14 * PSI // n, 16 * PSI // n]


def test_precision_recipes() -> None:
    shapes = [(10, 20), (20,)]  # 220 elements
    assert model_state(shapes, optimizer="adamw", precision_name="fp32").total_bytes == 220 * (4 + 4 + 8)
    assert model_state(shapes, optimizer="adamw", precision_name="bf16").total_bytes == 220 * (2 + 2 + 4)
    assert model_state(shapes, optimizer="sgd", precision_name="mixed").total_bytes == 220 * (2 + 2 + 4)
    with pytest.raises(ValueError, match="unknown precision 'fp8'.*allowed: fp32, mixed"):
        precision("fp8")


def test_zero3_gathered_unit() -> None:
    state = model_state([(800,)], optimizer="adam", precision_name="mixed")
    unit = model_state([(100,)], optimizer="adam", precision_name="mixed")
    out = shard_model_state(state, world_size=4, zero_stage=3, largest_unit=unit)
    # FSDP2 while the unit's backward runs: its weights 200 B and gradients 200 B at full size, the
    # next unit's weights 200 B (prefetched), the unit before's reduce-scatter input 200 B; the
    # rank's shards stay where they are
    assert out.gathered_bytes == 800
    assert out.total_bytes == 16 * 800 // 4 + 800
    # one rank gathers nothing
    assert shard_model_state(state, world_size=1, zero_stage=3, largest_unit=unit).gathered_bytes == 0


def test_bad_sharding_arguments() -> None:
    state = model_state([(8,)])
    with pytest.raises(ValueError, match="zero_stage must be 0, 1, 2 or 3, got 4"):
        shard_model_state(state, world_size=2, zero_stage=4)
    with pytest.raises(ValueError, match="world_size must be an integer >= 1, got 0"):
        shard_model_state(state, world_size=0, zero_stage=1)


def test_table_values_by_hand() -> None:
    assert optimizer_state_bytes("sgd", [(3, 4)]) == 0
    assert optimizer_state_bytes("sgd-momentum", [(3, 4)]) == 48
    assert optimizer_state_bytes("adamw", [(3, 4)]) == 96
    # Adafactor: 3x4 matrix -> 3 row + 4 column statistics; a vector keeps a full second moment
    assert optimizer_state_bytes("adafactor", [(3, 4), (5,)]) == (3 + 4) * 4 + 5 * 4
    assert optimizer_state_bytes("adafactor", [(2, 3, 4)]) == (6 + 8) * 4
    # 8-bit Adam: 10_000 elements -> 2 bytes each + 2 x ceil(10000/256)=40 fp32 absmax; small
    # tensors keep fp32 state; the two 256-entry maps once
    assert adam8bit_tensor_bytes((10_000,)) == 20_000 + 2 * 40 * 4
    assert adam8bit_tensor_bytes((100,)) == 800
    assert optimizer_state_bytes("adam8bit", [(10_000,), (100,)]) == 20_320 + 800 + BNB_QMAP_BYTES
    assert adam8bit_tensor_bytes((10_000,), blocksize=2048) == 20_000 + 2 * 5 * 4
    with pytest.raises(ValueError, match="unknown optimizer 'lion'; allowed: adafactor, adam"):
        optimizer_layout("lion")


def _run_one_step(opt_cls, **kwargs) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    opt = opt_cls(model.parameters(), **kwargs)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize(
    ("name", "opt_cls", "kwargs"),
    [
        ("sgd", torch.optim.SGD, {"lr": 0.1}),
        ("sgd-momentum", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
        ("adam", torch.optim.Adam, {}),
        ("adamw", torch.optim.AdamW, {}),
        ("adafactor", torch.optim.Adafactor, {}),
    ],
)
def test_table_equals_real_optimizer(name: str, opt_cls, kwargs) -> None:
    model, opt = _run_one_step(opt_cls, **kwargs)
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert optimizer_state_bytes_of(opt) == optimizer_state_bytes(name, shapes)


def test_real_adam_counts_host_steps_only_when_asked() -> None:
    model, opt = _run_one_step(torch.optim.Adam)
    num_tensors = len(list(model.parameters()))
    assert optimizer_state_bytes_of(opt, include_host=True) == optimizer_state_bytes_of(opt) + 4 * num_tensors


def test_diagnosis_names_every_remedy_with_numbers() -> None:
    gib = 1024**3
    text = explain_model_state_overflow(
        param_bytes=4 * gib, grad_bytes=4 * gib, optimizer_state_bytes=8 * gib, buffer_bytes=0,
        budget_bytes=10 * gib, optimizer_name="adamw",
    )
    assert "Model state alone needs 16.00 GiB" in text
    assert "by 6.00 GiB" in text
    assert "does not remove parameters, gradients or optimizer-state storage" in text
    assert "ZeRO-1: fits from 4 data-parallel ranks (10.00 GiB per rank)" in text
    assert "ZeRO-2: fits from 2 data-parallel ranks (10.00 GiB per rank)" in text
    assert "ZeRO-3 / FSDP: fits from 2 data-parallel ranks (8.00 GiB per rank)" in text
    # 8-bit: 2**30 params -> 2 GiB + absmax 2*4*2**22 = 32 MiB + 2 KiB maps
    assert "8-bit optimizer state: 10.03 GiB on the device; still does not fit" in text
    assert "optimizer offload to host: 8.00 GiB on the device, 8.00 GiB moved to host memory; fits" in text
    assert explain_model_state_overflow(param_bytes=1, grad_bytes=1, optimizer_state_bytes=1, buffer_bytes=0,
                                        budget_bytes=10, optimizer_name="adam") == ""
    with pytest.raises(ValueError, match="budget_bytes must be positive, got 0"):
        explain_model_state_overflow(param_bytes=1, grad_bytes=1, optimizer_state_bytes=1, buffer_bytes=0,
                                     budget_bytes=0, optimizer_name="adam")


def test_min_world_size_exact_boundary() -> None:
    state = ModelState(param_bytes=100, grad_bytes=100, master_bytes=0, optimizer_state_bytes=800)
    assert min_world_size(state, zero_stage=1, budget_bytes=400) == 4  # 200 + 800/4
    assert min_world_size(state, zero_stage=1, budget_bytes=399) == 5  # 200 + 160
    assert min_world_size(state, zero_stage=1, budget_bytes=200) is None
    assert min_world_size(state, zero_stage=3, budget_bytes=1000) == 1
    names = [r.name for r in remedies(state, budget_bytes=300, param_count=25, optimizer_name="sgd")]
    assert names == ["ZeRO-1", "ZeRO-2", "ZeRO-3 / FSDP", "optimizer offload to host"]


def test_allowance_terms_and_inverse() -> None:
    from remat.memory.allowance import NO_ALLOWANCE, Allowance

    mib = 2**20
    allowance = Allowance()  # 512 MiB context + 32 MiB workspaces + 5% fragmentation
    assert allowance.bytes_for(1000 * mib) == 512 * mib + 32 * mib + 50 * mib
    device = 80 * 2**30
    peak = allowance.max_allocated_bytes(device)
    assert peak + allowance.bytes_for(peak) <= device < peak + 1 + allowance.bytes_for(peak + 1)
    assert NO_ALLOWANCE.max_allocated_bytes(device) == device
    assert Allowance(context_bytes=10, workspace_bytes=0).max_allocated_bytes(10) == 0
    with pytest.raises(ValueError, match="fragmentation_fraction=1.5 must be in \\[0, 1\\)"):
        Allowance(fragmentation_fraction=1.5)
    with pytest.raises(ValueError, match="context_bytes=-1 and workspace_bytes=0 must be >= 0"):
        Allowance(context_bytes=-1, workspace_bytes=0)


def test_zero3_world_size_counts_the_gathered_unit() -> None:
    state = ModelState(param_bytes=1000, grad_bytes=1000, master_bytes=2000, optimizer_state_bytes=4000)
    unit = ModelState(param_bytes=100, grad_bytes=100, master_bytes=0, optimizer_state_bytes=0)
    # n ranks: 8000/n + 2 x (100 + 100) <= 1200  ->  n >= 10
    assert min_world_size(state, zero_stage=3, budget_bytes=1200, largest_unit=unit) == 10
    assert min_world_size(state, zero_stage=3, budget_bytes=1200) == 7
    assert min_world_size(state, zero_stage=3, budget_bytes=400, largest_unit=unit) is None
    # each of the four shards rounds up to a byte at any world size: 404 B from 4000 ranks on
    assert min_world_size(state, zero_stage=3, budget_bytes=404, largest_unit=unit) == 4000
    assert min_world_size(state, zero_stage=3, budget_bytes=403, largest_unit=unit) is None


def test_small_models_get_figures_in_the_unit_that_shows_them():
    """A toy: 1.5 KiB of parameters, no optimizer, against a 2 KiB budget: no "0.00 GiB", no
    "none optimizer state", exact bytes where the figures are compared."""
    text = explain_model_state_overflow(param_bytes=1536, grad_bytes=1536, optimizer_state_bytes=0, buffer_bytes=100,
                                        budget_bytes=2048, optimizer_name="none")
    assert text.splitlines()[0] == (
        "Model state alone needs 3.10 KiB (3,172 bytes) (parameters 1.50 KiB, gradients 1.50 KiB, no optimizer state, "
        "buffers 100 B), more than the budget of 2.00 KiB (2,048 bytes) by 1.10 KiB (1,124 bytes), before any activation."
    )
    assert "GiB" not in text and "none optimizer" not in text
    text = explain_model_state_overflow(param_bytes=3 << 20, grad_bytes=3 << 20, optimizer_state_bytes=6 << 20,
                                        buffer_bytes=0, budget_bytes=10 << 20, optimizer_name="AdamW")
    assert "needs 12.00 MiB (12,582,912 bytes) (parameters 3.00 MiB, gradients 3.00 MiB, AdamW optimizer state 6.00 MiB" in text
    assert "- ZeRO-1: fits from 2 data-parallel ranks (9.00 MiB per rank)." in text


def test_byte_formats():
    from remat._units import format_bytes, format_bytes_exact

    assert [format_bytes(n) for n in (0, 512, 1023, 1024, 1536, 5 << 20, 3 << 29, -2048)] == [
        "0 B", "512 B", "1023 B", "1.00 KiB", "1.50 KiB", "5.00 MiB", "1.50 GiB", "-2.00 KiB"]
    assert format_bytes_exact(512) == "512 B"
    assert format_bytes_exact(3 << 29) == "1.50 GiB (1,610,612,736 bytes)"
