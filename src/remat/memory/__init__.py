"""The memory of a whole training step: model state, optimizer state table, sharding, diagnosis."""

from remat.memory.allowance import Allowance
from remat.memory.diagnose import explain_model_state_overflow, format_gib, min_world_size, remedies
from remat.memory.model_state import (
    ModelState,
    Precision,
    model_state,
    precision,
    shard_model_state,
)
from remat.memory.optimizer_state import optimizer_layout, optimizer_state_bytes, optimizer_state_bytes_of

__all__ = [
    "Allowance",
    "ModelState",
    "Precision",
    "explain_model_state_overflow",
    "format_gib",
    "min_world_size",
    "model_state",
    "optimizer_layout",
    "optimizer_state_bytes",
    "optimizer_state_bytes_of",
    "precision",
    "remedies",
    "shard_model_state",
]
