"""`remat estimate`: will a training step fit, on which device, with which strategy (no GPU needed)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import typer
from rich.text import Text

from remat.cli._app import TARGET_HELP, app, console
from remat.cli.estimate_view import devices_table, render, render_search

MIB = 2**20


@app.command("estimate")
def estimate_command(
    model: Optional[str] = typer.Option(None, "--model", "-m", help=TARGET_HELP),
    hf: Optional[str] = typer.Option(None, "--hf", help="Hugging Face family built from sizes: gpt2, llama, mistral, t5 (an encoder-decoder: --layers in each stack)."),
    config: Optional[Path] = typer.Option(None, "--config", help="A Hugging Face config.json (no download)."),
    hidden: Optional[int] = typer.Option(None, help="Hidden size (--hf; d_model of a built-in model)."),
    layers: Optional[int] = typer.Option(None, help="Number of layers."),
    heads: Optional[int] = typer.Option(None, help="Attention heads."),
    kv_heads: Optional[int] = typer.Option(None, "--kv-heads", help="Key/value heads (grouped-query attention)."),
    intermediate: Optional[int] = typer.Option(None, help="MLP intermediate size."),
    vocab: Optional[int] = typer.Option(None, help="Vocabulary size."),
    device: list[str] = typer.Option(["H100-80GB"], "--device", "-d", help="Device name; repeat for several (see --list-devices)."),
    devices_file: Optional[Path] = typer.Option(None, "--devices-file", help="Your devices, .json or .toml."),
    world_size: int = typer.Option(1, "--world-size", help="Data-parallel ranks (replicas of the model)."),
    zero: int = typer.Option(0, "--zero", help="ZeRO stage: 0, 1, 2 or 3 (3 = FSDP)."),
    distributed_optimizer: bool = typer.Option(False, "--distributed-optimizer", help="Megatron-LM's distributed optimizer: ZeRO-1 with fp32 gradients."),
    fp32_grads: bool = typer.Option(False, "--fp32-grads", help="Keep gradients in fp32 (Megatron-LM's main_grad)."),
    tensor_parallel: int = typer.Option(1, "--tensor-parallel", "--tp", help="Tensor-parallel size."),
    sequence_parallel: bool = typer.Option(False, "--sequence-parallel", "--sp", help="Sequence parallelism (with --tensor-parallel above 1)."),
    pipeline_parallel: int = typer.Option(1, "--pipeline-parallel", "--pp", help="Pipeline stages (1F1B)."),
    virtual_stages: int = typer.Option(1, "--virtual-stages", help="Model chunks per stage: the interleaved 1F1B schedule when above 1."),
    first_stage_layers: Optional[int] = typer.Option(None, "--first-stage-layers", help="Layers on the first pipeline stage (default: as many as the stages between; Megatron-LM's --decoder-first-pipeline-num-layers)."),
    last_stage_layers: Optional[int] = typer.Option(None, "--last-stage-layers", help="Layers on the last pipeline stage (default: as many as the stages between; Megatron-LM's --decoder-last-pipeline-num-layers)."),
    context_parallel: int = typer.Option(1, "--context-parallel", "--cp", help="Context-parallel size."),
    expert_parallel: int = typer.Option(1, "--expert-parallel", "--ep", help="Expert-parallel size (MoE models)."),
    expert_tensor_parallel: Optional[int] = typer.Option(None, "--expert-tensor-parallel", help="Tensor-parallel size of the routed experts (default: --tensor-parallel)."),
    expert_load: float = typer.Option(1.0, "--expert-load", help="Tokens the busiest expert rank gets over the mean (1.0: balanced router)."),
    seq: int = typer.Option(2048, "--seq", help="Sequence length: tokens (a speech encoder's: frames a layer, its audio made to fit; an image encoder's come from its image_size)."),
    micro_batch: int = typer.Option(1, "--micro-batch", help="Sequences per micro-batch."),
    grad_accum: int = typer.Option(1, "--grad-accum", help="Micro-batches per optimizer step (per pipeline)."),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16, fp16 or fp32 (weights and activations)."),
    no_master_weights: bool = typer.Option(False, "--no-master-weights", help="Pure 16-bit training: no fp32 master copy."),
    optimizer: Optional[str] = typer.Option(None, "--optimizer", help="sgd, sgd-momentum, adam, adamw, adafactor, adam8bit, none (default: a file model's own optimizer, else adamw)."),
    mfu: float = typer.Option(0.4, "--mfu", help="Share of peak FLOP/s the kernels reach (0.4 = 40%)."),
    network_gbps: Optional[float] = typer.Option(None, "--network-gbps", help="Between nodes, per GPU, one direction, in Gb/s (default: the device's, else 400)."),
    head: Optional[str] = typer.Option(None, "--head", help="LM head and loss: keep (default: as the model runs it), "
                                       "recompute, chunked or chunked:N (N tokens a chunk); --search tries keep and chunked."),
    explicit_attention: bool = typer.Option(False, "--explicit-attention", help="HF eager attention (scores materialized) instead of SDPA."),
    lora: Optional[int] = typer.Option(None, "--lora", help="Train LoRA adapters of rank R on every linear layer but the LM head, every other weight frozen (Hugging Face models; peft's target_modules='all-linear')."),
    lora_targets: Optional[str] = typer.Option(None, "--lora-targets", help="With --lora: only the linear layers of these names, comma-separated (q_proj,v_proj: peft's default for Llama)."),
    lora_dropout: float = typer.Option(0.0, "--lora-dropout", help="With --lora: dropout on the adapters' input (peft's lora_dropout, 0.05 or 0.1 in many recipes): its mask and the dropped input are saved."),
    quantize: Optional[str] = typer.Option(None, "--quantize", help="With --lora: the frozen base weights of the adapted layers in this format: nf4 (QLoRA: 4-bit NormalFloat with double quantization, as bitsandbytes stores it)."),
    cpu_kernels: bool = typer.Option(False, "--cpu-kernels", help="Trace the CPU's kernels (its fused attention kernel, but the math path under attention dropout; dropout masks in the activation dtype): what remat profile measures on a CPU."),
    context_mib: int = typer.Option(512, "--context-mib", help="Allowance: CUDA context, kernels, NCCL (MiB)."),
    workspace_mib: int = typer.Option(32, "--workspace-mib", help="Allowance: library workspaces (MiB)."),
    fragmentation: float = typer.Option(0.05, "--fragmentation", help="Allowance: allocator fragmentation, share of the peak."),
    search: bool = typer.Option(False, "--search", help="List the fastest layouts of --gpus GPUs of --device that fit."),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="--search: GPUs of the job."),
    global_batch: Optional[int] = typer.Option(None, "--global-batch", help="--search: sequences per optimizer step (default 1024)."),
    top: Optional[int] = typer.Option(None, "--top", help="--search: layouts listed (default 5)."),
    as_json: bool = typer.Option(False, "--json", help="Print the estimate as JSON."),
    list_devices: bool = typer.Option(False, "--list-devices", help="List known devices with their sources and exit."),
) -> None:
    """Estimate memory and step time per GPU for none / full / selective / optimal recomputation."""
    if list_devices:
        console.print(devices_table(devices_file))
        return
    sizes = dict(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, intermediate=intermediate, vocab=vocab)
    from remat.memory.allowance import Allowance

    source = make_source(model, hf, config, sizes, seq, "eager" if explicit_attention else "sdpa")
    if lora is not None or lora_targets is not None or quantize is not None or lora_dropout:
        targets = tuple(t.strip() for t in lora_targets.split(",") if t.strip()) if lora_targets is not None else None
        source = dataclasses.replace(source, lora_rank=lora, lora_targets=targets, quantize=quantize,
                                     lora_dropout=lora_dropout)
    allowance = Allowance(context_bytes=context_mib * MIB, workspace_bytes=workspace_mib * MIB,
                          fragmentation_fraction=fragmentation)
    options = dict(dtype=dtype, master_weights=not no_master_weights, optimizer=optimizer, mfu=mfu,
                   allowance=allowance, gpu_kernels=not cpu_kernels, fp32_grads=fp32_grads or distributed_optimizer,
                   network_bytes_per_s=network_gbps * 1e9 / 8 if network_gbps else None,
                   zero_stage=_zero(zero, distributed_optimizer))
    if search:
        layout = {"--tensor-parallel": tensor_parallel != 1, "--sequence-parallel": sequence_parallel,
                  "--pipeline-parallel": pipeline_parallel != 1, "--virtual-stages": virtual_stages != 1,
                  "--first-stage-layers": first_stage_layers is not None,
                  "--last-stage-layers": last_stage_layers is not None, "--context-parallel": context_parallel != 1,
                  "--expert-parallel": expert_parallel != 1, "--expert-tensor-parallel": expert_tensor_parallel is not None,
                  "--world-size": world_size != 1, "--grad-accum": grad_accum != 1, "--micro-batch": micro_batch != 1}
        given = [flag for flag, set_ in layout.items() if set_]
        if given:
            raise ValueError(f"--search chooses the layout itself (data, tensor, pipeline, context and expert parallel "
                             f"sizes, the stages' layers, the micro-batch and the micro-batches per step); {', '.join(given)} would be "
                             "ignored. Drop them to search, or drop --search to estimate that layout.")
        _search(source, device, devices_file, seq=seq, gpus=gpus, global_batch=SEARCH_GLOBAL_BATCH if global_batch is None
                else global_batch, top=SEARCH_TOP if top is None else top, as_json=as_json, head=head, **options)
        return
    searching = [flag for flag, value in (("--gpus", gpus), ("--global-batch", global_batch), ("--top", top))
                 if value is not None]
    if searching:
        raise ValueError(f"{', '.join(searching)} {'is' if len(searching) == 1 else 'are'} for --search, which lists "
                         "the fastest layouts of --gpus GPUs; this estimate prices one layout, whose sequences per "
                         "step are --world-size x --micro-batch x --grad-accum. Add --search, or drop "
                         f"{', '.join(searching)}.")
    from remat.estimate import Parallelism, estimate

    layout = Parallelism(tensor=tensor_parallel, sequence_parallel=sequence_parallel, pipeline=pipeline_parallel,
                         virtual_stages=virtual_stages, first_stage_layers=first_stage_layers,
                         last_stage_layers=last_stage_layers, context=context_parallel, expert=expert_parallel,
                         expert_tensor=expert_tensor_parallel, expert_load=expert_load, data=world_size)
    with console.status("tracing one training step on the meta device..."):
        result = estimate(source, devices=device, devices_file=str(devices_file) if devices_file else None,
                          micro_batch=micro_batch, seq_len=seq, world_size=world_size,
                          grad_accumulation_steps=grad_accum, parallelism=layout, head=head or "keep", **options)
    if as_json:
        from remat._serialize import to_dict

        console.print_json(json.dumps(to_dict(result)))
        return
    render(result)


SEARCH_GLOBAL_BATCH = 1024
"""``--search``'s sequences per optimizer step when ``--global-batch`` is not given."""
SEARCH_TOP = 5
"""``--search``'s layouts listed when ``--top`` is not given."""


