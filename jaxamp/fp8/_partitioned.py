"""A float8 ``dot_general`` scaled per shard where XLA partitions it: tensorwise scaling on Auto meshes.

On an Explicit mesh an array's type says how it is split, and `PerShard`
gives each shard its own scale while tracing. On an Auto mesh (``jax.jit``
with `NamedSharding` inputs, `with_sharding_constraint`) types carry no
sharding: XLA's partitioner decides it after tracing, so a scale taken while
tracing is one amax of the whole tensor, an all-reduce in front of every
matmul of batch-split activations and cotangents.

`per_shard_dot` is a `custom_partitioning` op that is told the shardings when
XLA partitions the program: each device quantises its own shard of each
operand with a scale from that shard's amax (no collective), multiplies in
float8, rescales its partial product and, where the contraction is split over
mesh axes (data parallelism's weight gradient, a row-parallel weight), sums
the partial products over them: the all-reduce a bfloat16 step makes too.
Unpartitioned (one device, or replicated operands) it is tensorwise scaling.

Each product quantises its own operands, so residuals are saved in the
compute dtype (2 bytes per element; the rowwise and block recipes save theirs
the same way): a float8 residual's scales would belong to the shards of the
forward product, which XLA may split differently from the gradient's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .. import _compat
from ._quantize import place, quantize_along

__all__ = ["LocalScaling", "axis_names", "free_dims", "per_shard_dot"]

_F32 = np.dtype(np.float32)


class LocalScaling(NamedTuple):
    """What `per_shard_dot` computes (hashable: it is a static argument).

    Attributes:
        dimension_numbers: the ``dot_general``'s.
        precision: its precision (`Fp8Recipe.accumulation_precisions`), or None.
        formats: the float8 formats of the left and right operands.
        power_of_two: round scales up to powers of two.
        out_dtype: the product's dtype.
        own_scales: dimensions of the left and right operands with a scale
            per index (those `jax.vmap` added: each example scaled apart, as
            the unbatched function scales its one example); never contracted.
    """

    dimension_numbers: Any
    precision: Any
    formats: tuple[Any, Any]
    power_of_two: bool
    out_dtype: Any
    own_scales: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())

    # The matmul the op stands for, read by jaxpr walkers (`jaxamp._jaxpr.matmul_name`).
    jaxamp_matmul = "dot_general"


def _scaled_product(lhs: Any, rhs: Any, how: LocalScaling, summed_over: tuple = ()) -> Any:
    """One device's product: its shards quantised with their own scales, summed over `summed_over`."""
    (lc, rc), (lb, rb) = how.dimension_numbers
    lf, rf = free_dims(lhs.ndim, lc, lb), free_dims(rhs.ndim, rc, rb)
    scaled = []
    for x, fmt, own in zip((lhs, rhs), how.formats, how.own_scales):
        scaled.append(quantize_along(x, fmt, [d for d in range(x.ndim) if d not in own], how.power_of_two))
    (q_lhs, s_lhs), (q_rhs, s_rhs) = scaled
    out = lax.dot_general(q_lhs, q_rhs, how.dimension_numbers, how.precision, preferred_element_type=_F32)
    to_out = (
        {d: lb.index(d) if d in lb else len(lb) + lf.index(d) for d in how.own_scales[0]},
        {d: rb.index(d) if d in rb else len(lb) + len(lf) + rf.index(d) for d in how.own_scales[1]},
    )
    for scale, own, position in zip((s_lhs, s_rhs), how.own_scales, to_out):
        out = out * place(scale, sorted(own), position, out.shape)
    if summed_over:
        out = lax.psum(out, summed_over)
    return out.astype(how.out_dtype)


@functools.partial(custom_partitioning, static_argnums=(2,))
def per_shard_dot(lhs: Any, rhs: Any, how: LocalScaling) -> Any:
    """``dot_general`` of `lhs` and `rhs` in float8, each device's shards scaled apart (see the module doc)."""
    return _scaled_product(lhs, rhs, how)


def free_dims(ndim: int, contracting: Sequence[int], batch: Sequence[int]) -> list[int]:
    """A ``dot_general`` operand's dimensions it neither contracts nor batches, in order."""
    return [d for d in range(ndim) if d not in (*contracting, *batch)]


def axis_names(entry: Any) -> tuple:
    """The mesh axes a `PartitionSpec` entry splits its dimension over."""
    if entry is None:
        return ()
    return entry if isinstance(entry, tuple) else (entry,)


def _dims(how: LocalScaling, lhs_ndim: int, rhs_ndim: int) -> tuple:
    (lc, rc), (lb, rb) = how.dimension_numbers
    return lc, rc, lb, rb, free_dims(lhs_ndim, lc, lb), free_dims(rhs_ndim, rc, rb)


