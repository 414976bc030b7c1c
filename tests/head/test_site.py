"""Finding a model's head, and refusing the heads that are not a projection followed by the loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.head.site import find_head
from remat.measure.profile import profile
from remat.models import build
from remat.models.gpt import GPT, GPTConfig
from head_models import SIZES, tiny


def test_the_three_language_models():
    gpt, llama, gpt2 = (find_head(tiny(name).model)[0] for name in ("gpt", "hf:llama", "hf:gpt2"))
    assert (gpt.kind, gpt.projection, gpt.labels_arg, gpt.tied) == ("remat-gpt", "head", "targets", False)
    assert (gpt.loss.shift, gpt.loss.upcast, gpt.loss.ignore_index) == (False, False, -100)
    assert (llama.kind, llama.projection, llama.labels_arg, llama.tied) == ("hf-causal-lm", "lm_head", "labels", False)
    assert (llama.loss.shift, llama.loss.upcast) == (True, True)
    assert (gpt2.projection, gpt2.tied) == ("lm_head", True)  # GPT-2 ties lm_head to the token embedding


def test_a_model_without_a_language_model_head_has_none():
    site, why = find_head(build("mlp", depth=2, width=8, batch_size=2).model)
    assert site is None and "is not a language model remat knows the head of" in why


def test_a_projection_that_is_not_a_plain_linear_is_refused():
    model = tiny("gpt").model
    model.head = nn.Sequential(nn.Linear(32, 300, bias=False))
    assert "is Sequential, not a plain nn.Linear" in find_head(model)[1]


def test_a_model_that_names_no_projection_is_told_so():
    model = tiny("gpt").model
    model.head = None
    site, why = find_head(model)
    assert site is None and why == ("GPT names no output projection: not a language model head remat plans "
                                    "(Hugging Face *ForCausalLM, *ForMaskedLM, encoder-decoders, the built-in GPT)")


def test_a_hugging_face_model_with_another_loss_is_refused():
    model = tiny("hf:llama").model
    model.loss_function = lambda logits, labels, vocab_size, **kw: F.cross_entropy(logits.view(-1, vocab_size), labels.view(-1))
    assert "not transformers' ForCausalLMLoss" in find_head(model)[1]


def test_gemma2_soft_capping_is_refused():
    import transformers

    config = transformers.Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=32)
    site, why = find_head(transformers.Gemma2ForCausalLM(config))
    assert site is None and "config.final_logit_softcapping=30.0" in why


def test_a_vision_language_model_keeping_its_vocabulary_in_the_text_config_has_a_head():
    """Gemma3, Idefics2, InternVL, Aria, Kosmos-2 and InstructBLIP keep ``vocab_size`` in
    ``config.text_config``: measuring their head raised AttributeError, so it was never planned."""
    import transformers

    config = transformers.Gemma3Config(
        text_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, intermediate_size=64, vocab_size=64, max_position_embeddings=64,
                         sliding_window=8, use_cache=False),
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                           image_size=32, patch_size=4),
        mm_tokens_per_image=4, image_token_index=63, boi_token_index=61, eoi_token_index=62)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).train()
    assert not hasattr(model.config, "vocab_size")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 60, (2, 16), generator=g)
    ids[:, 1:5] = 63
    batch = {"pixel_values": torch.randn(2, 3, 32, 32, generator=g), "input_ids": ids,
             "token_type_ids": (ids == 63).long(), "labels": ids.clone()}
    result = profile(model, batch, repeats=1, head_chunks=(8,))
    assert result.head_note == "" and [o.strategy for o in result.head.options] == ["keep", "recompute", "chunked:8"]
    assert (result.head.vocab_size, result.head.num_tokens) == (64, 32)
    v = remat.verify(model, batch, remat.plan(result, strategy="full", head="recompute"), repeats=1)
    assert v.ok and v.grads_identical


class ScaledGPT(GPT):
    """A GPT whose loss is not the cross-entropy of its projection's output: it scales the logits."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        logits = 2.0 * self.head(self.ln_f(x))
        return logits if targets is None else F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _scaled_gpt():
    config = GPTConfig(**{k: v for k, v in SIZES.items()}, dropout=0.0)
    model = ScaledGPT(config)
    tokens = torch.randint(0, config.vocab_size, (config.batch_size, config.seq_len + 1))
    return model, (tokens[:, :-1], tokens[:, 1:])


