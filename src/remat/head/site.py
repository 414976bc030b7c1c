"""Find a model's head: its output projection, where the labels come in, the loss it computes.

A registry keyed by model class (matched by qualified name along the class's MRO, so that
finding a Hugging Face model's head does not import transformers) gives a `HeadKind`: how the
model is called with labels, which module projects the hidden states to logits, its loss
convention (`remat.head.loss.TokenLoss`) and how to return the loss without the logits:

- Hugging Face causal LMs (``PreTrainedModel`` with ``get_output_embeddings()`` and a
  ``labels`` argument): ``labels`` (plus ``num_items_in_batch``, ``shift_labels``), the
  output embeddings, ``ForCausalLMLoss``; the output comes back with ``logits=None``.
- Hugging Face encoder-decoders (``config.is_encoder_decoder``: T5, mT5, UMT5, M2M-100):
  ``labels`` (the decoder's input made of them where a call has none), the output embeddings,
  ``CrossEntropyLoss`` of the logits against the labels as given (`HFSeq2SeqLMHead`);
- Hugging Face masked LMs (``*ForMaskedLM``: BERT's family, ModernBERT, ESM, DistilBERT):
  ``labels``, the output embeddings (what runs before them, BERT's transform, stays in the rest
  of the post part), the labels as given with ``-100`` left out, and either transformers'
  ``ForMaskedLMLoss`` (`HFMaskedLMHead`: fp32 upcast, ``num_items_in_batch``) or
  ``CrossEntropyLoss()`` of the logits as they are (`HFMaskedLMCrossEntropyHead`); a bias the
  model adds after a projection without one (ESM's ``lm_head.bias``) is the site's `logit_bias`;
- the built-in GPT (`remat.models.gpt.GPT`): ``targets``, ``head``, plain cross-entropy; the
  loss is the output, as without a plan.

`find_head` checks what it can see in the structure (a plain ``nn.Linear``, the standard loss,
no known logit transform such as Gemma-2's final soft-capping); `remat.measure.head` then
checks on the real batch that the model's loss is bit for bit the convention's loss of the
projection's output. Any other model has no head part: its loss stays in the fixed part.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.head.loss import LossInputs, TokenLoss, reference_loss

__all__ = ["HeadSite", "HeadKind", "find_head", "kind_named", "bind_call", "capture_projection", "Captured", "KINDS"]

LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Hugging Face config fields of models that change the logits between the projection and the
loss (Gemma-2 soft-capping, Cohere's scale, Granite's scaling): such a head is refused."""


@dataclass(kw_only=True, frozen=True)
class HeadSite:
    """A model's head, found: what runs it and what it computes (no tensors, no modules)."""

    kind: str
    """Registry key of the `HeadKind`: ``"hf-causal-lm"``, ``"hf-seq2seq-lm"`` or ``"remat-gpt"``."""
    projection: str
    """Qualified name of the output projection (an ``nn.Linear``), e.g. ``"lm_head"``."""
    labels_arg: str
    """The forward's argument that carries the labels (``"labels"``, ``"targets"``)."""
    loss: TokenLoss
    """The loss the model computes from the logits."""
    tied: bool
    """The projection's weight is also another module's (input embedding): its gradient waits
    for that module's backward before it is accumulated."""
    logit_bias: str = ""
    """Qualified name of a parameter the model adds to the projection's output before the loss
    (ESM's ``lm_head.bias``: its projection has no bias of its own); "" for none."""


