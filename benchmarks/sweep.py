"""The Hugging Face sweep: every model type of transformers, tiny, through remat's whole pipeline.

    .venv/bin/python -m benchmarks.sweep [--models TYPE ...] [--limit N] [--skip N] [--timeout-s 300]
                                         [--json out.json] [--markdown out.md] [--compare earlier.json]
                                         [--lora R [--lora-dropout P] [--quantize nf4 | --peft]]

The models are every type in ``transformers.CONFIG_MAPPING`` (sorted), or ``--models``, each built
by `benchmarks._sweep.build` from its config class's defaults shrunk to 2 layers of width 32
(random weights, a batch made in code, fixed seeds; nothing is downloaded). Each model runs in a
subprocess of its own (``--one TYPE --json-line``) under a wall-clock timeout, so a crash, hang
or OOM of one model never stops the sweep, and the JSON is rewritten after each model, so a
killed sweep keeps what it measured. Per model, with SGD (lr 1e-3):

- `remat.profile` (one timed step), `remat.pareto`;
- three plans, each checked by `remat.verify` (one timed step): the least peak (the frontier's
  last plan), the plan half-way from there to no recomputation (as `benchmarks.zoo` picks it),
  and full recomputation (every block its own recompute segment: the ``full`` strategy);
  predicted and measured peak, the error, gradients, blocks recomputed;
- three SGD steps of a copy of the model under the least plan (`remat.apply_`) against a copy
  without remat, the same batch and seeds before each step: parameters bit-identical or not.

With ``--lora R`` each model is fine-tuned as most people fine-tune one: LoRA of rank R on every
linear layer but the head, every other weight frozen (`remat.models.lora.add_lora`, peft's
``target_modules="all-linear"``), ``--lora-dropout`` on the adapters' input, ``--quantize nf4`` the
frozen linears in NF4 (QLoRA, `remat.models.qlora.quantize_base`). The adapters' ``lora_B`` starts
from seeded random values, not peft's zeros, so that every adapter gets a gradient the checks can
compare (with zeros, ``lora_A``'s gradient is zero in the first step whatever the plan does).
A model LoRA cannot adapt (no linear layer besides the head) is ``refused`` at stage ``lora``.
``--peft`` makes the adapters with peft's own ``get_peft_model`` (``LoraConfig(target_modules=
"all-linear")``): the wrapper users train, its modules named as peft names them; a model peft
cannot wrap or run is ``unbuilt`` ("peft: ...").

Statuses: ``ok``; ``unbuilt`` (the harness could not build the model or run a plain step at the
tiny size: its limit, not remat's); ``refused`` (remat's own clear error: a ValueError or
TypeError raised in remat); ``crash`` (any other exception: the traceback's tail);
``timeout``; ``verify-failed`` (a verification not ``ok``, gradients that differ, or 3 trained
steps that differ from training without remat).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

RESULT_MARK = "SWEEP-RESULT "
STATUSES = ("ok", "verify-failed", "refused", "crash", "timeout", "unbuilt")
PLANS = ("least", "half", "full")
ERROR_MOVE = 0.05
"""Points of peak error by which a model must move for `compare` to report it."""


def _last_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[-1] if lines else type(error).__name__)[:400]


def _raised_in_remat(error: BaseException) -> bool:
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and f"{os.sep}remat{os.sep}" in frames[-1].filename


def _recomputed(plan: Any) -> int:
    """Blocks whose activations the plan does not keep (recomputed, selectively or whole)."""
    return sum(seg.stop - seg.start for seg in plan.segments if seg.strategy != "keep")


def _max_abs_diff(a: Any, b: Any) -> float:
    import torch

    diffs = [(p.detach().double() - q.detach().double()).abs().max().item()
             for p, q in zip(a.parameters(), b.parameters(), strict=True) if p.numel()]
    return max(diffs, default=0.0) if all(torch.isfinite(torch.tensor(d)) for d in diffs) else float("nan")


def _train(model: Any, batch: dict[str, Any], steps: int) -> None:
    import torch

    from benchmarks._sweep.build import loss_fn, seed

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model.train()
    for i in range(steps):
        optimizer.zero_grad(set_to_none=True)
        seed(i)
        loss_fn(model(**batch), batch).backward()
        optimizer.step()


def _fine_tuned(model: Any, lora: int, dropout: float, quantize: str | None, use_peft: bool = False) -> Any:
    """``model`` with LoRA of rank ``lora`` (module docstring), ``lora_B`` seeded random; NF4 base
    weights with ``quantize``; with ``use_peft``, peft's own LoRA (``get_peft_model`` with
    ``LoraConfig(target_modules="all-linear")``, alpha 8 as `add_lora`'s): the wrapper it returns."""
    import torch

    from benchmarks._sweep.build import seed
    from remat.models.lora import add_lora, is_lora
    from remat.models.qlora import quantize_base

    if use_peft:
        import peft

        config = peft.LoraConfig(r=lora, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear")
        model = peft.get_peft_model(model, config)
        seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.02)
        return model
    add_lora(model, lora, dropout=dropout)
    seed(1)
    with torch.no_grad():
        for module in model.modules():
            if is_lora(module):
                module.lora_B.weight.normal_(0.0, 0.02)
    if quantize == "nf4":
        quantize_base(model)
    return model


