"""Hand-made Profiles small enough to compute every prediction by hand."""

from __future__ import annotations

import dataclasses
import random

from remat.measure.types import BlockProfile, Environment, Fingerprint, OpRecord, Profile

FINGERPRINT = Fingerprint(
    model_hash="toy", batch_shapes=("2x3:float32",), device="cpu", dtype="float32", torch_version="2.13.0"
)
ENVIRONMENT = Environment(device_name="toy", num_threads=1, python_version="3", hostname="toy")


def op(key: str, output_bytes: int, saved_bytes: int, time_ms: float, flops: int = 0, *,
       is_random: bool = False, is_view: bool = False) -> OpRecord:
    return OpRecord(key=key, name=key.split("#")[0], output_bytes=output_bytes, saved_bytes=saved_bytes,
                    time_ms=time_ms, flops=flops, is_random=is_random, is_view=is_view)


def block(index: int, *, input_bytes: int, saved_bytes: int, bwd_temp_bytes: int = 0, fwd_ms: float = 1.0,
          bwd_ms: float = 2.0, fwd_flops: int = 100, ops: tuple[OpRecord, ...] = (), output_bytes: int | None = None) -> BlockProfile:
    return BlockProfile(index=index, name=f"blocks.{index}", class_name="Toy", input_bytes=input_bytes,
                        output_bytes=input_bytes if output_bytes is None else output_bytes, saved_bytes=saved_bytes,
                        bwd_temp_bytes=bwd_temp_bytes, fwd_ms=fwd_ms, bwd_ms=bwd_ms, fwd_flops=fwd_flops, ops=ops)


def profile(blocks: list[BlockProfile], **fields) -> Profile:
    base = dict(
        fingerprint=FINGERPRINT, environment=ENVIRONMENT, blocks=tuple(blocks),
        param_bytes=0, grad_bytes=0, optimizer_state_bytes=0, optimizer_name="none",
        optimizer_step_temp_bytes=0, optimizer_step_ms=0.0, buffer_bytes=0,
        fixed_pre_saved_bytes=0, fixed_post_saved_bytes=0, fixed_post_bwd_temp_bytes=0,
        fixed_fwd_ms=0.0, fixed_bwd_ms=0.0, fixed_flops=0, step_ms=0.0, peak_bytes=0,
        peak_bytes_by_category={}, device_max_allocated_bytes=None,
    )
    base.update(fields)
    return Profile(**base)


def chain(num_blocks: int, *, input_bytes: int, saved_bytes: int, output_bytes: int | None = None, **fields) -> Profile:
    """A homogeneous chain: every block alike."""
    blocks = [block(i, input_bytes=input_bytes, saved_bytes=saved_bytes, output_bytes=output_bytes)
              for i in range(num_blocks)]
    return profile(blocks, **fields)


def random_profile(rng: random.Random, num_blocks: int) -> Profile:
    """Heterogeneous blocks with small integer sizes (so the DP's slots are exact)."""
    blocks = []
    for i in range(num_blocks):
        inp = rng.randint(1, 4)
        saved = inp + rng.randint(0, 8)
        blocks.append(block(i, input_bytes=inp, saved_bytes=saved, bwd_temp_bytes=rng.randint(0, 3),
                            fwd_ms=float(rng.randint(1, 9)), bwd_ms=2.0))
    blocks = [replace(b, grad_bytes=rng.randint(0, 2), fwd_temp_bytes=rng.randint(-1, 5)) for b in blocks]
    return profile(blocks, param_bytes=10, grad_bytes=10, fixed_pre_saved_bytes=rng.randint(0, 3),
                   fixed_post_saved_bytes=rng.randint(0, 5), fixed_post_bwd_temp_bytes=rng.randint(0, 2))


def replace(obj, **changes):
    return dataclasses.replace(obj, **changes)
