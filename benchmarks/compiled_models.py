"""Compiled Hugging Face models: a compiled profile's predictions against the compiled steps.

    python -m benchmarks.compiled_models [--models vit clip bert swin whisper] [--plans none full]

Tiny configs built from configs (nothing downloaded), two samples, SGD, inductor. Each model is
profiled with ``compiled=True``; each plan is checked with `remat.verify`, which runs the
baseline's and the plan's copies compiled and measures their allocator peaks
(`Verification.compiled_peak_bytes`): per plan, the prediction, the compiled measured peak and
its error (positive: measured above predicted, the unsafe side).
"""

from __future__ import annotations

import argparse
import copy
import warnings
from typing import Any

DEFAULT_MODELS = ("vit", "clip", "bert", "swin", "whisper")


def build(name: str) -> tuple[Any, dict[str, Any]]:
    """The model (seed 0) and its batch."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 16), generator=g)
    pixels = torch.randn(2, 3, 32, 32, generator=g)
    labels = torch.tensor([0, 2])
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    if name == "vit":
        config = T.ViTConfig(image_size=32, patch_size=8, num_labels=3, **small)
        return T.ViTForImageClassification(config), dict(pixel_values=pixels, labels=labels)
    if name == "bert":
        config = T.BertConfig(vocab_size=128, max_position_embeddings=64, num_labels=3, **small)
        return T.BertForSequenceClassification(config), dict(input_ids=ids, labels=labels)
    if name == "clip":
        text = dict(vocab_size=128, max_position_embeddings=32, pad_token_id=1, bos_token_id=2, eos_token_id=3, **small)
        vision = dict(image_size=32, patch_size=8, **small)
        config = T.CLIPConfig(text_config=text, vision_config=vision, projection_dim=32)
        return T.CLIPModel(config), dict(input_ids=ids, pixel_values=pixels, return_loss=True)
    if name == "swin":
        config = T.SwinConfig(embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=2, patch_size=4, image_size=32,
                              drop_path_rate=0.0, num_labels=3)
        return T.SwinForImageClassification(config), dict(pixel_values=pixels, labels=labels)
    if name == "whisper":
        config = T.WhisperConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                 decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
                                 max_source_positions=16, max_target_positions=32, vocab_size=128, pad_token_id=0,
                                 bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
        features = torch.randn(2, 16, 32, generator=g)
        return T.WhisperForConditionalGeneration(config), dict(input_features=features, labels=ids[:, :8])
    raise KeyError(f"unknown model {name!r}; known: {', '.join(DEFAULT_MODELS)}")


def measure(name: str, plans: list[str]) -> list[str]:
    """One model: a compiled profile, then each plan verified compiled (a table row per plan)."""
    import torch

    import remat

    model, batch = build(name)
    model.train()
    profiled = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = remat.profile(profiled, batch, None, torch.optim.SGD(profiled.parameters(), lr=0.01), compiled=True)
    rows = []
    for strategy in plans:
        plan = remat.plan(prof, strategy=strategy)
        checked = copy.deepcopy(model)
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            v = remat.verify(checked, batch, plan, None, torch.optim.SGD(checked.parameters(), lr=0.01), repeats=3)
        if v.compiled_error:
            rows.append(f"| {name} | {strategy} | {v.predicted_peak_bytes:,} | {v.compiled_error} | |")
            continue
        rows.append(f"| {name} | {strategy} | {v.predicted_peak_bytes:,} | {v.compiled_peak_bytes:,} "
                    f"| {v.compiled_peak_error_pct:+.1f} % |")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compiled_models", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--plans", nargs="+", default=["none", "full"])
    args = parser.parse_args(argv)
    print("| model | plan | predicted (B) | compiled measured (B) | error |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name in args.models:
        for row in measure(name, args.plans):
            print(row, flush=True)


if __name__ == "__main__":
    main()
