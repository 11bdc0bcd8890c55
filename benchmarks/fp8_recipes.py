"""fp8 mode's scaling recipes side by side: error against float32, residual bytes, float8 FLOPs, all-reduces.

    python -m benchmarks.fp8_recipes          # from the repository root

For each `jaxamp.fp8.Fp8Recipe(scaling=...)` (and bf16 mode for reference):

* a linear layer, torchao's accuracy test: ``x[2048, 1024] @ w[1024, 1024]``
  (normal entries), the output's and the weight gradient's signal-to-quantisation
  noise ratio (SQNR, dB) against float32; torchao holds its float8 linear at
  >= 18 dB (output) and >= 17 dB (weight gradient) against bf16;
* the benchmark models at ``"tiny"`` size (`benchmarks.workloads`; the same
  architectures as the tables' GPT and ResNet, small enough to run float32 on
  a CPU): the loss's relative error and the gradient's SQNR against float32;
* the same models at ``"full"`` size, lowered only: residual bytes of
  ``jax.vjp`` and the share of matmul FLOPs in float8;
* the data-parallel step of `benchmarks.collectives` (4 host devices, an
  Explicit mesh): all-reduces in the compiled program.

float8 is emulated on a CPU: accuracy figures hold anywhere, speed needs a GPU.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before JAX starts: four host devices
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import jaxamp

from . import measure
from .workloads import workloads

__all__ = ["RECIPES", "main", "sqnr_db"]

RECIPES = {
    "bf16": "bf16",
    # Every size: these figures measure float8's accuracy, not when it pays (keep_small_bf16).
    **{scaling: jaxamp.fp8.Fp8Recipe(scaling=scaling, keep_small_bf16=None) for scaling in
       ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "blockwise", "delayed")},
}  # fmt: skip
ACCURACY_RECIPES = {name: recipe for name, recipe in RECIPES.items() if name != "delayed"}
"""The recipes measured for accuracy on one batch. The delayed recipe scales a
batch by the amaxes of the steps before it: on the same batch again those are
its own, which is tensorwise's result (`tests/test_fp8_delayed.py` checks the
first step bit for bit); its accuracy is a training figure (`examples/char_lm.py`)."""


def _with_state(loss, recipe, *args):
    """`loss` as ``f(state, *args)`` (the state its first argument, differentiated) and a state, for
    the delayed recipe; otherwise ``(f(None, *args), None)``."""
    if not (isinstance(recipe, jaxamp.fp8.Fp8Recipe) and recipe.scaling == "delayed"):
        return (lambda state, *a: loss(*a)), None
    return (lambda state, *a: loss(*a, fp8_state=state)), jaxamp.fp8.init_fp8_state(loss, *args)


def sqnr_db(reference, value) -> float:
    """``20 log10(|reference| / |reference - value|)`` over all leaves."""
    ref = np.concatenate([np.ravel(np.asarray(r, np.float64)) for r in jax.tree.leaves(reference)])
    val = np.concatenate([np.ravel(np.asarray(v, np.float64)) for v in jax.tree.leaves(value)])
    noise = np.linalg.norm(ref - val)
    return float("inf") if noise == 0 else float(20 * np.log10(np.linalg.norm(ref) / noise))


def _as_last_matmul_too(compute_dtype):
    # A single linear layer is its program's last matmul, which recipes keep in bf16 by default.
    if isinstance(compute_dtype, jaxamp.fp8.Fp8Recipe):
        import dataclasses

        return dataclasses.replace(compute_dtype, keep_last_matmul_bf16=False)
    return compute_dtype


def linear_layer() -> dict[str, dict]:
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (2048, 1024))
    w = jax.random.normal(k[1], (1024, 1024)) / 32
    g = jax.random.normal(k[2], (2048, 1024))

    def run(compute_dtype):
        def forward(w):
            return x @ w

        fn = forward if compute_dtype is None else jaxamp.amp(forward, compute_dtype=_as_last_matmul_too(compute_dtype))
        out, vjp = jax.vjp(fn, w)
        return out.astype(jnp.float32), vjp(g.astype(out.dtype))[0]

    ref_out, ref_grad = run(None)
    bf16_out, bf16_grad = run("bf16")
    rows = {}
    for name, recipe in ACCURACY_RECIPES.items():
        out, grad = run(recipe)
        rows[name] = {
            "output dB vs f32": sqnr_db(ref_out, out),
            "weight grad dB vs f32": sqnr_db(ref_grad, grad),
            "output dB vs bf16": sqnr_db(bf16_out, out),
            "weight grad dB vs bf16": sqnr_db(bf16_grad, grad),
        }
    return rows


def models() -> dict[str, dict[str, dict]]:
    """Tiny GPT and ResNet: loss error and gradient SQNR against float32, per recipe."""
    results = {}
    for key, workload in workloads("tiny").items():
        model, *batch = workload.concrete_args()
        ref_loss, ref_grad = eqx.filter_jit(eqx.filter_value_and_grad(workload.loss_fn))(model, *batch)
        rows = {}
        for name, recipe in ACCURACY_RECIPES.items():
            amped = jaxamp.amp(workload.loss_fn, compute_dtype=recipe)
            loss, grad = eqx.filter_jit(eqx.filter_value_and_grad(amped))(model, *batch)
            rows[name] = {
                "loss rel. error": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
                "grad dB vs f32": sqnr_db(ref_grad, grad),
            }
        results[key] = rows
    return results


def static() -> dict[str, dict[str, dict]]:
    """Full-size GPT and ResNet, lowered only: residual bytes and float8 FLOP share, per recipe."""
    results = {}
    for key, workload in workloads("full").items():
        model, *batch = workload.abstract_args()
        rows = {}
        for name, recipe in RECIPES.items():
            loss, state = _with_state(jaxamp.amp(workload.loss_fn, compute_dtype=recipe), recipe, model, *batch)
            residuals = measure.residuals(loss, state, model, *batch)
            # The gradient with respect to the model (and the delayed recipe's state).
            grad = eqx.filter_grad(lambda differentiated, *b: loss(*differentiated, *b))  # noqa: B023 (traced here)
            flops = measure.matmul_flops(eqx.filter_make_jaxpr(grad)((state, model), *batch)[0])
            total = max(sum(flops.values()), 1)
            rows[name] = {
                "residual GB": residuals.saved_bytes / 1e9,
                "float8 FLOP share": sum(n for d, n in flops.items() if d.startswith("float8")) / total,
            }
        results[key] = rows
    return results


def all_reduces() -> dict[str, int]:
    """All-reduces of `benchmarks.collectives`' data-parallel step on an Explicit mesh, per recipe."""
    from jax.sharding import AxisType

    from .collectives import _compiled_all_reduces, _delayed_step, _step

    steps = {
        name: (
            lambda mesh, r=recipe, make=_delayed_step if name == "delayed" else _step: make(
                "jit", False, False, mesh, r
            )
        )
        for name, recipe in RECIPES.items()
    }
    return {name: figures["all-reduces"] for name, figures in _compiled_all_reduces(AxisType.Explicit, steps).items()}


