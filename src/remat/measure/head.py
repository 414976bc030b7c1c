"""Measure the head part: every head strategy on the real head, with the real hidden states.

`capture_head` runs one more forward of the model (no gradients) with the projection
recording its input, and checks that the model's loss is bit for bit the token cross-entropy
of the projection's output (`remat.head.loss.reference_loss`; plus the bias the model adds
after it, `remat.head.site.HeadSite.logit_bias`): a head that transforms its logits or
computes another loss has no head part. `measure_head` then runs each strategy
(``keep``, ``recompute``, ``chunked:<tokens>`` for each chunk size) alone on those hidden
states, under the live-storage tracker, forward then backward, and times them in interleaved
rounds. The backward treats the projection's gradients as the step does: accumulated into
``.grad`` at once for an untied weight (`torch.Tensor.backward`), held until the embedding's
backward for a tied one (`torch.autograd.grad`: no accumulation), so the bytes are the step's.
A strategy whose run raises is left out, with the reason (`remat.measure.probes.Attempts`).

`HeadBoundary` marks, during the profile's accounting step, where the head's backward ends
(the gradient of the projection's input is ready), so the post part's backward window splits
into the head's and the rest's (`remat.measure.types.HeadProfile`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat._batch import call_arguments, call_model, compute_loss, model_device
from remat.head.loss import reference_loss
from remat.head.site import HeadSite, bind_call, capture_projection, kind_named
from remat.head.strategies import HeadCall, HeadChunked, HeadKeep, HeadRecompute, HeadStrategy
from remat.measure.boundaries import in_backward
from remat.measure.faults import FaultCount
from remat.measure.probes import Attempts
from remat.measure.storage import storage_key, storage_keys, storage_nbytes
from remat.measure.timing import Clock
from remat.measure.tracker import LiveTracker
from remat.measure.types import HeadOption, HeadProfile

__all__ = ["HeadBoundary", "HeadCapture", "capture_head", "measure_head", "chunk_candidates", "logits_returned",
           "MIN_CHUNK_TOKENS"]

MIN_CHUNK_TOKENS = 64
"""The smallest chunk offered by default. Each chunk's backward reads and writes the whole weight
gradient (``V x H``) for ``6 c V H`` FLOPs of its three products: ``3 c / p`` FLOPs per byte of
that traffic, 48 at 64 fp32 rows, about the FLOP-to-bandwidth balance of CPUs and GPUs; below it
the chunks turn memory-bound while the bytes they save are already small against the weight
gradient every chunk size holds. `remat.profile` takes smaller sizes when named (``head_chunks``)."""


def chunk_candidates(num_tokens: int) -> tuple[int, ...]:
    """Default chunk sizes: the largest power of two under half the tokens, then a quarter of
    the previous, down to `MIN_CHUNK_TOKENS` (four at most: 1024, 256, 64 for 2048 tokens)."""
    out: list[int] = []
    size = 1 << max(0, (num_tokens // 2).bit_length() - 1)
    while size >= MIN_CHUNK_TOKENS and len(out) < 4:
        out.append(size)
        size //= 4
    return tuple(out)


class HeadBoundary:
    """Context manager: ``emit("head_bwd_end")`` when the gradient of the projection's input
    is ready, in the backward of each step run inside it."""

    def __init__(self, projection: nn.Module, emit: Callable[[str], None]) -> None:
        self.projection = projection
        self.emit = emit
        self._handle: Any = None

    def __enter__(self) -> HeadBoundary:
        self._handle = self.projection.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()

    def _hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        hidden = args[0] if args else None
        if not in_backward() and isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(lambda grad: self.emit("head_bwd_end"))


@dataclass(kw_only=True, frozen=True)
class HeadCapture:
    """The hidden states of one forward and the head call they belong to."""

    hidden: torch.Tensor
    """The projection's input (detached)."""
    call: HeadCall
    """The model, projection, labels and loss keywords."""


