"""Float8 products each device scales per shard: tensorwise scaling on Auto meshes, and convolutions on Explicit ones.

On an Explicit mesh an array's type says how it is split, and `PerShard`
gives each shard its own scale while tracing. On an Auto mesh (``jax.jit``
with `NamedSharding` inputs, `with_sharding_constraint`) types carry no
sharding: XLA's partitioner decides it after tracing, so a scale taken while
tracing is one amax of the whole tensor, an all-reduce in front of every
matmul of batch-split activations and cotangents.

`per_shard_dot` is a `custom_partitioning` op (inside a jaxamp primitive of
its own, `_partitioned_op`) that is told the shardings when XLA partitions
the program: each device quantises its own shard of each
operand with a scale from that shard's amax (no collective), multiplies in
float8, rescales its partial product and, where the contraction is split over
mesh axes (data parallelism's weight gradient, a row-parallel weight), sums
the partial products over them: the all-reduce a bfloat16 step makes too.
An operand XLA split along a dimension the product needs whole (an FSDP
weight, split over the axis the batch takes) is gathered by each device in
float8, after its shards agree on one scale (`OnDevice.gathered`), rather
than by XLA in high precision.
Unpartitioned (one device, or replicated operands) it is tensorwise scaling.
`per_shard_conv` does the same for a ``conv_general_dilated`` without batch
groups and its cotangents (JAX's transpose rules, run on each device's
shards), its spatial dimensions (and a grouped convolution's features) whole.
Both are built by `_partitioned_op` from a description of the op's dimensions
as Shardy factors (`_Factors`).

Each product quantises its own operands, so residuals are saved in the
compute dtype (2 bytes per element; the rowwise and block recipes save theirs
the same way): a float8 residual's scales would belong to the shards of the
forward product, which XLA may split differently from the gradient's.

On an Explicit mesh `PerShard` splits a ``dot_general``'s scales while
tracing; a convolution's batch cannot become a batch dimension of the
product, so its products run in `jax.shard_map` (`conv_per_device`), each
device's blocks as the types split them, with float8 residuals scaled per
device (`quantize_per_device`): the types fix the blocks for the gradients too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .. import _compat
from ..transform._interpreter import warn_once
from ._quantize import place, quantize, quantize_along

__all__ = [
    "ConvShardLayouts",
    "LocalConv",
    "LocalScaling",
    "OnDevice",
    "ShardLayout",
    "axis_names",
    "conv_per_device",
    "dequantize_per_device",
    "explicit_conv_layouts",
    "free_dims",
    "per_shard_conv",
    "per_shard_dot",
    "quantize_per_device",
    "spec_of",
]

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

    @property
    def jaxamp_matmul(self) -> str:
        """The matmul the op stands for, read by jaxpr walkers (`jaxamp._jaxpr.matmul_name`)."""
        return "dot_general"


class OnDevice(NamedTuple):
    """Where one device's product runs (the defaults: unpartitioned, the whole operands).

    Attributes:
        mesh: the mesh.
        result_spec: how the result is split.
        summed_over: the mesh axes that split the contraction, which the
            partial products are summed over.
        gathered: per operand, ``{dim: mesh axes}`` that XLA split and the
            product needs whole: the device quantises its block with a scale
            those devices agree on and all-gathers it in float8 (an FSDP
            weight), where XLA would gather it in high precision.
    """

    mesh: Any = None
    result_spec: P | None = None
    summed_over: tuple = ()
    gathered: tuple[dict, ...] = ({}, {})


def _quantized_block(x: Any, fmt: Any, power_of_two: bool, own: Sequence[int], gathered: dict) -> tuple[Any, Any]:
    """One device's block of an operand in `fmt` with its scales (per index of `own`), `gathered` as `OnDevice` says."""
    agreed = spec_axes(tuple(gathered.values()))
    q, scale = quantize_along(x, fmt, [d for d in range(x.ndim) if d not in own], power_of_two, agreed)
    for dim, axes in gathered.items():
        q = lax.all_gather(q, axes, axis=dim, tiled=True)
    return q, scale


