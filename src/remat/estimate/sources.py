"""Where estimate gets its model: a built-in model, a Hugging Face config, or ``file.py:build``.

Every source builds on the meta device (no memory, no download) with a chosen number of
layers, so a 70B-parameter configuration is traced with a few layers and the layers are
multiplied afterwards (`remat.estimate.trace.Traced.layer_kinds`).

Hugging Face families and the sizes they take (``HF_SIZE_KEYS``): ``gpt2`` (GPT2Config),
``llama`` (LlamaConfig), ``mistral`` (MistralConfig), ``t5`` (T5Config, T5 v1.1's form, an
encoder-decoder with ``--layers`` in each stack); or any ``config.json`` with a ``model_type``
that ``transformers.AutoConfig.for_model`` knows.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat.estimate.text_lm import TextCausalLM, has_text_causal_lm, vision_language_of

HF_FAMILIES = ("gpt2", "llama", "mistral", "t5")

MAX_LAYERS = 1024
"""Most layers an estimate takes. The deepest published decoder stacks have 96 to 200 layers; the
estimate's work grows with the layer count (the optimal strategy's knapsack over the layers, the
stage peak that sums over layers at each layer): measured here, 5 s at 256 layers, 21 s at 1024,
about a minute at 3000, so a mistyped ``--layers 10000000`` would run for days without a word."""

_SIZE_FLAGS = {"hidden": "--hidden", "layers": "--layers", "heads": "--heads", "kv_heads": "--kv-heads",
               "intermediate": "--intermediate", "vocab": "--vocab"}

# our size names -> each family's config keyword
HF_SIZE_KEYS: dict[str, dict[str, str]] = {
    "gpt2": {"hidden": "n_embd", "layers": "n_layer", "heads": "n_head", "intermediate": "n_inner",
             "vocab": "vocab_size"},
    "llama": {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
              "kv_heads": "num_key_value_heads", "intermediate": "intermediate_size", "vocab": "vocab_size"},
    "mistral": {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
                "kv_heads": "num_key_value_heads", "intermediate": "intermediate_size", "vocab": "vocab_size"},
    # an encoder-decoder: --layers in each stack (T5 v1.1's form, as Flan-T5 and mT5 are)
    "t5": {"hidden": "d_model", "layers": "num_layers", "heads": "num_heads", "intermediate": "d_ff",
           "vocab": "vocab_size"},
}


_STEP_ARGUMENTS = {"batch_size": "micro_batch", "seq_len": "seq_len", "optimizer": "optimizer"}
"""A built-in model's size keywords that the estimate sets from its own arguments."""


QUANTIZATIONS = ("nf4",)
"""Formats of the frozen base weights under LoRA (`ModelSource.quantize`)."""


