"""What the device check runs, at two sizes: ``full`` for one GPU, ``small`` for the CPU test.

``full`` is sized for one NVIDIA H200 (about 139 GiB, CUDA events, FlashAttention-class
kernels) within the time limit; ``small`` runs the same code on toy shapes in well under the
3 minutes the CPU check may take. Why each ``full`` shape is what it is:

- models: activations well above the model state (so budgets have room to act) and steps of
  tens of milliseconds (so CUDA-event medians are not launch latency); float32 like the rest of
  remat's tables.
- attention-core: one GPT-3 175B layer (Brown et al. 2020, table 2.1: d_model 12288, 96 heads
  of 128, 2048 tokens) in bf16, two of them. Megatron-LM's figure (Korthikanti et al. 2022:
  70 % fewer activation bytes at 2.7 % extra FLOPs) is for this layer: the core replays
  4bs²h of a layer's 24bsh² + 4bs²h forward FLOPs, s / (6h + s) = 2.7 % at h = 12288,
  s = 2048, and stores 5as²b of its sbh(34 + 5as/h) bytes, 80 of 114 at a·s/h = 16. It fits:
  `remat estimate` puts one copy's step at 29.4 GiB (27.3 GiB of it model state: 3.66 B bf16
  parameters, gradients and AdamW's two moments), and `remat.verify` holds three copies at once
  (the profiled model, the baseline and the planned copy): about 84 GiB of 139. The check
  estimates it again before it runs and skips the shape when it does not fit the device.
  d_model 4096 or 8192 at a·s/h = 16 would fit with more room, but their core is 7.7 % and
  4.0 % of the forward FLOPs: not the layer the 70 % / 2.7 % figure is about.
- host offload: SDPA attention (no a·s² scores to move) at d_model 2048, so a block's transfer
  at PCIe rates and its compute are of the same order: the overlap is what decides the cost.
- peers: the models' GPT, eager and compiled (torch.compile with one activation memory budget,
  0.5, beside plain compile: each compiled model costs tens of seconds of compilation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SIZE_NAMES = ("small", "full")
STRATEGIES = ("none", "full", "sqrt", "selective:attention-core")
BUDGET_FRACTIONS = (0.25, 0.75)
"""The optimal rows: this far from the least feasible peak to the baseline peak (two of
`remat demo`'s three)."""

FULL_SHARES = {"models": 0.23, "attention_core": 0.11, "host_offload": 0.05, "estimate": 0.07, "segments": 0.08,
               "peers": 0.46}
"""On a GPU the compiled peers cost most (tens of seconds of compilation a model). On an H200
(2026-12-04, second run, 387 s in all) the sections took 105 s, 49 s, 12 s, 15 s and 205 s with
a cold inductor cache (57 s warm): 112, 54, 22, 34 and 230 s of the 450 then; the segments'
script took 40 s with its two profiles. Of 490 s: 113, 54, 25, 34, 39 and 225 s."""
SMALL_SHARES = {"models": 0.42, "attention_core": 0.21, "host_offload": 0.05, "estimate": 0.10, "segments": 0.05,
                "peers": 0.17}
"""On the CPU nothing is compiled: profiling and verifying the four models cost most."""

SECTION_NAMES = tuple(FULL_SHARES)
"""The sections, in the order they run (`benchmarks._device.checks.sections`)."""


@dataclass(kw_only=True, frozen=True)
class CheckConfig:
    """Sizes and counts of one device check."""

    size: str
    """``small`` or ``full``."""
    repeats: int
    """Timed pairs (baseline, plan) per verified plan; timed rounds of the peers."""
    total_s: float
    """Time limit of all sections together, seconds (the process adds start-up and writing)."""
    models: dict[str, dict[str, Any]]
    """Built-in model name -> size keywords, for the models section, most telling first (a section
    stopped early keeps the first)."""
    core_sizes: dict[str, Any]
    """The built-in GPT's sizes for attention-core."""
    core_dtype: str = "bfloat16"
    """Parameters and activations of the attention-core GPT (a `torch` dtype name)."""
    offload_sizes: dict[str, Any] = field(default_factory=dict)
    """The built-in GPT's sizes for pinned host offload."""
    peers_size: str = "small"
    """Named size of the peers' workload (`benchmarks._peers.workloads`)."""
    peers_sizes: dict[str, Any] = field(default_factory=dict)
    """Size keywords that replace the named size's."""
    compile_budgets: tuple[float, ...] = ()
    """Activation memory budgets of the compiled peers beside plain compile; empty: no
    compiled part."""
    frontier_points: int = 2
    """Plans of remat's Pareto frontier measured beside the peers."""
    segment_models: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Built-in model name -> sizes for `benchmarks.segment_calls` (segments of k blocks against
    each other)."""
    segment_rounds: int = 15
    """Interleaved timed rounds of the segments section."""
    shares: dict[str, float] = field(default_factory=lambda: dict(FULL_SHARES))
    """Section name -> its weight in ``total_s`` (`benchmarks._device.sections.limit_s`)."""


_GPT_FULL = dict(num_layers=8, d_model=1024, num_heads=16, seq_len=1024, batch_size=4, vocab_size=512)

PRESETS: dict[str, CheckConfig] = {
    "small": CheckConfig(
        size="small", repeats=2, total_s=170.0,
        models={
            "gpt": dict(num_layers=3, d_model=32, num_heads=2, seq_len=32, batch_size=2, vocab_size=64),
            "hf:llama": dict(num_layers=2, d_model=32, num_heads=2, seq_len=16, batch_size=2, vocab_size=64),
            "mlp": dict(depth=4, width=32, batch_size=16),
            "convnet": dict(num_blocks=3, channels=4, image_size=8, batch_size=2),
        },
        # a·s/h = 16 as in the full shape, on toy widths
        core_sizes=dict(num_layers=2, d_model=32, num_heads=2, seq_len=256, batch_size=1, dropout=0.1),
        offload_sizes=dict(num_layers=2, d_model=32, num_heads=2, seq_len=32, batch_size=2, attention="sdpa"),
        peers_size="tiny", frontier_points=1, shares=SMALL_SHARES,
        segment_models={"convnet": dict(num_blocks=4, channels=4, image_size=8, batch_size=2)}, segment_rounds=2,
    ),
    "full": CheckConfig(
        size="full", repeats=5, total_s=490.0,
        models={
            "gpt": _GPT_FULL,
            "hf:llama": dict(num_layers=8, d_model=1024, num_heads=16, seq_len=1024, batch_size=4, vocab_size=32000),
            "mlp": dict(depth=32, width=2048, batch_size=4096),
            "convnet": dict(num_blocks=16, channels=64, image_size=64, batch_size=64),
        },
        core_sizes=dict(num_layers=2, d_model=12288, num_heads=96, seq_len=2048, batch_size=1, dropout=0.1),
        offload_sizes=dict(num_layers=6, d_model=2048, num_heads=16, seq_len=1024, batch_size=4, attention="sdpa"),
        peers_size="large", peers_sizes=_GPT_FULL, compile_budgets=(0.5,),
        segment_models={"convnet": dict(num_blocks=16, channels=64, image_size=64, batch_size=64), "gpt": _GPT_FULL},
    ),
}