def _local_dot(lhs: Any, rhs: Any, how: LocalScaling, where: OnDevice) -> Any:
    """One device's product: its shards quantised with their own scales, summed over `where.summed_over`."""
    (lc, rc), (lb, rb) = how.dimension_numbers
    lf, rf = free_dims(lhs.ndim, lc, lb), free_dims(rhs.ndim, rc, rb)
    (q_lhs, s_lhs), (q_rhs, s_rhs) = (
        _quantized_block(x, fmt, how.power_of_two, own, gathered)
        for x, fmt, own, gathered in zip((lhs, rhs), how.formats, how.own_scales, where.gathered)
    )
    out = lax.dot_general(q_lhs, q_rhs, how.dimension_numbers, how.precision, preferred_element_type=_F32)
    to_out = (
        {d: lb.index(d) if d in lb else len(lb) + lf.index(d) for d in how.own_scales[0]},
        {d: rb.index(d) if d in rb else len(lb) + len(lf) + rf.index(d) for d in how.own_scales[1]},
    )
    for scale, own, position in zip((s_lhs, s_rhs), how.own_scales, to_out):
        out = out * place(scale, sorted(own), position, out.shape)
    return _summed(out, where.summed_over, how.out_dtype)


def _summed(out: Any, summed_over: tuple, dtype: Any) -> Any:
    """One device's rescaled partial result, summed over the mesh axes that split the contraction, in `dtype`."""
    if summed_over:
        out = lax.psum(out, summed_over)
    return out.astype(dtype)


def free_dims(ndim: int, contracting: Sequence[int], batch: Sequence[int]) -> list[int]:
    """A ``dot_general`` operand's dimensions it neither contracts nor batches, in order."""
    return [d for d in range(ndim) if d not in (*contracting, *batch)]


def spec_of(aval: Any) -> tuple:
    """`aval`'s `PartitionSpec` entries, one per dimension (None where the spec stops short)."""
    spec = tuple(aval.sharding.spec)
    return spec + (None,) * (len(aval.shape) - len(spec))


def axis_names(entry: Any) -> tuple:
    """The mesh axes a `PartitionSpec` entry splits its dimension over."""
    if entry is None:
        return ()
    return entry if isinstance(entry, tuple) else (entry,)


def spec_axes(*specs: Iterable[Any]) -> tuple:
    """The mesh axes `specs` split dimensions over, each once, in order."""
    return tuple(dict.fromkeys(name for spec in specs for entry in spec for name in axis_names(entry)))


def _dims(how: LocalScaling, lhs_ndim: int, rhs_ndim: int) -> tuple:
    (lc, rc), (lb, rb) = how.dimension_numbers
    return lc, rc, lb, rb, free_dims(lhs_ndim, lc, lb), free_dims(rhs_ndim, rc, rb)


class _Factors(NamedTuple):
    """An op's dimensions as Shardy factors: those of each operand, of the result, which it sums, which stay whole."""

    operands: tuple[tuple[str, ...], ...]
    result: tuple[str, ...]
    reduced: tuple[str, ...] = ()
    replicated: tuple[str, ...] = ()


def _dot_factors(how: LocalScaling, lhs_ndim: int, rhs_ndim: int) -> _Factors:
    lc, rc, lb, rb, lf, rf = _dims(how, lhs_ndim, rhs_ndim)
    lhs, rhs = [""] * lhs_ndim, [""] * rhs_ndim
    for i, (l, r) in enumerate(zip(lb, rb)):
        lhs[l] = rhs[r] = f"b{i}"
    for i, (l, r) in enumerate(zip(lc, rc)):
        lhs[l] = rhs[r] = f"k{i}"
    for i, d in enumerate(lf):
        lhs[d] = f"l{i}"
    for i, d in enumerate(rf):
        rhs[d] = f"r{i}"
    out = [f"b{i}" for i in range(len(lb))] + [f"l{i}" for i in range(len(lf))] + [f"r{i}" for i in range(len(rf))]
    return _Factors((tuple(lhs), tuple(rhs)), tuple(out), tuple(f"k{i}" for i in range(len(lc))))


