"""One self-contained HTML report: summary, tables, plots, plan per block, environment, commands.

The page needs nothing but itself: CSS inline, figures embedded as ``data:`` URIs, no script,
no font, image or link outside the file. It reads on a phone and on a desktop.

Writing the report at the end of a run (what `remat run` and `remat demo` do)::

    from remat.report import write_report

    path = write_report(
        out_dir / "report.html", profile, plans=[chosen, *baselines], verifications=[verification],
        commands=["remat run --model gpt --budget 4GiB"],   # how to reproduce it
        frontier=remat.pareto(profile),                      # optional: the optimal frontier
    )
    console.print(f"report: {path}")

``plans`` are the few plans to compare (they fill the tables); pass a frontier sweep such as
`remat.pareto`'s plans as ``frontier``, which only draws the frontier line. ``render_html``
returns the same page as a string.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from matplotlib.figure import Figure

import remat
from remat._files import write_atomic
from remat.measure.types import Profile
from remat.plan.types import Plan
from remat.report.blocks import check_plan_matches, plot_blocks
from remat.report.breakdown import plot_breakdown
from remat.report.frontier import plot_frontier
from remat.report.style import figure_data_uri, save_figure
from remat.report.summary import choose_plan, find_verification, plan_label, report_budget, summary_sentence
from remat.report.tables import (
    Table,
    blocks_table,
    environment_table,
    op_mismatch_table,
    plans_table,
    unavailable_table,
    verifications_table,
)
from remat.report.timeline import plot_timeline, timeline_series
from remat.report.tuning import tuned_plan, tuning_sentence, tuning_table
from remat.report.units import format_bytes
from remat.verify_types import Verification

FIGURE_CAPTIONS = {
    "frontier": "Trade-off: peak memory against step time for each plan; the star is no recomputation.",
    "breakdown": "Where the peak goes: model state, fixed part and activations, per step.",
    "timeline": "Live memory over one training step, measured at block boundaries: no recomputation "
                "against the chosen plan.",
    "blocks": "Per block under the chosen plan: bytes kept on the device, recomputed, offloaded.",
}

STRATEGY_NOTE = (
    '<p class="note"><b>keep</b>: store what autograd saves; <b>recompute</b>: store only the '
    "input, replay the forward in backward; <b>selective</b>: save the outputs of expensive ops, "
    "recompute the cheap ones; <b>offload</b>: move saved tensors to host memory or disk and "
    "fetch them back in backward.</p>"
)

UNAVAILABLE_NOTE = (
    '<p class="note">The profile ran each block alone under each strategy; where that raised, the '
    "strategy is left out for the block, and no plan picks it there.</p>"
)


def report_figures(profile: Profile, plans: Sequence[Plan] = (),
                   verifications: Sequence[Verification] = (), *, frontier: Sequence[Plan] = (),
                   budget_bytes: int | None = None) -> dict[str, Figure]:
    """The report's figures by name (``frontier``, ``breakdown``, ``timeline``, ``blocks``); a
    figure without data (no plan, no timeline) is left out."""
    for plan in (*plans, *frontier):
        check_plan_matches(profile, plan)
    budget = report_budget(plans, budget_bytes)
    figures: dict[str, Figure] = {}
    if plans or frontier:
        figures["frontier"] = plot_frontier(profile, plans, verifications, frontier=frontier,
                                            budget_bytes=budget)
    figures["breakdown"] = plot_breakdown(profile, plans, budget_bytes=budget)
    shown = _plan_to_show(plans, budget)
    # Baseline against the shown plan only: one line per verified plan would hide both.
    shown_ver = [v for v in verifications if shown is not None and v is find_verification(shown, verifications)]
    if timeline_series(profile, shown_ver):
        figures["timeline"] = plot_timeline(profile, shown_ver, budget_bytes=budget)
    if shown is not None:
        figures["blocks"] = plot_blocks(profile, shown)
    return figures


def save_figures(figures: dict[str, Figure], directory: str | Path) -> list[Path]:
    """Write every figure as ``<name>.png`` and ``<name>.svg`` under ``directory``."""
    return [save_figure(fig, Path(directory) / f"{name}.{fmt}")
            for name, fig in figures.items() for fmt in ("png", "svg")]


def render_html(profile: Profile, plans: Sequence[Plan] = (),
                verifications: Sequence[Verification] = (), *, commands: Sequence[str] = (),
                frontier: Sequence[Plan] = (), budget_bytes: int | None = None,
                figures: dict[str, Figure] | None = None) -> str:
    """The report page. ``commands`` reproduce it; ``frontier`` draws the optimal frontier;
    ``figures`` reuses figures already made by `report_figures`."""
    for plan in plans:
        check_plan_matches(profile, plan)
    if figures is None:
        figures = report_figures(profile, plans, verifications, frontier=frontier, budget_bytes=budget_bytes)
    budget = report_budget(plans, budget_bytes)
    sentence = summary_sentence(profile, plans, verifications, budget_bytes=budget)
    chosen = _index_of(choose_plan(plans, budget), plans)
    sections = [
        ("plans", "Plans", _table_html(plans_table(profile, plans, verifications, budget), highlight=chosen))
        if plans else None,
        _tuning_section(plans),
        ("figures", "Plots", _figures_html(figures)),
        ("blocks", "Plan per block", _table_html(blocks_table(profile, plans)) + STRATEGY_NOTE),
        ("unavailable", "Strategies a block cannot run", _table_html(unavailable_table(profile)) + UNAVAILABLE_NOTE)
        if unavailable_table(profile)[1] else None,
        ("verify", "Verification", _verification_html(verifications)) if verifications else None,
        ("environment", "Environment", _table_html(environment_table(profile), header=False, css_class="kv")),
        ("reproduce", "Reproduce", _commands_html(commands) + _apply_html(choose_plan(plans, budget))),
    ]
    sections = [s for s in sections if s is not None]
    body = [_header(profile, sentence, budget), _nav(sections), *(_section(*s) for s in sections)]
    return _page(f"remat report: {_model_title(profile)}", "\n".join(body))


def write_report(path: str | Path, profile: Profile, plans: Sequence[Plan] = (),
                 verifications: Sequence[Verification] = (), *, commands: Sequence[str] = (),
                 frontier: Sequence[Plan] = (), budget_bytes: int | None = None,
                 figures_dir: str | Path | None = None) -> Path:
    """Write the report to ``path`` (parents created) and, with ``figures_dir``, each figure as
    PNG and SVG; returns the report's path."""
    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"report path {str(path)!r} must end in .html; e.g. report.html.")
    figures = report_figures(profile, plans, verifications, frontier=frontier, budget_bytes=budget_bytes)
    page = render_html(profile, plans, verifications, commands=commands, budget_bytes=budget_bytes,
                       figures=figures)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, page)
    if figures_dir is not None:
        save_figures(figures, figures_dir)
    return path


