"""The Profile: what `remat.profile` measured on the real model (versioned JSON, no pickle).

Conventions (every later stage relies on them):
- Bytes are bytes of *storages*, each storage counted once; parameters and buffers are
  never activations.
- Blocks are indexed 0..N-1 in the order the forward runs them, over every stack (an encoder's
  blocks, then a decoder's). The fixed part is split into ``pre`` (runs before the first block:
  embeddings...), ``between`` (code run between two blocks: pooling, patch merging, an encoder's
  final norm and a decoder's embeddings; recorded on the block after it) and ``post`` (after
  the last block: final norm, head, loss).
- Times are medians in milliseconds over repeats after warm-up.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from remat._serialize import JsonDocument, Rules

PROFILE_FORMAT = "profile"
PROFILE_VERSION = 1
def block_names_hash(names: Sequence[str]) -> str:
    """SHA-256 (16 hex digits) of the blocks' qualified names, in order (`Fingerprint.block_names_hash`)."""
    return hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]


def _check_profile(profile: Profile) -> None:
    """What a measured profile always holds across fields (checked when one is read)."""
    names = [b.name for b in profile.blocks]
    for i, block in enumerate(profile.blocks):
        if block.index != i:
            raise ValueError(f"blocks[{i}] has index {block.index}; blocks are numbered 0.. in order.")
        if not block.name or names.index(block.name) != i:
            raise ValueError(f"blocks[{i}] is named {block.name!r}, empty or the name of an earlier block.")
        keys = [op.key for op in block.ops]
        if len(set(keys)) != len(keys):
            raise ValueError(f"blocks[{i}] ({block.name}) names an op key twice; op keys are unique in a block.")
        for curve in ("fwd_live_bytes", "checkpointed_fwd_live_bytes"):
            if len(getattr(block, curve)) not in (0, len(block.ops)):
                raise ValueError(f"blocks[{i}].{curve} has {len(getattr(block, curve))} values for "
                                 f"{len(block.ops)} ops; one per op (or none).")
    recorded = profile.fingerprint.block_names_hash
    if recorded and recorded != block_names_hash(names):
        raise ValueError(f"the blocks' names {names} do not match the fingerprint's block_names_hash {recorded!r}.")
    pos = 0
    for stack in profile.stacks:
        if stack.start != pos or stack.stop <= stack.start:
            raise ValueError(f"stack {stack.name!r} spans [{stack.start}, {stack.stop}); stacks cover the "
                             f"blocks in order without gap or overlap, so it must start at {pos} and be non-empty.")
        pos = stack.stop
    if profile.stacks and pos != len(profile.blocks):
        raise ValueError(f"the stacks cover {pos} blocks, the profile has {len(profile.blocks)}.")


PROFILE_RULES = Rules(
    signed=frozenset({"fwd_temp_bytes", "fwd_other_bytes", "bwd_free_order"}),
    floors=(("num_threads", 1), ("producer_storage", -1), ("storage_saved_from", -1), ("size_group", -2)),
    check=lambda profile: _check_profile(profile),
)
"""Beyond the type hints: the measured differences that may be negative (their docstrings say
when), ``bwd_free_order``'s storage id -1 and ``producer_storage``'s -1 (not known); every other
size, time and count is >= 0; ``storage_saved_from``'s -1 (none); ``size_group``'s -1 and -2."""


@dataclass(kw_only=True, frozen=True)
class OpRecord:
    """One aten op call inside a block's forward, in call order."""

    key: str
    """``"<op name>#<occurrence>"``, e.g. ``"aten.mm.default#2"``: the 3rd mm call in this block's
    forward. Plans name saved ops by this key; the selective-checkpoint policy counts the same way."""
    name: str
    """The aten overload, e.g. ``"aten.addmm.default"``."""
    output_bytes: int
    """Bytes of the new storages this op allocated for its outputs (0 for views and in-place ops)."""
    saved_bytes: int
    """Bytes of those storages that autograd saves for backward (first saver only)."""
    time_ms: float
    """Median wall time of this call, scaled so that a block's calls add up to its forward time
    in the timed steps (timing each call alone adds a cost per call; measured on the built-in
    GPT, the calls summed to 1.1-1.5x the block's forward)."""
    flops: int
    """Forward FLOPs of this call (FlopCounterMode, plus formulas for attention ops it misses)."""
    is_random: bool
    """True for ops that draw random numbers (dropout, bernoulli, rand*)."""
    is_view: bool
    """True when every output aliases an input (view, transpose, reshape of a contiguous tensor...)."""
    storage_ids: tuple[int, ...] = ()
    """Block-local ids of the storages its outputs live in, among those this block's forward
    allocated: 0, 1... in allocation order. A view or in-place op names its source's id; storages
    from outside the block (its inputs, parameters) are not listed. Caching an op's output keeps
    these storages alive whole. () in profiles recorded without it."""
    storage_bytes: tuple[int, ...] = ()
    """Bytes of each storage of ``storage_ids``, in the same order."""
    storage_escapes: tuple[bool, ...] = ()
    """Per storage of ``storage_ids``: True when it outlives the block anyway: a later segment's
    autograd saves it too (the block's output, the next block's saved input; that block's
    checkpoint holds it where the block is not kept). Caching it adds no bytes. A storage later
    blocks only read (T5's position bias, added to every layer's scores) does not: a kept reader
    lets it go after its forward. () in profiles recorded without it."""
    storage_saved_from: tuple[int, ...] = ()
    """Per storage of ``storage_ids``: the first block after this one whose autograd saves it too
    (the code between block k - 1 and block k counts as k, its backward running right after k's;
    the post part as the number of blocks), -1 where none does. Past this block's next one, a
    cache of it is all that holds it between that saver's backward and this block's: BridgeTower's
    last text layer, whose output the post part saves, caching it beside the image layer after it
    (whose backward runs in that gap) measured 8,192 bytes above its prediction. () in profiles
    recorded without it."""
    mutated_later: bool = False
    """A later call of the step's forward writes in place into a storage its outputs live in
    (T5's ``relative_buckets += ...``): selective checkpointing cannot cache it
    (`remat.checkpointing.cacheable`)."""
    size_group: int = -1
    """Whether its output size follows the data (an expert's matmul over the tokens routed to it,
    `remat.measure.size_groups`): -1 no; else the index of the first call of its family in this
    block, whose calls' bytes add up to a total that does not (a knapsack caches the family
    whole or not at all); -2 never cached: the total follows the data too, or the call's output
    shape follows values outside a family (``nonzero``), or a loop over such an output runs it
    (the experts a batch hits), so its key names another call on another batch."""