def capture_head(model: nn.Module, batch: Any, site: HeadSite) -> tuple[HeadCapture | None, str]:
    """``(capture, "")``, or ``(None, why the head cannot be planned)`` on this batch."""
    kind = kind_named(site.kind)
    projection = model.get_submodule(site.projection)
    bound = bind_call(model, *call_arguments(batch)).arguments
    if bound.get(site.labels_arg) is None:
        return None, f"the batch passes no {site.labels_arg!r}, so the model computes no loss of its own"
    rng = _rng_state(model)
    with torch.no_grad(), capture_projection(projection, run=True) as captured:
        model_loss = compute_loss(call_model(model, batch), batch).detach()
    inputs = kind.loss_inputs(bound)
    if captured.calls != 1:
        return None, f"the forward called the output projection {captured.calls} times"
    rows = captured.output.numel() // max(captured.output.size(-1), 1)
    if isinstance(inputs.labels, torch.Tensor) and rows != inputs.labels.numel():
        return None, (f"the output projection makes {rows} rows of logits for {inputs.labels.numel()} labels "
                      "(several streams through one projection, ProphetNet's n-grams; or tokens a wrapper adds "
                      "before the labels it was given, peft's prompt tuning's virtual tokens): the loss is not one "
                      "row's cross-entropy per label given, and the head stays in the fixed part")
    if model_device(model).type != "meta":
        ours = reference_loss(_biased(model, site, captured.output), inputs, site.loss).detach()
        if not torch.equal(ours, model_loss):
            how = "next-token, labels shifted" if site.loss.shift else "the labels as given"
            how += ", logits upcast to fp32" if site.loss.upcast else ", logits as they are"
            return None, (f"the model's loss ({float(model_loss):.9g}) is not the token cross-entropy of its "
                          f"projection's output ({float(ours):.9g}) that remat's head computes ({how}): the model "
                          "computes it another way (an encoder-decoder's unshifted labels, an auxiliary term, a "
                          "scaling), so the head stays in the fixed part, measured as it is")
    why = logits_returned(model, batch, site, kind, projection, rng=rng, hidden=captured.hidden)
    if why:
        return None, why
    call = HeadCall(kind=kind, site=site, model=model, projection=projection, inputs=inputs,
                    extra=kind.loss_extra(bound))
    return HeadCapture(hidden=captured.hidden.detach(), call=call), ""


def logits_returned(model: nn.Module, batch: Any, site: HeadSite, kind: Any, projection: nn.Module, *,
                    rng: tuple | None = None, hidden: torch.Tensor | None = None) -> str:
    """'' when a call without labels returns the projection's own output as its logits, as a
    planned head needs (`remat.apply.head`: it computes the loss from the projection's input and
    never makes those logits); else why not. A model that rescales its logits by a factor that
    leaves them equal (Granite's ``logits_scaling`` of 1.0 divides anyway) returns a new tensor:
    its loss is the projection's, but a planned head could not stand in for its logits.
    ``hidden``: what the projection received in the call with labels, from the random state
    ``rng`` (`_rng_state`): the call without them, from the same state, must give it the very
    same (an encoder-decoder's decoder input, made of the labels by the model or by the head kind)."""
    bound = bind_call(model, *call_arguments(batch))
    kind.without_labels(model, bound.arguments)
    if rng is not None:
        _set_rng_state(rng)
    with torch.no_grad(), capture_projection(projection, run=True) as captured:
        output = model(*bound.args, **bound.kwargs)
    if hidden is not None and captured.calls == 1 and not (
            captured.hidden.shape == hidden.shape and torch.equal(captured.hidden, hidden)):
        return (f"a call without {site.labels_arg!r} gives the output projection other hidden states than the call "
                "with them (the model makes something of its labels that remat's call does not)")
    logits = kind.logits_of(output)
    if captured.calls == 1 and site.logit_bias and isinstance(logits, torch.Tensor):
        if logits.shape == captured.output.shape and (
                logits.device.type == "meta" or torch.equal(logits, _biased(model, site, captured.output))):
            return ""
        return (f"a call without {site.labels_arg!r} does not return the output projection's output plus "
                f"{site.logit_bias} as its logits (the model transforms them otherwise)")
    if captured.calls == 1 and logits is captured.output:
        return ""
    return (f"a call without {site.labels_arg!r} does not return the output projection's own output as its logits "
            "(the model transforms them after the projection, even if by a factor that leaves them equal)")


def _biased(model: nn.Module, site: HeadSite, output: torch.Tensor) -> torch.Tensor:
    """The projection's ``output`` as the model's logits: plus the site's `logit_bias`, if any."""
    return output + model.get_parameter(site.logit_bias) if site.logit_bias else output


def _rng_state(model: nn.Module) -> tuple:
    """The CPU's random state and the model's accelerator's, to run a second call from (dropout)."""
    device = model_device(model)
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), device, cuda


def _set_rng_state(state: tuple) -> None:
    cpu, device, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def measure_head(capture: HeadCapture, *, post_head_bytes: int, post_rest_bytes: int,
                 chunks: Sequence[int], repeats: int, touch_ms_per_byte: float = 0.0) -> HeadProfile:
    """Every strategy's bytes and times (`remat.measure.types.HeadProfile`); ``post_*_bytes``
    come from the accounting step's split post window; ``touch_ms_per_byte``: what a page fault
    costs (`remat.measure.faults`), taken out of the times."""
    hidden, call = capture.hidden, capture.call
    attempts = Attempts()  # a strategy whose run raises is left out, with the reason; keep's error is raised
    keep, *others = [HeadKeep(), HeadRecompute(), *(HeadChunked(chunk_tokens=c) for c in chunks)]
    sizes = {keep.name: _option_bytes(keep, capture)}
    sizes |= {s.name: attempts.run(s.name, _option_bytes, s, capture) for s in others}
    strategies = [keep, *(s for s in others if sizes[s.name] is not None)]
    times = _option_times(strategies, capture, repeats, touch_ms_per_byte)
    options = tuple(HeadOption(strategy=s.name, **sizes[s.name], **t) for s, t in zip(strategies, times))
    weight = call.projection.weight
    return HeadProfile(
        projection=call.site.projection, kind=call.site.kind, labels_arg=call.site.labels_arg, tied=call.site.tied,
        num_tokens=hidden.numel() // hidden.size(-1), hidden_size=weight.size(1), vocab_size=weight.size(0),
        dtype=str(hidden.dtype).removeprefix("torch."), upcast=call.site.loss.upcast,
        post_head_bytes=post_head_bytes, post_rest_bytes=post_rest_bytes, options=options,
        unavailable=tuple(attempts.failed().items()),
    )


