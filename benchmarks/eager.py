"""What `jaxamp.amp` costs per call outside any jit.

Users call amp-wrapped functions eagerly too (in a notebook, a debugging
session, a loss printed at the end of training): there, nothing amortises the
transform over a compiled program, so its cost per call is its overhead. For
the MLP of `benchmarks.workloads.eager_workload` (8 layers of width 128, batch
16, float32 parameters), this compares the wall time of

    loss(params, x)          and          amp_loss(params, x)

with ``amp_loss = jaxamp.amp(loss)`` built once and reused, as a user would.
After a few untimed warm-up calls of each, the two take turns, each call timed
up to `jax.block_until_ready` on its result, and the medians are kept. The
target (amp / plain at most 1.3) is in `benchmarks.targets`.

    python -m benchmarks.eager [--calls 50]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import jax

import jaxamp
from benchmarks import targets
from benchmarks.workloads import SIZES, eager_workload

__all__ = ["format_results", "main", "measure"]


def measure(size: str = "full", calls: int = 50, warmup: int = 3) -> dict:
    """Median wall time of an eager call of the loss, plain and under amp.

    Args:
        size: the MLP's size (`benchmarks.workloads.eager_workload`).
        calls: timed calls of each function.
        warmup: untimed calls of each before them.

    Returns:
        ``{"title", "plain_s", "amp_s", "ratio", "calls"}``: the medians, amp's
        over plain's, and the number of timed calls of each.
    """
    workload = eager_workload(size)
    args = workload.concrete_args()
    functions = {"plain": workload.loss_fn, "amp": jaxamp.amp(workload.loss_fn)}
    for _ in range(warmup):
        for fn in functions.values():
            jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {name: [] for name in functions}
    gc.collect()
    for _ in range(calls):
        for name, fn in functions.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    plain, amp = (statistics.median(times[name]) for name in ("plain", "amp"))
    return {
        "title": workload.title,
        "plain_s": plain,
        "amp_s": amp,
        "ratio": amp / plain,
        "calls": calls,
    }


def format_results(results: dict) -> str:
    """One line: plain and amp milliseconds per call and their ratio."""
    return (
        f"{results['title']}: plain {results['plain_s'] * 1e3:.2f} ms, "
        f"amp {results['amp_s'] * 1e3:.2f} ms per call, amp / plain {results['ratio']:.2f} "
        f"(median of {results['calls']} calls each)"
    )


def main(argv: list[str] | None = None) -> dict:
    """Command-line entry point: print `measure`'s figure and its target; return it."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.eager",
        description="Time an eager call of an 8-layer MLP's loss, plain and under jaxamp.amp.",
    )
    parser.add_argument("--calls", type=int, default=50, help="timed calls of each function (default: 50)")
    parser.add_argument("--size", choices=SIZES, default="full", help="MLP size (default: full)")
    args = parser.parse_args(argv)
    results = measure(args.size, args.calls)
    print(f"JAX {jax.__version__}, backend {jax.default_backend()}")
    print(format_results(results))
    as_run = {"settings": {"size": args.size}, "eager": results}
    print(targets.format_figure(as_run, "eager overhead"))
    return results


if __name__ == "__main__":
    main()
