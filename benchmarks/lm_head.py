"""A large-vocabulary language model: where the peak is the logits, not the layers.

    .venv/bin/python -m benchmarks.lm_head [--shapes small large] [--repeats 5] [--device cuda]
                                           [--json lm-head.json] [--markdown lm-head.md]

Per shape, a Hugging Face Llama (shape ``t5``: T5, an encoder-decoder; shape ``modernbert``:
ModernBERT's masked LM, 15 % of the positions labelled, the others -100) built from a config (random
weights, AdamW, labels = the input ids, the first 16 of each sequence labelled -100), every row a whole training step (gradients
to None, forward, loss, backward, optimizer step) from the same weights and batch:

- ``none``: the model as it is;
- ``HF checkpointing``: ``model.activation_checkpointing_enable()`` (transformers 5's name for
  ``gradient_checkpointing_enable``: every decoder layer recomputed; the projection and loss kept);
- ``remat lowest peak, head kept``: the plan of least predicted peak with the head as the model
  runs it (`remat.plan.planners.min_peak_plan` with ``heads=("keep",)``): what planning the
  layers alone reaches;
- ``remat lowest peak``: the plan of least predicted peak over the layers and the head
  strategies (keep, recompute, chunked:<tokens>);
- ``remat optimal @ 60% of HF``: the fastest plan whose predicted peak fits 60 % of the peak
  measured for HF checkpointing.

Reported: the measured peak (remat's live-storage tracker; on CUDA also
``max_memory_allocated``), the median step time over ``--repeats`` interleaved rounds (one step
of every row per round, the order rotated each round), both as ratios to HF checkpointing, the
head strategy, and the gradients against ``none`` (bit-identical, or the chunked head's
reordered sums within its stated tolerance: `remat.verify` on the plan). Target (issue 17): the
lowest-peak plan at <= 0.6x HF checkpointing's peak and <= 1.1x its step time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import remat
from remat._files import write_atomic
from remat.measure.profile import _Step
from remat.measure.tracker import track_step
from remat.models import load_target
from remat.models.loading import move_to, resolve_device
from remat.models.registry import BuiltModel
from remat.plan.planners import min_peak_plan

SHAPES: dict[str, dict[str, int]] = {
    # the issue's example: HF checkpointing leaves the peak where it was (196 MiB)
    "small": dict(vocab_size=32000, d_model=64, num_heads=4, num_layers=2, seq_len=256, batch_size=2),
    # wider and longer: the layers weigh more, the logits still most
    "large": dict(vocab_size=32000, d_model=256, num_heads=8, num_layers=4, seq_len=1024, batch_size=2),
    # an encoder-decoder, T5 v1.1's vocabulary and form (2 layers in each stack): its loss over the
    # labels as given, the head planned as `remat.head.site.HFSeq2SeqLMHead`
    "t5": dict(vocab_size=32128, d_model=64, num_heads=4, num_layers=2, seq_len=256, batch_size=2),
    # a masked LM, ModernBERT's vocabulary and form (a global attention layer every third, the others
    # a 128-token window): its loss transformers' ForMaskedLMLoss over the masked positions, the
    # head planned as `remat.head.site.HFMaskedLMHead`
    "modernbert": dict(vocab_size=50368, d_model=64, num_heads=4, num_layers=3, seq_len=512, batch_size=2),
}
MODELS = {"t5": "hf:t5", "modernbert": "ModernBertForMaskedLM"}
"""The built-in model of a shape (default ``hf:llama``; ``ModernBertForMaskedLM`` is built here, `_masked_lm`)."""
MASKED_SHARE = 0.15
"""Masked LM shapes: the share of positions labelled (BERT's masking); the others are -100."""
IGNORED_PREFIX = 16
"""Labels set to -100 at the start of each sequence (a prompt the loss leaves out)."""
BUDGET_SHARE = 0.6
MIB = 2**20


@dataclass(kw_only=True)
class Row:
    """One way to run the model and what it measured."""

    name: str
    head: str = "keep"
    plan: str = ""
    predicted_peak_mib: float | None = None
    peak_mib: float = 0.0
    cuda_peak_mib: float | None = None
    step_ms: float = 0.0
    peak_vs_hf: float = 0.0
    time_vs_hf: float = 0.0
    grads: str = ""


@dataclass(kw_only=True)
class _Variant:
    row: Row
    step: _Step
    times: list[float]


def _built(shape: str, device: str | None) -> Any:
    if MODELS.get(shape) == "ModernBertForMaskedLM":
        return _masked_lm(shape, device)
    built = load_target(MODELS.get(shape, "hf:llama"), seed=0, device=device, **SHAPES[shape])
    built.batch["labels"][:, :IGNORED_PREFIX] = -100
    return built


def _masked_lm(shape: str, device: str | None) -> BuiltModel:
    """ModernBERT's masked LM at ``shape`` (ModernBERT-large's tokens and attention pattern, its
    feed-forward 2.56x the width), random weights from seed 0; `MASKED_SHARE` of the labels kept."""
    import transformers

    sizes = SHAPES[shape]
    config = transformers.ModernBertConfig(
        vocab_size=sizes["vocab_size"], hidden_size=sizes["d_model"], num_hidden_layers=sizes["num_layers"],
        num_attention_heads=sizes["num_heads"], intermediate_size=int(2.5625 * sizes["d_model"]),
        max_position_embeddings=max(8192, sizes["seq_len"]), global_attn_every_n_layers=3, local_attention=128,
        pad_token_id=50283, bos_token_id=50281, eos_token_id=50282, cls_token_id=50281, sep_token_id=50282)
    torch.manual_seed(0)
    model = transformers.ModernBertForMaskedLM(config).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50280, (sizes["batch_size"], sizes["seq_len"]), generator=g)
    labels = torch.where(torch.rand(ids.shape, generator=g) < MASKED_SHARE, ids, -100)
    built = BuiltModel(model=model, batch={"input_ids": ids, "labels": labels}, loss_fn=None,
                       optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), name="ModernBertForMaskedLM")
    return built if device is None else move_to(built, resolve_device(device))


