"""The windows of the accounting step: per block and per piece of code between two blocks, the
peak of its backward (and of each block's forward) above what the identities of
`remat.measure.profile` count apart, read from the live-storage tracker at the step's
boundaries (`remat.measure.boundaries`)."""

from __future__ import annotations

from collections.abc import Callable

from remat.measure.boundaries import Boundary
from remat.measure.saved import POST, PRE, SavedAccountant, between_name
from remat.measure.tracker import ACT_PREFIX, LiveTracker

__all__ = ["BackwardWindows", "STATE_LABELS"]

STATE_LABELS = ("parameters", "buffers", "optimizer_state")


class BackwardWindows:
    """Boundary listener: the backward-temporary windows of the accounting step, one per block
    and per piece of code between two blocks (`remat.measure.saved.between_name`), in run order:
    a block's from the gradient of what it hands on to that of its chained input, the code
    before block i's from there to block i-1's start."""

    def __init__(self, tracker: LiveTracker, block_names: list[str], accountant: SavedAccountant) -> None:
        self.tracker = tracker
        self.names = block_names
        self.accountant = accountant
        self.order = [PRE] + [seg for i, name in enumerate(block_names) for seg in ([between_name(i)] if i else []) + [name]] + [POST]
        self.block_temp_bytes = [0] * len(block_names)
        self.between_temp_bytes = [0] * len(block_names)
        self.block_bwd_start_temp_bytes = [0] * len(block_names)
        self._index_of = {name: i for i, name in enumerate(block_names)}
        self.inputs_of: Callable[[int], set[int | None]] = lambda index: set()
        """Storage keys of the tensors a block's first call took as arguments (`StepBoundaries.taken`)."""
        self.block_held_input_temp_bytes: list[int | None] = [None] * len(block_names)
        """Per block, its backward window's peak had the inputs it saved itself lived to the window's
        end, as a checkpoint holding them keeps them (None: it saved none of its inputs)."""
        self._pinned = False
        self.block_first_read_temp_bytes: list[int | None] = [None] * len(block_names)
        """Per block, the window's value at the first read of a tensor the block saved, in its
        backward: where a checkpoint of it begins its replay. The nodes before need nothing
        saved (a sum's, a view's) and what they made is live beside the replay: the gradient of
        GPT-OSS's routed expert outputs, one routed token x hidden, made contiguous for a view."""
        self.between_grad_bytes = [0] * len(block_names)
        self.outside_grad_bytes = [0] * len(block_names)
        """Per block, the gradients of parameters outside every block that its backward window made
        whole (``.grad`` set: their last use was in it; `note_outside_grad`)."""
        self._grads_at_open = 0
        self.block_free_order: list[tuple[tuple[int, int], ...]] = [()] * len(block_names)
        self.storage_id: Callable[[int, str], int] = lambda key, segment: -1
        """Block-local storage id (`remat.measure.types.OpRecord.storage_ids`) of a storage key."""
        self.block_fwd_temp_bytes = [0] * len(block_names)
        self.between_fwd_peak_bytes = [0] * len(block_names)
        """Per block, the peak of the code run between the block before and it, above the live
        bytes when the block began (`BlockProfile.between_fwd_peak_bytes`)."""
        self.between_apart: list[tuple[int, frozenset[int]]] = [(0, frozenset())] * len(block_names)
        """Per block, the peak of the code run between the block before and it with the blocks'
        arguments alive as that code began set apart while they lived, above the live bytes when
        the block began without those still alive then; and the dataflow ids of those that code
        freed (`BlockProfile.between_fwd_apart_bytes`)."""
        self._between_apart: dict[int, int] = {}
        self._between_open = False
        self._between_open_bytes = 0
        self.pre_saved_live_at_fwd_start = [0] * len(block_names)
        self.saved_dead_at_backward = [0] * len(block_names)
        """Per block, what its saved bytes count that is no longer live as the backward begins: a
        storage a graph of the block's saved that its forward dropped, which the model's code held
        past the block and freed before the loss's backward (MRA's layer input, which query, key
        and value projections whose outputs its attention never reads saved, held by the model to
        the encoder's return). The accountant counts it saved, as held to the backward (it lives
        through the forward after the block); the block's backward windows, which exclude its
        saved bytes as counted, measure that much lower (`BlockProfile.saved_dead_bytes`)."""
        self.pre_saved_live_at_backward: int | None = None
        """What the pre part saved still live when each block's forward began and when the
        backward began: a graph it built off the loss path (Chameleon's trainable VQ tokenizer,
        whose codes are integers) dies with the forward (`pre_saved_dead_bytes`)."""
        self.saved_live_at_fwd_start: list[dict[int, int]] = [{} for _ in block_names]
        """Per block, the saved bytes of each block before it still live when its forward began:
        those of blocks no backward runs (`unreached_live_bytes`) live as long as the code holds
        their outputs, beside this block's forward."""
        self.block_fwd_start_bytes = [0] * len(block_names)
        self.block_fwd_start_temporaries = [0] * len(block_names)
        """Live bytes neither model state nor saved for backward when each block's forward began."""
        self.post_temp_bytes = 0
        self.post_head_temp_bytes: int | None = None
        """Of the post window, the peak up to the end of the head's backward (``head_bwd_end``);
        ``post_temp_bytes`` then covers the rest, and the larger of the two at the close."""
        self.optimizer_temp_bytes = 0
        self.grads_at_first_block_bytes = 0
        """Gradients live when the backward of `first_backward_block` starts."""
        self.grads_at_pre_bytes: int | None = None
        """Gradients live when the pre part's backward starts (None: it has none)."""
        self.backward_blocks: set[int] = set()
        """The blocks whose backward ran: a block no gradient reaches (frozen with its inputs, or
        whose output never reaches the loss) has none."""
        self.first_backward_block: int | None = None
        """The first block in run order whose backward ran: 0 but where the blocks before it have
        none (a frozen backbone's, DETR's: no gradient reaches them); None when none ran."""
        self.post_rest_temp_bytes = 0
        self.post_fwd_bytes = 0
        """Peak of the post part's forward (from the last block's end to ``loss.backward()``) less
        the model state and every earlier segment's saved bytes (the pre part's as the backward
        finds them: a graph of its no backward needs counts while it lives): its own saved bytes
        so far and every other live byte (the last block's output, a loss's forward workspace: a CTC loss's
        ``ones_like`` of the input lengths)."""
        self._post_forward_open = False
        self.post_model_fwd_bytes = 0
        """``post_fwd_bytes`` up to the model's return (the head's projection, not the loss)."""
        self.post_loss_fwd_bytes: int | None = None
        """``post_fwd_bytes`` from the model's return on (the loss), None where the return was not
        seen apart (then ``post_fwd_bytes`` bounds it)."""
        self._post_labels: list[str] = []
        self._post_model_peak: int | None = None
        self.post_arguments: Callable[[], dict[int, int]] = dict
        """Storage key -> dataflow id of the blocks' arguments alive now (`remat.measure.dataflow
        .DataflowRecorder.live_arguments`)."""
        self.post_code_held: dict[int, int] = {}
        """Dataflow id -> bytes of the blocks' arguments alive as the post part's forward begins
        that nothing saved: the model's code holds them (EoMT's attention mask of its last layer,
        a local of its forward to its return). ``post_fwd_bytes`` counts them while they live; a
        checkpoint holding them is counted in the blocks' retained bytes."""
        self.post_fwd_apart_bytes = 0
        """``post_fwd_bytes`` without the storages of ``post_code_held`` while they live."""
        self._post_apart: tuple[int, ...] = ()
        self._post_model_apart: int | None = None
        self.post_fwd_block_bytes: list[int] = [0] * len(block_names)
        """What each block saved that is still live when the post part's forward begins: the
        ``post_fwd_bytes`` window leaves it out as the block's to count; a block no backward runs
        counts nothing (`unreached_post_bytes`)."""
        self.pre_fwd_bytes = 0
        """Peak of the pre part's forward (from ``fwd_begin`` to the first block's start) less the
        model state."""
        self._pre_forward_open = False
        self.pre_bwd_temp_bytes = 0
        """Peak of the pre part's backward (from the gradient of the first block's chained input to
        the backward's end: a vision model's stem) less the model state, the gradients live when it
        starts and its own saved bytes (0: it ran none)."""
        self._open: str | None = None  # the segment whose backward window is open
        self._opt_start_bytes = 0
        self.opt_start_held_bytes = 0
        """What the step leaves live on the model when the optimizer steps, beyond the model state:
        activations and temporaries its code keeps (a recurrent layer's state as an attribute)."""
        self._labels: list[str] = []
        self._offset = 0

    def __call__(self, event: Boundary) -> None:
        if event.kind == "fwd_begin":  # the pre part's forward, to the first block's
            self.tracker.open_window(list(STATE_LABELS))
            self._pre_forward_open = True
        elif event.kind == "fwd_start" and event.index == 0 and self._pre_forward_open:
            self.pre_fwd_bytes = self.tracker.close_window()
            self._pre_forward_open = False
        if event.kind == "fwd_start" and self._between_open:  # the code between the block before and this one
            # its peak above what is live now, as this block starts: what it made and still holds
            # (the block's inputs) and what it freed (a graph no backward needed) are live here or not
            still = self.tracker.apart_keys()
            apart = self.tracker.apart_peak() + self._between_open_bytes
            peak = self.tracker.close_window() + self._between_open_bytes
            self.between_fwd_peak_bytes[event.index] = max(0, peak - self.tracker.live_bytes)
            others = self.tracker.live_bytes - sum(self.tracker.bytes_of_key(key) for key in still)
            self.between_apart[event.index] = (max(0, apart - others), frozenset(
                sid for key, sid in self._between_apart.items() if key not in still))
            self._between_open = False
        if event.kind == "fwd_start":
            self.saved_live_at_fwd_start[event.index] = self._saved_live(event.index)
            self.pre_saved_live_at_fwd_start[event.index] = self.tracker.live_by_label.get(ACT_PREFIX + PRE, 0)
            self.block_fwd_start_bytes[event.index] = self.tracker.live_bytes
            self.block_fwd_start_temporaries[event.index] = self.tracker.live_by_label.get("temporaries", 0)
            self.tracker.open_window(offset_bytes=self.tracker.live_bytes)
        elif event.kind == "fwd_end":
            own = self.accountant.segment_bytes(self.names[event.index])
            self.block_fwd_temp_bytes[event.index] = self.tracker.close_window() - own
            if event.index == len(self.names) - 1:  # the post part's forward: final norm, head, loss
                self.post_fwd_block_bytes = [self.tracker.live_by_label.get(ACT_PREFIX + n, 0) for n in self.names]
                # what the pre part saved stays in the window, less what the backward finds of it
                # (`pre_saved_live_at_backward`, at its close): a graph of its that no backward
                # needs counts while it lives (Chameleon's VQ tokenizer, to the forward's end)
                labels = [*STATE_LABELS, *(ACT_PREFIX + s for s in self.order[: self.order.index(POST)] if s != PRE)]
                held = {key: sid for key, sid in self.post_arguments().items()
                        if self.tracker.label_of_key(key) == "temporaries"}
                self.post_code_held = {sid: self.tracker.bytes_of_key(key) for key, sid in held.items()}
                self._post_apart = tuple(held)
                self.tracker.open_window(labels, apart=self._post_apart)
                self._post_labels, self._post_model_peak, self._post_model_apart = labels, None, None
                self._post_forward_open = True
            else:
                self._between_open_bytes = self.tracker.live_bytes
                # the blocks' arguments alive now, set apart: a mask the code frees in it
                # (`BlockProfile.between_fwd_apart_bytes`)
                arguments = self.post_arguments()
                self.tracker.open_window(offset_bytes=self.tracker.live_bytes, apart=arguments)
                opened = self.tracker.apart_keys()
                self._between_apart = {key: sid for key, sid in arguments.items() if key in opened}
                self._between_open = True
        elif event.kind == "model_end" and self._post_forward_open and self._post_model_peak is None:
            # the head's part of the post forward ends as the model returns; the loss's goes on
            # what is set apart goes on only while it lives: a key freed by now may name a storage
            # the loss made (the allocator hands a freed storage's address on), not to set apart
            self._post_model_apart = self.tracker.apart_peak()
            self._post_apart = tuple(self.tracker.apart_keys())
            self._post_model_peak = self.tracker.close_window()
            self.tracker.open_window(self._post_labels, apart=self._post_apart)
        elif event.kind == "bwd_begin":
            self.pre_saved_live_at_backward = self.tracker.live_by_label.get(ACT_PREFIX + PRE, 0)
            self.saved_dead_at_backward = [self._saved_dead(name) for name in self.names]
            if self._between_open:  # no block followed (blocks that did not run): nothing to count
                self.tracker.close_window()
                self._between_open = False
            if self._post_forward_open:
                rest_apart = self.tracker.apart_peak()
                rest = self.tracker.close_window()
                model = rest if self._post_model_peak is None else self._post_model_peak
                model_apart = rest_apart if self._post_model_apart is None else self._post_model_apart
                self.post_fwd_bytes = max(model, rest) - self.pre_saved_live_at_backward
                self.post_fwd_apart_bytes = max(model_apart, rest_apart) - self.pre_saved_live_at_backward
                self.post_model_fwd_bytes = model - self.pre_saved_live_at_backward
                if self._post_model_peak is not None:
                    self.post_loss_fwd_bytes = rest - self.pre_saved_live_at_backward
                self._post_forward_open = False
            self._start(POST)
        elif event.kind == "head_bwd_end" and self._open == POST:
            self.post_head_temp_bytes = self.tracker.close_window()
            self.tracker.open_window(self._labels, offset_bytes=self._offset)
        elif event.kind == "bwd_start" and self._open != self.names[event.index]:  # not begun on a read
            self._close()
            self._start(self.names[event.index])
        elif event.kind == "bwd_end" and self._open == self.names[event.index]:
            self._close()
            # the code before this block runs its backward next: the pre part's after block 0's
            self._start(between_name(event.index) if event.index else PRE)
        elif event.kind == "bwd_done":
            self._close()
        elif event.kind == "opt_start":
            self._opt_start_bytes = self.tracker.live_bytes
            self.opt_start_held_bytes = self.tracker.live_in(("activations", "temporaries"))
            self.tracker.open_window()
        elif event.kind == "opt_end":
            self.optimizer_temp_bytes = self.tracker.close_window() - self._opt_start_bytes

    def note_read(self, segment: str) -> None:
        """A tensor ``segment`` saved is read by the backward (`SavedAccountant.on_unpack`). The
        last block, read while the head's backward is still measured, begins its backward here:
        the gradient of what it hands on comes later (a two-stream layer whose second stream the
        loss takes: that stream's backward ran first and freed part of its saved tensors before
        the window opened, and recomputing the layer measured 1.5 % above its prediction). An
        earlier block read first is left to its own start: a stack whose last layer's output
        reaches no loss but its keys and values do (DiffusionGemma's encoder) has no backward
        window of its own, as before."""
        index = self._index_of.get(segment)  # called at every read of a saved tensor
        if index is None:
            return
        if self._open == POST and index == len(self.names) - 1 and index not in self.backward_blocks:
            self._close()
            self._start(segment)
        if segment != self._open:
            return
        if self.block_first_read_temp_bytes[index] is None:
            self.block_first_read_temp_bytes[index] = self._beside_replay(segment)

    def _saved_dead(self, segment: str) -> int:
        """What the accountant counts as ``segment``'s saved bytes that is no longer live now."""
        live = self.tracker.live_by_label.get(ACT_PREFIX + segment, 0)
        return max(0, self.accountant.segment_bytes(segment) - live)

    def _beside_replay(self, segment: str) -> int:
        """The open window's value now, with what it excludes as the block's saved bytes that is
        no longer live added back (`saved_dead_at_backward`): a replay adds the block's saved
        bytes to its forward's temporaries, measured without them too, so beside a replay they
        were left out twice."""
        return self.tracker.window_value() + self._saved_dead(segment)

    def replay_start_bytes(self, index: int) -> int:
        """What the block's backward window holds when a replay of it would begin: at the first
        read of its saved tensors, at the window's start where none was read (`_beside_replay`)."""
        first = self.block_first_read_temp_bytes[index]
        return self.block_bwd_start_temp_bytes[index] if first is None else first

    def _saved_live(self, index: int) -> dict[int, int]:
        """The saved bytes of each block before ``index`` live now (those with none left out)."""
        live = self.tracker.live_by_label
        return {i: n for i in range(index) if (n := live.get(ACT_PREFIX + self.names[i], 0))}

    def unreached_live_bytes(self, index: int) -> int:
        """What the blocks before ``index`` that no backward runs saved and was live when its
        forward began: their graphs live as long as the model's code holds their outputs (a
        tokenizer stack whose output, made into integer codes, stays in a variable to the
        forward's end), and no plan changes them (such blocks are kept,
        `remat.measure.types.NO_BACKWARD`), and what the pre part saved and the backward did not
        keep (`pre_saved_dead_bytes`). Known once the step's backward ran (``backward_blocks``)."""
        unreached = sum(n for i, n in self.saved_live_at_fwd_start[index].items() if i not in self.backward_blocks)
        return unreached + self._pre_dead_then(index)

    def _pre_dead_then(self, index: int) -> int:
        """Of what the pre part saved, the bytes live when block ``index`` began that no backward kept."""
        if self.pre_saved_live_at_backward is None:
            return 0
        return max(0, self.pre_saved_live_at_fwd_start[index] - self.pre_saved_live_at_backward)

    def pre_saved_dead_bytes(self) -> int:
        """What the pre part saved and freed before the backward began, of what was live as the
        first block started: its graphs off the loss path, gone with the forward; counted beside
        the blocks' forwards (`unreached_live_bytes`), not through the backward."""
        return self._pre_dead_then(0)

    def unreached_post_bytes(self) -> int:
        """What the blocks no backward runs saved and the step still holds through the post part's
        forward: their graphs live as long as their outputs, which the model's output may hold to
        the loss (LLaVA's vision tower output, every layer's hidden state in it)."""
        return sum(nbytes for i, nbytes in enumerate(self.post_fwd_block_bytes) if i not in self.backward_blocks)

    def note_outside_grad(self, nbytes: int) -> None:
        """A parameter outside every block got its ``.grad``: counted for the block whose backward
        window is open (none: the code between blocks, or the pre and post parts, have their own)."""
        if self._open in self.names:
            self.outside_grad_bytes[self.names.index(self._open)] += nbytes

    def _start(self, segment: str) -> None:
        """Exclude the state and what earlier segments still hold (live), and two constants: the
        window's own segment's full saved bytes (those it frees during its backward stay counted)
        and the gradients live when it starts (the ones its backward accumulates are temporaries)."""
        self._open = segment
        earlier = self.order[: self.order.index(segment)]
        labels = [*STATE_LABELS, *(ACT_PREFIX + s for s in earlier)]
        grads_live = self.tracker.live_by_label.get("gradients", 0)
        self._grads_at_open = grads_live
        if segment == PRE:
            self.grads_at_pre_bytes = grads_live
        if segment in self.names:
            index = self.names.index(segment)
            self.backward_blocks.add(index)
            if self.first_backward_block is None or index < self.first_backward_block:
                self.first_backward_block, self.grads_at_first_block_bytes = index, grads_live
        watch = ACT_PREFIX + segment if segment in self.names else None
        own = self.accountant.segment_bytes(segment) - (self.pre_saved_dead_bytes() if segment == PRE else 0)
        self._labels, self._offset = labels, own + grads_live
        pinned = set()
        if segment in self.names:  # the inputs it saved itself: its checkpoint holds them to the end
            pinned = {key for key in self.inputs_of(self.names.index(segment)) if key is not None
                      and self.tracker.label_of_key(key) == ACT_PREFIX + segment}
        self._pinned = bool(pinned)
        self.tracker.open_window(labels, offset_bytes=self._offset, watch_label=watch, pinned=pinned)
        if segment in self.names:
            self.block_bwd_start_temp_bytes[self.names.index(segment)] = self._beside_replay(segment)

    def _close(self) -> None:
        if self._open is None:
            return
        pinned_peak = self.tracker.pinned_peak() if self._pinned else None
        peak, segment = self.tracker.close_window(), self._open
        self._open = None
        if segment == POST:
            self.post_temp_bytes = max(peak, self.post_head_temp_bytes or peak)
            self.post_rest_temp_bytes = peak
        elif segment == PRE:
            self.pre_bwd_temp_bytes = peak
        elif segment in self.names:
            index = self.names.index(segment)
            self.block_temp_bytes[index] = peak
            self.block_held_input_temp_bytes[index] = pinned_peak
            self.block_free_order[index] = tuple(
                (self.storage_id(key, segment), nbytes) for key, nbytes in self.tracker.window_freed())
        else:
            index = int(segment.split(":", 1)[1])
            self.between_temp_bytes[index] = peak
            self.between_grad_bytes[index] = self.tracker.live_by_label.get("gradients", 0) - self._grads_at_open
