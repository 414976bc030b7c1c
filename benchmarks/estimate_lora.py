"""`remat estimate --lora` against the measured step: models of several families built from tiny
configs (hidden 64, 4 layers, random weights), trained whole, with LoRA adapters of rank 4 on
every linear layer (`remat.models.lora.add_lora`) and with those layers' base weights in NF4
(QLoRA, `remat.models.qlora.quantize_base`; GPT-2's ``Conv1D`` layers too, transposed). For each: the estimate's forward + backward
FLOPs of a micro-batch against ``torch.utils.flop_counter`` over the real step on the CPU
(`remat.measure.flops.step_flop_counter`), and its peak with no recomputation and with every layer
recomputed over `remat.plan`'s prediction from a profile of the whole model (equal to the measured
peak) with fused AdamW over the trained parameters, the optimizer step the estimate prices.

    OMP_NUM_THREADS=1 PYTHONPATH=src python -m benchmarks.estimate_lora [--types llama gpt2 ...] [--rank 4]

The model state (parameters, gradients, optimizer state and buffers, NF4 weights among them) is
checked against the model's own tensors first.
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
from remat.measure.flops import step_flop_counter
from remat.measure.profile import profile
from remat.models.lora import add_lora
from remat.models.qlora import NF4Linear, quantize_base
from remat.plan.planners import plan

B, S, H = 2, 32, 64
CAUSAL, MASKED, SEQ2SEQ, IMAGE = (transformers.AutoModelForCausalLM, transformers.AutoModelForMaskedLM,
                                  transformers.AutoModelForSeq2SeqLM, transformers.AutoModelForImageClassification)
MODELS: dict[str, tuple[dict[str, Any], Any]] = {
    "llama": (dict(model_type="llama", hidden_size=H, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=96, max_position_embeddings=64), CAUSAL),
    "qwen2": (dict(model_type="qwen2", hidden_size=H, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=96, max_position_embeddings=64), CAUSAL),
    "gpt2": (dict(model_type="gpt2", n_embd=H, n_layer=4, n_head=4, vocab_size=96, n_positions=64, bos_token_id=0,
                  eos_token_id=0), CAUSAL),
    "bert": (dict(model_type="bert", pad_token_id=0, hidden_size=H, num_hidden_layers=4, num_attention_heads=4,
                  intermediate_size=128, vocab_size=96, max_position_embeddings=128), MASKED),
    "t5": (dict(model_type="t5", d_model=H, d_kv=16, d_ff=128, num_layers=4, num_decoder_layers=3, num_heads=4,
                vocab_size=96, decoder_start_token_id=0), SEQ2SEQ),
    "vit": (dict(model_type="vit", hidden_size=H, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
                 image_size=32, patch_size=8), IMAGE),
}


def _batch(name: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    if name == "vit":
        return {"pixel_values": torch.randn(B, 3, 32, 32, generator=generator), "labels": torch.tensor([0, 1])}
    ids = torch.randint(3, 90, (B, S), generator=generator)
    return {"input_ids": ids, "labels": ids.clone()}


def _model(cfg: dict[str, Any], cls: Any, rank: int | None, quantize: str | None = None) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(**cfg)
    config._attn_implementation = "sdpa"
    if getattr(config, "is_encoder_decoder", False):
        config.use_cache = False
    torch.manual_seed(0)
    model = cls.from_config(config).train()
    model = add_lora(model, rank) if rank else model
    return quantize_base(model) if quantize else model


def row(name: str, rank: int | None, workdir: Path, quantize: str | None = None) -> dict[str, Any]:
    """One model, trained whole (``rank`` None), with LoRA, or with LoRA over NF4 weights
    (``quantize="nf4"``): the estimate against the measured step."""
    cfg, cls = MODELS[name]
    path = workdir / f"{name}.json"
    path.write_text(json.dumps(cfg))
    start = time.perf_counter()
    result = estimate(ModelSource(hf_config_path=str(path), lora_rank=rank, quantize=quantize), seq_len=S,
                      micro_batch=B, dtype="fp32", gpu_kernels=False)
    estimate_s = time.perf_counter() - start
    model, batch = _model(cfg, cls, rank, quantize), _batch(name)
    state = result.devices[0].model_state
    trained_count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    held = (4 * sum(p.numel() for p in model.parameters()), 4 * trained_count, 8 * trained_count,
            sum(b.numel() * b.element_size() for b in model.buffers()))
    quantized = sum(m.out_features * m.in_features for m in model.modules() if isinstance(m, NF4Linear))
    if (state.param_bytes, state.grad_bytes, state.optimizer_state_bytes, state.buffer_bytes) != held or \
            result.param_count != sum(p.numel() for p in model.parameters()) + quantized:
        raise AssertionError(f"{name}: model state {state} and {result.param_count:,} parameters are not the model's "
                             f"own {held}")
    with step_flop_counter() as counter:
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    trained = [p for p in model.parameters() if p.requires_grad]
    prof = profile(model, batch, None, torch.optim.AdamW(trained, fused=True), repeats=1)  # the estimate prices a fused step
    rows = {s.strategy: s for s in result.devices[0].strategies}
    over = {s: rows[s].peak_bytes / plan(prof, strategy=s).prediction.peak_bytes - 1 for s in ("none", "full")}
    return dict(model=name, lora=rank or 0, nf4=bool(quantize), trained=sum(p.numel() for p in trained),
                params=result.param_count, estimated_flops=result.train_flops,
                counted_flops=counter.get_total_flops(), none_over=over["none"], full_over=over["full"],
                estimate_s=estimate_s)


def markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| model | LoRA rank | trained / all parameters | FLOPs estimated | FLOPs counted | estimated / counted | "
           "peak over, none | peak over, full |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rank = f"{r['lora']}{', NF4' if r.get('nf4') else ''}" if r['lora'] else "-"
        out.append(f"| {r['model']} | {rank} | {r['trained']:,} / {r['params']:,} | "
                   f"{r['estimated_flops']:,} | {r['counted_flops']:,} | "
                   f"{r['estimated_flops'] / r['counted_flops']:.4f} | {100 * r['none_over']:+.4f} % | "
                   f"{100 * r['full_over']:+.4f} % |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rank", type=int, default=4)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.types:
            for rank, quantize in ((None, None), (args.rank, None), (args.rank, "nf4")):
                rows.append(row(name, rank, Path(tmp), quantize))
    print(markdown(rows))


if __name__ == "__main__":
    main()