class HeadKind:
    """How one family of models runs its head (subclasses are the registry's values)."""

    name = ""
    labels_arg = "labels"
    token_loss = TokenLoss(shift=True, upcast=True)

    def projection(self, model: nn.Module) -> nn.Module | None:
        raise NotImplementedError

    def refusal(self, model: nn.Module) -> str:
        """Why this model's head cannot be planned, from its structure ('' when it can)."""
        return ""

    def logit_bias(self, model: nn.Module, projection: nn.Linear) -> str:
        """Qualified name of the parameter the model adds to the projection's output ("" for none)."""
        return ""

    def loss_inputs(self, arguments: dict[str, Any]) -> LossInputs:
        """The labels and loss keywords of one call (bound arguments of the forward)."""
        return LossInputs(labels=arguments[self.labels_arg])

    def loss_extra(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments the model passes on to its loss besides logits and labels."""
        return {}

    def model_loss(self, model: nn.Module, logits: torch.Tensor, inputs: LossInputs, extra: dict[str, Any]) -> torch.Tensor:
        """The loss exactly as the model computes it from ``logits``."""
        return reference_loss(logits, inputs, self.token_loss)

    def without_labels(self, model: nn.Module, arguments: dict[str, Any]) -> None:
        """Make the bound ``arguments`` of a call with labels those of the same call without them
        (in place): the model then computes its logits and no loss."""
        arguments[self.labels_arg] = None

    def output(self, output: Any, loss: torch.Tensor) -> Any:
        """The output of a call made without labels, turned into that of the call with them
        (and without logits)."""
        return loss

    def logits_of(self, output: Any) -> Any:
        """What the model returned as logits from a call without labels."""
        return output


class GPTHead(HeadKind):
    """`remat.models.gpt.GPT`: ``forward(idx, targets)``, ``head``, mean cross-entropy."""

    name = "remat-gpt"
    labels_arg = "targets"
    token_loss = TokenLoss(shift=False, upcast=False)

    def projection(self, model: nn.Module) -> nn.Module | None:
        return getattr(model, "head", None)


class HFCausalLMHead(HeadKind):
    """Hugging Face ``*ForCausalLM``: ``labels``, ``get_output_embeddings()``, ``ForCausalLMLoss``."""

    name = "hf-causal-lm"

    def projection(self, model: nn.Module) -> nn.Module | None:
        get = getattr(model, "get_output_embeddings", None)
        return get() if callable(get) else None

    def refusal(self, model: nn.Module) -> str:
        transformed = _logits_transformed(model)
        if transformed:
            return transformed
        if "labels" not in inspect.signature(model.forward).parameters:
            if callable(getattr(type(model), "get_base_model", None)):  # peft's PeftModel: forward(*args, **kwargs)
                return (f"{type(model).__name__}.forward takes no labels argument (it hands *args and **kwargs to the "
                        "base model, so remat cannot tell where the labels are); make the adapter with "
                        "LoraConfig(task_type='CAUSAL_LM'), whose PeftModelForCausalLM takes labels by name")
            return f"{type(model).__name__}.forward takes no labels argument"
        loss_fn = getattr(model, "loss_function", None)
        if getattr(loss_fn, "__name__", "") != "ForCausalLMLoss":
            return (f"{type(model).__name__}'s loss is {getattr(loss_fn, '__name__', type(loss_fn).__name__)}, "
                    "not transformers' ForCausalLMLoss")
        return ""

    def loss_inputs(self, arguments: dict[str, Any]) -> LossInputs:
        extra = arguments.get("kwargs", {})
        return LossInputs(labels=arguments["labels"], num_items_in_batch=extra.get("num_items_in_batch"),
                          shift_labels=extra.get("shift_labels"))

    def model_loss(self, model: nn.Module, logits: torch.Tensor, inputs: LossInputs, extra: dict[str, Any]) -> torch.Tensor:
        return model.loss_function(logits=logits, labels=inputs.labels, vocab_size=_text_config(model).vocab_size, **extra)

    def loss_extra(self, arguments: dict[str, Any]) -> dict[str, Any]:
        return dict(arguments.get("kwargs", {}))

    def output(self, output: Any, loss: torch.Tensor) -> Any:
        if not hasattr(output, "items"):
            raise ValueError(
                f"the model returned {type(output).__name__}; a planned head needs the Hugging Face output "
                "object. Call the model with return_dict=True (the default) or plan the head as keep."
            )
        fields = {k: v for k, v in output.items() if k not in ("loss", "logits")}
        return type(output)(loss=loss, **fields)

    def logits_of(self, output: Any) -> Any:
        return getattr(output, "logits", None)


class HFSeq2SeqLMHead(HFCausalLMHead):
    """Hugging Face encoder-decoders (``*ForConditionalGeneration`` with ``config.is_encoder_decoder``:
    T5, mT5, UMT5, M2M-100): the decoder's input is the labels shifted right
    (``prepare_decoder_input_ids_from_labels``), and the loss is ``CrossEntropyLoss`` of the
    logits as they are against the labels as given: no shift, no fp32 upcast, the mean over the
    labels not ``-100``. A call without labels gets the decoder's input the model would have made
    of them."""

    name = "hf-seq2seq-lm"
    token_loss = TokenLoss(shift=False, upcast=False)

    def refusal(self, model: nn.Module) -> str:
        transformed = _logits_transformed(model)
        if transformed:
            return transformed
        parameters = inspect.signature(model.forward).parameters
        if "labels" not in parameters or "decoder_input_ids" not in parameters:
            return f"{type(model).__name__}.forward takes no labels and decoder_input_ids arguments"
        if _decoder_input_maker(model) is None:
            return (f"{type(model).__name__} makes its decoder's input from its labels in a way remat does not know "
                    "(no prepare_decoder_input_ids_from_labels, nor its module's shift_tokens_right(input_ids, "
                    "pad_token_id, decoder_start_token_id))")
        return ""

    def loss_inputs(self, arguments: dict[str, Any]) -> LossInputs:
        return LossInputs(labels=arguments["labels"])  # the model's loss takes no num_items_in_batch

    def loss_extra(self, arguments: dict[str, Any]) -> dict[str, Any]:
        return {}

    def model_loss(self, model: nn.Module, logits: torch.Tensor, inputs: LossInputs, extra: dict[str, Any]) -> torch.Tensor:
        return reference_loss(logits, inputs, self.token_loss)

    def without_labels(self, model: nn.Module, arguments: dict[str, Any]) -> None:
        labels = arguments.get(self.labels_arg)
        if labels is not None and arguments.get("decoder_input_ids") is None and \
                arguments.get("decoder_inputs_embeds") is None:
            arguments["decoder_input_ids"] = _decoder_input_maker(model)(labels)
        arguments[self.labels_arg] = None


class HFMaskedLMHead(HFCausalLMHead):
    """Hugging Face ``*ForMaskedLM`` whose forward calls ``self.loss_function``, transformers'
    ``ForMaskedLMLoss`` (ModernBERT, EuroBERT): the logits upcast to fp32, the labels as given
    (no shift), ``-100`` left out, the mean over the others or the sum over
    ``num_items_in_batch``. The projection is ``get_output_embeddings()``; what runs before it
    (a dense layer, an activation, a norm) stays in the rest of the post part."""

    name = "hf-masked-lm"
    token_loss = TokenLoss(shift=False, upcast=True)

    def refusal(self, model: nn.Module) -> str:
        return _masked_lm_refusal(model, self.projection(model)) or self._loss_refusal(model)

    def _loss_refusal(self, model: nn.Module) -> str:
        loss_fn = getattr(model, "loss_function", None)
        if getattr(loss_fn, "__name__", "") != "ForMaskedLMLoss":
            return (f"{type(model).__name__}'s loss is {getattr(loss_fn, '__name__', type(loss_fn).__name__)}, "
                    "not transformers' ForMaskedLMLoss")
        return ""

    def logit_bias(self, model: nn.Module, projection: nn.Linear) -> str:
        """A projection without a bias whose parent module holds one of the vocabulary's size
        (ESM's ``lm_head``: ``decoder(x) + bias``); `remat.measure.head` checks on the real batch
        that the model's logits are the projection's output plus it."""
        if projection.bias is not None:
            return ""
        name = next(n for n, m in model.named_modules() if m is projection)
        parent_name = name.rpartition(".")[0]
        parent = model.get_submodule(parent_name)
        bias = parent._parameters.get("bias")
        if isinstance(bias, torch.Tensor) and tuple(bias.shape) == (projection.out_features,):
            return f"{parent_name}.bias" if parent_name else "bias"
        return ""

    def loss_inputs(self, arguments: dict[str, Any]) -> LossInputs:
        extra = arguments.get("kwargs", {})  # ForMaskedLMLoss reads num_items_in_batch, no shift_labels
        return LossInputs(labels=arguments["labels"], num_items_in_batch=extra.get("num_items_in_batch"))


class HFMaskedLMCrossEntropyHead(HFMaskedLMHead):
    """Hugging Face ``*ForMaskedLM`` that computes its loss inline, as BERT's copies do
    (BERT, RoBERTa, ESM, DeBERTa's legacy head, ALBERT, ELECTRA: ``CrossEntropyLoss()(logits.view(-1,
    V), labels.view(-1))``; DistilBERT: the same module kept as ``self.mlm_loss_fct``): the logits
    as they are (no upcast), the labels as given, ``-100`` left out, the mean over the others;
    the forward's keyword arguments do not reach the loss."""

    name = "hf-masked-lm-ce"
    token_loss = TokenLoss(shift=False, upcast=False)

    def _loss_refusal(self, model: nn.Module) -> str:
        if _inline_cross_entropy(model):
            return ""
        return (f"{type(model).__name__}.forward computes its masked LM loss neither by transformers' ForMaskedLMLoss "
                "(self.loss_function) nor by a default CrossEntropyLoss() of the logits as they are, so remat cannot "
                "tell its loss; its head stays in the fixed part")

    def loss_inputs(self, arguments: dict[str, Any]) -> LossInputs:
        return LossInputs(labels=arguments["labels"])

    def loss_extra(self, arguments: dict[str, Any]) -> dict[str, Any]:
        return {}

    def model_loss(self, model: nn.Module, logits: torch.Tensor, inputs: LossInputs, extra: dict[str, Any]) -> torch.Tensor:
        return reference_loss(logits, inputs, self.token_loss)


