"""An applied plan's watch on its model: a batch larger than the profiled one is warned of once
per new size, and Hugging Face checkpointing turned on after apply is refused before the forward
runs. The shapes are the built-in GPT's (4x32 tokens) and a tiny GPT-2's."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import remat
from remat._batch import call_model, compute_loss
from remat.apply.api import apply_, is_applied, remove_
from remat.apply.watch import largest_dims
from remat.models import build


def _gpt():
    torch.manual_seed(0)
    return build("gpt", num_layers=2, d_model=32, num_heads=2, seq_len=32, batch_size=4, vocab_size=64)


def _step(model, batch, loss_fn) -> list[str]:
    """One forward and backward; the messages of the RuntimeWarnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compute_loss(call_model(model, batch), batch, loss_fn).backward()
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_largest_dims_per_rank():
    shapes = ("4x32:int64", "4x16:int64", "2x3x8x8:float32", ":float32", "7:int64")
    assert largest_dims(shapes) == {2: [4, 32], 4: [2, 3, 8, 8], 1: [7]}


def test_a_larger_batch_is_warned_of_once_per_new_size_and_a_smaller_one_not():
    built = _gpt()
    model, batch, loss_fn = built.model, built.batch, built.loss_fn
    plan = remat.plan(remat.profile(model, batch, loss_fn, repeats=1), strategy="full")
    apply_(model, plan)
    assert _step(model, batch, loss_fn) == []  # the profiled batch
    assert _step(model, tuple(t[:2, :16] for t in batch), loss_fn) == []  # smaller in every dimension

    doubled = tuple(t.repeat(2, 1) for t in batch)
    messages = _step(model, doubled, loss_fn)
    assert len(messages) == 1
    assert messages[0].startswith("remat: GPT is called with a tensor of shape 8x32, larger than the batch its plan "
                                  "was made for (largest of that rank: 4x32)")
    assert f"above the plan's predicted {plan.prediction.peak_bytes:,} bytes" in messages[0]
    assert "Profile and plan with the largest batch you train on" in messages[0]
    assert _step(model, doubled, loss_fn) == []  # that size was told
    assert _step(model, tuple(t[:, :16].repeat(2, 1) for t in batch), loss_fn) == []  # no larger than it
    assert _step(model, tuple(t.repeat(3, 1) for t in batch), loss_fn)[0].split(",")[0].endswith("shape 12x32")
    with torch.no_grad():  # inference: no backward, nothing to warn of
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(*tuple(t.repeat(5, 1) for t in batch))
    remove_(model)
    assert model._forward_pre_hooks == {}  # the watch's hook is taken off with the plan
    assert _step(model, tuple(t.repeat(6, 1) for t in batch), loss_fn) == []


def test_a_copy_of_the_applied_model_watches_its_own_calls():
    built = _gpt()
    model, batch, loss_fn = built.model, built.batch, built.loss_fn
    apply_(model, remat.plan(remat.profile(model, batch, loss_fn, repeats=1), strategy="full"))
    twin = copy.deepcopy(model)
    assert len(_step(twin, tuple(t.repeat(2, 1) for t in batch), loss_fn)) == 1
    remove_(twin)
    assert twin._forward_pre_hooks == {} and len(model._forward_pre_hooks) == 1
    assert len(_step(model, tuple(t.repeat(2, 1) for t in batch), loss_fn)) == 1  # the original's sizes are its own
    remove_(model)


