"""The one finiteness check and tree select shared by every loss-scaling API.

`DynamicLossScale` (jmp-style), `DynamicScalerState` (jaxamp-style), `GradScaler`
(torch-style) and `skip_nonfinite_updates` (optax) all decide "was this step
finite?" and "keep the old values or take the new ones?" here, so they agree on
what counts as non-finite and on which leaves are looked at. `checked_scalar` is
the one validation of user-given scales and counters (finite, in range, of the
right kind) that the scaler states share, and `check_scale_bounds` the one check
that a scale lies within its ``[min, max]`` bounds.
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "all_finite",
    "check_scale_bounds",
    "checked_scalar",
    "first_finite",
    "is_inexact_leaf",
    "select_tree",
]

T = TypeVar("T")


def is_inexact_leaf(x: Any) -> bool:
    """Whether `x` is a leaf whose values can be inf or NaN.

    Floating and complex arrays (jax, including tracers, or numpy) and Python
    floats/complexes qualify. Integer and boolean arrays can never be non-finite,
    and non-array leaves (``None``, strings, functions inside an equinox Module,
    ``float0`` gradients) carry no numbers, so those are all skipped.
    """
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return jnp.issubdtype(x.dtype, jnp.inexact)
    return isinstance(x, (float, complex))


def all_finite(tree: Any) -> jax.Array:
    """Whether every inexact leaf of `tree` is free of inf and NaN.

    Args:
        tree: any pytree. Only inexact leaves (see `is_inexact_leaf`) are checked.

    Returns:
        A boolean scalar array. ``True`` for ``None``, empty trees and trees
        without inexact leaves, since there is nothing that could have overflowed.
    """
    checks = [
        jnp.all(jnp.isfinite(leaf))
        for leaf in jax.tree_util.tree_leaves(tree)
        if is_inexact_leaf(leaf)
    ]
    if not checks:
        return jnp.array(True)
    return jnp.stack(checks).all()


def select_tree(pred: Any, a: T, b: T) -> T:
    """Take every leaf from `a` where `pred` is true, else from `b` (jmp's select_tree).

    Selecting (rather than branching with `lax.cond`) returns the very bits of the
    chosen tree, so a skipped step leaves parameters and optimizer state exactly as
    they were, and it behaves the same under `vmap`.

    Args:
        pred: a boolean scalar (a 0-d bool array or a Python bool).
        a: the tree returned where `pred` is true.
        b: a tree with the same structure, shapes and dtypes as `a`.

    Returns:
        A tree shaped like `a` and `b`.

    Raises:
        AssertionError: "expected boolean scalar ..." if `pred` is not a 0-d bool
            (the exception type jmp raises; it is raised explicitly so that
            ``python -O`` does not drop the check).
    """
    shape, dtype = jnp.shape(pred), jnp.result_type(pred)
    if shape != () or dtype != jnp.bool_:
        raise AssertionError(
            f"expected boolean scalar for the select predicate, got {dtype}{list(shape)}"
        )
    return jax.tree_util.tree_map(lambda x, y: jax.lax.select(pred, x, y), a, b)


def first_finite(candidate: jax.Array, fallback: jax.Array) -> jax.Array:
    """`candidate` if all its values are finite, else `fallback`.

    Used when growing a loss scale: a scale that overflows to inf would turn every
    later loss into inf, so growth is refused instead.
    """
    return jax.lax.select(jnp.isfinite(candidate).all(), candidate, fallback)


def _concrete(value: Any) -> np.ndarray | None:
    """`value` as a numpy array, or None when it is traced and cannot be inspected."""
    try:
        return np.asarray(value)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def checked_scalar(
    what: str, value: Any, dtype: Any, *, lower: float, inclusive: bool = True
) -> jax.Array:
    """Validate a user-given scale or counter and return it as a `dtype` scalar array.

    Scaler state must have fixed dtypes to be carried through `jit` and
    `lax.while_loop`, but nothing is converted across kinds behind the user's
    back: Python ints are accepted for any field (they are untyped literals),
    Python floats and floating arrays only for a floating `dtype`, integer arrays
    only for an integer `dtype`, bools never.

    Args:
        what: how error messages name the value, e.g. ``"GradScaler init_scale"``.
        value: a Python number or a scalar array (possibly traced).
        dtype: the dtype to store, e.g. ``jnp.float32`` or ``jnp.int32``.
        lower: the smallest allowed value.
        inclusive: whether `lower` itself is allowed.

    Returns:
        A 0-d array of `dtype`.

    Raises:
        TypeError: for bools, non-numbers, or a value of the wrong kind.
        ValueError: for a non-scalar, or a concrete value that is inf, NaN or
            below the bound. Traced values are only checked for dtype and shape.
    """
    floating = jnp.issubdtype(dtype, jnp.floating)
    expected = "a float or int" if floating else "an int"
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, jax.Array, np.ndarray, np.generic)
    ):
        raise TypeError(
            f"{what} must be {expected} scalar, got {value!r} of type "
            f"{type(value).__name__}."
        )
    kind_ok = (
        isinstance(value, int)
        or jnp.issubdtype(jnp.result_type(value), jnp.integer if not floating else jnp.floating)
    )
    if not kind_ok:
        raise TypeError(
            f"{what} must be {expected} scalar, got {value!r} with dtype "
            f"{np.dtype(jnp.result_type(value)).name}; convert it explicitly if intended."
        )
    if jnp.ndim(value) != 0:
        raise ValueError(f"{what} must be a scalar, got shape {jnp.shape(value)}.")
    concrete = _concrete(value)
    if concrete is not None:
        in_range = concrete >= lower if inclusive else concrete > lower
        if not (np.isfinite(concrete) and in_range):
            bound = ">=" if inclusive else ">"
            raise ValueError(f"{what} must be finite and {bound} {lower}, got {value!r}.")
    return jnp.asarray(value, dtype=dtype)


def check_scale_bounds(
    what: str, scale: tuple[str, Any], lower: tuple[str, Any], upper: tuple[str, Any]
) -> None:
    """Check ``lower <= upper`` and ``lower <= scale <= upper``, for concrete values.

    Each argument is a ``(name, value)`` pair, so the message names the fields as
    the user knows them. The values are already validated scalars (see
    `checked_scalar`); comparisons involving a traced value are skipped, like
    `checked_scalar`'s range checks.

    Args:
        what: the owner, e.g. ``"DynamicScalerState"``.
        scale: the scale's name and value.
        lower: the lower bound's name and value.
        upper: the upper bound's name and value.

    Raises:
        ValueError: the message names the offending values and the bounds.
    """
    (scale_name, s), (lower_name, lo), (upper_name, hi) = scale, lower, upper
    s, lo, hi = map(_concrete, (s, lo, hi))
    if lo is not None and hi is not None and not lo <= hi:
        raise ValueError(
            f"{what} {lower_name} must be <= {upper_name}, got {lower_name}={lo.item()!r} "
            f"and {upper_name}={hi.item()!r}."
        )
    if s is not None and lo is not None and not s >= lo:
        raise ValueError(
            f"{what} {scale_name} must be >= {lower_name}={lo.item()!r}, got "
            f"{s.item()!r}; lower {lower_name} if that scale is intended."
        )
    if s is not None and hi is not None and not s <= hi:
        raise ValueError(
            f"{what} {scale_name} must be <= {upper_name}={hi.item()!r}, got "
            f"{s.item()!r}; raise {upper_name} if that scale is intended."
        )