@dataclass(kw_only=True, frozen=True)
class BlockInput:
    """One tensor argument of a block's call, and where it came from (`remat.measure.dataflow`)."""

    argument: str
    """``"args[0]"``, ``"args[1]"``... for positional arguments, the keyword for keyword ones;
    a tensor inside a tuple argument adds its index (``"position_embeddings[0]"``)."""
    storage: int
    """Profile-local id of the tensor's storage: arguments with equal ids (in this block or any
    other) are one storage."""
    storage_bytes: int
    """Bytes of the whole storage."""
    source: str
    """``previous`` (made by the block just before, in run order), ``block:<k>`` (made by an
    earlier block k: a skip), ``shared`` (made outside blocks and passed to several blocks: a
    mask, rotary cos/sin, an encoder's output), ``between`` (made by code between two blocks)
    or ``outside`` (made before the first block, or by the caller: the batch)."""
    activation: bool = True
    """False for storages that existed before the step (the batch, parameters, buffers): they
    are never counted, as the live-storage tracker does not count them."""
    producer_storage: int = -1
    """Made by an earlier block (``previous``, ``block:<k>``): the storage's number among that
    block's call outputs (`OpRecord.storage_ids`), which a selective strategy of it may cache
    (-1: not known)."""
    counted: str = ""
    """Where the memory model counts it (`remat.measure.dataflow`): ``held`` (in this block's
    ``held_input_bytes``), ``shared`` (in its ``shared_entry_bytes``: the first of several blocks
    to take it, and none saves it), ``earlier`` (where an earlier part saved it or an earlier
    block took it), ``state`` (not an activation); "" in profiles recorded without it."""

    def producer(self, taker: int) -> int:
        """The index of the block that made it, as block ``taker``'s argument (``previous``: the one
        before; ``block:<k>``: k), -1 where no block did."""
        if self.source == "previous":
            return taker - 1
        return int(self.source[len("block:"):]) if self.source.startswith("block:") else -1


@dataclass(kw_only=True, frozen=True)
class CompiledBlock:
    """One block run alone under ``torch.compile`` (``fullgraph=True``), forward then backward
    (`remat.measure.compiled`): what its figures become in a compiled profile."""

    fwd_ms: float
    """Median compiled forward, everything kept."""
    bwd_ms: float
    """Median compiled backward, everything kept."""
    replay_ms: float
    """What checkpointing the whole block adds to its compiled step: the fused replay inside the
    compiled backward (median of paired differences, never negative)."""
    cheap_replay_ms: float
    """What checkpointing adds when the outputs of the matmul-class ops
    (`remat.checkpointing.cacheable.MATMUL_OPS`) are saved and the other ops replayed (never
    above ``replay_ms``)."""
    saved_bytes: int
    """Bytes of the storages the compiled graph saves for backward (its backward node's saved
    tensors), parameters and buffers excluded."""
    eager_saved_bytes: int
    """The same count for the block run alone eagerly (autograd's saved tensors)."""


