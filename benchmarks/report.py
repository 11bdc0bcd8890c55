"""Turning the results of ``python -m benchmarks.run`` into text, a markdown section and a PNG.

`text_table` prints one workload's per-variant figures; `update_markdown`
replaces one machine's section of RESULTS.md (per-workload tables, residual
differences, trace and eager overhead, the targets); `plot` draws bar charts.
All of them read the results dict only.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from benchmarks import eager, targets, trace_overhead
from benchmarks.variants import VARIANTS

__all__ = ["plot", "text_table", "update_markdown"]

MIB = 2**20
_HEADER = """\
# Benchmark results

Written by `python -m benchmarks.run --device-label LABEL`, which replaces the
section of its label and leaves the others alone. What each column means, and
how to reproduce them: [docs/benchmarks.md](../docs/benchmarks.md). Every figure
below was measured by the command shown in its section; none is estimated.
"""


def _ratio(a: Any, b: Any) -> str:
    return f"{a / b:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) else "-"


def _fmt(value: Any, scale: float = 1.0, digits: int = 1) -> str:
    return f"{value / scale:,.{digits}f}" if isinstance(value, (int, float)) else "-"


def _share(value: Any) -> str:
    return f"{value:.1%}" if isinstance(value, (int, float)) else "-"


def _columns(per_variant: dict[str, dict], unit: str) -> tuple[list[str], list[list[str]]]:
    """Column names and one row of cells per variant.

    The "vs hand-cast" columns divide by the variant's `Variant.compare_with`.
    """
    timed = any("step_s" in r for r in per_variant.values())
    f32 = per_variant.get("f32", {})
    names = [
        "variant",
        "lower (ms)",
        "vs f32",
        "residuals (MiB)",
        "vs f32",
        "vs hand-cast",
        "half-precision FLOPs",
        "float8 FLOPs",
        "converts",
        "vs hand-cast",
        "compiled converts",
        "vs hand-cast",
    ]
    if timed:
        names += ["step (ms)", f"{unit}/s", "peak memory (MiB)", "skipped steps"]
    rows = []
    for key, r in per_variant.items():
        hand = per_variant.get(VARIANTS[key].compare_with, {})
        row = [
            VARIANTS[key].label,
            _fmt(r.get("lower_s"), 1e-3, 0),
            _ratio(r.get("lower_s"), f32.get("lower_s")),
            _fmt(r.get("residual_bytes"), MIB, 0),
            _ratio(r.get("residual_bytes"), f32.get("residual_bytes")),
            _ratio(r.get("residual_bytes"), hand.get("residual_bytes")),
            _share(r.get("half_flop_share")),
            _share(r.get("fp8_flop_share")),
            str(r.get("converts", "-")),
            _ratio(r.get("converts"), hand.get("converts")),
            str(r.get("compiled_converts", "-")),
            _ratio(r.get("compiled_converts"), hand.get("compiled_converts")),
        ]
        if timed:
            row += [
                _fmt(r.get("step_s"), 1e-3, 1),
                _fmt(r.get("throughput"), 1, 0),
                _fmt(r.get("peak_bytes"), MIB, 0),
                str(r.get("nonfinite_steps", "-")),
            ]
        rows.append(row)
    return names, rows


_SHORT_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "bool": "bool"}


def _by_dtype(counts: dict[str, int]) -> str:
    if not counts:
        return "-"
    return ", ".join(f"{_SHORT_DTYPES.get(dtype, dtype)} {n / MIB:,.0f}" for dtype, n in sorted(counts.items()))


def _errors(per_variant: dict[str, dict]) -> list[str]:
    """``"label: what failed"`` for every measurement that failed or was skipped."""
    return [
        f"{VARIANTS[key].label}: {r[field]}"
        for key, r in per_variant.items()
        for field in ("error", "timing_error")
        if field in r
    ]


def text_table(per_variant: dict[str, dict], unit: str) -> str:
    """An aligned plain-text table of one workload's results."""
    names, rows = _columns(per_variant, unit)
    widths = [max(len(c) for c in column) for column in zip(names, *rows)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in [names, *rows]]
    return "\n".join(lines + [f"!! {e}" for e in _errors(per_variant)])


