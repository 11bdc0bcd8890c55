"""`monitor_report`: a run's recorded statistics as heatmaps of scopes over steps, worst scopes first."""

from __future__ import annotations

import dataclasses
import html
import math
import os
from collections import defaultdict
from typing import Any

import numpy as np

from ._measure import derived, headroom_bits
from ._recorder import load_records

__all__ = ["ScopeSummary", "monitor_report", "summarize"]

# Headroom above this many bits is drawn as plenty: float16 has 30 binades in
# all, and what matters is the last few before its largest value.
_HEADROOM_SCALE = 16.0


@dataclasses.dataclass(frozen=True)
class ScopeSummary:
    """One scope's worst figures over a run, in one direction.

    Attributes:
        direction: ``"forward"`` or ``"backward"``.
        scope: the named scope path (or source line).
        dtypes: the dtypes its measured values were stored in.
        headroom_bits: the least headroom of any of its sites at any step.
        underflow: the largest underflow fraction of any site at any step.
        nonfinite: inf/NaN entries seen, all steps and sites together.
        worst_site: the site with the least headroom.
    """

    direction: str
    scope: str
    dtypes: tuple[str, ...]
    headroom_bits: float
    underflow: float
    nonfinite: float
    worst_site: str

    def sort_key(self) -> tuple:
        """Worst first: non-finite values; less than a bit of headroom (least
        first); more than 1% underflow (most first); then least headroom."""
        overflowing, underflowing = self.headroom_bits < 1.0, self.underflow > 0.01
        return (
            -self.nonfinite, not overflowing, self.headroom_bits if overflowing else 0.0,
            not underflowing, -self.underflow, min(self.headroom_bits, _HEADROOM_SCALE), self.scope,
        )  # fmt: skip


def summarize(
    records: Any, against: str | None = None
) -> tuple[list[int], list[ScopeSummary], dict[str, dict[str, np.ndarray]], list[dict]]:
    """Per scope and step, the worst site's headroom and underflow.

    A scope is judged by the values it makes (its matmuls' results, what it
    hands on, the operands it prepares itself, such as its weights in the
    compute dtype); a matmul operand handed in by another scope is that
    scope's (`Site.handed_in`).

    Args:
        records: a `MonitorRecorder`, its records, or the JSON-lines file it wrote.
        against: None: headroom and underflow against the dtype each value is
            stored in; ``"float16"``: against float16's range, whatever the
            run used (what a bfloat16 or float32 run would meet in float16;
            float8 values, whose magnitudes are scaled, are left out).

    Returns:
        ``(steps, scopes, grids, loss_scale_events)``: the steps with
        statistics; `ScopeSummary` per (direction, scope), worst first;
        ``grids[direction]["headroom_bits" | "underflow"]``, arrays of shape
        ``(scopes of that direction in the order of `scopes`, steps)`` (NaN
        where a scope was not measured at a step); the loss-scale records.
    """
    if against not in (None, "float16"):
        raise ValueError(f"against must be None or 'float16', got {against!r}.")
    records = load_records(records)
    stats = [r for r in records if r["kind"] == "stats"]
    events = [r for r in records if r["kind"] == "loss_scale"]
    steps = [r["step"] for r in stats]
    cells: dict[tuple[str, str], dict[int, list]] = defaultdict(dict)
    totals: dict[tuple[str, str], dict[str, Any]] = {}
    for column, record in enumerate(stats):
        for site in record["sites"]:
            if not site["values"] or site.get("handed_in"):
                continue  # a cond branch that did not run; another scope's value
            figures = derived(site)
            key = (site["direction"], site["scope"])
            headroom, underflow = figures["headroom_bits"], figures["underflow_fraction"]
            if against == "float16":
                if str(site["dtype"]).startswith("float8"):
                    continue
                headroom, underflow = headroom_bits(site["amax"], "float16"), figures["float16_underflow_fraction"]
            previous = cells[key].get(column, [math.inf, 0.0])
            cells[key][column] = [min(previous[0], headroom), max(previous[1], underflow)]
            total = totals.setdefault(
                key, dict(dtypes=set(), headroom=math.inf, underflow=0.0, nonfinite=0.0, worst=site["name"])
            )
            total["dtypes"].add(site["dtype"])
            if headroom < total["headroom"]:
                total["headroom"], total["worst"] = headroom, site["name"]
            total["underflow"] = max(total["underflow"], underflow)
            total["nonfinite"] += site["nonfinite"]
    summaries = sorted(
        (
            ScopeSummary(d, s, tuple(sorted(t["dtypes"])), t["headroom"], t["underflow"], t["nonfinite"], t["worst"])
            for (d, s), t in totals.items()
        ),
        key=ScopeSummary.sort_key,
    )
    grids: dict[str, dict[str, Any]] = {}  # per direction: two arrays (rows x steps) and the scopes
    for direction in ("forward", "backward"):
        rows = [s for s in summaries if s.direction == direction]
        headroom = np.full((len(rows), len(steps)), np.nan)
        underflow = np.full((len(rows), len(steps)), np.nan)
        for i, summary in enumerate(rows):
            for column, (h, u) in cells[(direction, summary.scope)].items():
                headroom[i, column], underflow[i, column] = h, u
        grids[direction] = dict(headroom_bits=headroom, underflow=underflow, scopes=[s.scope for s in rows])
    return steps, summaries, grids, events