def _params(call: HeadCall) -> list[torch.Tensor]:
    return [p for p in (call.projection.weight, call.bias) if p is not None and p.requires_grad]


def _backward(loss: torch.Tensor, hidden: torch.Tensor, call: HeadCall) -> Any:
    """The head's backward as the step runs it; returns what must stay alive until measured."""
    params = _params(call)
    if call.site.tied:  # the weight's gradient waits for the embedding's: nothing accumulates
        return torch.autograd.grad(loss, [hidden, *params])
    stashed = [p.grad for p in params]
    for p in params:
        p.grad = None
    loss.backward(inputs=[hidden, *params])
    grads = [hidden.grad, *(p.grad for p in params)]
    for p, grad in zip(params, stashed):
        p.grad = grad
    return grads


def _option_bytes(strategy: HeadStrategy, capture: HeadCapture) -> dict[str, int]:
    """Saved, held and peak bytes of one strategy's forward and backward, the hidden states counted."""
    hidden = capture.hidden.detach().requires_grad_()
    projection = capture.call.projection  # its parameters are model state, frozen or not
    excluded = storage_keys([t for t in (projection.weight, capture.call.bias, capture.call.inputs.labels) if t is not None])
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key is not None and key not in excluded:
            saved[key] = storage_nbytes(t)
        return t

    with LiveTracker(model_device(capture.call.model)) as tracker:
        tracker.register([hidden], "temporaries")
        tracker.open_window()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = strategy.loss(capture.call, hidden)
        fwd_peak, held = tracker.close_window(), tracker.live_bytes
        tracker.open_window()
        grads = _backward(loss, hidden, capture.call)
        bwd_peak = tracker.close_window()
        del grads, loss
    # hidden states that no backward reads (a frozen projection's keeps only its weight) are
    # freed in the step once the head's forward returns; here the capture holds them throughout
    unread = 0 if storage_key(hidden) in saved else storage_nbytes(hidden)
    return {"saved_bytes": sum(saved.values()), "held_bytes": held - unread, "fwd_peak_bytes": fwd_peak,
            "bwd_peak_bytes": bwd_peak - unread}


def _option_times(strategies: list[HeadStrategy], capture: HeadCapture, repeats: int,
                  touch_ms_per_byte: float) -> list[dict[str, float]]:
    """Median forward and backward ms of each strategy over ``repeats`` rounds (one untimed
    first), the order rotated every round so that a drift of the machine hits all alike. The
    time of the page faults a run takes is taken out: a head whose buffers the host allocator
    returns to the kernel faults them in again every run, and the planner prices fresh memory
    for the whole step from its peak (`remat.plan.predict.fresh_memory`), not per part."""
    device = model_device(capture.call.model)
    if device.type == "meta":
        return [{"fwd_ms": 0.0, "bwd_ms": 0.0} for _ in strategies]
    clock = Clock(device)
    fwd: list[list[float]] = [[] for _ in strategies]
    bwd: list[list[float]] = [[] for _ in strategies]
    for r in range(repeats + 1):
        order = list(range(len(strategies)))
        order = order[r % len(order):] + order[: r % len(order)]
        for i in order:
            f, b = _timed(strategies[i], capture, clock, touch_ms_per_byte)
            if r:
                fwd[i].append(f)
                bwd[i].append(b)
    return [{"fwd_ms": statistics.median(f), "bwd_ms": statistics.median(b)} for f, b in zip(fwd, bwd)]


def _timed(strategy: HeadStrategy, capture: HeadCapture, clock: Clock, touch_ms_per_byte: float) -> tuple[float, float]:
    """(forward ms, backward ms) of one run, less the time of the page faults each took."""
    hidden = capture.hidden.detach().requires_grad_()
    clock.sync()
    with FaultCount(enabled=not clock.cuda) as fwd_faults:
        start = clock.mark()
        loss = strategy.loss(capture.call, hidden)
        middle = clock.mark()
    with FaultCount(enabled=not clock.cuda) as bwd_faults:
        grads = _backward(loss, hidden, capture.call)
        end = clock.mark()
    clock.sync()
    del grads
    fwd_ms = clock.elapsed_ms(start, middle) - (fwd_faults.bytes or 0) * touch_ms_per_byte
    bwd_ms = clock.elapsed_ms(middle, end) - (bwd_faults.bytes or 0) * touch_ms_per_byte
    return max(fwd_ms, 0.0), max(bwd_ms, 0.0)