@dataclass(kw_only=True, frozen=True)
class ModelSource:
    """A model to estimate: exactly one of ``builtin``, ``hf_family``, ``hf_config_path``, ``file``."""

    builtin: str | None = None
    """A `remat.models` name (``"gpt"``...); sizes go to `remat.models.build`."""
    hf_family: str | None = None
    """``gpt2``, ``llama``, ``mistral`` or ``t5``; sizes: hidden, layers, heads, kv_heads (not t5),
    intermediate, vocab."""
    hf_config_path: str | None = None
    """A Hugging Face ``config.json`` (needs ``model_type``)."""
    file: str | None = None
    """``path/to/file.py:function`` returning ``(model, batch[, loss_fn[, optimizer]])``."""
    sizes: dict[str, Any] = field(default_factory=dict)
    """Size keywords of the built-in model or the HF family."""
    attention: str = "sdpa"
    """HF attention implementation: ``sdpa`` (fused kernel) or ``eager`` (explicit ops)."""
    lora_rank: int | None = None
    """Train LoRA adapters of this rank on every linear layer but the LM head, every other weight
    frozen (`remat.models.lora.add_lora`); None: every weight trained. Hugging Face models only."""
    lora_targets: tuple[str, ...] | None = None
    """With ``lora_rank``: only the linear layers of these names (``("q_proj", "v_proj")``)."""
    lora_dropout: float = 0.0
    """With ``lora_rank``: peft's ``lora_dropout`` on the adapters' input (its mask and the dropped
    input saved for ``lora_A``'s gradient)."""
    quantize: str | None = None
    """With ``lora_rank``: ``"nf4"`` stores the adapted linears' frozen weights in 4-bit NormalFloat
    with double quantization, as bitsandbytes does for QLoRA (`remat.models.qlora`); None: in the
    model's dtype."""

    def __post_init__(self) -> None:
        given = [k for k in ("builtin", "hf_family", "hf_config_path", "file") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(
                f"name exactly one model source, got {given or 'none'}; use a built-in model (--model gpt), "
                "a Hugging Face family with sizes (--hf llama --hidden ...), a config (--config config.json) "
                "or your own builder (--model path/to/file.py:build)."
            )
        if self.hf_family and self.hf_family not in HF_FAMILIES:
            raise ValueError(f"unknown Hugging Face family {self.hf_family!r}; allowed: {', '.join(HF_FAMILIES)}.")
        if self.attention not in ("sdpa", "eager"):
            raise ValueError(f"attention={self.attention!r} is not supported; allowed: sdpa, eager.")
        if self.lora_rank is not None:
            if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 1:
                raise ValueError(f"LoRA rank must be an integer >= 1, got {self.lora_rank!r} (--lora R).")
            if self.lora_targets is not None and not self.lora_targets:
                raise ValueError("--lora-targets names no layer; pass names such as q_proj,v_proj, or leave it out "
                                 "for every linear layer.")
            if not (self.hf_family or self.hf_config_path):
                raise ValueError(f"--lora {self.lora_rank} adapts a Hugging Face model the estimate builds (--hf, "
                                 "--config); add adapters to your own model in its file.py:build instead, for example "
                                 "with remat.models.lora.add_lora(model, rank).")
        if self.lora_dropout:
            if isinstance(self.lora_dropout, bool) or not 0.0 < self.lora_dropout < 1.0:
                raise ValueError(f"--lora-dropout {self.lora_dropout!r} must be a probability in [0, 1).")
            if self.lora_rank is None:
                raise ValueError(f"--lora-dropout {self.lora_dropout} drops the input of LoRA adapters; pass their rank "
                                 "with --lora R too.")
        if self.quantize is not None:
            if self.quantize not in QUANTIZATIONS:
                raise ValueError(f"--quantize {self.quantize!r} is not a weight format the estimate knows; allowed: "
                                 f"{', '.join(QUANTIZATIONS)}.")
            if self.lora_rank is None:
                raise ValueError(f"--quantize {self.quantize} stores the frozen base weights of LoRA layers (QLoRA); "
                                 "pass the adapters' rank with --lora R too.")
        if self.lora_targets is not None and self.lora_rank is None:
            raise ValueError(f"--lora-targets {','.join(self.lora_targets)} names where LoRA adapters go; pass their "
                             "rank with --lora R too.")
        if self.hf_family:
            check_sizes(self.sizes, f"--hf {self.hf_family}")
        if self.builtin:
            clashes = sorted(set(self.sizes) & set(_STEP_ARGUMENTS))
            if clashes:
                raise ValueError(
                    f"sizes {clashes} of the built-in model {self.builtin!r} are the estimate's own arguments; "
                    f"pass {', '.join(f'{_STEP_ARGUMENTS[k]}=' for k in clashes)} to remat.estimate instead "
                    f"(sizes given: {self.sizes})."
                )

    @property
    def label(self) -> str:
        """A short human name."""
        name = self.builtin or self.file or self.hf_config_path or f"hf:{self.hf_family}"
        on = f" on {', '.join(self.lora_targets)}" if self.lora_targets else ""
        base = f", {self.quantize.upper()} base weights" if self.quantize else ""
        drop = f", dropout {self.lora_dropout:g}" if self.lora_dropout else ""
        return name + (f" with LoRA of rank {self.lora_rank}{on}{drop}{base}" if self.lora_rank else "")


def as_source(source: ModelSource | str) -> ModelSource:
    """A `ModelSource` from itself, a built-in model name (``"gpt"``) or ``"file.py:build"``."""
    if isinstance(source, ModelSource):
        return source
    if isinstance(source, str):
        is_file = source.endswith(".py") or ".py:" in source
        return ModelSource(file=source) if is_file else ModelSource(builtin=source)
    raise TypeError(f"source must be a ModelSource or a model name, got {type(source).__name__}.")


def check_num_layers(layers: int, where: str) -> None:
    """Refuse more than `MAX_LAYERS` layers, saying why."""
    if layers > MAX_LAYERS:
        raise ValueError(
            f"{where}: {layers} layers is more than the {MAX_LAYERS} an estimate takes (the deepest published "
            f"models have about 200, and the estimate's work grows with the layers: about 20 s at {MAX_LAYERS}, "
            f"so this would run for hours or days); pass at most --layers {MAX_LAYERS}."
        )


def check_sizes(sizes: dict[str, Any], where: str) -> None:
    """Sizes of a transformer, checked before anything is built: positive integers, heads dividing
    the hidden size, key/value heads dividing the heads, at most `MAX_LAYERS` layers."""
    for key, flag in _SIZE_FLAGS.items():
        value = sizes.get(key)
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"{where}: {key} = {value!r} ({flag}) must be a positive integer; pass {flag} N with N >= 1.")
    hidden, heads, kv_heads = sizes.get("hidden"), sizes.get("heads"), sizes.get("kv_heads")
    # a config that sets each head's width itself (Gemma, GLM-4.5, mT5's d_kv) projects to heads x
    # head_dim, whatever the hidden size
    if hidden is not None and heads is not None and hidden % heads and sizes.get("head_dim") is None:
        fits = sorted(sorted((h for h in range(1, min(hidden, 4 * heads) + 1) if hidden % h == 0), key=lambda h: abs(h - heads))[:3])
        raise ValueError(
            f"{where}: hidden size {hidden} is not a multiple of {heads} attention heads (each head gets "
            f"hidden/heads features); pass --heads dividing --hidden, e.g. {', '.join(map(str, fits))}."
        )
    if heads is not None and kv_heads is not None and heads % kv_heads:
        fits = sorted(sorted((k for k in range(1, heads + 1) if heads % k == 0), key=lambda k: abs(k - kv_heads))[:3])
        raise ValueError(
            f"{where}: {heads} attention heads are not a multiple of {kv_heads} key/value heads (grouped-query "
            f"attention shares each key/value head among heads/kv-heads query heads); pass --kv-heads dividing "
            f"--heads, e.g. {', '.join(map(str, fits))}."
        )
    if sizes.get("layers") is not None:
        check_num_layers(sizes["layers"], where)


