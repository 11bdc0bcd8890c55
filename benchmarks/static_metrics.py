"""Figures of each variant's training step that need no accelerator.

For a workload (`benchmarks.workloads`) and every variant (`benchmarks.variants`),
`static_metrics` measures the value-and-grad step from the abstract model
(`jax.ShapeDtypeStruct` leaves): how long it takes to trace and lower, the
residual bytes kept for the backward pass, the share of matmul FLOPs in half
precision and in float8, and the converts in the lowered program; and, for the
variants the targets compare (`COMPILED_VARIANTS`), the converts XLA's
optimisations leave in the compiled program. `residual_excess` then says where
amp's residuals differ from hand-cast code's, source line by source line.

Everything but ``compiled_converts`` is the same on every backend; compiling
GPT-2 small takes seconds per variant on a CPU, hence the restriction.
"""

from __future__ import annotations

import equinox as eqx
import jax

from benchmarks import measure
from benchmarks.guard import guarded
from benchmarks.variants import VARIANTS
from benchmarks.workloads import Workload

__all__ = ["BASELINE", "COMPILED_VARIANTS", "residual_excess", "static_metrics"]

BASELINE = "f32"
"""The variant the ``lower_ratio`` of the others is relative to."""

COMPILED_VARIANTS = ("hand_bf16", "amp_bf16", "hand_f16_scaled", "amp_f16_scaled")
"""The variants whose step is compiled to count ``compiled_converts``: those the
compiled-converts targets set side by side (`benchmarks.targets`)."""

_HALF = ("bfloat16", "float16")


def _one_variant(workload: Workload, key: str, args: tuple, compile_step: bool) -> dict:
    """Residuals, FLOP shares and converts of one variant's step at ``args``
    (``(model, *batch)``, abstract)."""
    variant = VARIANTS[key]
    model, *batch = args
    grad_fn = variant.value_and_grad(workload.loss_fn)
    step_args = (variant.init_scaler(), model, *batch)
    res = measure.residuals(variant.wrap(workload.loss_fn), model, *batch)
    traced = jax.jit(grad_fn).trace(*step_args)  # traced once: its jaxpr for the FLOPs, lowered for the converts
    flops = measure.matmul_flops(traced.jaxpr)
    total = max(sum(flops.values()), 1)
    lowered = traced.lower()
    out = {
        "residual_bytes": res.saved_bytes,
        "residual_bytes_by_dtype": res.bytes_by_dtype,
        "matmul_flops": sum(flops.values()),
        "half_flop_share": sum(n for d, n in flops.items() if d in _HALF) / total,
        "fp8_flop_share": sum(n for d, n in flops.items() if d.startswith("float8")) / total,
        "converts": measure.count_converts(lowered.as_text()),
    }
    if compile_step:
        compiled_text = lowered.compile().as_text()
        out["compiled_converts"] = measure.count_compiled_converts(compiled_text)
    return out


def static_metrics(workload: Workload, repeats: int, compiled: tuple[str, ...] = COMPILED_VARIANTS) -> dict[str, dict]:
    """Measure every variant's value-and-grad step without running it.

    Args:
        workload: the model, loss and batch shapes.
        repeats: timed lowerings per variant (`measure.median_lower_seconds`).
        compiled: the variants whose step is also compiled to count
            ``compiled_converts``.

    Returns:
        variant key -> ``{"lower_s", "lower_ratio", "residual_bytes",
        "residual_bytes_by_dtype", "matmul_flops", "half_flop_share",
        "fp8_flop_share", "converts"}`` plus ``"compiled_converts"`` for the
        variants in `compiled`. A figure that could not be measured is missing
        and an ``"error"`` says why.
    """
    args = workload.abstract_args()
    model, *batch = args
    builders = {
        key: (
            lambda v=variant: v.value_and_grad(workload.loss_fn),
            (variant.init_scaler(), model, *batch),
        )
        for key, variant in VARIANTS.items()
    }
    medians = guarded(f"{workload.key}: lowering", lambda: measure.median_lower_seconds(builders, repeats))
    results: dict[str, dict] = {}
    for key in VARIANTS:
        out = results[key] = {}
        if key in medians:
            out["lower_s"] = medians[key]
        out.update(
            guarded(
                f"{workload.key}/{key}: static metrics",
                lambda key=key: _one_variant(workload, key, args, key in compiled),
            )
        )
    base = results[BASELINE]
    for out in results.values():
        if "lower_s" in out and "lower_s" in base:
            out["lower_ratio"] = out["lower_s"] / base["lower_s"]
    return results


def residual_excess(workload: Workload, top: int = 6) -> list[dict]:
    """The source lines where amp bf16 and hand-cast bf16 save different residual bytes.

    Measured on the loop-free form of the model, so that residuals are
    attributed to the operations producing them rather than to a scan. A cast
    may be attributed to different lines in the two programs (hand-cast casts
    the weights at the top, amp where they are used), so read the rows together.

    Args:
        workload: the model, loss and batch shapes.
        top: the most rows returned.

    Returns:
        Up to `top` rows ``{"source", "amp_bf16", "hand_bf16", "excess_bytes"}``
        (the two middle ones: dtype name -> bytes; the excess is amp's bytes
        minus hand-cast's), largest absolute difference first.
    """
    make = workload.make_flat_model or workload.make_model
    model = eqx.filter_eval_shape(make, jax.random.key(0))
    keys = ("amp_bf16", "hand_bf16")
    by_source = {
        key: measure.residuals(VARIANTS[key].wrap(workload.loss_fn), model, *workload.batch).by_source for key in keys
    }
    # Differences below 0.1% of the total are rounding, not findings.
    negligible = 1e-3 * sum(sum(d.values()) for d in by_source["hand_bf16"].values())
    rows = []
    for source in by_source["amp_bf16"].keys() | by_source["hand_bf16"].keys():
        amp, hand = (by_source[key].get(source, {}) for key in keys)
        excess = sum(amp.values()) - sum(hand.values())
        if abs(excess) > negligible:
            rows.append({"source": source, "amp_bf16": amp, "hand_bf16": hand, "excess_bytes": excess})
    return sorted(rows, key=lambda r: -abs(r["excess_bytes"]))[:top]
