"""The numerics monitor's cost: a monitored training step against the same step unmonitored.

    python -m benchmarks.monitor_overhead          # from the repository root

The step is the benchmarks' GPT (`benchmarks.models.GPT`, layers under
`lax.scan`) with AdamW, in a variant of `benchmarks.variants` (``amp_bf16``
and ``amp_f16_scaled`` by default), jitted and compiled. The monitored step
is ``jaxamp.monitoring.monitor(step)``: the same step, returning its statistics (every
low-precision matmul's operands and result and every value a named scope hands
on, forward and backward). Both are timed in alternation, each step with
`jax.block_until_ready`; the figure is the ratio of the medians. The target is
at most 1.15x (issue 25).

The default shape (``"cpu"``: 4 layers, d=256, seq 256, vocab 8192, batch 8)
is a GPT a 2-core CPU runs in about a second a step; ``"tiny"`` is for tests.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax

import jaxamp

from .models import GPTConfig
from .variants import VARIANTS
from .workloads import _gpt_workload

__all__ = ["SHAPES", "TARGET", "main", "overhead"]

TARGET = 1.15
SHAPES = {
    "cpu": (GPTConfig(vocab_size=8192, seq_len=256, d_model=256, n_heads=4, n_layers=4), 8),
    "tiny": (GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_heads=4, n_layers=2), 2),
}


def overhead(shape: str = "cpu", variant: str = "amp_bf16", steps: int = 10, warmup: int = 2) -> dict:
    """Median step times, monitored and not, and their ratio.

    Returns:
        ``{"plain_s", "monitored_s", "ratio", "sites", "compile_plain_s",
        "compile_monitored_s"}``.
    """
    config, batch = SHAPES[shape]
    workload = _gpt_workload("gpt", config, batch)
    params, *data = workload.concrete_args()
    step, optimizer = VARIANTS[variant].train_step(workload.loss_fn, optax.adamw(1e-4))
    opt_state = optimizer.init(params)
    scaler = VARIANTS[variant].init_scaler()
    args = (params, opt_state, scaler, *data)
    compiled, compile_s = {}, {}
    for name, fn in (("plain", step), ("monitored", jaxamp.monitoring.monitor(step))):
        start = time.perf_counter()
        compiled[name] = jax.jit(fn).lower(*args).compile()
        compile_s[name] = time.perf_counter() - start
    sites = len(jax.block_until_ready(compiled["monitored"](*args))[1].sites)
    times: dict[str, list] = {"plain": [], "monitored": []}
    for i in range(warmup + steps):
        for name in ("plain", "monitored"):  # alternated, so drift hits both alike
            start = time.perf_counter()
            jax.block_until_ready(compiled[name](*args))
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    plain, monitored = statistics.median(times["plain"]), statistics.median(times["monitored"])
    return dict(
        plain_s=plain, monitored_s=monitored, ratio=monitored / plain, sites=sites,
        compile_plain_s=compile_s["plain"], compile_monitored_s=compile_s["monitored"],
    )  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="cpu")
    parser.add_argument("--variants", nargs="+", default=["amp_bf16", "amp_f16_scaled"], choices=sorted(VARIANTS))
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    print(f"JAX {jax.__version__}, {jax.devices()[0].device_kind}, GPT {args.shape}: {SHAPES[args.shape][0]}")
    print("| variant | sites | step (s) | monitored step (s) | ratio | target | compile (s) | monitored compile (s) |")
    print("|---|---|---|---|---|---|---|---|")
    results = {}
    for variant in args.variants:
        r = results[variant] = overhead(args.shape, variant, steps=args.steps)
        verdict = "met" if r["ratio"] <= TARGET else "MISSED"
        print(f"| {variant} | {r['sites']} | {r['plain_s']:.3f} | {r['monitored_s']:.3f} | {r['ratio']:.3f}x | "
              f"<= {TARGET}x ({verdict}) | {r['compile_plain_s']:.1f} | {r['compile_monitored_s']:.1f} |")  # fmt: skip
    return results


if __name__ == "__main__":
    jnp.zeros(())  # start the backend before timing anything
    main()