def _config_sizes(config: Any) -> dict[str, Any]:
    """The sizes `check_sizes` checks, read from a transformers config (None where it has none)."""
    names = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
             "kv_heads": "num_key_value_heads", "intermediate": "intermediate_size", "vocab": "vocab_size"}
    sizes = {key: _config_value(config, name) for key, name in names.items()}
    sizes["head_dim"] = next((value for value in (_config_value(config, name)
                                                  for name in ("head_dim", "d_kv", "kv_channels", "attention_head_size"))
                              if isinstance(value, int)), None)
    return sizes


def _json_float(value: dict) -> Any:
    """transformers writes a float JSON cannot hold (``inf``: Mamba 2's time-step limit) as
    ``{"__float__": "Infinity"}`` and reads it back so."""
    if len(value) == 1 and isinstance(value.get("__float__"), str):
        return float(value["__float__"])
    return value


def _check_uniform(config: Any, where: str) -> None:
    """Refuse a config whose layers take sizes of their own (transformers' per-layer attributes,
    which it will not read as one value), or whose parts outside the layers grow with their number
    (Gemma 3n's and Gemma 4's per-layer input embeddings), which a model of fewer layers has
    smaller."""
    per_layer_input = _config_value(config, "hidden_size_per_layer_input")
    if per_layer_input:
        raise ValueError(
            f"{where}: {type(config).__name__} gives every layer an input of its own, from embeddings and a "
            f"projection sized by the number of layers (hidden_size_per_layer_input = {per_layer_input}), which "
            "the estimate, building two layers of each kind and copying them, would count at that depth "
            "(Gemma 4's default text model: 3.25 B of its 5.08 B parameters). Estimate it from a file.py:build "
            "that builds the whole model (--model path/to/file.py:build), or measure it with `remat profile` at a "
            "size that runs here.")
    for name in ("num_attention_heads", "hidden_size", "intermediate_size"):
        try:
            getattr(config, name, None)
        except Exception as exc:  # noqa: BLE001 - transformers' per-layer lookups raise errors of their own
            said = " ".join(str(exc).split())[:160].rstrip(".")
            raise ValueError(
                f"{where}: {type(config).__name__} sets {name} per layer ({type(exc).__name__}: {said}): the estimate "
                "builds two layers of each kind and copies them, so it needs layers of one size per kind. Estimate it "
                "from a file.py:build that builds the whole model (--model path/to/file.py:build), or measure it "
                "with `remat profile` at a size that runs here.") from None


