"""How much longer tracing and lowering take under `jaxamp.amp` (issue 2 acceptance).

For a 12-layer GPT-style model, written once with the layers unrolled and once
with `jax.lax.scan`, compares the median time of::

    jax.jit(jax.value_and_grad(jaxamp.amp(loss))).lower(model, tokens, targets)

with the same for ``loss`` itself. Target: a ratio of at most 1.5. Nothing is
compiled or run, and the model is abstract (`jax.ShapeDtypeStruct` leaves), so
the figures are the same on any backend and the script needs no accelerator.

    python benchmarks/trace_overhead.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxamp  # noqa: E402
from benchmarks.measure import median_lower_seconds  # noqa: E402
from benchmarks.models import GPT, GPT2_SMALL, lm_loss  # noqa: E402

__all__ = ["TARGET_RATIO", "main", "measure"]

TARGET_RATIO = 1.5
BATCH = 8


def measure(repeats: int = 7, compute_dtype: str = "bf16") -> dict[str, dict[str, float]]:
    """Median lowering times of plain and amp value-and-grad, unrolled and scanned.

    Args:
        repeats: timed rounds per function (after one untimed warm-up round).
        compute_dtype: amp's compute dtype.

    Returns:
        ``{"unrolled": {...}, "scan": {...}}``, each with ``plain_s``, ``amp_s``,
        ``ratio`` (amp over plain) and ``meets_target`` (1.0 or 0.0).
    """
    tokens = jax.ShapeDtypeStruct((BATCH, GPT2_SMALL.seq_len), jnp.int32)
    results = {}
    for name, scan_layers in (("unrolled", False), ("scan", True)):
        config = dataclasses.replace(GPT2_SMALL, scan_layers=scan_layers)
        model = eqx.filter_eval_shape(GPT, config, key=jax.random.key(0))
        args = (model, tokens, tokens)
        amp_loss = lambda: jaxamp.amp(lm_loss, compute_dtype=compute_dtype)  # noqa: E731
        medians = median_lower_seconds(
            {
                "plain": (lambda: jax.value_and_grad(lm_loss), args),
                "amp": (lambda: jax.value_and_grad(amp_loss()), args),
            },
            repeats,
        )
        ratio = medians["amp"] / medians["plain"]
        results[name] = {
            "plain_s": medians["plain"],
            "amp_s": medians["amp"],
            "ratio": ratio,
            "meets_target": float(ratio <= TARGET_RATIO),
        }
    return results


def format_results(results: dict[str, dict[str, float]]) -> str:
    """A small text table of `measure`'s results."""
    lines = [f"{'layers':<9} {'plain':>8} {'amp':>8} {'ratio':>6}  target <= {TARGET_RATIO}"]
    for name, r in results.items():
        verdict = "ok" if r["meets_target"] else "MISSED"
        lines.append(
            f"{name:<9} {r['plain_s']:>7.3f}s {r['amp_s']:>7.3f}s {r['ratio']:>6.2f}  {verdict}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Command-line entry point; returns `measure`'s results."""
    parser = argparse.ArgumentParser(
        description=(
            "Time jax.jit(jax.value_and_grad(amp(f))).lower(...) against the same for f, "
            "for a 12-layer GPT-2-small-shaped model written unrolled and with lax.scan."
        )
    )
    parser.add_argument(
        "--repeats", type=int, default=7, help="timed lowerings per function (default: 7)"
    )
    parser.add_argument(
        "--compute-dtype", default="bf16", help="amp's compute dtype (default: bf16)"
    )
    args = parser.parse_args(argv)
    results = measure(args.repeats, args.compute_dtype)
    print(f"JAX {jax.__version__}, 12-layer GPT, median of {args.repeats} lowerings")
    print(format_results(results))
    return results


if __name__ == "__main__":
    main()
