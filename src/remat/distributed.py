"""remat beside PyTorch's own data parallelism: torchrun, DDP and FSDP2 (`fully_shard`).

remat composes with the distributed engine; it does not replace it. The order is the one
torchtitan uses: apply the recomputation plan first (`remat.apply_`), then wrap for data
parallelism (`DistributedDataParallel(model)` or `fully_shard` per block, then on the root).
Recomputation is non-reentrant only, which is what DDP needs (reentrant checkpointing under
DDP fails with "Expected to mark a variable ready only once").

Every rank runs the same model on its own micro-batch, so every rank's profile is the same
model's: rank 0 profiles and plans, the plan is broadcast as JSON (`broadcast_plan`) or made on
every rank and checked identical (`check_same_plan`). The planner sees one rank's memory through
`shard_profile`: parameters, gradients and optimizer state divided as ZeRO stage 1/2/3 divides
them, plus, under ZeRO-3/FSDP, what FSDP2 gathers while a unit runs: its weights, the root's, the
next unit's prefetched and the last unit's reduce-scatter input (`fsdp2_gathered_bytes`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from remat.checkpointing.callsites import split_site
from remat.measure.types import Profile
from remat.memory.model_state import ModelState, check_sharding, shard_model_state
from remat.plan.types import Plan

__all__ = [
    "rank",
    "world_size",
    "is_main_process",
    "broadcast_plan",
    "check_same_plan",
    "shard_profile",
    "fsdp_units",
    "fully_shard_by_plan",
    "init_from_env",
]


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank, 0 outside a process group."""
    return dist.get_rank() if _initialized() else 0


def world_size() -> int:
    """Number of ranks, 1 outside a process group."""
    return dist.get_world_size() if _initialized() else 1


def is_main_process() -> bool:
    """True on rank 0 (the one that prints and writes files) and outside a process group."""
    return rank() == 0


