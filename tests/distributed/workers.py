"""Rank functions for tests/distributed (module-level so torch.multiprocessing can spawn them).

Each writes ``rank<N>.json`` into the output directory with what the test asserts on.
"""

from __future__ import annotations

import copy
import faulthandler
import hashlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

GPT_SIZES = dict(num_layers=4, d_model=64, num_heads=4, seq_len=32, batch_size=2, vocab_size=128, dropout=0.1)


def _init(rank: int, world_size: int, port: int) -> None:
    faulthandler.enable()  # a rank that aborts inside gloo prints where it was
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def _write(out_dir: str, rank: int, result: dict) -> None:
    # written whole or not at all: a rank aborted mid-write leaves no half file to read
    tmp = Path(out_dir, f"rank{rank}.json.tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(Path(out_dir, f"rank{rank}.json"))
    # every rank past its last collective before any tears gloo down: a rank that destroys the
    # group while the other is still inside a broadcast aborts ("terminate called without an
    # active exception"), about one run in three of the broadcast test
    dist.barrier()
    dist.destroy_process_group()


def _built(rank: int):
    from remat.models import build

    # same weights on every rank (seed 0), a different micro-batch per rank
    weights = build("gpt", seed=0, **GPT_SIZES)
    batch = build("gpt", seed=100 + rank, **GPT_SIZES).batch
    return weights, batch


def _shared_plan(weights, batch, strategy: str, world_size: int, zero_stage: int):
    import remat
    from remat.distributed import broadcast_plan, is_main_process, shard_profile

    plan = None
    if is_main_process():
        profile = remat.profile(weights.model, batch, weights.loss_fn, weights.optimizer, warmup=0, repeats=1)
        profile = shard_profile(profile, world_size=world_size, zero_stage=zero_stage)
        budget = None
        if strategy == "optimal":  # halfway between full recomputation and none
            peaks = [remat.plan(profile, strategy=s).prediction.peak_bytes for s in ("full", "none")]
            budget = sum(peaks) // 2
        plan = remat.plan(profile, budget=budget, strategy=strategy)
    return broadcast_plan(plan)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _step(model, batch, loss_fn, seed: int) -> tuple[float, dict[str, torch.Tensor]]:
    from remat._batch import call_model, compute_loss

    torch.manual_seed(seed)
    loss = compute_loss(call_model(model, batch), batch, loss_fn)
    loss.backward()
    grads = {n: _local(p.grad).clone() for n, p in model.named_parameters()}
    return loss.item(), grads


def _compare(rank: int, base: tuple, planned: tuple) -> dict:
    (loss_b, grads_b), (loss_p, grads_p) = base, planned
    digest = hashlib.sha256(b"".join(g.numpy().tobytes() for g in grads_p.values())).hexdigest()
    return {
        "rank": rank, "loss": loss_b, "loss_equal": loss_b == loss_p, "num_params": len(grads_b),
        "mismatched": [n for n in grads_b if not torch.equal(grads_b[n], grads_p[n])],
        "grad_digest": digest,
    }


def _fully_shard(model, plan) -> None:
    from remat.distributed import fully_shard_by_plan

    fully_shard_by_plan(model, plan)


def fsdp_grads(rank: int, world_size: int, port: int, out_dir: str, strategy: str) -> None:
    import remat

    _init(rank, world_size, port)
    weights, batch = _built(rank)
    plan = _shared_plan(weights, batch, strategy, world_size, zero_stage=3)
    runs = []
    for applied in (False, True):
        model = copy.deepcopy(weights.model)
        if applied:
            remat.apply_(model, plan)  # recomputation wrapping first, then sharding
        _fully_shard(model, plan)
        runs.append(_step(model, batch, weights.loss_fn, seed=1234 + rank))
    _write(out_dir, rank, _compare(rank, *runs))


def _t5(rank: int):
    """A tiny Hugging Face T5 (an encoder and a decoder stack, dropout 0.1) from its config, the
    same weights on every rank, a micro-batch per rank."""
    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "t5", vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=3, num_heads=4, dropout_rate=0.1,
        use_cache=False, decoder_start_token_id=0, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(config).train()
    g = torch.Generator().manual_seed(100 + rank)
    batch = dict(input_ids=torch.randint(3, 128, (2, 32), generator=g), labels=torch.randint(3, 128, (2, 16), generator=g))
    return model, batch


def fsdp_grads_encoder_decoder(rank: int, world_size: int, port: int, out_dir: str, strategy: str) -> None:
    import remat
    from remat.distributed import broadcast_plan, is_main_process, shard_profile

    _init(rank, world_size, port)
    model, batch = _t5(rank)
    plan = None
    if is_main_process():
        profile = remat.profile(model, batch, None, torch.optim.AdamW(model.parameters()), warmup=0, repeats=1)
        plan = remat.plan(shard_profile(profile, world_size=world_size, zero_stage=3), strategy=strategy)
    plan = broadcast_plan(plan)
    runs = []
    for applied in (False, True):
        copied = copy.deepcopy(model)
        if applied:
            remat.apply_(copied, plan)
        _fully_shard(copied, plan)
        runs.append(_step(copied, batch, None, seed=1234 + rank))
    result = _compare(rank, *runs)
    result["blocks"] = list(plan.block_names)
    (_, base), (_, planned) = runs
    result["max_rel_diff"] = max(float((planned[n] - base[n]).abs().max() / base[n].abs().max().clamp_min(1e-30))
                                 for n in base)
    _write(out_dir, rank, result)


def ddp_grads(rank: int, world_size: int, port: int, out_dir: str, strategy: str) -> None:
    import remat
    from torch.nn.parallel import DistributedDataParallel

    _init(rank, world_size, port)
    weights, batch = _built(rank)
    plan = _shared_plan(weights, batch, strategy, world_size, zero_stage=0)
    runs = []
    for applied in (False, True):
        model = copy.deepcopy(weights.model)
        if applied:
            remat.apply_(model, plan)
        runs.append(_step(DistributedDataParallel(model), batch, weights.loss_fn, seed=1234 + rank))
    _write(out_dir, rank, _compare(rank, *runs))


class _Universal(torch.nn.Module):
    """One residual layer run at four depths between an embedding and a head (a Universal
    Transformer's shape): each call a block of its own (``layer@i``)."""

    def __init__(self) -> None:
        super().__init__()
        from torch import nn

        self.embed = nn.Linear(8, 32)
        self.layer = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 128), nn.GELU(), nn.Dropout(0.1),
                                   nn.Linear(128, 32))
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for _ in range(4):
            h = h + self.layer(h)
        return self.head(h)


