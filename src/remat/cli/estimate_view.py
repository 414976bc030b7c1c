"""What `remat estimate` prints: the setup, model state, one table per device, diagnoses, and
the fastest layouts of ``--search``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

from remat.cli._app import console, styled

GIB = 2**30
MIB = 2**20

STEP_MODEL = ("step = micro-batches x (forward + backward + replayed FLOPs) / (MFU x peak FLOP/s) "
              "+ tensor/context/expert/pipeline communication + pipeline bubble + data-parallel traffic not "
              "hidden by the backward + optimizer step at memory bandwidth")


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f}"


def render(result) -> None:
    """Print the estimate: setup, model state, one table per device, diagnoses."""
    par = result.parallelism
    console.print(styled(
        f"[bold]{escape(result.model)}[/]: {result.param_count / 1e9:.3f} B parameters, {result.num_layers} layers; "
        f"micro-batch {result.micro_batch} x seq {result.seq_len}, {result.dtype} ({result.precision} precision"
        f"{', fp32 gradients' if result.fp32_grads else ''}), {result.optimizer}, ZeRO-{result.zero_stage}, "
        f"{result.grad_accumulation_steps} micro-batch(es) per step, MFU {result.mfu:.0%}"
    ))
    console.print(f"layout: {par.describe()} = {result.gpus} GPU(s)"
                  + (f", expert load {par.expert_load:g}x the mean" if par.expert > 1 or par.expert_load > 1 else ""))
    console.print(
        f"per layer and GPU: saved {result.layer_saved_bytes / MIB:.1f} MiB, input {result.layer_input_bytes / MIB:.1f} MiB; "
        f"outside layers: saved {result.fixed_saved_bytes / MIB:.1f} MiB; "
        f"{result.train_flops / 1e12:.1f} TFLOP per micro-batch (forward + backward) on the busiest GPU"
    )
    console.print(head_line(result))
    a = result.allowance
    console.print(
        f"allowance: context {a.context_bytes / MIB:.0f} MiB + workspaces {a.workspace_bytes / MIB:.0f} MiB "
        f"+ fragmentation {a.fragmentation_fraction:.0%} of the peak"
    )
    console.print(STEP_MODEL)
    for dev in result.devices:
        console.print(state_line(dev))
        table = device_table(dev, pipeline=par.pipeline > 1)
        if Measurement.get(console, console.options.update(max_width=1 << 16), table).maximum <= console.width:
            console.print(table)
        else:  # a narrow terminal (80 columns) cut the table's cells with "...": "100.…" for 100.00
            for line in device_lines(dev, pipeline=par.pipeline > 1):
                console.print(line)
        for row in dev.strategies:
            if row.diagnosis:
                console.print(styled(f"[yellow]{escape(row.strategy)}[/]: {escape(row.diagnosis)}"))
                if row.diagnosis.startswith(f"On {dev.device.name}, model state"):
                    break  # the same words for every strategy


def head_line(result) -> str:
    """The head strategy priced and what each would hold and peak at on one GPU of the last stage."""
    if not result.head_bytes:
        return f"LM head: priced as traced ({result.head_note or 'no head part'})"
    parts = "; ".join(f"{h.strategy} {_gib(h.post_peak_bytes)}" for h in result.head_bytes)
    keep = result.head_bytes[0]
    return (f"LM head: {result.head} (logits {_gib(keep.logits_bytes)} GiB per GPU); peak of the part after the "
            f"layers per micro-batch, GiB: {parts} (--head)")


def state_line(dev):
    from remat.estimate.explain import state_parts

    s = dev.model_state
    parts = " + ".join(f"{name} {_gib(num_bytes)}" for name, num_bytes in state_parts(s))
    return styled(f"\n[bold]{escape(dev.device.name)}[/] ({_gib(dev.device.memory_bytes)} GiB, {_gib(dev.budget_bytes)} GiB for tensors): "
            f"model state per GPU {_gib(s.total_bytes)} GiB = {parts} GiB")


def device_table(dev, *, pipeline: bool = False) -> Table:
    caption = ("GiB per GPU; peak = model state + activations held + working set; comm s: communication, "
               "bubble and data-parallel traffic not hidden; max mb: largest micro-batch that fits")
    table = Table(show_edge=False, caption=caption)
    names = ["strategy", "layout", "fits", "peak", "+allow", "total", "held", "recompute TFLOP", "step s", "comm s",
             "max mb"] + (["stage"] if pipeline else [])
    for name in names:
        table.add_column(name, justify="left" if name in ("strategy", "layout") else "right")
    for row in dev.strategies:
        t = row.time
        comm = t.comm_s + t.bubble_s + t.data_parallel_s if t else 0.0
        cells = [row.strategy, _layout(row), styled("[green]yes[/]" if row.fits else "[red]no[/]"), _gib(row.peak_bytes),
                 _gib(row.allowance_bytes), _gib(row.total_bytes), _gib(row.held_bytes),
                 f"{row.recompute_flops / 1e12:.1f}", f"{row.step_s:.2f}", f"{comm:.2f}", _max_mb(row)]
        table.add_row(*cells, *([f"{row.peak_stage} ({row.peak_phase})"] if pipeline else []))
    return table


def device_lines(dev, *, pipeline: bool = False) -> list[str]:
    """`device_table`'s rows as lines, each figure named, for a terminal too narrow for its columns."""
    lines = []
    for row in dev.strategies:
        t = row.time
        comm = t.comm_s + t.bubble_s + t.data_parallel_s if t else 0.0
        layout = _layout(row)
        lines.append(
            f"{row.strategy}{'' if layout == '-' else f' ({layout})'}: fits {'yes' if row.fits else 'no'}; GiB per GPU: "
            f"peak {_gib(row.peak_bytes)}, +allow {_gib(row.allowance_bytes)}, total {_gib(row.total_bytes)}, held "
            f"{_gib(row.held_bytes)}; recompute {row.recompute_flops / 1e12:.1f} TFLOP; step {row.step_s:.2f} s, comm "
            f"{comm:.2f} s; max mb {_max_mb(row)}" + (f"; stage {row.peak_stage} ({row.peak_phase})" if pipeline else ""))
    lines.append("(peak = model state + activations held + working set; comm: communication, bubble and data-parallel "
                 "traffic not hidden; max mb: largest micro-batch that fits)")
    return lines