def _entry(axes: Sequence[Any]) -> Any:
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def _layout(factors: _Factors, operand_shapes: Sequence[Any]) -> tuple[list, list, tuple]:
    """``(operands' specs, result spec, axes summed over)`` for the operands' shardings as XLA proposes them.

    Each factor is split as the first operand that has it is split (so the
    right operand follows the left along a contraction), over axes no other
    factor took (each mesh axis splits one dimension of the result); the
    `replicated` factors stay whole.
    """
    axes_of: dict[str, tuple] = {}
    taken: set = set()
    for shape, names in zip(operand_shapes, factors.operands):
        for factor, entry in zip(names, spec_of(shape)):
            if factor in axes_of:
                continue
            axes = () if factor in factors.replicated or taken.intersection(axis_names(entry)) else axis_names(entry)
            axes_of[factor] = axes
            taken.update(axes)

    def spec(names: Sequence[str]) -> list:
        return [_entry(axes_of.get(f, ())) for f in names]

    summed_over = tuple(name for factor in factors.reduced for name in axes_of.get(factor, ()))
    return [spec(names) for names in factors.operands], spec(factors.result), summed_over


def _replicated_off_mesh(operand_shapes: Sequence[Any]) -> bool:
    """Whether XLA proposes shardings no mesh names (a program whose inputs carry none), all replicated.

    Raises:
        ValueError: such shardings that split an operand, which jaxamp cannot
            map to mesh axes.
    """
    shardings = [s.sharding for s in operand_shapes]
    if all(isinstance(sharding, NamedSharding) for sharding in shardings):
        return False
    if not all(sharding.is_fully_replicated for sharding in shardings):
        raise ValueError(
            f"jaxamp fp8 mode: XLA split a float8 product's operands as {shardings}, which names no mesh, so "
            "their per-device scales cannot be chosen. Place the step's inputs with a NamedSharding on the mesh "
            "(jax.device_put(x, NamedSharding(mesh, spec))) or pass them as arguments rather than constants."
        )
    return True


def _gathered(specs: Sequence[Sequence[Any]], operand_shapes: Sequence[Any]) -> tuple[list, tuple[dict, ...]]:
    """The operands' specs with the dims the device gathers itself kept split, and those dims (`OnDevice.gathered`).

    A dim `_layout` leaves whole that XLA split (an FSDP weight's, split over
    the axis the batch takes) stays split: each device gathers it in float8.
    """
    kept, gathered = [], []
    for spec, shape in zip(specs, operand_shapes):
        split = spec_of(shape)
        found = {dim: axis_names(have) for dim, (entry, have) in enumerate(zip(spec, split)) if entry is None and have}
        kept.append([split[dim] if dim in found else entry for dim, entry in enumerate(spec)])
        gathered.append(found)
    return kept, tuple(gathered)


