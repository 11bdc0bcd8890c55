"""fp8 mode's scaling schemes: how each kind of float8 matmul quantises, multiplies and differentiates.

Each is a `jaxamp.fp8._differentiable.Scheme`; `differentiable_matmul` makes
it a function JAX differentiates in every mode. Forward-mode tangents are
multiplied in the compute dtype with the other operand as float8 holds it (the
straight-through estimator); gradients run in float8, as each recipe says.

* `Tensorwise`: Transformer Engine's ``Float8CurrentScaling``, torchao's
  tensorwise recipe; any matmul primitive.
* `Delayed`: tensorwise with scales from an amax history (Transformer
  Engine's ``DelayedScaling``, `jaxamp.fp8._state`); ``dot_general`` and
  convolutions.
* `Rowwise`: torchao's rowwise and ``rowwise_with_gw_hp`` recipes; ``dot_general``.
* `PerGroup`: `lax.ragged_dot` with a scale per group (expert).
* `PerShard`: tensorwise with a scale per shard of the dimensions an Explicit
  mesh splits and the matmul does not contract; ``dot_general``.
* `PerShardConv`: tensorwise with a scale per device's shard on an Explicit
  mesh, each product a `jax.shard_map`; convolutions.
* `AutoPerShard`: tensorwise with a scale per device's shard on an Auto mesh,
  decided when XLA partitions the program (`jaxamp.fp8._partitioned`);
  ``dot_general`` and convolutions without batch groups.
* `BlockScaled`: MXFP8 and Transformer Engine's blockwise recipe; ``dot_general``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .. import _compat
from ._differentiable import OTHER_SIDE
from ._partitioned import (
    ConvShardLayouts,
    LocalConv,
    LocalScaling,
    axis_names,
    conv_per_device,
    dequantize_per_device,
    free_dims,
    per_shard_conv,
    per_shard_dot,
    quantize_per_device,
    spec_of,
)
from ._quantize import (
    E4M3,
    E5M2,
    apply_scale,
    finite_amax,
    place,
    quantize,
    quantize_along,
    quantize_blocks,
    quantize_rows_by_group,
)
from ._state import ROLES, history_scale, observation

__all__ = [
    "AutoPerShard",
    "BLOCK_SIZE",
    "BlockScaled",
    "Delayed",
    "PerGroup",
    "PerShard",
    "PerShardConv",
    "Rowwise",
    "Tensorwise",
    "blocked_dot",
    "shard_axes",
    "sharded_free_dims",
]

_F32 = np.dtype(jnp.float32)

BLOCK_SIZE = {"mxfp8": 32, "blockwise": 128}
"""The block length along the contraction of each block recipe."""


def _accumulating(params: dict, precision: Any = None) -> dict:
    """A matmul's bind parameters, accumulating in float32, with `precision`
    (`Fp8Recipe.accumulation_precisions`) when given."""
    params = dict(params, preferred_element_type=_F32)
    if precision is not None:
        params["precision"] = precision
    return params


def _conv_how(scheme: Any, formats: tuple, precision: Any, out_dtype: Any, side: str = "", shape=()) -> LocalConv:
    """The `LocalConv` of one of `scheme`'s convolution products (`side`'s cotangent, of whole `shape`, if given)."""
    params = tuple(sorted(_accumulating(scheme.params, precision).items()))
    return LocalConv(params, formats, scheme.power_of_two, np.dtype(out_dtype), side, tuple(shape))


def _tangent_product(scheme: Any, side: str, t: Any, other: Any, rest: tuple = ()) -> Any:
    """Forward mode's product: `side`'s tangent times the other operand, both in the compute dtype."""
    pair = _pair(side, t.astype(scheme.out_dtype), other.astype(scheme.out_dtype))
    return scheme.primitive.bind(*pair, *rest, **_accumulating(scheme.params)).astype(scheme.out_dtype)


def _pair(side: str, own: Any, other: Any) -> tuple[Any, Any]:
    """``(lhs, rhs)`` from `side`'s operand and the other one."""
    return (own, other) if side == "lhs" else (other, own)


def _chosen(side: str, found: tuple[Any, Any]) -> Any:
    return found[0] if side == "lhs" else found[1]


def _off_mesh(*xs: Any) -> bool:
    """Whether no mesh types `xs` (abstract values or arrays) or the context: JAX's transpose rules place
    the gradient matmuls there."""
    avals: list[Any] = [x if isinstance(x, jax.core.AbstractValue) else jax.typeof(x) for x in xs]
    return jax.sharding.get_abstract_mesh().empty and all(a.sharding.mesh.empty for a in avals)


