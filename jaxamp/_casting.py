"""Casting values between the dtypes amp moves: float32, float16 and bfloat16.

The rules, the evaluation loop and the higher-order handlers all convert values
through these, so "which values may be cast" (see `jaxamp._dtypes.is_castable`)
and "how a narrowing cast treats out-of-range values" are decided once.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._dtypes import is_castable

__all__ = ["as_array", "cast_value", "dtype_of", "linear_values", "saturating_cast", "shared_casts"]

# value id -> {dtype: (value, its cast)} for the jaxpr being interpreted.
_SHARED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("jaxamp_shared_casts", default=None)
# Values `saturating_cast` casts plainly (see `linear_values`).
_LINEAR: contextvars.ContextVar[tuple] = contextvars.ContextVar("jaxamp_linear_values", default=())


@contextlib.contextmanager
def shared_casts(casts: dict) -> Iterator[None]:
    """Within this block, casting a value to a dtype `casts` has seen reuses that cast.

    The evaluation loop keeps one `casts` dict per jaxpr and opens this block
    around each rule call (rules run in that jaxpr's trace): a value read by
    several float32-by-rule equations (a norm layer's input feeds its mean, its
    centring and its variance) is converted once, not once per reader. Besides
    the equations saved while tracing, every convert costs one in the backward
    pass too, where XLA does not merge them (each reader's cotangent is
    converted before they are summed).
    """
    token = _SHARED.set(casts)
    try:
        yield
    finally:
        _SHARED.reset(token)


@contextlib.contextmanager
def linear_values(values: Sequence[Any]) -> Iterator[None]:
    """Within this block, `saturating_cast` casts `values` as `cast_value` does.

    For the tangents a custom_jvp rule computes with: JAX transposes what the
    rule does to them, and a saturating cast is not linear (its clamp and its
    test for infinities have no transpose; JAX fails on the rule's backward
    pass). A plain cast is linear, and it is what a tangent gets anywhere else
    (the backward pass of a saturating cast is the plain cast's): a tangent
    past float16's range overflows to inf, which a loss scaler looks for.
    """
    token = _LINEAR.set(tuple(values))
    try:
        yield
    finally:
        _LINEAR.reset(token)


def dtype_of(x: Any) -> Any:
    """The dtype of a value: numpy's, or JAX's extended dtype (PRNG keys) as is."""
    dtype = getattr(x, "dtype", None)
    return dtype if dtype is not None else np.asarray(x).dtype


def cast_value(x: Any, dtype: Any) -> Any:
    """Convert `x` to `dtype` when both are amp-castable floats; else return `x`."""
    current = dtype_of(x)
    if current == dtype or not (is_castable(current) and is_castable(dtype)):
        return x
    shared = _SHARED.get()
    if shared is None or isinstance(x, (int, float, np.ndarray, np.generic)):
        return lax.convert_element_type(x, dtype)
    casts = shared.setdefault(id(x), (x, {}))
    if casts[0] is not x:  # an id reused after its value died: start afresh
        casts = shared[id(x)] = (x, {})
    key = np.dtype(dtype)
    if key not in casts[1]:
        casts[1][key] = lax.convert_element_type(x, dtype)
    return casts[1][key]


def saturating_cast(x: Any, dtype: Any) -> Any:
    """`cast_value`, with finite values beyond `dtype`'s range clamped to its largest.

    For casts amp inserts that the user never wrote: a float32 mask constant such
    as ``-1e9`` must not become ``-inf`` in float16, where ``softmax`` would turn
    a fully masked row into NaNs. Infinities stay infinite, so comparisons against
    ``inf`` keep their meaning. Only float16 targets saturate: bfloat16 has
    float32's exponent range (only the last 0.4% below ``finfo(float32).max``
    rounds to inf), and the extra ops are not worth it there.

    Its gradient is the plain cast's (straight through the clamp): a clamp
    differentiated as written saves its float32 operand and two masks for the
    backward pass, and the operand is often activation-sized (haiku's
    ``Linear`` broadcasts its bias to the output's shape before adding it),
    which cost float16 models 46% more residual bytes than hand-cast code.
    """
    current = dtype_of(x)
    narrowing_to_float16 = (
        is_castable(current)
        and np.dtype(dtype) == np.dtype(jnp.float16)
        and jnp.finfo(current).max > jnp.finfo(jnp.float16).max
    )
    if narrowing_to_float16 and not any(x is v for v in _LINEAR.get()):
        if isinstance(x, (int, float, np.ndarray, np.generic)):  # a literal: no ops needed
            x = np.asarray(x, current)
            limit = _float16_bound(current)
            x = np.where(np.isinf(x), x, np.clip(x, -limit, limit)).astype(current)
        else:
            x = _saturate_to_float16(x)
    return cast_value(x, dtype)


def _float16_bound(dtype: Any) -> np.ndarray:
    """float16's largest finite value, as the largest value of `dtype` not above it.

    In bfloat16 65504 rounds to 65536, which float16 cannot hold: a bfloat16
    clamped to it would still turn into inf (an attention mask's fill value
    into -inf, a fully masked row into NaN). bfloat16's bound is 65280.
    """
    limit = float(jnp.finfo(jnp.float16).max)
    bound = np.asarray(limit, dtype)
    while float(bound) > limit:
        bound = np.nextafter(bound, np.asarray(0, dtype))
    return bound


@jax.custom_jvp
def _saturate_to_float16(x: Any) -> Any:
    bound = _float16_bound(x.dtype)
    clamped = lax.clamp(-bound, x, bound)
    return lax.select(lax.eq(lax.abs(x), np.asarray(np.inf, x.dtype)), x, clamped)


@_saturate_to_float16.defjvp
def _saturate_to_float16_jvp(primals: tuple, tangents: tuple) -> tuple:
    (x,), (tangent,) = primals, tangents
    return _saturate_to_float16(x), tangent


def as_array(value: Any, aval: Any) -> Any:
    """`value` as a JAX array of type `aval`, if the program held it as a constant.

    An output the program computed from nothing (``jnp.array(False)``, a
    BatchNorm's "first call" flag) is a literal in its jaxpr, and evaluating
    the jaxpr yields the literal's Python or NumPy value; the function itself
    returned an Array, and so does amp (with the literal's weak type).
    """
    if isinstance(value, jax.Array):
        return value
    if getattr(aval, "weak_type", False):
        weak = jnp.asarray(np.asarray(value).item())  # from a Python scalar: weakly typed
        if weak.dtype == aval.dtype:
            return weak
    return jnp.asarray(value, dtype=aval.dtype)
