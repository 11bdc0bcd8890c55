"""The update rule shared by every dynamic loss scale: grow, shrink, stay in bounds.

`DynamicScalerState` (jaxamp), `DynamicLossScale` (jmp) and `GradScaler` (torch)
differ in how they name and count things, not in what they do, so each one maps
its own fields onto `next_scale` and nothing else decides how a scale moves:

=================  ===================  ==================  =======================
rule argument      DynamicScalerState   DynamicLossScale    GradScaler
=================  ===================  ==================  =======================
``patience``       ``patience``         ``period - 1``      ``growth_interval - 1``
``growth_factor``  ``adjust_factor``    ``factor``          ``growth_factor``
shrink             ``/ adjust_factor``  ``/ factor``        ``* backoff_factor``
``min_scale``      ``min_scaler``       ``min_loss_scale``  ``min_scale``
``max_scale``      ``max_scaler``       none (``inf``)      ``max_scale``
=================  ===================  ==================  =======================

The bounds are there because a scale that reaches 0 or inf never comes back: at 0
every scaled loss is 0 and every unscaled gradient ``0 / 0 = NaN``, so every step
shrinks it again; at inf every scaled loss is inf. Both are reachable in float32
without bounds: a burst of non-finite steps, each halving the scale (11 times a
step with ``redo_on_nan=10``), underflows the default ``2**15`` to 0 within 15
steps, and growth that is never refused overflows to inf.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ._finite import first_finite

__all__ = ["next_scale"]


def next_scale(
    scale: Any,
    counter: Any,
    finite: Any,
    *,
    patience: Any,
    growth_factor: Any,
    min_scale: Any,
    max_scale: Any,
    backoff_factor: Any = None,
    backoff_divisor: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """The scale and counter after one step, given whether the step was finite.

    * finite step, ``counter >= patience``: the scale is multiplied by
      `growth_factor`, unless the product is inf/NaN (then it is kept), and
      capped at `max_scale`; the counter restarts at 0. So with the counter
      starting at 0, growth happens on the ``(patience + 1)``-th consecutive
      finite step.
    * finite step, ``counter < patience``: the scale is kept; the counter goes up
      by one.
    * non-finite step: the scale is multiplied by `backoff_factor` (or divided by
      `backoff_divisor`) and raised to `min_scale` if it fell below it; the
      counter restarts at 0.

    The bounds are applied on the way up and on the way down only, never to a
    scale that is kept, as jmp does for its minimum: an initial scale outside the
    bounds is the caller's to reject.

    Exactly one of `backoff_factor` and `backoff_divisor` is given: torch
    multiplies by a factor below 1, jmp and jaxamp divide by one above 1, and
    ``x * (1 / d)`` and ``x / d`` can round differently for a `d` that is not a
    power of two.

    Args:
        scale: the current scale, a floating scalar. The result keeps its dtype.
        counter: finite steps since the scale last changed, an integer scalar.
            The result keeps its dtype.
        finite: whether this step's values and gradients were all finite, a
            boolean scalar.
        patience: how many finite steps to wait before growing (see above).
        growth_factor: the growth multiplier.
        min_scale: the floor for shrinking.
        max_scale: the ceiling for growing; ``inf`` leaves only the overflow check.
        backoff_factor: the shrink multiplier (torch's convention).
        backoff_divisor: the shrink divisor (jmp's and jaxamp's convention).

    Returns:
        ``(new_scale, new_counter)``, scalar arrays of `scale`'s and `counter`'s
        dtypes.

    Raises:
        TypeError: if `finite` is not a boolean scalar, or not exactly one of
            `backoff_factor` and `backoff_divisor` is given.
    """
    if (backoff_factor is None) == (backoff_divisor is None):
        raise TypeError(
            "next_scale takes exactly one of backoff_factor and backoff_divisor, got "
            f"backoff_factor={backoff_factor!r}, backoff_divisor={backoff_divisor!r}."
        )
    finite = jnp.asarray(finite)
    if finite.shape != () or finite.dtype != jnp.bool_:
        raise TypeError(f"finite must be a boolean scalar, got {finite.dtype}{list(finite.shape)}.")
    scale, counter = jnp.asarray(scale), jnp.asarray(counter)
    grow = finite & (counter >= patience)
    # Overflow is judged in the scale's own dtype: that is the value stored.
    grown = first_finite((scale * growth_factor).astype(scale.dtype), scale)
    grown = jnp.minimum(grown, max_scale)
    if backoff_divisor is None:
        shrunk = scale * backoff_factor
    else:
        shrunk = scale / backoff_divisor
    shrunk = jnp.maximum(shrunk, min_scale)
    new_scale = jnp.where(finite, jnp.where(grow, grown, scale), shrunk)
    new_counter = jnp.where(finite & ~grow, counter + 1, jnp.zeros_like(counter))
    return new_scale.astype(scale.dtype), new_counter.astype(counter.dtype)