def _max_mb(row) -> str:
    return "-" if row.max_micro_batch is None else str(row.max_micro_batch)


def _layout(row) -> str:
    """The strategies behind a row in a few words (the optimal mix, or nothing for a uniform one)."""
    return row.plan_strategy.split(": ", 1)[1] if ": " in row.plan_strategy else "-"


def render_search(found, spec, *, gpus: int, global_batch: int, seq_len: int) -> None:
    """The fastest layouts, fastest first."""
    console.print(styled(f"[bold]{gpus} x {escape(spec.name)}[/], global batch {global_batch} x {seq_len} tokens: "
                         f"{len(found)} fastest layout(s) that fit"))
    if not found:
        console.print(styled("[red]no layout of the search space fits[/]: more GPUs, a device with more memory, or a "
                             "smaller global batch per step."))
        return
    table = Table(show_edge=False, caption=STEP_MODEL)
    for name in ("#", "layout", "ZeRO", "mb", "m", "strategy", "head", "peak GiB", "step s", "tokens/s/GPU", "MFU"):
        table.add_column(name, justify="left" if name in ("layout", "strategy") else "right")
    for i, c in enumerate(found, 1):
        table.add_row(str(i), c.parallelism.describe(), str(c.zero_stage), str(c.micro_batch), str(c.micro_batches),
                      c.strategy, c.head, _gib(c.peak_bytes), f"{c.step_s:.2f}", f"{c.tokens_per_s_per_gpu:,.0f}",
                      f"{c.mfu:.1%}")
    console.print(table)


def devices_table(devices_file: Optional[Path]) -> Table:
    from remat.estimate.devices import builtin_devices, load_devices_file

    specs = builtin_devices()
    if devices_file is not None:
        specs.update(load_devices_file(devices_file))
    table = Table(show_edge=False)
    for name in ("device", "memory GiB", "bf16 TFLOP/s", "fp32 TFLOP/s", "memory TB/s", "host link GB/s",
                 "GPU link GB/s", "GPUs/node", "source"):
        table.add_column(name)
    for spec in specs.values():
        table.add_row(
            spec.name, _gib(spec.memory_bytes), f"{spec.peak_bf16_flops_per_s / 1e12:.1f}",
            f"{spec.peak_fp32_flops_per_s / 1e12:.1f}" if spec.peak_fp32_flops_per_s else "-",
            f"{spec.memory_bytes_per_s / 1e12:.2f}" if spec.memory_bytes_per_s else "-",
            f"{spec.host_link_bytes_per_s / 1e9:.0f}" if spec.host_link_bytes_per_s else "-",
            f"{spec.gpu_link_bytes_per_s / 1e9:.0f}" if spec.gpu_link_bytes_per_s else "-",
            str(spec.gpus_per_node or "-"),
            spec.sources.get("memory_bytes", "user file").split(",")[0],
        )
    return table