def _is_masked_lm(model: nn.Module) -> bool:
    """A Hugging Face masked LM: its class (or one it derives from) is a ``*ForMaskedLM``."""
    return getattr(model, "loss_type", None) == "ForMaskedLM" or any(
        c.__name__.endswith("ForMaskedLM") for c in type(model).__mro__)


def _forward_source(model: nn.Module) -> str:
    """The source of the model class's ``forward`` ("" where Python cannot read it)."""
    try:
        return inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return ""


def _inline_cross_entropy(model: nn.Module) -> bool:
    """The forward calls a default ``CrossEntropyLoss()`` (mean, ``ignore_index=-100``, no
    weight, no label smoothing), made in place or kept as one of the model's attributes."""
    source = _forward_source(model)
    if "CrossEntropyLoss()" in source:
        return True
    return any(f"self.{name}(" in source and type(module) is nn.CrossEntropyLoss and module.weight is None
               and module.ignore_index == -100 and module.reduction == "mean" and module.label_smoothing == 0.0
               for name, module in model.named_children())


def _masked_lm_refusal(model: nn.Module, projection: nn.Module) -> str:
    """Why a masked LM's head cannot be planned, by its structure ("" where nothing says so)."""
    transformed = _logits_transformed(model)
    if transformed:
        return transformed
    name = type(model).__name__
    if "labels" not in inspect.signature(model.forward).parameters:
        return f"{name}.forward takes no labels argument"
    vocab = getattr(_text_config(model), "vocab_size", None)
    if projection.out_features != vocab:
        return (f"{name}'s get_output_embeddings() makes {projection.out_features} outputs, not the vocabulary's "
                f"{vocab} (DeBERTa's non-legacy head multiplies by the word embeddings itself): its logits come from "
                "elsewhere, so the head stays in the fixed part")
    if getattr(getattr(model, "config", None), "sparse_prediction", False):
        return (f"{name} projects only the labelled rows (config.sparse_prediction=True), which already keeps the "
                "logits of the masked tokens alone; the head is planned over every row only with "
                "sparse_prediction=False")
    return ""


