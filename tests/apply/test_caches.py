"""Hugging Face key/value caches under a plan: off where gradients are enabled, said once, and the
op counts then match the plan (the profile and verify's baseline run without the cache too).
Tiny configs, random weights, nothing downloaded."""

from __future__ import annotations

import copy

import warnings

import pytest
import torch
from torch import nn

import remat
from remat.checkpointing.caches import CACHE_WARNING, CacheOff, drop_kv_caches
from remat.plan.planners import plan

transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64)
FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(num_key_value_heads=2, **SIZES)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(num_key_value_heads=2, **SIZES)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(num_key_value_heads=2, **SIZES)),
    "gpt-neox": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**SIZES)),
}


def _built(family: str):
    torch.manual_seed(0)
    model = FAMILIES[family]()
    model.config._attn_implementation = "eager"
    assert model.config.use_cache  # the default: a cache in every forward unless told otherwise
    ids = torch.randint(1, 64, (2, 16))
    return model, {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_op_counts_match_the_plan_on_models_with_a_cache(family):
    model, batch = _built(family)
    # full recomputation replays every call of every layer, the cache's included were it on
    check = remat.verify(model, batch, plan(remat.profile(model, batch, repeats=1), strategy="full"), repeats=1)
    mismatched = [c for c in check.op_counts if c.planned_count != c.expected_count]
    assert check.recompute_counts_match and not mismatched, mismatched[:4]
    assert check.grads_identical


def test_an_applied_plan_turns_the_cache_off_in_training_with_a_warning_and_remove_takes_it_back():
    model, batch = _built("llama")
    full = remat.plan(remat.profile(model, batch, repeats=1), strategy="full")
    remat.apply_(model, full)
    with pytest.warns(UserWarning, match=r"use_cache=True is incompatible with remat's recomputation .* Setting "
                                         r"use_cache=False where gradients are enabled"):
        out = model(**batch)
    assert out.past_key_values is None
    out.loss.backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asked for explicitly: no warning, no cache
        assert model(**batch, use_cache=False).past_key_values is None
        with torch.no_grad():  # generation: nothing is replayed, the cache works
            assert model(**batch).past_key_values.get_seq_length() == 16
    remat.remove_(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert model(**batch).past_key_values.get_seq_length() == 16  # as before apply_


def test_only_the_outermost_model_is_hooked_and_a_cache_reaching_a_block_is_dropped_with_the_warning():
    model, _ = _built("llama")
    with CacheOff(model) as off:
        assert len(off.handles) == 1 and model._forward_pre_hooks  # LlamaForCausalLM, not its LlamaModel
    assert not model._forward_pre_hooks
    cache = transformers.DynamicCache(config=model.config)
    with pytest.warns(UserWarning, match="use_cache=True is incompatible"):
        args, kwargs = drop_kv_caches((1, cache), {"past_key_values": cache, "mask": 2})
    assert args == (1, None) and kwargs == {"past_key_values": None, "mask": 2}
    assert CACHE_WARNING.startswith("use_cache=True is incompatible")


def test_an_encoder_whose_config_has_use_cache_is_not_warned_of_a_cache_it_never_makes():
    """BERT's config and signature have ``use_cache`` (for use as a decoder); its masked-LM output has no
    place for a cache, and every remat call warned of one."""
    torch.manual_seed(0)
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=64)
    config = transformers.BertConfig(**sizes)
    model = transformers.BertForMaskedLM(config)
    assert model.config.use_cache
    ids = torch.randint(1, 64, (2, 16))
    batch = {"input_ids": ids, "labels": ids.clone()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        remat.apply_(model, remat.plan(remat.profile(model, batch, repeats=1), strategy="full"))
        model(**batch).loss.backward()
    remat.remove_(model)
    decoder = transformers.BertLMHeadModel(transformers.BertConfig(is_decoder=True, **sizes))
    with CacheOff(decoder) as off:  # as a decoder it caches: hooked
        assert len(off.handles) == 1


class _PrefixTuned(nn.Module):
    """Prefix tuning as peft does it: learned keys and values per layer, handed to the model in a
    key/value cache (`past_key_values`) with every forward."""

    def __init__(self, model, prefix: int = 4) -> None:
        super().__init__()
        self.model = model
        config = model.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        dim = config.hidden_size // config.num_attention_heads
        self.keys = nn.Parameter(torch.randn(config.num_hidden_layers, 1, heads, prefix, dim) * 0.1)
        self.values = nn.Parameter(torch.randn(config.num_hidden_layers, 1, heads, prefix, dim) * 0.1)

    def forward(self, input_ids, labels):
        batch = input_ids.shape[0]
        cache = transformers.DynamicCache(config=self.model.config)
        for layer in range(self.keys.shape[0]):
            cache.update(self.keys[layer].expand(batch, -1, -1, -1), self.values[layer].expand(batch, -1, -1, -1), layer)
        mask = torch.ones(batch, self.keys.shape[3] + input_ids.shape[1], dtype=torch.long)
        return self.model(input_ids=input_ids, labels=labels, past_key_values=cache, attention_mask=mask)


def test_blocks_handed_a_filled_cache_replay_with_the_cache_as_their_forward_found_it():
    """A prefix-tuned model's cache holds the prefix, which each block must see, and each block's
    forward appends its keys and values to it. Replayed with the cache as it was after the
    forward, a block attended to its own keys twice; handed None, it did not see the prefix, so
    such blocks were keep-only. Now a replay gets the cache as the block's forward found it and
    the cache gets back what it held after: every block recomputes, the gradients (the prefix's
    among them) are bit-identical, and the peak is predicted: the cache, holding every layer's
    keys and values, lives as long as a checkpoint holds it, and so does the prefix."""
    torch.manual_seed(0)
    base, batch = _built("llama")
    model = _PrefixTuned(base)
    for p in base.parameters():
        p.requires_grad_(False)
    prof = remat.profile(model, batch, repeats=1)
    assert [b.name for b in prof.blocks] == ["model.model.layers.0", "model.model.layers.1"]
    assert [dict(b.unavailable) for b in prof.blocks] == [{}, {}]
    for plan in (remat.plan(prof, strategy="full"), remat.plan(prof, strategy="none")):
        check = remat.verify(model, batch, plan, repeats=1)
        assert check.grads_identical and check.grad_max_abs_diff == 0.0
        # on the safe side, within 1 % (full: 1,024 bytes over, -0.51 %)
        assert -1.0 < check.peak_error_pct <= 0.0, (plan.block_strategies(), check.peak_error_pct)
    assert plan.block_strategies() == ("keep", "keep") and check.peak_error_pct == 0.0
    full = remat.plan(prof, strategy="full")
    assert full.block_strategies() == ("recompute", "recompute")
    assert full.prediction.peak_bytes < plan.prediction.peak_bytes
    remat.apply_(model, full)
    torch.manual_seed(3)
    model(**batch).loss.backward()
    planned = [model.keys.grad.clone(), model.values.grad.clone()]
    remat.remove_(model)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    model(**batch).loss.backward()
    assert torch.equal(planned[0], model.keys.grad) and torch.equal(planned[1], model.values.grad)
    assert float(model.keys.grad.abs().max()) > 0


def _diffusion_gemma(cls, **text_options):
    """A tiny DiffusionGemma of class ``cls`` (``text_options`` on its text config) and its batch:
    a prompt its encoder layers write to the cache, a canvas its decoder layers read it from."""
    torch.manual_seed(0)
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, global_head_dim=8, max_position_embeddings=128, sliding_window=8,
                num_experts=4, top_k_experts=2, moe_intermediate_size=32, layer_types=["sliding_attention", "full_attention"],
                **text_options)
    vision = dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=4, head_dim=8, patch_size=4, position_embedding_size=64)
    config = transformers.DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=8, boi_token_id=120,
                                               eoi_token_id=121, image_token_id=122)
    model = cls(config).train()
    g = torch.Generator().manual_seed(1)
    batch = dict(input_ids=torch.randint(10, 128, (2, 16), generator=g),
                 decoder_input_ids=torch.randint(10, 128, (2, 8), generator=g))
    return model, batch