def _zero(zero: int, distributed_optimizer: bool) -> int:
    if distributed_optimizer and zero not in (0, 1):
        raise ValueError(f"--distributed-optimizer is ZeRO-1 (Megatron-LM's sharded optimizer state); it contradicts "
                         f"--zero {zero}: pass one of them.")
    return 1 if distributed_optimizer else zero


def _search(source, device: list[str], devices_file: Optional[Path], *, seq: int, gpus: Optional[int],
            global_batch: int, top: int, as_json: bool, head: Optional[str], **options) -> None:
    from remat.estimate.devices import resolve_devices
    from remat.estimate.fastest import search_source

    if gpus is None:
        raise ValueError("--search needs the number of GPUs: pass --gpus N (and --global-batch G sequences per step).")
    if len(device) != 1:
        raise ValueError(f"--search prices one device kind at a time, got {len(device)} (--device {' --device '.join(device)}).")
    spec = resolve_devices(device, str(devices_file) if devices_file else None)[0]
    with console.status(Text(f"searching layouts of {gpus} x {spec.name}...")):
        found = search_source(source, spec, gpus=gpus, global_batch=global_batch, seq_len=seq, top=top, head=head,
                              **options)
    if as_json:
        from remat._serialize import to_dict

        console.print_json(json.dumps([to_dict(c) for c in found]))
        return
    render_search(found, spec, gpus=gpus, global_batch=global_batch, seq_len=seq)


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