def test_profile_says_why_there_is_no_head_part():
    model, batch = _scaled_gpt()
    assert find_head(model)[0] is not None  # its structure is the GPT's...
    result = profile(model, batch, repeats=1)
    assert result.head is None  # ...but its loss is not the projection's cross-entropy
    assert "the model's loss" in result.head_note and "is not the token cross-entropy of its projection's output" in result.head_note

    built = tiny("hf:llama")
    del built.batch["labels"]
    result = profile(built.model, built.batch, loss_fn=lambda out, batch: out.logits.mean(), repeats=1)
    assert result.head is None and result.head_note == "the loss is a loss_fn outside the model"


class TwoStreamGPT(GPT):
    """Runs two streams through its projection at once (ProphetNet's main and n-gram streams):
    twice as many rows of logits as labels, its loss the mean over both."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        h = self.ln_f(x)
        logits = self.head(torch.stack([h, h.flip(1)]))
        if targets is None:
            return logits[0]
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1).repeat(2))


def test_a_projection_making_more_rows_than_labels_is_said_to():
    model, batch = _scaled_gpt()
    twin = TwoStreamGPT(model.config)
    result = profile(twin, batch, repeats=1)
    rows = batch[1].numel()
    assert result.head is None and result.head_note.startswith(
        f"the output projection makes {2 * rows} rows of logits for {rows} labels")


class EqualScaledGPT(GPT):
    """Divides its logits by 1.0 (Granite's default ``logits_scaling``): the loss is the
    projection's cross-entropy to the bit, but the logits returned are a new tensor, which a
    planned head (it never makes the logits) could not stand in for."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x)) / 1.0
        return logits if targets is None else F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def test_logits_that_are_not_the_projections_own_output_leave_no_head_part():
    import remat

    model = EqualScaledGPT(GPTConfig(**{k: v for k, v in SIZES.items()}, dropout=0.0))
    tokens = torch.randint(0, model.config.vocab_size, (SIZES["batch_size"], SIZES["seq_len"] + 1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    result = profile(model, batch, repeats=1)
    assert result.head is None
    assert result.head_note == ("a call without 'targets' does not return the output projection's own output as its "
                                "logits (the model transforms them after the projection, even if by a factor that "
                                "leaves them equal)")
    with pytest.raises(ValueError, match="head strategy 'chunked:64' needs a head part, and this profile has none"):
        remat.plan(result, strategy="full", head="chunked:64")
    assert all(p.head == "keep" for p in remat.pareto(result))


def test_granite_divides_its_logits_and_gets_no_head_part():
    transformers = pytest.importorskip("transformers")
    config = transformers.GraniteConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    assert config.logits_scaling == 1.0
    model = transformers.GraniteForCausalLM(config)
    ids = torch.randint(0, 64, (2, 16))
    result = profile(model, {"input_ids": ids, "labels": ids.clone()}, repeats=1)
    assert result.head is None and "does not return the output projection's own output" in result.head_note


def test_a_head_strategy_that_raises_is_left_out_with_its_reason(monkeypatch):
    from remat.head.strategies import HeadChunked, HeadKeep

    def refuse(self, call, hidden):
        raise RuntimeError("no kernel for this shape\nsecond line")

    built = tiny("gpt", optimizer="none")
    monkeypatch.setattr(HeadChunked, "loss", refuse)
    result = profile(built.model, built.batch, repeats=1, head_chunks=(8,))
    assert [o.strategy for o in result.head.options] == ["keep", "recompute"]
    assert result.head.unavailable == (("chunked:8", "RuntimeError: no kernel for this shape"),)
    monkeypatch.setattr(HeadKeep, "loss", refuse)  # the model's own head cannot run alone: no head part
    result = profile(built.model, built.batch, repeats=1, head_chunks=(8,))
    assert result.head is None and result.head_note == "measuring the head raised RuntimeError: no kernel for this shape"


def test_default_chunk_sizes():
    from remat.measure.head import chunk_candidates

    assert chunk_candidates(2048) == (1024, 256, 64)
    assert chunk_candidates(512) == (256, 64) and chunk_candidates(128) == (64,) and chunk_candidates(100) == ()
    assert chunk_candidates(2**20) == (2**19, 2**17, 2**15, 2**13)  # four at most


@pytest.mark.parametrize("coef", [0.02, 0.0])
def test_a_router_loss_turned_on_after_profiling_is_refused_not_dropped(coef):
    """Mixtral profiled without router logits gets a planned head; called with
    ``output_router_logits=True`` it adds ``router_aux_loss_coef * aux_loss`` to its loss, which
    the planned head, computing the token cross-entropy alone, dropped (6.2529 for 6.2929 on the
    sweep's model, the load balancing missing from training, no word). Refused; with a zero
    coefficient there is nothing to drop, and the losses agree."""
    import transformers

    config = transformers.MixtralConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64, output_router_logits=False,
                                        router_aux_loss_coef=coef, use_cache=False)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).train()
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    prof = profile(model, batch, head_chunks=(16,), repeats=1)
    plan = remat.plan(prof, head="chunked:16")
    plain = model(**batch, output_router_logits=True).loss
    remat.apply_(model, plan, batch=batch)
    try:
        if coef:
            with pytest.raises(ValueError, match=r"MixtralForCausalLM returned aux_loss beside its logits.*would be "
                                                 r"dropped from training"):
                model(**batch, output_router_logits=True)
        else:
            torch.testing.assert_close(model(**batch, output_router_logits=True).loss, plain)
        model(**batch)  # as profiled: no router loss, the planned head runs
    finally:
        remat.remove_(model)


class _Adapted(nn.Module):
    """A wrapper in peft's way (``PeftModelForCausalLM``): ``get_base_model()``, the call passed
    through with its labels, every other attribute read from the model it wraps."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base_model = base

    def get_base_model(self) -> nn.Module:
        return self.base_model

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        return self.base_model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.base_model, name)


def test_a_wrapped_language_model_has_its_head_planned_through_the_wrapper():
    """peft's LoRA models were told "PeftModelForCausalLM is not a language model remat knows the
    head of": their head and loss stayed in the fixed part, where a large vocabulary peaks."""
    built = tiny("hf:llama")
    model = _Adapted(built.model)
    site, why = find_head(model)
    assert why == "" and (site.kind, site.projection, site.labels_arg) == ("hf-causal-lm", "base_model.lm_head", "labels")
    prof = profile(model, built.batch, repeats=1, head_chunks=(8,))
    assert [o.strategy for o in prof.head.options] == ["keep", "recompute", "chunked:8"]
    for head in ("recompute", "chunked:8"):
        result = remat.verify(model, built.batch, remat.plan(prof, strategy="full", head=head), repeats=1)
        assert result.ok and result.head == head
    assert find_head(_Adapted(build("mlp", depth=2, width=8, batch_size=2).model))[0] is None


class _PassThrough(_Adapted):
    """peft's plain ``PeftModel`` (a LoRA config without a task type): ``forward(*args, **kwargs)``."""

    def forward(self, *args, **kwargs):
        return self.base_model(*args, **kwargs)


def test_a_wrapper_passing_every_argument_through_is_told_how_to_name_its_labels():
    """Its labels are somewhere in ``**kwargs``: the refusal said only "takes no labels argument",
    which read as wrong (the base model gets them and computes its loss); it names the fix."""
    site, why = find_head(_PassThrough(tiny("hf:llama").model))
    assert site is None
    assert why.startswith("_PassThrough.forward takes no labels argument") and "task_type='CAUSAL_LM'" in why
