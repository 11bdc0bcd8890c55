"""What the monitor measures of one value: a short float32 vector per observation.

Every observation of a value (a matmul's operand or result, a value a named
scope hands on) is one vector of `FIELDS`, computed on device in a single
fused pass over the value. Observations of the same site (a loop body's
iterations, a `shard_map` body's devices) combine field by field: maxima for
the magnitudes, sums for the counts (`combine`).
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "FIELDS",
    "LOSS_SCALE_EXPONENTS",
    "combine",
    "derived",
    "headroom_bits",
    "is_low_precision",
    "measure",
    "per_site",
]

# The smallest normal of float16 is 2^-14. A backward value below
# 2^(-14 - e) is one that a loss scale of 2^e would still leave below
# float16's normal range: the counts `suggest_policy` picks a scale range from.
LOSS_SCALE_EXPONENTS = (0, 6, 12, 18)

FIELDS = (
    "amax",  # largest finite |x|
    "source_amax",  # float8 operands: largest finite |x| of the value quantised (0 otherwise)
    "scale",  # float8 operands: the largest quantisation scale (0 otherwise)
    "values",  # entries observed
    "nonzero",  # finite nonzero entries
    "underflow",  # finite nonzero entries below the smallest normal of the dtype stored in
    "above",  # finite entries above max(dtype) / 2**headroom_bits
    "nonfinite",  # inf and NaN entries
    *(f"below_2^-{14 + e}" for e in LOSS_SCALE_EXPONENTS),  # finite nonzero entries below 2^-(14 + e)
)
"""The statistics the monitor measures at each site, in the order `MonitorStats` stores them.

``amax`` (the largest finite ``|x|``); for float8 operands ``source_amax`` (that
of the value quantised) and ``scale`` (the largest quantisation scale), 0
otherwise; then counts: ``values`` (entries observed), ``nonzero`` (finite
nonzero), ``underflow`` (finite nonzero below the smallest normal of the dtype
stored in), ``above`` (finite above ``max(dtype) / 2**headroom_bits``),
``nonfinite`` (inf and NaN), and ``below_2^-14``, ``below_2^-20``... (finite
nonzero below ``2^-(14 + e)`` for each exponent ``e`` of a loss scale
`suggest_policy` considers).
"""
NUM_MAX_FIELDS = 3  # amax, source_amax, scale combine by maximum; the rest are counts
_F32 = np.dtype(np.float32)


def is_low_precision(dtype: Any) -> bool:
    """float16, bfloat16 and the float8 formats: what the monitor watches matmuls in."""
    dtype = np.dtype(dtype)
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize <= 2


def measure(x: Any, headroom_bits: float, source: Any = None, scale: Any = None) -> Any:
    """The `FIELDS` vector of one observation of `x` (float32, shape ``(len(FIELDS),)``).

    Args:
        x: a floating array; "underflow" and "above" are relative to its dtype.
        headroom_bits: "above" counts entries above ``max(dtype) / 2**headroom_bits``.
        source, scale: for a float8 operand, the value it quantises and its scale.
    """
    dtype = np.dtype(x.dtype)
    info = jnp.finfo(dtype)
    # Compared as bit patterns: for floats of one sign, the order of the
    # magnitudes' bits is the order of the magnitudes. That reads the value as
    # stored (XLA may keep a half-precision intermediate in float32 inside a
    # fusion, and a read in float32 would see the unrounded value; float16
    # subnormals, which are what underflow means, survive), and is exact.
    unsigned = _unsigned(dtype)
    sign = unsigned.type(1 << (8 * dtype.itemsize - 1))
    magnitude = lax.bitwise_and(lax.bitcast_convert_type(x, unsigned), ~sign)
    finite = magnitude <= _bits_at_most(float(info.max), dtype)
    nonzero = finite & (magnitude > 0)
    flags = [
        nonzero,
        nonzero & (magnitude < _bits_below(float(info.smallest_normal), dtype)),
        finite & (magnitude > _bits_at_most(float(info.max) / 2.0**headroom_bits, dtype)),
        ~finite,
        *(nonzero & (magnitude < _bits_below(2.0 ** (-14 - e), dtype)) for e in LOSS_SCALE_EXPONENTS),
    ]
    # One variadic reduction: XLA reads `x` once for every field (separate
    # reductions cost about seven times as much on CPU).
    operands = [lax.select(finite, magnitude, lax.full_like(magnitude, 0))]
    operands += [lax.convert_element_type(f, np.int32) for f in flags]
    inits = [unsigned.type(0), *(np.int32(0) for _ in flags)]

    def add(a, b):
        return (lax.max(a[0], b[0]), *(p + q for p, q in zip(a[1:], b[1:])))

    reduced = lax.reduce(tuple(operands), tuple(inits), add, tuple(range(x.ndim)))
    amax = lax.convert_element_type(lax.bitcast_convert_type(reduced[0], dtype), _F32)
    counts = [lax.convert_element_type(c, _F32) for c in reduced[1:]]
    fp8 = [np.float32(0), np.float32(0)]
    if source is not None:
        scale32 = lax.convert_element_type(scale, _F32)
        fp8 = [_finite_amax(source), lax.reduce_max(scale32, tuple(range(np.ndim(scale))))]
    return jnp.stack([amax, *fp8, np.float32(x.size), *counts])


def _unsigned(dtype: np.dtype) -> np.dtype:
    return np.dtype(f"uint{8 * dtype.itemsize}")


def _bits_at_most(threshold: float, dtype: np.dtype) -> Any:
    """The bits of the largest `dtype` magnitude that is at most `threshold`."""
    unsigned = _unsigned(dtype)
    bits = np.asarray(threshold, np.float64).astype(dtype).view(unsigned)[()]
    if float(np.asarray(bits).view(dtype)) > threshold:
        bits = unsigned.type(bits - 1)  # one step towards zero
    return bits


def _bits_below(threshold: float, dtype: np.dtype) -> Any:
    """Bits ``b``: a magnitude is below `threshold` exactly when its bits are below ``b``."""
    bits = _bits_at_most(threshold, dtype)
    if float(np.asarray(bits).view(dtype)) == threshold:
        return bits
    return _unsigned(dtype).type(bits + 1)


def _finite_amax(x: Any) -> Any:
    magnitude = lax.abs(lax.convert_element_type(x, _F32))
    finite = lax.select(magnitude < np.float32(np.inf), magnitude, lax.full_like(magnitude, 0.0))
    return lax.reduce_max(finite, tuple(range(x.ndim)))


def combine(vectors: Any, axis: int = 0) -> Any:
    """Observations stacked along `axis` combined into one: maxima and sums (numpy in, numpy out)."""
    xp = np if isinstance(vectors, np.ndarray) else jnp
    maxima = vectors[..., :NUM_MAX_FIELDS].max(axis=axis)
    return xp.concatenate([maxima, vectors[..., NUM_MAX_FIELDS:].sum(axis=axis)], axis=-1)


def per_site(vectors: Any, num_sites: int) -> np.ndarray:
    """A `MonitorStats`' vectors on the host, one row per site (float64).

    A monitored function under `jax.pmap` or `jax.vmap` returns them with
    leading axes (one row per device or example): those combine as a loop's
    iterations do.
    """
    vectors = np.asarray(vectors, np.float64)
    if num_sites == 0:
        return np.zeros((0, len(FIELDS)))
    return combine(vectors.reshape(-1, num_sites, len(FIELDS)), axis=0)


def headroom_bits(amax: float, dtype: Any) -> float:
    """log2 of `dtype`'s largest finite value over `amax` (inf for an all-zero value)."""
    return math.log2(float(jnp.finfo(dtype).max) / amax) if amax > 0 else math.inf


