"""Run a planned head in place: the model's forward computes its loss by the plan's head strategy.

`HeadRuntime.install` sets the model's ``forward`` instance attribute (its class, modules and
``state_dict`` stay as they are; tied weights stay tied: the strategies read the projection's
own parameters); `uninstall` restores exactly what was there. A call that carries labels, with
gradients enabled, runs the model's own forward without the labels while the projection only
records the hidden states it receives (`remat.head.site.capture_projection`: no logits are
made), then computes the loss from them by the strategy (`remat.head.strategies`) and returns
the model's output with that loss, and with ``logits=None`` for Hugging Face models: under
``recompute`` and ``chunked`` the full logits are never kept (as Hugging Face's own Liger
integration returns no logits). Calls without labels, or under ``torch.no_grad()``, run the
model's forward untouched.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat._batch import call_arguments
from remat.head.site import HeadSite, bind_call, capture_projection, find_head, kind_named
from remat.head.strategies import HeadCall, HeadStrategy, parse_head

__all__ = ["HeadRuntime", "HeadTolerance", "head_tolerance"]


class HeadRuntime:
    """The model's ``forward`` while a head strategy is applied (no work in the constructor)."""

    def __init__(self, model: nn.Module, site: HeadSite, strategy: HeadStrategy) -> None:
        self.model = model
        self.site = site
        self.kind = kind_named(site.kind)
        self.strategy = strategy
        self.projection: nn.Linear = model.get_submodule(site.projection)
        self._previous: Any = None
        self._original: Any = None
        self._signature: inspect.Signature | None = None

    def install(self) -> None:
        self._previous = self.model.__dict__.get("forward")
        self._original = self.model.forward
        self._signature = inspect.signature(self._original)
        self.model.forward = self

    def uninstall(self) -> None:
        if self.model.__dict__.get("forward") is not self:  # not installed (a failed apply_)
            return
        del self.model.__dict__["forward"]
        if self._previous is not None:
            self.model.forward = self._previous

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bound = self._signature.bind(*args, **kwargs)
        labels = bound.arguments.get(self.site.labels_arg)
        if labels is None or not torch.is_grad_enabled():
            return self._original(*args, **kwargs)
        self._check_projection()
        inputs, extra = self.kind.loss_inputs(bound.arguments), self.kind.loss_extra(bound.arguments)
        self.kind.without_labels(self.model, bound.arguments)
        width = self.projection.out_features if self.site.logit_bias else 0  # the model adds its bias to it
        with capture_projection(self.projection, run=False, width=width) as captured:
            output = self._original(*bound.args, **bound.kwargs)
        self._check(captured, output)
        self._check_no_auxiliary_loss(output)
        call = HeadCall(kind=self.kind, site=self.site, model=self.model, projection=self.projection,
                        inputs=inputs, extra=extra)
        return self.kind.output(output, self.strategy.loss(call, captured.hidden))

    def _check_projection(self) -> None:
        """The output projection must be the one the plan was applied with: replaced since
        (``resize_token_embeddings`` makes a new one), the head would watch the old one."""
        try:
            now = self.model.get_submodule(self.site.projection)
        except AttributeError:
            now = None
        if now is not self.projection:
            raise ValueError(
                f"the output projection {self.site.projection!r} of {type(self.model).__name__} was replaced after the "
                f"plan was applied (resize_token_embeddings makes a new one), so the head strategy "
                f"{self.strategy.name!r} would run the old one. Call remat.remove_(model), then profile and plan the "
                "model as it is now."
            )

    def _check_no_auxiliary_loss(self, output: Any) -> None:
        """A loss term beside the logits (a mixture-of-experts router's load balancing, asked for by
        ``output_router_logits``) that the model adds to its loss with labels: the head strategy
        computes the token cross-entropy alone, and would drop it from training."""
        items = output.items() if hasattr(output, "items") else ()
        auxiliary = [k for k, v in items if k != "loss" and "loss" in k and v is not None]
        if not auxiliary or getattr(getattr(self.model, "config", None), "router_aux_loss_coef", None) == 0:
            return
        raise ValueError(
            f"{type(self.model).__name__} returned {', '.join(auxiliary)} beside its logits: with labels it adds that "
            f"to its loss (router_aux_loss_coef * aux_loss), and the head strategy {self.strategy.name!r} computes the "
            "token cross-entropy alone, so the term would be dropped from training. The plan was made for a call "
            "without it (output_router_logits off when profiled). Profile the call you train with (its head is then "
            "planned as keep), or plan the head as keep (remat.plan(..., head='keep'))."
        )

    def _check(self, captured: Any, output: Any) -> None:
        """The forward must have called the projection once and returned its output as the
        logits (plus the site's `logit_bias`, as the empty output broadcast with it): otherwise
        the loss would not be the model's."""
        logits = self.kind.logits_of(output)
        if self.site.logit_bias:
            returned = isinstance(logits, torch.Tensor) and logits.shape == captured.output.shape
        else:
            returned = logits is captured.output
        if captured.calls != 1 or not returned:
            raise ValueError(
                f"{type(self.model).__name__} called its output projection {self.site.projection!r} "
                f"{captured.calls} time(s) and returned {'other logits' if captured.calls else 'no logits'}; "
                f"the head strategy {self.strategy.name!r} needs one projection whose output is the logits. "
                "Plan the head as keep (remat.plan(..., head='keep'))."
            )


@dataclass(kw_only=True, frozen=True)
class HeadTolerance:
    """What a plan's head strategy lets differ from the model without a plan (`remat.verify`)."""

    relative_tolerance: float
    """Normwise relative difference allowed on the loss and on each gradient (0.0: none)."""
    reason: str
    """Why, in a sentence ('' for a bit-identical head)."""


def head_tolerance(model: nn.Module, plan_head: str, batch: Any) -> HeadTolerance:
    """The tolerance of head strategy ``plan_head`` on ``model`` and ``batch``
    (`remat.head.strategies.HeadStrategy.relative_tolerance`)."""
    strategy = parse_head(plan_head)
    site, _ = find_head(model) if plan_head != "keep" else (None, "")
    if site is None:
        return HeadTolerance(relative_tolerance=0.0, reason="")
    projection = model.get_submodule(site.projection)
    labels = bind_call(model, *call_arguments(batch)).arguments.get(site.labels_arg)
    tokens = labels.numel() if isinstance(labels, torch.Tensor) else 0
    rtol = strategy.relative_tolerance(projection.weight.dtype, tokens)
    if rtol == 0.0:
        return HeadTolerance(relative_tolerance=0.0, reason="")
    reason = (f"the {plan_head} head sums the loss and the projection's gradients over tokens chunk by chunk "
              "and multiplies chunks of rows, not all rows at once: the loss and every gradient may differ in "
              f"their last bits, normwise relative difference allowed {rtol:.3g} each")
    return HeadTolerance(relative_tolerance=rtol, reason=reason)