def _config_value(config: Any, name: str) -> Any:
    """``config.name``, None where it has none: also where transformers refuses to give one value
    (a per-layer attribute of a heterogeneous config raises its own error)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - transformers' per-layer lookups raise errors of their own
        return None


def hf_config(source: ModelSource) -> Any:
    """The transformers config of an HF source (family + sizes, or a config.json): of its language
    model where the config is composite (`language_model_config`)."""
    return hf_config_and_part(source)[0]


def hf_config_and_part(source: ModelSource) -> tuple[Any, str]:
    """`hf_config`, and what part of the model it is ("" for the whole model; else what
    `language_model_config` says of it)."""
    import transformers

    part = ""
    if source.hf_config_path is not None:
        path = Path(source.hf_config_path)
        if not path.is_file():
            raise ValueError(f"config file {str(path)!r} does not exist; pass a Hugging Face config.json.")
        try:
            data = json.loads(path.read_text(), object_hook=_json_float)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"config file {str(path)!r} is not JSON ({exc}); pass a Hugging Face config.json.") from None
        if not isinstance(data, dict) or "model_type" not in data:
            raise ValueError(f"{str(path)!r} has no 'model_type'; a Hugging Face config.json names it (e.g. \"llama\").")
        where = f"config {str(path)!r}"
        made = _make_config(where, data.pop("model_type"), data)
        if two_towers(made) is not None:  # CLIP, SigLIP: each tower checked by its own sizes
            config = made
            for tower in two_towers(made):
                check_sizes(_config_sizes(getattr(made, tower)), f"{where} ({tower})")
        else:
            config, part = language_model_config(made, where)
            check_sizes(_config_sizes(config), where)
    else:
        config = _make_config(f"--hf {source.hf_family}", source.hf_family, _family_kwargs(source))
        # a size left out takes the family's default (Mistral: 8 key/value heads), which must fit the rest
        check_sizes(_config_sizes(config), f"--hf {source.hf_family} (sizes not given are the family's defaults)")
    config._attn_implementation = source.attention
    return config, part


def language_model_config(config: Any, where: str) -> tuple[Any, str]:
    """``(config, "")`` for a config with its layers in ``num_hidden_layers``. A composite config
    (a vision-language or speech-text model: Gemma 3, Llama 4, Qwen3.5, Qwen2-Audio) keeps its
    layers in a sub-config: the estimate prices its language model (transformers'
    ``get_text_config(decoder=True)``, a causal LM of its own), which holds nearly all of the
    weights and activations at scale, and says which parts it leaves out. Refused where there is no
    such language model."""
    if getattr(config, "num_hidden_layers", None) is not None:
        _check_uniform(config, where)
        return config, ""
    import transformers

    causal = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    try:
        text = config.get_text_config(decoder=True)
    except Exception:  # noqa: BLE001 - a config class whose own lookup fails is refused below
        text = config
    text_lm = text is not config and has_text_causal_lm(config, text)
    if text is config or (text.model_type not in causal and not text_lm) or getattr(text, "num_hidden_layers", None) is None:
        raise ValueError(
            f"{where}: {type(config).__name__} (model_type {config.model_type!r}) keeps no decoder layers in "
            "num_hidden_layers, nor a causal language model in a sub-config: `remat estimate` prices decoder-only "
            "language models and the language model of a composite one. Measure this model with `remat profile "
            "path/to/file.py:build` at a size that runs here.")
    _check_uniform(text, where)
    others = [name for name in getattr(config, "sub_configs", {}) if getattr(config, name, None) is not text]
    left = f"; {', '.join(others)} left out" if others else ""
    if text_lm:  # built as the generative model runs it (`TextCausalLM`), its head tied as the whole model's
        text = copy.deepcopy(text)
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        return text, f" (its language model, {type(text).__name__}, with the head and loss of {type(config).__name__}{left})"
    return text, f" (its language model, {type(text).__name__}{left})"


def _make_config(where: str, model_type: Any, kwargs: dict[str, Any]) -> Any:
    """``AutoConfig.for_model``, its refusals (an unknown model type, values it validates) as ValueError."""
    import transformers

    try:
        return transformers.AutoConfig.for_model(model_type, **kwargs)
    except Exception as exc:  # noqa: BLE001 - transformers raises several kinds for a bad config
        raise ValueError(f"{where}: transformers refuses this config: {type(exc).__name__}: "
                         f"{' '.join(str(exc).split())}; fix the sizes.") from exc


def _family_kwargs(source: ModelSource) -> dict[str, Any]:
    keys = HF_SIZE_KEYS[source.hf_family]
    unknown = sorted(set(source.sizes) - set(keys) - {"seq"})
    if unknown:
        raise ValueError(f"unknown size(s) {unknown} for --hf {source.hf_family}; allowed: {', '.join(keys)}.")
    kwargs = {keys[k]: v for k, v in source.sizes.items() if k in keys and v is not None}
    if source.hf_family == "gpt2":
        kwargs["n_positions"] = max(1024, int(source.sizes.get("seq") or 0))
    elif source.hf_family == "t5":  # relative positions: no table to size; each head hidden / heads wide
        hidden, heads = kwargs.get("d_model", 512), kwargs.get("num_heads", 8)
        kwargs.update(d_kv=max(hidden // heads, 1), feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                      decoder_start_token_id=0)
    else:
        kwargs["max_position_embeddings"] = max(4096, int(source.sizes.get("seq") or 0))
    return kwargs


_STACK_KEYS = (("num_layers", "num_decoder_layers"), ("encoder_layers", "decoder_layers"),
               ("num_encoder_layers", "num_decoder_layers"))
"""Where an encoder-decoder config keeps its two layer counts: T5's family (mT5, UMT5, LongT5,
Switch Transformers), BART's (mBART, Pegasus, Marian, Blenderbot, PLBart, LED, M2M-100, NLLB...),
ProphetNet's."""