def _comm_device() -> torch.device:
    """Collectives on NCCL need CUDA tensors; gloo and the rest take CPU tensors."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _broadcast_bytes(payload: bytes | None, src: int) -> bytes:
    device = _comm_device()
    size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src)
    buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if payload is not None:
        buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buffer, src=src)
    return bytes(buffer.cpu().tolist())


def broadcast_plan(plan: Plan | None, src: int = 0) -> Plan:
    """The plan of rank ``src`` on every rank (sent as versioned JSON, never pickled).

    Pass the plan on rank ``src`` and None (or anything) elsewhere. Outside a process group
    the plan is returned as is.
    """
    if not _initialized():
        if plan is None:
            raise ValueError("broadcast_plan got plan=None outside a process group; pass the plan to apply.")
        return plan
    if rank() == src and plan is None:
        raise ValueError(f"broadcast_plan: rank {src} is the source and must pass a Plan, got None.")
    payload = plan.to_json().encode() if rank() == src else None
    return Plan.from_json(_broadcast_bytes(payload, src).decode())


def check_same_plan(plan: Plan) -> None:
    """Raise ValueError unless every rank holds the same plan: the same blocks, segments (their
    strategies, saved ops and children) and head, compared by a digest. Not the predictions: a
    plan made on every rank from its own profile has the same decisions and its own measured
    times, which made every such pair of plans differ."""
    if not _initialized():
        return
    data = json.loads(plan.to_json())["data"]
    decisions = json.dumps({key: data[key] for key in ("block_names", "segments", "head")}, sort_keys=True)
    digest = hashlib.sha256(decisions.encode()).digest()[:8]
    mine = torch.tensor(list(digest), dtype=torch.uint8, device=_comm_device())
    gathered = [torch.empty_like(mine) for _ in range(world_size())]
    dist.all_gather(gathered, mine)
    differ = [r for r, t in enumerate(gathered) if not torch.equal(t, gathered[0])]
    if differ:
        raise ValueError(
            f"ranks {differ} hold a different plan than rank 0; every rank must apply the same plan: "
            "plan on rank 0 and share it with remat.distributed.broadcast_plan(plan)."
        )


def shard_profile(profile: Profile, *, world_size: int, zero_stage: int,
                  gradient_as_bucket_view: bool = False) -> Profile:
    """One rank's view of ``profile`` when its model state is sharded over ``world_size`` ranks.

    ``zero_stage``: 0 = DDP (nothing sharded), 1 = optimizer state, 2 = + gradients,
    3 = + parameters (FSDP2 ``fully_shard`` per block). Activations are per rank and unchanged.
    Under stage 3 what FSDP2 gathers beside the shards while a unit's backward runs is added as
    ``gathered_bytes`` (`fsdp2_gathered_bytes`: the largest block's weights, the root unit's, which
    FSDP2 does not reshard after the forward, the next unit's prefetched weights and the unit
    before's reduce-scatter input); the planner counts them in every phase of backward.
    A recompute segment of several blocks is one unit (`fsdp_units`), its blocks gathered
    together through its backward: each block's unsharded weights (``unit_bytes``) let the
    planner price that per segment (`remat.plan.phases.unit_extra_bytes`).
    Under stages 0 and 1 over several ranks (DDP, and DDP with torch's ZeroRedundancyOptimizer
    sharding the optimizer state) its gradient buckets are model state
    (``bucket_bytes``): a flat copy of every gradient, allocated with the wrapper; with
    ``gradient_as_bucket_view=True`` (pass what the wrapper gets) the gradients are views of the
    buckets, every one there from the step's start, none allocated by a block's backward.
    Counted as the largest block alone, a GPT whose embeddings and head outweigh a layer was
    predicted 9.9 % under its measured per-rank peak. Left out at stage 1, DDP with a
    ZeroRedundancyOptimizer and bucket views measured 25 % over its prediction.
    """
    check_sharding(world_size, zero_stage)
    if zero_stage <= 1 and world_size > 1:  # DDP's buckets, beside a ZeroRedundancyOptimizer at stage 1 too
        profile = _with_buckets(profile, gradient_as_bucket_view)
    unsharded = ModelState(
        param_bytes=profile.param_bytes, grad_bytes=profile.grad_bytes, master_bytes=0,
        optimizer_state_bytes=profile.optimizer_state_bytes, buffer_bytes=profile.buffer_bytes,
    )
    sharded = shard_model_state(unsharded, world_size=world_size, zero_stage=zero_stage)
    units: dict[str, Any] = {}
    if zero_stage == 3 and world_size > 1:
        # the root unit (`fully_shard_by_plan`): every parameter outside the blocks
        root_params = max(0, profile.param_bytes - sum(b.grad_bytes for b in profile.blocks))
        largest = max((b.grad_bytes for b in profile.blocks), default=0)
        sharded = dataclasses.replace(sharded, gathered_bytes=fsdp2_gathered_bytes(largest, root_params))
        # a multi-block recompute segment is one unit: priced per plan
        units = dict(unit_bytes=tuple(b.grad_bytes for b in profile.blocks), block_gathered_bytes=2 * largest)
    if zero_stage >= 2:  # gradients sharded: each block's and the pre part's too
        profile = dataclasses.replace(
            profile,
            blocks=tuple(dataclasses.replace(b, grad_bytes=-(-b.grad_bytes // world_size)) for b in profile.blocks),
            fixed_pre_grad_bytes=-(-profile.fixed_pre_grad_bytes // world_size),
            fixed_pre_early_grad_bytes=-(-profile.fixed_pre_early_grad_bytes // world_size),
        )
    return dataclasses.replace(
        profile,
        param_bytes=sharded.param_bytes,
        grad_bytes=sharded.grad_bytes,
        optimizer_state_bytes=sharded.optimizer_state_bytes,
        gathered_bytes=sharded.gathered_bytes,
        **units,
    )


def fsdp2_gathered_bytes(unit_params: int, root_params: int) -> int:
    """What FSDP2 holds on a rank beside its shards while a unit's backward runs, for the largest
    unit of one block, whose weights take ``unit_params`` bytes unsharded, beside a root unit of
    ``root_params``:

    - the unit's weights, gathered into storages of their own (the shard stays where it is);
    - the root's, gathered from the forward's start to the backward's end;
    - the next unit's all-gather result, prefetched as this unit's backward begins and held
      until that unit's runs, and the reduce-scatter input of the unit before, held until this
      unit's is issued: one unit's weights each (FSDP2's ``backward_prefetch`` and
      ``reduce_scatter_states``, one input buffer).

    The head's backward holds the root's weights and the prefetched ones only
    (``Profile.block_gathered_bytes`` is the rest). The unit's unsharded gradients are in its
    blocks' measured backward already. Counted as the ZeRO paper counts it (the gathered unit and
    its gradients less the shard), a 4-layer Llama's per-rank peak measured 13 % over its
    prediction."""
    return 3 * unit_params + root_params


def _with_buckets(profile: Profile, as_view: bool) -> Profile:
    """``profile`` beside DDP's gradient buckets (`shard_profile`)."""
    if as_view:  # the buckets are the gradients: live from the start, none allocated in the backward
        blocks = tuple(dataclasses.replace(b, grad_bytes=0, between_grad_bytes=0) for b in profile.blocks)
        return dataclasses.replace(profile, blocks=blocks, grad_bytes=0, fixed_pre_grad_bytes=0, fixed_pre_early_grad_bytes=0,
                                   bucket_bytes=profile.grad_bytes)
    return dataclasses.replace(profile, bucket_bytes=profile.grad_bytes)