@dataclass(kw_only=True, frozen=True)
class BlockProfile:
    """Measurements of one block (one member of the model's repeated-layer list)."""

    index: int
    """Position in forward order, 0-based."""
    name: str
    """Qualified module name, e.g. ``"blocks.3"``."""
    class_name: str
    """The module's class name."""
    input_bytes: int
    """Bytes of the block's tensor inputs (distinct storages): what `recompute` retains."""
    output_bytes: int
    """Bytes of the block's tensor outputs (distinct storages)."""
    saved_bytes: int
    """Bytes autograd saves for backward inside this block (first saver counts a storage)."""
    bwd_temp_bytes: int
    """Peak live bytes during this block's backward minus the model state (parameters, buffers,
    optimizer state, gradients live when it began), the fixed pre part's and earlier blocks'
    saved bytes and this block's full ``saved_bytes``: its incoming gradient, the gradients it
    computes, later blocks' leftovers (exact identity in `remat.measure.profile`)."""
    fwd_ms: float
    """Forward time of this block."""
    bwd_ms: float
    """Backward time of this block (excluding recomputation)."""
    fwd_flops: int
    """Forward FLOPs of this block."""
    ops: tuple[OpRecord, ...]
    """Every aten op of the block's forward, in call order."""
    grad_bytes: int = 0
    """Bytes of the gradients of this block's own parameters (0: not measured; the planner then
    counts every gradient as live during the whole backward)."""
    fwd_temp_bytes: int = 0
    """Peak live bytes during this block's forward minus those live when it began minus its full
    ``saved_bytes`` (negative when the peak comes before all saves): a forward replayed in
    backward (recompute) peaks at what is live then + ``saved_bytes`` + this."""
    between_fwd_peak_bytes: int = 0
    """Peak of the code the model runs between the block before and this one (from that block's
    forward's end to this one's start) above the live bytes when this one starts: a transient no
    block saves, such as a mask or bias built under ``torch.no_grad()`` between two layers, or a
    graph no backward needs, freed before this block (an off-path tokenizer's, once its output
    became integer codes); counted in this block's forward phase, kept or recomputed
    (`remat.plan.phases.forward_phase_bytes`, `checkpointed_forward_peak`). Measured above the
    start, not above the live bytes when that code began, it leaves out what that code made and
    still holds then (the block's inputs), which the block's own figures count. 0 for block 0,
    whose code before is the pre part's forward."""
    unreached_fwd_bytes: int = 0
    """What blocks before this one that no backward runs saved and is still live when this
    block's forward begins: their graphs live as long as the model's code holds their outputs (a
    tokenizer stack whose output becomes integer codes, kept in a variable to the forward's end),
    beside this block's forward whatever its strategy (such blocks are always kept; their own
    ``saved_bytes`` is 0); and likewise what the part before the first block saved and no
    backward keeps (Chameleon's trainable VQ tokenizer). A trainable tokenizer of three blocks off the loss path measured 16.7 %
    above the prediction of full recomputation before (0: none, or not measured)."""
    output_grad_bytes: int = 0
    """Bytes of the gradient of the block's output, live while a replay of the block runs in
    backward (its output bytes when measured; 0: not counted)."""
    output_passed_bytes: int = 0
    """Of ``output_bytes``, the storages among its own inputs that it returns as they came: the
    position bias a T5-style layer takes from the layer before and returns beside its hidden
    states, for the next (LongT5's: 786,432 of a layer's 790,528 output bytes). Live as its
    inputs are, they add nothing while a segment's forward holds the block's output for the
    model's next call (`remat.plan.phases.segment_forward_bytes`; 0: none, or not measured)."""
    fwd_live_bytes: tuple[int, ...] = ()
    """Per op call of ``ops``: bytes the block's forward had made live (beyond those live when
    it began) once that call's outputs existed. A selective replay holds the cached outputs of
    later calls on top of this curve (`remat.plan.costs.selective_working_bytes`); empty: not
    measured."""
    replay_stop_calls: int | None = None
    """Op calls of ``ops`` dispatched when the forward's last tensor saved for backward was
    saved (parameters and repeated storages count): where torch's early-stopping replay
    (``early_stop=True``) of a checkpoint ending with this block stops; the calls after it
    are not replayed (`remat.plan.phases.stopped_replay`; None: not recorded, the whole
    forward is replayed)."""
    checkpointed_fwd_live_bytes: tuple[int, ...] = ()
    """The same curve for a checkpointed forward of the block run alone (autograd keeps only its
    input): what a selective forward holds beyond its cache (`remat.measure.overhead
    .checkpointed_forward_curve`; empty: not measured)."""
    checkpointed_fwd_freed_at: tuple[int, ...] = ()
    """Per storage of `OpRecord.storage_ids` (index = id), the op call of that checkpointed
    forward from which the storage was no longer live (``len(ops)``: live at its end): a cached
    output adds to the curve only from then on (empty: not measured)."""
    graph_held_storages: tuple[int, ...] = ()
    """The storages (ids of `OpRecord.storage_ids`) a checkpointed forward of the block leaves to
    its autograd graph beyond its outputs: tensors a custom ``torch.autograd.Function`` keeps as
    attributes of its ``ctx`` (an intermediate, as torch's documentation has it), which no
    saved-tensor hook sees, so no checkpoint drops them. Live from the forward to the end of the
    step's backward whatever the plan, they are counted where they live in every phase; a replay
    makes them again, held by the replay's graph until the replay ends, so such a block ends every
    multi-block segment (`remat.plan.joins`), and caching one costs a selective block nothing
    (`remat.plan.costs`). Empty: none, or not measured (`remat.measure.overhead
    .checkpointed_forward_curve`)."""
    graph_held_bytes: int = 0
    """Their bytes (kept where the checkpointed forward's calls did not line up with the block's
    and the storages are not named)."""
    bwd_free_order: tuple[tuple[int, int], ...] = ()
    """The block's saved storages in the order its backward freed them, as ``(storage id of
    `OpRecord.storage_ids` or -1, bytes)``: which storages autograd keeps for the backward, so
    which cached outputs a selective forward holds beyond them (empty: not measured)."""
    selective_overhead_ms: float = 0.0
    """Time selective checkpointing adds to this block's step beyond the ops it replays: the
    policy's dispatch mode on every op of the forward and of the replay, the replay's Python,
    the cache and the checkpoint hooks (0: not measured; `remat.measure.overhead`)."""
    selective_cache_overhead_ms: float = 0.0
    """What saving every cacheable op call adds to ``selective_overhead_ms`` (storing and
    fetching outputs); a plan saving a share of those calls pays that share (0: not measured)."""
    recompute_overhead_ms: float = 0.0
    """Time plain non-reentrant checkpointing adds to this block's step beyond one replayed
    forward: saved-tensor hooks, RNG state, the replay's bookkeeping (0: not measured)."""
    replay_saved_extra_bytes: int = 0
    """A compiled profile's (`remat.measure.compiled`): the bytes by which ``saved_bytes`` came
    down to what the compiled graph of the kept block saves, which a replay of the block in the
    compiled backward holds all the same (measured on a Llama layer alone: the compiled replay's
    backward peak 17.3 MB above what is live when it starts, the eager replay's 17.9 MB, while
    the compiled kept block saves 3.1 MB less than eager autograd): a replay's working set
    counts them back (`remat.plan.phases.replay_working_bytes`). 0 in an eager profile."""
    unavailable: tuple[tuple[str, str], ...] = ()
    """``(strategy, reason)`` per strategy that cannot run on this block: ``recompute``,
    ``selective`` (every policy), ``offload:cpu`` or ``offload:disk``; the reason is what its
    probe raised, in one line (`remat.measure.probes`). The planner never picks them."""

    stack: str = ""
    """Name of the stack it belongs to (`Profile.stacks`; "" in profiles recorded without them)."""
    follows_previous: bool = True
    """Called with what the block before it handed on (its output, or the output's first
    element) as its first positional argument and with that block's other arguments, in the
    same stack: a checkpointed segment may run the two together (`remat.measure.calls`). True
    in profiles recorded without it (one chain)."""
    output_read_aside: bool = False
    """The code between it and the next block reads its output (not through views alone): a side
    output the model computes from each layer's before the next runs (Hiera's rerolled hidden
    states). Run in one segment, the next block runs before that code, its gradient into the
    output comes second instead of first, the sum rounds otherwise, and gradients are no longer
    bit-identical: no segment spans the two (`remat.plan.joins`). Code after the next block
    (a neck reading every layer's output: DPT's) runs after it either way."""
    inputs: tuple[BlockInput, ...] = ()
    """Its tensor arguments and their sources (empty: not recorded)."""
    held_input_bytes: int | None = None
    """Bytes of its input storages that nothing before it saved or took (inputs another block
    took first, or an earlier part saved, are counted there): what a checkpoint of this block
    holds of its own, on top of ``entry_bytes`` (None: not recorded; ``input_bytes`` holds)."""
    unsaved_input_bytes: int = 0
    """Of ``held_input_bytes``, the storages the block's own autograd does not save: live beside
    its replay, outside its ``saved_bytes``."""
    shared_entry_bytes: int = 0
    """Input storages this block is the first to take, later blocks take too, and it does not
    save (a mask no op saves): held while a checkpoint of one of them holds them, so counted
    from this block on (`remat.plan.predict.dead_shared_bytes`: not at all when no checkpoint
    holds them; an upper bound when the first block to hold them comes later)."""
    handoff_bytes: int = 0
    """Of ``saved_bytes``, the storages (not among its inputs) that something after it also
    holds: its output when the next block or the code after it saves it too, a skip connection's
    tensor. They outlive a checkpoint of this block, so they are counted from the next block's
    entry on (`entry_bytes`), whatever this block's strategy."""
    handoff_next_bytes: int = 0
    """Of ``handoff_bytes``, the storages held after it by the next block alone (as an input or
    saved by it): a segment spanning both recomputes them, so nothing holds them."""
    between_saved_bytes: int = 0
    """Saved bytes of the code run between the previous block and this one (pooling, patch
    merging, a final norm and the next stack's embeddings): kept whatever the plan."""
    between_bwd_temp_bytes: int = 0
    """Like ``bwd_temp_bytes`` for that code: the peak of its backward above the model state,
    the gradients live when it began, the saved bytes of everything before it and its own."""
    between_grad_bytes: int = 0
    """Gradients that code's backward accumulates (parameters only it uses: a second stack's
    embeddings), and those this block's backward makes whole that are not its own (parameters
    outside the blocks whose last use it completes: SEW-D's relative position embeddings, read by
    every layer): not yet allocated while the blocks after it run their backward."""
    entry_bytes: int = 0
    """Held from this block's entry on whatever the plan: ``between_saved_bytes`` + the
    previous block's ``handoff_bytes`` + ``shared_entry_bytes``."""
    saved_dead_bytes: int = 0
    """Of ``saved_bytes``, what is no longer live as the step's backward begins: a storage a graph
    of the block's saved that its forward dropped, which the model's code held past the block and
    freed before the loss's backward (MRA's layer input, which query, key and value projections
    whose outputs its attention never reads saved, held by the model to the encoder's return).
    It lives through the forward after the block, where the saved bytes count it; the block's
    backward windows measure that much lower (``bwd_temp_bytes`` + ``saved_bytes`` is exact), and
    kept, the blocks' backwards after it and the post part's do not hold it
    (`remat.plan.predict.layout_peak`; 0: none, or not measured)."""
    bwd_start_temp_bytes: int | None = None
    """What ``bwd_temp_bytes`` counts when a replay of the block would begin: at the first read
    of a tensor it saved in its backward (at the backward's start where it read none): the
    gradient of its output, whatever else the step holds then, and what the nodes before that
    read made (a view's and a sum's, which need nothing saved: the gradient of an MoE's routed
    outputs); a replay of the block runs on top of it (None: not measured;
    ``output_grad_bytes`` stands for it)."""
    held_input_bwd_temp_bytes: int | None = None
    """``bwd_temp_bytes`` had the inputs it saves itself lived to its backward's end: a checkpoint
    holds its inputs until the last of its saved tensors is read, where kept, the op that read
    one early (GraphSAGE's root weight on the layer's input, at the layer's end) frees it then and
    the backward peaks later without it (None: it saves none of its inputs; ``bwd_temp_bytes``)."""
    output_end_held_bytes: int = 0
    """Of ``saved_bytes``, its outputs the model's code still holds when the last block's
    forward ends, other than what it hands on (`remat.measure.dataflow`): the attention weights
    of ``output_attentions=True``, which the model's output holds through the head and the loss.
    Live through the post part's forward whatever this block's strategy, so counted there when
    this block is not kept (`remat.plan.predict`)."""
    output_post_held_bytes: int = 0
    """Of ``saved_bytes``, its outputs the model's code still holds when the post part's forward
    begins (at least ``output_end_held_bytes``): a list of every layer's attention scores the
    forward drops only as it returns, live through the head's projection (`remat.plan.predict`)."""
    output_held_bytes: int = 0
    """Of ``saved_bytes``, its outputs the model's code still holds when the next block's forward
    begins (not that block's inputs, not handed off): live in that forward whatever this block's
    strategy, so counted there when this block is not kept (its saved bytes hold them when it
    is; `remat.measure.dataflow`)."""
    output_later_held_bytes: int = 0
    """Of ``saved_bytes``, its outputs the model's code still holds as the blocks from two after
    it start (not their arguments, not what it hands on; the most at any of them): x-transformers
    keeps every layer's attention scores in a list to the end of its layers' forward. Live in the
    forwards of those blocks whatever this block's strategy, so counted there when this block is
    not kept (`remat.plan.predict`; `remat.measure.held`)."""
    output_held_until: int = 0
    """The last block whose forward starts with ``output_later_held_bytes`` of this block's
    outputs still held (0: none)."""
    input_code_held_bytes: int = 0
    """Of its inputs, the output of the block before (what that block hands on) that the model's
    code still holds once the loss is computed and the output dropped, so through the backward:
    a forward hook's list of every block's output. A recompute segment
    that runs this block after its first replays that output beside the one the code holds, so
    the segment holds it too, from its forward to the step's end (`remat.plan.costs`); a kept
    block's saved input and a checkpoint's are the code's own storage (`remat.measure.held`)."""
    saved_code_held_bytes: int = 0
    """Of ``saved_bytes``, what the model's code still holds once the loss is computed and the
    output dropped, so through the backward whatever this block's strategy: the weight
    ``torch.nn.utils.spectral_norm``'s pre-hook computes and leaves on the module as a plain
    attribute, which the Linear saves. A block not kept holds it all the same, while the backward
    runs the blocks after it (its replay reads the same storage; the profile's step, every block
    kept, counted it past the block's backward in the backward temporaries of the blocks before)."""
    input_code_kept_bytes: int = 0
    """That input (the block before's output) where the model's code keeps it past this block's
    call, in the forward at least (a tuple of every layer's hidden states the output returns:
    FLAVA's image encoder's); ``input_code_held_bytes`` where it keeps it through the backward too.
    A recompute segment that runs this block after its first holds it then as the code does
    (`remat.plan.predict`)."""
    input_code_kept_until: int = 0
    """The last block whose forward begins with ``input_code_kept_bytes`` held (the number of
    blocks: the part after the blocks too, to the loss; 0: none)."""
    input_saved_after_bytes: int = 0
    """Of its inputs, the output of the block before (what that block hands on, which it holds
    kept or as a checkpoint) that code after it, not a block, saves too: a norm on every layer's
    hidden states before a neck reads them (Depth Anything's backbone's feature maps). A recompute
    segment that runs this block after its first holds no copy of it, yet that code's graph holds
    it from the forward to that code's backward (`remat.measure.dataflow`; 0: none)."""
    input_saved_after_from: int = 0
    """The first block whose backward runs with ``input_saved_after_bytes`` still held: that code
    runs before it (the number of blocks: after the last; its backward runs before theirs)."""
    code_held_inputs: tuple[tuple[int, int], ...] = ()
    """``(j, bytes)`` per earlier block j: the inputs a checkpoint of block j holds that the
    model's code holds too as this block begins (``fwd_other_bytes`` counts them): a
    checkpoint of j adds nothing here (`remat.measure.dataflow`)."""
    shared_freed: tuple[tuple[int, int], ...] = ()
    """``(storage id, bytes)``: shared tensors of earlier blocks (an input ``counted == "shared"``: a
    mask no block saves) that the model's code had freed when this block's forward began, so that
    ``fwd_other_bytes`` counts them out (an audio tower's mask, dropped as the tower returns,
    before a language model's layers). A checkpoint of one of their takers keeps them alive there
    (`remat.plan.predict.revived_profile`)."""
    shared_saved: tuple[tuple[int, int, int], ...] = ()
    """``(storage id, bytes, saver)``: shared tensors of earlier blocks (an input ``counted ==
    "shared"``, counted by its first taker's ``shared_entry_bytes``) that block ``saver``, after that
    taker and before this block, saves first, so that its ``saved_bytes`` count them too and this
    block's ``fwd_other_bytes`` counts them out (RT-DETR's reference points with LoRA: its frozen
    query-position head takes them first, each decoder layer saves them). Where the saver is not
    kept, nothing else counts them in this block's forward (`remat.plan.variants.resaved_profile`)."""
    shared_freed_between: tuple[int, ...] = ()
    """Of ``shared_freed``, the storage ids the code between the block before and this one freed
    (alive as that code began)."""
    between_fwd_apart_bytes: int | None = None
    """``between_fwd_peak_bytes`` with ``shared_freed_between`` set apart while they lived: where
    a checkpoint holds them through that code, its peak above this block's start is this (they
    are live at both). None where that code freed none, or freed a block argument that is not a
    shared tensor."""
    stored_held: tuple[tuple[int, int, int, int], ...] = ()
    """``(i, bytes, saved bytes, handed-off bytes)`` per block i (this one, one before or after it)
    whose call outputs the mutable containers among this block's arguments hold as the last
    block's forward ends, of them what block i saves, and of that what a later segment saves too
    (in its ``handoff_bytes``: Gemma 4's layers that reuse keys and values save them) (`remat.measure.held`):
    Gemma 4's storing layers write their keys and values to the mapping every layer is handed. A
    checkpoint of this block holds the container to the end of its backward, and with it these,
    where the code let them go as the forward returned (`remat.plan.predict.stored_held_bytes`)."""
    stored_calls: tuple[str, ...] = ()
    """The op calls (keys of ``ops``) whose outputs some block's ``stored_held`` counts of this
    block: a selective strategy that caches one holds it already."""
    output_later_held_calls: tuple[str, ...] = ()
    """The op calls (keys of ``ops``) whose outputs ``output_later_held_bytes`` counts: a
    selective strategy that caches one holds it already."""
    output_held_calls_until: tuple[tuple[str, int], ...] = ()
    """``(call, k)``: the op calls (keys of ``ops``) whose outputs the model's code still holds as a
    later block's forward begins, saved or not, each with the last such block k (from the next
    block on; the number of blocks: to the post part): x-transformers' attention layers return
    their keys and values in a list the forward holds to its return. A later block's measured
    forward counts those not saved; a selective strategy that caches one counts it again
    (`remat.plan.phases.cached_code_held_bytes`)."""
    output_end_held_calls: tuple[str, ...] = ()
    """The op calls (keys of ``ops``) whose outputs the model's code holds as the last block's
    forward ends, saved or not (``output_end_held_bytes`` counts the saved ones): a selective
    strategy that caches one adds nothing there (`remat.plan.predict.end_held_bytes`)."""
    output_post_held_calls: tuple[str, ...] = ()
    """Likewise as the post part's forward begins (``output_post_held_bytes``): x-transformers'
    attention layers return their keys and values in a list the forward holds to its return,
    which the post part's measured forward counts; a cache of them counted again measured 6 %
    under the prediction."""
    fwd_other_bytes: int | None = None
    """Live bytes when its forward began that are neither model state nor saved by anything
    before it, less the ``shared_entry_bytes`` of this block and those before it: its input when
    nothing saved it, what the model's code still holds (may be negative when a shared tensor
    was freed by then). With it, the peak of the block's forward is the live model state +
    the pre part's saved bytes + what the blocks before it retain + ``entry_bytes`` + this +
    ``saved_bytes`` + ``fwd_temp_bytes`` (exact for the measured step; None: not recorded)."""
    timing_from: int | None = None
    """Index of the block whose timing probes (checkpointing overheads, op times' shares) this
    block's figures come from: itself when they ran on it, an earlier block that is the same
    computation otherwise (`remat.measure.sharing`; None: recorded without sharing). Its bytes
    and its forward and backward times in the step are always its own."""


    def unavailable_reason(self, strategy: str) -> str | None:
        """Why ``strategy`` (``recompute``, ``selective:<policy>``, ``offload:disk``...) cannot
        run on this block; None when it can. ``keep`` always can."""
        kind = strategy.split(":", 1)[0]
        return next((reason for name, reason in self.unavailable if name in (strategy, kind)), None)


