"""The head part in a plan: what each head strategy costs, from the profile's head measurements.

The post part of the step (after the last block: final norm, projection, loss) peaks, above
the model state, the pre part's and every block's retained bytes, at (`remat.measure.types
.HeadProfile`, with ``rest = fixed_post_saved_bytes - keep.saved_bytes``)::

    need(s) = max( rest + s.fwd_peak_bytes,                                    head forward
                   post_head_bytes + s.bwd_peak_bytes - keep.bwd_peak_bytes,   head backward
                   post_rest_bytes )                                           the rest's backward

The head's backward is anchored at what the step measured for the model's own head
(``post_head_bytes``), so that ``keep`` prices the step exactly as measured and other
strategies by their measured difference (the tests check that the anchor equals ``rest +
keep.bwd_peak_bytes``). `priced_profile` writes ``need(s)`` into the profile's post-part
fields, so that `remat.plan.predict` and the optimal search price the post part by the head
strategy without knowing about it. A head strategy's extra time is its measured forward and
backward less the keep head's (timed side by side); its extra FLOPs are one more projection
(``2 x tokens x hidden x vocab``, `remat.memory.head.projection_flops`): ``recompute`` replays
the projection and loss, ``chunked`` projects each chunk again in the backward.

``recompute`` keeps only the hidden states, but the head runs last in the forward and first in
the backward, so nothing else happens while it holds less: its peaks are keep's, and it is
offered to the search only to be dominated (`head_choices`).
"""

from __future__ import annotations

import dataclasses

from remat.head.names import check_head_name
from remat.measure.types import HeadOption, Profile
from remat.memory.head import projection_flops

__all__ = ["head_choices", "head_need_bytes", "priced_profile", "head_extra_ms", "head_extra_flops", "check_head"]

KEEP = "keep"


def check_head(profile: Profile, head: str) -> None:
    """Raise ValueError when ``head`` cannot be priced on ``profile``."""
    check_head_name(head)
    if head == KEEP:
        return
    if profile.head is None:
        raise ValueError(
            f"head strategy {head!r} needs a head part, and this profile has none ({profile.head_note or 'not measured'}); "
            "plan the head as 'keep'."
        )
    profile.head.option(head)


def _option(profile: Profile, head: str) -> HeadOption:
    check_head(profile, head)
    return profile.head.option(head)


def head_need_bytes(profile: Profile, head: str = KEEP, forward_held: int = 0) -> int:
    """``need(head)``: the post part's peak above the state, pre part and blocks (module docstring);
    ``forward_held``: bytes the code holds through the head's forward beside them (a plan's
    recomputed blocks' outputs kept to the loss, `remat.plan.predict.end_held_bytes`)."""
    if profile.head is None:
        check_head(profile, head)
        return profile.fixed_post_saved_bytes + profile.fixed_post_bwd_temp_bytes + forward_held
    part, option, keep = profile.head, _option(profile, head), profile.head.option(KEEP)
    rest = profile.fixed_post_saved_bytes - keep.saved_bytes
    backward = part.post_head_bytes + option.bwd_peak_bytes - keep.bwd_peak_bytes
    # what the step holds beside the head (unreached blocks' graphs), and what this plan adds
    forward = rest + option.fwd_peak_bytes + profile.fixed_post_fwd_held_bytes + forward_held
    return max(forward, backward, part.post_rest_bytes)


def priced_profile(profile: Profile, head: str = KEEP, forward_held: int = 0) -> Profile:
    """``profile`` whose post-part bytes are those of ``head``: the post part holds the rest's
    saved bytes and what the head holds (``held_bytes``), and peaks at ``need(head)`` (with
    ``forward_held`` in the head's forward). The head part is folded in (``head=None``): pricing
    the result again with ``keep`` changes nothing."""
    if profile.head is None:
        check_head(profile, head)
        return profile
    option, keep = _option(profile, head), profile.head.option(KEEP)
    held = profile.fixed_post_saved_bytes - keep.saved_bytes + option.held_bytes
    return dataclasses.replace(profile, fixed_post_saved_bytes=held,
                               fixed_post_bwd_temp_bytes=head_need_bytes(profile, head, forward_held) - held,
                               head=None, head_note=f"the post part is priced with the head {head}")


def head_extra_ms(profile: Profile, head: str = KEEP) -> float:
    """Measured forward + backward of ``head`` less the keep head's."""
    if head == KEEP:
        return 0.0
    option, keep = _option(profile, head), profile.head.option(KEEP)
    extra = (option.fwd_ms + option.bwd_ms) - (keep.fwd_ms + keep.bwd_ms)
    # recompute runs keep's forward and backward and a replay: never faster, whatever the noise
    return max(extra, 0.0) if head == "recompute" else extra


def head_extra_flops(profile: Profile, head: str = KEEP) -> int:
    """One more projection for ``recompute`` and ``chunked``, none for ``keep``."""
    if head == KEEP:
        return 0
    _option(profile, head)
    part = profile.head
    return projection_flops(part.num_tokens, part.hidden_size, part.vocab_size)


def head_choices(profile: Profile) -> tuple[str, ...]:
    """The head strategies worth searching: every measured one that no other beats or ties in
    both ``need`` and extra time (of equal ones, the first measured: keep first);
    ``("keep",)`` without a head part."""
    if profile.head is None:
        return (KEEP,)
    costs = [(head_need_bytes(profile, o.strategy), head_extra_ms(profile, o.strategy)) for o in profile.head.options]

    def beaten(i: int) -> bool:
        return any(other[0] <= costs[i][0] and other[1] <= costs[i][1] and (other != costs[i] or j < i)
                   for j, other in enumerate(costs) if j != i)

    return tuple(o.strategy for i, o in enumerate(profile.head.options) if not beaten(i))
