"""Which op calls selective checkpointing can keep: the one rule measure, plan and apply share.

`torch.utils.checkpoint`'s selective mode stores an op's outputs in the forward and hands the
same tensors back in the replay; a cached tensor whose version counter moved in between raises
``Tensor cached during selective activation checkpoint has been mutated``. So a call can be
cached only when nothing writes into its outputs afterwards:

- allocation-only calls never (their output is filled in place next: a dropout mask is
  ``empty_like`` + ``bernoulli_`` + ``div_``);
- in-place calls never (their output is their input, written by them);
- a call whose output storage a later call of the forward writes in place
  (`remat.measure.types.OpRecord.mutated_later`: T5's ``relative_buckets += ...``, Mixtral's
  router ``top_k_weights /= ...``) never;
- a call that draws random numbers never (`RANDOM_OPS`; dropout's ``native_dropout`` aside): the
  replay restores the generator as the forward found it and runs the same draws in the same
  order; a cached draw is skipped, so every draw after it in the replay takes other numbers than
  its forward did (SegFormer's drop-path ``rand`` cached, its dropout masks and later drop-path
  draws differed: gradients off by 1e-4).

Torch-free on purpose: the planner prices selective blocks by this rule without importing torch.
"""

from __future__ import annotations

import functools

__all__ = ["ALLOCATION_OPS", "MATMUL_OPS", "RANDOM_OPS", "cacheable", "is_in_place", "op_packet"]

ALLOCATION_OPS = frozenset({"aten.empty_like", "aten.empty", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided"})
"""Ops that only allocate: their outputs are filled in place afterwards, so a cached output would
be mutated. They cost nothing to replay, so they are always replayed."""

RANDOM_OPS = frozenset(
    {
        "aten.rand", "aten.rand_like", "aten.randn", "aten.randn_like", "aten.randint", "aten.randint_like",
        "aten.randperm", "aten.bernoulli", "aten.normal", "aten.multinomial", "aten.poisson", "aten.binomial",
        "aten._standard_gamma", "aten._sample_dirichlet", "aten.rrelu_with_noise", "aten.uniform", "aten.exponential",
        "aten.geometric", "aten.cauchy", "aten.log_normal", "aten.random",
    }
)
"""Ops that draw from a random generator, out of place (the in-place ones, ``bernoulli_`` and
the like, are never cached anyway): never cached (module docstring). Not dropout's
``native_dropout`` (one call for output and mask where it runs eagerly, on CUDA): Megatron's
recipe keeps the masks of the dropouts after the attention core. Where one is cached, the replay
still runs it, to advance the generator, and drops its output (`remat.checkpointing.selective`),
so the block's later draws take the forward's numbers."""

MATMUL_OPS = frozenset(
    {
        "aten.mm",
        "aten.addmm",
        "aten.bmm",
        "aten.baddbmm",
        "aten._grouped_mm",
        "transformers.grouped_mm_fallback",
        "aten._scaled_mm",
        "aten._scaled_grouped_mm",
        "aten._int_mm",
        "aten.linear",
        "aten.convolution",
        "aten._convolution",
        "aten._scaled_dot_product_flash_attention",
        "aten._scaled_dot_product_efficient_attention",
        "aten._scaled_dot_product_cudnn_attention",
        "aten._scaled_dot_product_flash_attention_for_cpu",
        "aten._flash_attention_forward",
        "aten._efficient_attention_forward",
    }
)
"""Compute-intensive ops: the outputs `save-matmuls` keeps, and what a compiled profile times
apart from the cheap ops (`remat.measure.compiled`): torchtitan's list, plus the CPU fused
attention kernel, which differs from the CUDA ones, and the grouped and low-precision matmuls
(a mixture-of-experts layer's experts run as one ``_grouped_mm`` in Hugging Face's MoE models,
or as its ``grouped_mm_fallback`` op where that cannot run, under ``torch.compile``: without
them, save-matmuls replayed the experts, the layer's heaviest calls)."""


def op_packet(name: str) -> str:
    """``"aten.mm.default"`` -> ``"aten.mm"``."""
    return name.rsplit(".", 1)[0] if name.count(".") >= 2 else name


def is_in_place(name: str) -> bool:
    """Whether aten overload ``name`` writes into its first argument (``add_``, not ``__and__``)."""
    packet = op_packet(name)
    return packet.endswith("_") and not packet.rsplit(".", 1)[-1].startswith("__")


@functools.lru_cache(maxsize=8192)  # called per op per option by the optimal search
def cacheable(name: str, mutated_later: bool = False) -> bool:
    """Whether a call of aten overload ``name`` (``"aten.mm.default"``) can keep its output;
    ``mutated_later``: a later call of the same forward writes into that output's storage.

    Caching an in-place call is unsound besides: the replay of ``dropout`` fills the tensor it
    allocated (``noise.bernoulli_(); noise.div_()``), not the value an op returns, so a cached
    in-place op would leave that tensor unfilled."""
    packet = op_packet(name)
    return not mutated_later and packet not in ALLOCATION_OPS and packet not in RANDOM_OPS and not is_in_place(name)
