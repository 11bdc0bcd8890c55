"""float8 quantisation with current scales: per tensor, along dimensions, per group of rows.

Each scale is ``amax / max(format)``, amax the largest finite ``|x|`` over the
entries it covers, taken from the live tensor (Transformer Engine's "current
scaling"); see `quantize` for what happens to zeros, infs and NaNs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["E4M3", "E5M2", "place", "quantize", "quantize_along", "quantize_rows_by_group"]

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
_F32 = np.dtype(jnp.float32)


def quantize(x: Any, fmt: Any, power_of_two: bool = False) -> tuple[Any, Any]:
    """Quantise `x` to the float8 format `fmt` with a per-tensor current scale.

    Args:
        x: a float32, bfloat16 or float16 array.
        fmt: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.

    Returns:
        ``(q, scale)``: `q` in `fmt` with ``q * scale ≈ x``, and the float32
        scalar ``scale = amax / max(fmt)``, amax the largest finite ``|x|``. A
        tensor with no nonzero finite entry (or whose scale underflows
        float32) gets scale 1. Non-finite entries are not clamped: they stay
        inf or NaN in `q` (e4m3, which has no inf, holds NaN), so only the
        rows and columns of the matmul's result they touch go non-finite, as
        in bfloat16, and a loss scaler or `jaxamp.skip_nonfinite_updates`
        still sees the step as bad; saturating an inf to the format's maximum
        would hide it, and a scale taken from an infinite amax would turn every
        finite entry into 0 and the whole result into NaN.
    """
    return quantize_along(x, fmt, range(np.ndim(x)), power_of_two)


def quantize_along(x: Any, fmt: Any, contracted: Sequence[int], power_of_two: bool = False) -> tuple[Any, Any]:
    """`quantize` with one scale per index of the dimensions not in `contracted`.

    Returns ``(q, scale)``, `scale` holding the kept dimensions in order.
    """
    x32 = lax.convert_element_type(x, _F32)
    contracted = tuple(sorted(contracted))
    scale = _scale(lax.reduce_max(_finite_magnitude(x32), contracted), fmt, power_of_two)
    return _apply_scale(x32, lax.expand_dims(scale, contracted), fmt), scale


# lax rather than jnp in these helpers: each jnp helper adds a nested jit to every matmul.


def _finite_magnitude(x32: Any) -> Any:
    """``|x|`` with non-finite entries as 0: what an amax is taken over."""
    return lax.select(lax.is_finite(x32), lax.abs(x32), lax.full_like(x32, 0.0))


def _scale(amax: Any, fmt: Any, power_of_two: bool = False) -> Any:
    """``amax / max(fmt)``, 1 where that is not positive (an all-zero or empty tensor).

    With `power_of_two`, rounded up to a power of two (so ``amax / scale``
    still fits the format and scaling changes no mantissa bit).
    """
    scale = amax / np.float32(jnp.finfo(fmt).max)
    scale = lax.select(scale > 0, scale, lax.full_like(scale, 1.0))
    if power_of_two:
        # Bits, not frexp: a positive float32 with any mantissa bit set goes
        # to the next exponent (jnp.frexp also loses an Explicit sharding).
        bits = lax.bitcast_convert_type(scale, np.int32)
        exponent = lax.shift_right_logical(bits, np.int32(23))
        inexact = lax.convert_element_type(lax.bitwise_and(bits, np.int32(0x7FFFFF)) != 0, np.int32)
        scale = lax.bitcast_convert_type(lax.shift_left(exponent + inexact, np.int32(23)), _F32)
    return scale


def _apply_scale(x32: Any, scale: Any, fmt: Any) -> Any:
    """``x / scale`` saturated to `fmt`, non-finite entries passed through (see `quantize`)."""
    fmax = np.float32(jnp.finfo(fmt).max)
    q = lax.select(lax.is_finite(x32), lax.clamp(-fmax, x32 / scale, fmax), x32)
    return lax.convert_element_type(q, fmt)


def quantize_rows_by_group(x: Any, fmt: Any, group_ids: Any, num_groups: int) -> tuple[Any, Any]:
    """`quantize` with one scale per group of rows (rows of group ``group_ids[i]``).

    Returns ``(q, scales)``, `scales` of shape ``(num_groups,)``.
    """
    x32 = lax.convert_element_type(x, _F32)
    row_amax = lax.reduce_max(_finite_magnitude(x32), tuple(range(1, x32.ndim)))
    scales = _scale(jax.ops.segment_max(row_amax, group_ids, num_segments=num_groups), fmt)
    row_scales = scales[group_ids].reshape((-1,) + (1,) * (x32.ndim - 1))
    return _apply_scale(x32, row_scales, fmt), scales




def place(scale: Any, kept: Sequence[int], position: dict, shape: Sequence[int]) -> Any:
    """`scale` (over dims `kept` of its operand, in order) broadcast into a result of `shape`.

    `position` maps each kept dim to the result's dimension it becomes.
    """
    order = sorted(range(len(kept)), key=lambda k: position[kept[k]])
    return lax.broadcast_in_dim(
        lax.transpose(scale, order), tuple(shape), tuple(position[kept[k]] for k in order)
    )