def _plan_to_show(plans: Sequence[Plan], budget: int | None) -> Plan | None:
    """The chosen plan, else (nothing fits) the plan with the smallest peak."""
    chosen = choose_plan(plans, budget)
    if chosen is None and plans:
        chosen = min(plans, key=lambda p: p.prediction.peak_bytes)
    return chosen


def _index_of(plan: Plan | None, plans: Sequence[Plan]) -> int | None:
    return next((i for i, p in enumerate(plans) if p is plan), None)


def _model_title(profile: Profile) -> str:
    classes = ", ".join(dict.fromkeys(b.class_name for b in profile.blocks)) or "model"
    return f"{profile.num_blocks} x {classes} on {profile.fingerprint.device} ({profile.fingerprint.dtype})"


def _header(profile: Profile, sentence: str, budget: int | None) -> str:
    facts = [("device", profile.environment.device_name), ("blocks", str(profile.num_blocks)),
             ("budget", format_bytes(budget) if budget is not None else "none given")]
    items = "".join(f"<div><dt>{_e(k)}</dt><dd>{_e(v)}</dd></div>" for k, v in facts)
    return (f'<header><p class="kicker">remat memory plan</p><h1>{_e(_model_title(profile))}</h1>'
            f'<p class="summary" id="summary">{_e(sentence)}</p><dl class="facts">{items}</dl></header>')


