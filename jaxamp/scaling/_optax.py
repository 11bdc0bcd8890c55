"""Skipping optimizer steps whose gradients are not finite, for optax.

`optax.apply_if_finite` does something similar, but it (a) needs a
``max_consecutive_errors`` after which it *applies* non-finite updates, which is the
wrong call when a loss scaler is still backing off, and (b) leaves parameters
unchanged only up to the sign of zero, since a skipped step returns zero updates and
``-0.0 + 0.0 == +0.0``. Here a skipped step never touches the inner optimizer
state, and `apply_if_finite_updates` keeps the parameters' exact bits.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from .._dtypes import array_part
from ._finite import (
    AxisName,
    check_axis_name,
    local_all_finite,
    on_every_device,
    select_tree,
)

__all__ = [
    "SkipNonFiniteState",
    "apply_if_finite_updates",
    "check_optimizer",
    "gradients_finite",
    "skip_nonfinite_updates",
    "update_if_finite",
]


class SkipNonFiniteState(NamedTuple):
    """State of `skip_nonfinite_updates` (field names as `optax.ApplyIfFiniteState`).

    Attributes:
        inner_state: the wrapped optimizer's state, exactly as after the last
            finite step.
        last_finite: whether the latest gradients were finite (bool scalar).
        notfinite_count: non-finite steps in a row, up to the latest (int32).
        total_notfinite: non-finite (skipped) steps since `init` (int32).
    """

    inner_state: Any
    last_finite: jax.Array
    notfinite_count: jax.Array
    total_notfinite: jax.Array


def gradients_finite(grads: Any, axis_name: AxisName | None, *, what: str) -> jax.Array:
    """Whether `grads` are finite on every device: the decision to skip a step.

    Shared by every optimizer wrapper that skips steps (`skip_nonfinite_updates`,
    `jaxamp.loss_scaling`), as `dynamic_scale_tx` decides with the same two
    functions: this device's check, then one decision for all devices.
    """
    return on_every_device(local_all_finite(grads), axis_name, what=what)


def update_if_finite(
    inner: optax.GradientTransformationExtraArgs,
    finite: jax.Array,
    grads: Any,
    inner_state: Any,
    params: Any = None,
    **extra_args: Any,
) -> tuple[Any, Any]:
    """``inner.update``'s updates and state if `finite`, else zero updates and `inner_state` bit for bit.

    Selected rather than branched (see `select_tree`): the same under `vmap`,
    and the kept state is the very bits that came in.
    """
    params = None if params is None else array_part(params)
    updates, new_state = inner.update(grads, inner_state, params, **extra_args)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, updates)
    return select_tree(finite, updates, zeros), select_tree(finite, new_state, inner_state)


def check_optimizer(optimizer: Any, what: str) -> optax.GradientTransformationExtraArgs:
    """`optimizer` with extra-args support, or a TypeError naming `what`."""
    if not all(callable(getattr(optimizer, name, None)) for name in ("init", "update")):
        raise TypeError(
            f"{what} expects an optax GradientTransformation (with init and update), "
            f"got {type(optimizer).__name__}: {optimizer!r:.200}."
        )
    return optax.with_extra_args_support(optimizer)


def skip_nonfinite_updates(
    optimizer: optax.GradientTransformation,
    axis_name: AxisName | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wrap `optimizer` so that steps with inf/NaN gradients are skipped and counted.

    On a step whose gradients contain inf or NaN in any inexact leaf, the returned
    updates are zeros and the inner state is returned unchanged, bit for bit; the
    skip is recorded in `SkipNonFiniteState`. Pair it with `apply_if_finite_updates`
    to keep the parameters' bits unchanged as well.

    Args:
        optimizer: any optax gradient transformation.
        axis_name: inside `shard_map` or `jax.pmap`, the axes (a name or a tuple
            of names) the finiteness check is reduced over, so every device skips
            the same steps (with ZeRO-style reduce-scattered gradients, an inf in
            one device's shard must skip the step everywhere); see
            `jaxamp.all_finite` for what happens without it there.

    Returns:
        A `GradientTransformationExtraArgs` whose state is a `SkipNonFiniteState`.

    Raises:
        TypeError: if `optimizer` has no ``init``/``update`` functions, or
            `axis_name` is not a name or a tuple of names.
    """
    inner = check_optimizer(optimizer, "skip_nonfinite_updates")
    axis_name = check_axis_name(axis_name, "skip_nonfinite_updates")

    def init(params: Any) -> SkipNonFiniteState:
        # Separate buffers per field, so the state can be donated to a jit'd step.
        return SkipNonFiniteState(
            inner.init(array_part(params)), jnp.array(True), jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32)
        )

    def update(updates, state: SkipNonFiniteState, params=None, **extra_args):
        finite = gradients_finite(updates, axis_name, what="skip_nonfinite_updates")
        steps, inner_state = update_if_finite(inner, finite, updates, state.inner_state, params, **extra_args)
        skipped = (~finite).astype(jnp.int32)
        return steps, SkipNonFiniteState(
            inner_state=inner_state,
            last_finite=finite,
            notfinite_count=(state.notfinite_count + 1) * skipped,
            total_notfinite=state.total_notfinite + skipped,
        )

    return optax.GradientTransformationExtraArgs(init, update)


def apply_if_finite_updates(params: Any, updates: Any, finite: Any) -> Any:
    """`optax.apply_updates(params, updates)` if `finite`, else `params` bit for bit.

    As `optax.apply_updates` (each sum cast back to the parameter's dtype) and
    `equinox.apply_updates`: a ``None`` update leaves its parameter alone, so
    an Equinox module, whose non-array fields get ``None`` gradients from
    `equinox.filter_grad`, can be passed as it is.

    Args:
        params: the parameters (a pytree of arrays, or an Equinox module).
        updates: updates with the same structure (``None`` where there is
            nothing to update), e.g. from an optimizer wrapped in
            `skip_nonfinite_updates`.
        finite: a boolean scalar, e.g. ``opt_state.last_finite`` of a
            `SkipNonFiniteState` or `jaxamp.all_finite(grads)`.

    Returns:
        The new parameters.

    Raises:
        AssertionError: if `finite` is not a boolean scalar (see `select_tree`).
    """

    def apply(update: Any, param: Any) -> Any:
        if update is None:
            return param
        return jnp.asarray(param + update).astype(jnp.asarray(param).dtype)

    updated = jax.tree_util.tree_map(apply, updates, params, is_leaf=lambda x: x is None)
    return select_tree(finite, updated, params)