def monitor_report(records: Any, path: str | os.PathLike, *, top: int = 40, against: str | None = None) -> str:
    """Write a run's report: ``.html`` (self-contained) or ``.png`` (needs matplotlib).

    The report shows, for the forward values and the backward cotangents, a
    heatmap of scopes (rows, worst first) over recorded steps (columns) of
    the headroom in bits (log2 of the largest finite value of the dtype each
    value is stored in over its amax; red is none left, green 16 bits or
    more) and one of the underflow fraction (nonzero entries below the
    dtype's smallest normal), the loss scale over steps with skipped steps
    marked, and a table of scopes worst first (`ScopeSummary.sort_key`:
    non-finite values, less than a bit of headroom, more than 1% underflow).

    Args:
        records: a `MonitorRecorder`, its ``records``, or the JSON-lines file it wrote.
        path: where to write; the suffix picks the format.
        top: the number of scopes per direction drawn (the worst).
        against: ``"float16"``: headroom and underflow against float16's
            range whatever dtype the run used (see `summarize`).

    Returns:
        `path`, as a string.

    Raises:
        ValueError: `path` ends in neither ``.html`` nor ``.png``, or there
            are no recorded statistics.
        ImportError: a ``.png`` report without matplotlib installed.
    """
    path = os.fspath(path)
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in (".html", ".png"):
        raise ValueError(f"monitor_report writes .html or .png files, got {path!r}.")
    steps, summaries, grids, events = summarize(records, against)
    if not steps:
        raise ValueError("monitor_report: the records hold no statistics (record MonitorStats with a MonitorRecorder).")
    for grid in grids.values():
        for name in ("headroom_bits", "underflow"):
            grid[name] = grid[name][:top]
        grid["scopes"] = grid["scopes"][:top]
    if suffix == ".png":
        _write_png(path, steps, grids, events, _dtype_label(against))
    else:
        with open(path, "w") as f:
            f.write(_html(steps, summaries, grids, events, _dtype_label(against)))
    return path


def _dtype_label(against: str | None) -> str:
    return "against float16" if against else "against each value's dtype"


# --- HTML ----------------------------------------------------------------------------


def _headroom_colour(bits: float) -> str:
    if math.isnan(bits):
        return "#eeeeee"
    t = min(max(bits / _HEADROOM_SCALE, 0.0), 1.0)  # 0: red, 1: green
    red, green = int(215 * (1 - t) + 40 * t), int(48 * (1 - t) + 160 * t)
    return f"rgb({red},{green},60)"


def _underflow_colour(fraction: float) -> str:
    if math.isnan(fraction):
        return "#eeeeee"
    shade = int(255 * (1 - min(max(fraction, 0.0), 1.0)))
    return f"rgb({shade},{shade},255)"


def _heatmap_svg(title: str, scopes: list[str], steps: list[int], values: np.ndarray, colour, unit: str) -> str:
    cell_w, cell_h, label_w, top = max(4, min(24, 720 // max(len(steps), 1))), 16, 260, 24
    width, height = label_w + cell_w * len(steps) + 10, top + cell_h * len(scopes) + 24
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">',
        f'<text x="0" y="14" font-size="13" font-weight="bold">{html.escape(title)}</text>',
    ]
    for i, scope in enumerate(scopes):
        y = top + i * cell_h
        parts.append(
            f'<text x="{label_w - 6}" y="{y + 12}" font-size="11" text-anchor="end">{html.escape(scope[:40])}</text>'
        )
        for j, step in enumerate(steps):
            value = values[i, j]
            label = "not measured" if math.isnan(value) else f"{value:.3g} {unit}"
            parts.append(
                f'<rect x="{label_w + j * cell_w}" y="{y}" width="{cell_w}" height="{cell_h - 1}" '
                f'fill="{colour(value)}"><title>{html.escape(scope)}, step {step}: {label}</title></rect>'
            )
    parts.append(
        f'<text x="{label_w}" y="{height - 6}" font-size="11">steps {steps[0]} to {steps[-1]}</text>' if steps else ""
    )
    parts.append("</svg>")
    return "\n".join(parts)


def _scale_points(events: list[dict], steps: list[int]) -> list[tuple[int, float]]:
    """The loss scale at each event, held to the last recorded step."""
    points = [(e["step"], e["loss_scale"]) for e in events if e["loss_scale"]]
    if points and steps and steps[-1] > points[-1][0]:
        points.append((steps[-1], points[-1][1]))
    return points


def _loss_scale_svg(events: list[dict], steps: list[int]) -> str:
    points = _scale_points(events, steps)
    if not points:
        return "<p>No loss scale recorded.</p>"
    width, height, pad = 720, 160, 30
    first, last = points[0][0], max(points[-1][0], points[0][0] + 1)
    logs = [math.log2(s) for _, s in points]
    low, high = min(logs), max(max(logs), min(logs) + 1)

    def xy(step, scale):
        x = pad + (width - 2 * pad) * (step - first) / (last - first)
        return x, height - pad - (height - 2 * pad) * (math.log2(scale) - low) / (high - low)

    line = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(*p) for p in points))
    skips = "".join(
        f'<circle cx="{xy(e["step"], e["loss_scale"])[0]:.1f}" cy="{xy(e["step"], e["loss_scale"])[1]:.1f}" r="3" '
        f'fill="red"><title>step {e["step"]}: skipped</title></circle>'
        for e in events
        if e["skipped"] and e["loss_scale"]
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">'
        f'<text x="0" y="14" font-size="13" font-weight="bold">Loss scale (log2), skipped steps in red</text>'
        f'<polyline fill="none" stroke="black" points="{line}"/>{skips}'
        f'<text x="{pad}" y="{height - 8}" font-size="11">2^{low:.0f} to 2^{high:.0f}, steps {first} to {last}</text>'
        "</svg>"
    )


