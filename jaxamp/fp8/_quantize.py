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

__all__ = [
    "E4M3",
    "E5M2",
    "apply_scale",
    "finite_amax",
    "place",
    "quantize",
    "quantize_along",
    "quantize_blocks",
    "quantize_rows_by_group",
    "scale_for_amax",
]

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
        in bfloat16, and a loss scaler or `jaxamp.scaling.skip_nonfinite_updates`
        still sees the step as bad; saturating an inf to the format's maximum
        would hide it, and a scale taken from an infinite amax would turn every
        finite entry into 0 and the whole result into NaN.
    """
    return quantize_along(x, fmt, range(np.ndim(x)), power_of_two)


def quantize_along(
    x: Any, fmt: Any, contracted: Sequence[int], power_of_two: bool = False, agreed_over: tuple = ()
) -> tuple[Any, Any]:
    """`quantize` with one scale per index of the dimensions not in `contracted`.

    With `agreed_over` (mesh axes; per-device code), each amax is the largest
    over those devices, so they all take the same scales.

    Returns ``(q, scale)``, `scale` holding the kept dimensions in order.
    """
    x32 = lax.convert_element_type(x, _F32)
    contracted = tuple(sorted(contracted))
    amax = lax.reduce_max(_finite_magnitude(x32), contracted)
    if agreed_over:
        amax = lax.pmax(amax, agreed_over)
    scale = scale_for_amax(amax, fmt, power_of_two)
    return apply_scale(x32, lax.expand_dims(scale, contracted), fmt), scale


# lax rather than jnp in these helpers: each jnp helper adds a nested jit to every matmul.


def _finite_magnitude(x32: Any) -> Any:
    """``|x|`` with non-finite entries as 0: what an amax is taken over."""
    magnitude = lax.abs(x32)
    # The zeros like `magnitude`, not `x32`: inside a trace, `full_like` of a
    # concrete array split over an Explicit mesh (a batch the jit closes over)
    # is not split like it, and `select` wants its cases typed alike.
    return lax.select(lax.is_finite(x32), magnitude, lax.full_like(magnitude, 0.0))


def finite_amax(x: Any) -> Any:
    """The largest finite ``|x|`` over all of `x`, a float32 scalar (0 if there is none)."""
    x32 = lax.convert_element_type(x, _F32)
    return lax.reduce_max(_finite_magnitude(x32), tuple(range(x32.ndim)))


def scale_for_amax(amax: Any, fmt: Any, power_of_two: bool = False) -> Any:
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


def apply_scale(x32: Any, scale: Any, fmt: Any) -> Any:
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
    scales = scale_for_amax(jax.ops.segment_max(row_amax, group_ids, num_segments=num_groups), fmt)
    row_scales = scales[group_ids].reshape((-1,) + (1,) * (x32.ndim - 1))
    return apply_scale(x32, row_scales, fmt), scales


def quantize_blocks(
    x: Any, axis: int, block: int, mode: str, free_axis: int | None = None, free_block: int = 1, fmt: Any = E4M3
) -> tuple[Any, Any]:
    """Quantise `x` to `fmt` (e4m3 by default) with one scale per block of `block` entries along `axis`.

    With `free_axis`, a block also spans `free_block` entries along it (the
    128x128 weight tiles of Transformer Engine's ``Float8BlockScaling``).

    Args:
        x: an array whose `axis` (and `free_axis`) sizes the blocks divide.
        mode: ``"mxfp8"``: the OCP MX format as `jax.nn.scaled_dot_general`
            quantises it (scale ``amax / max(fmt)`` rounded up to a power of two
            and stored as e8m0, an all-zero block scaled by 2^-127; an inf or
            NaN in a block makes the whole block NaN, as there). ``"blockwise"``:
            amax of the finite entries, the scale rounded up to a power of two,
            non-finite entries passed through (see `quantize`).

    Returns:
        ``(q, scales)``: `q` in `fmt` with `x`'s shape, and float32 scales with
        `axis` (and `free_axis`) divided by the block sizes.
    """
    x32 = lax.convert_element_type(x, _F32)
    shape = x32.shape
    split, inner = [], []  # the blocked layout; the dims inside a block
    for dim, size in enumerate(shape):
        if dim in (axis, free_axis):
            width = block if dim == axis else free_block
            split += [size // width, width]
            inner.append(len(split) - 1)
        else:
            split.append(size)
    blocked = lax.reshape(x32, tuple(split))
    fmax = np.float32(jnp.finfo(fmt).max)
    if mode == "mxfp8":
        amax = lax.reduce_max(lax.abs(blocked), tuple(inner))
        scale, reciprocal = _e8m0_rounded_up(amax / fmax)
        # Times the exact power-of-two reciprocal, not divided by the scale: an
        # all-zero block's scale 2^-127 is a float32 subnormal, which the CPU
        # flushes to zero (0 / 0 = NaN; the GPU path gives 0).
        q = lax.clamp(-fmax, blocked * lax.expand_dims(reciprocal, inner), fmax)
        q = lax.convert_element_type(q, fmt)
    else:
        scale = scale_for_amax(lax.reduce_max(_finite_magnitude(blocked), tuple(inner)), fmt, power_of_two=True)
        q = apply_scale(blocked, lax.expand_dims(scale, inner), fmt)
    return lax.reshape(q, tuple(shape)), scale


def _e8m0_rounded_up(scale: Any) -> tuple[Any, Any]:
    """A positive float32 scale as OCP MX's e8m0 holds it, rounded up: ``(scale, 1 / scale)`` in float32.

    Bit for bit `jax._src.cudnn.scaled_matmul_stablehlo`'s
    ``cast_to_e8m0_with_rounding_up`` followed by ``e8m0_to_dtype``: a
    mantissa bit set rounds the exponent up (not past 2^127, and not for a
    subnormal of at most half the smallest normal); exponent 0 reads as
    2^-127, exponent 255 (an inf or NaN amax) as inf.
    """
    bits = lax.bitcast_convert_type(scale, np.uint32)
    exponent = lax.shift_right_logical(bits, np.uint32(23))
    mantissa = lax.bitwise_and(bits, np.uint32(0x7FFFFF))
    round_up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    exponent = lax.bitwise_and(exponent + lax.convert_element_type(round_up, np.uint32), np.uint32(0xFF))
    value = lax.bitcast_convert_type(lax.shift_left(exponent, np.uint32(23)), _F32)
    value = lax.select(value == 0, lax.full_like(value, 2.0**-127), value)
    inverse = lax.bitcast_convert_type(lax.shift_left(np.uint32(254) - exponent, np.uint32(23)), _F32)
    inverse = lax.select(exponent == 0xFF, lax.full_like(inverse, 0.0), inverse)
    return value, inverse


def place(scale: Any, kept: Sequence[int], position: dict, shape: Sequence[int]) -> Any:
    """`scale` (over dims `kept` of its operand, in order) broadcast into a result of `shape`.

    `position` maps each kept dim to the result's dimension it becomes.
    """
    order = sorted(range(len(kept)), key=lambda k: position[kept[k]])
    return lax.broadcast_in_dim(lax.transpose(scale, order), tuple(shape), tuple(position[kept[k]] for k in order))