def _variant(shape: str, device: str | None, name: str, prepare: Callable[[Any], str]) -> _Variant:
    built = _built(shape, device)
    detail = prepare(built)
    return _Variant(row=Row(name=name, plan=detail), step=_Step(built.model, built.batch, None, built.optimizer), times=[])


def _measure_peak(variant: _Variant) -> None:
    model, device = variant.step.model, next(variant.step.model.parameters()).device
    variant.step.run()  # optimizer state exists from here on, as in every later step
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    tracked = track_step(variant.step.run, model=model, optimizer=variant.step.optimizer, batch=variant.step.batch)
    variant.row.peak_mib = tracked.peak_bytes / MIB
    if tracked.device_max_allocated_bytes is not None:
        variant.row.cuda_peak_mib = tracked.device_max_allocated_bytes / MIB


def _timed(variants: list[_Variant], repeats: int) -> None:
    for r in range(repeats):
        start = r % len(variants)
        for v in variants[start:] + variants[:start]:
            device = next(v.step.model.parameters()).device
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            v.step.run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            v.times.append(1e3 * (time.perf_counter() - t0))
    for v in variants:
        v.row.step_ms = statistics.median(v.times)


def _hf_checkpointing(built: Any) -> str:
    """Hugging Face's own checkpointing of every decoder layer (``gradient_checkpointing_enable``
    before transformers 5, which renamed it)."""
    model = built.model
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    return "every layer"


def _applier(plan: remat.Plan) -> Callable[[Any], str]:
    def prepare(built: Any) -> str:
        remat.apply_(built.model, plan)
        return _plan_label(plan)

    return prepare


def _plan_label(plan: remat.Plan) -> str:
    kinds = [s.strategy if not s.children else "recompute (nested)" for s in plan.segments]
    return f"blocks: {', '.join(kinds)}; head: {plan.head}"


