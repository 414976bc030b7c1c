"""The look shared by every remat figure: colour-blind-safe and readable in grayscale.

Colours are the Okabe-Ito palette (Okabe & Ito, "Color Universal Design", 2008), which stays
distinguishable under the common colour-vision deficiencies. Colour is never the only cue: each
series also has its own hatch, marker or line style, so a grayscale print still reads.

Figures are plain `matplotlib.figure.Figure` objects rendered by the Agg canvas: no pyplot,
no global backend switch, no display needed.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from remat._files import replacing

OKABE_ITO = {
    "black": "#000000",
    "orange": "#E69F00",
    "sky_blue": "#56B4E9",
    "bluish_green": "#009E73",
    "yellow": "#F0E442",
    "blue": "#0072B2",
    "vermillion": "#D55E00",
    "reddish_purple": "#CC79A7",
}

# One (colour, hatch) per memory category, the same in every figure.
CATEGORY_STYLE = {
    "parameters": (OKABE_ITO["blue"], ""),
    "gradients": (OKABE_ITO["sky_blue"], "//"),
    "optimizer state": (OKABE_ITO["reddish_purple"], "\\\\"),
    "fixed part": (OKABE_ITO["yellow"], ".."),
    "activations": (OKABE_ITO["vermillion"], "xx"),
    "kept": (OKABE_ITO["blue"], ""),
    "recomputed": (OKABE_ITO["orange"], "//"),
    "offloaded": (OKABE_ITO["bluish_green"], "\\\\"),
}

# Series cycle for plans and lines: colour, marker, line style.
SERIES = (
    (OKABE_ITO["blue"], "o", "-"),
    (OKABE_ITO["vermillion"], "s", "--"),
    (OKABE_ITO["bluish_green"], "^", "-."),
    (OKABE_ITO["orange"], "D", ":"),
    (OKABE_ITO["reddish_purple"], "v", (0, (5, 1, 1, 1))),
    (OKABE_ITO["sky_blue"], "P", (0, (3, 1, 1, 1, 1, 1))),
    (OKABE_ITO["black"], "X", (0, (1, 1))),
)

BUDGET_COLOR = OKABE_ITO["black"]
BUDGET_LINESTYLE = (0, (6, 3))

SAVE_FORMATS = ("png", "svg")


def series_style(index: int) -> tuple[str, str, object]:
    """(colour, marker, line style) of the index-th series, cycling."""
    return SERIES[index % len(SERIES)]


def new_figure(width_in: float = 7.5, height_in: float = 4.5) -> Figure:
    """A figure on the Agg canvas with remat's defaults (white background, constrained layout)."""
    fig = Figure(figsize=(width_in, height_in), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    fig.patch.set_facecolor("white")
    return fig


def style_axes(ax) -> None:
    """Light grid behind the data, no top/right spines."""
    ax.set_axisbelow(True)
    ax.grid(True, color="#d0d0d0", linewidth=0.6)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def save_figure(fig: Figure, path: str | Path, *, dpi: int = 150) -> Path:
    """Write ``fig`` to ``path``; the suffix picks the format (``.png`` or ``.svg``)."""
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in SAVE_FORMATS:
        raise ValueError(
            f"cannot save a figure as {path.name!r}: unknown suffix {path.suffix!r}; "
            "allowed: .png, .svg. Rename the file."
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as f:
        fig.savefig(f, format=fmt, dpi=dpi, metadata=_metadata(fmt))
    return path


def figure_bytes(fig: Figure, fmt: str = "svg", *, dpi: int = 150) -> bytes:
    """The encoded figure (``"png"`` or ``"svg"``)."""
    if fmt not in SAVE_FORMATS:
        raise ValueError(f"unknown figure format {fmt!r}; allowed: png, svg.")
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=dpi, metadata=_metadata(fmt))
    return buf.getvalue()


def figure_data_uri(fig: Figure, fmt: str = "svg") -> str:
    """``data:image/...;base64,...``: the figure embedded, nothing fetched."""
    mime = "image/svg+xml" if fmt == "svg" else "image/png"
    encoded = base64.b64encode(figure_bytes(fig, fmt)).decode("ascii")
    return f"data:{mime};base64,{encoded}"


def _metadata(fmt: str) -> dict:
    # Reproducible files: no creation date; no tool URL in the SVG metadata.
    if fmt == "svg":
        return {"Date": None, "Creator": None}
    return {"Software": None}