def test_a_cache_the_step_reads_is_left_to_the_blocks_that_write_it(tmp_path):
    """DiffusionGemma's encoder layers write the prompt's keys and values into a cache its decoder
    layers then attend to, in every training forward. Handed no empty cache (as remat hands a
    model's blocks, `CacheOff.drop_in`), the encoder wrote nothing and the decoder saw no prompt,
    in the profile, in both of verify's runs and under the plan alike: verify passed while the
    planned model trained another function (the first loss 4.5795 against 4.5455). Now the
    profile finds that the step reads the cache, leaves it to the blocks, and keeps the blocks
    handed one."""
    from remat.checkpointing.caches import SHARED_CACHE

    model, batch = _diffusion_gemma(transformers.DiffusionGemmaForBlockDiffusion)

    def loss_fn(out, b):
        return nn.functional.cross_entropy(out.logits.float().flatten(0, 1), b["decoder_input_ids"].flatten())

    other_prompt = dict(batch, input_ids=torch.randint(10, 128, (2, 16), generator=torch.Generator().manual_seed(99)))
    plain = [loss_fn(model(**b), b).item() for b in (batch, other_prompt)]
    assert plain[0] != plain[1]  # the decoder reads the prompt through the cache
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = remat.profile(model, batch, loss_fn, optimizer, repeats=1, offload_dir=str(tmp_path))
        assert prof.fingerprint.shared_cache
        reasons = [dict(b.unavailable).get("recompute") for b in prof.blocks]
        # the encoder's last layer's output reaches no loss (its keys and values do): no backward
        assert reasons[0] == SHARED_CACHE and reasons[1] and reasons[2:] == [SHARED_CACHE] * 2
        least = remat.plan(prof, budget=min(p.prediction.peak_bytes for p in remat.pareto(prof)))
        check = remat.verify(model, batch, least, loss_fn, optimizer, repeats=1)
        assert check.grads_identical and check.measured_peak_bytes == check.predicted_peak_bytes
        # a block handed the cache may still offload its saved tensors: it writes the cache once
        from remat.plan.planners import make_plan
        from remat.plan.types import Segment

        offload = make_plan(prof, (Segment(start=0, stop=1, strategy="offload:disk"),
                                   *(Segment(start=i, stop=i + 1, strategy="keep") for i in range(1, 4))), "manual", None)
        assert remat.verify(model, batch, offload, loss_fn, optimizer, repeats=1, offload_dir=str(tmp_path)).grads_identical
        for applied_plan in (least, offload):
            remat.apply_(model, applied_plan, offload_dir=str(tmp_path))
            applied = [loss_fn(model(**b), b).item() for b in (batch, other_prompt)]
            remat.remove_(model)
            assert applied == plain, applied_plan.block_strategies()  # the same function, prompt and all


