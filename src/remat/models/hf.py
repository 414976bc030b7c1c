"""Hugging Face models built from a small config dict, random weights, no download: the causal LMs
GPT-2 and Llama, and the encoder-decoder T5 (its v1.1 / mT5 form: gated-GELU feed-forward, the
decoder's output not rescaled before the head; ``num_layers`` in each stack).

The batch is ``dict(input_ids, labels, attention_mask)`` and the loss is ``output.loss`` (T5's
decoder reads the labels shifted right, and predicts the labels as given).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
from torch import nn

HF_FAMILIES = ("gpt2", "llama", "t5")
HF_ATTENTION_KINDS = ("eager", "sdpa")


@dataclass(kw_only=True, frozen=True)
class HFConfig:
    """Sizes of a built-in Hugging Face model."""

    num_layers: int = 2
    """Decoder layers (T5: layers of the encoder, and as many of the decoder)."""
    d_model: int = 128
    """Hidden size."""
    num_heads: int = 4
    """Attention heads; must divide d_model."""
    seq_len: int = 64
    """Tokens per sequence."""
    batch_size: int = 4
    """Sequences per batch."""
    vocab_size: int = 512
    """Vocabulary size."""
    dropout: float = 0.1
    """Dropout probability (GPT-2 and T5; Llama has no dropout by default)."""
    attention: str = "eager"
    """transformers attention implementation: ``"eager"`` (every op visible) or ``"sdpa"``."""

    def __post_init__(self) -> None:
        if self.attention not in HF_ATTENTION_KINDS:
            raise ValueError(
                f"attention={self.attention!r} is not supported for hf models; "
                f"allowed: {', '.join(HF_ATTENTION_KINDS)}."
            )
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
                "pick num_heads that divides d_model."
            )


def gpt2_config(sizes: HFConfig) -> dict:
    """transformers GPT2Config keyword arguments."""
    return dict(
        n_layer=sizes.num_layers, n_embd=sizes.d_model, n_head=sizes.num_heads,
        n_positions=sizes.seq_len, vocab_size=sizes.vocab_size, resid_pdrop=sizes.dropout,
        embd_pdrop=sizes.dropout, attn_pdrop=sizes.dropout, bos_token_id=0, eos_token_id=0,
        use_cache=False,  # training: no key/value cache, as under Hugging Face's own checkpointing
    )


def llama_config(sizes: HFConfig) -> dict:
    """transformers LlamaConfig keyword arguments."""
    return dict(
        num_hidden_layers=sizes.num_layers, hidden_size=sizes.d_model,
        num_attention_heads=sizes.num_heads, num_key_value_heads=sizes.num_heads,
        intermediate_size=4 * sizes.d_model, max_position_embeddings=sizes.seq_len,
        vocab_size=sizes.vocab_size, bos_token_id=0, eos_token_id=0, pad_token_id=None,
        use_cache=False,  # training: no key/value cache, as under Hugging Face's own checkpointing
    )


def t5_config(sizes: HFConfig) -> dict:
    """transformers T5Config keyword arguments (T5 v1.1 / mT5: gated GELU; ``tie_word_embeddings``
    False, as their configs write it, which transformers 5 reads as "the decoder's output is not
    rescaled" and ties the head to the embedding all the same)."""
    return dict(
        num_layers=sizes.num_layers, num_decoder_layers=sizes.num_layers, d_model=sizes.d_model,
        num_heads=sizes.num_heads, d_kv=sizes.d_model // sizes.num_heads, d_ff=4 * sizes.d_model,
        vocab_size=sizes.vocab_size, dropout_rate=sizes.dropout, feed_forward_proj="gated-gelu",
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        use_cache=False,  # training: no key/value cache, as under Hugging Face's own checkpointing
    )


def build_hf_model(family: str, sizes: HFConfig) -> nn.Module:
    """A randomly initialised GPT2LMHeadModel, LlamaForCausalLM or T5ForConditionalGeneration
    (uses the global RNG)."""
    import transformers

    if family == "t5":
        config = transformers.T5Config(**t5_config(sizes))
        config._attn_implementation = sizes.attention
        return transformers.T5ForConditionalGeneration(config)
    if family == "gpt2":
        config = transformers.GPT2Config(**gpt2_config(sizes))
        model_cls = transformers.GPT2LMHeadModel
    elif family == "llama":
        config = transformers.LlamaConfig(**llama_config(sizes))
        model_cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(f"unknown hf family {family!r}; allowed: {', '.join(HF_FAMILIES)}.")
    config._attn_implementation = sizes.attention
    model = model_cls(config)
    model.loss_type = "ForCausalLM"  # GPT2LMHeadModel's name does not say it; transformers would warn
    return model


def make_batch(sizes: HFConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """``dict(input_ids, labels, attention_mask)``; transformers shifts the labels itself."""
    ids = torch.randint(0, sizes.vocab_size, (sizes.batch_size, sizes.seq_len), generator=generator)
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def transformers_available() -> bool:
    """Whether transformers is installed (checked without importing it: that takes seconds)."""
    return importlib.util.find_spec("transformers") is not None
