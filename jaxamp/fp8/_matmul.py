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
* backward: the incoming cotangent is quantised the same way to float8_e5m2
  (wider range, ±57344) and meets the saved e4m3 operands in the gradient
  matmuls, again accumulating in float32. Convolutions need one dtype on both
  sides, so their gradient convolutions run e4m3 x e4m3 (see
  `Fp8Recipe.gradient_dtype`; `Fp8Recipe.gradient_format` chooses). The
  scaled matmul's derivative is the straight-through one, in forward and
  reverse mode; a matmul whose operands amp sees differentiated twice runs in
  bf16 (`_differentiated_twice`), and differentiating a traced derivative
  again raises (see `jaxamp.fp8._differentiable`).

The scaling schemes (tensorwise, delayed, rowwise, per group, per shard,
blocks) are in `jaxamp.fp8._schemes`, the quantisers in
`jaxamp.fp8._quantize`, the delayed recipe's amax histories in
`jaxamp.fp8._state` (each matmul takes its own from the program's
`jaxamp.transform._site_state`).

Matmuls it does not accept run in bfloat16, with the reason recorded for
`jaxamp.explain`. By default, as Transformer Engine, torchao and torchtitan
set float8 up: the program's last matmuls (the logits head: a matmul whose
result reaches the output with no matmul after it, found by its place in the
program, `jaxamp.analyses._tail`), batched matmuls
(attention's scores and values), grouped matmuls, and matmuls whose sizes a
float8 GEMM cannot take (not multiples of 16); always non-float operands. The
`Fp8Recipe` fields opt in; grouped matmuls then get a scale per group.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax

from .. import _compat
from .._casting import dtype_of
from .._dtypes import dtype_short_name, is_castable
from .._jaxpr import MATMUL_NAMES, equation_flops
from ..transform import _site_state
from ..transform._interpreter import (
    EquationRewrite,
    differentiation_depth,
    explicit_upcast,
    is_last_matmul,
    warn_once,
)
from ..transform._linearity import UNKNOWN, linear_operands
from ..transform._rules import PolicyTable, Rule, requested_precision, use_compute_precision
from ..transform._scopes import MODE_ENTRY
from ._differentiable import Scheme, differentiable_matmul, tangent_product
from ._partitioned import explicit_conv_layouts
from ._quantize import E4M3, quantize
from ._recipe import BLOCK_SCALINGS, Fp8Recipe
from ._schemes import (
    BLOCK_SIZE,
    AutoPerShard,
    BlockScaled,
    Delayed,
    PerGroup,
    PerShard,
    PerShardConv,
    Rowwise,
    Tensorwise,
    shard_axes,
    sharded_free_dims,
)
from ._state import ROLES

__all__ = [
    "Fp8MatmulRule",
    "contraction_size",
    "formats",
    "is_per_group_layout",
    "output_features",
    "quantize",
    "with_fp8_matmuls",
]


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
    cotangent = dtype_short_name(recipe.gradient_dtype(primitive_name))
    backward = f"backward {cotangent} x e4m3 -> f32"
    if primitive_name == "ragged_dot_general":
        scaling = "current, per group"
    elif primitive_name == "dot_general" and recipe.scaling in BLOCK_SCALINGS:
        return (
            f"float8 e4m3 x e4m3 -> f32; {backward}; scaling: "
            + ("mxfp8, blocks of 32, e8m0 scales" if recipe.scaling == "mxfp8" else
               "blockwise, 1x128 tiles (the right operand 128x128), power-of-two scales")
            + _accumulation(recipe)
            + "; not one float8 GEMM on a GPU: a float8 product per block of the contraction, "
            "whose float32 partial results (blocks x the result's size) are rescaled and summed"
        )  # fmt: skip
    elif recipe.scaling == "delayed":
        scaling = f"delayed, from the {recipe.amax_compute_algo} of {recipe.amax_history_length} steps' amaxes"
        if recipe.margin:
            scaling += f", margin {recipe.margin}"
    elif primitive_name == "dot_general" and recipe.scaling != "tensorwise":
        scaling = "current, rowwise"
        if recipe.scaling == "rowwise_with_gw_hp":
            backward += " (weight gradient bf16)"
    else:
        scaling = "current"
    if recipe.rounds_scales_to_powers_of_two and primitive_name != "ragged_dot_general":
        scaling += ", power-of-two scales"
    if scaling.startswith("current, rowwise"):
        # XLA's GPU GEMM rewriter folds per-tensor scales into the float8 GEMM, not per-row ones.
        scaling += "; the row scales an elementwise pass after each float8 GEMM"
    return f"float8 e4m3 x e4m3 -> f32; {backward}; scaling: {scaling}{_accumulation(recipe)}"


def _accumulation(recipe: Fp8Recipe) -> str:
    # Said when not the default (forward GEMMs only, as Transformer Engine).
    return "" if recipe.fast_accumulation == "forward" else f"; fast accumulation: {recipe.fast_accumulation}"


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
    """

    recipe: Fp8Recipe

    def __call__(self, compute_dtype, original_dtypes, *invars, **bind_params):
        return use_compute_precision(compute_dtype, original_dtypes, *invars, **bind_params)

    def rewrite_equation(self, compute_dtype, original_dtypes, eqn, *invars, **bind_params) -> EquationRewrite:
        """Replace a matmul equation by the scaled float8 matmul, or say why not."""
        reason = self._keep_out(original_dtypes, eqn) or _differentiated_twice()
        if reason:
            return EquationRewrite(None, (), f"kept {dtype_short_name(compute_dtype)}: {reason}")
        lhs, rhs, *rest = invars
        recipe, name = self.recipe, eqn.primitive.name
        power_of_two = recipe.rounds_scales_to_powers_of_two
        description = formats(name, recipe)
        blocked = name == "dot_general" and recipe.scaling in BLOCK_SCALINGS
        unblocked = _why_not_blocked(eqn, lhs, rhs, recipe.scaling) if blocked else ""
        gradient, precisions = recipe.gradient_dtype(name), recipe.accumulation_precisions()
        history, fallback = None, ""
        scheme: Scheme
        if name == "ragged_dot_general":
            scheme = PerGroup(bind_params, compute_dtype, gradient, precisions)
        elif blocked and not unblocked:
            scheme = BlockScaled(bind_params, compute_dtype, recipe.scaling, gradient, precisions)
        elif name == "dot_general" and recipe.scaling in ("rowwise", "rowwise_with_gw_hp"):
            weight_gradient_hp = recipe.scaling == "rowwise_with_gw_hp"
            scheme = Rowwise(bind_params, compute_dtype, power_of_two, weight_gradient_hp, gradient, precisions)
        elif recipe.scaling == "delayed":
            history, fallback = _delayed_history(name, recipe.amax_history_length)
            per_tensor = (eqn.primitive, bind_params, compute_dtype, power_of_two, gradient, precisions)
            from_history: tuple = (recipe.amax_compute_algo, recipe.margin)
            loss_scale = None
            if history is not None:
                state = _site_state.active()
                assert state is not None  # (the histories are threaded through the site state)
                from_history += (state.cotangents_summed_over,)
                loss_scale = state.cotangent_scale
            scheme = Tensorwise(*per_tensor) if history is None else Delayed(*per_tensor, *from_history)
        elif name == "dot_general" and any(shards := sharded_free_dims(eqn, lhs, rhs)):
            avals = (jax.typeof(lhs), jax.typeof(rhs))
            scheme = PerShard(bind_params, *avals, *shards, compute_dtype, power_of_two, gradient, precisions)
        elif _splits_per_device(eqn) and (layouts := _explicit_conv_layouts(eqn, bind_params, lhs, rhs)):
            scheme = PerShardConv(
                eqn.primitive, bind_params, compute_dtype, layouts, power_of_two, gradient, precisions
            )
        elif _splits_per_device(eqn) and _compat.on_auto_mesh(lhs, rhs):
            scheme = AutoPerShard(eqn.primitive, bind_params, compute_dtype, power_of_two, gradient, precisions)
        else:
            scheme = Tensorwise(eqn.primitive, bind_params, compute_dtype, power_of_two, gradient, precisions)
        if recipe.scaling == "delayed" and history is None:
            unblocked = fallback or "a grouped matmul, scaled per group from the live values"
            description = formats(name, dataclasses.replace(recipe, scaling="tensorwise")) + f" (delayed: {unblocked})"
        elif unblocked:
            tensorwise = dataclasses.replace(
                recipe, scaling="tensorwise", power_of_two_scales=True, gradient_format=dtype_short_name(gradient)
            )
            description = formats(name, tensorwise) + f" ({recipe.scaling}: {unblocked})"
        elif name == "conv_general_dilated" and recipe.scaling not in ("tensorwise", "delayed"):
            unblocked = "a convolution, which it does not scale by rows or blocks"
            description += f" ({recipe.scaling}: {unblocked})"
        if unblocked:
            _warn_fallback(recipe.scaling, name, unblocked)
        if isinstance(scheme, PerShard):
            description += f", a scale per shard along {', '.join(shard_axes(shards))}"
        elif isinstance(scheme, PerShardConv):
            description += f", a scale per device's shard along {', '.join(layouts.split_axes())}"
        elif isinstance(scheme, AutoPerShard):
            description += ", a scale per device's shard as XLA splits the operands (an Auto mesh; saved in bf16)"
        linear = linear_operands(eqn)
        if linear is not None and any(linear[:2]):
            # In a custom_jvp rule, a tangent times a primal: linear in the
            # tangent, so that JAX can transpose it.
            side = "lhs" if linear[0] else "rhs"
            fn: Callable[..., Any] = functools.partial(tangent_product, scheme, side)
            description += f"; the tangent product of a custom_jvp rule ({side} the tangent)"
        elif history is not None:
            matmul = differentiable_matmul(scheme)
            fn = functools.partial(_with_history, matmul, history, loss_scale)
        else:
            fn = differentiable_matmul(scheme)
        operand_dtypes = (E4M3, E4M3, *(dtype_of(x) for x in rest))
        return EquationRewrite(fn, operand_dtypes, description)

    def _keep_out(self, original_dtypes, eqn) -> str:
        """Why the matmul stays in compute precision, or ``""``."""
        operands = original_dtypes[:2]
        if not all(is_castable(d) for d in operands):
            names = " x ".join(dtype_short_name(d) for d in operands)
            return f"{names} operands (float8 takes float32, bfloat16 or float16)"
        # (Reached only where the table has no "amp_requested" entry, which
        # otherwise runs such a matmul as written before this rule is asked.)
        requested = requested_precision(original_dtypes, eqn.params) or explicit_upcast()
        if requested:
            return f"the program asks for {requested}"
        linear = linear_operands(eqn)
        if linear == UNKNOWN:
            reason = "in a jit, scan or cond nested in a custom_jvp rule, where amp cannot tell tangents from primals"
            warn_once(
                ("fp8_nested_rule", str(eqn.source_info.traceback)[-200:] if eqn.source_info else ""),
                f"jaxamp fp8 mode: a {eqn.primitive.name} runs in bfloat16: {reason}. "
                "Call the body directly in the rule to let it run in float8.",
                UserWarning,
            )
            return reason
        if linear is not None and all(linear[:2]):
            return "in a custom_jvp rule, both operands tangents"
        if self.recipe.keep_last_matmul_bf16 and is_last_matmul():
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
        small = self.recipe.keep_small_bf16
        if small is not None and contraction <= small[0] and output_features(eqn) <= small[1]:
            return (
                f"too small to gain: contraction size {contraction} <= {small[0]} and output features "
                f"{output_features(eqn)} <= {small[1]} (keep_small_bf16; quantising costs more than float8 saves)"
            )
        flops = equation_flops(eqn)
        if flops < self.recipe.min_flops:
            return f"{flops} FLOPs < min_flops {self.recipe.min_flops}"
        return ""


def _differentiated_twice() -> str:
    """Why a matmul under two differentiations runs in bf16 (said once), or ``""``.

    The float8 matmul's derivative is first-order (`jaxamp.fp8._differentiable`):
    where amp sees its operands differentiated twice (a Hessian, `jax.jvp` of
    `jax.grad`, grad of grad, with `amp` inside both), the matmul runs as bf16
    mode runs it, whose derivatives JAX takes to any order. Where amp cannot see
    it (the outer derivative taken of a `jax.jit`'d derivative after tracing),
    `Fp8HigherOrderError` is raised instead.
    """
    if differentiation_depth() < 2:
        return ""
    reason = "differentiated twice (a Hessian, jax.jvp of jax.grad, grad of grad), which float8 matmuls are not"
    warn_once(
        ("fp8_higher_order", ""),
        f"jaxamp fp8 mode: matmuls run in bfloat16 where their operands are {reason}: the derivatives "
        "are bf16 mode's. jaxamp.explain does not see this (it runs undifferentiated).",
        UserWarning,
    )
    return reason


def _splits_per_device(eqn: Any) -> bool:
    """Whether `AutoPerShard` or `PerShardConv` may take `eqn`: a ``dot_general``, or a convolution without
    batch groups."""
    if eqn.primitive.name == "conv_general_dilated":
        return eqn.params["batch_group_count"] == 1
    return eqn.primitive.name == "dot_general"


def _explicit_conv_layouts(eqn: Any, params: dict, lhs: Any, rhs: Any) -> Any:
    """`explicit_conv_layouts` of a convolution equation (None for a ``dot_general``: `PerShard` has those)."""
    if eqn.primitive.name != "conv_general_dilated":
        return None
    return explicit_conv_layouts(params, lhs, rhs, eqn.outvars[0].aval)


def _delayed_history(name: str, length: int) -> tuple[Any, str]:
    """``(history, "")``: this matmul's amax history from the program's `Fp8State`; or ``(None, why not)``."""
    state, paused = _site_state.active(), _site_state.pause_reason()
    if paused:
        return None, f"{paused}, scaled from the live values"
    if state is None:
        return None, "a call without an fp8_state, scaled from the live values"
    return state.take(name, (len(ROLES), length)), ""


def _with_history(matmul: Any, history: Any, loss_scale: Any, lhs: Any, rhs: Any) -> Any:
    # The loss scale rides with the history (`Delayed`): its cotangent row is kept in true units.
    return matmul(lhs, rhs, history) if loss_scale is None else matmul(lhs, rhs, loss_scale, history)


def _warn_fallback(scaling: str, name: str, reason: str) -> None:
    """Say once per recipe and kind of reason that a matmul runs per-tensor instead."""
    if scaling == "delayed":  # each of its reasons is a fixed sentence
        kind = reason
    else:
        kind = "explicit" if "Explicit" in reason else "block size" if "block size" in reason else name
    warn_once(
        ("fp8_fallback", f"{scaling}:{kind}"),
        f"jaxamp fp8 mode: Fp8Recipe(scaling={scaling!r}) runs a {name} with per-tensor scales instead: "
        f"{reason}. jaxamp.explain(fn, compute_dtype=recipe)(*args) lists every matmul this happens to.",
        UserWarning,
    )


def _why_not_blocked(eqn: Any, lhs: Any, rhs: Any, scaling: str) -> str:
    """Why a ``dot_general`` cannot take `scaling`'s blocks (it then runs tensorwise), or ``""``."""
    if _compat.explicit_shards(lhs) or _compat.explicit_shards(rhs):
        return "an operand split over an Explicit mesh, where block scaling is not built (tensorwise, per shard)"
    # Every product's contraction must hold whole blocks: the forward one's,
    # the input gradient's (output features) and the weight gradient's (rows).
    block = BLOCK_SIZE[scaling]
    (contracting, _), (batch, _) = eqn.params["dimension_numbers"]
    shape = eqn.invars[0].aval.shape
    rows = math.prod(n for d, n in enumerate(shape) if d not in (*contracting, *batch))
    sizes = (("contraction", contraction_size(eqn)), ("output features", output_features(eqn)), ("rows", rows))
    for what, size in sizes:
        if size % block:
            return f"{what} {size} is not a multiple of the block size {block}"
    return ""


# fp8 mode's entries are amp's, not entries the user wrote (see `choose_rule`).
setattr(Fp8MatmulRule, MODE_ENTRY, True)


def with_fp8_matmuls(table: Mapping[Any, Rule], recipe: Fp8Recipe) -> PolicyTable:
    """`table` with its matmul primitives' compute-precision entries replaced by `Fp8MatmulRule`.

    Entries the user changed (a matmul primitive mapped to another rule, any
    scope) keep their meaning: only where the table says "this matmul runs in
    compute precision" does fp8 mode say "in float8".
    """
    rule = Fp8MatmulRule(recipe)
    by_name = _compat.primitives_by_name()
    primitives = [by_name[name] for name in MATMUL_NAMES if name in by_name]
    return PolicyTable({**table, **{p: rule for p in primitives if table.get(p) is use_compute_precision}})