def is_encoder_decoder(config: Any) -> bool:
    """True for a text-to-text encoder-decoder (transformers' seq2seq LM of ``input_ids``), which the
    estimate builds as such, not as the causal LM some of them also have (BART's decoder alone), or
    a speech-to-text one whose input is a log-mel spectrogram of a fixed length (`speech_features`:
    Whisper)."""
    import transformers

    seq2seq = transformers.models.auto.modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
    return bool(getattr(config, "is_encoder_decoder", False)) and (
        config.model_type in seq2seq or speech_features(config) is not None)


def speech_features(config: Any) -> tuple[int, int] | None:
    """(mel bins, frames) of a speech-to-text encoder-decoder's input features: Whisper's
    ``num_mel_bins`` by twice ``max_source_positions`` (its convolutional stem halves the frames
    into the encoder's positions; 80 x 3000, 30 s of audio); None for any other config."""
    import transformers

    speech = transformers.models.auto.modeling_auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES
    bins, positions = _config_value(config, "num_mel_bins"), _config_value(config, "max_source_positions")
    if config.model_type not in speech or not all(isinstance(v, int) and v > 0 for v in (bins, positions)):
        return None
    return bins, 2 * positions


def stack_layers(config: Any) -> tuple[int, int]:
    """(encoder layers, decoder layers) of an encoder-decoder config (`is_encoder_decoder`)."""
    for enc, dec in _STACK_KEYS:
        encoder, decoder = _config_value(config, enc), _config_value(config, dec)
        if isinstance(encoder, int) and encoder >= 1:
            decoder = decoder if isinstance(decoder, int) and decoder >= 1 else encoder  # T5: None means as many
            return encoder, decoder
    raise ValueError(
        f"{type(config).__name__} (model_type {config.model_type!r}) is an encoder-decoder whose layer counts the "
        f"estimate does not find (it reads {', '.join(f'{e} / {d}' for e, d in _STACK_KEYS)}): estimate it from a "
        "file.py:build that builds the whole model (--model path/to/file.py:build).")