def _logits_transformed(model: nn.Module) -> str:
    """Why a Hugging Face model's logits are not its projection's output, by its config
    (`LOGIT_TRANSFORMS`); "" where nothing says so."""
    config = getattr(model, "config", None)
    for field in LOGIT_TRANSFORMS:
        if getattr(config, field, None) not in (None, 1, 1.0):
            return (f"{type(model).__name__} transforms its logits after the projection (config.{field}="
                    f"{getattr(config, field)!r}); the head is planned only as a projection followed by the loss")
    return ""


def _decoder_input_maker(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """How ``model`` makes its decoder's input of its labels: its ``prepare_decoder_input_ids_from_labels``
    (T5, BART), else its modeling module's ``shift_tokens_right(input_ids, pad_token_id,
    decoder_start_token_id)`` on its config's tokens (M2M-100, NLLB), else None. `remat.profile`
    checks that the call made so gives the projection the same hidden states as the model's own
    call with labels (`remat.measure.head.logits_returned`)."""
    prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if callable(prepare):
        return lambda labels: prepare(labels=labels)
    shift = getattr(sys.modules.get(type(model).__module__), "shift_tokens_right", None)
    config = getattr(model, "config", None)
    if not callable(shift) or config is None:
        return None
    try:
        names = list(inspect.signature(shift).parameters)
    except (TypeError, ValueError):
        return None
    if names != ["input_ids", "pad_token_id", "decoder_start_token_id"]:
        return None
    return lambda labels: shift(labels, config.pad_token_id, config.decoder_start_token_id)


KINDS: dict[str, HeadKind] = {
    "remat.models.gpt.GPT": GPTHead(),
    "transformers.modeling_utils.PreTrainedModel": HFCausalLMHead(),
    "remat.estimate.text_lm.TextCausalLM": HFCausalLMHead(),  # a vision-language model's text path, as traced
}
"""Head kinds keyed by the qualified name of a model class (the first match along the MRO); a
Hugging Face encoder-decoder takes `HFSeq2SeqLMHead` instead, a masked LM `HFMaskedLMHead` or
`HFMaskedLMCrossEntropyHead` (`_kind_of`)."""

SEQ2SEQ = HFSeq2SeqLMHead()
MASKED_LM = HFMaskedLMHead()
MASKED_LM_CE = HFMaskedLMCrossEntropyHead()


def _kind_of(model: nn.Module) -> HeadKind | None:
    """The head kind of ``model``'s class (a masked LM's by how its forward computes the loss),
    or of the model a wrapper forwards its calls and
    attributes to (peft's ``PeftModelForCausalLM``: ``get_base_model()``, a Hugging Face
    ``*ForCausalLM`` whose LoRA layers sit inside), or None."""
    for cls in type(model).__mro__:
        kind = KINDS.get(f"{cls.__module__}.{cls.__qualname__}")
        if kind is not None:
            if isinstance(kind, HFCausalLMHead) and getattr(getattr(model, "config", None), "is_encoder_decoder", False):
                return SEQ2SEQ
            if isinstance(kind, HFCausalLMHead) and _is_masked_lm(model):
                return MASKED_LM if "self.loss_function(" in _forward_source(model) else MASKED_LM_CE
            return kind
    base = getattr(type(model), "get_base_model", None)
    inner = base(model) if callable(base) else None
    return _kind_of(inner) if isinstance(inner, nn.Module) and inner is not model else None


def kind_named(name: str) -> HeadKind:
    """The `HeadKind` registered under ``name`` (`HeadSite.kind`)."""
    known = [*KINDS.values(), SEQ2SEQ, MASKED_LM, MASKED_LM_CE]
    for kind in known:
        if kind.name == name:
            return kind
    raise ValueError(f"unknown head kind {name!r}; known: {', '.join(k.name for k in known)}.")


def find_head(model: nn.Module) -> tuple[HeadSite | None, str]:
    """``(site, "")`` for a model whose head can be planned, else ``(None, why not)``."""
    kind = _kind_of(model)
    if kind is None:
        return None, (f"{type(model).__name__} is not a language model remat knows the head of (Hugging Face "
                      "*ForCausalLM, *ForMaskedLM, encoder-decoders, the built-in GPT)")
    projection = kind.projection(model)
    if projection is None:
        how = " (get_output_embeddings() returns None)" if isinstance(kind, HFCausalLMHead) else ""
        return None, (f"{type(model).__name__} names no output projection{how}: not a language model head remat "
                      "plans (Hugging Face *ForCausalLM, *ForMaskedLM, encoder-decoders, the built-in GPT)")
    if type(projection) is not nn.Linear:
        return None, f"the output projection of {type(model).__name__} is {type(projection).__name__}, not a plain nn.Linear"
    reason = kind.refusal(model)
    if reason:
        return None, reason
    name = next(n for n, m in model.named_modules() if m is projection)
    site = HeadSite(kind=kind.name, projection=name, labels_arg=kind.labels_arg, loss=kind.token_loss,
                    tied=_is_tied(model, projection), logit_bias=kind.logit_bias(model, projection))
    return site, ""


def _is_tied(model: nn.Module, projection: nn.Module) -> bool:
    """The projection's weight is registered under another module too (tied to the embedding)."""
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if p is projection.weight]
    return len(names) > 1


