"""float8 matmuls: amp's ``compute_dtype="fp8"`` mode.

fp8 mode is bf16 mode with float8 matmuls: amp computes in bfloat16, and the
table entries of the matmul primitives (``dot_general``, ``ragged_dot_general``,
``conv_general_dilated``) that run in compute precision become `Fp8MatmulRule`.
That rule replaces each matmul it accepts with a scaled float8 matmul, the
"current scaling" recipe of Transformer Engine's ``Float8CurrentScaling`` and
torchao's tensorwise dynamic scaling:

* forward: each operand ``x`` gets ``scale = amax / 448`` (amax the largest
  finite ``|x|`` of the live tensor, in float32; 1 for a zero tensor), is
  quantised as ``x / scale`` saturated to e4m3's ±448 (inf and NaN entries
  pass through as NaN, see `quantize`), and the matmul of the two float8_e4m3fn operands
  accumulates in float32; the result, times both scales, goes on in bfloat16;
* backward (a `jax.custom_vjp`, so that JAX's transpose cannot choose the
  formats): the incoming cotangent is quantised the same way to float8_e5m2
  (wider range, ±57344) and meets the saved e4m3 operands in the gradient
  matmuls, again accumulating in float32. Convolutions need one dtype on both
  sides, so their gradient convolutions run e4m3 x e4m3 (see `_COTANGENT_FORMAT`).

Matmuls it does not accept run in bfloat16, with the reason recorded for
`jaxamp.explain`. By default, as Transformer Engine, torchao and torchtitan
set float8 up: the program's last matmul (the logits), batched matmuls
(attention's scores and values), grouped matmuls, and matmuls whose sizes a
float8 GEMM cannot take (not multiples of 16); always non-float operands. The
`Fp8Recipe` fields opt in; grouped matmuls then get a scale per group.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from .. import _compat
from .._casting import dtype_of
from .._dtypes import dtype_short_name, is_castable
from .._jaxpr import MATMUL_NAMES, equation_flops, matmuls_in
from ..transform._interpreter import HANDLERS, EquationRewrite
from ..transform._rules import PolicyTable, Rule, use_compute_precision
from ._recipe import Fp8Recipe

__all__ = [
    "Fp8MatmulRule",
    "contraction_size",
    "formats",
    "is_per_group_layout",
    "output_features",
    "quantize",
    "with_fp8_matmuls",
]

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
_F32 = np.dtype(jnp.float32)

# The cotangent's format in the gradient matmuls, by primitive (e5m2 unless
# listed); the saved operands are e4m3. A convolution takes one dtype for both
# operands, and e4m3 on both sides halved the gradient error of e5m2 on both
# sides on the digits CNN's convolutions (figures in README "## float8"): with
# a scale taken from the live cotangent, e5m2's extra range is not needed for
# its largest values, and its 2 mantissa bits cost more than e4m3's 3.
_COTANGENT_FORMAT = {"conv_general_dilated": E4M3}

# --- quantisation and the scaled matmul ----------------------------------------


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
    return _quantize_along(x, fmt, range(np.ndim(x)), power_of_two)


def _quantize_along(x: Any, fmt: Any, contracted: Sequence[int], power_of_two: bool = False) -> tuple[Any, Any]:
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


def _quantize_rows_by_group(x: Any, fmt: Any, group_ids: Any, num_groups: int) -> tuple[Any, Any]:
    """`quantize` with one scale per group of rows (rows of group ``group_ids[i]``).

    Returns ``(q, scales)``, `scales` of shape ``(num_groups,)``.
    """
    x32 = lax.convert_element_type(x, _F32)
    row_amax = lax.reduce_max(_finite_magnitude(x32), tuple(range(1, x32.ndim)))
    scales = _scale(jax.ops.segment_max(row_amax, group_ids, num_segments=num_groups), fmt)
    row_scales = scales[group_ids].reshape((-1,) + (1,) * (x32.ndim - 1))
    return _apply_scale(x32, row_scales, fmt), scales


def _scaled_matmul(primitive, params, lhs_dtype, rhs_dtype, out_dtype, power_of_two=False):
    """``f(lhs, rhs, *rest)``: the matmul in float8 with current scaling (see the module doc).

    Args:
        primitive, params: the matmul equation's primitive and bind parameters.
        lhs_dtype, rhs_dtype: the operands' dtypes as amp holds them, which
            their cotangents must have.
        out_dtype: the dtype the result is handed on in (amp's compute dtype).
        power_of_two: round the scales up to powers of two.
    """
    params = dict(params, preferred_element_type=_F32)
    cotangent_format = _COTANGENT_FORMAT.get(primitive.name, E5M2)

    def forward(lhs, rhs, *rest):
        q_lhs, s_lhs = quantize(lhs, E4M3, power_of_two)
        q_rhs, s_rhs = quantize(rhs, E4M3, power_of_two)
        out = primitive.bind(q_lhs, q_rhs, *rest, **params)
        return (out * (s_lhs * s_rhs)).astype(out_dtype), (q_lhs, s_lhs, q_rhs, s_rhs, rest)

    @jax.custom_vjp
    def matmul(lhs, rhs, *rest):
        return forward(lhs, rhs, *rest)[0]

    def backward(residuals, g):
        q_lhs, s_lhs, q_rhs, s_rhs, rest = residuals
        q_g, s_g = quantize(g, cotangent_format, power_of_two)
        # JAX's own transposes, on the float8 operands as they are typed here
        # (sharding, varying axes): the gradient matmuls' dimension numbers,
        # paddings, feature groups and output shardings stay JAX's.
        d_lhs, d_rhs = _compat.matmul_cotangents(primitive, q_g, q_lhs, q_rhs, rest, params, _F32)
        # Integer operands (a ragged dot's group sizes) get no cotangent.
        return (
            (d_lhs * (s_g * s_rhs)).astype(lhs_dtype),
            (d_rhs * (s_g * s_lhs)).astype(rhs_dtype),
            *(None for _ in rest),
        )

    matmul.defvjp(forward, backward)
    return matmul


def _place(scale: Any, kept: Sequence[int], position: dict, shape: Sequence[int]) -> Any:
    """`scale` (over dims `kept` of its operand, in order) broadcast into a result of `shape`.

    `position` maps each kept dim to the result's dimension it becomes.
    """
    order = sorted(range(len(kept)), key=lambda k: position[kept[k]])
    return lax.broadcast_in_dim(
        lax.transpose(scale, order), tuple(shape), tuple(position[kept[k]] for k in order)
    )


def _scaled_rowwise_dot(params, lhs_dtype, rhs_dtype, out_dtype, power_of_two, weight_gradient_hp):
    """``f(lhs, rhs)``: a ``dot_general`` in float8 with a scale per row along each contraction.

    torchao's rowwise recipe, for any dimension numbers. Forward: each
    operand gets one scale per index of its dimensions other than the
    contracting ones (a left operand's rows, a right operand's columns).
    Backward: the operands, saved in the compute dtype, are quantised again
    along the gradient matmuls' own contractions (``d_lhs`` contracts the
    right operand's free dimensions, ``d_rhs`` the left operand's), as is the
    cotangent; with `weight_gradient_hp` the right operand's gradient runs in
    the compute dtype instead.
    """
    primitive = _compat.primitives_by_name()["dot_general"]
    params = dict(params, preferred_element_type=_F32)
    (lc, rc), (lb, rb) = params["dimension_numbers"]

    def layout(lhs_ndim, rhs_ndim):
        lf = [d for d in range(lhs_ndim) if d not in (*lc, *lb)]
        rf = [d for d in range(rhs_ndim) if d not in (*rc, *rb)]
        batch, out_lf = range(len(lb)), range(len(lb), len(lb) + len(lf))
        out_rf = range(len(lb) + len(lf), len(lb) + len(lf) + len(rf))
        return lf, rf, batch, out_lf, out_rf

    def forward(lhs, rhs):
        lf, rf, batch, out_lf, out_rf = layout(lhs.ndim, rhs.ndim)
        q_lhs, s_lhs = _quantize_along(lhs, E4M3, lc, power_of_two)
        q_rhs, s_rhs = _quantize_along(rhs, E4M3, rc, power_of_two)
        out = primitive.bind(q_lhs, q_rhs, **params)
        to_out_lhs = {**dict(zip(lb, batch)), **dict(zip(lf, out_lf))}
        to_out_rhs = {**dict(zip(rb, batch)), **dict(zip(rf, out_rf))}
        out = out * _place(s_lhs, sorted(to_out_lhs), to_out_lhs, out.shape)
        out = out * _place(s_rhs, sorted(to_out_rhs), to_out_rhs, out.shape)
        return out.astype(out_dtype), (lhs.astype(out_dtype), rhs.astype(out_dtype))

    @jax.custom_vjp
    def matmul(lhs, rhs):
        return forward(lhs, rhs)[0]

    def gradient(side, g, operand, other, g_contracted, g_to, operand_contracted, operand_to):
        # One gradient matmul: the cotangent and `operand` (the other side's
        # operand) quantised along this matmul's contraction, the result
        # rescaled by both scales placed in `other`'s layout.
        q_g, s_g = _quantize_along(g, E5M2, g_contracted, power_of_two)
        q_operand, s_operand = _quantize_along(operand, E4M3, operand_contracted, power_of_two)
        pair = (other, q_operand) if side == "lhs" else (q_operand, other)
        found = _compat.matmul_cotangents(primitive, q_g, *pair, (), params, _F32, only=side)
        d = found[0] if side == "lhs" else found[1]
        d = d * _place(s_g, sorted(g_to), g_to, other.shape)
        return d * _place(s_operand, sorted(operand_to), operand_to, other.shape)

    def backward(residuals, g):
        lhs, rhs = residuals
        lf, rf, batch, out_lf, out_rf = layout(lhs.ndim, rhs.ndim)
        # d_lhs contracts the cotangent's and the right operand's free dims.
        d_lhs = gradient(
            "lhs", g, rhs, lhs,
            tuple(out_rf), {**dict(zip(batch, lb)), **dict(zip(out_lf, lf))},
            rf, {**dict(zip(rb, lb)), **dict(zip(rc, lc))},
        )  # fmt: skip
        if weight_gradient_hp:
            high = dict(params, preferred_element_type=np.dtype(out_dtype))
            d_rhs = _compat.matmul_cotangents(primitive, g.astype(out_dtype), lhs, rhs, (), high, only="rhs")[1]
        else:  # d_rhs contracts the cotangent's and the left operand's free dims.
            d_rhs = gradient(
                "rhs", g, lhs, rhs,
                tuple(out_lf), {**dict(zip(batch, rb)), **dict(zip(out_rf, rf))},
                lf, {**dict(zip(lb, rb)), **dict(zip(lc, rc))},
            )  # fmt: skip
        return d_lhs.astype(lhs_dtype), d_rhs.astype(rhs_dtype)

    matmul.defvjp(forward, backward)
    return matmul


def _split_blocks(aval, blocks):
    """`aval`'s layout with its `blocks` dims split into ``(shards, size // shards)``.

    Returns ``(shape, spec, at, block_at)``: the split shape and spec (the
    shard dim carries the mesh axes, the remainder none), and, per original
    dim, where it (its remainder) and its shard dim land.
    """
    spec = _spec_of(aval)
    new_shape, new_spec, at, block_at = [], [], {}, {}
    for dim, size in enumerate(aval.shape):
        if dim in blocks:
            shards, entry = blocks[dim]
            block_at[dim] = len(new_shape)
            new_shape += [shards, size // shards]
            new_spec += [entry, None]
        else:
            new_shape.append(size)
            new_spec.append(spec[dim])
        at[dim] = len(new_shape) - 1
    return tuple(new_shape), new_spec, at, block_at


def _spec_of(aval):
    spec = tuple(aval.sharding.spec)
    return spec + (None,) * (aval.ndim - len(spec))


def _free_dims(ndim, contracting, batch):
    return [d for d in range(ndim) if d not in (*contracting, *batch)]


def sharded_free_dims(eqn: Any, lhs: Any, rhs: Any) -> tuple[dict, dict]:
    """The dims of a ``dot_general``'s operands that `_scaled_sharded_dot` scales per shard.

    Each operand's dimensions split over Explicit mesh axes that the matmul
    neither contracts nor batches: ``({dim: (shards, spec entry)}, {...})``.
    Empty off an Explicit mesh.
    """
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]

    def blocks(x, contracting, batch, other):
        # The other operand is broadcast along these dims, which it can only
        # be where it is not split over the same mesh axes itself.
        taken = {name for entry in _spec_of(jax.typeof(other)) for name in _axis_names(entry)}
        shards = _compat.explicit_shards(x)
        return {
            d: shards[d]
            for d in _free_dims(np.ndim(x), contracting, batch)
            if d in shards and not taken.intersection(_axis_names(shards[d][1]))
        }

    return blocks(lhs, lc, lb, rhs), blocks(rhs, rc, rb, lhs)


def _axis_names(entry: Any) -> tuple:
    if entry is None:
        return ()
    return entry if isinstance(entry, tuple) else (entry,)


def _scaled_sharded_dot(params, lhs_aval, rhs_aval, lhs_blocks, rhs_blocks, out_dtype, power_of_two=False):
    """``f(lhs, rhs)``: a tensorwise ``dot_general`` in float8 with a scale per shard.

    On an Explicit mesh, an operand dimension that is split over mesh axes and
    not contracted (an activation's batch or sequence dimension, a
    column-parallel weight's output features) gets one scale per shard, so no
    amax crosses devices: `lhs_blocks` and `rhs_blocks` (`sharded_free_dims`)
    name those dimensions. Each is split into ``(shards, rest)`` and the shard
    dims become batch dimensions of the float8 ``dot_general``, the other
    operand broadcast along them (each device holds its shard's view), so every
    product, forward and backward, meets one scale per operand and block. A
    gradient that sums over blocks (data parallelism's weight gradient, tensor
    parallelism's input gradient) sums the rescaled per-block products: the
    all-reduce the bfloat16 step makes too. A dimension split along a
    contraction (an FSDP or row-parallel weight) keeps one scale across its
    shards, which must agree.
    """
    primitive = _compat.primitives_by_name()["dot_general"]
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    lhs_order, rhs_order = sorted(lhs_blocks), sorted(rhs_blocks)
    kl, kr, nb = len(lhs_order), len(rhs_order), len(lb)
    l_split, r_split = _split_blocks(lhs_aval, lhs_blocks), _split_blocks(rhs_aval, rhs_blocks)
    l_free, r_free = _free_dims(lhs_aval.ndim, lc, lb), _free_dims(rhs_aval.ndim, rc, rb)
    (_, _, l_at, l_block), (_, _, r_at, r_block) = l_split, r_split
    # Each operand split, the other's shard dims in front of it.
    l_front = [rhs_blocks[d] for d in rhs_order]
    r_front = [lhs_blocks[d] for d in lhs_order]
    blocked_params = dict(
        params,
        out_sharding=_blocked_out_sharding(params.get("out_sharding"), lb, l_free, r_free, lhs_order, rhs_order),
        dimension_numbers=(
            (tuple(kr + l_at[d] for d in lc), tuple(kl + r_at[d] for d in rc)),
            (
                tuple(kr + l_at[d] for d in lb) + tuple(kr + l_block[d] for d in lhs_order) + tuple(range(kr)),
                tuple(kl + r_at[d] for d in rb) + tuple(range(kl)) + tuple(kl + r_block[d] for d in rhs_order),
            ),
        ),
        preferred_element_type=_F32,
    )
    # The blocked product is [batch, lhs shards, rhs shards, lhs free, rhs
    # free]; `order` puts each shard dim before its remainder, so that a
    # reshape merges them into the result's dims.
    order, position = list(range(nb)), nb + kl + kr
    for free, blocks, base in ((l_free, lhs_order, nb), (r_free, rhs_order, nb + kl)):
        for d in free:
            if d in blocks:
                order.append(base + blocks.index(d))
            order.append(position)
            position += 1
    out_shape, out_spec = _product_layout(
        (lhs_aval.shape, _spec_of(lhs_aval)), (rhs_aval.shape, _spec_of(rhs_aval)), params["dimension_numbers"]
    )
    # The cotangent's way back: the blocked product's layout, in `order`.
    blocked_shape, blocked_spec = _product_layout(
        ((*(n for n, _ in l_front), *l_split[0]), [*(e for _, e in l_front), *l_split[1]]),
        ((*(n for n, _ in r_front), *r_split[0]), [*(e for _, e in r_front), *r_split[1]]),
        blocked_params["dimension_numbers"],
    )
    g_shape, g_spec = tuple(blocked_shape[i] for i in order), P(*(blocked_spec[i] for i in order))

    def split(x, layout):
        shape, spec, _, _ = layout
        return lax.reshape(lax.convert_element_type(x, _F32), shape, out_sharding=P(*spec))

    def quantize_blocks(x, layout, fmt):
        kept = sorted(layout[3].values())
        return _quantize_along(x, fmt, [d for d in range(x.ndim) if d not in kept], power_of_two)

    def with_front(x, layout, front):
        shape, spec, _, _ = layout
        k = len(front)
        return lax.broadcast_in_dim(
            x, (*(n for n, _ in front), *shape), tuple(range(k, k + len(shape))),
            out_sharding=P(*(entry for _, entry in front), *spec),
        )

    def merge(x, aval):
        return lax.reshape(x, aval.shape, out_sharding=P(*_spec_of(aval)))

    def forward(lhs, rhs):
        q_lhs, s_lhs = quantize_blocks(split(lhs, l_split), l_split, E4M3)
        q_rhs, s_rhs = quantize_blocks(split(rhs, r_split), r_split, E4M3)
        out = primitive.bind(with_front(q_lhs, l_split, l_front), with_front(q_rhs, r_split, r_front), **blocked_params)
        out = out * _place(s_lhs, range(kl), {i: nb + i for i in range(kl)}, out.shape)
        out = out * _place(s_rhs, range(kr), {j: nb + kl + j for j in range(kr)}, out.shape)
        out = lax.reshape(lax.transpose(out, order), out_shape, out_sharding=P(*out_spec))
        return out.astype(out_dtype), (q_lhs, s_lhs, q_rhs, s_rhs)

    @jax.custom_vjp
    def matmul(lhs, rhs):
        return forward(lhs, rhs)[0]

    def rescaled(d, side, s_g, s_other, own_blocks, aval):
        # `s_g` is over [lhs shards, rhs shards]; `own_blocks` maps this
        # operand's shard index (among its own) to its dim in `d`.
        lhs_side, k_front = side == "lhs", (kr if side == "lhs" else kl)
        g_position = {
            **{(i if lhs_side else kl + i): dim for i, dim in own_blocks.items()},
            **{((kl + j) if lhs_side else j): j for j in range(k_front)},
        }
        d = d * _place(s_g, range(kl + kr), g_position, d.shape)
        d = d * _place(s_other, range(k_front), {j: j for j in range(k_front)}, d.shape)
        return merge(lax.reduce_sum(d, tuple(range(k_front))) if k_front else d, aval)

    def backward(residuals, g):
        q_lhs, s_lhs, q_rhs, s_rhs = residuals
        blocked_lhs, blocked_rhs = with_front(q_lhs, l_split, l_front), with_front(q_rhs, r_split, r_front)
        # The cotangent in the blocked product's layout, a scale per block.
        g = lax.reshape(lax.convert_element_type(g, _F32), g_shape, out_sharding=g_spec)
        g = lax.transpose(g, tuple(int(i) for i in np.argsort(order)))
        q_g, s_g = _quantize_along(g, E5M2, [d for d in range(g.ndim) if not nb <= d < nb + kl + kr], power_of_two)
        d_lhs, d_rhs = _compat.matmul_cotangents(primitive, q_g, blocked_lhs, blocked_rhs, (), blocked_params, _F32)
        # Each is [the other operand's shards, its own split layout]: rescale
        # per block, sum over the other operand's shards, merge.
        d_lhs = rescaled(d_lhs, "lhs", s_g, s_rhs, {i: kr + l_block[d] for i, d in enumerate(lhs_order)}, lhs_aval)
        d_rhs = rescaled(d_rhs, "rhs", s_g, s_lhs, {i: kl + r_block[d] for i, d in enumerate(rhs_order)}, rhs_aval)
        return d_lhs.astype(lhs_aval.dtype), d_rhs.astype(rhs_aval.dtype)

    matmul.defvjp(forward, backward)
    return matmul


def _blocked_out_sharding(out_sharding, lb, l_free, r_free, lhs_order, rhs_order):
    """The user's ``out_sharding`` of a ``dot_general``, for its blocked product (or None)."""
    if out_sharding is None:
        return None
    spec = tuple(out_sharding.spec)
    spec += (None,) * (len(lb) + len(l_free) + len(r_free) - len(spec))
    batch, l_spec, r_spec = spec[: len(lb)], spec[len(lb) : len(lb) + len(l_free)], spec[len(lb) + len(l_free) :]
    l_entries = dict(zip(l_free, l_spec))
    r_entries = dict(zip(r_free, r_spec))
    blocks = [l_entries[d] for d in lhs_order] + [r_entries[d] for d in rhs_order]
    l_rest = [None if d in lhs_order else l_entries[d] for d in l_free]
    r_rest = [None if d in rhs_order else r_entries[d] for d in r_free]
    return jax.sharding.NamedSharding(out_sharding.mesh, P(*batch, *blocks, *l_rest, *r_rest))


def _product_layout(lhs, rhs, dimension_numbers):
    """The shape and spec of a ``dot_general``'s result from its operands' ``(shape, spec)``."""
    (lhs_shape, lhs_spec), (rhs_shape, rhs_spec) = lhs, rhs
    (lc, rc), (lb, rb) = dimension_numbers
    l_free, r_free = _free_dims(len(lhs_shape), lc, lb), _free_dims(len(rhs_shape), rc, rb)
    shape = [lhs_shape[d] for d in lb] + [lhs_shape[d] for d in l_free] + [rhs_shape[d] for d in r_free]
    spec = [lhs_spec[d] for d in lb] + [lhs_spec[d] for d in l_free] + [rhs_spec[d] for d in r_free]
    return tuple(shape), spec


def _scaled_ragged_dot(params, lhs_dtype, rhs_dtype, out_dtype):
    """``f(lhs, rhs, group_sizes)``: `lax.ragged_dot` in float8 with a scale per group.

    For the layout of `lax.ragged_dot` (`is_per_group_layout`): ``lhs[m, k]``
    whose rows belong to the groups in order (``group_sizes``), ``rhs[g, k,
    n]``. Each group's rows of `lhs`, its slice of `rhs` and its rows of the
    cotangent get their own scale, so an expert with small values keeps its
    precision. Within a group both operands' scales are constant, so each
    product (forward and both gradients) is rescaled per group afterwards.
    """
    params = dict(params, preferred_element_type=_F32)
    primitive = _compat.primitives_by_name()["ragged_dot_general"]

    def group_ids(group_sizes, rows):
        groups = jnp.arange(group_sizes.shape[0], dtype=group_sizes.dtype)
        return jnp.repeat(groups, group_sizes, total_repeat_length=rows)

    def forward(lhs, rhs, group_sizes):
        num_groups, rows = rhs.shape[0], lhs.shape[0]
        ids = group_ids(group_sizes, rows)
        q_lhs, s_lhs = _quantize_rows_by_group(lhs, E4M3, ids, num_groups)
        q_rhs, s_rhs = _quantize_along(rhs, E4M3, range(1, rhs.ndim))  # a scale per group
        out = primitive.bind(q_lhs, q_rhs, group_sizes, **params)
        out = out * (s_lhs * s_rhs)[ids][:, None]
        return out.astype(out_dtype), (q_lhs, s_lhs, q_rhs, s_rhs, group_sizes, ids)

    @jax.custom_vjp
    def matmul(lhs, rhs, group_sizes):
        return forward(lhs, rhs, group_sizes)[0]

    def backward(residuals, g):
        q_lhs, s_lhs, q_rhs, s_rhs, group_sizes, ids = residuals
        q_g, s_g = _quantize_rows_by_group(g, E5M2, ids, q_rhs.shape[0])
        d_lhs, d_rhs = _compat.matmul_cotangents(primitive, q_g, q_lhs, q_rhs, [group_sizes], params, _F32)
        d_lhs = d_lhs * (s_g * s_rhs)[ids][:, None]
        d_rhs = d_rhs * (s_g * s_lhs)[:, None, None]
        return d_lhs.astype(lhs_dtype), d_rhs.astype(rhs_dtype), None

    matmul.defvjp(forward, backward)
    return matmul


def is_per_group_layout(eqn: Any) -> bool:
    """Whether a ``ragged_dot_general`` is laid out as `lax.ragged_dot` makes it.

    ``lhs[m, k]`` ragged along its rows, ``rhs[g, k, n]`` grouped along its
    first axis, contracting ``k``, no batch dimensions: the layout whose
    per-group scales `_scaled_ragged_dot` knows.
    """
    numbers = eqn.params["ragged_dot_dimension_numbers"]
    lhs, rhs = (v.aval.ndim for v in eqn.invars[:2])
    return (
        (lhs, rhs) == (2, 3)
        and tuple(numbers.lhs_ragged_dimensions) == (0,)
        and tuple(numbers.rhs_group_dimensions) == (0,)
        and _normalised(numbers.dot_dimension_numbers) == (((1,), (1,)), ((), ()))
    )


def _normalised(dimension_numbers: Any) -> tuple:
    (lc, rc), (lb, rb) = dimension_numbers
    return (tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))


def formats(primitive_name: str, recipe: Fp8Recipe | None = None) -> str:
    """How fp8 mode runs a matmul of `primitive_name` under `recipe`, for diagnostics."""
    recipe = Fp8Recipe() if recipe is None else recipe
    cotangent = dtype_short_name(_COTANGENT_FORMAT.get(primitive_name, E5M2))
    backward = f"backward {cotangent} x e4m3 -> f32"
    if primitive_name == "ragged_dot_general":
        scaling = "current, per group"
    elif primitive_name == "dot_general" and recipe.scaling != "tensorwise":
        scaling = "current, rowwise"
        if recipe.scaling == "rowwise_with_gw_hp":
            backward += " (weight gradient bf16)"
    else:
        scaling = "current"
    if recipe.rounds_scales_to_powers_of_two and primitive_name != "ragged_dot_general":
        scaling += ", power-of-two scales"
    return f"float8 e4m3 x e4m3 -> f32; {backward}; scaling: {scaling}"


# --- the rule -----------------------------------------------------------------


def contraction_size(eqn: Any) -> int:
    """How many products each output element of a matmul equation sums."""
    name = eqn.primitive.name
    if name == "conv_general_dilated":
        kernel = eqn.invars[1].aval.shape
        return math.prod(kernel) // kernel[eqn.params["dimension_numbers"].rhs_spec[0]]
    if name == "ragged_dot_general":
        dimension_numbers = eqn.params["ragged_dot_dimension_numbers"].dot_dimension_numbers
    else:
        dimension_numbers = eqn.params["dimension_numbers"]
    (lhs_contract, _), _ = dimension_numbers
    lhs = eqn.invars[0].aval.shape
    return math.prod(lhs[d] for d in lhs_contract)


def output_features(eqn: Any) -> int:
    """A matmul's N: the right-hand operand's free size (a convolution's output features)."""
    name = eqn.primitive.name
    rhs = eqn.invars[1].aval.shape
    if name == "conv_general_dilated":
        return rhs[eqn.params["dimension_numbers"].rhs_spec[0]]
    if name == "ragged_dot_general":
        numbers = eqn.params["ragged_dot_dimension_numbers"]
        (_, contract), (_, batch) = numbers.dot_dimension_numbers
        bound = (*contract, *batch, *numbers.rhs_group_dimensions)
    else:
        (_, contract), (_, batch) = eqn.params["dimension_numbers"]
        bound = (*contract, *batch)
    return math.prod(d for i, d in enumerate(rhs) if i not in bound)


def _gemm_contraction(eqn: Any) -> int:
    # A convolution's GEMM contracts input features per group (its window is
    # the implicit GEMM's loop, not a dimension the float8 kernel aligns).
    if eqn.primitive.name == "conv_general_dilated":
        kernel = eqn.invars[1].aval.shape
        return kernel[eqn.params["dimension_numbers"].rhs_spec[1]]
    return contraction_size(eqn)


@dataclasses.dataclass(frozen=True)
class Fp8MatmulRule:
    """The table entry of a matmul primitive in fp8 mode.

    Called as an ordinary rule (the seed signature), it runs the matmul in
    compute precision (bfloat16), as `use_compute_precision`: that is what a
    matmul it keeps out of float8 gets. Its `rewrite_equation` is what amp's
    interpreter asks first (see `jaxamp.transform._interpreter.EquationRewrite`).

    Attributes:
        recipe: the fp8 options.
        last_matmul: the equation `for_program` found to be the program's last
            matmul (compared by identity), when the recipe keeps it in bf16.
    """

    recipe: Fp8Recipe
    last_matmul: Any = None

    def __call__(self, compute_dtype, original_dtypes, *invars, **bind_params):
        return use_compute_precision(compute_dtype, original_dtypes, *invars, **bind_params)

    def for_program(self, jaxpr: Any) -> Fp8MatmulRule:
        """This rule for one amp'd program: it knows the program's last matmul.

        Each program gets its own rule object, so amp's cache of rewritten
        bodies (keyed on the table) never serves one program's decision to another.
        """
        if not self.recipe.keep_last_matmul_bf16:
            return self
        last = None
        # Only the bodies amp rewrites (those of primitives with a handler),
        # not a Pallas kernel's.
        for last in matmuls_in(jaxpr, enter=lambda eqn: eqn.primitive in HANDLERS):
            pass
        return dataclasses.replace(self, last_matmul=last)

    def rewrite_equation(
        self, compute_dtype, original_dtypes, eqn, *invars, **bind_params
    ) -> EquationRewrite:
        """Replace a matmul equation by the scaled float8 matmul, or say why not."""
        reason = self._keep_out(original_dtypes, eqn)
        if reason:
            return EquationRewrite(None, (), f"kept {dtype_short_name(compute_dtype)}: {reason}")
        lhs, rhs, *rest = invars
        recipe, name = self.recipe, eqn.primitive.name
        dtypes = (dtype_of(lhs), dtype_of(rhs), compute_dtype)
        power_of_two = recipe.rounds_scales_to_powers_of_two
        description = formats(name, recipe)
        if name == "ragged_dot_general":
            fn = _scaled_ragged_dot(bind_params, *dtypes)
        elif name == "dot_general" and recipe.scaling != "tensorwise":
            weight_gradient_hp = recipe.scaling == "rowwise_with_gw_hp"
            fn = _scaled_rowwise_dot(bind_params, *dtypes, power_of_two, weight_gradient_hp)
        elif name == "dot_general" and any(blocks := sharded_free_dims(eqn, lhs, rhs)):
            avals = (_compat.with_dtype(jax.typeof(lhs), dtypes[0]), _compat.with_dtype(jax.typeof(rhs), dtypes[1]))
            fn = _scaled_sharded_dot(bind_params, *avals, *blocks, compute_dtype, power_of_two)
            axes = sorted({name for side in blocks for _, entry in side.values() for name in _axis_names(entry)})
            description += f", a scale per shard along {', '.join(map(str, axes))}"
        else:
            fn = _scaled_matmul(eqn.primitive, bind_params, *dtypes, power_of_two)
        operand_dtypes = (E4M3, E4M3, *(dtype_of(x) for x in rest))
        return EquationRewrite(fn, operand_dtypes, description)

    def _keep_out(self, original_dtypes, eqn) -> str:
        """Why the matmul stays in compute precision, or ``""``."""
        operands = original_dtypes[:2]
        if not all(is_castable(d) for d in operands):
            names = " x ".join(dtype_short_name(d) for d in operands)
            return f"{names} operands (float8 takes float32, bfloat16 or float16)"
        if eqn is self.last_matmul:
            return "the program's last matmul (keep_last_matmul_bf16)"
        name = eqn.primitive.name
        if name == "dot_general" and eqn.params["dimension_numbers"][1][0] and not self.recipe.attention:
            return "a batched matmul: attention's scores and values (Fp8Recipe(attention=True) takes it)"
        if name == "ragged_dot_general":
            if not self.recipe.grouped:
                return "a grouped matmul (Fp8Recipe(grouped=True) takes it, with a scale per group)"
            if not is_per_group_layout(eqn):
                return "a grouped matmul not laid out as lax.ragged_dot makes it (no per-group scales for it)"
        contraction, least = contraction_size(eqn), self.recipe.min_contraction
        if contraction < least:
            return f"contraction size {contraction} < min_contraction {least}"
        multiple = self.recipe.gemm_multiple
        for what, size in (("contraction size", _gemm_contraction(eqn)), ("output features", output_features(eqn))):
            if size % multiple:
                return f"{what} {size} is not a multiple of {multiple} (float8 GEMMs need it; gemm_multiple)"
        flops = equation_flops(eqn)
        if flops < self.recipe.min_flops:
            return f"{flops} FLOPs < min_flops {self.recipe.min_flops}"
        return ""


def with_fp8_matmuls(table: Mapping[Any, Rule], recipe: Fp8Recipe) -> PolicyTable:
    """`table` with its matmul primitives' compute-precision entries replaced by `Fp8MatmulRule`.

    Entries the user changed (a matmul primitive mapped to another rule, any
    scope) keep their meaning: only where the table says "this matmul runs in
    compute precision" does fp8 mode say "in float8".
    """
    rule = Fp8MatmulRule(recipe)
    by_name = _compat.primitives_by_name()
    primitives = [by_name[name] for name in MATMUL_NAMES if name in by_name]
    return PolicyTable(
        {**table, **{p: rule for p in primitives if table.get(p) is use_compute_precision}}
    )
