"""Rounding float32 values into a storage dtype: to nearest, or stochastically.

Stochastic rounding is what lets a bfloat16 value absorb updates far below its
spacing: an update of a tenth of a spacing moves the value one spacing with
probability 1/10, so the expected value follows the float32 trajectory. Here it
is written once for every storage dtype (bfloat16, float16; float32 is
passed through) by finding the two representable neighbours of each value,
rather than with bfloat16's "add 16 random bits and truncate" trick, which
does not carry over to float16's narrower exponent range.

This module also holds what `low_precision_params` and `cast_state` share
about rounding: validating a ``rounding=``/``key=`` pair and handing out one
key per leaf per step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._dtypes import parse_dtype

__all__ = [
    "STORAGE_DTYPES",
    "check_rounding",
    "leaf_keys",
    "round_to",
    "stochastic_round",
    "storage_dtype",
]

_F32 = np.dtype(jnp.float32)
# The dtypes a value is rounded into; their values are all exact in float32.
STORAGE_DTYPES = tuple(np.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))
_STORAGE_NAMES = ", ".join(d.name for d in STORAGE_DTYPES)


def stochastic_round(x: Any, dtype: Any, key: jax.Array) -> jax.Array:
    """Round `x` to `dtype`, up or down at random, so that the result is unbiased.

    A value strictly between two neighbours ``lo < x < hi`` of `dtype` becomes
    ``hi`` with probability ``(x - lo) / (hi - lo)`` and ``lo`` otherwise, so the
    expected result is `x` itself. Values that `dtype` represents come back
    exactly, and so do inf and NaN. Values beyond `dtype`'s largest finite value
    round as ``x.astype(dtype)`` does once that gives inf, and saturate to the
    largest finite value before that.

    The probability is compared with one float32 uniform draw per element
    (multiples of ``2**-23``), which is exact whenever ``(x - lo) / (hi - lo)``
    has at most 23 fractional bits: always for bfloat16, and for float16 down to
    its smallest subnormal; below that (``|x| < 2**-24``) it is quantised down
    to a multiple of ``2**-23`` (so a value far below float16's smallest
    subnormal rounds to zero). XLA flushes float32 subnormals (``|x| < 2**-126``, bfloat16's
    subnormal range too) to zero on CPU and GPU, so those round as zero does.

    Args:
        x: an array of float32, bfloat16 or float16 values (bfloat16 and float16
            upcast exactly).
        dtype: bfloat16, float16 or float32 (float32 returns `x` as float32).
        key: a PRNG key (``jax.random.key(0)`` or a legacy ``PRNGKey``).

    Returns:
        An array of `dtype` with `x`'s shape.

    Raises:
        TypeError: if `x` is not a float32/bfloat16/float16 array or `dtype` is
            not one of bfloat16, float16, float32.
    """
    # Read the dtype before jnp.asarray, which would quietly turn float64 into float32.
    in_dtype = getattr(x, "dtype", None)
    if in_dtype is not None and in_dtype not in STORAGE_DTYPES:
        raise TypeError(
            f"stochastic_round rounds float32, bfloat16 or float16 values, got {in_dtype}; "
            "cast explicitly first if a conversion is intended."
        )
    dtype = storage_dtype("stochastic_round dtype", dtype)
    x = jnp.asarray(x, _F32)
    if dtype == _F32:
        return x
    nearest = x.astype(dtype)
    nearest32 = nearest.astype(_F32)
    # The neighbour on the other side of x from the nearest value. Rounding to
    # it with probability |x - nearest| / |other - nearest| (at most 1/2) is the
    # same as rounding up with probability (x - lo) / (hi - lo).
    toward = jnp.where(nearest32 < x, jnp.inf, -jnp.inf).astype(dtype)
    other = jnp.nextafter(nearest, toward)
    # x - nearest is below 2**-126 for |x| < 2**-118, and XLA flushes such
    # results to zero: scale tiny values up (exactly, by a power of two) first.
    scale = jnp.where(jnp.abs(x) < 2.0**-64, jnp.float32(2.0**64), jnp.float32(1.0))
    nearest_s = nearest32 * scale
    # Both differences are exact (x and other lie within a factor 2 of nearest
    # unless one is 0) and the spacing is a power of two, so the ratio is exact
    # too. Past the largest finite value `other` is inf and the probability 0:
    # saturation.
    p_other = jnp.abs(x * scale - nearest_s) / jnp.abs(other.astype(_F32) * scale - nearest_s)
    # A draw from (0, 1] (multiples of 2**-23) taken when <= p: exact for
    # probabilities with 23 fractional bits, and never for a probability below
    # 2**-23. A draw from [0, 1) taken when < p would take the other neighbour
    # with probability 2**-23 however small p is: a value of 1e-36 would round
    # up to float16's smallest subnormal, 6e-8, about once in 8 million.
    take_other = 1.0 - jax.random.uniform(key, x.shape, _F32) <= p_other
    rounded = jnp.where(take_other, other, nearest)
    exact = (nearest32 == x) | ~jnp.isfinite(nearest)
    return jnp.where(exact, nearest, rounded)


def round_to(x: jax.Array, dtype: Any, rounding: str, key: jax.Array | None) -> jax.Array:
    """Round float32 `x` to `dtype`: ``"nearest"`` (as ``astype``) or ``"stochastic"``."""
    if rounding == "stochastic":
        if key is None:  # (the optimizers check this when built; a direct caller gets told here)
            raise ValueError("stochastic rounding needs a PRNG key")
        return stochastic_round(x, dtype, key)
    return x.astype(dtype)


def storage_dtype(what: str, value: Any) -> np.dtype:
    """Validate a storage dtype (bfloat16, float16, float32, or a name such as ``"bf16"``).

    Raises:
        TypeError: for anything else, naming `what` and the value.
    """
    try:
        dtype = parse_dtype(value) if isinstance(value, str) else np.dtype(value)
    except (TypeError, ValueError):
        dtype = None
    if value is None or dtype not in STORAGE_DTYPES:
        raise TypeError(f"{what} must be one of {_STORAGE_NAMES} (or a name such as 'bf16'), got {value!r}.")
    return dtype


def check_rounding(owner: str, rounding: Any, key: Any, allowed: tuple[str, ...]) -> Any:
    """Validate a ``rounding=``/``key=`` pair before anything is traced.

    Args:
        owner: how messages name the caller, e.g. ``"low_precision_params"``.
        rounding: the requested mode.
        key: the PRNG key, required by ``"stochastic"`` and refused otherwise (a
            key that would be ignored usually means the wrong mode was chosen).
        allowed: the modes `owner` supports.

    Returns:
        `key` (a PRNG key array) for ``"stochastic"``, else None.

    Raises:
        ValueError: an unknown mode, a missing key, or a key for another mode.
        TypeError: a key that is not a single PRNG key.
    """
    if not isinstance(rounding, str) or rounding not in allowed:
        raise ValueError(f"{owner}: rounding must be one of {', '.join(map(repr, allowed))}, got {rounding!r}.")
    if rounding != "stochastic":
        if key is not None:
            raise ValueError(
                f"{owner}: key is only used by rounding='stochastic', got key={key!r} with "
                f"rounding={rounding!r}; drop the key or choose rounding='stochastic'."
            )
        return None
    if key is None:
        raise ValueError(
            f"{owner}: rounding='stochastic' draws random numbers and needs a PRNG key, e.g. key=jax.random.key(0)."
        )
    dtype = getattr(key, "dtype", None)
    typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    legacy = dtype == np.uint32 and jnp.shape(key) == (2,)
    if not ((typed and jnp.shape(key) == ()) or legacy):
        raise TypeError(f"{owner}: key must be a single PRNG key such as jax.random.key(0), got {key!r}.")
    return key


def leaf_keys(key: jax.Array, n: int) -> tuple[jax.Array, list[jax.Array]]:
    """Split `key` into the key for the next step and `n` keys for this step's leaves."""
    next_key, step_key = jax.random.split(key)
    return next_key, list(jax.random.split(step_key, max(n, 1)))[:n]
