"""The frontier plot: remat's predicted Pareto frontier, its measured plans, every peer as a point."""

from __future__ import annotations

from pathlib import Path

from benchmarks._peers.results import MIB, Row
from benchmarks._peers.strategies import EAGER
from remat._files import replacing

_MARKERS = {"peer": "o", "remat": "*"}


def frontier_png(path: Path, title: str, all_rows: list[Row], frontier: list[tuple[int, float]]) -> Path:
    """Write a small PNG (step ms against peak MiB) and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=90)
    if frontier:
        xs, ys = zip(*sorted(frontier))
        ax.step([x / MIB for x in xs], ys, where="post", color="tab:green", lw=1.2,
                label="remat Pareto frontier (predicted)")
    for r in all_rows:
        peak_bytes = r.match_peak_bytes
        if peak_bytes is None or r.step_ms is None:
            continue
        filled = r.mode == EAGER
        color = "tab:green" if r.source == "remat" else "tab:blue" if filled else "tab:orange"
        ax.scatter(peak_bytes / MIB, r.step_ms, marker=_MARKERS[r.source], s=60 if r.source == "remat" else 36,
                   facecolors=color if filled else "none", edgecolors=color, zorder=3)
        if r.source == "peer":
            ax.annotate(r.name.replace("checkpoint_sequential", "ckpt_seq"), (peak_bytes / MIB, r.step_ms),
                        fontsize=6.5, xytext=(3, 3), textcoords="offset points")
    ax.scatter([], [], marker="o", color="tab:blue", label="peer, eager")
    ax.scatter([], [], marker="o", facecolors="none", edgecolors="tab:orange", label="peer, torch.compile")
    ax.scatter([], [], marker="*", color="tab:green", label="remat plan, measured (hollow: compiled)")
    ax.set_xlabel("peak memory, MiB (eager: live tracker; compiled: allocator)")
    ax.set_ylabel("step time, median (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as f:
        fig.savefig(f, format=path.suffix.lstrip(".").lower() or "png")
    plt.close(fig)
    return path
