"""What `redo_on_nan` costs in time to a runnable step (lower + compile).

    python -m benchmarks.redo_compile [--repeats 5]      # from the repository root

A 12-layer float16 MLP's train step (`jaxamp.amp` + `dynamic_scale_value_and_grad`)
is lowered and compiled with ``redo_on_nan=0`` and ``redo_on_nan=10``,
alternately, with JAX's caches cleared before each; the medians and their
ratio are printed. The retry loop holds the only copy of the step (the loss is
traced once and the first attempt is the loop's first iteration), so the ratio
should be close to 1 (target: at most 1.10).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxamp

__all__ = ["measure", "main"]

LAYERS, WIDTH, BATCH = 12, 256, 32


def _params():
    keys = jax.random.split(jax.random.PRNGKey(0), LAYERS)
    return [jax.random.normal(k, (WIDTH, WIDTH)) / np.sqrt(WIDTH) for k in keys]


def _loss(params, x):
    for w in params:
        x = jnp.tanh(x @ w)
    return jnp.mean(x**2)


def _time_to_runnable(redo_on_nan: int, params, x) -> float:
    grad_fn = jaxamp.dynamic_scale_value_and_grad(
        jaxamp.amp(_loss, compute_dtype="f16"), filter=False, redo_on_nan=redo_on_nan
    )
    step = jax.jit(lambda p, x, s: grad_fn(p, x, dynamic_scaler_state=s))
    jax.clear_caches()
    start = time.perf_counter()
    step.lower(params, x, jaxamp.DynamicScalerState()).compile()
    return time.perf_counter() - start


def measure(repeats: int = 5) -> dict:
    """Median seconds to a runnable step for each setting, and their ratio."""
    params, x = _params(), jnp.ones((BATCH, WIDTH))
    times: dict[int, list[float]] = {0: [], 10: []}
    _time_to_runnable(0, params, x)  # warm up JAX's own Python
    for _ in range(repeats):
        for redo in times:
            times[redo].append(_time_to_runnable(redo, params, x))
    medians = {redo: statistics.median(t) for redo, t in times.items()}
    return {"redo_on_nan=0 s": medians[0], "redo_on_nan=10 s": medians[10], "ratio": medians[10] / medians[0]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    result = measure(parser.parse_args(argv).repeats)
    print(
        f"JAX {jax.__version__}, {jax.devices()[0].platform}: time to a runnable step, "
        f"{LAYERS}-layer f16 MLP: redo_on_nan=0 {result['redo_on_nan=0 s']:.3f} s, "
        f"redo_on_nan=10 {result['redo_on_nan=10 s']:.3f} s, ratio {result['ratio']:.2f}"
    )
    return result


if __name__ == "__main__":
    main()
