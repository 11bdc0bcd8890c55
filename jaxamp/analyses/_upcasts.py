"""Explicit upcasts: the matmuls whose operands the program widened from half precision.

A bfloat16 program that writes ``q.astype(jnp.float32)`` before
``jnp.einsum(q32, k32)`` (MaxText's ``float32_qk_product``,
``float32_logits``; a flax layer built with ``dtype=jnp.float32`` fed
bfloat16 activations) asks for that matmul in float32. Left to the table, amp
would cast the float32 operands straight back to the compute dtype. This pass
finds such matmuls in the user's jaxpr (never in amp's output, whose casts are
amp's own), and amp runs them by the table's ``"amp_requested"`` entry, as it
runs a matmul that asks for ``precision=HIGHEST``.

**Definition.** A value is *widened from half precision* when it is a
``convert_element_type`` from bfloat16 or float16 to float32, possibly
followed by ops that only move elements (reshape, transpose, broadcast,
slices, sharding constraints: MaxText reshapes between its cast and its
einsum). The half-precision value widened is either *computed* in the program
(the result of any equation but those moving elements of a program input) or
*given*: an input of the program, or a value whose origin the pass does not
know (the inputs of a cond's branches or a while loop's body). A matmul,
convolution or grouped matmul is a request when

* some floating operand is widened from a computed half-precision value (the
  program chose float32 for a bfloat16 activation: the other operand may be
  a float32 parameter, as in flax's ``Dense(dtype=jnp.float32)``), or
* every floating operand is widened from half precision, given values
  included (``jnp.einsum(q.astype(f32), k.astype(f32))`` on bfloat16 inputs:
  nothing float32 of the program's own is involved, so the casts can only be
  asking for float32).

A float32 model handed a bfloat16 batch that it casts up first
(``x.astype(jnp.float32) @ w1``, ``w1`` float32) is not a request: the cast
adopts the input into a float32 program, which amp was asked to run in the
compute dtype, and JAX's type promotion records ``x_bf16 @ w1`` the same way.
A program that is float32 throughout has nothing widened and runs as before.

The pass sees through calls (``jax.jit``, remat, custom derivatives' primal
bodies), scans (their carries settled over the loop) and shard_map: a body is
planned with the classes of its operands at that call site. Other bodies are
planned on their own, their inputs given.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _compat
from .._dtypes import is_castable
from .._jaxpr import MATMUL_NAMES, memoised_per_jaxpr

__all__ = ["NOTHING", "UpcastPlan", "plan_upcasts"]

# A value's class: (kind, the half-precision dtype it was widened from, or "").
Class = tuple[int, str]
_NONE, _HALF_GIVEN, _HALF, _WIDE_GIVEN, _WIDE = range(5)
NOTHING: Class = (_NONE, "")

# Ops that move elements without combining or changing them: a widened value
# stays widened through them (their first operand is the data).
_MOVING = frozenset(
    {
        "reshape",
        "transpose",
        "broadcast_in_dim",
        "squeeze",
        "expand_dims",
        "rev",
        "slice",
        "dynamic_slice",
        "copy",
        "copy_p",
        "sharding_constraint",
        "pvary",
        "mesh_cast",
        "reshard",
    }
)
_HALF_DTYPES = frozenset({np.dtype("bfloat16"), np.dtype("float16")})


@dataclasses.dataclass(frozen=True)
class UpcastPlan:
    """What the pass found in one jaxpr, for inputs of given classes.

    Attributes:
        requests: by equation index, the matmuls whose operands the program
            widened, each with what it asked for, in words (``"float32
            operands widened from bfloat16"``).
        body_inputs: by equation index, the classes of the inputs of the
            body a call, scan or shard_map runs, for planning that body.
        out_classes: the class of each of the jaxpr's outputs.
    """

    requests: dict[int, str]
    body_inputs: dict[int, tuple[Class, ...]]
    out_classes: tuple[Class, ...]


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def plan_upcasts(jaxpr: Any, in_classes: Sequence[Class] | None = None) -> UpcastPlan:
    """The upcast plan of an open `jaxpr`.

    Args:
        jaxpr: an open jaxpr: the amp'd program, or a body inside it.
        in_classes: one class per input, from `UpcastPlan.body_inputs` at the
            call site; None: every input given (the program's own inputs).

    Returns:
        The plan (memoised per jaxpr and classes).
    """
    key = tuple(in_classes) if in_classes is not None else tuple(_given(v) for v in jaxpr.invars)
    return memoised_per_jaxpr(_PLANS, jaxpr, key, lambda: _plan(jaxpr, key))


def _dtype(v: Any) -> np.dtype | None:
    dtype = getattr(getattr(v, "aval", None), "dtype", None)
    try:
        return None if dtype is None else np.dtype(dtype)
    except TypeError:  # an extended dtype (PRNG keys)
        return None


def _given(v: Any) -> Class:
    """The class of a value whose origin is not known: a half-precision one is given."""
    return (_HALF_GIVEN, "") if _dtype(v) in _HALF_DTYPES else NOTHING


def _computed(v: Any) -> Class:
    """The class of a value an equation computed."""
    return (_HALF, "") if _dtype(v) in _HALF_DTYPES else NOTHING


def _widened(eqn: Any, source: Class) -> Class:
    """The class of a ``convert_element_type``'s result."""
    old, new = _dtype(eqn.invars[0]), _dtype(eqn.outvars[0])
    if old == new:
        return source
    if old in _HALF_DTYPES and new is not None and is_castable(new) and new.itemsize >= 4:
        kind = _WIDE_GIVEN if source[0] == _HALF_GIVEN else _WIDE
        return (kind, old.name)
    if old in _HALF_DTYPES and new in _HALF_DTYPES and source[0] == _HALF_GIVEN:
        return source  # a given bfloat16 value as float16 is still given
    return _computed(eqn.outvars[0])


def _request(eqn: Any, ins: Sequence[Class]) -> str:
    """What a matmul with operands of classes `ins` asks for, or ``""``."""
    operands = [(k, c) for k, (v, c) in enumerate(zip(eqn.invars[:2], ins[:2])) if is_castable(_dtype(v))]
    widened = [(k, c) for k, c in operands if c[0] in (_WIDE, _WIDE_GIVEN)]
    if not widened:
        return ""
    if not any(c[0] == _WIDE for _, c in widened) and len(widened) < len(operands):
        return ""
    wide = _dtype(eqn.invars[widened[0][0]])
    assert wide is not None
    halves = " and ".join(sorted({c[1] for _, c in widened}))
    if len(widened) == len(operands) and len(operands) > 1:
        return f"{wide.name} operands widened from {halves}"
    side = "lhs" if widened[0][0] == 0 else "rhs"
    return f"a {wide.name} {side} widened from {halves}"


def _join(a: Class, b: Class, v: Any) -> Class:
    """A loop carry's class, from what enters the loop (`a`) and what the body hands on (`b`)."""
    if a == b:
        return a
    if {a[0], b[0]} <= {_HALF_GIVEN, _HALF}:
        return (_HALF, "")  # the loop computes it
    return _given(v)


def _plan(jaxpr: Any, in_classes: tuple[Class, ...]) -> UpcastPlan:
    cls: dict[Any, Class] = dict(zip(jaxpr.invars, in_classes))
    requests: dict[int, str] = {}
    body_inputs: dict[int, tuple[Class, ...]] = {}

    def of(v: Any) -> Class:
        if isinstance(v, _compat.Literal):
            return NOTHING
        found = cls.get(v)
        return found if found is not None else _given(v)  # a constant closed over

    for i, eqn in enumerate(jaxpr.eqns):
        name = eqn.primitive.name
        ins = [of(v) for v in eqn.invars]
        outs: Sequence[Class]
        body = _compat.call_body(eqn)
        if body is not None or eqn.primitive is _compat.shard_map_p:
            if body is None:
                body = eqn.params["jaxpr"]
                body = getattr(body, "jaxpr", body)
            body_inputs[i] = tuple(ins)
            outs = plan_upcasts(body, ins).out_classes
        elif eqn.primitive is _compat.scan_p:
            outs = _scan(eqn, ins, body_inputs, i)
        elif name == "convert_element_type":
            outs = [_widened(eqn, ins[0])]
        elif name in _MOVING and len(eqn.outvars) == 1 and _dtype(eqn.outvars[0]) == _dtype(eqn.invars[0]):
            outs = [ins[0]]
        else:
            if name in MATMUL_NAMES:
                request = _request(eqn, ins)
                if request:
                    requests[i] = request
            outs = [_computed(v) for v in eqn.outvars]
        for v, c in zip(eqn.outvars, outs):
            cls[v] = c
    return UpcastPlan(requests, body_inputs, tuple(of(v) for v in jaxpr.outvars))


def _scan(eqn: Any, ins: list[Class], body_inputs: dict, index: int) -> list[Class]:
    """A scan's result classes; records its body's input classes, carries settled over the loop."""
    num_consts, num_carry = _compat.scan_layout(eqn.params)
    body = eqn.params["jaxpr"].jaxpr
    carries = slice(num_consts, num_consts + num_carry)
    entry = list(ins)
    for _ in range(3):
        inner = plan_upcasts(body, entry)
        joined = [
            _join(a, b, v) for a, b, v in zip(entry[carries], inner.out_classes[:num_carry], body.invars[carries])
        ]
        if joined == entry[carries]:
            break
        entry[carries] = joined
    else:  # not settled: carries of unknown origin
        entry[carries] = [_given(v) for v in body.invars[carries]]
        inner = plan_upcasts(body, entry)
    body_inputs[index] = tuple(entry)
    # A stacked output holds what each iteration computed.
    return [*entry[carries], *inner.out_classes[num_carry:]]