def bind_call(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              forward: Callable[..., Any] | None = None) -> inspect.BoundArguments:
    """The call's arguments bound to the model's forward signature (defaults not applied)."""
    return inspect.signature(forward or model.forward).bind(*args, **kwargs)


@dataclass
class Captured:
    """What the projection received and returned during one captured call."""

    hidden: torch.Tensor | None = None
    """Its input: the hidden states."""
    output: Any = None
    """What it returned."""
    calls: int = 0
    """How often it was called."""


@contextlib.contextmanager
def capture_projection(projection: nn.Module, *, run: bool, width: int = 0) -> Iterator[Captured]:
    """While open, the projection records its input; ``run``: it computes its output as usual,
    else it returns an empty tensor instead of the logits (which then never exist): of no rows
    and ``width`` columns where given (a bias of that size added to it then broadcasts)."""
    captured = Captured()
    previous = projection.__dict__.get("forward")
    own = functools.partial(type(projection).forward, projection) if previous is None else previous

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        captured.hidden, captured.calls = hidden, captured.calls + 1
        captured.output = own(hidden) if run else hidden.new_empty((0, width) if width else 0)
        return captured.output

    projection.forward = forward
    try:
        yield captured
    finally:
        if previous is None:
            del projection.__dict__["forward"]
        else:
            projection.forward = previous


def _text_config(model: nn.Module) -> Any:
    """The config holding a Hugging Face model's vocabulary: its text config
    in a vision-language model (Gemma3, Idefics2, InternVL keep ``vocab_size`` there), else its
    own config."""
    config = getattr(model, "config", None)
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config