def measure(shape: str, repeats: int, device: str | None = None) -> dict:
    """Every row of ``shape`` (module docstring)."""
    start = time.perf_counter()
    built = _built(shape, device)
    prof = remat.profile(built.model, built.batch, None, built.optimizer, repeats=max(repeats // 2, 1))
    hf = _variant(shape, device, "HF checkpointing", _hf_checkpointing)
    _measure_peak(hf)
    plans = {
        "remat lowest peak, head kept": min_peak_plan(prof, ("keep",)),
        "remat lowest peak": min_peak_plan(prof),
    }
    try:
        plans[f"remat optimal @ {BUDGET_SHARE:.0%} of HF"] = remat.plan(prof, budget=int(BUDGET_SHARE * hf.row.peak_mib * MIB))
    except ValueError as error:
        plans[f"remat optimal @ {BUDGET_SHARE:.0%} of HF"] = None
        print(f"{shape}: no plan at {BUDGET_SHARE:.0%} of HF checkpointing's peak: {error}")
    variants = [_variant(shape, device, "none", lambda built: "nothing recomputed"), hf]
    for name, plan in plans.items():
        if plan is not None:
            variant = _variant(shape, device, name, _applier(plan))
            variant.row.head, variant.row.predicted_peak_mib = plan.head, plan.prediction.peak_bytes / MIB
            variants.append(variant)
    for v in variants:
        if v is not hf:
            _measure_peak(v)
    _timed(variants, repeats)
    for v in variants:
        v.row.peak_vs_hf, v.row.time_vs_hf = v.row.peak_mib / hf.row.peak_mib, v.row.step_ms / hf.row.step_ms
    _grad_checks(shape, device, plans, variants)
    return {"shape": shape, "sizes": SHAPES[shape], "repeats": repeats, "wall_s": time.perf_counter() - start,
            "profile_peak_mib": prof.peak_bytes / MIB, "head_note": prof.head_note,
            "rows": [asdict(v.row) for v in variants]}


def _grad_checks(shape: str, device: str | None, plans: dict[str, Any], variants: list[_Variant]) -> None:
    """Each plan's gradients against no recomputation (`remat.verify`, one step each)."""
    for v in variants:
        plan = plans.get(v.row.name)
        if plan is None:
            v.row.grads = "reference" if v.row.name == "none" else "HF's own"
            continue
        built = _built(shape, device)
        check = remat.verify(built.model, built.batch, plan, None, built.optimizer, repeats=1)
        if check.grads_identical:
            v.row.grads = "identical"
        elif check.relative_tolerance:
            v.row.grads = (f"{'ok' if check.ok else 'FAILS'}: every gradient within {check.relative_tolerance:.0e} "
                           f"(max {check.grad_max_rel_diff:.1e})")
        else:
            v.row.grads = f"differs (max |d| {check.grad_max_abs_diff:.1e})"


def markdown(results: list[dict]) -> str:
    lines = [f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}; "
             f"load average {os.getloadavg()[0]:.2f} at the end."]
    for result in results:
        sizes = ", ".join(f"{k} {v}" for k, v in result["sizes"].items())
        lines += ["", f"### {result['shape']}: {MODELS.get(result['shape'], 'hf:llama')}, {sizes} ({result['repeats']} rounds, {result['wall_s']:.0f} s)", "",
                  "| row | peak MiB | x HF peak | step ms | x HF time | head | gradients | plan |",
                  "| --- | ---: | ---: | ---: | ---: | --- | --- | --- |"]
        for row in result["rows"]:
            lines.append(f"| {row['name']} | {row['peak_mib']:.1f} | {row['peak_vs_hf']:.2f} | {row['step_ms']:.0f} | "
                         f"{row['time_vs_hf']:.2f} | {row['head']} | {row['grads']} | {row['plan']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    results = [measure(shape, args.repeats, args.device) for shape in args.shapes]
    text = markdown(results)
    print(text)
    if args.json:
        write_atomic(args.json, json.dumps(results, indent=1))
    if args.markdown:
        write_atomic(args.markdown, text)


if __name__ == "__main__":
    main()