def fsdp_units(model: nn.Module, plan: Plan) -> list[list[nn.Module]]:
    """The FSDP2 units that match ``plan``: one unit per top-level segment of blocks.

    A recomputed segment of several blocks replays them together, so their weights must be
    gathered together: it becomes one unit. Kept, selective and offloaded blocks are one unit each.
    """
    sites = [name for name in plan.block_names if split_site(name)[1] is not None]
    several = {split_site(name)[0] for name in sites if split_site(name)[1] > 0}
    if sites and not several:  # each layer called once, through ``layer.forward(...)``
        raise ValueError(
            f"the plan's blocks {sites[:3]}{' ...' if len(sites) > 3 else ''} are layers the model calls through "
            "layer.forward(...) (remat.checkpointing.callsites): such a call goes past the module hooks that an FSDP2 "
            "unit gathers its weights with, so a unit of them would compute with sharded weights. Shard the modules "
            "they are called from, or modules inside them that run as modules, with fully_shard as you choose.")
    if sites:
        raise ValueError(
            f"the plan's blocks {sites[:3]}{' ...' if len(sites) > 3 else ''} are calls of a layer that runs several times "
            "per step (remat.checkpointing.callsites): fully_shard_by_plan makes an FSDP2 unit of each segment's modules, and the "
            "calls of one layer are one module, which cannot be a unit per call. Shard the model with fully_shard as you "
            "choose (fully_shard(layer), then fully_shard(model): the calls then run with the layer's weights "
            "gathered), or plan with blocks that run once each (remat.profile(..., blocks=...)).")
    blocks = [model.get_submodule(name) for name in plan.block_names]
    units: list[list[nn.Module]] = []
    for seg in plan.segments:
        if seg.kind == "recompute":
            units.append(blocks[seg.start:seg.stop])
        else:
            units.extend([b] for b in blocks[seg.start:seg.stop])
    return units


def fully_shard_by_plan(model: nn.Module, plan: Plan, **fsdp_kwargs: Any) -> nn.Module:
    """Shard ``model`` with FSDP2 after `remat.apply_`: ``fully_shard`` on each unit of
    `fsdp_units`, then on the root (torchtitan's order: recomputation wrapping, then sharding).
    ``fsdp_kwargs`` go to every ``fully_shard`` call (mesh, mp_policy, reshard_after_forward...)."""
    from torch.distributed.fsdp import fully_shard

    for unit in fsdp_units(model, plan):
        fully_shard(unit if len(unit) > 1 else unit[0], **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    return model


def init_from_env() -> bool:
    """Join the process group torchrun describes (``WORLD_SIZE`` > 1 in the environment).

    gloo when the process has no CUDA device, NCCL (on ``LOCAL_RANK``'s device) when it has.
    Returns True when running distributed. Outside torchrun, or when a group already exists,
    it changes nothing.
    """
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not dist.is_available():
        return False
    if not dist.is_initialized():
        backend = "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            backend = "nccl"
        dist.init_process_group(backend)
    return True
