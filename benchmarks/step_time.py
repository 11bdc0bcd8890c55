"""Step time, throughput and peak device memory of a jitted AdamW training step.

Each (workload, variant) pair runs in a process of its own (`benchmarks.worker`),
so that the peak memory the device reports is that run's alone. The figures
only mean something on a GPU; the command line measures them there (or when
forced, to test this code).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import optax

from benchmarks import worker
from benchmarks.variants import VARIANTS
from benchmarks.workloads import Workload, workloads

__all__ = ["time_all", "time_training", "worker_task"]

_MAX_RUN_S = 300.0


def time_training(workload: Workload, variant_key: str, steps: int, warmup: int) -> dict:
    """Time a jitted AdamW step of one variant on the default device, in this process.

    Parameters and optimizer state are donated; every step is timed with
    `jax.block_until_ready`.

    Args:
        workload: the model, loss and batch shapes (parameters and batch are
            drawn at random).
        variant_key: a key of `benchmarks.variants.VARIANTS`.
        steps: timed steps.
        warmup: untimed steps before them.

    Returns:
        ``{"compile_s", "step_s" (median), "throughput" (items per second),
        "peak_bytes" (None where the device does not say), "final_loss"}``,
        plus ``"loss_scale"`` and ``"nonfinite_steps"`` for scaled variants.
    """
    variant = VARIANTS[variant_key]
    params, *batch = workload.concrete_args()
    step, optimizer = variant.train_step(workload.loss_fn, optax.adamw(1e-4))
    # Copied leaf by leaf: optimizer states may hold one array in two places
    # (jaxamp.scaling.skip_nonfinite_updates' two zero counters), which cannot be donated.
    opt_state = jax.tree_util.tree_map(jnp.copy, optimizer.init(params))
    scaler = variant.init_scaler()
    start = time.perf_counter()
    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, scaler, *batch)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        params, opt_state, scaler, loss = jax.block_until_ready(compiled(params, opt_state, scaler, *batch))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    stats = jax.local_devices()[0].memory_stats() or {}
    result = {
        "compile_s": compile_s,
        "step_s": step_s,
        "throughput": workload.items_per_step / step_s,
        "peak_bytes": stats.get("peak_bytes_in_use"),
        "final_loss": float(loss),
    }
    if scaler is not None:
        result["loss_scale"] = float(scaler.scaler)
        result["nonfinite_steps"] = int(scaler.total_resets)
    return result


def worker_task(size: str, workload: str, variant: str, steps: int, warmup: int) -> dict:
    """`time_training` of a workload named by size and key (what a worker runs)."""
    return time_training(workloads(size)[workload], variant, steps, warmup)


def time_all(
    size: str, workload_keys: Iterable[str], steps: int, warmup: int, deadline: float
) -> dict[str, dict[str, dict]]:
    """`time_training` of every variant of every workload, each in its own process.

    Args:
        size: the workloads' size (`benchmarks.workloads.workloads`).
        workload_keys: which workloads.
        steps: timed steps per run.
        warmup: untimed steps before them.
        deadline: a `time.perf_counter` value; runs that would start within 30
            s of it are skipped, so a run ends with a partial table rather than
            being killed.

    Returns:
        workload key -> variant key -> `time_training`'s figures, or
        ``{"timing_error": ...}`` for a run that failed or was skipped.
    """
    results: dict[str, dict[str, dict]] = {}
    for wkey in workload_keys:
        for vkey, variant in VARIANTS.items():
            left = deadline - time.perf_counter()
            if left < 30:
                results.setdefault(wkey, {})[vkey] = {"timing_error": "skipped: time budget spent"}
                continue
            print(f"   timing {wkey} / {variant.label} ...", flush=True)
            kwargs = {
                "size": size,
                "workload": wkey,
                "variant": vkey,
                "steps": steps,
                "warmup": warmup,
            }
            timing = worker.run(worker_task, kwargs, timeout_s=min(_MAX_RUN_S, left))
            if "error" in timing:
                timing = {"timing_error": timing["error"]}
                print(f"   !! {timing['timing_error']}", flush=True)
            results.setdefault(wkey, {})[vkey] = timing
    return results
