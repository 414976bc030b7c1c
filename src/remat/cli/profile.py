"""`remat profile`: measure a built-in model or ``file.py:function`` and print the per-block table."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.progress import Progress
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from remat._units import format_bytes, format_bytes_exact, in_unit, table_unit
from remat.cli._app import DEVICE_HELP, TARGET_HELP, app, check_output_file, console, fail
from remat.distributed import is_main_process
from remat.measure.types import Profile
from remat.plan.policies import MAX_KNAPSACK_GROUPS, knapsack_left_out_ms



@app.command("profile")
def profile_command(
    target: Optional[str] = typer.Argument(None, help=TARGET_HELP + " Overrides --model."),
    model: str = typer.Option("gpt", "--model", "-m", help="Built-in model to profile."),
    layers: Optional[int] = typer.Option(None, help="Blocks (gpt/hf layers, mlp depth, convnet blocks, unet levels)."),
    d_model: Optional[int] = typer.Option(None, "--d-model", help="Width (gpt/hf d_model, mlp width, convnet/unet channels)."),
    heads: Optional[int] = typer.Option(None, help="Attention heads."),
    seq: Optional[int] = typer.Option(None, help="Sequence length (convnet, unet: image size)."),
    batch: Optional[int] = typer.Option(None, help="Batch size."),
    vocab: Optional[int] = typer.Option(None, help="Vocabulary size."),
    dropout: Optional[float] = typer.Option(None, help="Dropout probability."),
    attention: Optional[str] = typer.Option(None, help="gpt: explicit or sdpa; hf: eager or sdpa."),
    blocks: Optional[list[str]] = typer.Option(None, "--blocks", help="Glob over module names or a class name; repeatable (several stacks)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write the Profile as JSON here."),
    warmup: int = typer.Option(1, help="Plain steps before measuring."),
    repeats: int = typer.Option(5, help="Timed steps (the median is kept)."),
    seed: int = typer.Option(0, help="Seed of the built-in model's weights and batch."),
    device: Optional[str] = typer.Option(None, "--device", help=DEVICE_HELP),
    compiled: bool = typer.Option(False, "--compiled", help="Also measure each block under torch.compile "
                                  "(inductor): the profile of a model that will train compiled."),
    grad_accumulation: bool = typer.Option(False, "--grad-accumulation", help="Several micro-batches per "
                                           "optimizer step: plans are for a micro-batch whose gradients add to "
                                           "the earlier ones' (every gradient live through it)."),
    head_chunks: Optional[str] = typer.Option(None, "--head-chunks", help="Chunk sizes (tokens) a chunked LM head "
                                              "is measured at, e.g. 512,64 (default: from half the tokens down to 64)."),
    offload_dir: Optional[Path] = typer.Option(None, "--offload-dir", help="Measure this directory's disk too, so "
                                               "that plans of this profile may offload to it (offload:disk)."),
) -> None:
    """Measure the real model block by block: saved bytes, time, FLOPs, memory peak.

    A path/to/file.py:build target is imported and build() called: that file's code runs."""
    from remat.measure.profile import profile
    from remat.models import load_target, sizes_from_options

    spec = target or model
    check_output_file(json_path, "--json")
    chunks = parse_head_chunks(head_chunks)
    options = dict(layers=layers, d_model=d_model, heads=heads, seq=seq, batch=batch, vocab=vocab,
                   dropout=dropout, attention=attention)
    with console.status(Text(f"building {spec}...")):
        sizes = sizes_from_options(spec, **options)
        built = load_target(spec, seed=seed, device=device, **sizes)
    with Progress(*Progress.get_default_columns(), console=console, transient=True) as bar:
        task = bar.add_task(f"profiling {escape(spec)}", total=None)

        def advance(done: int, total: int, stage: str) -> None:
            bar.update(task, completed=done, total=total, description=f"profiling {escape(spec)}: {escape(stage)}")

        result = profile(built.model, built.batch, built.loss_fn, built.optimizer, blocks or None,
                         warmup=warmup, repeats=repeats, progress=advance, compiled=compiled,
                         grad_accumulation=grad_accumulation, head_chunks=chunks,
                         offload_dir=None if offload_dir is None else str(offload_dir))
    console.print(profile_table(result, spec))
    if any(b.unavailable for b in result.blocks):
        console.print(unavailable_rich(result))
    console.print(stacks_summary(result))
    console.print(sharing_summary(result))
    console.print(state_summary(result))
    console.print(head_summary(result))
    if json_path is not None and is_main_process():  # under torchrun, rank 0 writes
        try:
            result.save(json_path)
        except OSError as error:
            raise fail(f"cannot write {json_path}: {error.strerror}; pass --json with a writable path.") from None
        console.print(f"profile written to {json_path}")