def _partitioned_op(name: str, factors_of: Callable, local: Callable, batch: Callable) -> Callable:
    """``op(lhs, rhs, how)`` computing ``local(lhs, rhs, how, OnDevice(...))`` on each device, as XLA splits it.

    `factors_of(how, lhs_ndim, rhs_ndim)` gives its `_Factors`; `local`
    computes one device's result from its shards (the whole operands when
    unpartitioned, ``OnDevice()``); ``batch(args, dims, how)`` is its
    `jax.vmap` rule. A `custom_partitioning` op inside a jaxamp primitive
    named `name` (`_compat.OwnPrimitive`): JAX has no batching rule for
    `custom_partitioning`, and `jax.export` cannot serialize one (the
    primitive lowers the unpartitioned function there instead), and jaxamp
    changes neither for other libraries' `custom_partitioning` ops.
    """

    def whole(lhs: Any, rhs: Any, how: Any) -> Any:
        return local(lhs, rhs, how, OnDevice())

    op = functools.partial(custom_partitioning, static_argnums=(2,))(whole)

    def sharding_rule(how: Any, mesh: Any, operand_types: Sequence[Any], result_types: Any) -> tuple:
        factors = factors_of(how, *(len(t.shape) for t in operand_types))
        rule = ", ".join(" ".join(names) for names in factors.operands) + " -> " + " ".join(factors.result)
        # Shardy wants special factors in the order the rule first names them.
        order = list(dict.fromkeys(name for names in (*factors.operands, factors.result) for name in names))
        reduced, replicated = (tuple(sorted(group, key=order.index)) for group in (factors.reduced, factors.replicated))
        return rule, {"reduction_factors": reduced, "need_replication_factors": replicated}

    def partition(how: Any, mesh: Any, operand_shapes: Sequence[Any], result_shape: Any) -> tuple:
        if _replicated_off_mesh(operand_shapes):  # no mesh to name the devices: one whole copy each
            return (
                mesh,
                lambda lhs, rhs: local(lhs, rhs, how, OnDevice()),
                result_shape.sharding,
                tuple(s.sharding for s in operand_shapes),
            )
        factors = factors_of(how, *(len(s.shape) for s in operand_shapes))
        specs, out_spec, summed_over = _layout(factors, operand_shapes)
        specs, gathered = _gathered(specs, operand_shapes)
        where = OnDevice(mesh, P(*out_spec), summed_over, gathered)

        def per_device(lhs: Any, rhs: Any) -> Any:
            return local(lhs, rhs, how, where)

        operands = tuple(NamedSharding(mesh, P(*spec)) for spec in specs)
        return mesh, per_device, NamedSharding(mesh, P(*out_spec)), operands

    def result_sharding(how: Any, mesh: Any, operand_shapes: Sequence[Any], result_shape: Any) -> Any:
        if _replicated_off_mesh(operand_shapes):
            return operand_shapes[0].sharding
        factors = factors_of(how, *(len(s.shape) for s in operand_shapes))
        return NamedSharding(mesh, P(*_layout(factors, operand_shapes)[1]))

    op.def_partition(partition=partition, infer_sharding_from_operands=result_sharding, sharding_rule=sharding_rule)

    def exported(lhs: Any, rhs: Any, how: Any) -> Any:
        _one_scale_per_tensor_when_exported()
        return whole(lhs, rhs, how)

    # (custom_partitioning takes its static argument by position only.)
    primitive = _compat.OwnPrimitive(name, lambda lhs, rhs, how: op(lhs, rhs, how), batch=batch, export=exported)

    def per_shard(lhs: Any, rhs: Any, how: Any) -> Any:
        return primitive(lhs, rhs, how=how)

    return per_shard


def _one_scale_per_tensor_when_exported() -> None:
    warn_once(
        ("fp8_exported_on_an_auto_mesh", ""),
        "jaxamp fp8 mode: an exported program (jax.export) cannot carry the per-device scales of an Auto "
        "mesh's float8 products (their partitioning runs in this process), so it takes one scale per tensor "
        "(an amax all-reduce in front of each product on a mesh). Use an Explicit mesh, whose per-shard scales "
        "are traced, to export them.",
        UserWarning,
    )


per_shard_dot = _partitioned_op(
    "jaxamp_per_shard_dot", _dot_factors, _local_dot, lambda args, dims, how: _batched(args, dims, how)
)
"""``per_shard_dot(lhs, rhs, how)``: ``dot_general`` in float8, each device's shards scaled apart."""


