"""The LM head and its loss on one GPU, priced with the planner's byte model of the head.

The bytes are those of `remat.memory.head` (the formulas `remat.profile` measures to the byte
on the built-in GPT, Hugging Face Llama and GPT-2, and the masked LMs of BERT, ModernBERT and
ESM), taken at one rank's share of the head.
Per GPU of the last pipeline stage, with micro-batch ``b``, sequence ``s``, vocabulary ``V``,
hidden size ``H``, tensor-parallel size ``t`` and context-parallel size ``c``:

- tokens ``T = b s / c``: context parallelism splits every token-indexed tensor, the logits too;
- vocabulary ``ceil(V / t)``: the projection is column-parallel over the vocabulary and the
  cross-entropy vocabulary-parallel (Megatron-LM's ``ColumnParallelLinear`` head and
  ``vocab_parallel_cross_entropy``; Shoeybi et al. 2019, section 3), so a rank holds its slice
  of the logits, of their fp32 copy, of the log-probabilities and of their gradients, and its
  slice of the weight's gradient; Megatron-LM pads the vocabulary to a multiple of ``t``;
- the hidden states enter whole (the input of a column-parallel linear). Under sequence
  parallelism a rank keeps only its sequence shard for the backward and all-gathers it in the
  forward and again in the backward (Korthikanti et al. 2022, section 4.2.2; Megatron-LM's
  ``LinearWithGradAccumulationAndAsyncCommunication``): it holds ``(1 - 1/t) T H p`` less from
  the forward to the backward, and the shard ``T H p / t`` besides the gathered copy at the peaks.

The part after the layers is then the rest (a final norm: the traced part's saved bytes less
what the model's own head saves, `remat.memory.head.keep_saved_bytes`; outside the tensor-
parallel region, so split along the sequence by sequence and context parallelism) and the head
under its strategy ``h``::

    saved = rest + held(h)
    peak  = rest + max(fwd_peak(h), bwd_peak(h))        on top of what the layers hold

(the rest's own backward, the final norm's, runs with the hidden states' and the weight's
gradients that the head's backward made, which the head's backward peak holds with more).

Strategies (`remat.head.strategies`): ``keep`` (what the model does), ``recompute``, and
``chunked:<tokens>``; ``chunked`` alone takes `default_chunk_tokens`. ``recompute`` and
``chunked`` run the projection once more (`remat.plan.head.head_extra_flops`). Chunked, each
chunk's backward also adds its share into the weight's gradient (``addmm_``, `remat.head.chunked`),
reading and writing all of it: ``2 ceil(T / chunk) H V p`` bytes, which the step prices at
memory bandwidth when they take longer than the replayed FLOPs (a chunk of ``c`` rows does
``2 c`` FLOPs per gradient element it moves: memory-bound below the device's FLOP-to-byte ratio).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from remat.estimate.parallel import Parallelism
from remat.head.names import check_head_name
from remat.head.site import find_head
from remat.memory.head import HeadShape, head_bytes, keep_saved_bytes, logits_bytes, projection_flops

__all__ = ["HeadOnGpu", "TracedHead", "default_chunk_tokens", "find_traced_head", "head_candidates", "check_head"]

KEEP = "keep"


@dataclass(kw_only=True, frozen=True)
class TracedHead:
    """The head found on the traced model (`remat.head.site.find_head`), at the traced sequence."""

    projection: str
    """Qualified name of the output projection."""
    traced: HeadShape
    """The head's sizes and loss conventions for one sequence of the trace (batch_size 1)."""

    def shape(self, micro_batch: int, par: Parallelism = Parallelism()) -> HeadShape:
        """The head of one rank of ``par`` at ``micro_batch`` (module docstring)."""
        return dataclasses.replace(self.traced, batch_size=micro_batch, seq_len=self.traced.seq_len // par.context,
                                   vocab_size=math.ceil(self.traced.vocab_size / par.tensor))

    def model_saved_bytes(self, micro_batch: int) -> int:
        """What the model's own head saves on one GPU without model parallelism."""
        return keep_saved_bytes(self.shape(micro_batch))

    def on_gpu(self, strategy: str, micro_batch: int, par: Parallelism) -> HeadOnGpu:
        """The head under ``strategy`` on one rank of ``par`` (module docstring)."""
        shape = self.shape(micro_batch, par)
        name = resolve(strategy, shape)
        formula = head_bytes(shape, name)
        shard = shape.hidden_bytes / par.tensor if par.sequence_parallel else 0.0
        gathered = shape.hidden_bytes - shard if par.sequence_parallel else 0.0  # gathered again in backward
        replay = 0 if name == KEEP else projection_flops(shape.num_tokens, shape.hidden_size, shape.vocab_size)
        kind, _, chunk = name.partition(":")
        moved = 2 * math.ceil(shape.num_tokens / int(chunk)) * shape.weight_grad_bytes if kind == "chunked" else 0
        return HeadOnGpu(strategy=name, logits_bytes=logits_bytes(shape), held_bytes=formula.held_bytes - gathered,
                         fwd_peak_bytes=formula.fwd_peak_bytes + shard, bwd_peak_bytes=formula.bwd_peak_bytes + shard,
                         replay_flops=replay, moved_bytes=moved)