def _html(steps, summaries, grids, events, label: str) -> str:
    rows = "\n".join(
        f"<tr><td>{s.direction}</td><td>{html.escape(s.scope)}</td><td>{', '.join(s.dtypes)}</td>"
        f"<td>{s.headroom_bits:.2f}</td><td>{100 * s.underflow:.2f}%</td><td>{s.nonfinite:.0f}</td>"
        f"<td>{html.escape(s.worst_site)}</td></tr>"
        for s in summaries
    )
    sections = []
    for direction in ("forward", "backward"):
        grid = grids[direction]
        if not grid["scopes"]:
            continue
        name = "values" if direction == "forward" else "cotangents"
        sections.append(
            _heatmap_svg(
                f"{direction}: headroom (bits) of {name}, {label}",
                grid["scopes"],
                steps,
                grid["headroom_bits"],
                _headroom_colour,
                "bits",
            )  # fmt: skip
        )
        sections.append(
            _heatmap_svg(
                f"{direction}: underflow fraction of {name}, {label}",
                grid["scopes"],
                steps,
                grid["underflow"],
                _underflow_colour,
                "",
            )  # fmt: skip
        )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>jaxamp numerics report</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 6px;font-size:12px}}</style></head>
<body><h1>jaxamp numerics report</h1>
<p>{len(steps)} recorded steps ({steps[0]} to {steps[-1]}), {label}. Headroom: log2 of the dtype's largest
finite value over a value's largest magnitude (below 1 bit: within a factor of 2 of overflowing).
Underflow: the fraction of nonzero entries below the dtype's smallest normal.</p>
<h2>Scopes, worst first</h2>
<table id="scopes"><thead><tr><th>direction</th><th>scope</th><th>dtype</th><th>least headroom (bits)</th>
<th>most underflow</th><th>inf/NaN</th><th>worst site</th></tr></thead><tbody>
{rows}
</tbody></table>
<h2>Over steps</h2>
{_loss_scale_svg(events, steps)}
{"".join(f"<div>{s}</div>" for s in sections)}
</body></html>
"""


# --- PNG -----------------------------------------------------------------------------


def _write_png(path: str, steps, grids, events, label: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("monitor_report(..., '*.png') draws with matplotlib: pip install matplotlib.") from err
    directions = [d for d in ("forward", "backward") if grids[d]["scopes"]]
    rows = len(directions) + 1
    height = max(2.5, max((len(grids[d]["scopes"]) for d in directions), default=1) * 0.22 + 1.2)
    fig, axes = plt.subplots(rows, 2, figsize=(14, height * len(directions) + 2.5), squeeze=False)
    extent = None
    for row, direction in enumerate(directions):
        grid = grids[direction]
        for column, (name, cmap, vmax, name_label) in enumerate(
            (("headroom_bits", "RdYlGn", _HEADROOM_SCALE, "headroom (bits)"), ("underflow", "Blues", 1.0, "underflow"))
        ):
            ax = axes[row][column]
            image = ax.imshow(
                np.ma.masked_invalid(grid[name]), aspect="auto", cmap=cmap, vmin=0, vmax=vmax,
                interpolation="nearest", extent=extent,
            )  # fmt: skip
            ax.set_yticks(range(len(grid["scopes"])), [s[:40] for s in grid["scopes"]], fontsize=7)
            ticks = np.linspace(0, len(steps) - 1, min(len(steps), 6)).round().astype(int)
            ax.set_xticks(ticks, [str(steps[t]) for t in ticks], fontsize=7)
            ax.set_title(f"{direction}: {name_label}, {label}", fontsize=9)
            fig.colorbar(image, ax=ax)
    ax = axes[-1][0]
    points = _scale_points(events, steps)
    if points:
        ax.step(*zip(*points), where="post")
        ax.set_yscale("log", base=2)
        skipped = [(e["step"], e["loss_scale"]) for e in events if e["skipped"] and e["loss_scale"]]
        if skipped:
            ax.plot(*zip(*skipped), "r.", label="skipped")
            ax.legend(fontsize=7)
    if not points:
        ax.text(0.5, 0.5, "no loss scale recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
    ax.set_title("loss scale", fontsize=9)
    axes[-1][1].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