def test_hugging_face_checkpointing_turned_on_after_apply_is_refused_before_the_forward():
    pytest.importorskip("transformers")
    built = build("hf:gpt2", num_layers=2, d_model=16, num_heads=2, seq_len=8, batch_size=2, vocab_size=32)
    model, batch = built.model, built.batch
    apply_(model, remat.plan(remat.profile(model, batch, repeats=1), strategy="full"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    calls = []
    handle = model.transformer.h[0].register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(RuntimeError, match=r"Hugging Face gradient checkpointing was turned on in GPT2LMHeadModel after "
                                           r"a remat plan was applied .*model.gradient_checkpointing_disable\(\)"):
        compute_loss(call_model(model, batch), batch).backward()
    assert calls == []  # refused before any layer ran
    with torch.no_grad():
        call_model(model, batch)  # inference is not a step the plan is for
    assert calls == [1]
    model.gradient_checkpointing_disable()
    compute_loss(call_model(model, batch), batch).backward()
    assert calls == [1, 1]
    handle.remove()
    remove_(model)
    assert not is_applied(model)


def test_a_block_replaced_after_apply_is_warned_of_once():
    built = _gpt()
    model, batch, loss_fn = built.model, built.batch, built.loss_fn
    apply_(model, remat.plan(remat.profile(model, batch, loss_fn, repeats=1), strategy="full"))
    assert _step(model, batch, loss_fn) == []
    model.blocks[1] = copy.deepcopy(model.blocks[1])  # a layer swapped by hand: it runs without the plan
    messages = _step(model, batch, loss_fn)
    assert messages == ["remat: block 'blocks.1' of GPT was replaced after the plan was applied: the new module runs "
                        "without the plan (its activations all kept, as the plan did not count) and remat still holds "
                        "the old one. Call remat.remove_(model), then profile and plan the model as it is now."]
    assert _step(model, batch, loss_fn) == []
    remove_(model)


def test_a_head_projection_replaced_after_apply_is_named():
    pytest.importorskip("transformers")
    built = build("hf:llama", num_layers=2, d_model=32, num_heads=2, seq_len=16, batch_size=2, vocab_size=64)
    model, batch = built.model, built.batch
    prof = remat.profile(model, batch, repeats=1, head_chunks=(8,))
    apply_(model, remat.plan(prof, strategy="none", head="chunked:8"))
    model.resize_token_embeddings(72)
    with pytest.raises(ValueError, match=r"^the output projection 'lm_head' of LlamaForCausalLM was replaced after the "
                                         r"plan was applied \(resize_token_embeddings makes a new one\)"):
        compute_loss(call_model(model, batch), batch)
    remove_(model)


def test_a_batch_larger_in_every_dimension_than_each_warned_of_is_warned_of_again():
    """Per-dimension maxima of the shapes warned of let 8x64 through after 4x64 and 8x32 (it peaked
    3.3 times the plan on GPT-2, the two before 1.8 and 1.6 times)."""
    torch.manual_seed(0)
    built = build("gpt", num_layers=2, d_model=32, num_heads=2, seq_len=64, batch_size=4, vocab_size=64)
    model, loss_fn = built.model, built.loss_fn
    profiled = tuple(t[:, :32] for t in built.batch)  # 4x32, positions for 64
    apply_(model, remat.plan(remat.profile(model, profiled, loss_fn, repeats=1), strategy="full"))
    shapes = [(4, 64), (8, 32), (8, 64), (8, 64), (6, 48)]
    told = [len(_step(model, tuple(t.repeat(2, 1)[:b, :s] for t in built.batch), loss_fn)) for b, s in shapes]
    assert told == [1, 1, 1, 0, 0]
    remove_(model)


def test_a_block_wrapped_after_apply_is_not_called_replaced():
    """FSDP1's auto-wrap, torch.compile by assignment or the user's own wrapper hold the block, which
    still runs its planned forward: each was warned of as replaced, with the advice to remove the plan."""

    class Holder(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args, **kwargs):
            return self.inner(*args, **kwargs)

    built = _gpt()
    model, batch, loss_fn = built.model, built.batch, built.loss_fn
    apply_(model, remat.plan(remat.profile(model, batch, loss_fn, repeats=1), strategy="full"))
    model.blocks[0] = Holder(model.blocks[0])
    assert _step(model, batch, loss_fn) == []
    model.blocks[0] = model.blocks[0].inner
    remove_(model)


def test_per_sample_gradient_hooks_are_refused_before_and_after_apply():
    """Opacus's GradSampleModule pairs each layer's forward input with its backward gradient and
    marks every parameter it counts forwards of (``_forward_counter``); under a plan, 12 of 16
    parameters lost their per-sample gradients, silently."""
    built = _gpt()
    model, batch, loss_fn = built.model, built.batch, built.loss_fn
    plan = remat.plan(remat.profile(model, batch, loss_fn, repeats=1), strategy="full")
    apply_(model, plan)
    for p in model.parameters():
        p._forward_counter = 0  # as GradSampleModule(model) marks them
    with pytest.raises(RuntimeError, match=r"^block 'blocks.0' cannot be replayed: per-sample gradients \(Opacus's "
                                           r"GradSampleModule\)"):
        compute_loss(call_model(model, batch), batch, loss_fn)
    remove_(model)
    with pytest.raises(ValueError, match=r"^remat.profile: per-sample gradients \(Opacus's GradSampleModule\)"):
        remat.profile(model, batch, loss_fn, repeats=1)