def main() -> dict:
    print(f"JAX {jax.__version__}, {jax.devices()[0].device_kind}, {len(jax.devices())} devices")
    results = {"linear": linear_layer()}
    print("\nLinear layer 2048x1024x1024: SQNR (dB)")
    print("| recipe | output vs f32 | weight grad vs f32 | output vs bf16 | weight grad vs bf16 |")
    print("|---|---|---|---|---|")
    for name, r in results["linear"].items():
        print(f"| {name} | {r['output dB vs f32']:.1f} | {r['weight grad dB vs f32']:.1f} | "
              f"{r['output dB vs bf16']:.1f} | {r['weight grad dB vs bf16']:.1f} |")  # fmt: skip
    results["models"] = models()
    for key, rows in results["models"].items():
        print(f"\n{key} (tiny size): against float32")
        print("| recipe | loss relative error | gradient SQNR (dB) |")
        print("|---|---|---|")
        for name, r in rows.items():
            print(f"| {name} | {r['loss rel. error']:.2e} | {r['grad dB vs f32']:.1f} |")
    results["static"] = static()
    results["all-reduces"] = all_reduces()
    for key, rows in results["static"].items():
        print(f"\n{key} (full size, lowered): residual bytes, float8 share of matmul FLOPs; DP all-reduces (MLP)")
        print("| recipe | residual GB | float8 FLOP share | all-reduces (DP, Explicit) |")
        print("|---|---|---|---|")
        for name, r in rows.items():
            reduces = results["all-reduces"][name]
            print(f"| {name} | {r['residual GB']:.3f} | {r['float8 FLOP share']:.3f} | {reduces} |")
    return results


if __name__ == "__main__":
    main()