def test_a_cache_the_step_reads_is_found_when_the_loss_cannot_tell():
    """DiffusionGemma's base model trained against the mean square of its last hidden states: a
    final RMSNorm (its epsilon 1e-12 here) makes that 1 whatever the decoder attends to, so one forward's loss with the
    blocks' caches dropped equalled the loss with them, the cache read went unseen, and a plan
    dropped it: the encoder got no gradient (the sweep with LoRA adapters found it). The outputs'
    absolute sums differ; the cache is found read and left to the blocks, and a step under the
    least plan gives every gradient bit for bit, the encoder's among them."""
    model, batch = _diffusion_gemma(transformers.DiffusionGemmaModel, rms_norm_eps=1e-12)

    def loss_fn(out, b):
        return out.last_hidden_state.float().pow(2).mean()

    other = dict(batch, input_ids=torch.randint(10, 128, (2, 16), generator=torch.Generator().manual_seed(99)))
    with torch.no_grad():
        outs = [model(**b).last_hidden_state for b in (batch, other)]
    losses = [loss_fn(model(**b), b).item() for b in (batch, other)]
    assert not torch.allclose(outs[0], outs[1]) and abs(losses[0] - losses[1]) < 1e-6 * losses[0]
    with warnings.catch_warnings():  # no optimizer: its steps during the profile would move the norm's weight
        warnings.simplefilter("ignore")
        prof = remat.profile(model, batch, loss_fn, repeats=1)
        assert prof.fingerprint.shared_cache
        least = remat.pareto(prof)[-1]
        check = remat.verify(model, batch, least, loss_fn, repeats=1)
        assert check.grads_identical and check.measured_peak_bytes == check.predicted_peak_bytes
        reference = copy.deepcopy(model)
        remat.apply_(model, least)
        for m in (reference, model):
            torch.manual_seed(0)
            loss_fn(m(**batch), batch).backward()
        remat.remove_(model)
    grads = {n: p.grad for n, p in reference.named_parameters()}
    assert any(n.startswith("encoder.") and g is not None and float(g.abs().max()) > 0 for n, g in grads.items())
    for n, p in model.named_parameters():
        assert (p.grad is None) == (grads[n] is None), n
        assert p.grad is None or torch.equal(p.grad, grads[n]), n


