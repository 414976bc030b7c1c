"""The four strategies estimate compares, chosen per pipeline stage.

- ``none``: every layer keeps what autograd saves;
- ``full``: every layer keeps only its input and replays its forward in backward;
- ``selective``: Megatron-LM's selective recomputation (Korthikanti et al. 2022, section 4.3):
  every layer replays its attention core and keeps the rest; a layer without one (an MLP, a
  convolution) keeps everything;
- ``optimal``: per layer the fastest of ``none``, ``selective``, ``full`` and, where the
  device has a host link, ``offload``, mixed so that the stage fits (`remat.estimate.optimal`).
  When nothing fits, the mix with the lowest peak is shown: every layer on the option that
  retains the least.

What a layer holds and spends under each is `remat.estimate.layers.LAYER_STRATEGIES`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from remat.estimate.comms import Network, all_reduce_s
from remat.estimate.layers import LayerCost, LayerOnGpu, layer_cost
from remat.estimate.optimal import cheapest_mix
from remat.estimate.parallel import Parallelism
from remat.estimate.stage import Rates, Stage, extra_s

STRATEGY_NAMES = ("none", "full", "selective", "optimal")
UNIFORM = ("none", "selective", "full")


@dataclass(kw_only=True, frozen=True)
class Choice:
    """The strategies one stage's layers run."""

    costs: tuple[LayerCost, ...]
    """Per layer, in forward order."""
    label: str
    """What ran, e.g. ``selective`` or ``optimal: 60 none, 20 full``; for ``optimal`` with
    nothing fitting, ``lowest peak: ...``."""


def option_seconds(layer: LayerOnGpu, cost: LayerCost, rates: Rates, par: Parallelism, net: Network) -> float:
    """What ``cost`` adds to one micro-batch of ``layer``: its replay or transfer, and a replayed
    forward's two tensor-parallel all-reduces."""
    replayed = 2 * all_reduce_s(layer.hidden_bytes, par.tensor, net.bandwidth(par.tensor, 1)) if cost.replays_forward else 0.0
    return extra_s(cost, rates) + replayed


def choose(stage: Stage, strategy: str, budget_bytes: float, *, rates: Rates, par: Parallelism, net: Network) -> Choice:
    """The layers of ``stage`` under ``strategy`` (module docstring)."""
    if strategy not in STRATEGY_NAMES:
        raise ValueError(f"unknown strategy {strategy!r}; allowed: {', '.join(STRATEGY_NAMES)}.")
    if strategy != "optimal":
        return Choice(costs=tuple(layer_cost(layer, strategy) for layer in stage.layers), label=strategy)
    names = UNIFORM + (("offload",) if rates.host_link_bytes_per_s else ())
    options = [[layer_cost(layer, n) for n in names] for layer in stage.layers]
    seconds = [[option_seconds(layer, c, rates, par, net) for c in opts] for layer, opts in zip(stage.layers, options)]
    mix = cheapest_mix(stage, options, seconds, budget_bytes)
    if mix is not None:
        return Choice(costs=mix, label="optimal: " + _counts(mix, options, names))
    lowest = tuple(min(opts, key=lambda c: c.retained_bytes) for opts in options)
    return Choice(costs=lowest, label="lowest peak: " + _counts(lowest, options, names))


def _counts(mix: tuple[LayerCost, ...], options: list[list[LayerCost]], names: tuple[str, ...]) -> str:
    """``"60 none, 20 full"``: how many layers run each strategy (an option equal to an earlier
    one is named as that one: ``selective`` of a layer without attention core is ``none``)."""
    counts = Counter(names[opts.index(cost)] for cost, opts in zip(mix, options))
    return ", ".join(f"{counts[n]} {n}" for n in names if counts[n])


__all__ = ["Choice", "STRATEGY_NAMES", "choose", "option_seconds"]
