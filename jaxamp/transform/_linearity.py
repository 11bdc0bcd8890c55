"""Which values of a `jax.custom_jvp` rule are tangents, while amp interprets the rule.

A rule's tangent outputs are linear in its tangent inputs, and JAX transposes
them for reverse mode. An equation rewrite that is not linear in its operands
cannot be transposed:

* fp8 mode's scaled matmul quantises both operands, from their amaxes, so it
  asks `linear_operands` which operands are tangents and emits a linear form
  for those (see `jaxamp.fp8._matmul`);
* a cast that saturates to float16's range clamps, so the evaluation loop casts
  tangents plainly (`tangent_operands`, `jaxamp._casting.linear_values`), in
  the rule and in the bodies it runs them through (a ``jit``'d helper, every
  ``jnp`` function that is one, a ``cond`` or a loop: `entering_bodies`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from .. import _compat

__all__ = ["UNKNOWN", "context_key", "entering_bodies", "linear_operands", "tangent_operands", "tangents_of"]

UNKNOWN = "unknown"
"""`linear_operands` inside a body nested in a rule, whose tangents were not traced."""


class _Rule(NamedTuple):
    """The custom_jvp rule being interpreted, or the bodies of one of its equations."""

    linear: frozenset  # the variables that depend on the rule's tangents
    own: frozenset  # ids of the equations of the jaxprs these variables belong to
    inputs: tuple[tuple[bool, ...], ...]  # per jaxpr, which of its inputs are tangents
    nested: bool  # bodies the rule runs (`entering_bodies`), not the rule itself


_RULE: contextvars.ContextVar[_Rule | None] = contextvars.ContextVar("jaxamp_custom_jvp_rule", default=None)


def _depending(jaxpr: Any, inputs: Sequence[bool]) -> set:
    """The variables of `jaxpr` that depend on the inputs marked in `inputs`."""
    linear = {v for v, t in zip(jaxpr.invars, inputs) if t}
    for eqn in jaxpr.eqns:
        if any(isinstance(v, _compat.Var) and v in linear for v in eqn.invars):
            linear.update(eqn.outvars)
    return linear


@contextlib.contextmanager
def _interpreting(bodies: Sequence[tuple[Any, tuple[bool, ...]]], nested: bool) -> Iterator[None]:
    linear = set().union(*(_depending(jaxpr, inputs) for jaxpr, inputs in bodies))
    own = frozenset(id(eqn) for jaxpr, _ in bodies for eqn in jaxpr.eqns)
    token = _RULE.set(_Rule(frozenset(linear), own, tuple(inputs for _, inputs in bodies), nested))
    try:
        yield
    finally:
        _RULE.reset(token)


def tangents_of(jaxpr: Any, tangent_inputs: Sequence[Any]) -> contextlib.AbstractContextManager:
    """While amp interprets `jaxpr`, a custom_jvp rule whose `tangent_inputs` are its tangents."""
    tangents = set(tangent_inputs)
    return _interpreting([(jaxpr, tuple(v in tangents for v in jaxpr.invars))], nested=False)


def entering_bodies(eqn: Any) -> contextlib.AbstractContextManager:
    """While amp interprets the bodies of `eqn`, which of their values are tangents.

    Where `eqn` is an equation of a custom_jvp rule (or of a body inside one)
    with a body: a call (jit, closed_call, remat, a custom rule's primal), a
    cond, a scan, a while loop or a shard_map. Elsewhere nothing changes.
    """
    tangents = tangent_operands(eqn)
    bodies = _bodies(eqn, tangents) if isinstance(tangents, tuple) else []
    return _interpreting(bodies, nested=True) if bodies else contextlib.nullcontext()


def _bodies(eqn: Any, tangents: tuple[bool, ...]) -> list[tuple[Any, tuple[bool, ...]]]:
    """The bodies `eqn` passes its operands to, each with which of its inputs are tangents."""
    primitive, params = eqn.primitive, eqn.params
    if primitive is _compat.cond_p:
        return [(branch.jaxpr, tangents[1:]) for branch in params["branches"]]
    if primitive is _compat.scan_p:
        body = params["jaxpr"].jaxpr
        num_consts, num_carry = _compat.scan_layout(params)
        return [(body, _settled(body, tangents, num_consts, num_carry))]
    if primitive is _compat.while_p:
        cond, body = params["cond_jaxpr"].jaxpr, params["body_jaxpr"].jaxpr
        cond_n, body_n = params["cond_nconsts"], params["body_nconsts"]
        body_inputs = _settled(body, tangents[cond_n:], body_n, len(body.outvars))
        return [(body, body_inputs), (cond, (*tangents[:cond_n], *body_inputs[body_n:]))]
    body = _compat.call_body(eqn)
    if body is None and primitive is _compat.shard_map_p:
        body = getattr(params["jaxpr"], "jaxpr", params["jaxpr"])
    if body is None or len(body.invars) != len(tangents):
        return []
    return [(body, tangents)]


def _settled(body: Any, inputs: Sequence[bool], start: int, num_carry: int) -> tuple[bool, ...]:
    """A loop body's tangent inputs: a carry is one where it enters as one or the body makes it one."""
    inputs = list(inputs)
    while True:
        linear = _depending(body, inputs)
        made = [isinstance(v, _compat.Var) and v in linear for v in body.outvars[:num_carry]]
        if not any(m and not inputs[start + k] for k, m in enumerate(made)):
            return tuple(inputs)
        for k, m in enumerate(made):
            inputs[start + k] = inputs[start + k] or m


def tangent_operands(eqn: Any) -> tuple[bool, ...] | str | None:
    """Which of `eqn`'s operands are tangents of the custom_jvp rule being interpreted.

    As `linear_operands`, and also for the equations of the bodies the rule
    runs its values through (`entering_bodies`).
    """
    rule = _RULE.get()
    if rule is None:
        return None
    if id(eqn) not in rule.own:
        return UNKNOWN
    return tuple(isinstance(v, _compat.Var) and v in rule.linear for v in eqn.invars)


def linear_operands(eqn: Any) -> tuple[bool, ...] | str | None:
    """Which of `eqn`'s operands are tangents of the custom_jvp rule being interpreted.

    Returns None outside any rule, `UNKNOWN` for an equation of a body nested
    in the rule (a jit, scan or cond inside it), else one bool per operand.
    """
    rule = _RULE.get()
    if rule is not None and rule.nested:
        # fp8 mode keeps a nested body's matmuls in bfloat16, linear whichever
        # operand is the tangent (and says so): its tangent products are
        # written for the rule's own equations.
        return UNKNOWN
    return tangent_operands(eqn)


def context_key() -> Any:
    """What `tangent_operands` and `linear_operands` answer depends on, for bodies traced now (a cache key)."""
    rule = _RULE.get()
    return None if rule is None else (rule.inputs, rule.nested)
