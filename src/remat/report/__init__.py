"""Reports: plots (frontier, per-block bars, timeline, memory breakdown) and one HTML page.

Figures are `matplotlib.figure.Figure` objects on the Agg canvas; `save_figure` writes PNG or
SVG. `write_report` writes the self-contained HTML page (see `remat.report.html`).
"""

from remat.report.blocks import BlockBytes, block_bytes, plot_blocks
from remat.report.breakdown import MemoryBreakdown, memory_breakdowns, plot_breakdown
from remat.report.frontier import pareto_points, plot_frontier
from remat.report.html import render_html, report_figures, save_figures, write_report
from remat.report.inputs import ReportInputs, document_kind, load_inputs
from remat.report.style import save_figure
from remat.report.summary import summary_sentence
from remat.report.timeline import plot_timeline

__all__ = [
    "BlockBytes",
    "MemoryBreakdown",
    "ReportInputs",
    "block_bytes",
    "document_kind",
    "load_inputs",
    "memory_breakdowns",
    "pareto_points",
    "plot_blocks",
    "plot_breakdown",
    "plot_frontier",
    "plot_timeline",
    "render_html",
    "report_figures",
    "save_figure",
    "save_figures",
    "summary_sentence",
    "write_report",
]
