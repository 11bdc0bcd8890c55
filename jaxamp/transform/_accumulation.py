"""Matmuls that accumulate in float32: gradient reductions across devices in float32.

In a data-parallel step the weight gradient of a matmul is a sum over the batch,
and the batch is split over devices: XLA sums each device's partial gradient
with an all-reduce placed right after the matmul, in the matmul's output dtype.
Under amp's default rule that is the compute dtype, so the cross-device sum of
(scaled) gradients runs in float16 or bfloat16, as in hand-cast JAX code.

With ``amp(..., float32_gradient_reductions=True)`` the table's compute-precision
``dot_general`` entry becomes `use_float32_accumulation`: operands in the compute
dtype, ``preferred_element_type=float32``, the result handed on in the compute
dtype. Its backward (a `jax.custom_vjp`, so that the incoming cotangent stays
in the compute dtype: JAX's own transpose would meet a float32 cotangent and
run the gradient matmuls float32 x float16) runs JAX's transposes of the matmul
on half-precision operands, accumulating in float32: the weight gradient's
partial sums, and the all-reduce that adds them across devices, are float32
(Megatron's ``accumulate_allreduce_grads_in_fp32``; PyTorch autocast with DDP
gets this by construction, its gradients being those of float32 parameters).
Convolutions and ragged dots keep accumulating in the compute dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .._casting import dtype_of
from .._jaxpr import MATMUL_NAMES
from ._interpreter import EquationRewrite, warn_once
from ._rules import PolicyTable, Rule, use_compute_precision
from ._scopes import MODE_ENTRY

__all__ = ["use_float32_accumulation", "with_float32_accumulation"]


def use_float32_accumulation(compute_dtype, original_dtypes, *invars, **bind_params):
    """Like `use_compute_precision`, for matmuls: accumulate in float32, hand on in compute dtype.

    As an ordinary rule (for a primitive that is not a matmul) it is
    `use_compute_precision`; on matmuls and convolutions amp asks its
    ``rewrite_equation``, which runs them with float32 accumulation.
    """
    return use_compute_precision(compute_dtype, original_dtypes, *invars, **bind_params)


def _float32_accumulating_dot(params: dict, out_dtype: Any):
    """``f(lhs, rhs)``: `dot_general` accumulating in float32, forward and backward."""
    params = dict(params, preferred_element_type=np.dtype(jnp.float32))

    @jax.custom_vjp
    def dot(lhs, rhs):
        return jax.lax.dot_general_p.bind(lhs, rhs, **params).astype(out_dtype)

    def forward(lhs, rhs):
        return dot(lhs, rhs), (lhs, rhs)

    def backward(residuals, g):
        lhs, rhs = residuals
        return _compat.matmul_cotangents(jax.lax.dot_general_p, g, lhs, rhs, (), params)

    dot.defvjp(forward, backward)
    return dot


def _rewrite_equation(compute_dtype, original_dtypes, eqn, *invars, **bind_params):
    operands, params = use_compute_precision(compute_dtype, original_dtypes, *invars, **bind_params)
    if eqn.primitive is not jax.lax.dot_general_p:
        name = eqn.primitive.name
        warn_once(
            ("float32_gradient_reductions", name),
            f"amp(..., float32_gradient_reductions=True): {name} still accumulates in "
            f"{np.dtype(compute_dtype).name}, so its weight gradients are summed across "
            "devices in that dtype; only dot_general accumulates in float32. Map "
            f"jax.lax.{name}_p to jaxamp.use_original_precision in amp_policy to run it "
            "in float32 instead.",
            UserWarning,
        )
        return EquationRewrite(None, (), f"{name} accumulates in the compute dtype")
    if params.get("preferred_element_type") != np.dtype(compute_dtype):
        # Not a floating matmul amp moved (integer operands, or a
        # preferred_element_type of the user's own): run it as the table says.
        return EquationRewrite(None, (), "")
    dot = _float32_accumulating_dot(params, compute_dtype)
    detail = "accumulates in float32, forward and backward (float32_gradient_reductions)"
    return EquationRewrite(lambda *_: dot(*operands), tuple(dtype_of(x) for x in operands), detail)


use_float32_accumulation.rewrite_equation = _rewrite_equation  # type: ignore[attr-defined]
setattr(use_float32_accumulation, MODE_ENTRY, True)


def with_float32_accumulation(table: Mapping[Any, Rule]) -> PolicyTable:
    """`table` with its compute-precision matmul entries accumulating in float32.

    Entries the user changed (a matmul mapped to another rule, any scope) keep
    their meaning, as fp8 mode leaves them.
    """
    by_name = _compat.primitives_by_name()
    primitives = [by_name[name] for name in MATMUL_NAMES if name in by_name]
    return PolicyTable(
        {
            **table,
            **{p: use_float32_accumulation for p in primitives if table.get(p) is use_compute_precision},
        }
    )