class LocalConv(NamedTuple):
    """What `per_shard_conv` computes (hashable: it is a static argument).

    Attributes:
        params: the ``conv_general_dilated``'s parameters, as sorted items
            (precision included, `Fp8Recipe.accumulation_precisions`;
            accumulating in float32).
        formats: the float8 formats of the two operands.
        power_of_two: round scales up to powers of two.
        out_dtype: the result's dtype.
        cotangent_of: ``""``: the convolution of ``(lhs, rhs)``; ``"lhs"``
            (``"rhs"``): the operands are the cotangent and the other operand,
            and the result is that side's cotangent (JAX's transpose rule).
        result_shape: with `cotangent_of`, that side's (whole) shape.
    """

    params: tuple
    formats: tuple[Any, Any]
    power_of_two: bool
    out_dtype: Any
    cotangent_of: str = ""
    result_shape: tuple[int, ...] = ()

    @property
    def jaxamp_matmul(self) -> str:
        """The matmul the op stands for, read by jaxpr walkers (`jaxamp._jaxpr.matmul_name`)."""
        return "conv_general_dilated"


def _conv_factors(how: LocalConv, lhs_ndim: int, rhs_ndim: int) -> _Factors:
    """Batch, input and output features shared as the convolution shares them; spatial dimensions whole.

    A convolution with feature groups keeps its features whole too (its batch
    may be split); one with batch groups is not taken (`_matmul`).
    """
    lhs_spec, rhs_spec, out_spec = dict(how.params)["dimension_numbers"]
    spatial = len(lhs_spec) - 2

    def laid_out(spec: Sequence[int], names: Sequence[str]) -> tuple[str, ...]:
        factors = [""] * len(spec)
        for dim, name in zip(spec, names):
            factors[dim] = name
        return tuple(factors)

    lhs = laid_out(lhs_spec, ["n", "c", *(f"s{i}" for i in range(spatial))])
    rhs = laid_out(rhs_spec, ["o", "c", *(f"k{i}" for i in range(spatial))])
    out = laid_out(out_spec, ["n", "o", *(f"t{i}" for i in range(spatial))])
    whole = tuple(f"{kind}{i}" for kind in "skt" for i in range(spatial))
    if dict(how.params)["feature_group_count"] > 1:  # a split of the features would cut across groups
        whole += ("c", "o")
    if how.cotangent_of == "lhs":
        operands, result, reduced = (out, rhs), lhs, "o"
    elif how.cotangent_of == "rhs":
        operands, result, reduced = (out, lhs), rhs, "n"
    else:
        operands, result, reduced = (lhs, rhs), out, "c"
    return _Factors(operands, result, () if reduced in whole else (reduced,), whole)


def _local_conv(a: Any, b: Any, how: LocalConv, where: OnDevice) -> Any:
    """One device's convolution (or cotangent): its shards quantised with their own scales, summed as `_local_dot`."""
    (q_a, s_a), (q_b, s_b) = (
        _quantized_block(x, fmt, how.power_of_two, (), gathered)
        for x, fmt, gathered in zip((a, b), how.formats, where.gathered)
    )
    return _rescaled_conv(q_a, s_a, q_b, s_b, how, where)


def _rescaled_conv(q_a: Any, s_a: Any, q_b: Any, s_b: Any, how: LocalConv, where: OnDevice) -> Any:
    """One device's float8 convolution (or cotangent) of quantised blocks, rescaled, summed, in `how.out_dtype`."""
    return _summed(_float8_conv(q_a, q_b, how, where) * (s_a * s_b), where.summed_over, how.out_dtype)


def _float8_conv(q_a: Any, q_b: Any, how: LocalConv, where: OnDevice) -> Any:
    """The unscaled float8 convolution (or `how.cotangent_of`'s cotangent) of one device's blocks, in float32."""
    conv = _compat.primitives_by_name()["conv_general_dilated"]
    params = dict(how.params)
    if params.get("out_sharding") is not None:  # the whole result's: each device computes a block
        params["out_sharding"] = None
    if not how.cotangent_of:
        return conv.bind(q_a, q_b, **params)
    shape = list(how.result_shape)  # the whole side's: this device's block of it
    if where.mesh is not None and where.result_spec is not None:  # (set together)
        for dim, entry in enumerate(where.result_spec):
            for name in axis_names(entry):
                shape[dim] //= where.mesh.shape[name]
    side = _compat.shaped_array(shape, how.out_dtype)
    pair = (side, q_b) if how.cotangent_of == "lhs" else (q_b, side)
    found = _compat.matmul_cotangents(conv, q_a, *pair, (), params, _F32, only=how.cotangent_of)
    return found[0 if how.cotangent_of == "lhs" else 1]


