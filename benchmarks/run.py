"""The benchmark suite's command line: every figure, its targets, the report.

    python -m benchmarks.run --device-label h100              # on a GPU
    python -m benchmarks.run --device-label cpu-2core --quick

Run from the repository root. For each workload of `benchmarks.workloads`
(GPT-2 small, a ResNet-style CNN) and each variant of `benchmarks.variants`,
it measures the static metrics (`benchmarks.static_metrics`: lowering time,
residual bytes, FLOP shares, lowered and compiled converts) and, on a GPU, the
step time, throughput and peak memory (`benchmarks.step_time`); then the trace
overhead of amp, warm and cold (`benchmarks.trace_overhead`), and its overhead
per eager call (`benchmarks.eager`). It checks every target of
`benchmarks.targets`, writes ``<results-dir>/<label>.json`` and ``<label>.png``,
and replaces the ``<label>`` section of ``benchmarks/RESULTS.md``. See
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax

from benchmarks import eager, report, step_time, targets, trace_overhead
from benchmarks.guard import guarded
from benchmarks.machine import default_label, machine_info
from benchmarks.static_metrics import COMPILED_VARIANTS, residual_excess, static_metrics
from benchmarks.variants import VARIANTS
from benchmarks.workloads import SIZES, workloads

__all__ = ["SKIPPABLE", "main", "parse_args"]

_HERE = Path(__file__).resolve().parent

SKIPPABLE = {
    "trace": "the trace overhead, warm, cold and time to a runnable step",
    "cold": "the cold trace overhead only (its fresh processes)",
    "runnable": "time to a runnable step only (compiling each model three ways)",
    "eager": "the eager overhead",
    "compiled": "the compiled converts (compiling the steps of the compared variants)",
}
"""What ``--skip`` accepts, and what each skips."""


def _comma_list(allowed: Any, what: str):
    def parse(text: str) -> list[str]:
        items = [item for item in text.split(",") if item]
        unknown = [item for item in items if item not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(allowed)}")
        return items

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line's options (``argv`` None: ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description=(
            "Benchmark float32, hand-cast bf16/f16 and amp bf16/f16/fp8 on a GPT-2-small-shaped "
            "LM and a ResNet-style CNN, and amp's trace and eager overhead; check the targets. "
            "Writes <results-dir>/<label>.json and .png and updates the <label> section of "
            "benchmarks/RESULTS.md."
        ),
        epilog="Step time, throughput and peak memory are only measured on a GPU.",
    )
    parser.add_argument(
        "--device-label",
        help="name of this machine in RESULTS.md and the result files "
        "(default: backend and device kind, e.g. gpu-nvidia-h100-80gb-hbm3)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer repeats and timed steps (3 warm lowerings instead of 7, 2 cold processes "
        "per function instead of 3, 10 timed steps instead of 30)",
    )
    parser.add_argument(
        "--size",
        choices=SIZES,
        default="full",
        help="'full': GPT-2 small and a CIFAR-sized ResNet (default); "
        "'tiny': toy shapes, for testing the suite (no target counts)",
    )
    parser.add_argument(
        "--models",
        type=_comma_list(("gpt", "resnet"), "workload"),
        default=["gpt", "resnet"],
        help="comma-separated workloads (default: gpt,resnet)",
    )
    parser.add_argument(
        "--timings",
        choices=("auto", "on", "off"),
        default="auto",
        help="measure step time and memory: 'auto' on GPUs only (default); 'on' forces it "
        "(CPU figures are not meaningful, this is for testing the suite)",
    )
    parser.add_argument(
        "--skip",
        type=_comma_list(SKIPPABLE, "measurement"),
        default=[],
        help="comma-separated measurements to leave out: " + "; ".join(f"'{k}': {v}" for k, v in SKIPPABLE.items()),
    )
    parser.add_argument(
        "--repeats",
        type=int,
        help="timed warm lowerings per variant and per trace-overhead function (default: 7, 3 with --quick)",
    )
    parser.add_argument(
        "--cold-runs",
        type=int,
        help="fresh processes per model and function for the cold trace overhead (default: 3, 2 with --quick)",
    )
    parser.add_argument(
        "--runnable-rounds",
        type=int,
        help="rounds of lower + compile per function for time to a runnable step "
        "(default: 3, 1 with --quick; 0 or --skip runnable leaves it out)",
    )
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=_HERE / "results",
        help="where <label>.json and <label>.png go (default: benchmarks/results)",
    )
    parser.add_argument(
        "--results-md",
        type=Path,
        default=_HERE / "RESULTS.md",
        help="markdown file whose <label> section is replaced (default: benchmarks/RESULTS.md)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=450.0,
        help="seconds after which remaining step-timing runs are skipped (default: 450)",
    )
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    return args


@contextlib.contextmanager
def _phase(results: dict, name: str, title: str) -> Iterator[None]:
    """Announce a part of the run, and record and print how long it took."""
    print(f"== {title}", flush=True)
    start = time.perf_counter()
    yield
    results["phase_s"][name] = seconds = time.perf_counter() - start
    print(f"   ({seconds:.0f} s)", flush=True)


def _static(results: dict, selected: dict, repeats: int, compiled: tuple[str, ...]) -> None:
    """Per-variant static metrics and residual differences of every selected workload."""
    for wkey, workload in selected.items():
        title = f"{workload.title}: lowering, residuals, FLOPs, converts"
        # amp warns when it cannot rewrite something (e.g. a primitive changed in
        # a new JAX) and runs it at original precision: the figures then say
        # less than they seem to, so the warnings go into the results too.
        with (
            _phase(results, f"static {wkey}", title),
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.simplefilter("always")
            results["models"][wkey] = static_metrics(workload, repeats, compiled)
            excess = guarded(f"{wkey}: residual sources", lambda w=workload: {"rows": residual_excess(w)})
        results["residual_excess"][wkey] = excess.get("rows", excess)
        messages = sorted({str(w.message) for w in caught if "jaxamp" in str(w.message)})
        results["warnings"][wkey] = messages
        for message in messages:
            print(f"!! warning: {message}", flush=True)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmarks.

    Args:
        argv: command-line arguments (None: ``sys.argv[1:]``).

    Returns:
        Everything written to the JSON file.
    """
    args = parse_args(argv)
    started = time.perf_counter()
    repeats, steps, warmup = (3, 10, 2) if args.quick else (7, 30, 3)
    if args.repeats is not None:
        repeats = args.repeats
    cold_runs = args.cold_runs if args.cold_runs is not None else (2 if args.quick else 3)
    if "cold" in args.skip:
        cold_runs = 0
    runnable_rounds = args.runnable_rounds if args.runnable_rounds is not None else (1 if args.quick else 3)
    if "runnable" in args.skip:
        runnable_rounds = 0
    label = args.device_label or default_label()
    timed = args.timings == "on" or (args.timings == "auto" and jax.default_backend() == "gpu")
    selected = {k: w for k, w in workloads(args.size).items() if k in args.models}
    command = argv if argv is not None else sys.argv[1:]
    results: dict[str, Any] = {
        "label": label,
        "machine": machine_info(),
        "command": " ".join(["python -m benchmarks.run", *command]),
        "settings": {
            "size": args.size,
            "lower_repeats": repeats,
            "cold_runs": cold_runs,
            "runnable_rounds": runnable_rounds,
            "steps": steps,
            "warmup": warmup,
            "skip": args.skip,
        },
        "workloads": {k: w.title for k, w in selected.items()},
        "variants": {k: v.label for k, v in VARIANTS.items()},
        "models": {},
        "residual_excess": {},
        "warnings": {},
        "phase_s": {},
    }
    compiled = () if "compiled" in args.skip else COMPILED_VARIANTS
    _static(results, selected, repeats, compiled)
    if "trace" not in args.skip:
        title = "trace overhead (GPT-2 small unrolled, under lax.scan, 24 layers unrolled)"
        with _phase(results, "trace overhead", title):
            results["trace_overhead"] = guarded(
                "trace overhead",
                lambda: trace_overhead.measure(
                    args.size, repeats=repeats, cold_runs=cold_runs, runnable_rounds=runnable_rounds
                ),
            )
        if "error" not in results["trace_overhead"]:
            print(trace_overhead.format_results(results["trace_overhead"]), flush=True)
    if "eager" not in args.skip:
        with _phase(results, "eager overhead", "eager overhead"):
            results["eager"] = guarded("eager overhead", lambda: eager.measure(args.size))
        if "error" not in results["eager"]:
            print(eager.format_results(results["eager"]), flush=True)
    if timed:
        with _phase(results, "step time", "step time and peak memory (one process per run)"):
            timings = step_time.time_all(args.size, selected, steps, warmup, deadline=started + args.budget)
        for wkey, per_variant in timings.items():
            for vkey, figures in per_variant.items():
                results["models"][wkey][vkey].update(figures)
    else:
        results["timings_note"] = (
            f"step time, throughput and peak memory not measured: backend is "
            f"{jax.default_backend()}, they are only meaningful on a GPU"
        )
    for wkey, workload in selected.items():
        print(f"\n{workload.title}\n" + report.text_table(results["models"][wkey], workload.unit))
    results["targets"] = targets.evaluate(results)
    results["elapsed_s"] = time.perf_counter() - started

    args.results_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.results_dir / f"{label}.json"
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    png_path = report.plot(results, args.results_dir / f"{label}.png")
    report.update_markdown(args.results_md, results, json_path, png_path)
    print()
    for row in results["targets"]:
        print(targets.format_row(row))
    print(f"wrote {json_path}, {png_path} and the '{label}' section of {args.results_md}")
    print(f"took {results['elapsed_s']:.0f}s")
    return results


if __name__ == "__main__":
    main()