def derived(row: dict[str, Any]) -> dict[str, Any]:
    """The figures read off a site's fields (a dict with `FIELDS`, ``dtype`` and ``direction``).

    ``headroom_bits`` (against the dtype the value is stored in; for a
    float8 value, of the value it quantises, in float32, inf when that is
    not in the same body),
    ``underflow_fraction`` (of nonzero entries, below the smallest normal of
    the dtype stored in), ``above_fraction`` (of entries),
    ``float16_underflow_fraction`` (of nonzero entries, below float16's
    smallest normal, whatever the dtype) and, for cotangents,
    ``underflow_at_scale``: per exponent ``e`` of `LOSS_SCALE_EXPONENTS`, the
    fraction of nonzero entries that a loss scale of ``2^e`` would leave
    below float16's smallest normal.
    """
    nonzero = row["nonzero"]
    # A float8 value is scaled to fill its format (current scaling) and cannot
    # overflow it: its headroom is that of the value it quantises, held in
    # float32, where that was found (inf otherwise).
    if str(row["dtype"]).startswith("float8"):
        headroom = headroom_bits(row["source_amax"], np.float32)
    else:
        headroom = headroom_bits(row["amax"], row["dtype"])
    figures: dict[str, Any] = dict(
        headroom_bits=headroom,
        underflow_fraction=row["underflow"] / nonzero if nonzero else 0.0,
        above_fraction=row["above"] / row["values"] if row["values"] else 0.0,
        float16_underflow_fraction=row["below_2^-14"] / nonzero if nonzero else 0.0,
    )
    if row["direction"] == "backward":
        figures["underflow_at_scale"] = {
            e: (row[f"below_2^-{14 + e}"] / nonzero if nonzero else 0.0) for e in LOSS_SCALE_EXPONENTS
        }
    return figures