NO_BACKWARD = ("no gradient reaches it in the step (its parameters frozen and its inputs needing none, or its output "
               "never reaching the loss): it saves nothing a backward needs, and a replay would never run")
"""`BlockProfile.unavailable`'s reason for a block whose backward never ran in the profiled step:
only keep. Recomputed, such a block gained nothing and a segment of them held each output until
the model called the next block (a linear probe of Swin measured twice its prediction)."""


GRADIENT_GRAPH = ("the step differentiates through its backward (a gradient taken with create_graph=True: a gradient "
                  "penalty, a physics-informed loss): a replay would run once per backward, what it recomputes is saved "
                  "again by that gradient's graph and held to the step's last backward, and torch's selective "
                  "checkpointing allows one backward through a region")
"""`BlockProfile.unavailable`'s reason (recompute, selective and offload) for a block whose saved
tensors a backward read while building a graph (`remat.measure.saved.SavedAccountant.graph_building`)
and another backward read again.
Recomputed, such a block was replayed once per backward and its replayed tensors were held by
the gradient's graph: a physics-informed net's `full` plan measured 13 % over its prediction, and
a selective plan raised torch's "Trying to backward an extra time"."""

BACKWARD_TWICE = ("the step runs a backward through it more than once (retain_graph=True), and torch's selective "
                  "checkpointing allows one backward through a region")