per_shard_conv = _partitioned_op(
    "jaxamp_per_shard_conv", _conv_factors, _local_conv, lambda args, dims, how: _batched_conv(args, dims, how)
)
"""``per_shard_conv(lhs, rhs, how)``: ``conv_general_dilated`` (or a cotangent) in float8, per device's shards."""


# --- convolutions on an Explicit mesh ---------------------------------------------
# There types say how each operand is split, so `jax.shard_map` can run each
# device's blocks while tracing, and a residual quantised per device keeps its
# scales: the gradient products see the same blocks (`explicit_conv_layouts`
# takes only layouts where nothing is resplit).


class ShardLayout(NamedTuple):
    """How one product runs per device on an Explicit mesh: its operands' specs, and `OnDevice`."""

    operands: tuple[P, ...]
    where: OnDevice


class ConvShardLayouts(NamedTuple):
    """`ShardLayout`s of a convolution's three products: forward, and the left and right cotangents."""

    forward: ShardLayout
    lhs: ShardLayout
    rhs: ShardLayout

    @property
    def mesh(self) -> Any:
        return self.forward.where.mesh

    def operand(self, side: str) -> P:
        """How `side`'s operand (``"lhs"`` or ``"rhs"``) is split."""
        return self.forward.operands[0 if side == "lhs" else 1]

    def split_axes(self) -> list[str]:
        """The mesh axes that split the operands, for diagnostics."""
        return sorted(str(name) for name in spec_axes(*self.forward.operands))


def explicit_conv_layouts(params: dict, lhs: Any, rhs: Any, out: Any) -> ConvShardLayouts | None:
    """The per-device layouts of a convolution of `lhs` and `rhs` (arrays) into `out` (a type), or None.

    None unless an operand is split over an Explicit mesh whose axes are all
    Explicit (outside `shard_map`), and each of the three products takes its
    operands as they are split and gives its result as the types say (the
    cotangent split as `out`): then no residual's blocks change between the
    forward product and the gradients. Otherwise the convolution keeps one
    scale per tensor.
    """
    if _compat.manual_axes() or not (_compat.explicit_shards(lhs) or _compat.explicit_shards(rhs)):
        return None
    lhs, rhs = jax.typeof(lhs), jax.typeof(rhs)
    meshes = {m for m in (lhs.sharding.mesh, rhs.sharding.mesh, out.sharding.mesh) if not m.empty}
    if len(meshes) != 1:
        return None
    (mesh,) = meshes
    if any(kind != jax.sharding.AxisType.Explicit for kind in mesh.axis_types):
        return None
    by_name = dict(params)

    def product(cotangent_of: str, operands: Sequence[Any], result: Any) -> ShardLayout | None:
        how = LocalConv(tuple(sorted(by_name.items())), (None, None), False, None, cotangent_of)
        factors = _conv_factors(how, *(len(a.shape) for a in operands))
        specs, result_spec, summed_over = _layout(factors, operands)
        if [tuple(s) for s in specs] != [spec_of(a) for a in operands] or tuple(result_spec) != spec_of(result):
            return None
        return ShardLayout(tuple(P(*s) for s in specs), OnDevice(mesh, P(*result_spec), summed_over))

    found = [product("", (lhs, rhs), out), product("lhs", (out, rhs), lhs), product("rhs", (out, lhs), rhs)]
    layouts = [layout for layout in found if layout is not None]
    return ConvShardLayouts(*layouts) if len(layouts) == len(found) else None