def _nav(sections: Sequence[tuple[str, str, str]]) -> str:
    links = "".join(f'<a href="#{anchor}">{_e(title)}</a>' for anchor, title, _ in sections)
    return f'<nav aria-label="sections">{links}</nav>'


def _verification_html(verifications: Sequence[Verification]) -> str:
    """The verification table, and every op whose planned count is not the expected one."""
    inner = _table_html(verifications_table(verifications))
    headers, rows = op_mismatch_table(verifications)
    if rows:
        inner += "<p>Ops that ran a different number of times than the plan says:</p>"
        inner += _table_html((headers, rows))
    return inner


def _tuning_section(plans: Sequence[Plan]) -> tuple[str, str, str] | None:
    """Predicted against measured for each layout measured tuning timed, the winner marked."""
    tuned = tuned_plan(plans)
    if tuned is None:
        return None
    table, winner = tuning_table(tuned.tuning)
    return "tuning", "Tuning", f"<p>{_e(tuning_sentence(tuned.tuning))}</p>" + _table_html(table, highlight=winner)


def _section(anchor: str, title: str, inner: str) -> str:
    return f'<section id="{anchor}"><h2>{_e(title)}</h2>{inner}</section>'


def _table_html(table: Table, *, header: bool = True, highlight: int | None = None,
                css_class: str = "") -> str:
    """A scrollable table; row ``highlight`` (the chosen plan) is marked."""
    headers, rows = table
    head = "<thead><tr>" + "".join(f"<th>{_e(h)}</th>" for h in headers) + "</tr></thead>" if header else ""
    body = "".join(
        ('<tr class="chosen">' if i == highlight else "<tr>") + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>"
        for i, row in enumerate(rows)
    )
    klass = f' class="{css_class}"' if css_class else ""
    return f'<div class="table-wrap"><table{klass}>{head}<tbody>{body}</tbody></table></div>'


def _figures_html(figures: dict[str, Figure]) -> str:
    cells = []
    for name, fig in figures.items():
        caption = FIGURE_CAPTIONS.get(name, name)
        cells.append(f'<figure id="fig-{name}"><img src="{figure_data_uri(fig, "svg")}" '
                     f'alt="{_e(caption)}"><figcaption>{_e(caption)}</figcaption></figure>')
    return f'<div class="figures">{"".join(cells)}</div>'


def _commands_html(commands: Sequence[str]) -> str:
    if not commands:
        return "<p>No command recorded; pass <code>commands=</code> to <code>write_report</code>.</p>"
    return "<pre><code>" + _e("\n".join(commands)) + "</code></pre>"


def _apply_html(chosen: Plan | None) -> str:
    """How to use the chosen plan in a training script."""
    if chosen is None:
        return ""
    code = (f"import remat\n\nplan = remat.Plan.load(\"plan.json\")  # {plan_label(chosen)}\n"
            "remat.apply_(model, plan, batch=batch)  # in place; state_dict keys unchanged\n"
            "# ... train as usual ...\nremat.remove_(model)  # back to the original forward")
    return f"<p>Use the chosen plan in your training script:</p><pre><code>{_e(code)}</code></pre>"


def _page(title: str, body: str) -> str:
    css = resources.files("remat.report").joinpath("report.css").read_text(encoding="utf-8")
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        # An empty icon, so that no browser asks the disk or network for favicon.ico.
        '<link rel="icon" href="data:,">'
        f"<title>{_e(title)}</title><style>{css}</style></head>\n<body><main>\n{body}\n"
        f'<footer>remat {_e(remat.__version__)}</footer></main></body></html>\n'
    )


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)