def fsdp_grads_shared_layer(rank: int, world_size: int, port: int, out_dir: str, strategy: str) -> None:
    """FSDP2 by hand on a model whose layer runs at every depth: the layer a unit of its own and
    the root another (`fully_shard_by_plan` refuses calls of one layer: a unit per call cannot
    be); each call's plan replays with the layer's weights gathered by FSDP2's pre-backward."""
    import remat
    from remat.distributed import broadcast_plan, is_main_process
    from torch.distributed.fsdp import fully_shard

    _init(rank, world_size, port)
    torch.manual_seed(0)
    weights = _Universal()
    batch = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(100 + rank))
    loss_fn = lambda out, b: out.square().mean()  # noqa: E731
    plan = None
    if is_main_process():
        plan = remat.plan(remat.profile(weights, batch, loss_fn, warmup=0, repeats=1), strategy=strategy)
    plan = broadcast_plan(plan)
    runs = []
    for applied in (False, True):
        model = copy.deepcopy(weights)
        if applied:
            remat.apply_(model, plan)
        fully_shard(model.layer)
        fully_shard(model)
        runs.append(_step(model, batch, loss_fn, seed=1234 + rank))
    result = _compare(rank, *runs)
    result["blocks"] = list(plan.block_names)
    _write(out_dir, rank, result)


