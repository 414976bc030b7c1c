"""`remat estimate` on encoders against the measured step: text encoders (masked LMs), plain vision
transformers (image classifiers), two-tower models trained contrastively (CLIP, SigLIP) and speech
encoders trained with CTC, each type of transformers
built from a tiny config (hidden 64, 4 layers, random weights), estimated on the meta device with
the CPU's kernels in fp32, and profiled whole on the CPU with AdamW; the table gives the estimate's
peak over `remat.plan`'s prediction from that profile (equal to the measured peak) for no
recomputation and for every block recomputed, or the estimate's refusal.

    OMP_NUM_THREADS=1 PYTHONPATH=src python -m benchmarks.estimate_encoders [--kinds text image towers speech]
        [--types bert vit ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from remat.estimate import ModelSource, estimate
from remat.estimate.sources import CTC_FRAMES_PER_TARGET, audio_samples
from remat.measure.profile import profile
from remat.plan.planners import plan

B = 2
TEXT = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, hidden_size=64,
            num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, vocab_size=96, max_position_embeddings=128)
IMAGE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, image_size=32,
             patch_size=8, num_channels=3)
SPEECH = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128, vocab_size=32,
              conv_dim=[32, 32, 32], conv_kernel=[10, 3, 2], conv_stride=[5, 2, 2], num_conv_pos_embeddings=16,
              num_conv_pos_embedding_groups=4, layerdrop=0.0, mask_time_prob=0.05)
TOWERS = dict(text_config=dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128,
                               vocab_size=96, max_position_embeddings=64),
              vision_config=dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
                                 image_size=32, patch_size=8))
EXTRA = {"squeezebert": dict(embedding_size=64), "albert": dict(embedding_size=32),
         "beit": dict(use_relative_position_bias=True, drop_path_rate=0.1),
         "data2vec-vision": dict(use_relative_position_bias=True)}
KINDS = {
    "text": ("masked", TEXT, 32, ["bert", "roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "data2vec-text",
                                  "roberta-prelayernorm", "megatron-bert", "ernie", "electra", "distilbert", "rembert",
                                  "roc_bert", "nomic_bert", "eurobert", "gte", "jina_embeddings_v3", "ultrabert",
                                  "modernbert", "esm", "esmc", "deberta", "deberta-v2", "convbert", "tapas", "layoutlm",
                                  "roformer", "mpnet", "big_bird", "fnet", "nystromformer", "yoso", "mra", "luke",
                                  "neomme", "albert", "longformer", "ibert", "xlm", "flaubert", "xmod", "mobilebert",
                                  "squeezebert", "funnel"]),
    "image": ("image", IMAGE, 64, ["vit", "deit", "beit", "dinov2", "dinov2_with_registers", "data2vec-vision", "ijepa",
                                   "vit_msn", "convnext", "swin", "imagegpt"]),
    "towers": ("towers", TOWERS, 16, ["clip", "metaclip_2", "altclip", "chinese_clip", "siglip", "blip", "siglip2"]),
    "speech": ("ctc", SPEECH, 60, ["wav2vec2", "hubert", "wavlm", "unispeech", "unispeech-sat", "data2vec-audio", "sew",
                                   "wav2vec2-conformer", "sew-d"]),
}
EAGER = {"beit", "data2vec-vision"}
"""Traced with their own attention code though transformers offers SDPA for them (their relative
position bias, a learned mask, takes a gradient the CPU's fused kernel cannot give); the others
where transformers offers no SDPA attention."""


def _real(kind: str, model_type: str, cfg: dict, attention: str) -> tuple[torch.nn.Module, dict]:
    config = transformers.AutoConfig.for_model(model_type, **cfg)
    config._attn_implementation = attention
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if kind == "masked":
        ids = torch.randint(3, 90, (B, 32), generator=gen)
        return transformers.AutoModelForMaskedLM.from_config(config).train(), {"input_ids": ids, "labels": ids.clone()}
    if kind == "towers":
        batch = {"input_ids": torch.randint(3, 90, (B, 16), generator=gen),
                 "pixel_values": torch.randn(B, 3, 32, 32, generator=gen), "return_loss": True}
        return transformers.AutoModel.from_config(config).train(), batch
    if kind == "image":
        config.architectures = ["DeiTForImageClassification"] if model_type == "deit" else None
        images = torch.randn(B, 3, 32, 32, generator=gen)
        return (transformers.AutoModelForImageClassification.from_config(config).train(),
                {"pixel_values": images, "labels": torch.arange(B) % 2})
    frames = KINDS["speech"][2]
    audio = torch.randn(B, audio_samples(config, frames), generator=gen)
    labels = torch.randint(1, 32, (B, frames // CTC_FRAMES_PER_TARGET), generator=gen)
    return transformers.AutoModelForCTC.from_config(config).train(), {"input_values": audio, "labels": labels}


def run_one(kind: str, model_type: str, base: dict, seq: int) -> dict[str, Any]:
    cfg = {**base, **EXTRA.get(model_type, {})}
    attention = "eager" if model_type in EAGER else "sdpa"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(dict(model_type=model_type, **cfg)))
        start = time.perf_counter()
        try:
            try:
                result = estimate(ModelSource(hf_config_path=str(path), attention=attention), seq_len=seq,
                                  micro_batch=B, dtype="fp32", gpu_kernels=False)
            except ValueError as error:  # no SDPA attention: its own attention code, as the refusal says
                if attention == "eager" or "--explicit-attention" not in str(error):
                    raise
                attention = "eager"
                result = estimate(ModelSource(hf_config_path=str(path), attention=attention), seq_len=seq,
                                  micro_batch=B, dtype="fp32", gpu_kernels=False)
        except ValueError as error:
            said = " ".join(str(error).replace(str(path), "config.json").split())
            return {"type": model_type, "refused": said[:200]}
        seconds = time.perf_counter() - start
    model, batch = _real(kind, model_type, cfg, attention)
    prof = profile(model, batch, None, torch.optim.AdamW(model.parameters(), fused=True), repeats=1)
    rows = {s.strategy: s.peak_bytes for s in result.devices[0].strategies}
    over = {s: rows[s] / plan(prof, strategy=s).prediction.peak_bytes - 1 for s in ("none", "full")}
    return {"type": model_type, "attention": attention, "params_equal": result.param_count == sum(
        p.numel() for p in model.parameters()), "blocks": prof.num_blocks, "none": over["none"], "full": over["full"],
        "estimate_s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS))
    parser.add_argument("--types", nargs="+", default=None, help="only these model types")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    print("| kind | model type | attention | parameters equal | blocks | none: over measured | full: over measured |")
    print("|---|---|---|---|---|---|---|")
    for name in args.kinds:
        kind, base, seq, types = KINDS[name]
        for model_type in types:
            if args.types and model_type not in args.types:
                continue
            row = run_one(kind, model_type, base, seq)
            if "refused" in row:
                print(f"| {name} | {model_type} | | | | refused: {row['refused']} | |", flush=True)
            else:
                print(f"| {name} | {model_type} | {row['attention']} | {row['params_equal']} | {row['blocks']} | "
                      f"{row['none']:+.4%} | {row['full']:+.4%} |", flush=True)


if __name__ == "__main__":
    main()
