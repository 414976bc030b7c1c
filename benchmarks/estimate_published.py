"""`remat estimate` beside published figures: Korthikanti et al. 2022 and Megatron-LM for GPT-3
175B, ZeRO's Table 1, torchtitan's Llama 3.1 8B FSDP memory.

    .venv/bin/python -m benchmarks.estimate_published [--json out.json]

- GPT-3 175B (96 layers, hidden 12288, 96 heads, sequence 2048, vocabulary 51200 as Megatron-LM
  pads it; the built-in GPT with explicit attention, bf16, micro-batch 1): per layer and GPU,
  Table 2's rows against remat at t = 8 with and without sequence parallelism; per GPU of the
  first stage, Megatron-LM's ``compute_weight_and_optimizer_memory`` and
  ``compute_activation_memory`` against remat at t = 8 with p = 8 and p = 16 (Megatron-LM's
  ``examples/gpt3/train_gpt3_175b_distributed.sh``), sequence parallelism and selective
  recomputation;
- ZeRO Table 1 (7.5B, 128B and 1T parameters, mixed-precision Adam) per data-parallel degree;
- torchtitan's ``benchmarks/llama3_h100_202412_torchtitan.md`` Table 1 and 3 (Llama 3.1 8B, FSDP
  on 8 and 128 H100s, local batch 2, sequence 8192, selective activation checkpointing, eager):
  the published peak reserved memory against remat's peak with no recomputation, with
  torchtitan's selective policy (save the outputs of every other matmul and of attention,
  priced by the planner's selective cost model, `remat.plan.costs`) and with full recomputation,
  and torchtitan's selective policy with the chunked head (`remat.estimate.head`);
- the LM head at Llama-3's vocabulary (128256, sequence 8192, bf16 with fp32 logits as Hugging
  Face computes the loss): per head strategy (`remat.estimate.head`), the logits, the peak of the
  part after the layers and the step's peak per GPU on 8 H100s under ZeRO-3, alone and under
  tensor parallelism 8 with sequence parallelism.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from benchmarks.published_formulas import (
    korthikanti_full,
    korthikanti_layer,
    megatron_activation_sp_selective,
    megatron_weight_and_optimizer,
    zero_per_rank,
)
from remat.estimate import ModelSource, Parallelism
from remat._files import write_atomic
from remat.estimate.layers import LayerCost, layer_cost
from remat.estimate.pricing import Pricing
from remat.estimate.sharding import ModelParams, RoleShapes, StateRecipe, gpu_state
from remat.estimate.stage import stage_peak
from remat.estimate.trace import trace_source
from remat.memory.allowance import NO_ALLOWANCE
from remat.plan.costs import cost_of
from remat.plan.types import Segment

GIB = 2**30
GPT3 = dict(num_layers=96, d_model=12288, num_heads=96, vocab_size=51200, dropout=0.1)
S, H, A, L, V = 2048, 12288, 96, 96, 51200
MEGATRON = StateRecipe(optimizer="adamw", precision="mixed", zero_stage=0, fp32_grads=True)
TITAN_SAVED = ("aten.mm.default#0", "aten.mm.default#2", "aten.mm.default#4", "aten.mm.default#6",
               "aten._scaled_dot_product_flash_attention.default#0")
"""torchtitan's op-level selective policy on a Llama layer (q, k, v, o, w1, w3, w2 in call order):
save the 1st, 3rd, 5th and 7th matmul and the attention, recompute the rest
(``torchtitan/distributed/activation_checkpoint.py``, ``_get_custom_policy``)."""


def _pricing(traced, par: Parallelism, *, micro_batch: int = 1, micro_batches: int = 1, recipe=MEGATRON) -> Pricing:
    return Pricing(traced=traced, micro_batch=micro_batch, micro_batches=micro_batches, recipe=recipe,
                   parallelism=par, mfu=0.4, allowance=NO_ALLOWANCE, strategies=("none",))


def gpt3_layers(traced) -> list[dict]:
    """Table 2 per layer and GPU against remat (MiB), t = 8."""
    rows = []
    for sp in (False, True):
        layer = _pricing(traced, Parallelism(tensor=8, sequence_parallel=sp)).layer(1, 1)
        kw = dict(s=S, b=1, h=H, a=A, t=8, sequence_parallel=sp)
        pairs = [("none", korthikanti_layer(**kw)), ("selective", korthikanti_layer(**kw, selective=True)),
                 ("full", korthikanti_full(s=S, b=1, h=H) / (8 if sp else 1))]
        for name, paper in pairs:
            rows.append(dict(layout="t=8" + (" + SP" if sp else ""), strategy=name, published_mib=paper / 2**20,
                             remat_mib=layer_cost(layer, name).retained_bytes / 2**20))
    return rows


def gpt3_stages(traced) -> list[dict]:
    """Megatron-LM's theoretical memory on the first stage against remat (GiB): t = 8, sequence
    parallelism, selective recomputation, micro-batch 1, p micro-batches or more per step."""
    rows = []
    for p, d, zero in ((8, 1, 0), (8, 8, 1), (16, 1, 0)):
        par = Parallelism(tensor=8, sequence_parallel=True, pipeline=p, data=d)
        pricing = _pricing(traced, par, micro_batches=4 * p, recipe=replace(MEGATRON, zero_stage=zero))
        stage = pricing.stages(1)[0]
        costs = [layer_cost(x, "selective") for x in stage.layers]
        held = stage.in_flight * (stage.pre_bytes + sum(c.retained_bytes for c in costs))
        state = pricing.state(0)
        rows.append(dict(
            layout=f"t=8 SP p={p} d={d}" + (" distributed optimizer" if zero else ""),
            megatron_state_gib=megatron_weight_and_optimizer(h=H, layers=L, vocab=V, t=8, p=p, d=d,
                                                             distributed_optimizer=zero == 1, untied=True) / GIB,
            remat_state_gib=(state.total_bytes - state.buffer_bytes) / GIB,
            megatron_activation_gib=megatron_activation_sp_selective(s=S, b=1, h=H, layers=L, t=8, p=p, virtual=None,
                                                                     micro_batches=4 * p) / GIB,
            remat_activation_gib=held / GIB,
            remat_peak_gib=stage_peak(stage, costs).peak_bytes / GIB,
        ))
    return rows


def zero_table() -> list[dict]:
    """ZeRO Table 1: per-device GB (1e9 bytes) for Psi parameters per data-parallel degree."""
    rows = []
    for psi in (7.5e9, 128e9, 1e12):
        params = ModelParams(pre=RoleShapes(), post=RoleShapes(), tied=RoleShapes(),
                             layers=(RoleShapes(whole=((int(psi),),)),))
        for n in (1, 4, 16, 64, 256, 1024):
            row = dict(params_b=psi / 1e9, dp=n)
            for stage in (1, 2, 3):
                state = gpu_state(params, Parallelism(data=n), 0, StateRecipe(optimizer="adam", precision="mixed",
                                                                              zero_stage=stage))
                row[f"published_{stage}"] = zero_per_rank(psi, n, stage) / 1e9
                row[f"remat_{stage}"] = (state.total_bytes - state.gathered_bytes) / 1e9
            rows.append(row)
    return rows


LLAMA3_8B = ModelSource(hf_family="llama", sizes=dict(hidden=4096, layers=32, heads=32, kv_heads=8,
                                                    intermediate=14336, vocab=128256, seq=8192))


def titan_rows(traced=None) -> list[dict]:
    """torchtitan Tables 1 and 3 (peak reserved GiB) against remat's allocated peak (GiB)."""
    traced = traced or trace_source(LLAMA3_8B, seq_len=8192)
    profile = traced.profile(2)
    titan = cost_of(profile, 1, Segment(start=1, stop=2, strategy="selective:titan", saved_ops=TITAN_SAVED))
    rows = []
    for gpus, published in ((8, 82.4), (128, 67.0)):
        pricing = _pricing(traced, Parallelism(data=gpus), micro_batch=2,
                           recipe=StateRecipe(optimizer="adamw", precision="mixed", zero_stage=3))
        stage = pricing.stages(2)[0]
        titan_costs = [LayerCost(retained_bytes=titan.retained_bytes, working_bytes=titan.working_bytes)] * 32
        peaks = {name: stage_peak(stage, [layer_cost(x, name) for x in stage.layers]).peak_bytes / GIB
                 for name in ("none", "full")}
        chunked = pricing.with_head("chunked").stages(2)[0]
        rows.append(dict(gpus=gpus, published_gib=published, remat_none_gib=peaks["none"],
                         remat_titan_gib=stage_peak(stage, titan_costs).peak_bytes / GIB, remat_full_gib=peaks["full"],
                         remat_titan_chunked_gib=stage_peak(chunked, titan_costs).peak_bytes / GIB,
                         state_gib=pricing.state(0).total_bytes / GIB))
    return rows


