"""`remat.estimate.search`: the fastest layouts of N GPUs that fit, on a small GPT."""

from __future__ import annotations

import pytest

from remat.estimate import DeviceSpec, ModelSource, Parallelism, SearchSpace, search
from remat.estimate.fastest import layouts, model_flops
from remat.estimate.fastest import search as search_traced
from remat.estimate.pricing import Pricing
from remat.estimate.sharding import StateRecipe
from remat.estimate.trace import trace_source
from remat.memory.allowance import NO_ALLOWANCE

SOURCE = ModelSource(builtin="gpt", sizes=dict(num_layers=4, d_model=32, num_heads=2, vocab_size=64))
SEQ = 16
DEVICE = DeviceSpec(name="Toy", memory_bytes=2**30, peak_bf16_flops_per_s=1e12, memory_bytes_per_s=1e11,
                    host_link_bytes_per_s=1e10, gpu_link_bytes_per_s=1e11, gpus_per_node=4)
RECIPE = StateRecipe(optimizer="adamw", precision="mixed", zero_stage=1)


@pytest.fixture(scope="module")
def traced():
    return trace_source(SOURCE, seq_len=SEQ)


def test_layouts_of_a_small_space(traced) -> None:
    """4 GPUs, 8 sequences per step, t in (1, 2), c = 1, micro-batch 1: t = 1 with p = 1, 2 (and
    interleaved: 8/2 = 4 micro-batches, 4 layers over 2 x 2 chunks), 4; t = 2 with p = 1, 2 (and
    interleaved): 7 layouts, every one of 4 GPUs."""
    space = SearchSpace(gpus=4, global_batch=8, seq_len=SEQ, tensor=(1, 2), context=(1,), micro_batch=(1,))
    found = list(layouts(space, traced, 8))
    assert len(found) == 7 and len(set(found)) == 7
    assert all(par.gpus == 4 and par.data * b * m == 8 for par, b, m in found)
    assert (Parallelism(data=2, pipeline=2, virtual_stages=2), 1, 4) in found
    assert (Parallelism(data=1, tensor=2, sequence_parallel=True, pipeline=2), 1, 8) in found
    assert not any(par.tensor == 4 for par, _, _ in layouts(SearchSpace(gpus=4, global_batch=8, seq_len=SEQ), traced, 8))


def test_search_returns_the_fastest_that_fit(traced) -> None:
    space = SearchSpace(gpus=4, global_batch=8, seq_len=SEQ)
    found = search_traced(traced, DEVICE, space, recipe=RECIPE, mfu=0.5, allowance=NO_ALLOWANCE, top=4)
    assert len(found) == 4 and [c.step_s for c in found] == sorted(c.step_s for c in found)
    best = found[0]
    pricing = Pricing(traced=traced, micro_batch=best.micro_batch, micro_batches=best.micro_batches,
                      recipe=StateRecipe(optimizer="adamw", precision="mixed", zero_stage=best.zero_stage),
                      parallelism=best.parallelism, mfu=0.5, allowance=NO_ALLOWANCE, strategies=("none",))
    steps = [pricing.price(DEVICE, name, best.micro_batch, DEVICE.memory_bytes).time.total_s
             for name in ("none", "selective", "full", "optimal")]
    assert best.step_s == pytest.approx(min(steps), rel=1e-12)
    assert best.mfu == pytest.approx(model_flops(traced) * 8 / (best.step_s * 4 * 1e12), rel=1e-12)
    assert best.tokens_per_s_per_gpu == pytest.approx(8 * SEQ / best.step_s / 4, rel=1e-12)
    tiny = DeviceSpec(name="Tiny", memory_bytes=10_000, peak_bf16_flops_per_s=1e12)
    assert search_traced(traced, tiny, space, recipe=RECIPE, mfu=0.5, allowance=NO_ALLOWANCE) == []


def test_search_from_a_source_and_a_file_model(tmp_path) -> None:
    found = search(SOURCE, DEVICE, gpus=2, global_batch=4, seq_len=SEQ, top=2, zero_stage=3)
    assert found and all(c.zero_stage == 3 for c in found)
    path = tmp_path / "model.py"
    path.write_text("import torch\nfrom torch import nn\n\ndef build():\n"
                    "    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), torch.ones(2, 4), lambda o, b: o.sum()\n")
    with pytest.raises(ValueError, match="search varies the micro-batch; .* is a file model with a fixed batch"):
        search(f"{path}:build", DEVICE, gpus=2, global_batch=4, seq_len=SEQ)


def test_search_chunks_the_head_when_only_that_fits() -> None:
    """One GPU, a GPT whose 2048-way logits outweigh its layers: a device between the two heads'
    lowest peaks fits only with the chunked head (chunks of 128 tokens / ceil(2048 / 32) = 2 rows),
    which runs one more projection in the backward."""
    big = trace_source(ModelSource(builtin="gpt", sizes=dict(num_layers=2, d_model=32, num_heads=2, vocab_size=2048)),
                       seq_len=128)
    space = SearchSpace(gpus=1, global_batch=1, seq_len=128, micro_batch=(1,), zero=(1,))

    def lowest(head: str) -> float:
        pricing = Pricing(traced=big, micro_batch=1, micro_batches=1, recipe=RECIPE, parallelism=Parallelism(),
                          mfu=0.5, allowance=NO_ALLOWANCE, strategies=("full",), head=head)
        return max(p.peak_bytes for p in pricing.price(DEVICE, "full", 1, DEVICE.memory_bytes).peaks)

    keep, chunked = lowest("keep"), lowest("chunked")
    assert chunked < keep
    between = DeviceSpec(name="Between", memory_bytes=int((keep + chunked) / 2), peak_bf16_flops_per_s=1e12)
    found = search_traced(big, between, space, recipe=RECIPE, mfu=0.5, allowance=NO_ALLOWANCE)
    assert [c.head for c in found] == ["chunked:2"]
    assert search_traced(big, between, space, recipe=RECIPE, mfu=0.5, allowance=NO_ALLOWANCE, heads=("keep",)) == []
    roomy = search_traced(big, DEVICE, space, recipe=RECIPE, mfu=0.5, allowance=NO_ALLOWANCE)
    assert [c.head for c in roomy] == ["keep"]  # keep is the faster where it fits