"""`BlockProfile.unavailable`'s reason (selective) for a block two backward passes read
(`remat.measure.saved.SavedAccountant.backward_tasks`); recomputing it replays it once per pass."""

WRITES_INPUT = ("it writes its input in place (an in-place activation, `ReLU(inplace=True)`): a replay of it alone "
                "would read the input it overwrote")
"""`BlockProfile.unavailable`'s reason (recompute and selective) for a block whose run alone on
its captured inputs wrote them in place (`remat.measure.overhead`)."""

OWN_GENERATOR = "its forward draws from a torch.Generator of its own"
"""How `own_generator_reason` begins."""


def own_generator_reason(calls: Sequence[str]) -> str:
    """`BlockProfile.unavailable`'s reason for a block whose forward draws from a
    ``torch.Generator`` of its own (``calls``: the keys of those random calls)."""
    shown = ", ".join(calls[:3]) + (f" and {len(calls) - 3} more" if len(calls) > 3 else "")
    return (f"{OWN_GENERATOR} ({shown}): a replay restores only the default "
            "generators' states, so it would draw other numbers and the gradients would differ; keep it, or draw "
            "from the default generator (torch.manual_seed seeds it)")


@dataclass(kw_only=True, frozen=True)
class Stack:
    """A run of consecutive blocks (in run order) from one module list: an encoder's layers, a
    decoder's, one tower of a two-tower model, one stage of a hierarchical vision model."""

    name: str
    """Qualified name of the list (``"encoder.block"``), or of the module holding named blocks
    (``""``: the model itself)."""
    start: int
    """Index of its first block."""
    stop: int
    """One past the index of its last block."""
    class_name: str
    """Class of its first block."""


@dataclass(kw_only=True, frozen=True)
class FixedModule:
    """A module outside every block, with nothing of a block inside it (an embedding, a final
    norm, a head), or a parameter held directly by a module that contains blocks."""

    name: str
    """Qualified name (of the parameter, for one held directly)."""
    class_name: str
    """The module's class (``"Parameter"`` for a parameter held directly)."""
    param_bytes: int
    """Bytes of its parameters not counted before (tied weights count once, in the first module
    in module order that holds them)."""