def broadcast_check(rank: int, world_size: int, port: int, out_dir: str) -> None:
    import dataclasses

    from remat.distributed import broadcast_plan, check_same_plan

    _init(rank, world_size, port)
    weights, batch = _built(rank)
    plan = _shared_plan(weights, batch, "full", world_size, zero_stage=3)
    check_same_plan(plan)
    # made on each rank from its own profile: the same decisions, its own predicted times
    own = dataclasses.replace(plan, budget_bytes=rank,
                              prediction=dataclasses.replace(plan.prediction, step_ms=plan.prediction.step_ms + rank))
    check_same_plan(own)
    kept = tuple(dataclasses.replace(s, strategy="keep", children=()) for s in plan.segments)
    other = dataclasses.replace(plan, segments=kept) if rank == 1 else plan  # rank 1 now decides otherwise
    try:
        check_same_plan(other)
        error = ""
    except ValueError as exc:
        error = str(exc)
    _write(out_dir, rank, {"same_plan": broadcast_plan(plan if rank == 0 else None) == plan, "mismatch_error": error})


def fsdp_peak(rank: int, world_size: int, port: int, out_dir: str, strategy: str) -> None:
    import remat
    from remat.distributed import shard_profile

    _init(rank, world_size, port)
    weights, batch = _built(rank)
    profile = remat.profile(weights.model, batch, weights.loss_fn, weights.optimizer, warmup=0, repeats=1)
    sharded = shard_profile(profile, world_size=world_size, zero_stage=3)
    plan = remat.plan(sharded, strategy=strategy)
    tracked = fsdp2_step_peak(weights, batch, plan)
    _write(out_dir, rank, {
        "rank": rank, "measured_peak_bytes": tracked.peak_bytes,
        "predicted_peak_bytes": plan.prediction.peak_bytes,
        "by_category": tracked.peak_bytes_by_category,
        "sharded_state_bytes": sharded.model_state_bytes, "unsharded_state_bytes": profile.model_state_bytes,
        "largest_unit_bytes": max(sharded.unit_bytes),
    })


def fsdp2_step_peak(weights, batch, plan):
    """The tracked step of a copy of ``weights.model`` with ``plan`` applied and sharded by it
    (`fully_shard_by_plan`), AdamW, after one step that creates the optimizer state, as in the
    profile."""
    import remat
    from remat._batch import call_model, compute_loss
    from remat.measure.tracker import track_step

    model = copy.deepcopy(weights.model)
    remat.apply_(model, plan)
    _fully_shard(model, plan)
    optimizer = torch.optim.AdamW(model.parameters())

    def step() -> None:
        compute_loss(call_model(model, batch), batch, weights.loss_fn).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    return track_step(step, model=model, optimizer=optimizer, batch=batch)


def ddp_view_peak(rank: int, world_size: int, port: int, out_dir: str, strategy: str) -> None:
    """A DDP step with ``gradient_as_bucket_view=True``: the gradients are views of the buckets,
    which the live-storage tracker sees (DDP's own bucket copies, in its C++ reducer, it does not)."""
    import remat
    from remat._batch import call_model, compute_loss
    from remat.distributed import shard_profile
    from remat.measure.tracker import track_step
    from torch.nn.parallel import DistributedDataParallel

    _init(rank, world_size, port)
    weights, batch = _built(rank)
    profile = remat.profile(weights.model, batch, weights.loss_fn, weights.optimizer, warmup=0, repeats=1)
    sharded = shard_profile(profile, world_size=world_size, zero_stage=0, gradient_as_bucket_view=True)
    plan = remat.plan(sharded, strategy=strategy)
    unaware = remat.plan(profile, strategy=strategy)
    model = copy.deepcopy(weights.model)
    remat.apply_(model, plan)
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(ddp.parameters())

    def step() -> None:
        compute_loss(call_model(ddp, batch), batch, weights.loss_fn).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # the buckets stay: DDP's gradients are their views

    step()
    step()  # the buckets hold the gradients from here on
    tracked = track_step(step, model=ddp, optimizer=optimizer, batch=batch)
    _write(out_dir, rank, {"rank": rank, "measured_peak_bytes": tracked.peak_bytes,
                           "predicted_peak_bytes": plan.prediction.peak_bytes,
                           "unaware_peak_bytes": unaware.prediction.peak_bytes})