def llama3_heads(traced=None) -> list[dict]:
    """Llama-3-8B sizes, micro-batch 1 x 8192 tokens, 8 x H100-80GB: per layout and head strategy,
    the rank's logits, the peak after the layers, and the step's peak with no and full recomputation (GiB)."""
    from remat.estimate.devices import resolve_devices

    traced = traced or trace_source(LLAMA3_8B, seq_len=8192)
    spec = resolve_devices(["H100-80GB"])[0]
    rows = []
    for label, par, zero in (("dp8 ZeRO-3", Parallelism(data=8), 3), ("tp8+sp", Parallelism(tensor=8, sequence_parallel=True), 1)):
        for head in ("keep", "recompute", "chunked", "chunked:1024"):
            pricing = Pricing(traced=traced, micro_batch=1, micro_batches=1, parallelism=par, mfu=0.4,
                              allowance=NO_ALLOWANCE, strategies=("none", "full"), head=head,
                              recipe=StateRecipe(optimizer="adamw", precision="mixed", zero_stage=zero))
            on = pricing.head_estimates((head,))[0]
            peaks = {name: max(p.peak_bytes for p in pricing.price(spec, name, 1, spec.memory_bytes).peaks) / GIB
                     for name in ("none", "full")}
            rows.append(dict(layout=label, head=on.strategy, logits_gib=on.logits_bytes / GIB,
                             post_peak_gib=on.post_peak_bytes / GIB, replay_tflop=on.replay_flops / 1e12,
                             none_peak_gib=peaks["none"], full_peak_gib=peaks["full"]))
    return rows


