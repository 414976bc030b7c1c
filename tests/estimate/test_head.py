"""`remat estimate` prices the LM head and loss with the planner's byte model of the head.

The toy head: the built-in GPT's, T = 32 tokens (one sequence of 32, or two of 16), H = 32,
V = 300, fp32, no shift and no upcast (`tests/head/test_head_bytes.py` counts the same head by
hand). One row of logits is 300 x 4 = 1200 bytes, all of them L = 38400, the hidden states
T H 4 = 4096; the loss and nll_loss's total weight are 4-byte scalars. The rest of the part
after the layers is what the final LayerNorm saves besides its output (the head's hidden
states): its input, the last layer's output (T H 4 = 4096: saved first there), and its fp32 mean
and 1/std (2 x T x 4 = 256).
"""

from __future__ import annotations

import pytest

from remat.estimate import ModelSource, Parallelism, estimate
from remat.estimate.head import default_chunk_tokens
from remat.estimate.pricing import Pricing
from remat.estimate.sharding import StateRecipe
from remat.estimate.stage import Rates, head_extra_s
from remat.estimate.trace import trace_source
from remat.memory.allowance import NO_ALLOWANCE
from remat.memory.head import HeadShape

GPT = dict(d_model=32, num_heads=2, vocab_size=300, dropout=0.0)
HIDDEN, LOGITS, SCALAR, REST = 4096, 38400, 4, 4096 + 256
WEIGHT = 300 * 32 * 4  # the projection's weight gradient: 38400 bytes
FLOPS = 2 * 32 * 32 * 300  # one more projection: 2 T H V


@pytest.fixture(scope="module")
def toy():
    """The toy GPT with 4 layers, traced at sequence 16 (micro-batch 2: 32 tokens)."""
    return trace_source(ModelSource(builtin="gpt", sizes={**GPT, "num_layers": 4}), seq_len=16, dtype="fp32",
                        gpu_kernels=False)


def _pricing(traced, head: str = "keep", **layout) -> Pricing:
    recipe = StateRecipe(optimizer="adamw", precision="fp32", zero_stage=0)
    return Pricing(traced=traced, micro_batch=2, micro_batches=2, recipe=recipe,
                   parallelism=Parallelism(**layout), mfu=0.4, allowance=NO_ALLOWANCE, strategies=("none",), head=head)


def _bytes(estimates) -> dict[str, tuple[int, int, int, int]]:
    return {h.strategy: (h.logits_bytes, h.held_bytes, h.fwd_peak_bytes, h.bwd_peak_bytes) for h in estimates}


def test_the_toy_head_per_strategy_by_hand():
    result = estimate(ModelSource(builtin="gpt", sizes=GPT), micro_batch=1, seq_len=32, dtype="fp32",
                      gpu_kernels=False, head="chunked:8")
    assert result.head == "chunked:8"
    chunk = 8 * 300 * 4  # 8 rows of logits
    small = 4 * 300 * 4  # the default chunk: T / ceil(V / H) = 32 / 10 -> 4 rows
    assert _bytes(result.head_bytes) == {
        # logits; held: hidden, log-probs, total weight, loss; forward: + the logits themselves;
        # backward: log-probs, their gradient and the logits' gradient at once, + loss and seed
        "keep": (LOGITS, HIDDEN + LOGITS + 2 * SCALAR, HIDDEN + 2 * LOGITS + 2 * SCALAR, HIDDEN + 3 * LOGITS + 2 * SCALAR),
        "recompute": (LOGITS, HIDDEN + SCALAR, HIDDEN + 2 * LOGITS + 2 * SCALAR, HIDDEN + 3 * LOGITS + 2 * SCALAR),
        # held: hidden, count, loss; forward: count, total, one chunk's logits and log-probs, two scalars;
        # backward: hidden, count, loss, seed, the hidden states' and the weight's gradients, 3 chunks
        "chunked:4": (LOGITS, HIDDEN + 2 * SCALAR, HIDDEN + 2 * SCALAR + 2 * small + 2 * SCALAR,
                      HIDDEN + 3 * SCALAR + HIDDEN + WEIGHT + 3 * small),
        "chunked:8": (LOGITS, HIDDEN + 2 * SCALAR, HIDDEN + 2 * SCALAR + 2 * chunk + 2 * SCALAR,
                      HIDDEN + 3 * SCALAR + HIDDEN + WEIGHT + 3 * chunk),
    }
    peaks = {h.strategy: h.post_peak_bytes for h in result.head_bytes}
    assert peaks == {"keep": REST + 119304, "recompute": REST + 119304, "chunked:4": REST + 61004, "chunked:8": REST + 75404}
    assert [h.replay_flops for h in result.head_bytes] == [0, FLOPS, FLOPS, FLOPS]
    # each chunk's backward reads and writes the weight's whole gradient: 8 and 4 chunks of 32 rows
    assert [h.moved_bytes for h in result.head_bytes] == [0, 0, 2 * 8 * WEIGHT, 2 * 4 * WEIGHT]
    assert result.devices[0].strategies[0].recompute_flops == FLOPS  # no layer replays under none