@dataclasses.dataclass(frozen=True, eq=False)
class Tensorwise:
    """One scale per operand and per cotangent; float8 residuals.

    Forward e4m3 x e4m3 accumulating in float32; gradients take the cotangent
    in `gradient_format` (`Fp8Recipe.gradient_dtype`) against the saved e4m3
    operands, through JAX's own transposes at the operands' types (so their
    dimension numbers, paddings, feature groups and shardings are JAX's).
    """

    primitive: Any
    params: dict
    out_dtype: Any
    power_of_two: bool = False
    gradient_format: Any = E5M2
    precisions: tuple = (None, None)  # forward, gradient (`Fp8Recipe.accumulation_precisions`)

    def quantize(self, side, x, rest):
        return quantize(x, E4M3, self.power_of_two)

    def quantize_cotangent(self, g, rest):
        return quantize(g, self.gradient_format, self.power_of_two)

    def operands(self, rest):
        """The matmul's own operands among `rest` (a ragged dot's group sizes)."""
        return rest

    def product(self, lhs, rhs, rest):
        (q_lhs, s_lhs), (q_rhs, s_rhs) = lhs, rhs
        out = self.primitive.bind(q_lhs, q_rhs, *self.operands(rest), **_accumulating(self.params, self.precisions[0]))
        return (out * (s_lhs * s_rhs)).astype(self.out_dtype)

    def tangent(self, side, other, t, rest):
        q, s = other
        return _tangent_product(self, side, t, lax.convert_element_type(q, _F32) * s, self.operands(rest))

    def cotangent(self, side, other, aval, g, rest):
        q, s = other
        q_g, s_g = self.quantize_cotangent(g, rest)
        if self.primitive.name == "dot_general" and _off_mesh(aval, q):
            # The scales multiply the float8 product itself, before the
            # transpose into `side`'s layout (the same values): XLA's GPU GEMM
            # rewriter folds ``dot(f8, f8) * broadcast(scalar)`` into the
            # float8 GEMM's scale operands, and a transpose in between hides it.
            lhs_ndim, rhs_ndim = _pair(side, aval.ndim, q.ndim)
            dims, order = _gradient_dims(self.params["dimension_numbers"], side, lhs_ndim, rhs_ndim)
            params = _accumulating(self.params, self.precisions[1])
            d = lax.dot_general(q_g, q, dims, params.get("precision"), preferred_element_type=_F32)
            return lax.transpose(d * (s_g * s), order).astype(aval.dtype)
        found = _compat.matmul_cotangents(
            self.primitive,
            q_g,
            *_pair(side, aval, q),
            self.operands(rest),
            _accumulating(self.params, self.precisions[1]),
            _F32,
            only=side,
        )
        # Integer operands (a ragged dot's group sizes) get no cotangent.
        return (_chosen(side, found) * (s_g * s)).astype(aval.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class Delayed(Tensorwise):
    """`Tensorwise` with each scale from an amax history: Transformer Engine's ``DelayedScaling``.

    `rest` is ``(history,)``: the site's float32 ``[3, length]`` history
    (`jaxamp.fp8._state`), an input of the differentiable matmul so that its
    gradient can carry the step's amaxes out (`observe`, `observed`); or
    ``(loss scale, history)`` where the backward pass is loss-scaled
    (`SiteState.cotangent_scale`): the history's cotangent row then holds
    true-scale amaxes, and the cotangent is scaled by them times this step's
    loss scale. Values beyond a stale scale's range saturate to the format's
    largest; inf and NaN pass through (see `quantize`).
    """

    algorithm: str = "max"
    margin: int = 0
    observed_on_one_device_of: tuple = ()  # `SiteState.cotangents_summed_over`

    def _quantize_by_history(self, role: str, x: Any, history: Any, fmt: Any, units: Any = None) -> tuple[Any, Any]:
        x32 = lax.convert_element_type(x, _F32)
        row = history[ROLES.index(role)]
        scale = history_scale(row, x32, fmt, self.algorithm, self.margin, self.power_of_two, units)
        return apply_scale(x32, scale, fmt), scale

    def quantize(self, side, x, rest):
        return self._quantize_by_history(side, x, rest[-1], E4M3)

    def quantize_cotangent(self, g, rest):
        return self._quantize_by_history("cotangent", g, rest[-1], self.gradient_format, _loss_scale(rest))

    def operands(self, rest):
        return ()

    def observe(self, lhs, rhs, rest):
        """What `observed` needs from the forward pass: the operands' amaxes, float32 ``[2]``, and the loss scale."""
        # lax, not jnp.stack: a jnp helper adds a nested jit to every matmul.
        return lax.concatenate([lax.expand_dims(finite_amax(x), (0,)) for x in (lhs, rhs)], 0), _loss_scale(rest)

    def observed(self, forward, g, history_aval):
        """The history's cotangent: this step's amaxes (`forward`'s and the cotangent `g`'s) in its newest column."""
        amaxes, units = forward
        return observation(amaxes, g, history_aval, self.observed_on_one_device_of, units)


def _loss_scale(rest: tuple) -> Any:
    """The loss scale among a `Delayed` matmul's `rest`, or None (unscaled)."""
    return rest[0] if len(rest) > 1 else None


@dataclasses.dataclass(frozen=True, eq=False)
class Rowwise:
    """A ``dot_general`` with a scale per row along each contraction (torchao's rowwise).

    Forward: each operand gets one scale per index of its dimensions other
    than the contracting ones (a left operand's rows, a right operand's
    columns). Backward: the operands, saved in the compute dtype, are
    quantised again along the gradient matmuls' own contractions (``d_lhs``
    contracts the right operand's free dimensions, ``d_rhs`` the left
    operand's), as is the cotangent; with `weight_gradient_hp` the right
    operand's gradient runs in the compute dtype instead.
    """

    params: dict
    out_dtype: Any
    power_of_two: bool
    weight_gradient_hp: bool
    gradient_format: Any = E5M2
    precisions: tuple = (None, None)  # forward, gradient (`Fp8Recipe.accumulation_precisions`)

    @property
    def primitive(self) -> Any:
        return _compat.primitives_by_name()["dot_general"]

    def _layout(self, lhs_ndim, rhs_ndim):
        (lc, rc), (lb, rb) = self.params["dimension_numbers"]
        lf, rf = free_dims(lhs_ndim, lc, lb), free_dims(rhs_ndim, rc, rb)
        batch, out_lf = range(len(lb)), range(len(lb), len(lb) + len(lf))
        out_rf = range(len(lb) + len(lf), len(lb) + len(lf) + len(rf))
        return lf, rf, batch, out_lf, out_rf

    def quantize(self, side, x, rest):
        # Each product quantises along its own contraction: keep the operand.
        return x.astype(self.out_dtype)

    def product(self, lhs, rhs, rest):
        (lc, rc), (lb, rb) = self.params["dimension_numbers"]
        lf, rf, batch, out_lf, out_rf = self._layout(lhs.ndim, rhs.ndim)
        q_lhs, s_lhs = quantize_along(lhs, E4M3, lc, self.power_of_two)
        q_rhs, s_rhs = quantize_along(rhs, E4M3, rc, self.power_of_two)
        out = self.primitive.bind(q_lhs, q_rhs, **_accumulating(self.params, self.precisions[0]))
        to_out_lhs = {**dict(zip(lb, batch)), **dict(zip(lf, out_lf))}
        to_out_rhs = {**dict(zip(rb, batch)), **dict(zip(rf, out_rf))}
        out = out * place(s_lhs, sorted(to_out_lhs), to_out_lhs, out.shape)
        out = out * place(s_rhs, sorted(to_out_rhs), to_out_rhs, out.shape)
        return out.astype(self.out_dtype)

    def tangent(self, side, other, t, rest):
        return _tangent_product(self, side, t, other)

    def cotangent(self, side, other, aval, g, rest):
        (lc, rc), (lb, rb) = self.params["dimension_numbers"]
        lhs_ndim, rhs_ndim = _pair(side, aval.ndim, other.ndim)
        lf, rf, batch, out_lf, out_rf = self._layout(lhs_ndim, rhs_ndim)
        if side == "rhs" and self.weight_gradient_hp:
            high = dict(self.params, preferred_element_type=np.dtype(self.out_dtype))
            g = g.astype(self.out_dtype)
            found = _compat.matmul_cotangents(self.primitive, g, other, aval, (), high, only=side)
            return found[1].astype(aval.dtype)
        if side == "lhs":  # contracts the cotangent's and the right operand's free dims
            g_contracted, g_to = tuple(out_rf), {**dict(zip(batch, lb)), **dict(zip(out_lf, lf))}
            other_contracted, other_to = rf, {**dict(zip(rb, lb)), **dict(zip(rc, lc))}
        else:  # contracts the cotangent's and the left operand's free dims
            g_contracted, g_to = tuple(out_lf), {**dict(zip(batch, rb)), **dict(zip(out_rf, rf))}
            other_contracted, other_to = lf, {**dict(zip(lb, rb)), **dict(zip(lc, rc))}
        q_g, s_g = quantize_along(g, self.gradient_format, g_contracted, self.power_of_two)
        q_other, s_other = quantize_along(other, E4M3, other_contracted, self.power_of_two)
        found = _compat.matmul_cotangents(
            self.primitive,
            q_g,
            *_pair(side, aval, q_other),
            (),
            _accumulating(self.params, self.precisions[1]),
            _F32,
            only=side,
        )
        d = _chosen(side, found) * place(s_g, sorted(g_to), g_to, aval.shape)
        return (d * place(s_other, sorted(other_to), other_to, aval.shape)).astype(aval.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class PerGroup:
    """`lax.ragged_dot` with a scale per group (`jaxamp.fp8._matmul.is_per_group_layout`).

    ``lhs[m, k]`` whose rows belong to the groups in order (``group_sizes``),
    ``rhs[g, k, n]``. Each group's rows of `lhs`, its slice of `rhs` and its
    rows of the cotangent get their own scale, so an expert with small values
    keeps its precision. Within a group both operands' scales are constant,
    so each product (forward and both gradients) is rescaled per group afterwards.
    """

    params: dict
    out_dtype: Any
    gradient_format: Any = E5M2
    precisions: tuple = (None, None)  # forward, gradient (`Fp8Recipe.accumulation_precisions`)

    @property
    def primitive(self) -> Any:
        return _compat.primitives_by_name()["ragged_dot_general"]

    @staticmethod
    def _group_ids(group_sizes, rows):
        groups = jnp.arange(group_sizes.shape[0], dtype=group_sizes.dtype)
        return jnp.repeat(groups, group_sizes, total_repeat_length=rows)

    def quantize(self, side, x, rest):
        (group_sizes,) = rest
        if side == "lhs":
            ids = self._group_ids(group_sizes, x.shape[0])
            return quantize_rows_by_group(x, E4M3, ids, group_sizes.shape[0])
        return quantize_along(x, E4M3, range(1, np.ndim(x)))  # a scale per group

    def product(self, lhs, rhs, rest):
        (q_lhs, s_lhs), (q_rhs, s_rhs), (group_sizes,) = lhs, rhs, rest
        ids = self._group_ids(group_sizes, q_lhs.shape[0])
        out = self.primitive.bind(q_lhs, q_rhs, group_sizes, **_accumulating(self.params, self.precisions[0]))
        return (out * (s_lhs * s_rhs)[ids][:, None]).astype(self.out_dtype)

    def tangent(self, side, other, t, rest):
        (q, s), (group_sizes,) = other, rest
        if side == "lhs":
            scale = s[:, None, None]
        else:
            scale = s[self._group_ids(group_sizes, q.shape[0])][:, None]
        return _tangent_product(self, side, t, lax.convert_element_type(q, _F32) * scale, rest)

    def cotangent(self, side, other, aval, g, rest):
        (q, s), (group_sizes,) = other, rest
        ids = self._group_ids(group_sizes, g.shape[0])
        q_g, s_g = quantize_rows_by_group(g, self.gradient_format, ids, group_sizes.shape[0])
        found = _compat.matmul_cotangents(
            self.primitive,
            q_g,
            *_pair(side, aval, q),
            [group_sizes],
            _accumulating(self.params, self.precisions[1]),
            _F32,
            only=side,
        )
        scale = (s_g * s)[ids][:, None] if side == "lhs" else (s_g * s)[:, None, None]
        return (_chosen(side, found) * scale).astype(aval.dtype)


# --- scales per block of the contraction ------------------------------------------


def _free_and_flat(x: Any, contracting: Sequence[int], batch: Sequence[int], contraction_last: bool) -> tuple:
    """`x` as ``[batch..., free, contraction]`` (or ``[batch..., contraction, free]``).

    Its free dims and its contracted dims are each flattened into one.
    """
    free = free_dims(x.ndim, contracting, batch)
    order = (*batch, *free, *contracting) if contraction_last else (*batch, *contracting, *free)
    sizes = [x.shape[d] for d in batch]
    flat_free = int(np.prod([x.shape[d] for d in free], dtype=int))
    flat_contraction = int(np.prod([x.shape[d] for d in contracting], dtype=int))
    tail = (flat_free, flat_contraction) if contraction_last else (flat_contraction, flat_free)
    return lax.reshape(lax.transpose(x, order), (*sizes, *tail)), [x.shape[d] for d in free]


def blocked_dot(
    a: Any,
    b: Any,
    dimension_numbers: Any,
    block: int,
    mode: str,
    b_free_block: int = 1,
    a_format: Any = E4M3,
    precision: Any = None,
) -> Any:
    """``dot_general(a, b)`` in e4m3 with a scale per block of `block` along the contraction.

    Each operand's entries are scaled per block of `block` consecutive
    contraction indices (and, for `b`, `b_free_block` of its free indices:
    2D tiles), by `quantize_blocks` in `mode`; `a` to `a_format` (a gradient
    matmul's cotangent), `b` to e4m3. The float8 product runs per
    contraction block (a batch dimension of the emulated ``dot_general``,
    accumulating in float32), each block's partial product is rescaled by its
    two scales, and the blocks are summed: what a block-scaled float8 GEMM
    computes. Returns float32, laid out as ``dot_general``'s result.
    `precision`: the float8 product's (`Fp8Recipe.accumulation_precisions`).
    """
    (ac, bc), (ab, bb) = dimension_numbers
    nb = len(ab)
    a2, a_free = _free_and_flat(a, ac, ab, contraction_last=True)  # [batch, F, K]
    b2, b_free = _free_and_flat(b, bc, bb, contraction_last=False)  # [batch, K, G]
    batch = a2.shape[:nb]
    f, k, g = a2.shape[nb], a2.shape[nb + 1], b2.shape[nb + 1]
    q_a, s_a = quantize_blocks(a2, nb + 1, block, mode, fmt=a_format)  # s_a: [batch, F, K/block]
    free_axis = nb + 1 if b_free_block > 1 else None
    q_b, s_b = quantize_blocks(b2, nb, block, mode, free_axis, b_free_block)  # s_b: [batch, K/block, G/b_free_block]
    kb = k // block
    q_a = lax.reshape(q_a, (*batch, f, kb, block))
    q_b = lax.reshape(q_b, (*batch, kb, block, g))
    batch_dims = tuple(range(nb))
    out = lax.dot_general(
        q_a,
        q_b,
        (((nb + 2,), (nb + 1,)), ((*batch_dims, nb + 1), (*batch_dims, nb))),
        precision=precision,
        preferred_element_type=_F32,
    )  # [batch, K/block, F, G]
    s_a = lax.transpose(s_a, (*batch_dims, nb + 1, nb))  # [batch, K/block, F]
    out = out * lax.broadcast_in_dim(s_a, out.shape, tuple(range(nb + 2)))
    s_b = lax.broadcast_in_dim(s_b, (*batch, kb, g // b_free_block, b_free_block), tuple(range(nb + 2)))
    s_b = lax.reshape(s_b, (*batch, kb, g))
    out = out * lax.broadcast_in_dim(s_b, out.shape, (*batch_dims, nb, nb + 2))
    out = lax.reduce_sum(out, (nb,))
    return lax.reshape(out, (*batch, *a_free, *b_free))


def _ranges_like(*lists: Sequence[int]) -> list[list[int]]:
    out, start = [], 0
    for items in lists:
        out.append(list(range(start, start + len(items))))
        start += len(items)
    return out


def _gradient_dims(dimension_numbers: Any, side: str, lhs_ndim: int, rhs_ndim: int) -> tuple[Any, list[int]]:
    """The ``dot_general(g, other)`` giving `side`'s cotangent, and the transpose into `side`'s layout.

    JAX's own ``_dot_general_transpose_lhs``/``_rhs`` arithmetic.
    """
    (lc, rc), (lb, rb) = dimension_numbers
    if side == "lhs":
        (xc, yc), (xb, yb), x_ndim, y_ndim = (lc, rc), (lb, rb), lhs_ndim, rhs_ndim
    else:
        (xc, yc), (xb, yb), x_ndim, y_ndim = (rc, lc), (rb, lb), rhs_ndim, lhs_ndim
    x_kept, y_kept = free_dims(x_ndim, xc, xb), free_dims(y_ndim, yc, yb)
    if side == "rhs":
        ans_batch, ans_y, _ = _ranges_like(xb, y_kept, x_kept)
    else:
        ans_batch, _, ans_y = _ranges_like(xb, x_kept, y_kept)
    dims = ((tuple(ans_y), tuple(y_kept)), (tuple(ans_batch), tuple(yb)))
    x_contract_sorted_by_y = list(np.take(xc, np.argsort(yc)))
    return dims, [int(i) for i in np.argsort(list(xb) + x_kept + x_contract_sorted_by_y)]


@dataclasses.dataclass(frozen=True, eq=False)
class BlockScaled:
    """A ``dot_general`` with a scale per block of its contraction: MXFP8 or Transformer Engine's blockwise.

    ``mode="mxfp8"``: blocks of 32 along each product's contraction for every
    operand, e8m0 scales rounded up, all tensors e4m3 (NVIDIA's MXFP8
    pretraining recipe; bit for bit `jax.nn.scaled_dot_general`'s quantiser).
    ``mode="blockwise"``: ``Float8BlockScaling``: 1x128 tiles for activations
    and gradients, 128x128 for the right operand (the weight) where its sizes
    allow, power-of-two scales, e4m3. Residuals: the operands in the compute
    dtype, quantised again along each gradient matmul's own contraction
    (2 bytes per element, as torchao's rowwise recipe saves).
    """

    params: dict
    out_dtype: Any
    mode: str
    gradient_format: Any = E4M3
    precisions: tuple = (None, None)  # forward, gradient (`Fp8Recipe.accumulation_precisions`)

    @property
    def primitive(self) -> Any:
        return _compat.primitives_by_name()["dot_general"]

    @property
    def block(self) -> int:
        return BLOCK_SIZE[self.mode]

    def _weight_block(self, weight: Any, contracting: Sequence[int], batch: Sequence[int]) -> int:
        if self.mode != "blockwise":
            return 1
        free = int(np.prod([weight.shape[d] for d in free_dims(weight.ndim, contracting, batch)], dtype=int))
        contraction = int(np.prod([weight.shape[d] for d in contracting], dtype=int))
        return 128 if free % 128 == 0 and contraction % 128 == 0 else 1

    def quantize(self, side, x, rest):
        return x.astype(self.out_dtype)

    def product(self, lhs, rhs, rest):
        (_, rc), (_, rb) = self.params["dimension_numbers"]
        weight_block = self._weight_block(rhs, rc, rb)
        dims = self.params["dimension_numbers"]
        out = blocked_dot(lhs, rhs, dims, self.block, self.mode, weight_block, precision=self.precisions[0])
        return out.astype(self.out_dtype)

    def tangent(self, side, other, t, rest):
        return _tangent_product(self, side, t, other)

    def cotangent(self, side, other, aval, g, rest):
        lhs_ndim, rhs_ndim = _pair(side, aval.ndim, other.ndim)
        dims, order = _gradient_dims(self.params["dimension_numbers"], side, lhs_ndim, rhs_ndim)
        # The other operand is the gradient matmul's right one: the weight
        # (for the input's gradient) keeps its 2D tiles.
        (_, oc), (_, ob) = dims
        weight_block = self._weight_block(other, oc, ob) if side == "lhs" else 1
        d = blocked_dot(g, other, dims, self.block, self.mode, weight_block, self.gradient_format, self.precisions[1])
        return lax.transpose(d, order).astype(aval.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class AutoPerShard:
    """A tensorwise ``dot_general`` or convolution on an Auto mesh: each device scales its own shards.

    `PerShard`'s scales for a mesh whose types carry no sharding: every
    product (forward, both gradients) is a `per_shard_dot` or
    `per_shard_conv` (`_partitioned`), which XLA's partitioner tells the
    operands' shardings, so no amax crosses devices. Residuals are the
    operands in the compute dtype, quantised again in each gradient product;
    cotangents in `gradient_format`.
    """

    primitive: Any
    params: dict
    out_dtype: Any
    power_of_two: bool = False
    gradient_format: Any = E5M2
    precisions: tuple = (None, None)  # forward, gradient (`Fp8Recipe.accumulation_precisions`)

    @property
    def _conv(self) -> bool:
        return self.primitive.name == "conv_general_dilated"

    def _dot(self, dimension_numbers: Any, formats: tuple, precision: Any, out_dtype: Any) -> LocalScaling:
        precision = _accumulating(self.params, precision).get("precision")
        return LocalScaling(dimension_numbers, precision, formats, self.power_of_two, np.dtype(out_dtype))

    def quantize(self, side, x, rest):
        # Each product quantises its own operands, per shard: keep the operand.
        return x.astype(self.out_dtype)

    def product(self, lhs, rhs, rest):
        formats, precision = (E4M3, E4M3), self.precisions[0]
        if self._conv:
            return per_shard_conv(lhs, rhs, _conv_how(self, formats, precision, self.out_dtype))
        return per_shard_dot(lhs, rhs, self._dot(self.params["dimension_numbers"], formats, precision, self.out_dtype))

    def tangent(self, side, other, t, rest):
        return _tangent_product(self, side, t, other)

    def cotangent(self, side, other, aval, g, rest):
        formats, precision = (self.gradient_format, E4M3), self.precisions[1]
        if self._conv:
            return per_shard_conv(g, other, _conv_how(self, formats, precision, aval.dtype, side, aval.shape))
        lhs_ndim, rhs_ndim = _pair(side, aval.ndim, other.ndim)
        dims, order = _gradient_dims(self.params["dimension_numbers"], side, lhs_ndim, rhs_ndim)
        return lax.transpose(per_shard_dot(g, other, self._dot(dims, formats, precision, aval.dtype)), order)


@dataclasses.dataclass(frozen=True, eq=False)
class PerShardConv:
    """A tensorwise convolution on an Explicit mesh: a scale per device's shard, float8 residuals.

    `PerShard`'s scales for convolutions, whose batch cannot be split into
    ``dot_general`` batch dimensions: each product (forward, both gradients)
    runs in `jax.shard_map` over the mesh as `layouts` say, each device
    quantising its own blocks, so no amax crosses devices; the kernel's
    gradient sums the rescaled per-device products over the batch's axes, the
    all-reduce bf16 mode makes too. Residuals are float8 with a scale per
    device's block, which the gradient products see unchanged.
    """

    primitive: Any
    params: dict
    out_dtype: Any
    layouts: ConvShardLayouts
    power_of_two: bool = False
    gradient_format: Any = E5M2
    precisions: tuple = (None, None)  # forward, gradient (`Fp8Recipe.accumulation_precisions`)

    def quantize(self, side, x, rest):
        return quantize_per_device(x, self.layouts.operand(side), self.layouts.mesh, E4M3, self.power_of_two)

    def product(self, lhs, rhs, rest):
        how = _conv_how(self, (E4M3, E4M3), self.precisions[0], self.out_dtype)
        return conv_per_device(lhs, rhs, how, self.layouts.forward)

    def tangent(self, side, other, t, rest):
        other_side = OTHER_SIDE[side]
        other = dequantize_per_device(other, self.layouts.operand(other_side), self.layouts.mesh)
        return _tangent_product(self, side, t, other)

    def cotangent(self, side, other, aval, g, rest):
        layout = getattr(self.layouts, side)
        g_spec = layout.operands[0]
        if spec_of(jax.typeof(g)) != tuple(g_spec):
            g = jax.sharding.reshard(g, g_spec)
        how = _conv_how(self, (self.gradient_format, E4M3), self.precisions[1], aval.dtype, side, aval.shape)
        return conv_per_device(g, other, how, layout)


# --- scales per shard -----------------------------------------------------------


def sharded_free_dims(eqn: Any, lhs: Any, rhs: Any) -> tuple[dict, dict]:
    """The dims of a ``dot_general``'s operands that `PerShard` scales per shard.

    Each operand's dimensions split over Explicit mesh axes that the matmul
    neither contracts nor batches, and that the other operand is not split
    over along its own free or batch dimensions (it is broadcast along them;
    where the other operand is split over them along its contraction, an
    FSDP weight, `PerShard` gathers its float8 copy first): ``({dim: (shards,
    spec entry)}, {...})``. Empty off an Explicit mesh.
    """
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]

    def blocks(x, contracting, batch, other, other_contracting):
        other_spec = spec_of(jax.typeof(other))
        taken = {name for d, entry in enumerate(other_spec) if d not in other_contracting for name in axis_names(entry)}
        shards = _compat.explicit_shards(x)
        return {
            d: shards[d]
            for d in free_dims(np.ndim(x), contracting, batch)
            if d in shards and not taken.intersection(axis_names(shards[d][1]))
        }

    return blocks(lhs, lc, lb, rhs, rc), blocks(rhs, rc, rb, lhs, lc)


def shard_axes(blocks: tuple[dict, dict]) -> list[str]:
    """The mesh axes `sharded_free_dims` found, for diagnostics."""
    return sorted({str(name) for side in blocks for _, entry in side.values() for name in axis_names(entry)})


def _split_layout(aval: Any, blocks: dict, spec: Sequence[Any] | None = None) -> tuple[tuple, list, dict, dict]:
    """`aval`'s layout with its `blocks` dims split into ``(shards, size // shards)``.

    Returns ``(shape, spec, at, block_at)``: the split shape and spec (the
    shard dim carries the mesh axes, the remainder none; the other dims
    `spec`, by default `aval`'s), and, per original dim, where it (its
    remainder) and its shard dim land.
    """
    spec = spec_of(aval) if spec is None else spec
    new_shape: list[int] = []
    new_spec: list[Any] = []
    at: dict[int, int] = {}
    block_at: dict[int, int] = {}
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


def _without(entry: Any, axes: set) -> Any:
    """A spec entry with `axes` removed (None if none is left)."""
    kept = tuple(name for name in axis_names(entry) if name not in axes)
    if not kept:
        return None
    return kept[0] if len(kept) == 1 and not isinstance(entry, tuple) else kept


def _product_layout(lhs: tuple, rhs: tuple, dimension_numbers: Any) -> tuple[tuple, list]:
    """The shape and spec of a ``dot_general``'s result from its operands' ``(shape, spec)``."""
    (lhs_shape, lhs_spec), (rhs_shape, rhs_spec) = lhs, rhs
    (lc, rc), (lb, rb) = dimension_numbers
    l_free, r_free = free_dims(len(lhs_shape), lc, lb), free_dims(len(rhs_shape), rc, rb)
    shape = [lhs_shape[d] for d in lb] + [lhs_shape[d] for d in l_free] + [rhs_shape[d] for d in r_free]
    spec = [lhs_spec[d] for d in lb] + [lhs_spec[d] for d in l_free] + [rhs_spec[d] for d in r_free]
    return tuple(shape), spec


class PerShard:
    """A tensorwise ``dot_general`` with a scale per shard (built by `sharded_free_dims`).

    On an Explicit mesh, an operand dimension that is split over mesh axes and
    not contracted (an activation's batch or sequence dimension, a
    column-parallel weight's output features) gets one scale per shard, so no
    amax crosses devices. Each such dimension is split into ``(shards,
    rest)`` and the shard dims become batch dimensions of the float8
    ``dot_general``, the other operand broadcast along them (each device holds
    its shard's view), so every product, forward and backward, meets one scale
    per operand and block. A gradient that sums over blocks (data
    parallelism's weight gradient, tensor parallelism's input gradient) sums
    the rescaled per-block products: the all-reduce the bfloat16 step makes
    too. A dimension split along a contraction (an FSDP or row-parallel
    weight) keeps one scale across its shards, which must agree.
    """

    @property
    def primitive(self) -> Any:
        return _compat.primitives_by_name()["dot_general"]

    def __init__(
        self,
        params,
        lhs_aval,
        rhs_aval,
        lhs_blocks,
        rhs_blocks,
        out_dtype,
        power_of_two=False,
        gradient_format=E5M2,
        precisions=(None, None),
    ):
        self.params, self.out_dtype, self.power_of_two = params, out_dtype, power_of_two
        self.gradient_format, self.precisions = gradient_format, precisions
        self.avals = {"lhs": lhs_aval, "rhs": rhs_aval}
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        self.order = {"lhs": sorted(lhs_blocks), "rhs": sorted(rhs_blocks)}
        kl, kr, nb = len(self.order["lhs"]), len(self.order["rhs"]), len(lb)
        self.counts = {"lhs": kl, "rhs": kr}
        blocks = {"lhs": lhs_blocks, "rhs": rhs_blocks}
        # An operand split along its contraction over the axes of the other's
        # shards (an FSDP weight) is gathered, as float8, off those axes.
        contracting = {"lhs": lc, "rhs": rc}
        self.gathered_spec = {}
        for side, aval in self.avals.items():
            other_axes = {n for _, entry in blocks[OTHER_SIDE[side]].values() for n in axis_names(entry)}
            self.gathered_spec[side] = [
                _without(entry, other_axes) if d in contracting[side] else entry
                for d, entry in enumerate(spec_of(aval))
            ]
        self.own_split = {side: _split_layout(self.avals[side], blocks[side]) for side in blocks}
        self.split = {side: _split_layout(self.avals[side], blocks[side], self.gathered_spec[side]) for side in blocks}
        (_, _, l_at, l_block), (_, _, r_at, r_block) = self.split["lhs"], self.split["rhs"]
        # Each operand split, the other's shard dims in front of it.
        self.front = {
            "lhs": [rhs_blocks[d] for d in self.order["rhs"]],
            "rhs": [lhs_blocks[d] for d in self.order["lhs"]],
        }
        l_free, r_free = free_dims(lhs_aval.ndim, lc, lb), free_dims(rhs_aval.ndim, rc, rb)
        self.blocked_params = dict(
            params,
            out_sharding=_blocked_out_sharding(params.get("out_sharding"), lb, l_free, r_free, *self.order.values()),
            dimension_numbers=(
                (tuple(kr + l_at[d] for d in lc), tuple(kl + r_at[d] for d in rc)),
                (
                    tuple(kr + l_at[d] for d in lb)
                    + tuple(kr + l_block[d] for d in self.order["lhs"])
                    + tuple(range(kr)),
                    tuple(kl + r_at[d] for d in rb)
                    + tuple(range(kl))
                    + tuple(kl + r_block[d] for d in self.order["rhs"]),
                ),
            ),  # fmt: skip
            preferred_element_type=_F32,
        )
        # The blocked product is [batch, lhs shards, rhs shards, lhs free, rhs
        # free]; `order` puts each shard dim before its remainder, so that a
        # reshape merges them into the result's dims.
        order, position = list(range(nb)), nb + kl + kr
        for free, blocked, base in ((l_free, self.order["lhs"], nb), (r_free, self.order["rhs"], nb + kl)):
            for d in free:
                if d in blocked:
                    order.append(base + blocked.index(d))
                order.append(position)
                position += 1
        self.result_order = order
        self.out_shape, self.out_spec = _product_layout(
            (lhs_aval.shape, spec_of(lhs_aval)), (rhs_aval.shape, spec_of(rhs_aval)), params["dimension_numbers"]
        )
        blocked_shape, blocked_spec = _product_layout(
            self._blocked_layout("lhs"), self._blocked_layout("rhs"), self.blocked_params["dimension_numbers"]
        )
        self.g_shape = tuple(blocked_shape[i] for i in order)
        self.g_spec = P(*(blocked_spec[i] for i in order))
        # Where each operand's and the cotangent's block scales land.
        self.block_dims = {"lhs": [nb + i for i in range(kl)], "rhs": [nb + kl + j for j in range(kr)]}
        self.own_block_at = {
            "lhs": {i: kr + l_block[d] for i, d in enumerate(self.order["lhs"])},
            "rhs": {j: kl + r_block[d] for j, d in enumerate(self.order["rhs"])},
        }

    def _blocked_layout(self, side):
        shape, spec, _, _ = self.split[side]
        front = self.front[side]
        return (*(n for n, _ in front), *shape), [*(entry for _, entry in front), *spec]

    def _with_front(self, side, x):
        shape, spec = self._blocked_layout(side)
        k = len(self.front[side])
        return lax.broadcast_in_dim(x, shape, tuple(range(k, len(shape))), out_sharding=P(*spec))

    def _merge(self, side, x):
        aval = self.avals[side]
        x = lax.reshape(x, aval.shape, out_sharding=P(*self.gathered_spec[side]))
        if self.gathered_spec[side] != list(spec_of(aval)):
            x = jax.sharding.reshard(x, P(*spec_of(aval)))
        return x

    def quantize(self, side, x, rest):
        shape, spec, _, block_at = self.own_split[side]
        x = lax.reshape(lax.convert_element_type(x, _F32), shape, out_sharding=P(*spec))
        kept = sorted(block_at.values())
        q, scale = quantize_along(x, E4M3, [d for d in range(x.ndim) if d not in kept], self.power_of_two)
        gathered = self.split[side][1]
        if gathered != spec:  # the float8 all-gather of an FSDP weight
            q = jax.sharding.reshard(q, P(*gathered))
        return q, scale

    def product(self, lhs, rhs, rest):
        (q_lhs, s_lhs), (q_rhs, s_rhs) = lhs, rhs
        out = self.primitive.bind(
            self._with_front("lhs", q_lhs),
            self._with_front("rhs", q_rhs),
            **_accumulating(self.blocked_params, self.precisions[0]),
        )
        for side, s in (("lhs", s_lhs), ("rhs", s_rhs)):
            dims = self.block_dims[side]
            out = out * place(s, range(len(dims)), dict(enumerate(dims)), out.shape)
        out = lax.reshape(lax.transpose(out, self.result_order), self.out_shape, out_sharding=P(*self.out_spec))
        return out.astype(self.out_dtype)

    def _dequantized(self, side, residual):
        q, s = residual
        _, _, _, block_at = self.split[side]
        blocks = [block_at[d] for d in self.order[side]]
        x = lax.convert_element_type(q, _F32) * place(s, range(len(blocks)), dict(enumerate(blocks)), q.shape)
        return self._merge(side, x)

    def tangent(self, side, other, t, rest):
        return _tangent_product(self, side, t, self._dequantized(OTHER_SIDE[side], other))

    def cotangent(self, side, other, aval, g, rest):
        q_other, s_other = other
        other_side = OTHER_SIDE[side]
        # The cotangent in the blocked product's layout, a scale per block.
        g = lax.reshape(lax.convert_element_type(g, _F32), self.g_shape, out_sharding=self.g_spec)
        g = lax.transpose(g, tuple(int(i) for i in np.argsort(self.result_order)))
        kl, kr = self.counts["lhs"], self.counts["rhs"]
        blocks = (*self.block_dims["lhs"], *self.block_dims["rhs"])
        contracted = [d for d in range(g.ndim) if d not in blocks]
        q_g, s_g = quantize_along(g, self.gradient_format, contracted, self.power_of_two)
        shape, spec = self._blocked_layout(side)
        # An operand not placed on the mesh (an uncommitted weight beside a
        # sharded batch) has an empty mesh in its type: the context's is the one.
        mesh = aval.sharding.mesh if not aval.sharding.mesh.empty else jax.sharding.get_abstract_mesh()
        blocked = aval.update(shape=shape, dtype=_F32, sharding=NamedSharding(mesh, P(*spec)))
        found = _compat.matmul_cotangents(
            self.primitive,
            q_g,
            *_pair(side, blocked, self._with_front(other_side, q_other)),
            (),
            _accumulating(self.blocked_params, self.precisions[1]),
            _F32,
            only=side,
        )
        d = _chosen(side, found)
        # `d` is [the other operand's shards, this one's split layout]; `s_g`
        # is over [lhs shards, rhs shards]. Rescale per block, sum over the
        # other operand's shards, merge.
        k_front = len(self.front[side])
        offset = 0 if side == "lhs" else kl
        other_offset = kl if side == "lhs" else 0
        g_position = {
            **{offset + i: dim for i, dim in self.own_block_at[side].items()},
            **{other_offset + j: j for j in range(k_front)},
        }
        d = d * place(s_g, range(kl + kr), g_position, d.shape)
        d = d * place(s_other, range(k_front), {j: j for j in range(k_front)}, d.shape)
        d = lax.reduce_sum(d, tuple(range(k_front))) if k_front else d
        return self._merge(side, d).astype(aval.dtype)


def _blocked_out_sharding(out_sharding, lb, l_free, r_free, lhs_order, rhs_order):
    """The user's ``out_sharding`` of a ``dot_general``, for its blocked product (or None)."""
    if out_sharding is None:
        return None
    spec = tuple(out_sharding.spec)
    spec += (None,) * (len(lb) + len(l_free) + len(r_free) - len(spec))
    batch, l_spec, r_spec = spec[: len(lb)], spec[len(lb) : len(lb) + len(l_free)], spec[len(lb) + len(l_free) :]
    l_entries, r_entries = dict(zip(l_free, l_spec)), dict(zip(r_free, r_spec))
    blocks = [l_entries[d] for d in lhs_order] + [r_entries[d] for d in rhs_order]
    l_rest = [None if d in lhs_order else l_entries[d] for d in l_free]
    r_rest = [None if d in rhs_order else r_entries[d] for d in r_free]
    return NamedSharding(out_sharding.mesh, P(*batch, *blocks, *l_rest, *r_rest))