def tp_profile(rank: int, world_size: int, port: int, out_dir: str, strategy: str) -> None:
    """Tensor parallelism (DTensor): the built-in GPT's MLPs split column- then row-wise over the
    ranks, profiled and verified on each rank as it runs."""
    import remat
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    _init(rank, world_size, port)
    weights, batch = _built(0)  # one batch: tensor parallelism splits the layers, not the data
    model = copy.deepcopy(weights.model)
    split = {}
    for i in range(len(model.blocks)):
        split[f"blocks.{i}.mlp.fc"], split[f"blocks.{i}.mlp.proj"] = ColwiseParallel(), RowwiseParallel()
    parallelize_module(model, init_device_mesh("cpu", (world_size,)), split)
    optimizer = torch.optim.AdamW(model.parameters())
    profile = remat.profile(model, batch, weights.loss_fn, optimizer, warmup=1, repeats=1)
    plan = remat.plan(profile, strategy=strategy)
    v = remat.verify(model, batch, plan, weights.loss_fn, optimizer, repeats=1)
    _write(out_dir, rank, {
        "rank": rank, "ok": v.ok, "identical": v.grads_identical, "predicted": v.predicted_peak_bytes,
        "measured": v.measured_peak_bytes, "param_bytes": profile.param_bytes,
        "whole_param_bytes": sum(p.numel() * p.element_size() for p in weights.model.parameters()),
    })


def fsdp1_checks(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """FSDP1 (FullyShardedDataParallel, each block its own unit): a wrapped model is refused by
    `profile`; a plan of one-block segments trains as without remat; a segment of several blocks
    is refused at its first forward (it crashed inside the blocks on their flattened shards)."""
    import remat
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from remat.models.gpt import Block

    _init(rank, world_size, port)
    weights, batch = _built(rank)
    plans = {s: _shared_plan(weights, batch, s, world_size, zero_stage=3) for s in ("full", "sqrt")}

    def wrapped(model):  # flat parameters: every rank's shard has a gradient
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=False,
                                        device_id=torch.device("cpu"))

    result: dict = {"rank": rank}
    try:
        remat.profile(wrapped(copy.deepcopy(weights.model)), batch, weights.loss_fn, repeats=1)
    except ValueError as e:
        result["profile_error"] = str(e)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    zero = ZeroRedundancyOptimizer(weights.model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    try:  # its state is sharded and its step collective: refused before anything runs
        remat.profile(weights.model, batch, weights.loss_fn, zero, repeats=1)
    except ValueError as e:
        result["zero_error"] = str(e)
    runs = []
    for plan in (None, plans["full"]):
        model = copy.deepcopy(weights.model)
        if plan is not None:
            remat.apply_(model, plan)
        runs.append(_step(wrapped(model), batch, weights.loss_fn, seed=1234 + rank))
    result.update(_compare(rank, *runs))
    model = copy.deepcopy(weights.model)
    remat.apply_(model, plans["sqrt"])
    result["sqrt_segments"] = [[s.start, s.stop] for s in plans["sqrt"].segments]
    try:
        _step(wrapped(model), batch, weights.loss_fn, seed=1234 + rank)
    except RuntimeError as e:
        result["segment_error"] = str(e)
    _write(out_dir, rank, result)
