"""The language model of a vision-language model whose language model transformers offers no
causal LM of its own (Qwen2-VL's, Qwen2.5-VL's, Qwen3-VL's, GLM-4V's): built as its generative
model runs it on text (`TextCausalLM`), for `remat estimate` to trace.

Their generative model (``Qwen2_5_VLForConditionalGeneration``) runs its text model on the
tokens, its ``lm_head`` on the last hidden states and transformers' causal LM loss on the logits;
with no image in the batch its vision tower runs no op. `TextCausalLM` is that path alone: the
text model (transformers' ``AutoModel`` of the text config: embeddings, layers, final norm), a
bias-free ``lm_head`` tied to the embeddings where the vision-language config ties them, and the
same loss. Its parameters are the language model's, and its step saves what the whole model's
saves on text (tests/estimate/test_vision_language.py measures both on the CPU).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["TextCausalLM", "vision_language_of", "has_text_causal_lm"]


def vision_language_of(config: Any) -> str | None:
    """The model type of the vision-language model (transformers' image-text-to-text mapping)
    whose language model ``config`` configures, where transformers has no causal LM for that
    language model alone but a model of it (``AutoModel``): ``"qwen2_5_vl"`` for a
    ``Qwen2_5_VLTextConfig``; None otherwise (a config with a causal LM of its own, an encoder's)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto

    model_type = getattr(config, "model_type", None)
    if model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or model_type not in modeling_auto.MODEL_MAPPING_NAMES:
        return None
    for composite in modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        try:
            sub_configs = getattr(CONFIG_MAPPING[composite], "sub_configs", {})
        except (KeyError, ImportError):  # a model type this install cannot import
            continue
        if sub_configs.get("text_config") is type(config):
            return composite
    return None


def has_text_causal_lm(config: Any, text: Any) -> bool:
    """Whether ``text``, the language model's config of the composite ``config``, is one
    `TextCausalLM` builds: ``config`` a vision-language model (image-text-to-text) and ``text`` of
    a type with a model (``AutoModel``) but no causal LM in transformers (GLM-4.6V keeps GLM-4V's)."""
    from transformers.models.auto import modeling_auto

    model_type = getattr(text, "model_type", None)
    return (getattr(config, "model_type", None) in modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
            and model_type not in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            and model_type in modeling_auto.MODEL_MAPPING_NAMES)


class TextCausalLM(nn.Module):
    """A vision-language model's text path as its generative model runs it (module docstring):
    ``model`` (the text model), ``lm_head``, transformers' causal LM loss on ``labels``."""

    def __init__(self, config: Any, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        import transformers

        self.config = config
        self.model = transformers.AutoModel.from_config(config, dtype=dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.get_input_embeddings().weight

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    @property
    def loss_function(self) -> Any:
        """transformers' causal LM loss, as the generative model's ``self.loss_function``."""
        from transformers.loss.loss_utils import ForCausalLMLoss

        return ForCausalLMLoss

    def forward(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        logits = self.lm_head(hidden)
        loss = None if labels is None else self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)