def _runs_with_peft(model: Any, batch: dict[str, Any]) -> None:
    """A plain step of peft's model (raises where peft's wrapper cannot run the model: the
    harness's limit, not remat's)."""
    from benchmarks._sweep.build import loss_fn, seed

    seed(0)
    loss_fn(model(**batch), batch).backward()
    model.zero_grad(set_to_none=True)


def run_one(model_type: str, lora: int | None = None, dropout: float = 0.0,
            quantize: str | None = None, use_peft: bool = False) -> dict[str, Any]:
    """One model through the pipeline: its row of the sweep (never raises); fine-tuned with LoRA of
    rank ``lora`` where given, peft's with ``use_peft`` (`_fine_tuned`)."""
    start = time.perf_counter()
    row: dict[str, Any] = {"model": model_type, "status": "crash"}
    stage = "build"
    try:
        import torch

        import remat
        from benchmarks._sweep.build import build, loss_fn, seed
        from remat.plan.available import explained, unavailable_blocks
        from remat.plan.planners import pareto, plan
        from remat.plan.types import Segment

        torch.use_deterministic_algorithms(False)

        def built_model() -> Any:
            made = build(model_type)
            if lora is not None:
                made.model = _fine_tuned(made.model, lora, dropout, quantize, use_peft)
            return made

        try:
            built = build(model_type)
            if use_peft:  # peft's wrapper on a model it cannot wrap or run: the harness's limit too
                built.model = _fine_tuned(built.model, lora, dropout, quantize, use_peft)
                _runs_with_peft(built.model, built.batch)
        except Exception as e:  # noqa: BLE001 - the harness's limit, recorded
            row.update(status="unbuilt", reason=("peft: " if use_peft else "") + _last_line(e))
            return row
        if lora is not None:
            stage = "lora"
            if not use_peft:
                built.model = _fine_tuned(built.model, lora, dropout, quantize)
            row["lora"] = {"rank": lora, "dropout": dropout, "quantize": quantize, "peft": use_peft,
                           "trained": sum(p.numel() for p in built.model.parameters() if p.requires_grad)}
        row.update(task=built.task, class_name=built.class_name,
                   params=sum(p.numel() for p in built.model.parameters()))
        try:
            pristine = copy.deepcopy(built.model)
        except RuntimeError:  # a tensor with a graph left on a module by the plain step (RecurrentGemma's state)
            pristine = None  # the 3-step check builds the model twice more instead (`build` is seeded)
        model, batch = built.model, built.batch
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        stage = "profile"
        seed(0)
        prof = remat.profile(model, batch, loss_fn, optimizer, repeats=1)
        row.update(stacks=[[s.name, s.stop - s.start] for s in prof.stacks], blocks=prof.num_blocks)
        saved_after = sum(b.input_saved_after_bytes for b in prof.blocks)
        if saved_after:  # block inputs that code after the blocks saves (`BlockProfile.input_saved_after_bytes`)
            row["saved_after_bytes"] = saved_after
        freed = {storage: nbytes for b in prof.blocks for storage, nbytes in b.shared_freed}
        if freed:  # shared tensors the code frees before later blocks (`BlockProfile.shared_freed`)
            row["shared_freed_bytes"] = sum(freed.values())
        resaved = {storage: nbytes for b in prof.blocks for storage, nbytes, _ in b.shared_saved}
        if resaved:  # shared tensors a later block saves first (`BlockProfile.shared_saved`)
            row["shared_saved_bytes"] = sum(resaved.values())
        stage = "plan"
        frontier = pareto(prof)
        least, most = frontier[-1], frontier[0]
        middle = (least.prediction.peak_bytes + most.prediction.peak_bytes) / 2
        half = min(frontier, key=lambda p: abs(p.prediction.peak_bytes - middle))
        full = plan(prof, strategy="full")
        row["frontier"] = len(frontier)
        reasons = Counter(explained(reason) for i in range(prof.num_blocks)
                          for _, reason in unavailable_blocks(prof, Segment(start=i, stop=i + 1, strategy="recompute")))
        row["keep_only"] = {reason[:160]: count for reason, count in sorted(reasons.items())}
        ok = True
        for label, chosen in (("least", least), ("half", half), ("full", full)):
            stage = f"verify {label}"
            seed(0)
            check = remat.verify(model, batch, chosen, loss_fn, optimizer, repeats=1)
            row[label] = {
                "predicted_bytes": check.predicted_peak_bytes,
                "measured_bytes": check.measured_peak_bytes,
                "error_pct": round(check.peak_error_pct, 4),
                "ok": check.ok,
                "grads_identical": check.grads_identical,
                "grad_max_abs_diff": check.grad_max_abs_diff,
                "recomputed": _recomputed(chosen),
                "head": chosen.head,
            }
            ok = ok and check.ok and check.grads_identical
        stage = "apply"
        if pristine is not None:
            reference, planned = copy.deepcopy(pristine), copy.deepcopy(pristine)
        else:
            reference, planned = built_model().model, built_model().model
        remat.apply_(planned, least)
        stage = "train"
        _train(reference, batch, 3)
        _train(planned, batch, 3)
        remat.remove_(planned)
        same = all(torch.equal(p, q) for p, q in zip(reference.parameters(), planned.parameters(), strict=True))
        row["three_steps"] = {"bit_identical": same, "max_abs_diff": _max_abs_diff(reference, planned)}
        row["status"] = "ok" if ok and same else "verify-failed"
    except Exception as e:  # noqa: BLE001 - every failure is a row
        refused = isinstance(e, (ValueError, TypeError)) and _raised_in_remat(e)
        row.update(status="refused" if refused else "crash", stage=stage, reason=_last_line(e))
        if not refused:
            row["traceback"] = "".join(traceback.format_exception(e)).strip().splitlines()[-12:]
    finally:
        row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def run_isolated(model_type: str, timeout_s: float, tuning: list[str] | None = None) -> dict[str, Any]:
    """`run_one` in a subprocess of its own under ``timeout_s``: a crash, hang or OOM is a row.
    ``tuning``: the fine-tuning options passed on (``--lora R`` ...)."""
    command = [sys.executable, "-m", "benchmarks.sweep", "--one", model_type, "--json-line", *(tuning or [])]
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, str(Path(root) / "src"), env.get("PYTHONPATH")) if p)
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=root,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        return {"model": model_type, "status": "timeout", "reason": f"over {timeout_s:g} s",
                "seconds": round(time.perf_counter() - start, 2)}
    for line in reversed(out.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    tail = [line for line in err.strip().splitlines() if line.strip()][-12:]
    return {"model": model_type, "status": "crash", "stage": "process",
            "reason": f"exit code {proc.returncode}" + (f": {tail[-1][:300]}" if tail else ""),
            "traceback": tail, "seconds": round(time.perf_counter() - start, 2)}


# --- tables ---------------------------------------------------------------------------------------

def _pct(row: dict[str, Any], label: str) -> str:
    return f"{row[label]['error_pct']:+.2f}%" if isinstance(row.get(label), dict) else ""


def _grads(row: dict[str, Any]) -> str:
    checks = [row[label] for label in PLANS if isinstance(row.get(label), dict)]
    if not checks:
        return ""
    if all(c["grads_identical"] for c in checks):
        return "identical"
    return f"DIFFER (max {max(c['grad_max_abs_diff'] for c in checks):.2g})"


def _three(row: dict[str, Any]) -> str:
    steps = row.get("three_steps")
    if not steps:
        return ""
    return "yes" if steps["bit_identical"] else f"NO (max {steps['max_abs_diff']:.2g})"


def summary(rows: list[dict[str, Any]]) -> str:
    counts = Counter(r["status"] for r in rows)
    return ", ".join(f"{counts[s]} {s}" for s in STATUSES if counts[s]) + f" ({len(rows)} models)"


def markdown(rows: list[dict[str, Any]], changes: list[str] | None = None) -> str:
    header = ("| model | status | blocks | least / half / full recomputed | peak error: least / half / full | "
              "gradients | 3 steps bit-identical | seconds |")
    lines = [header, "| --- | --- | ---: | --- | --- | --- | --- | ---: |"]
    for r in rows:
        recomputed = " / ".join(str(r[p]["recomputed"]) for p in PLANS) if isinstance(r.get("full"), dict) else ""
        status = r["status"] if r["status"] in ("ok",) else f"{r['status']}: {r.get('reason', '')}".replace("|", "\\|")
        lines.append(f"| {r['model']} | {status} | {r.get('blocks', '')} | {recomputed} | "
                     f"{' / '.join(_pct(r, p) for p in PLANS) if 'full' in r else ''} | {_grads(r)} | {_three(r)} | "
                     f"{r.get('seconds', 0):.1f} |")
    lines += ["", f"Summary: {summary(rows)}."]
    if changes is not None:
        lines += ["", "Changes against the earlier sweep:", ""]
        lines += [f"- {c}" for c in changes] or ["- none"]
    return "\n".join(lines)


def compare(rows: list[dict[str, Any]], earlier: list[dict[str, Any]]) -> list[str]:
    """Per model of both sweeps, what changed: status, peak error moved by more than
    `ERROR_MOVE` points, blocks recomputed, number of blocks; models in one sweep only."""
    before = {r["model"]: r for r in earlier}
    now = {r["model"]: r for r in rows}
    out = []
    for name in sorted(before.keys() | now.keys()):
        a, b = before.get(name), now.get(name)
        if a is None or b is None:
            out.append(f"{name}: only in the {'earlier' if b is None else 'new'} sweep")
            continue
        if a["status"] != b["status"]:
            reason = f" ({b['reason']})" if b.get("reason") else ""
            out.append(f"{name}: status {a['status']} -> {b['status']}{reason}")
        if a.get("blocks") != b.get("blocks") and a.get("blocks") is not None and b.get("blocks") is not None:
            out.append(f"{name}: blocks {a['blocks']} -> {b['blocks']}")
        for label in PLANS:
            pa, pb = a.get(label), b.get(label)
            if not (isinstance(pa, dict) and isinstance(pb, dict)):
                continue
            if abs(pa["error_pct"] - pb["error_pct"]) > ERROR_MOVE:
                out.append(f"{name}: {label} peak error {pa['error_pct']:+.2f}% -> {pb['error_pct']:+.2f}%")
            if pa["recomputed"] != pb["recomputed"]:
                out.append(f"{name}: {label} recomputed {pa['recomputed']} -> {pb['recomputed']}")
    return out


def model_types(models: list[str] | None, skip: int, limit: int | None) -> list[str]:
    if models:
        names = list(models)
    else:
        import transformers

        names = sorted(transformers.CONFIG_MAPPING.keys())
    names = names[skip:]
    return names if limit is None else names[:limit]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", metavar="TYPE")
    parser.add_argument("--limit", type=int)
    parser.add_argument("--skip", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--compare", type=Path, metavar="EARLIER_JSON")
    parser.add_argument("--lora", type=int, metavar="R", help="fine-tune with LoRA of rank R (module docstring)")
    parser.add_argument("--lora-dropout", type=float, default=0.0, metavar="P")
    parser.add_argument("--quantize", choices=("nf4",), help="with --lora: the frozen linear layers in NF4 (QLoRA)")
    parser.add_argument("--peft", action="store_true", help="with --lora: peft's own LoRA (get_peft_model)")
    parser.add_argument("--one", metavar="TYPE", help=argparse.SUPPRESS)
    parser.add_argument("--json-line", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from remat._files import write_atomic

    if args.lora is None and (args.lora_dropout or args.quantize or args.peft):
        parser.error("--lora-dropout, --quantize and --peft fine-tune with LoRA: add --lora R")
    if args.peft and args.quantize:
        parser.error("--peft runs peft's LoRA over the model's own weights; --quantize nf4 is remat's NF4 layer: pick one")
    tuning = [] if args.lora is None else ["--lora", str(args.lora), "--lora-dropout", repr(args.lora_dropout),
                                           *(["--quantize", args.quantize] if args.quantize else []),
                                           *(["--peft"] if args.peft else [])]

    if args.one:
        warnings.filterwarnings("ignore")
        row = run_one(args.one, args.lora, args.lora_dropout, args.quantize, args.peft)
        print(RESULT_MARK + json.dumps(row) if args.json_line else json.dumps(row, indent=2), flush=True)
        return [row]
    rows: list[dict[str, Any]] = []
    for name in model_types(args.models, args.skip, args.limit):
        rows.append(run_isolated(name, args.timeout_s, tuning))
        r = rows[-1]
        print(f"{name}: {r['status']}" + (f" ({r['reason']})" if r.get("reason") else "")
              + f" {r.get('seconds', 0):.1f} s", file=sys.stderr, flush=True)
        if args.json:
            write_atomic(args.json, json.dumps(rows, indent=1) + "\n")
    changes = compare(rows, json.loads(args.compare.read_text())) if args.compare else None
    text = markdown(rows, changes)
    print(text)
    if args.markdown:
        write_atomic(args.markdown, text + "\n")
    return rows


if __name__ == "__main__":
    main()