def test_an_inner_model_asked_for_its_cache_by_name_keeps_it():
    """PI0 calls its vision-language model with ``use_cache=True`` and hands the cache it returns
    to its action expert; its outer module takes no ``use_cache``, so remat turned the cache off at
    the inner model, which returned None, and the profile crashed ('NoneType' object has no
    attribute 'get_seq_length'). A call inside the model that asks for the cache by name keeps it;
    the step reads what the layers write there, so they keep (the vision tower recomputes)."""
    from remat.checkpointing.caches import SHARED_CACHE
    from remat.measure.types import NO_BACKWARD

    torch.manual_seed(0)
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=1, head_dim=8, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                eos_token_id=2, model_type="gemma")
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, image_size=16, patch_size=4, vision_use_head=False)
    config = transformers.PI0Config(vlm_config=dict(model_type="paligemma", text_config=text, vision_config=vision,
                                                    image_token_id=5, projection_dim=32, hidden_size=32),
                                    dit_config=text, chunk_size=4, max_state_dim=8, max_action_dim=8)
    model = transformers.PI0ForConditionalGeneration(config).train()
    g = torch.Generator().manual_seed(16)
    ids = torch.randint(10, 128, (2, 24), generator=g)
    ids[:, 2:18] = 5  # the image's 16 tokens
    batch = dict(state=torch.randn(2, 8, generator=g), noise=torch.randn(2, 4, 8, generator=g),
                 timestep=torch.rand(2, generator=g), input_ids=ids, attention_mask=torch.ones_like(ids),
                 pixel_values=torch.randn(2, 1, 3, 16, 16, generator=g),
                 pixel_attention_mask=torch.ones(2, 1, dtype=torch.bool), actions=torch.randn(2, 4, 8, generator=g))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = remat.profile(model, batch, None, optimizer, repeats=1)
        assert prof.fingerprint.shared_cache
        assert [(b.name, dict(b.unavailable).get("recompute")) for b in prof.blocks] == [
            ("model.vlm.vision_tower.encoder.layers.0", None), ("model.vlm.vision_tower.encoder.layers.1", None),
            # the language model's last layer's output reaches no loss (its keys and values do): no backward
            ("model.vlm.language_model.layers.0", SHARED_CACHE), ("model.vlm.language_model.layers.1", NO_BACKWARD),
            ("model.dit.layers.0", SHARED_CACHE), ("model.dit.layers.1", SHARED_CACHE)]
        plan = remat.plan(prof, strategy="full")
        assert plan.block_strategies() == ("recompute", "recompute", "keep", "keep", "keep", "keep")
        check = remat.verify(model, batch, plan, None, optimizer, repeats=1)
    assert check.grads_identical and check.measured_peak_bytes == check.predicted_peak_bytes
