"""`remat estimate`: will a training step fit, on which device, with which strategy (no GPU needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from remat.cli._app import app, console, fail

GIB = 2**30
MIB = 2**20


@app.command("estimate")
def estimate_command(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Built-in model (gpt, mlp...) or path/to/file.py:build."),
    hf: Optional[str] = typer.Option(None, "--hf", help="Hugging Face family built from sizes: gpt2, llama, mistral."),
    config: Optional[Path] = typer.Option(None, "--config", help="A Hugging Face config.json (no download)."),
    hidden: Optional[int] = typer.Option(None, help="Hidden size (--hf; d_model of a built-in model)."),
    layers: Optional[int] = typer.Option(None, help="Number of layers."),
    heads: Optional[int] = typer.Option(None, help="Attention heads."),
    kv_heads: Optional[int] = typer.Option(None, "--kv-heads", help="Key/value heads (grouped-query attention)."),
    intermediate: Optional[int] = typer.Option(None, help="MLP intermediate size."),
    vocab: Optional[int] = typer.Option(None, help="Vocabulary size."),
    device: list[str] = typer.Option(["H100-80GB"], "--device", "-d", help="Device name; repeat for several (see --list-devices)."),
    devices_file: Optional[Path] = typer.Option(None, "--devices-file", help="Your devices, .json or .toml."),
    world_size: int = typer.Option(1, "--world-size", help="Data-parallel ranks."),
    zero: int = typer.Option(0, "--zero", help="ZeRO stage: 0, 1, 2 or 3 (3 = FSDP)."),
    seq: int = typer.Option(2048, "--seq", help="Sequence length."),
    micro_batch: int = typer.Option(1, "--micro-batch", help="Sequences per rank per micro-step."),
    grad_accum: int = typer.Option(1, "--grad-accum", help="Micro-steps per optimizer step."),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16, fp16 or fp32 (weights and activations)."),
    no_master_weights: bool = typer.Option(False, "--no-master-weights", help="Pure 16-bit training: no fp32 master copy."),
    optimizer: Optional[str] = typer.Option(None, "--optimizer", help="sgd, sgd-momentum, adam, adamw, adafactor, adam8bit, none (default: a file model's own optimizer, else adamw)."),
    mfu: float = typer.Option(0.4, "--mfu", help="Model FLOP utilization for step time (0.4 = 40% of peak)."),
    explicit_attention: bool = typer.Option(False, "--explicit-attention", help="HF eager attention (scores materialized) instead of SDPA."),
    cpu_kernels: bool = typer.Option(False, "--cpu-kernels", help="Trace the CPU's kernels (no FlashAttention, dropout masks in the activation dtype)."),
    context_mib: int = typer.Option(512, "--context-mib", help="Allowance: CUDA context, kernels, NCCL (MiB)."),
    workspace_mib: int = typer.Option(32, "--workspace-mib", help="Allowance: library workspaces (MiB)."),
    fragmentation: float = typer.Option(0.05, "--fragmentation", help="Allowance: allocator fragmentation, share of the peak."),
    as_json: bool = typer.Option(False, "--json", help="Print the estimate as JSON."),
    list_devices: bool = typer.Option(False, "--list-devices", help="List known devices with their sources and exit."),
) -> None:
    """Estimate memory and step time per device for none / full / selective / optimal recomputation."""
    from remat.estimate import estimate
    from remat.memory.allowance import Allowance

    if list_devices:
        console.print(devices_table(devices_file))
        return
    sizes = dict(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, intermediate=intermediate, vocab=vocab)
    try:
        source = make_source(model, hf, config, sizes, seq, "eager" if explicit_attention else "sdpa")
        allowance = Allowance(context_bytes=context_mib * MIB, workspace_bytes=workspace_mib * MIB,
                              fragmentation_fraction=fragmentation)
        with console.status("tracing one training step on the meta device..."):
            result = estimate(
                source, devices=device, devices_file=str(devices_file) if devices_file else None,
                micro_batch=micro_batch, seq_len=seq, dtype=dtype, master_weights=not no_master_weights,
                optimizer=optimizer, world_size=world_size, zero_stage=zero, grad_accumulation_steps=grad_accum,
                mfu=mfu, allowance=allowance, gpu_kernels=not cpu_kernels,
            )
    except (ValueError, TypeError, FileNotFoundError) as error:
        raise fail(str(error)) from None
    if as_json:
        from remat._serialize import to_dict

        console.print_json(json.dumps(to_dict(result)))
        return
    render(result)


_BUILTIN_SIZE_OPTIONS = {"hidden": "d_model", "layers": "layers", "heads": "heads", "vocab": "vocab"}


def make_source(model: Optional[str], hf: Optional[str], config: Optional[Path], sizes: dict, seq: int, attention: str):
    """The ModelSource the options name."""
    from remat.estimate import ModelSource

    given = {k: v for k, v in sizes.items() if v is not None}
    if hf is not None:
        return ModelSource(hf_family=hf, sizes={**given, "seq": seq}, attention=attention)
    if config is not None:
        if given:
            raise ValueError(f"size options {sorted(given)} do not apply to --config; edit the config file instead.")
        return ModelSource(hf_config_path=str(config), attention=attention)
    if model is None:
        raise ValueError("name a model: --model gpt, --model path/to/file.py:build, --hf llama --hidden ... or --config config.json.")
    from remat.models.loading import is_file_target, sizes_from_options

    if is_file_target(model):
        sizes_from_options(model, **given)  # raises: sizes do not apply to a file model
        return ModelSource(file=model)
    unknown = sorted(set(given) - set(_BUILTIN_SIZE_OPTIONS))
    if unknown:
        raise ValueError(f"options {unknown} apply to --hf models only; built-in models take --hidden, --layers, --heads, --vocab.")
    options = {_BUILTIN_SIZE_OPTIONS[k]: v for k, v in given.items()}
    return ModelSource(builtin=model, sizes=sizes_from_options(model, **options))


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f}"


def render(result) -> None:
    """Print the estimate: setup, model state, one table per device, diagnoses."""
    console.print(
        f"[bold]{result.model}[/]: {result.param_count / 1e9:.3f} B parameters, {result.num_layers} layers; "
        f"micro-batch {result.micro_batch} x seq {result.seq_len}, {result.dtype} ({result.precision} precision), "
        f"{result.optimizer}, {result.world_size} rank(s), ZeRO-{result.zero_stage}, "
        f"{result.grad_accumulation_steps} micro-step(s), MFU {result.mfu:.0%}"
    )
    console.print(
        f"per layer: saved {_gib(result.layer_saved_bytes)} GiB, input {result.layer_input_bytes / MIB:.1f} MiB; "
        f"outside layers: saved {_gib(result.fixed_saved_bytes)} GiB; "
        f"{result.train_flops / 1e12:.1f} TFLOP per micro-batch (forward + backward)"
    )
    a = result.allowance
    console.print(
        f"allowance: context {a.context_bytes / MIB:.0f} MiB + workspaces {a.workspace_bytes / MIB:.0f} MiB "
        f"+ fragmentation {a.fragmentation_fraction:.0%} of the peak"
    )
    for dev in result.devices:
        console.print(state_line(dev))
        console.print(device_table(dev))
        for row in dev.strategies:
            if row.diagnosis:
                console.print(f"[yellow]{row.strategy}[/]: {row.diagnosis}")
                if row.diagnosis.startswith(f"On {dev.device.name}, model state"):
                    break  # the same words for every strategy


def state_line(dev) -> str:
    s = dev.model_state
    parts = [f"params {_gib(s.param_bytes)}", f"grads {_gib(s.grad_bytes)}"]
    if s.master_bytes:
        parts.append(f"fp32 master {_gib(s.master_bytes)}")
    parts.append(f"optimizer {_gib(s.optimizer_state_bytes)}")
    if s.gathered_bytes:
        parts.append(f"all-gathered unit {_gib(s.gathered_bytes)}")
    return (f"\n[bold]{dev.device.name}[/] ({_gib(dev.device.memory_bytes)} GiB, {_gib(dev.budget_bytes)} GiB for tensors): "
            f"model state per rank {_gib(s.total_bytes)} GiB = " + " + ".join(parts) + " GiB")


def device_table(dev) -> Table:
    table = Table(show_edge=False, caption="GiB per rank; peak = model state + activations + temporaries; "
                  "max mb: largest micro-batch that fits")
    for name in ("strategy", "layout", "fits", "peak", "+allow", "total", "activ", "recompute TFLOP",
                 "step s", "max mb"):
        table.add_column(name, justify="left" if name in ("strategy", "layout") else "right")
    for row in dev.strategies:
        table.add_row(
            row.strategy, _layout(row), "[green]yes[/]" if row.fits else "[red]no[/]", _gib(row.peak_bytes),
            _gib(row.allowance_bytes), _gib(row.total_bytes), _gib(row.activation_bytes),
            f"{row.recompute_flops / 1e12:.1f}", f"{row.step_s:.2f}",
            _max_mb(row),
        )
    return table


def _max_mb(row) -> str:
    """The largest micro-batch; for optimal a lower bound when it is above 0 (see remat.estimate.pricing)."""
    if row.max_micro_batch is None:
        return "-"
    return f">={row.max_micro_batch}" if row.strategy == "optimal" and row.max_micro_batch else str(row.max_micro_batch)


def _layout(row) -> str:
    """The plan behind a strategy in a few words."""
    return row.plan_strategy.removeprefix("selective:").replace(row.strategy, "").strip() or "-"


def devices_table(devices_file: Optional[Path]) -> Table:
    from remat.estimate.devices import builtin_devices, load_devices_file

    specs = builtin_devices()
    if devices_file is not None:
        specs.update(load_devices_file(devices_file))
    table = Table(show_edge=False)
    for name in ("device", "memory GiB", "bf16 TFLOP/s", "memory TB/s", "host link GB/s", "source"):
        table.add_column(name)
    for spec in specs.values():
        table.add_row(
            spec.name, _gib(spec.memory_bytes), f"{spec.peak_bf16_flops_per_s / 1e12:.1f}",
            f"{spec.memory_bytes_per_s / 1e12:.2f}" if spec.memory_bytes_per_s else "-",
            f"{spec.host_link_bytes_per_s / 1e9:.0f}" if spec.host_link_bytes_per_s else "-",
            spec.sources.get("memory_bytes", "user file").split(",")[0],
        )
    return table