def profile_table(result: Profile, title: str) -> Table:
    """The per-block table: saved bytes, fwd/bwd ms, GFLOPs, share of the step (bytes in the unit
    that shows the largest of them, `remat._units.table_unit`)."""
    unit, size = table_unit([result.fixed_saved_bytes, result.fixed_post_bwd_temp_bytes, result.optimizer_step_temp_bytes,
                             *(b.saved_bytes for b in result.blocks), *(b.bwd_temp_bytes for b in result.blocks)])
    table = Table(title=f"remat profile: {title} on {result.environment.device_name}")
    for header in ("#", "block", "class", f"saved {unit}", f"bwd temp {unit}", "fwd ms", "bwd ms", "GFLOPs", "share of step"):
        table.add_column(header, justify="left" if header in ("block", "class") else "right")
    step_ms = result.step_ms or 1.0
    table.add_row("", "pre + between + post (fixed)", "", in_unit(result.fixed_saved_bytes, size),
                  in_unit(result.fixed_post_bwd_temp_bytes, size),
                  f"{result.fixed_fwd_ms:.2f}", f"{result.fixed_bwd_ms:.2f}", f"{result.fixed_flops / 1e9:.3f}",
                  f"{100 * (result.fixed_fwd_ms + result.fixed_bwd_ms) / step_ms:.1f}%")
    for b in result.blocks:
        table.add_row(str(b.index), b.name, b.class_name, in_unit(b.saved_bytes, size), in_unit(b.bwd_temp_bytes, size),
                      f"{b.fwd_ms:.2f}", f"{b.bwd_ms:.2f}", f"{b.fwd_flops / 1e9:.3f}",
                      f"{100 * (b.fwd_ms + b.bwd_ms) / step_ms:.1f}%")
    table.add_row("", "optimizer step", result.optimizer_name, "", in_unit(result.optimizer_step_temp_bytes, size),
                  "", f"{result.optimizer_step_ms:.2f}", "", f"{100 * result.optimizer_step_ms / step_ms:.1f}%")
    return table


def unavailable_rich(result: Profile) -> Table:
    """The strategies a block cannot run, and why (`remat.report.tables.unavailable_table`)."""
    from remat.report.tables import unavailable_table

    headers, rows = unavailable_table(result)
    table = Table(title="strategies a block cannot run (their probes raised; no plan picks them there)")
    for header in headers:
        table.add_column(header, justify="right" if header == "#" else "left")
    for row in rows:
        table.add_row(*row)
    return table


def stacks_summary(result: Profile) -> str:
    """The stacks (name, blocks, class) and the fixed part (its modules with parameters, their
    bytes, and what it saves before, between and after the blocks), a line each."""
    stacks = "; ".join(f"{s.name or '<root>'} ({s.stop - s.start} x {s.class_name}, blocks {s.start}-{s.stop - 1})"
                       for s in result.stacks)
    breaks = sum(1 for b in result.blocks[1:] if not b.follows_previous)
    held = [m for m in result.fixed_modules if m.param_bytes]
    modules = ", ".join(f"{m.name} {format_bytes(m.param_bytes)}" for m in held[:8]) + (", ..." if len(held) > 8 else "")
    return "\n".join([
        f"stacks: {stacks or 'not recorded'}; chain breaks: {breaks} (a block not called with the previous "
        "block's output and its other arguments)",
        f"fixed part: {len(result.fixed_modules)} module(s) outside blocks, parameters: {modules or 'none'}; "
        f"saved pre {format_bytes(result.fixed_pre_saved_bytes)}, between {format_bytes(result.fixed_between_saved_bytes)}, "
        f"post {format_bytes(result.fixed_post_saved_bytes)}" + _unplanned_hint(result),
    ])


def _unplanned_hint(result: Profile) -> str:
    """A sentence when the fixed part saves more than the blocks (the head part aside, which is
    planned): no plan touches those bytes. CANINE's one-layer character encoders (a stack is two
    or more modules) held 74 % of its saved activations, and naming them lowered the least peak 12 %."""
    head = result.head.option("keep").saved_bytes if result.head is not None else 0
    fixed = result.fixed_pre_saved_bytes + result.fixed_between_saved_bytes + result.fixed_post_saved_bytes - head
    blocks = sum(b.saved_bytes for b in result.blocks)
    if fixed <= blocks:
        return ""
    return (f"; the fixed part saves more than the blocks ({format_bytes(fixed)} against {format_bytes(blocks)}"
            f"{', the head aside' if head else ''}), which no plan changes: name the modules that save it as blocks "
            "too (--blocks, one glob per stack, the found stacks' included) to plan them")