@dataclass(kw_only=True, frozen=True)
class Fingerprint:
    """What a plan must match to be applied: structure, batch, device, dtype, torch."""

    model_hash: str
    """Hash of qualified module names, classes and parameter/buffer shapes and dtypes."""
    batch_shapes: tuple[str, ...]
    """``"4x128:int64"`` per batch tensor, in `remat._batch.batch_tensors` order."""
    device: str
    """Device type of the model, e.g. ``"cpu"`` or ``"cuda"``."""
    dtype: str
    """dtype of the model's floating-point parameters, e.g. ``"float32"``."""
    torch_version: str
    """`torch.__version__` at profiling time."""
    block_names_hash: str = ""
    """`remat.measure.fingerprint.block_names_hash` of the profiled blocks' names, in order: a plan
    naming other blocks is refused ("": not recorded, older files and hand-made plans)."""
    run_model_hash: str = ""
    """``model_hash`` after the profile, where running the model changed its own structure
    (BigBird-Pegasus at a sequence too short for block-sparse attention swaps its attention
    modules for full ones on its first forward): the profile measured that model, and the one
    given, never run, becomes it on its first forward, so a model in either state matches ("":
    running changed nothing)."""
    shared_cache: bool = False
    """The model reads, later in the step, the key/value cache its blocks write (DiffusionGemma's
    encoder layers fill the cache its decoder attends to): its blocks are handed their caches in
    the profile, `remat.verify` and under the plan, where other models' get none
    (`remat.checkpointing.caches.CacheOff.drop_in`), and a block handed one is keep-only
    (`remat.checkpointing.caches.SHARED_CACHE`). Handed none, the decoder attended to no prompt,
    and the plan trained another model than the one given."""


@dataclass(kw_only=True, frozen=True)
class Environment:
    """Where the profile was taken."""

    device_name: str
    """Human name of the device (CPU model or GPU name)."""
    num_threads: int
    """`torch.get_num_threads()`."""
    python_version: str
    """Python version."""
    hostname: str
    """Machine name."""


@dataclass(kw_only=True, frozen=True)
class Bandwidths:
    """Measured transfer rates for offloading, bytes per second (None: not measured)."""

    host_to_device_bytes_per_s: float | None = None
    """Pinned host->device copy rate (accelerators only)."""
    device_to_host_bytes_per_s: float | None = None
    """Device->pinned host copy rate (accelerators only)."""
    disk_write_bytes_per_s: float | None = None
    """Sequential write throughput of the offload directory."""
    disk_read_bytes_per_s: float | None = None
    """Sequential read throughput of the offload directory."""
    disk_dir: str | None = None
    """The directory the disk rates were measured in."""
    overlap_fraction: float | None = None
    """Share of offload transfer time measured hidden behind compute (0..1)."""
    disk_overlap_fraction: float | None = None
    """Share of disk write time measured hidden behind compute (0..1); ``overlap_fraction`` is
    the host<->device copies' share."""


@dataclass(kw_only=True, frozen=True)
class MemoryEvent:
    """One point of the live-memory timeline of a training step."""

    phase: str
    """``"fwd"``, ``"bwd"`` or ``"opt"``."""
    where: str
    """Block name, ``"pre"``, ``"post"`` or ``"optimizer"``."""
    live_bytes: int
    """Live storage bytes on the model's device at this point (all categories)."""


@dataclass(kw_only=True, frozen=True)
class HeadOption:
    """One way to run the head, measured alone on the real hidden states and labels
    (`remat.measure.head`). Bytes are live storages counted from the head's input on: the
    hidden states, and everything the head allocates (its gradients included)."""

    strategy: str
    """``keep``, ``recompute`` or ``chunked:<tokens>`` (`remat.head.strategies`)."""
    saved_bytes: int
    """Bytes autograd saves for the head's backward through saved-tensor hooks, the hidden
    states included (under ``keep``: the head's share of ``Profile.fixed_post_saved_bytes``)."""
    held_bytes: int
    """Bytes live from the end of the head's forward to its backward: the hidden states, what
    the strategy keeps, the loss."""
    fwd_peak_bytes: int
    """Peak live bytes during the head's forward."""
    bwd_peak_bytes: int
    """Peak live bytes during the head's backward, up to the gradients of the hidden states and
    of the projection's parameters, which it leaves behind."""
    fwd_ms: float
    """Median forward time, less the page faults it took (the planner prices fresh memory for
    the whole step from its peak: `remat.plan.predict.fresh_memory`)."""
    bwd_ms: float
    """Median backward time, less the page faults it took."""


@dataclass(kw_only=True, frozen=True)
class HeadProfile:
    """The head part: the output projection and the token loss after the last block.

    Byte model (`remat.plan.head`), above the model state, the pre part's and every block's
    retained bytes: the rest of the post part saves ``rest = Profile.fixed_post_saved_bytes -
    keep.saved_bytes`` (a final norm) and holds it through the head. Under a strategy ``s``
    the post part then peaks at ``max(rest + s.fwd_peak_bytes, post_head_bytes +
    s.bwd_peak_bytes - keep.bwd_peak_bytes, post_rest_bytes)``: the head's forward, its
    backward, and the rest of the post part's backward (which sees the same gradients under
    every strategy)."""

    projection: str
    """Qualified name of the output projection."""
    kind: str
    """The model family (`remat.head.site.HeadSite.kind`)."""
    labels_arg: str
    """The forward's argument that carries the labels."""
    tied: bool
    """The projection's weight is tied to the input embedding."""
    num_tokens: int
    """Rows of logits: batch x sequence."""
    hidden_size: int
    """Input features of the projection."""
    vocab_size: int
    """Output features of the projection (the vocabulary)."""
    dtype: str
    """dtype of the hidden states, e.g. ``"float32"``."""
    upcast: bool
    """The loss upcasts the logits to fp32 (Hugging Face)."""
    post_head_bytes: int
    """Peak of the baseline step's post part from ``loss.backward()`` to the end of the head's
    backward (the gradient of the hidden states), measured inside the step: the model's own
    keep head (the tests check it equals ``rest + keep.bwd_peak_bytes``)."""
    post_rest_bytes: int
    """Peak of the baseline step's post part from the end of the head's backward to the last
    block's backward (the final norm's backward, with the head's gradients live)."""
    options: tuple[HeadOption, ...]
    """``keep`` first, then ``recompute`` and each measured chunk size."""
    unavailable: tuple[tuple[str, str], ...] = ()
    """``(strategy, reason)`` of each head strategy whose run raised (`remat.measure.probes`):
    not measured, never planned."""

    def option(self, strategy: str) -> HeadOption:
        """The measured option named ``strategy``."""
        for candidate in self.options:
            if candidate.strategy == strategy:
                return candidate
        measured = ", ".join(o.strategy for o in self.options)
        raise ValueError(f"head strategy {strategy!r} was not measured; measured: {measured}. Profile with its "
                         "chunk size named: remat.profile(..., head_chunks=(...)), remat profile --head-chunks N,...")