@dataclass(kw_only=True, frozen=True)
class HeadOnGpu:
    """One head strategy on one GPU of the last pipeline stage, per micro-batch."""

    strategy: str
    """``keep``, ``recompute`` or ``chunked:<tokens>``."""
    logits_bytes: int
    """The rank's logits in the dtype the loss runs in (what ``keep`` holds, and more, at once)."""
    held_bytes: float
    """Held from the head's forward to its backward, the hidden states included."""
    fwd_peak_bytes: float
    """Peak of the head's forward, from the hidden states on."""
    bwd_peak_bytes: float
    """Peak of the head's backward (the weight's gradient included)."""
    replay_flops: int
    """FLOPs run again in the backward: one more projection for ``recompute`` and ``chunked``."""
    moved_bytes: int = 0
    """Bytes the chunks' updates of the weight's gradient read and write (``chunked``, a trained head;
    module docstring)."""

    @property
    def peak_bytes(self) -> float:
        """The higher of the forward's and the backward's peaks."""
        return max(self.fwd_peak_bytes, self.bwd_peak_bytes)


def default_chunk_tokens(shape: HeadShape) -> int:
    """Chunks whose logits are about as large as the hidden states: the next power of two of
    ``T / ceil(V / H)`` rows, at most ``T`` (Liger-Kernel's fused linear cross-entropy picks its
    chunk so: ``next_power_of_2(cdiv(BT, cdiv(V, H)))``, ``ops/fused_linear_cross_entropy.py``)."""
    rows = math.ceil(shape.num_tokens / math.ceil(shape.vocab_size / shape.hidden_size))
    return min(1 << max(0, rows - 1).bit_length(), shape.num_tokens)


def resolve(strategy: str, shape: HeadShape) -> str:
    """``strategy`` with ``chunked`` alone given its chunk size on ``shape``."""
    return f"chunked:{default_chunk_tokens(shape)}" if strategy == "chunked" else strategy


def check_head(strategy: object) -> None:
    """Raise ValueError/TypeError unless ``strategy`` names a head strategy (``chunked`` alone allowed)."""
    if strategy == "chunked":
        return
    try:
        check_head_name(strategy)
    except ValueError as error:
        raise ValueError(f"{error} An estimate also takes 'chunked' alone: chunks sized to the hidden states.") from None


def head_candidates(head: TracedHead | None) -> tuple[str, ...]:
    """The head strategies `remat.estimate.fastest` tries: ``keep`` and ``chunked`` at its default
    chunk (``recompute`` peaks where ``keep`` does: the head runs last in the forward and first in
    the backward, `remat.plan.head`)."""
    return (KEEP,) if head is None else (KEEP, "chunked")


def find_traced_head(model: Any, seq_len: int | None) -> tuple[TracedHead | None, str]:
    """The head of a meta-device ``model`` traced at ``seq_len`` tokens per sequence, or why it has none."""
    site, note = find_head(model)
    if site is None:
        return None, note
    if seq_len is None:
        return None, "the model's batch is its own (a file model): its head stays as traced"
    why = _logits_transformed(model, site, seq_len)
    if why:
        return None, why
    projection = model.get_submodule(site.projection)
    vocab, hidden = projection.weight.shape
    traced = HeadShape(batch_size=1, seq_len=seq_len, hidden_size=int(hidden), vocab_size=int(vocab),
                       dtype_bytes=projection.weight.element_size(), upcast=site.loss.upcast, shift=site.loss.shift,
                       tied=site.tied, bias=projection.bias is not None or bool(site.logit_bias),
                       trained=projection.weight.requires_grad)
    return TracedHead(projection=site.projection, traced=traced), ""


def _logits_transformed(model: Any, site: Any, seq_len: int) -> str:
    """Why a planned head could not stand in for the model's own ("" when it can): the check
    `remat.profile` makes (`remat.measure.head`), that a call without labels returns the
    projection's own output as its logits, run on the meta device, where it needs no values.
    Granite divides its logits by ``logits_scaling`` even when that is 1.0: the estimate priced a
    chunked head the profile refuses."""
    import torch

    from remat.estimate.kernels import no_packed_sequence_check
    from remat.head.site import kind_named
    from remat.measure.head import logits_returned

    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    try:
        with no_packed_sequence_check():
            return logits_returned(model, {"input_ids": ids, site.labels_arg: ids}, site, kind_named(site.kind),
                                    model.get_submodule(site.projection))
    except Exception:  # noqa: BLE001 - a forward the meta device cannot run: the trace says so itself
        return ""
