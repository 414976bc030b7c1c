"""Layers that run several times per step, planned call by call, against checkpointing every call.

    python -m benchmarks.shared_layers [--models universal albert gru] [--repeats 15] [--markdown out.md]

Three models whose weights serve several calls (`remat.checkpointing.callsites`): a Universal
Transformer (one ``nn.TransformerEncoderLayer`` applied at every depth), ALBERT (Hugging Face's
``AlbertForMaskedLM`` from a config: one layer group at every depth) and a GRU cell stepped over
time. Before, remat had no block to plan in them; the way left to a user was to checkpoint every
call of the shared layer by hand. Per model, every strategy on a copy built from the same seed, the same batch:

- ``none``: no recomputation, the reference for gradients and time;
- ``every call``: `torch.utils.checkpoint.checkpoint(layer, ..., use_reentrant=False)` around each
  call (for ALBERT, around its layer group's forward: transformers 5 refuses
  ``gradient_checkpointing_enable()`` on ALBERT);
- remat's plans from one profile (no optimizer, as the steps): ``optimal`` at the measured peak of ``every call``,
  ``sqrt`` (segments of √N calls) and the least-peak plan (`remat.pareto`'s last).

A step is gradients to None, the seed set, forward, loss, backward (no optimizer step: the same
for every strategy). The peak is the live-storage tracker's (`remat.measure.tracker.track_step`);
the time the median over ``--repeats`` rounds, each round one step of every strategy, starting one
strategy later than the round before; gradients compared with ``torch.equal`` against ``none``, or,
for a plan that runs the head chunked (its loss summed chunk by chunk), within the head's stated
normwise relative tolerance (`remat.apply.head.head_tolerance`), as `benchmarks.peers` does.
For remat's plans the predicted peak and step time are printed beside the measured ones.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import remat
from remat.apply.head import head_tolerance
from remat.measure.tracker import track_step
from remat.verify import max_rel_diff

MIB = 2**20


class Universal(nn.Module):
    """One transformer layer applied ``depth`` times."""

    def __init__(self, depth: int, d_model: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.layer = nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, dropout=0.1, batch_first=True)
        self.head = nn.Linear(d_model, vocab)
        self.depth = depth
        self.every_call = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for _ in range(self.depth):
            x = checkpoint(self.layer, x, use_reentrant=False) if self.every_call else self.layer(x)
        return self.head(x)


class Recurrent(nn.Module):
    """A GRU cell stepped over the sequence, a projection of every hidden state."""

    def __init__(self, inputs: int, hidden: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, inputs)
        self.cell = nn.GRUCell(inputs, hidden)
        self.head = nn.Linear(hidden, vocab)
        self.hidden = hidden
        self.every_call = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        h = x.new_zeros(x.shape[0], self.hidden)
        states = []
        for t in range(x.shape[1]):
            h = checkpoint(self.cell, x[:, t], h, use_reentrant=False) if self.every_call else self.cell(x[:, t], h)
            states.append(h)
        return self.head(torch.stack(states, 1))


def _lm_loss(out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), ids.reshape(-1))


@dataclass
class Case:
    title: str
    model: nn.Module
    batch: Any
    loss_fn: Callable[..., torch.Tensor] | None
    every_call: Callable[[nn.Module], None]


def _set_flag(model: nn.Module) -> None:
    model.every_call = True


def build(name: str, small: bool = False) -> Case:
    torch.manual_seed(0)
    if name == "universal":
        depth, d, seq, batch = (3, 16, 8, 2) if small else (12, 128, 128, 8)
        ids = torch.randint(0, 512, (batch, seq))
        return Case(f"universal: one TransformerEncoderLayer (d_model {d}, dropout 0.1) x {depth} depths, batch "
                    f"{batch} x {seq}", Universal(depth, d, 512), ids, _lm_loss, _set_flag)
    if name == "gru":
        steps, hidden, batch = (4, 16, 2) if small else (96, 256, 32)
        ids = torch.randint(0, 256, (batch, steps))
        return Case(f"gru: one GRUCell (64 -> {hidden}) x {steps} time steps, batch {batch}", Recurrent(64, hidden, 256),
                    ids, _lm_loss, _set_flag)
    if name == "albert":
        from transformers import AlbertConfig, AlbertForMaskedLM

        layers, hidden, seq, batch = (2, 16, 8, 2) if small else (12, 128, 128, 8)
        config = AlbertConfig(vocab_size=512, embedding_size=64, hidden_size=hidden, num_hidden_layers=layers,
                              num_attention_heads=4, intermediate_size=4 * hidden, max_position_embeddings=seq)
        ids = torch.randint(0, 512, (batch, seq))

        def hf(model: nn.Module) -> None:  # transformers has no checkpointing for ALBERT: by hand, as a user would
            group = model.albert.encoder.albert_layer_groups[0]
            own = group.forward
            group.forward = lambda *args, **kwargs: checkpoint(own, *args, use_reentrant=False, **kwargs)

        return Case(f"albert: AlbertForMaskedLM, one layer group x {layers} layers (hidden {hidden}), batch {batch} x "
                    f"{seq}", AlbertForMaskedLM(config).train(), {"input_ids": ids, "labels": ids}, None, hf)
    raise ValueError(f"unknown model {name!r}; known: universal, albert, gru.")


def _call(model: nn.Module, batch: Any) -> Any:
    return model(**batch) if isinstance(batch, dict) else model(batch)


def _loss(case: Case, out: Any) -> torch.Tensor:
    return case.loss_fn(out, case.batch) if case.loss_fn is not None else out.loss


def _step(case: Case, model: nn.Module) -> Callable[[], None]:
    def run() -> None:
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(1)
        _loss(case, _call(model, case.batch)).backward()

    return run


@dataclass
class Result:
    name: str
    peak_bytes: int
    step_ms: float
    identical: bool
    predicted_bytes: int | None = None
    predicted_ms: float | None = None
    what: str = ""
    label: str = "identical"
    """How the gradients compare with ``none``'s: "identical", within a chunked head's tolerance, or "DIFFER"."""


def run_case(name: str, repeats: int, small: bool = False) -> tuple[Case, list[Result], float]:
    case = build(name, small)
    start = time.perf_counter()
    models: dict[str, nn.Module] = {"none": copy.deepcopy(case.model)}
    models["every call"] = copy.deepcopy(case.model)
    case.every_call(models["every call"])
    prof = remat.profile(copy.deepcopy(case.model), case.batch, case.loss_fn)  # no optimizer, as the steps here
    peaks: dict[str, int] = {}
    for key in ("none", "every call"):
        peaks[key] = track_step(_step(case, models[key]), model=models[key], batch=case.batch).peak_bytes
    plans = {"remat @ every call": remat.plan(prof, budget=peaks["every call"]),
             "remat sqrt": remat.plan(prof, strategy="sqrt"), "remat least peak": remat.pareto(prof)[-1]}
    for key, plan in plans.items():
        models[key] = remat.apply_(copy.deepcopy(case.model), plan)
        peaks[key] = track_step(_step(case, models[key]), model=models[key], batch=case.batch).peak_bytes
    steps = {key: _step(case, model) for key, model in models.items()}
    for run in steps.values():  # warm-up
        run()
    grads: dict[str, list[torch.Tensor]] = {}
    for key, run in steps.items():
        run()
        grads[key] = [p.grad.clone() if p.grad is not None else None for p in models[key].parameters()]
    times: dict[str, list[float]] = {key: [] for key in steps}
    keys = list(steps)
    for r in range(repeats):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            t0 = time.perf_counter()
            steps[key]()
            times[key].append((time.perf_counter() - t0) * 1e3)
    results = []
    for key in keys:
        same = all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                   for a, b in zip(grads[key], grads["none"]))
        plan = plans.get(key)
        what = ("no recomputation" if key == "none" else "checkpoint around every call"
                if key == "every call" else _layout(plan))
        label = "identical" if same else "DIFFER"
        if plan is not None and plan.head != "keep":  # a chunked head sums in another order: its stated tolerance
            what += f", head {plan.head}"
            rtol = head_tolerance(case.model, plan.head, case.batch).relative_tolerance
            present = [(a, b) for a, b in zip(grads[key], grads["none"]) if a is not None and b is not None]
            rel = max_rel_diff([a for a, _ in present], [b for _, b in present])
            if not same and rel <= rtol:
                same, label = True, f"within the chunked head's tolerance (rel {rel:.1e} <= {rtol:.0e})"
        results.append(Result(key, peaks[key], statistics.median(times[key]), same,
                              plan.prediction.peak_bytes if plan else None, plan.prediction.step_ms if plan else None,
                              what, label))
    return case, results, time.perf_counter() - start


def _layout(plan: Any) -> str:
    counts: dict[str, int] = {}
    for seg in plan.segments:
        key = seg.strategy if seg.stop - seg.start == 1 else f"{seg.strategy} of {seg.stop - seg.start}"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} x{n}" for k, n in counts.items())


def markdown(case: Case, results: list[Result], seconds: float, command: str) -> str:
    base = next(r for r in results if r.name == "none")
    peer = next(r for r in results if r.name == "every call")
    lines = [f"#### {case.title}", "",
             f"`{command}`; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}, "
             f"{torch.get_num_threads()} threads, {platform.machine()}, run took {seconds:.0f} s.", "",
             "| strategy | what it does | peak MiB | predicted MiB | step ms (median) | predicted ms | vs none | vs every call "
             "| gradients |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in results:
        pred = f"{r.predicted_bytes / MIB:.2f}" if r.predicted_bytes is not None else "-"
        pms = f"{r.predicted_ms:.1f}" if r.predicted_ms is not None else "-"
        lines.append(f"| {r.name} | {r.what} | {r.peak_bytes / MIB:.2f} | {pred} | {r.step_ms:.1f} | {pms} | "
                     f"{r.step_ms / base.step_ms:.2f}x | {r.step_ms / peer.step_ms:.2f}x | "
                     f"{r.label} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["universal", "albert", "gru"])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--small", action="store_true", help="tiny sizes (the tests' smoke run)")
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args(argv)
    command = "python -m benchmarks.shared_layers " + " ".join(argv if argv is not None else sys.argv[1:])
    out = []
    for name in args.models:
        case, results, seconds = run_case(name, args.repeats, args.small)
        text = markdown(case, results, seconds, command.strip())
        print(text, flush=True)
        out.append(text)
    if args.markdown:
        from remat._files import write_atomic

        write_atomic(args.markdown, "\n".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
