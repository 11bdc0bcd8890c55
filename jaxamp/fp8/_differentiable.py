"""A float8 matmul that JAX can differentiate in every mode.

`differentiable_matmul(scheme)` turns a scaling scheme (how operands are
quantised, multiplied, and how each side's tangent and cotangent are formed)
into ``f(lhs, rhs, *rest)``, a `jax.custom_jvp` whose derivative is the
straight-through one (quantisation counted as the identity):

* The tangent of the product is ``tangent(lhs side) + tangent(rhs side)``,
  each a `jax.custom_derivatives.linear_call`: linear in its tangent, with
  the other operand's quantised copy as its residual (taken through
  `_first_order_only`) and the scheme's float8 gradient matmul as its transpose. So
  `jax.grad` saves the float8 operands and runs the gradient matmuls on a
  float8 cotangent (e5m2 for the tensorwise recipe), as a `jax.custom_vjp`
  would; `jax.jvp`, `jax.linearize` and `jax.jacfwd` run the scheme's tangent
  product; and a transpose of a transpose is the tangent product again.
* Differentiating the derivative itself (a Hessian, `jax.jvp` of `jax.grad`,
  grad of grad) would need the tangent's dependence on the other operand,
  which the float8 residual does not carry. Where amp sees the operands
  differentiated twice, the matmul is not made float8 at all (it runs in
  bf16, `jaxamp.fp8._matmul`); elsewhere `_first_order_only` raises
  `Fp8HigherOrderError` instead of returning a derivative missing those terms.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import jax
from jax import lax
from jax.custom_derivatives import linear_call

from .. import _compat
from ..transform._interpreter import warn_once

__all__ = ["OTHER_SIDE", "Fp8HigherOrderError", "Scheme", "differentiable_matmul", "tangent_product"]

OTHER_SIDE = {"lhs": "rhs", "rhs": "lhs"}


class Scheme(Protocol):
    """How one kind of float8 matmul quantises, multiplies and differentiates.

    `side` is ``"lhs"`` or ``"rhs"``; `rest` the matmul's operands after the
    two it multiplies (a ragged dot's group sizes), never differentiated.

    Attributes:
        primitive, params: the matmul primitive and its bind parameters.
        out_dtype: the dtype the product is handed on in (amp's compute dtype).
    """

    # Read-only (properties), so that frozen dataclasses implement it.
    @property
    def primitive(self) -> Any: ...

    @property
    def params(self) -> dict: ...

    @property
    def out_dtype(self) -> Any: ...

    def quantize(self, side: str, x: Any, rest: tuple) -> Any:
        """The residual of operand `x`: what the product and the other side's derivatives need."""

    def product(self, lhs: Any, rhs: Any, rest: tuple) -> Any:
        """The matmul of two quantised operands (`quantize`'s residuals)."""

    def tangent(self, side: str, other: Any, t: Any, rest: tuple) -> Any:
        """The product's tangent from `side`'s tangent `t`, the other operand's residual given."""

    def cotangent(self, side: str, other: Any, aval: Any, g: Any, rest: tuple) -> Any:
        """`side`'s cotangent from the product's cotangent `g`; `aval` is `side`'s operand's type."""

    # A scheme with state (the delayed recipe's history, ``rest[-1]``) also has
    # ``observe(lhs, rhs, rest) -> residual`` and ``observed(residual, g,
    # state_aval) -> the state's cotangent``: see `_observation`.


def differentiable_matmul(scheme: Scheme) -> Callable[..., Any]:
    """``f(lhs, rhs, *rest)``: `scheme`'s float8 matmul, differentiable in every mode (see the module doc)."""

    @jax.custom_jvp
    def matmul(lhs, rhs, *rest):
        return scheme.product(scheme.quantize("lhs", lhs, rest), scheme.quantize("rhs", rhs, rest), rest)

    @functools.partial(matmul.defjvp, symbolic_zeros=True)
    def matmul_jvp(primals, tangents):
        lhs, rhs, *rest = primals
        rest = tuple(rest)
        out = matmul(lhs, rhs, *rest)
        terms = [
            tangent_product(scheme, side, *((t, rhs) if side == "lhs" else (lhs, t)), *rest)
            for side, t in zip(("lhs", "rhs"), tangents[:2])
            if not _compat.is_zero(t)
        ]
        if hasattr(scheme, "observe"):
            terms += _observation(scheme, lhs, rhs, rest, tangents, jax.typeof(out))
        if not terms:  # only `rest` (integers) had tangents
            return out, _compat.zeros_like_aval(jax.typeof(out))
        return out, functools.reduce(lax.add, terms)

    return matmul


def tangent_product(scheme: Scheme, side: str, lhs: Any, rhs: Any, *rest: Any) -> Any:
    """`scheme`'s product with `side`'s operand a tangent: linear in it, transposed in float8.

    A `linear_call` whose residual is the other operand's quantised copy:
    forward, the scheme's tangent product; transposed, its float8 gradient matmul.
    """
    operands = {"lhs": lhs, "rhs": rhs}
    other = OTHER_SIDE[side]
    residual = scheme.quantize(other, _first_order_only(operands[other]), rest)
    aval = jax.typeof(operands[side])

    def tangent(residuals, t):
        other_residual, rest = residuals
        return scheme.tangent(side, other_residual, t, rest)

    def cotangent(residuals, g):
        other_residual, rest = residuals
        return scheme.cotangent(side, other_residual, aval, g, rest)

    _compat.ensure_linear_call_batching()
    return linear_call(tangent, cotangent, (residual, rest), operands[side])


def _observation(scheme: Any, lhs: Any, rhs: Any, rest: tuple, tangents: tuple, out_aval: Any) -> list:
    """The term that carries a scheme's observed amaxes out as the cotangent of its state (``rest[-1]``).

    A `linear_call` that adds nothing to the tangent and whose transpose is
    the state's update (`Scheme.observed`): not a derivative, the way flax's
    fp8 ops return their amax histories. Nothing when the state is not
    differentiated (said once: its histories would never be updated).
    """
    state_tangent = tangents[-1]
    if _compat.is_zero(state_tangent):
        if not all(_compat.is_zero(t) for t in tangents[:2]):
            warn_once(
                ("fp8_state_not_differentiated", ""),
                "jaxamp fp8 mode: a delayed-recipe matmul was differentiated, but not with respect to its "
                "fp8_state, so the step's amaxes are lost and the histories never change. Differentiate "
                "with respect to the state too, jax.grad(loss, argnums=(0, 1))(params, fp8_state), and "
                "pass that gradient to fp8_state.update (jax.jvp alone observes no cotangent: ignore this there).",
                UserWarning,
            )
        return []
    state_aval = jax.typeof(rest[-1])

    def no_tangent(forward, t):
        return _compat.zeros_like_aval(out_aval)

    def observed(forward, g):
        return scheme.observed(forward, g, state_aval)

    _compat.ensure_linear_call_batching()
    return [linear_call(no_tangent, observed, scheme.observe(lhs, rhs, rest), state_tangent)]


class Fp8HigherOrderError(NotImplementedError):
    """A float8 matmul's derivative was differentiated again."""


_HIGHER_ORDER = (
    "jaxamp fp8 mode: a float8 matmul's derivative was differentiated again (a Hessian, jax.jvp "
    "of jax.grad, grad of grad, jax.jacfwd of jax.jacrev). fp8 mode differentiates its matmuls in "
    "forward mode (jax.jvp, jax.linearize, jax.jacfwd) and in first-order reverse mode (jax.grad, "
    "jax.vjp); the second derivative would need the operands in high precision, which fp8 mode does "
    "not keep. Where amp sees its operands differentiated twice it runs those matmuls in bfloat16 "
    "itself; here the outer derivative was taken of an already traced one (jax.jvp of a jax.jit'd "
    "jax.grad, say): put the jit around both derivatives, use compute_dtype='bf16' for this "
    "function, or keep the matmul out of float8 (a policy entry for its scope, Fp8Recipe.min_flops)."
)


@jax.custom_jvp
def _first_order_only(x):
    """The identity, whose derivative raises `Fp8HigherOrderError`.

    It guards the operand a derivative's residual is quantised from: that
    residual is cut from the operand (quantisation has no useful derivative),
    so differentiating the derivative would silently lose the terms that
    depend on it.
    """
    return x


@_first_order_only.defjvp
def _first_order_only_jvp(primals, tangents):
    raise Fp8HigherOrderError(_HIGHER_ORDER)