def two_towers(config: Any) -> tuple[str, str] | None:
    """The sub-configs of a two-tower model trained contrastively (CLIP, SigLIP, AltCLIP, Chinese
    CLIP: a type with a zero-shot image classifier, a ``vision_config`` and a ``text_config`` each
    with its layers in ``num_hidden_layers``), as ``("vision_config", "text_config")``; None for any
    other config."""
    import transformers

    zero_shot = transformers.models.auto.modeling_auto.MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES
    towers = ("vision_config", "text_config")
    if config.model_type not in zero_shot or not all(
            isinstance(_config_value(_config_value(config, t), "num_hidden_layers"), int) for t in towers):
        return None
    return towers


def speech_ctc(config: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(kernels, strides) of the convolutional feature encoder of a speech encoder trained with CTC
    (wav2vec 2.0, HuBERT, WavLM, Data2Vec-audio, UniSpeech...: a type transformers has a CTC model
    for, its layers in ``num_hidden_layers``); None for any other config."""
    import transformers

    ctc = transformers.models.auto.modeling_auto.MODEL_FOR_CTC_MAPPING_NAMES
    kernels, strides = _config_value(config, "conv_kernel"), _config_value(config, "conv_stride")
    if (config.model_type not in ctc or not isinstance(_config_value(config, "num_hidden_layers"), int)
            or not isinstance(kernels, (list, tuple)) or not isinstance(strides, (list, tuple))
            or len(kernels) != len(strides) or not kernels):
        return None
    return tuple(int(k) for k in kernels), tuple(int(v) for v in strides)


def audio_samples(config: Any, frames: int) -> int:
    """The fewest audio samples from which a speech encoder's feature encoder (`speech_ctc`) makes
    ``frames`` frames: each convolution, last to first, needs ``(out - 1) x stride + kernel``
    inputs (wav2vec 2.0: 320 samples a frame, 400 for the first)."""
    kernels, strides = speech_ctc(config)
    length = frames
    for kernel, stride in zip(reversed(kernels), reversed(strides)):
        length = (length - 1) * stride + kernel
    return length


CTC_FRAMES_PER_TARGET = 4
"""A speech encoder's CTC targets: one token every 4 frames (80 ms at wav2vec 2.0's 20 ms frames,
12.5 characters a second, about a reader's pace)."""


def ctc_loss_fn(config: Any, model: nn.Module) -> Callable[[Any, Any], torch.Tensor]:
    """transformers' CTC loss of a speech encoder, as its ``*ForCTC.forward`` computes it from
    ``labels``: the lengths from a mask of ones over the audio, then the model's own loss function
    (``ForCTCLoss``: the targets selected by a mask of the labels, log-softmax in fp32, ``ctc_loss``
    with the pad token as blank, the config's reduction and ``ctc_zero_infinity``); against targets of one token every
    `CTC_FRAMES_PER_TARGET` frames. transformers first checks the labels' values against the
    vocabulary, which a meta tensor has not: the estimate calls the model without labels and takes
    this loss of its logits, with the encoder's output held while it runs, as the forward holds it
    (its ``outputs``: the input of the dropout before the projection)."""
    blank = config.pad_token_id if isinstance(config.pad_token_id, int) else 0
    reduction, zero_infinity = config.ctc_loss_reduction, bool(config.ctc_zero_infinity)
    encoder_outputs: list[torch.Tensor] = []
    before_head = getattr(model, "dropout", None)
    (before_head if isinstance(before_head, nn.Module) else model.lm_head).register_forward_pre_hook(
        lambda _module, args: encoder_outputs.append(args[0]))

    def loss(output: Any, batch: Any) -> torch.Tensor:
        held = encoder_outputs.pop() if encoder_outputs else None
        encoder_outputs.clear()
        logits, audio = output.logits, batch["input_values"]
        b, t = logits.shape[:2]
        labels = torch.full((b, max(1, t // CTC_FRAMES_PER_TARGET)), 1 if blank != 1 else 2, dtype=torch.long,
                            device=logits.device)
        mask = torch.ones_like(audio, dtype=torch.long)
        input_lengths = model._get_feat_extract_output_lengths(mask.sum(-1)).to(torch.long)
        value = model.loss_function(logits=logits, labels=labels, logit_lengths=input_lengths, blank_token_id=blank,
                                    reduction=reduction, zero_infinity=zero_infinity)
        del held  # the forward returns: its outputs go
        return value

    return loss


def _causal_types() -> Any:
    import transformers

    return transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def is_image_encoder(config: Any) -> bool:
    """True for an image encoder the estimate builds as transformers' image classifier
    (`image_input`), not a causal LM (ImageGPT has both: a causal LM of pixels)."""
    return image_input(config) is not None and config.model_type not in _causal_types() and not is_masked_lm(config)


def is_masked_lm(config: Any) -> bool:
    """True for a text encoder the estimate builds as transformers' masked LM (BERT, RoBERTa,
    DeBERTa, ModernBERT, ESM, ALBERT...): a config of such a type that is not a decoder
    (``is_decoder``, which BERT's family sets for the causal LM it also has)."""
    import transformers

    masked = transformers.models.auto.modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    return (config.model_type in masked and not getattr(config, "is_decoder", False)
            and not getattr(config, "is_encoder_decoder", False))


def image_input(config: Any) -> tuple[int, int, int] | None:
    """(channels, height, width) of an image encoder's input: a config of a type transformers has
    an image classifier for (ViT, DeiT, BEiT, DINOv2, I-JEPA...), with its layers in
    ``num_hidden_layers`` and its ``image_size``; None for any other config."""
    import transformers

    classifiers = transformers.models.auto.modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES
    size, layers = _config_value(config, "image_size"), _config_value(config, "num_hidden_layers")
    if config.model_type not in classifiers or not isinstance(layers, int):
        return None
    height, width = (size, size) if isinstance(size, int) else tuple(size) if isinstance(size, (list, tuple)) else (0, 0)
    channels = _config_value(config, "num_channels") or 3
    if not all(isinstance(v, int) and v > 0 for v in (height, width, channels)):
        return None
    return channels, height, width


def num_layers(config: Any) -> int:
    """Layers of an HF config: its decoder layers, or an encoder-decoder's encoder and decoder layers."""
    if is_encoder_decoder(config):
        return sum(stack_layers(config))
    return int(config.num_hidden_layers)


def _set_stacks(config: Any, encoder: int, decoder: int) -> None:
    for enc, dec in _STACK_KEYS:
        if isinstance(_config_value(config, enc), int):
            setattr(config, enc, encoder)
            setattr(config, dec, decoder)
            return


def build_hf_on_meta(config: Any, *, layers: int, dtype: torch.dtype) -> nn.Module:
    """The HF causal LM with ``layers`` decoder layers, on the meta device, in ``dtype``; a
    vision-language model's language model with no causal LM of its own (`vision_language_of`) as
    `TextCausalLM`; a text encoder (`is_masked_lm`) as its masked LM with ``layers`` layers; an
    encoder-decoder (`is_encoder_decoder`) as its seq2seq LM with ``layers`` layers in each stack
    (fewer where the model has fewer)."""
    import copy

    import transformers

    if is_encoder_decoder(config):
        config = copy.deepcopy(config)
        encoder, decoder = stack_layers(config)
        _set_stacks(config, min(layers, encoder), min(layers, decoder))
        if getattr(config, "decoder_start_token_id", None) is None:  # T5's default config names none; its checkpoints 0
            config.decoder_start_token_id = config.pad_token_id or 0
        auto = transformers.AutoModelForSpeechSeq2Seq if speech_features(config) else transformers.AutoModelForSeq2SeqLM
        with torch.device("meta"):
            model = auto.from_config(config, dtype=dtype)
        model.train()
        return model
    causal = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if two_towers(config) is not None:  # ``layers`` in each tower (fewer where it has fewer)
        config = copy.deepcopy(config)
        for tower in two_towers(config):
            sub = getattr(config, tower)
            sub.num_hidden_layers = min(layers, sub.num_hidden_layers)
        with torch.device("meta"):
            model = transformers.AutoModel.from_config(config, dtype=dtype)
        model.train()
        return model
    if speech_ctc(config) is not None:
        config = copy.deepcopy(config)
        config.num_hidden_layers = layers
        with torch.device("meta"):
            model = transformers.AutoModelForCTC.from_config(config, dtype=dtype)
        if any(not t.is_meta for t in (*model.parameters(), *model.buffers())):
            model.to("meta")  # a weight made with torch.Tensor(n), which takes no device (UniSpeech-SAT's mask embedding)
        model.train()
        return model
    if vision_language_of(config) is not None:  # Qwen2-VL's language model: no causal LM of its own
        config = copy.deepcopy(config)
        config.num_hidden_layers = layers
        with torch.device("meta"):
            model = TextCausalLM(config, dtype=dtype)
        model.train()
        return model
    if config.model_type not in causal and not is_masked_lm(config) and not is_image_encoder(config):
        raise ValueError(
            f"{type(config).__name__} (model_type {config.model_type!r}) has no causal or masked language model in "
            "transformers, nor an image classifier with its layers in num_hidden_layers: `remat estimate --config` "
            "prices decoder-only language models (a causal LM's config, its layers in num_hidden_layers), text "
            "encoders trained as masked language models (BERT's family, DeBERTa, ModernBERT, ESM), image encoders "
            "trained as classifiers (ViT, DeiT, BEiT, DINOv2) and text-to-text encoder-decoders (T5's and BART's "
            "families). Measure this model with `remat profile path/to/file.py:build` at a size that runs here.")
    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    named = transformers.models.auto.modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES.get(config.model_type)
    if is_image_encoder(config) and isinstance(named, (list, tuple)) and not getattr(config, "architectures", None):
        config.architectures = [named[0]]  # DeiT's classifier with and without its teacher: the plain one
    auto = (transformers.AutoModelForImageClassification if is_image_encoder(config) else
            transformers.AutoModelForMaskedLM if is_masked_lm(config) else transformers.AutoModelForCausalLM)
    with torch.device("meta"):
        model = auto.from_config(config, dtype=dtype)
    if any(not t.is_meta for t in (*model.parameters(), *model.buffers())):
        model.to("meta")  # a weight made with torch.FloatTensor(...), which takes no device (XLNet's mask embedding)
    model.train()
    return model


def hf_batch(config: Any, *, micro_batch: int, seq_len: int, device: str | torch.device = "meta",
             dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """``input_ids`` and ``labels`` of shape (micro_batch, seq_len); transformers shifts the labels
    (an encoder-decoder's into its decoder's input: both stacks run ``seq_len`` tokens). A speech
    encoder-decoder (`speech_features`) takes its spectrogram (in ``dtype``) instead of the ids, an
    image encoder (`is_image_encoder`) its images at the config's size and a class per image."""
    if two_towers(config) is not None:  # the contrastive loss over the batch's image-text pairs
        channels = _config_value(config.vision_config, "num_channels") or 3
        size = config.vision_config.image_size
        return {"input_ids": torch.zeros(micro_batch, seq_len, dtype=torch.long, device=device),
                "pixel_values": torch.zeros(micro_batch, channels, size, size, dtype=dtype, device=device),
                "return_loss": True}
    if speech_ctc(config) is not None:  # the loss is `ctc_loss_fn`'s
        return {"input_values": torch.zeros(micro_batch, audio_samples(config, seq_len), dtype=dtype, device=device)}
    if is_image_encoder(config):
        return {"pixel_values": torch.zeros(micro_batch, *image_input(config), dtype=dtype, device=device),
                "labels": torch.zeros(micro_batch, dtype=torch.long, device=device)}
    ids = torch.zeros(micro_batch, seq_len, dtype=torch.long, device=device)
    features = speech_features(config)
    if features is not None:
        return {"input_features": torch.zeros(micro_batch, *features, dtype=dtype, device=device), "labels": ids}
    return {"input_ids": ids, "labels": ids.clone()}
