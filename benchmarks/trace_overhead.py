"""How much longer tracing, lowering and compiling take under `jaxamp.amp`.

For each model of `benchmarks.workloads.trace_workloads` (GPT-2 small with its
12 layers unrolled, under `lax.scan`, and unrolled at 24 layers), compares::

    jax.jit(jax.value_and_grad(jaxamp.amp(loss, compute_dtype="bf16"))).lower(model, tokens, targets)

with the same for ``loss`` itself (the target's baseline) and for ``loss``
cast by hand to the same compute dtype (`benchmarks.variants.hand_cast`, jmp
style): a mixed-precision program costs more to differentiate and lower than a
float32 one whoever writes the casts (more distinct dtypes, more converts), so
amp / hand-cast is the part of the overhead that is amp's own. Two settings:

* **warm** (`warm`): the median of repeated lowerings in one process, each of a
  freshly built function (`benchmarks.measure.median_lower_seconds`), after one
  untimed round: the cost a user pays on every re-trace once JAX's own caches
  (`jax.numpy`'s jit'd functions, linearization rules) are filled;
* **cold** (`cold`): the first lowering in a fresh Python process
  (`benchmarks.worker`), with imports (jaxamp's included, for both) and the
  abstract model built before the timer starts: the cost a user pays on the
  first step of a script. Plain and amp alternate, one process each, and the
  median of the runs is kept;
* **runnable** (`runnable`): time to a runnable step, lowering and XLA
  compilation (``.lower(...).compile()``) with JAX's caches cleared before
  each, plain, hand-cast and amp taking turns, the median of the rounds: what
  the user waits for before the first step runs.

Nothing is run, and the models are abstract (`jax.ShapeDtypeStruct` leaves).
Lowering needs no accelerator; compile times are the backend's own (on CPU,
XLA compiles bfloat16 scans slowly, and hand-cast code pays the same). The
targets, in `benchmarks.targets`: amp / hand-cast at most 1.00 for time to a
runnable step and 1.10 for the warm trace (amp's own cost against what its user
would otherwise write), and amp / plain at most 1.25 cold.

    python -m benchmarks.trace_overhead [--repeats 7] [--cold-runs 3] [--runnable-rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Iterable, Iterator

import jax

import jaxamp
from benchmarks import targets, worker
from benchmarks.measure import median_lower_seconds, runnable_seconds
from benchmarks.variants import hand_cast
from benchmarks.workloads import SIZES, trace_workloads

__all__ = [
    "cold",
    "cold_lower_seconds",
    "each_setting",
    "format_results",
    "main",
    "measure",
    "runnable",
    "warm",
]

_COLD_TIMEOUT_S = 300.0


# The functions compared, in the order they take turns.
FUNCTIONS = ("plain", "hand", "amp")


def _loss(loss_fn, function: str, compute_dtype: str):
    if function == "amp":
        return jaxamp.amp(loss_fn, compute_dtype=compute_dtype)
    if function == "hand":
        return hand_cast(loss_fn, jaxamp.get_policy(f"p=f32,c={compute_dtype},o=f32"))
    return loss_fn


def _value_and_grad_builder(loss_fn, function: str, compute_dtype: str):
    # A new function on every call, so that no trace cache answers for a repeat.
    return lambda: jax.value_and_grad(_loss(loss_fn, function, compute_dtype))


def _summary(seconds: dict[str, float]) -> dict[str, float]:
    return {
        **{f"{name}_s": seconds[name] for name in FUNCTIONS},
        "ratio": seconds["amp"] / seconds["plain"],
        "ratio_to_hand": seconds["amp"] / seconds["hand"],
    }


def warm(
    size: str = "full", repeats: int = 7, compute_dtype: str = "bf16", models: Iterable[str] = ()
) -> dict[str, dict[str, float]]:
    """Median lowering times of plain, hand-cast and amp value-and-grad in this process.

    Args:
        size: the models' size (`benchmarks.workloads.trace_workloads`).
        repeats: timed rounds per function (after one untimed warm-up round).
        compute_dtype: amp's compute dtype.
        models: keys of the models to measure (default: all).

    Returns:
        model key -> ``{"plain_s", "hand_s", "amp_s", "ratio", "ratio_to_hand"}``
        (ratio: amp over plain; ratio_to_hand: amp over hand-cast).
    """
    available = trace_workloads(size)
    results = {}
    for key in models or available:
        workload = available[key]
        args = workload.abstract_args()
        builders = {name: (_value_and_grad_builder(workload.loss_fn, name, compute_dtype), args) for name in FUNCTIONS}
        results[key] = _summary(median_lower_seconds(builders, repeats))
    return results


def cold_lower_seconds(size: str, model: str, function: str, compute_dtype: str = "bf16") -> dict:
    """Time this process's first lowering of one model's value-and-grad (worker side).

    Call it in a fresh process (`cold` does, through `benchmarks.worker`): in
    any other, JAX's caches are warm.

    Args:
        size: the models' size (`benchmarks.workloads.trace_workloads`).
        model: the model's key.
        function: ``"plain"`` (``value_and_grad(loss)``), ``"hand"`` (``loss``
            cast by hand) or ``"amp"`` (``value_and_grad(jaxamp.amp(loss))``).
        compute_dtype: amp's and the hand casts' compute dtype.

    Returns:
        ``{"seconds": ...}``.
    """
    workload = trace_workloads(size)[model]
    # Outside the timer, identical for every function: the abstract model (which
    # also starts JAX's backend) and a collection of the garbage it left.
    args = workload.abstract_args()
    jax.devices()
    gc.collect()
    start = time.perf_counter()
    jax.jit(jax.value_and_grad(_loss(workload.loss_fn, function, compute_dtype))).lower(*args)
    return {"seconds": time.perf_counter() - start}


def cold(size: str = "full", runs: int = 3, compute_dtype: str = "bf16", models: Iterable[str] = ()) -> dict[str, dict]:
    """Median first lowerings of plain, hand-cast and amp value-and-grad, each in a fresh process.

    For each model, `runs` rounds of one plain, one hand-cast and one amp
    process (`cold_lower_seconds`), taking turns.

    Args:
        size: the models' size (`benchmarks.workloads.trace_workloads`).
        runs: processes per model and per function.
        compute_dtype: amp's compute dtype.
        models: keys of the models to measure (default: all).

    Returns:
        model key -> ``{"plain_s", "hand_s", "amp_s", "ratio", "ratio_to_hand",
        "plain_runs", "hand_runs", "amp_runs"}`` (medians, the ratios as in
        `warm` and every run's seconds), or ``{"error": ...}``
        when a process failed.
    """
    return {key: _cold_one(size, key, runs, compute_dtype) for key in models or trace_workloads(size)}


def _cold_one(size: str, model: str, runs: int, compute_dtype: str) -> dict:
    samples: dict[str, list[float]] = {name: [] for name in FUNCTIONS}
    for _ in range(runs):
        for name in FUNCTIONS:
            kwargs = {"size": size, "model": model, "function": name, "compute_dtype": compute_dtype}
            out = worker.run(cold_lower_seconds, kwargs, timeout_s=_COLD_TIMEOUT_S)
            if "error" in out:
                return {"error": f"{name}: {out['error']}"}
            samples[name].append(out["seconds"])
    medians = {name: statistics.median(times) for name, times in samples.items()}
    return {**_summary(medians), **{f"{name}_runs": samples[name] for name in FUNCTIONS}}


def runnable(
    size: str = "full", rounds: int = 3, compute_dtype: str = "bf16", models: Iterable[str] = ()
) -> dict[str, dict[str, float]]:
    """Median time to a runnable step (lower and compile) of plain, hand-cast and amp value-and-grad.

    Args:
        size: the models' size (`benchmarks.workloads.trace_workloads`).
        rounds: timed rounds, each compiling every function once with JAX's
            caches cleared before each (after one untimed round).
        compute_dtype: amp's compute dtype.
        models: keys of the models to measure (default: all).

    Returns:
        model key -> ``{"plain_s", "hand_s", "amp_s", "ratio", "ratio_to_hand"}``.
    """
    available = trace_workloads(size)
    results = {}
    for key in models or available:
        workload = available[key]
        args = workload.abstract_args()
        samples: dict[str, list[float]] = {name: [] for name in FUNCTIONS}
        for round_ in range(rounds + 1):
            for name in FUNCTIONS:
                step = jax.jit(_value_and_grad_builder(workload.loss_fn, name, compute_dtype)())
                seconds = sum(runnable_seconds(step, *args))
                if round_:  # the first round fills JAX's own Python-level state
                    samples[name].append(seconds)
        results[key] = _summary({name: statistics.median(t) for name, t in samples.items()})
    return results


def measure(
    size: str = "full",
    repeats: int = 7,
    cold_runs: int = 3,
    compute_dtype: str = "bf16",
    models: Iterable[str] = (),
    runnable_rounds: int = 0,
) -> dict[str, dict]:
    """`warm`, `cold` and `runnable` figures of every model.

    Args:
        size: the models' size (`benchmarks.workloads.trace_workloads`).
        repeats: `warm`'s timed rounds.
        cold_runs: `cold`'s processes per model and function; 0 skips `cold`.
        compute_dtype: amp's compute dtype.
        models: keys of the models to measure (default: all).
        runnable_rounds: `runnable`'s timed rounds; 0 (the default) skips it.

    Returns:
        model key -> ``{"title": ..., "warm": ..., "cold": ..., "runnable": ...}``
        (``"cold"`` and ``"runnable"`` missing when skipped).
    """
    available = trace_workloads(size)
    keys = list(models or available)
    results = {key: {"title": available[key].title} for key in keys}
    for key, figures in warm(size, repeats, compute_dtype, keys).items():
        results[key]["warm"] = figures
    if cold_runs:
        for key, figures in cold(size, cold_runs, compute_dtype, keys).items():
            results[key]["cold"] = figures
    if runnable_rounds:
        for key, figures in runnable(size, runnable_rounds, compute_dtype, keys).items():
            results[key]["runnable"] = figures
    return results


def each_setting(results: dict[str, dict]) -> Iterator[tuple[str, str, dict]]:
    """``(model key, setting, figures)`` for each setting `measure` ran, in table order."""
    for key, per_setting in results.items():
        for setting in ("warm", "cold", "runnable"):
            if setting in per_setting:
                yield key, setting, per_setting[setting]


def format_results(results: dict[str, dict]) -> str:
    """A plain-text table of `measure`'s results: one row per model and setting."""
    header = f"{'model':<14} {'setting':<8} {'plain':>8} {'hand':>8} {'amp':>8} {'amp/plain':>9} {'amp/hand':>8}"
    lines = [header]
    for key, setting, r in each_setting(results):
        if "error" in r:
            lines.append(f"{key:<14} {setting:<8} !! {r['error']}")
            continue
        lines.append(
            f"{key:<14} {setting:<8} {r['plain_s']:>7.3f}s {r['hand_s']:>7.3f}s "
            f"{r['amp_s']:>7.3f}s {r['ratio']:>9.2f} {r['ratio_to_hand']:>8.2f}"
        )
    lines += [f"{key}: {r['title']}" for key, r in results.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, dict]:
    """Command-line entry point: print `measure`'s table and its targets; return the results."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.trace_overhead",
        description=(
            "Time jax.jit(jax.value_and_grad(amp(f))).lower(...) against the same for f "
            "and for f cast by hand, "
            "warm (median of repeats in this process) and cold (first lowering in a fresh "
            "process), for GPT-2 small unrolled, under lax.scan and unrolled at 24 layers."
        ),
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed warm lowerings per function (default: 7)")
    parser.add_argument(
        "--cold-runs",
        type=int,
        default=3,
        help="fresh processes per model and function for the cold figure; 0 skips it (default: 3)",
    )
    parser.add_argument(
        "--runnable-rounds",
        type=int,
        default=3,
        help="rounds of lower + compile per function for time to a runnable step; 0 skips it (default: 3)",
    )
    parser.add_argument("--size", choices=SIZES, default="full", help="model size (default: full)")
    parser.add_argument("--compute-dtype", default="bf16", help="amp's compute dtype (default: bf16)")
    args = parser.parse_args(argv)
    results = measure(
        args.size, args.repeats, args.cold_runs, args.compute_dtype,
        runnable_rounds=args.runnable_rounds,
    )  # fmt: skip
    print(
        f"JAX {jax.__version__}: median of {args.repeats} warm lowerings, "
        f"{args.cold_runs} cold processes per function, "
        f"{args.runnable_rounds} rounds of lower + compile"
    )
    print(format_results(results))
    as_run = {"settings": {"size": args.size}, "trace_overhead": results}
    print(targets.format_figure(as_run, "trace overhead"))
    return results


if __name__ == "__main__":
    main()