@dataclass(kw_only=True, frozen=True)
class Profile(JsonDocument):
    """Everything `remat.plan` needs, measured on the real model on its device."""

    DOCUMENT = (PROFILE_FORMAT, PROFILE_VERSION, PROFILE_RULES)

    @functools.cached_property
    def released_grad_prefix(self) -> tuple[int, ...]:
        """Running sums of what each block's backward and the code before it allocate as
        gradients (`remat.plan.phases.released_grad_bytes`: ``grad_bytes + between_grad_bytes``):
        entry ``j`` covers blocks ``< j``. Computed once per profile; the planners read it for
        every phase of every candidate plan."""
        return tuple(itertools.accumulate((b.grad_bytes + b.between_grad_bytes for b in self.blocks), initial=0))

    fingerprint: Fingerprint
    environment: Environment
    blocks: tuple[BlockProfile, ...]
    param_bytes: int
    """Bytes of all parameters."""
    grad_bytes: int
    """Bytes of all parameter gradients after backward."""
    optimizer_state_bytes: int
    """Bytes of optimizer state after one real step of the user's optimizer (0 without one)."""
    optimizer_name: str
    """Class name of the optimizer, or ``"none"``."""
    optimizer_step_temp_bytes: int
    """Peak live bytes during optimizer.step() above params + grads + state before it."""
    optimizer_step_ms: float
    """Median optimizer.step() time."""
    buffer_bytes: int
    """Bytes of module buffers (BatchNorm running stats...)."""
    fixed_pre_saved_bytes: int
    """Saved bytes of the fixed part before the first block still live when the backward begins
    (alive through the whole backward); what it saved on a graph off the loss path, freed with the
    forward (a trainable image tokenizer whose codes are integers), is counted beside the blocks'
    forwards instead (`BlockProfile.unreached_fwd_bytes`)."""
    fixed_post_saved_bytes: int
    """Saved bytes of the fixed part after the last block (freed by the head's backward)."""
    fixed_post_bwd_temp_bytes: int
    """Like `BlockProfile.bwd_temp_bytes` for the head and loss: peak live bytes from
    ``loss.backward()`` to the last block's backward, minus the model state, every saved byte
    of the forward (pre, blocks, post) (exact identity in `remat.measure.profile`); or the peak
    of the post part's forward (from the last block's end to ``loss.backward()``) less the same
    bytes, where that is higher (a CTC loss's forward workspace, freed before its backward)."""
    fixed_fwd_ms: float
    """Forward time of everything outside blocks (incl. loss)."""
    fixed_bwd_ms: float
    """Backward time of everything outside blocks."""
    fixed_flops: int
    """Forward FLOPs outside blocks."""
    step_ms: float
    """Median measured time of a whole baseline step (forward, backward, optimizer step)."""
    peak_bytes: int
    """Measured peak live bytes of a baseline step (device-agnostic tracker)."""
    peak_bytes_by_category: dict[str, int]
    """At the peak: ``parameters``, ``gradients``, ``optimizer_state``, ``activations``,
    ``temporaries`` (and ``buffers``)."""
    device_max_allocated_bytes: int | None
    """``torch.cuda.max_memory_allocated`` during the baseline step (CUDA only)."""
    timeline: tuple[MemoryEvent, ...] = ()
    """Live bytes at block boundaries of the baseline step, for the timeline plot."""
    bandwidths: Bandwidths = field(default_factory=Bandwidths)
    """Transfer rates for the offload strategies."""
    bucket_bytes: int = 0
    """DDP only (`remat.distributed.shard_profile` with ``zero_stage=0``): its gradient buckets, a
    flat copy of every gradient allocated with the wrapper, or, under
    ``gradient_as_bucket_view=True``, the gradients themselves, there from the step's start:
    model state through the whole step."""
    gathered_bytes: int = 0
    """ZeRO-3/FSDP only: what FSDP2 holds beside the rank's shards while a unit's backward runs:
    the largest block's and the root unit's gathered weights, the next unit's prefetched ones and
    the reduce-scatter input of the unit before (`remat.distributed.fsdp2_gathered_bytes`)."""
    block_gathered_bytes: int = 0
    """ZeRO-3/FSDP only: the part of ``gathered_bytes`` live only while a block's backward runs
    (its unit's weights and the reduce-scatter input beside the prefetched next unit), not through
    the head's, which holds the root's and the prefetched weights only."""
    unit_bytes: tuple[int, ...] = ()
    """ZeRO-3/FSDP only: per block, its weights unsharded. A recompute segment of several blocks
    is one unit (`remat.distributed.fsdp_units`), gathered whole through its backward: beyond
    ``gathered_bytes`` by `remat.plan.phases.unit_extra_bytes` (() elsewhere)."""
    fixed_pre_fwd_bytes: int = 0
    """Peak of the forward before the first block (embeddings, a vision model's stem) above the
    model state, no gradient live yet: what a model whose early layers save nothing (a frozen
    backbone under a linear probe) peaks at, whatever the plan (0: not measured)."""
    fixed_pre_bwd_temp_bytes: int = 0
    """Peak of the backward of the part before the first block (a vision model's stem), run after
    every block's, above the model state, the gradients then live (all but the pre part's own),
    and the pre part's saved bytes: a phase no plan changes, the peak of a convolutional network
    whose stem works at the input's resolution once recomputation has lowered the blocks' (0: not
    measured, or it ran none)."""
    fixed_post_fwd_bytes: int = 0
    """The peak of the post part's forward (from the last block's end to ``loss.backward()``)
    above the model state and the bytes the blocks and the pre part saved (the figure
    ``fixed_post_bwd_temp_bytes`` takes where it is the higher); without a head part, what a
    plan's recomputed blocks leave held by the code to the model's return adds to it, not to the
    post part's backward (`remat.plan.predict`; 0: not measured, counted through both, a bound)."""
    fixed_post_model_fwd_bytes: int = 0
    """The same peak up to the model's return (the head's projection, not the loss): what the code
    holds only until it returns (a list of every layer's attention scores) adds to this one."""
    fixed_post_bwd_own_temp_bytes: int | None = None
    """``fixed_post_bwd_temp_bytes`` of the backward alone, without the forward's peak (None: not
    recorded): where a plan lowers that forward's (`fixed_post_loss_fwd_bytes`), this still holds."""
    fixed_post_loss_fwd_bytes: int | None = None
    """The same peak from the model's return on (the loss; None: not seen apart, where
    ``fixed_post_fwd_bytes`` bounds it): what a selective block caches of what the code holds only
    until the return counts there as it does in the backward (`remat.plan.predict.end_held_bytes`)."""
    fixed_post_fwd_held_bytes: int = 0
    """With a head part: what the step holds through the post part's forward beyond what the
    head's own model of that forward counts (`remat.plan.head.head_need_bytes`): the graphs of
    blocks no backward runs, which live as long as their outputs, and outputs the model's output
    keeps to the loss. LLaVA keeps its vision tower's output, every layer's hidden state in it
    (so the unreached last vision layer's graph), and its image features: 3.5 % under the
    measured peak of every plan peaking at the head before. Without a head part the post part's
    measured forward counts them (``fixed_post_bwd_temp_bytes``)."""
    post_code_held: tuple[tuple[int, int], ...] = ()
    """``(storage, bytes)`` per block argument (`BlockInput.storage`) the model's code still holds
    as the post part's forward begins and nothing saved: EoMT's attention mask of its last layer,
    a local of its forward to the return, or a mask every layer takes. The post part's measured
    forward (``fixed_post_fwd_bytes``) counts them while they live; a checkpoint that holds one is
    counted in the blocks' retained bytes, which the post part's need sits on: counted twice
    (`remat.plan.predict.post_code_held_saving`). Empty where ``post_code_held_saving_bytes`` is 0."""
    post_code_held_saving_bytes: int = 0
    """How much lower ``fixed_post_saved_bytes + fixed_post_bwd_temp_bytes`` (the post part's need)
    is when checkpoints hold every storage of ``post_code_held``: its forward's peak measured
    without them while they live, against its backward's (0: none, or not measured)."""
    step_held_bytes: int = 0
    """What a step leaves live on the model beyond its state, measured when the optimizer steps:
    tensors its code keeps between steps (RecurrentGemma's RG-LRU stores its recurrent state as
    ``self.recurrent_states`` on every forward), live through the optimizer's step until the
    next forward replaces them; no plan changes them (0: none, or no optimizer)."""
    fixed_pre_grad_bytes: int = 0
    """Gradient bytes allocated only after the first block's backward, other than its own: the
    pre part's (embeddings, and weights tied to them, whose one gradient accumulates last).
    Block j's backward sees ``grad_bytes - this - sum(grad_bytes of blocks <= j)`` (0: not measured)."""
    fixed_pre_early_grad_bytes: int = 0
    """Of ``fixed_pre_grad_bytes``, the gradients already live as the pre part's backward begins:
    allocated in the first block's backward window, not its own, of weights outside the blocks
    that only blocks use (NeoMME's value embeddings, taken by its first and last layers: their
    gradient is whole once the first block's backward has run). The first block's window counts
    them among its temporaries; the pre part's backward runs with them live, which its window
    (``fixed_pre_bwd_temp_bytes``, above the gradients live when it opens) leaves out: 1 % under
    the peak of every plan where that backward peaks (0: none, or not measured)."""
    step_fault_bytes: int = 0
    """Host memory a baseline step faults in fresh (the least over the timed steps, what the
    settled allocator needs: `remat.measure.timing.steady_fault_bytes`; 0 on CUDA, where
    the caching allocator keeps memory, and where the platform does not count page faults):
    `remat.measure.faults`."""
    first_touch_ms_per_byte: float = 0.0
    """What faulting in a fresh byte costs on this host (`remat.measure.faults`)."""
    checkpoint_call_ms: float = 0.0
    """Of each block's ``recompute_overhead_ms``, the part one checkpointed call pays whatever
    it runs (RNG state saved and restored, the checkpoint's frame, the buffer guard): a segment
    of k blocks pays it once, not k times (`remat.measure.overhead.measure_checkpoint_call_ms`;
    never above any block's ``recompute_overhead_ms``; 0: not measured)."""
    head: HeadProfile | None = None
    """The head part (output projection and loss), measured per head strategy; None when the
    model has no head remat can plan (``head_note`` says why): its loss stays in the fixed part."""
    head_note: str = ""
    """Why there is no head part ('' when there is one)."""
    accumulated_grad_bytes: int = 0
    """With gradient accumulation (`with_grad_accumulation`): every gradient, live through the
    whole step from the second micro-batch on (the accumulated sum), counted here as model state
    live in every phase; ``grad_bytes`` and the per-block gradient figures are then 0."""
    compiled_backend: str = ""
    """The ``torch.compile`` backend the blocks' figures were measured under ('' for eager):
    `remat.profile(..., compiled=True)` (`remat.measure.compiled`)."""
    compiled_blocks: tuple[CompiledBlock, ...] = ()
    """Per block, what the compiled run measured (empty for eager profiles)."""
    stacks: tuple[Stack, ...] = ()
    """The stacks the blocks form, in run order (empty in profiles recorded without them)."""
    fixed_modules: tuple[FixedModule, ...] = ()
    """The modules of the fixed part (outside every block) and their parameter bytes."""
    timing_split: tuple[int, ...] = ()
    """Blocks alike in structure to an earlier block whose traced forward differed: measured
    apart (`remat.measure.sharing`; `BlockProfile.timing_from` says which block each one's
    timing comes from)."""

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def fixed_between_saved_bytes(self) -> int:
        """Saved bytes of the code run between blocks."""
        return sum(b.between_saved_bytes for b in self.blocks)

    @property
    def fixed_saved_bytes(self) -> int:
        return self.fixed_pre_saved_bytes + self.fixed_between_saved_bytes + self.fixed_post_saved_bytes

    @property
    def saved_bytes(self) -> int:
        """All bytes autograd saves in one forward (blocks + fixed part)."""
        return self.fixed_saved_bytes + sum(b.saved_bytes for b in self.blocks)

    @property
    def model_state_bytes(self) -> int:
        return (self.gradient_bytes + self.param_bytes + self.optimizer_state_bytes + self.buffer_bytes
                + self.bucket_bytes)

    @property
    def gradient_bytes(self) -> int:
        """Every gradient's bytes, accumulated or not."""
        return self.grad_bytes + self.accumulated_grad_bytes

    @property
    def grad_accumulation(self) -> bool:
        """Whether the plans are for a micro-batch whose gradients add to the earlier ones'."""
        return self.accumulated_grad_bytes > 0


def with_grad_accumulation(profile: Profile) -> Profile:
    """``profile`` as a micro-batch under gradient accumulation sees it: the earlier micro-batches'
    gradients are live from the step's start, through its forward and backward, so every
    gradient is model state (``accumulated_grad_bytes``) and none is allocated by a block's
    backward. A block's backward still computes its gradients as temporaries before adding them
    in place, which its measured window holds. Planned on the single-step profile, a
    two-micro-batch step peaked 6-19 % over the plan's prediction."""
    if profile.grad_accumulation or not profile.grad_bytes:
        return profile
    blocks = tuple(dataclasses.replace(b, grad_bytes=0, between_grad_bytes=0) for b in profile.blocks)
    return dataclasses.replace(profile, blocks=blocks, accumulated_grad_bytes=profile.grad_bytes, grad_bytes=0,
                               fixed_pre_grad_bytes=0, fixed_pre_early_grad_bytes=0)
