"""`update_scale`: one step of `DynamicScalerState`'s rule, for a script without optax.

A training step whose optimizer is written by hand (JAX's Training Cookbook:
Adam as a `jax.tree.map`) threads a `DynamicScalerState` itself, gives it to
``amp(loss_scale=...)``, and after the gradient calls this: it decides whether
the step was finite and moves the scale by the rule every jaxamp scaler shares
(`next_scaler_state`), so the script only chooses how to skip its own update.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ._dynamic_scaler import DynamicScalerState, next_scaler_state
from ._finite import AxisName, check_axis_name
from ._optax import gradients_finite

__all__ = ["update_scale"]


def update_scale(
    scaler_state: DynamicScalerState, grads_or_finite: Any, *, axis_name: AxisName | None = None
) -> tuple[DynamicScalerState, jax.Array]:
    """The scaler state after one step, and whether the step was finite.

    The step rule every jaxamp scaler shares
    (`jaxamp.scaling._scale_schedule.next_scale`), as a function: a
    non-finite step also counts one more skipped step in ``total_resets``.
    The update of the parameters and the optimizer state is the caller's to
    skip: ``jax.lax.cond(finite, update, keep, ...)`` (docs/porting.md, "No
    optax optimizer").

    Args:
        scaler_state: the state whose scale the gradients were taken with
            (``amp(loss, compute_dtype="f16", loss_scale=scaler_state)``).
        grads_or_finite: the step's gradients (every inexact leaf is checked,
            on every device: `jaxamp.all_finite`), or the decision itself, a
            boolean scalar, taken as it is.
        axis_name: inside `jax.pmap` or a ``shard_map(check_vma=False)``, the
            axes the gradients differ over, so every device takes the same
            decision (see `jaxamp.all_finite`).

    Returns:
        ``(new_scaler_state, finite)``: ``finite`` a boolean scalar array.

    Raises:
        TypeError: `scaler_state` is not a `DynamicScalerState`, or a
            non-scalar boolean is given as the decision.
        ValueError: inside `jax.pmap` without `axis_name` (see `jaxamp.all_finite`).
    """
    if not isinstance(scaler_state, DynamicScalerState):
        raise TypeError(
            "jaxamp.scaling.update_scale expects a jaxamp.DynamicScalerState (for an optax "
            f"optimizer, jaxamp.loss_scaling moves its own), got {type(scaler_state).__name__}."
        )
    axis_name = check_axis_name(axis_name, "jaxamp.scaling.update_scale")
    # A boolean is the decision: gradients are never boolean.
    if isinstance(grads_or_finite, bool) or getattr(grads_or_finite, "dtype", None) == jnp.bool_:
        finite = jnp.asarray(grads_or_finite)
        if finite.shape != ():
            raise TypeError(
                "jaxamp.scaling.update_scale takes the gradients or a boolean scalar (whether the "
                f"step was finite), got booleans of shape {finite.shape}."
            )
    else:
        finite = gradients_finite(grads_or_finite, axis_name, what="jaxamp.scaling.update_scale")
    return next_scaler_state(scaler_state, finite), finite