def _sharding_rule(how: LocalScaling, mesh: Any, operand_types: Sequence[Any], result_types: Any) -> tuple:
    """Shardy's rule, einsum-like: batch and contraction factors shared, the contraction a reduction."""
    lhs, rhs = operand_types
    lc, rc, lb, rb, lf, rf = _dims(how, len(lhs.shape), len(rhs.shape))
    lhs_factors, rhs_factors = [""] * len(lhs.shape), [""] * len(rhs.shape)
    for i, (l, r) in enumerate(zip(lb, rb)):
        lhs_factors[l] = rhs_factors[r] = f"b{i}"
    for i, (l, r) in enumerate(zip(lc, rc)):
        lhs_factors[l] = rhs_factors[r] = f"k{i}"
    for i, d in enumerate(lf):
        lhs_factors[d] = f"l{i}"
    for i, d in enumerate(rf):
        rhs_factors[d] = f"r{i}"
    out = [f"b{i}" for i in range(len(lb))] + [f"l{i}" for i in range(len(lf))] + [f"r{i}" for i in range(len(rf))]
    rule = f"{' '.join(lhs_factors)}, {' '.join(rhs_factors)} -> {' '.join(out)}"
    return rule, {"reduction_factors": tuple(f"k{i}" for i in range(len(lc)))}


def _layout(how: LocalScaling, lhs: Any, rhs: Any) -> tuple[list, list, list, tuple]:
    """``(lhs spec, rhs spec, result spec, contraction axes)`` for the operands' shardings as XLA proposes them.

    The right operand follows the left along the contraction and batch
    dimensions, and gives up a free dimension's split over an axis the left
    one already uses (each mesh axis splits one dimension of the result).
    """
    lc, rc, lb, rb, lf, rf = _dims(how, len(lhs.shape), len(rhs.shape))
    lhs_spec = [*lhs.sharding.spec, *(None,) * (len(lhs.shape) - len(lhs.sharding.spec))]
    rhs_spec = [*rhs.sharding.spec, *(None,) * (len(rhs.shape) - len(rhs.sharding.spec))]
    for l, r in (*zip(lc, rc), *zip(lb, rb)):
        rhs_spec[r] = lhs_spec[l]
    taken = {name for entry in lhs_spec for name in axis_names(entry)}
    for r in rf:
        if taken.intersection(axis_names(rhs_spec[r])):
            rhs_spec[r] = None
    out_spec = [lhs_spec[d] for d in lb] + [lhs_spec[d] for d in lf] + [rhs_spec[d] for d in rf]
    summed_over = tuple(name for d in lc for name in axis_names(lhs_spec[d]))
    return lhs_spec, rhs_spec, out_spec, summed_over


def _partition(how: LocalScaling, mesh: Any, operand_shapes: Sequence[Any], result_shape: Any) -> tuple:
    lhs_spec, rhs_spec, out_spec, summed_over = _layout(how, *operand_shapes)

    def per_device(lhs: Any, rhs: Any) -> Any:
        return _scaled_product(lhs, rhs, how, summed_over)

    operands = (NamedSharding(mesh, P(*lhs_spec)), NamedSharding(mesh, P(*rhs_spec)))
    return mesh, per_device, NamedSharding(mesh, P(*out_spec)), operands


def _result_sharding(how: LocalScaling, mesh: Any, operand_shapes: Sequence[Any], result_shape: Any) -> Any:
    return NamedSharding(mesh, P(*_layout(how, *operand_shapes)[2]))


per_shard_dot.def_partition(
    partition=_partition, infer_sharding_from_operands=_result_sharding, sharding_rule=_sharding_rule
)


def _batched(args: Sequence[Any], dims: Sequence[Any], how: LocalScaling) -> tuple[list, list]:
    """`jax.vmap` of `per_shard_dot`: the mapped dimensions join the product, each index with its own scales."""
    (lhs, rhs), (lhs_dim, rhs_dim) = args, dims
    if lhs_dim is None and rhs_dim is None:
        return [per_shard_dot(lhs, rhs, how)], [None]
    ndims, mapped = (lhs.ndim, rhs.ndim), (lhs_dim, rhs_dim)
    dimension_numbers, out_dim = _compat.dot_general_batch_dims(ndims, mapped, how.dimension_numbers)

    def with_mapped(own: tuple, mapped: Any) -> tuple:
        if mapped is None:
            return own
        return (mapped, *(d + (d >= mapped) for d in own))

    own = (with_mapped(how.own_scales[0], lhs_dim), with_mapped(how.own_scales[1], rhs_dim))
    return [per_shard_dot(lhs, rhs, how._replace(dimension_numbers=dimension_numbers, own_scales=own))], [out_dim]


_compat.register_custom_partitioning_batching(
    owns=lambda static_args: len(static_args) == 1 and isinstance(static_args[0], LocalScaling),
    rule=lambda args, dims, static_args: _batched(args, dims, static_args[0]),
)