def _markdown_table(names: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _trace_overhead_lines(overhead: dict | None) -> list[str]:
    """Markdown rows of the trace overhead: one per model and setting (warm, cold, runnable)."""
    if not overhead:
        return []
    lines = [
        "",
        "### Trace overhead: lowering value-and-grad (warm, cold) and time to a runnable step "
        "(lower + compile), amp / plain and amp / hand-cast",
        "",
    ]
    if "error" in overhead:
        return [*lines, f"- not measured: {overhead['error']}"]
    rows = []
    for key, setting, r in trace_overhead.each_setting(overhead):
        if "error" in r:
            rows.append([f"`{key}`", setting, "-", "-", "-", f"not measured: {r['error']}", "-"])
            continue
        rows.append(
            [
                f"`{key}`",
                setting,
                _fmt(r["plain_s"], 1e-3, 0),
                _fmt(r["hand_s"], 1e-3, 0),
                _fmt(r["amp_s"], 1e-3, 0),
                f"{r['ratio']:.2f}x",
                f"{r['ratio_to_hand']:.2f}x",
            ]
        )
    header = ["model", "trace", "plain (ms)", "hand-cast (ms)", "amp (ms)"]
    lines += _markdown_table([*header, "amp / plain", "amp / hand-cast"], rows)
    lines += [""] + [f"- `{key}`: {r['title']}" for key, r in overhead.items() if "title" in r]
    return lines


def _eager_lines(figure: dict | None) -> list[str]:
    """The eager-overhead figure as a markdown paragraph."""
    if not figure:
        return []
    lines = ["", "### Eager overhead: one call outside jit, amp / plain", ""]
    if "error" in figure:
        return [*lines, f"- not measured: {figure['error']}"]
    return [*lines, eager.format_results(figure) + "."]


_STATUS = {targets.MET: "met", targets.MISSED: "**MISSED**", targets.NOT_MEASURED: "not measured"}


def _target_lines(rows: list[dict]) -> list[str]:
    """The targets table (`benchmarks.targets.evaluate`'s rows) in markdown."""
    if not rows:
        return []
    cells = [
        [
            t["target"],
            "-" if t["value"] is None else f"{t['value']:.3f}",
            targets.wanted(t),
            _STATUS[t["status"]] + (f" ({t['note']})" if t["note"] else ""),
        ]
        for t in rows
    ]
    return ["", "### Targets", "", *_markdown_table(["target", "measured", "wanted", ""], cells)]


def _section(results: dict, json_path: Path, png_path: Path | None, md_dir: Path) -> list[str]:
    m = results["machine"]

    def rel(path: Path) -> str:
        return Path(os.path.relpath(path, md_dir)).as_posix()

    lines = [
        f"## {results['label']}",
        "",
        (
            f"- machine: {m['device']} ({m['backend']}, {m['device_count']} device(s)); "
            f"host {m['cpu']}, {m['cpu_count']} cores, load average "
            f"{m.get('load_average') or 0:.1f} at the start"
        ),
        (
            f"- JAX {m['jax']} (jaxlib {m['jaxlib']}), Python {m['python']}; measured "
            f"{m['date']}, in {results['elapsed_s']:.0f} s"
        ),
        f"- command: `{results['command']}`",
        f"- raw results: [{rel(json_path)}]({rel(json_path)})",
    ]
    if "timings_note" in results:
        lines.append(f"- {results['timings_note']}.")
    for key, per_variant in results["models"].items():
        lines += ["", f"### {results['workloads'][key]}", ""]
        unit = "tokens" if key == "gpt" else "images"
        lines += _markdown_table(*_columns(per_variant, unit))
        errors = _errors(per_variant)
        if errors:
            lines += [""] + [f"- not measured, {e}" for e in errors]
        amp_warnings = results.get("warnings", {}).get(key, [])
        if amp_warnings:
            lines += [""] + [f"- **amp warned**: {w}" for w in amp_warnings]
        excess = results.get("residual_excess", {}).get(key)
        if isinstance(excess, list) and excess:
            lines += [
                "",
                (
                    "Source lines where amp bf16 and hand-cast bf16 save different amounts for "
                    "the backward pass (loop-free form of the model; MiB by dtype; "
                    "difference = amp minus hand-cast):"
                ),
                "",
            ]
            lines += _markdown_table(
                ["source line", "amp bf16", "hand-cast bf16", "difference (MiB)"],
                [
                    [
                        f"`{r['source']}`",
                        _by_dtype(r["amp_bf16"]),
                        _by_dtype(r["hand_bf16"]),
                        f"{r['excess_bytes'] / MIB:+,.0f}",
                    ]
                    for r in excess
                ],
            )
    lines += _trace_overhead_lines(results.get("trace_overhead"))
    lines += _eager_lines(results.get("eager"))
    lines += _target_lines(results.get("targets", []))
    if png_path is not None:
        lines += ["", f"![{results['label']}]({rel(png_path)})"]
    return lines


def update_markdown(md_path: Path, results: dict, json_path: Path, png_path: Path | None) -> None:
    """Replace (or append) the section of ``results['label']`` in `md_path`."""
    label = results["label"]
    begin, end = f"<!-- begin: {label} -->", f"<!-- end: {label} -->"
    body = "\n".join([begin, *_section(results, json_path, png_path, md_path.parent), end])
    text = md_path.read_text() if md_path.exists() else _HEADER
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: body, text)
    else:
        text = text.rstrip("\n") + "\n\n" + body
    md_path.write_text(text.rstrip("\n") + "\n")


def plot(results: dict, png_path: Path) -> Path | None:
    """Bar charts per workload: step time and peak memory when timed, else the
    lowering-time ratio and residual bytes. Returns the path, or None when there
    is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = results["models"]
    timed = any("step_s" in r for pv in models.values() for r in pv.values())
    panels = (
        [("step_s", "step time (ms)", 1e-3), ("peak_bytes", "peak memory (MiB)", MIB)]
        if timed
        else [
            ("lower_ratio", "lowering time / float32", 1.0),
            ("residual_bytes", "residuals (MiB)", MIB),
        ]
    )
    if not models:
        return None
    fig, axes = plt.subplots(len(panels), len(models), figsize=(5 * len(models), 3.6 * len(panels)), squeeze=False)
    colors = ["#7f7f7f", "#1f77b4", "#ff7f0e", "#9467bd", "#2ca02c", "#d62728"]
    for col, (wkey, per_variant) in enumerate(models.items()):
        for row, (field, title, scale) in enumerate(panels):
            ax = axes[row][col]
            keys = [k for k, r in per_variant.items() if isinstance(r.get(field), (int, float))]
            values = [per_variant[k][field] / scale for k in keys]
            bars = ax.bar(range(len(keys)), values, color=colors[: len(keys)])
            labels = [f"{v:,.0f}" if v >= 100 else f"{v:.3g}" for v in values]
            ax.bar_label(bars, labels=labels, fontsize=8)
            names = [VARIANTS[k].label for k in keys]
            ax.set_xticks(range(len(keys)), names, rotation=30, ha="right", fontsize=8)
            ax.set_title(f"{wkey}: {title}", fontsize=10)
            ax.margins(y=0.15)
    fig.suptitle(f"{results['label']}: JAX {results['machine']['jax']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path