def markdown(results: dict) -> str:
    out = ["GPT-3 175B, one layer per GPU (MiB): Korthikanti et al. 2022 Table 2 / remat", "",
           "| layout | strategy | Table 2 | remat |", "| --- | --- | ---: | ---: |"]
    out += [f"| {r['layout']} | {r['strategy']} | {r['published_mib']:.1f} | {r['remat_mib']:.1f} |" for r in results["gpt3_layers"]]
    out += ["", "GPT-3 175B, first pipeline stage per GPU (GiB): Megatron-LM theoretical memory / remat", "",
            "| layout | weights + optimizer: Megatron-LM | remat | activations: Megatron-LM | remat | remat peak |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    out += [f"| {r['layout']} | {r['megatron_state_gib']:.2f} | {r['remat_state_gib']:.2f} | "
            f"{r['megatron_activation_gib']:.2f} | {r['remat_activation_gib']:.2f} | {r['remat_peak_gib']:.2f} |"
            for r in results["gpt3_stages"]]
    out += ["", "ZeRO Table 1, GB per device (published / remat)", "",
            "| parameters | DP | P_os | P_os+g | P_os+g+p |", "| ---: | ---: | ---: | ---: | ---: |"]
    out += [f"| {r['params_b']:g}B | {r['dp']} | " + " | ".join(
        f"{r[f'published_{s}']:.2f} / {r[f'remat_{s}']:.2f}" for s in (1, 2, 3)) + " |" for r in results["zero"]]
    out += ["", "torchtitan Llama 3.1 8B FSDP, local batch 2, sequence 8192 (GiB per GPU)", "",
            "| GPUs | published (peak reserved, selective AC) | remat none | remat torchtitan's selective | remat full | "
            "remat torchtitan's selective, chunked head | model state |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    out += [f"| {r['gpus']} | {r['published_gib']:.1f} | {r['remat_none_gib']:.1f} | {r['remat_titan_gib']:.1f} | "
            f"{r['remat_full_gib']:.1f} | {r['remat_titan_chunked_gib']:.1f} | {r['state_gib']:.2f} |" for r in results["titan"]]
    out += ["", "Llama-3-8B LM head, micro-batch 1 x 8192 tokens, per GPU of 8 x H100-80GB (GiB)", "",
            "| layout | head | logits | peak after the layers | replayed TFLOP | step peak, none | step peak, full |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    out += [f"| {r['layout']} | {r['head']} | {r['logits_gib']:.2f} | {r['post_peak_gib']:.2f} | {r['replay_tflop']:.1f} | "
            f"{r['none_peak_gib']:.2f} | {r['full_peak_gib']:.2f} |" for r in results.get("heads", [])]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.estimate_published", description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    parser.add_argument("--skip-titan", action="store_true", help="leave out the Llama 3.1 8B traces (the slowest part)")
    args = parser.parse_args(argv)
    traced = trace_source(ModelSource(builtin="gpt", sizes=GPT3), seq_len=S)
    results = dict(gpt3_layers=gpt3_layers(traced), gpt3_stages=gpt3_stages(traced), zero=zero_table(),
                   titan=[], heads=[])
    if not args.skip_titan:
        llama = trace_source(LLAMA3_8B, seq_len=8192)
        results.update(titan=titan_rows(llama), heads=llama3_heads(llama))
    sys.stdout.write(markdown(results))
    if args.json:
        write_atomic(args.json, json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