def sharing_summary(result: Profile) -> str:
    """Which blocks' timing probes ran and which blocks took whose (`remat.measure.sharing`), a line."""
    sources = [b.timing_from for b in result.blocks]
    if not sources or any(source is None for source in sources):
        return "timing probes: every block measured (recorded without sharing)"
    measured = [i for i, source in enumerate(sources) if source == i]
    taken = [_taking([i for i, s in enumerate(sources) if s == r and i != r], r) for r in measured]
    taken = [text for text in taken if text]
    split = _ranges(list(result.timing_split)) or "none"
    return (f"timing probes: run on {len(measured)} of {len(sources)} blocks ({_ranges(measured)})"
            f"{'; ' + '; '.join(taken) if taken else ''}; measured apart because their traced forward "
            f"differed from an alike block's: {split}")


def _taking(members: list[int], source: int) -> str:
    if not members:
        return ""
    return f"block {members[0]} takes block {source}'s" if len(members) == 1 else \
        f"blocks {_ranges(members)} take block {source}'s"


def _ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def state_summary(result: Profile) -> str:
    """Model state, activations and the measured peak, one line each."""
    peak = ", ".join(f"{k} {format_bytes(v)}" for k, v in result.peak_bytes_by_category.items() if v)
    lines = [
        f"parameters {format_bytes(result.param_bytes)}, gradients {format_bytes(result.grad_bytes)}, "
        f"optimizer state {format_bytes(result.optimizer_state_bytes)} ({result.optimizer_name}), "
        f"buffers {format_bytes(result.buffer_bytes)}",
        f"saved activations {format_bytes(result.saved_bytes)} in {result.num_blocks} blocks + fixed part; "
        f"step {result.step_ms:.1f} ms",
        f"measured peak {format_bytes_exact(result.peak_bytes)} ({peak})",
    ]
    if result.step_held_bytes:
        lines.append(f"kept on the model between steps (tensors its code stores on modules, live through the "
                     f"optimizer's step): {format_bytes(result.step_held_bytes)}")
    left_out = [(b.index, knapsack_left_out_ms(b)) for b in result.blocks]
    left_out = [(i, ms) for i, ms in left_out if ms > 0]
    if left_out:
        lines.append(f"selective:knapsack offers the {MAX_KNAPSACK_GROUPS} call groups of most replay time of a block; "
                     f"{len(left_out)} block(s) have more, always replayed: up to "
                     f"{max(ms for _, ms in left_out):.2f} ms a block (block {max(left_out, key=lambda t: t[1])[0]})")
    sized = size_group_summary(result)
    if sized:
        lines.append(sized)
    if result.device_max_allocated_bytes is not None:
        lines.append(f"torch.cuda.max_memory_allocated {format_bytes_exact(result.device_max_allocated_bytes)}")
    return "\n".join(lines)


def size_group_summary(result: Profile) -> str:
    """A line on the calls whose sizes follow the data (`remat.measure.size_groups`), or ""."""
    from remat.measure.size_groups import FIXED, UNCACHED

    blocks = [b for b in result.blocks if any(op.size_group != FIXED for op in b.ops)]
    if not blocks:
        return ""
    grouped = sum(op.size_group >= 0 for b in blocks for op in b.ops if not op.is_view)
    families = sum(len({op.size_group for op in b.ops if op.size_group >= 0}) for b in blocks)
    never = sum(op.size_group == UNCACHED for b in blocks for op in b.ops if not op.is_view)
    return (f"calls whose sizes follow the data (a router's tokens per expert) in {len(blocks)} block(s): "
            f"{grouped} in {families} families that selective plans cache whole or not at all, "
            f"{never} never cached (their sizes, or which call a plan's name meets, change with the batch)")


def head_summary(result: Profile) -> str:
    """The head part in a line: each measured head strategy's peak and time, or why there is none."""
    from remat.plan.head import head_extra_ms, head_need_bytes

    head = result.head
    if head is None:
        return f"head: not planned ({result.head_note})"
    tied = ", tied to the embedding" if head.tied else ""
    options = "; ".join(f"{o.strategy} {format_bytes(head_need_bytes(result, o.strategy))} {head_extra_ms(result, o.strategy):+.1f} ms"
                        for o in head.options)
    failed = "".join(f"; {name} cannot run: {reason}" for name, reason in head.unavailable)
    return (f"head: {head.projection}{tied}, {head.num_tokens} tokens x {head.vocab_size} vocabulary ({head.dtype}); "
            f"post part peak by head strategy: {options}{failed}")


def parse_head_chunks(text: Optional[str]) -> Optional[tuple[int, ...]]:
    """``--head-chunks 512,64`` -> (512, 64); None when not given."""
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--head-chunks {text!r}: expected positive token counts separated by commas, e.g. 512,64.")
    return tuple(int(p) for p in parts)