def _scale_spec(spec: P) -> P:
    """The spec of one scale per device's block of an array split as `spec`."""
    return P(_entry(spec_axes(spec)))


def quantize_per_device(x: Any, spec: P, mesh: Any, fmt: Any, power_of_two: bool) -> tuple[Any, Any]:
    """`quantize` on each device's block of `x` (split as `spec`): ``(q, one scale per block)``."""

    def block(x: Any) -> tuple[Any, Any]:
        q, scale = quantize(x, fmt, power_of_two)
        return q, lax.expand_dims(scale, (0,))

    return jax.shard_map(block, mesh=mesh, in_specs=(spec,), out_specs=(spec, _scale_spec(spec)))(x)


def dequantize_per_device(residual: tuple[Any, Any], spec: P, mesh: Any) -> Any:
    """`quantize_per_device`'s result back in float32."""

    def block(q: Any, scale: Any) -> Any:
        return lax.convert_element_type(q, _F32) * scale[0]

    return jax.shard_map(block, mesh=mesh, in_specs=(spec, _scale_spec(spec)), out_specs=spec)(*residual)


def conv_per_device(a: Any, b: tuple[Any, Any], how: LocalConv, layout: ShardLayout) -> Any:
    """The float8 convolution (or cotangent) of `a` and `b` per device, each device's product rescaled and summed.

    `b` is a `quantize_per_device` result; `a` is one too, or (a cotangent)
    an array each device quantises to ``how.formats[0]`` itself.
    """
    specs, where = layout
    # Each device's product varies over every axis that splits an operand (those
    # it sums over included), and the primitives want their operands typed alike.
    split_over = spec_axes(*specs)
    quantized = isinstance(a, tuple)

    def block(*blocks: Any) -> Any:
        *a, q_b, s_b = (_compat.mark_varying(x, split_over) for x in blocks)
        q_a, s_a = a if quantized else quantize(a[0], how.formats[0], how.power_of_two)
        return _rescaled_conv(q_a, s_a.reshape(()), q_b, s_b[0], how, where)

    a_specs = (specs[0], _scale_spec(specs[0])) if quantized else (specs[0],)
    in_specs = (*a_specs, specs[1], _scale_spec(specs[1]))
    a = a if quantized else (a,)
    return jax.shard_map(block, mesh=where.mesh, in_specs=in_specs, out_specs=where.result_spec)(*a, *b)


def _batched(args: Sequence[Any], dims: Sequence[Any], how: LocalScaling) -> tuple[Any, Any]:
    """`jax.vmap` of `per_shard_dot`: the mapped dimensions join the product, each index with its own scales."""
    (lhs, rhs), (lhs_dim, rhs_dim) = args, dims
    if lhs_dim is None and rhs_dim is None:
        return per_shard_dot(lhs, rhs, how), None
    ndims, mapped = (lhs.ndim, rhs.ndim), (lhs_dim, rhs_dim)
    dimension_numbers, out_dim = _compat.dot_general_batch_dims(ndims, mapped, how.dimension_numbers)

    def with_mapped(own: tuple, mapped: Any) -> tuple:
        if mapped is None:
            return own
        return (mapped, *(d + (d >= mapped) for d in own))

    own = (with_mapped(how.own_scales[0], lhs_dim), with_mapped(how.own_scales[1], rhs_dim))
    return per_shard_dot(lhs, rhs, how._replace(dimension_numbers=dimension_numbers, own_scales=own)), out_dim


def _batched_conv(args: Sequence[Any], dims: Sequence[Any], how: LocalConv) -> tuple[Any, Any]:
    """`jax.vmap` of `per_shard_conv`: each example scaled apart, as on one device (its shards' scales not split)."""
    mapped = [0 if d is not None else None for d in dims]
    moved = [x if d is None else jax.numpy.moveaxis(x, d, 0) for x, d in zip(args, dims)]
    out = jax.vmap(lambda a, b: _local_conv(a, b, how, OnDevice()), in_axes=mapped)(*moved)
    return out, 0