def test_tensor_parallel_splits_the_vocabulary_sequence_parallel_the_held_hidden_states(toy):
    half = LOGITS // 2  # 150 of the 300 logits per token on each of 2 ranks
    keep = ("keep",)
    assert _bytes(_pricing(toy, tensor=2).head_estimates(keep))["keep"] == (
        half, HIDDEN + half + 2 * SCALAR, HIDDEN + 2 * half + 2 * SCALAR, HIDDEN + 3 * half + 2 * SCALAR)
    # sequence parallel: a rank keeps its half of the hidden states and gathers them again; the
    # shard sits beside the gathered copy at the peaks; the rest is split along the sequence
    sp = _pricing(toy, tensor=2, sequence_parallel=True).head_estimates(keep)
    assert _bytes(sp)["keep"] == (half, HIDDEN // 2 + half + 2 * SCALAR, HIDDEN + HIDDEN // 2 + 2 * half + 2 * SCALAR,
                                  HIDDEN + HIDDEN // 2 + 3 * half + 2 * SCALAR)
    assert sp[0].post_peak_bytes == REST // 2 + HIDDEN + HIDDEN // 2 + 3 * half + 2 * SCALAR
    # context parallel: half the tokens, every vocabulary entry; with 16 tokens the backward peaks
    # where the untied weight's gradient (the whole 38400 bytes) is copied to its own layout
    cp = _pricing(toy, context=2).head_estimates(keep)
    backward = HIDDEN // 2 + 2 * SCALAR + HIDDEN // 2 + 2 * WEIGHT
    assert backward > HIDDEN // 2 + 2 * SCALAR + 3 * half
    assert _bytes(cp)["keep"] == (half, HIDDEN // 2 + half + 2 * SCALAR, HIDDEN // 2 + 2 * half + 2 * SCALAR, backward)
    assert cp[0].post_peak_bytes == REST // 2 + backward


def test_the_head_is_on_the_last_pipeline_stage_only(toy):
    first, last = _pricing(toy, "chunked:8", pipeline=2).stages(2)
    assert (first.post_saved_bytes, first.post_working_bytes, first.post_replay_flops) == (0.0, 0.0, 0.0)
    assert last.post_saved_bytes == REST + HIDDEN + 2 * SCALAR
    assert last.post_saved_bytes + last.post_working_bytes == REST + 75404
    assert last.post_replay_flops == FLOPS
    # its time: the replayed projection, or the weight gradient's traffic when that is slower
    moved = 2 * 4 * WEIGHT
    assert last.post_moved_bytes == moved
    assert head_extra_s(last, Rates(flops_per_s=1e12, memory_bytes_per_s=1e9)) == moved / 1e9
    assert head_extra_s(last, Rates(flops_per_s=1e12, memory_bytes_per_s=1e15)) == FLOPS / 1e12
    keep = _pricing(toy, pipeline=2).stages(2)[-1]
    assert (keep.post_saved_bytes, keep.post_saved_bytes + keep.post_working_bytes) == (
        REST + HIDDEN + LOGITS + 2 * SCALAR, REST + 119304)


def test_default_chunk_is_about_the_hidden_states():
    shape = HeadShape(batch_size=1, seq_len=8192, hidden_size=4096, vocab_size=128256, dtype_bytes=2, upcast=True,
                      shift=True, tied=False)
    assert default_chunk_tokens(shape) == 256  # 8192 / ceil(128256 / 4096) = 8192 / 32
    assert default_chunk_tokens(HeadShape(**{**shape.__dict__, "vocab_size": 16032})) == 2048  # a rank of t = 8
    assert default_chunk_tokens(HeadShape(**{**shape.__dict__, "seq_len": 3})) == 1


def test_bad_head_strategies_are_refused(toy):
    with pytest.raises(ValueError, match=r"unknown head strategy 'chunk'.*'chunked' alone"):
        estimate("gpt", head="chunk")
    with pytest.raises(ValueError, match=r"positive number of tokens per chunk"):
        estimate("gpt", head="chunked:0")
    with pytest.raises(ValueError, match=r"head strategy 'chunked' needs an LM head.*with head 'keep'"):
        estimate("mlp", head="chunked")


@pytest.mark.slow
def test_chunked_head_lowers_the_peak_of_llama3_8b_at_its_vocabulary():
    """Llama-3-8B sizes (vocabulary 128256, bf16, sequence 8192) on 8 x H100 under ZeRO-3: with
    the model's own head the fp32 logits (3.9 GiB) and their gradients peak after the layers, and
    nothing fits without recomputation; chunked, the same step fits with 10 GiB to spare."""
    source = ModelSource(hf_family="llama", sizes=dict(hidden=4096, layers=32, heads=32, kv_heads=8,
                                                       intermediate=14336, vocab=128256, seq=8192))
    rows = {}
    for head in ("keep", "chunked"):
        result = estimate(source, seq_len=8192, world_size=8, zero_stage=3, head=head, strategies=("none",))
        rows[head] = result.devices[0].strategies[0]
    T, V, H = 8192, 128256, 4096
    logits = T * V * 4
    keep, chunk = result.head_bytes[0], result.head_bytes[-1]
    assert (keep.strategy, chunk.strategy, keep.logits_bytes) == ("keep", "chunked:256", logits)
    # keep's backward: hidden states (bf16), the loss and its seed, 3 fp32 logits (log-probs,
    # their gradient and the logits' gradient)
    assert keep.bwd_peak_bytes == T * H * 2 + 8 + 3 * logits
    # chunked: hidden, shifted labels, count, loss and seed, the hidden states' and weight's
    # gradients, 3 fp32 chunks of 256 rows
    assert chunk.bwd_peak_bytes == T * H * 2 + T * 8 + 4 + 8 + T * H * 2 + V * H * 2 + 3 * 256 * V * 4
    assert (rows["keep"].peak_phase, rows["keep"].fits) == ("head", False)
    assert "The peak is the LM head's: its logits are 3.91 GiB per GPU, and --head chunked (chunked:256)" in rows["keep"].diagnosis
    assert rows["keep"].diagnosis.endswith("lower there, within the budget.")
    assert rows["chunked"].fits
    # both peak at the head's backward, on top of every layer's saved bytes: they differ by the head alone
    assert rows["keep"].peak_bytes - rows["chunked"].peak_bytes == keep.bwd_peak_bytes - chunk.bwd_peak_bytes > 10 * 2**30
    assert keep.post_peak_bytes - chunk.post_peak_bytes == keep.bwd_peak_bytes - chunk.bwd_peak_bytes


@pytest.mark.slow
def test_the_estimate_is_the_head_measured_on_the_cpu():
    """A tiny Hugging Face Llama (vocabulary 300, width 32, 2 x 16 tokens, fp32), measured by
    `remat.profile` on this machine: every head strategy's bytes, and the peak of the part after
    the layers (`remat.plan.head.head_need_bytes`), are the estimate's to the byte."""
    from remat.measure.profile import profile
    from remat.models import build
    from remat.plan.head import head_need_bytes

    sizes = dict(d_model=32, num_heads=2, vocab_size=300)
    built = build("hf:llama", optimizer="none", num_layers=2, seq_len=16, batch_size=2, **sizes)
    measured = profile(built.model, built.batch, built.loss_fn, None, repeats=1, head_chunks=(4, 8))
    result = estimate(ModelSource(builtin="hf:llama", sizes=sizes), micro_batch=2, seq_len=16, dtype="fp32",
                      gpu_kernels=False, head="chunked:8")
    assert [h.strategy for h in result.head_bytes] == ["keep", "recompute", "chunked:4", "chunked:8"]
    for h in result.head_bytes:
        option = measured.head.option(h.strategy)
        assert (h.held_bytes, h.fwd_peak_bytes, h.bwd_peak_bytes) == (
            option.held_bytes, option.fwd_peak_bytes, option.bwd_peak_bytes), h.strategy
        assert h.post_peak_bytes == head_need_bytes(measured, h.strategy), h.strategy


def test_a_head_the_byte_model_does_not_describe_is_priced_as_traced(toy):
    """When the traced part after the layers saves less than the model of the head says (here: a
    head described with a vocabulary ten times the model's), keep prices the traced part and the
    other strategies are refused."""
    import dataclasses

    wrong = dataclasses.replace(toy, head=dataclasses.replace(
        toy.head, traced=dataclasses.replace(toy.head.traced, vocab_size=3000)))
    assert _pricing(wrong, pipeline=2).head_estimates(("keep",)) == ()
    priced = _pricing(wrong, pipeline=2).stages(2)[-1]
    assert priced.post_saved_bytes == REST + HIDDEN + LOGITS + SCALAR  # what autograd saves: not the loss
    assert priced.post_saved_bytes + priced.post_working_bytes == REST + 119304  # the byte model's keep peak
    with pytest.raises(ValueError, match=r"head strategy 'chunked:8' needs an LM head"):
        _pricing(wrong, "chunked:8", pipeline=2).stages(2)


def test_a_head_phase_peak_the_layers_make_points_at_recomputation():
    """At the head's phase every layer's saved activations are held too: where a chunked head
    alone leaves the step over the budget, the diagnosis no longer calls the peak the head's."""
    source = ModelSource(hf_family="llama", sizes=dict(hidden=4096, layers=32, heads=32, kv_heads=8,
                                                       intermediate=14336, vocab=128256, seq=8192))
    result = estimate(source, seq_len=8192, world_size=2, zero_stage=3, head="keep", strategies=("none",))
    row = result.devices[0].strategies[0]
    assert row.peak_phase == "head" and not row.fits
    assert "The peak falls in the LM head's phase, with every layer's saved activations still held" in row.diagnosis
    assert "what the layers hold is what recomputation lowers" in row.diagnosis
    assert "The peak is the LM head's" not in row.diagnosis


def test_a_head_whose_logits_the_model_transforms_is_not_priced(tmp_path) -> None:
    """Granite divides its logits by ``logits_scaling`` even at 1.0: `remat.profile` plans no head
    there, and the estimate priced a chunked one (the same check, that a call without labels
    returns the projection's own output, now runs on the meta device)."""
    import json

    from remat.estimate import ModelSource, estimate

    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(model_type="granite", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=4, intermediate_size=64, vocab_size=96,
                                    max_position_embeddings=128)))
    answer = estimate(ModelSource(hf_config_path=str(path)), seq_len=32, micro_batch=2, dtype="fp32")
    assert "does not return the output projection's own output as its logits" in answer.head_note
    with pytest.raises(ValueError, match="needs an LM head remat can price"):
        estimate(ModelSource(hf_config_path=str(path)), seq_len=32, micro_batch=2, dtype="fp32", head="chunked")
