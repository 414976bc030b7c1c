"""FSDP2 on Hugging Face models: a plan's gradients against plain FSDP2, each rank's peak
against the sharded prediction.

    python -m benchmarks.fsdp2_models [--models llama gpt2 ...] [--strategies none full sqrt]

``--models`` also takes the decoders of `MORE_MODELS` (OPT, GPT-NeoX, Falcon, Phi, Qwen3, OLMo 2,
StableLM, Gemma, Granite) and DeBERTa-v2.

Two CPU ranks on gloo, tiny configs built from configs (nothing downloaded), a micro-batch per
rank, AdamW. Rank 0 profiles the unwrapped model, plans on `shard_profile(profile, world_size=2,
zero_stage=3)` and broadcasts the plan; each rank applies it to a copy, shards it with
`fully_shard_by_plan` and runs one step beside a plain FSDP2 copy (gradients compared), then a
step under the live tracker (FSDP2's gathered weights seen through their storages' resizes)
against the prediction, and the allocator's own peak of three more steps (the profiler's memory
events) as a cross-check: it also sees the buffers gloo's collectives make on their own threads,
whose overlap with the step's peak varies from step to step.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

RANK_TIMEOUT_S = 300
"""A rank still running after this long prints its stack and exits."""
DEFAULT_MODELS = ("llama", "mixtral", "qwen2_moe", "gpt2", "bert", "vit", "t5", "bart", "whisper", "gemma4",
                  "mamba")


def build(name: str, rank: int) -> tuple[Any, dict[str, Any]]:
    """The model (seed 0, the same on every rank) and this rank's batch."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(3, 128, (2, 32), generator=g)
    lm = dict(input_ids=ids, labels=ids.clone())
    tiny = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.1, use_cache=False)

    def cfg(kind: str, **kw: Any) -> Any:
        return T.AutoConfig.for_model(kind, **kw)

    def seq2seq_labels(n: int) -> dict[str, Any]:
        return dict(labels=torch.randint(3, 128, (2, n), generator=g))

    if name == "llama":
        return T.LlamaForCausalLM(cfg("llama", **tiny)), lm
    if name == "mixtral":
        return T.MixtralForCausalLM(cfg("mixtral", num_local_experts=4, num_experts_per_tok=2, **tiny)), lm
    if name == "qwen2_moe":
        return T.Qwen2MoeForCausalLM(cfg("qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                         shared_expert_intermediate_size=64, **tiny)), lm
    if name == "gpt2":
        return T.GPT2LMHeadModel(cfg("gpt2", vocab_size=128, n_embd=64, n_layer=4, n_head=4, n_positions=64)), lm
    if name == "bert":
        model = T.BertForSequenceClassification(cfg("bert", vocab_size=128, hidden_size=64, intermediate_size=128,
                                                    num_hidden_layers=4, num_attention_heads=4))
        return model, dict(input_ids=ids, labels=torch.randint(0, 2, (2,), generator=g))
    if name == "vit":
        model = T.ViTForImageClassification(cfg("vit", image_size=32, patch_size=8, hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=4, num_attention_heads=4, num_labels=5))
        return model, dict(pixel_values=torch.randn(2, 3, 32, 32, generator=g), labels=torch.randint(0, 5, (2,), generator=g))
    if name == "t5":
        model = T.T5ForConditionalGeneration(cfg("t5", vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=3,
                                                 num_heads=4, use_cache=False, decoder_start_token_id=0, pad_token_id=0))
        return model, dict(input_ids=ids, **seq2seq_labels(16))
    if name == "bart":
        model = T.BartForConditionalGeneration(cfg("bart", vocab_size=128, d_model=64, encoder_layers=3, decoder_layers=3,
                                                   encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                                   decoder_ffn_dim=128, max_position_embeddings=64, use_cache=False))
        return model, dict(input_ids=ids, **seq2seq_labels(16))
    if name == "whisper":
        model = T.WhisperForConditionalGeneration(cfg(
            "whisper", vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16, max_source_positions=32,
            max_target_positions=32, decoder_start_token_id=1, pad_token_id=0, use_cache=False))
        return model, dict(input_features=torch.randn(2, 16, 64, generator=g), **seq2seq_labels(12))
    if name == "gemma4":
        config = cfg("gemma4_text", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=0,
                     bos_token_id=1, eos_token_id=2, sliding_window=8,
                     layer_types=["sliding_attention", "full_attention"] * 2, global_head_dim=8,
                     num_global_key_value_heads=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
                     use_cache=False, num_kv_shared_layers=2)
        return T.Gemma4ForCausalLM(config), lm
    if name == "mamba":
        return T.MambaForCausalLM(cfg("mamba", vocab_size=128, hidden_size=64, num_hidden_layers=4, state_size=8,
                                      use_cache=False)), lm
    if name in MORE_MODELS:  # decoders (and DeBERTa) of the shared tiny size
        kind, cls, extra = MORE_MODELS[name]
        model = getattr(T, cls)(cfg(kind, **{**tiny, **extra}))
        if cls.endswith("ForSequenceClassification"):
            return model, dict(input_ids=ids, labels=torch.randint(0, 2, (2,), generator=g))
        return model, lm
    raise KeyError(f"unknown model {name!r}; known: {', '.join((*DEFAULT_MODELS, *MORE_MODELS))}")


MORE_MODELS = {
    "opt": ("opt", "OPTForCausalLM", dict(ffn_dim=128, word_embed_proj_dim=64)),
    "gpt_neox": ("gpt_neox", "GPTNeoXForCausalLM", {}),
    "falcon": ("falcon", "FalconForCausalLM", {}),
    "phi": ("phi", "PhiForCausalLM", {}),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", {}),
    "olmo2": ("olmo2", "Olmo2ForCausalLM", dict(eos_token_id=2, pad_token_id=1)),
    "stablelm": ("stablelm", "StableLmForCausalLM", {}),
    "gemma": ("gemma", "GemmaForCausalLM", dict(head_dim=16)),
    "granite": ("granite", "GraniteForCausalLM", {}),
    "deberta_v2": ("deberta-v2", "DebertaV2ForSequenceClassification", {}),
}
"""More models for ``--models``, beyond the default table: (config type, class, config overrides)."""


def _rank(rank: int, world: int, port: int, name: str, strategy: str, out: str) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist

    faulthandler.dump_traceback_later(RANK_TIMEOUT_S, exit=True)  # a rank that failed leaves the other waiting
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import remat
    from remat._batch import call_model, compute_loss
    from remat.distributed import broadcast_plan, fully_shard_by_plan, shard_profile
    from remat.measure.tracker import allocator_net_peak_bytes, state_bytes, track_step

    res: dict[str, Any] = {}
    try:
        model, batch = build(name, rank)
        model.train()
        plan = None
        if rank == 0:
            profile = remat.profile(model, batch, None, torch.optim.AdamW(model.parameters()), warmup=0, repeats=1)
            plan = remat.plan(shard_profile(profile, world_size=world, zero_stage=3), strategy=strategy)
        plan = broadcast_plan(plan)
        grads = []
        for applied in (False, True):
            m = copy.deepcopy(model)
            if applied:
                remat.apply_(m, plan)
            fully_shard_by_plan(m, plan)
            torch.manual_seed(1234 + rank)
            compute_loss(call_model(m, batch), batch, None).backward()
            grads.append({n: p.grad.to_local().clone() for n, p in m.named_parameters() if p.grad is not None})
        res["identical"] = all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
        res["max_rel"] = max((float((grads[1][n] - grads[0][n]).abs().max() / grads[0][n].abs().max().clamp_min(1e-30))
                              for n in grads[0] if grads[0][n].numel()), default=0.0)  # a shard may be empty
        m = copy.deepcopy(model)
        remat.apply_(m, plan)
        fully_shard_by_plan(m, plan)
        opt = torch.optim.AdamW(m.parameters())

        def step() -> None:
            torch.manual_seed(7)
            compute_loss(call_model(m, batch), batch, None).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # optimizer state from here on, as in the profile
        tracked = track_step(step, model=m, optimizer=opt, batch=batch)
        cpu = torch.device("cpu")
        allocator = [state_bytes(m, opt, cpu) + allocator_net_peak_bytes(step, cpu, before=step) for _ in range(3)]
        res.update(blocks=len(plan.block_names), measured=tracked.peak_bytes, allocator=allocator,
                   predicted=plan.prediction.peak_bytes)
    except Exception as exc:  # reported per model; the other models still run
        res["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    Path(f"{out}.{rank}.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def run(name: str, strategy: str) -> list[dict[str, Any]]:
    """One model and strategy on two ranks: each rank's results."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        try:
            mp.spawn(_rank, args=(2, port, name, strategy, out), nprocs=2, join=True)
        except ProcessException as exc:
            written = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank.*.json"))]
            return [r for r in written if "error" in r] or [{"error": f"{type(exc).__name__}: {exc}"}]
        return [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]


def _cell(results: list[dict[str, Any]]) -> str:
    if any("error" in r for r in results):
        return next(r["error"] for r in results if "error" in r)
    grads = "identical" if all(r["identical"] for r in results) else f"max rel. {max(r['max_rel'] for r in results):.1e}"
    errs = [100 * (r["measured"] - r["predicted"]) / r["predicted"] for r in results]
    worst = max(range(len(errs)), key=lambda i: errs[i])
    alloc = [100 * (a - results[worst]["predicted"]) / results[worst]["predicted"] for a in results[worst]["allocator"]]
    return f"{grads}, {errs[worst]:+.2f} % (allocator {min(alloc):+.2f}..{max(alloc):+.2f} %)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fsdp2_models", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--strategies", nargs="+", default=["none", "full", "sqrt"])
    args = parser.parse_args(argv)
    print("per-rank peak: measured (live tracker) against predicted, the rank further above, and the "
          "allocator's peak of three steps (lowest..highest); negative: predicted above measured (the safe side)\n")
    print("| model | " + " | ".join(args.strategies) + " |")
    print("| --- |" + " --- |" * len(args.strategies))
    for name in args.models:
        cells = [_cell(run(name, strategy)) for strategy in args.strategies]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
