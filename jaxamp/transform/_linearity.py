"""Which values of a `jax.custom_jvp` rule are tangents, while amp interprets the rule.

A rule's tangent outputs are linear in its tangent inputs, and JAX transposes
them for reverse mode. An equation rewrite that is not linear in its operands
(fp8 mode's scaled matmul quantises both, from their amaxes) cannot be
transposed, so a rule asks `linear_operands` which operands are tangents and
emits a linear form for those (see `jaxamp.fp8._matmul`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

from .. import _compat

__all__ = ["UNKNOWN", "linear_operands", "tangents_of"]

UNKNOWN = "unknown"
"""`linear_operands` inside a body nested in a rule, whose tangents were not traced."""

# (the rule's tangent-dependent variables, ids of the rule's own equations)
_RULE: contextvars.ContextVar[tuple[frozenset, frozenset] | None] = contextvars.ContextVar(
    "jaxamp_custom_jvp_rule", default=None
)


@contextlib.contextmanager
def tangents_of(jaxpr: Any, tangent_inputs: Sequence[Any]) -> Iterator[None]:
    """While amp interprets `jaxpr`, a custom_jvp rule whose `tangent_inputs` are its tangents."""
    linear = set(tangent_inputs)
    for eqn in jaxpr.eqns:
        if any(isinstance(v, _compat.Var) and v in linear for v in eqn.invars):
            linear.update(eqn.outvars)
    token = _RULE.set((frozenset(linear), frozenset(map(id, jaxpr.eqns))))
    try:
        yield
    finally:
        _RULE.reset(token)


def linear_operands(eqn: Any) -> tuple[bool, ...] | str | None:
    """Which of `eqn`'s operands are tangents of the custom_jvp rule being interpreted.

    Returns None outside any rule, `UNKNOWN` for an equation of a body nested
    in the rule (a jit, scan or cond inside it), else one bool per operand.
    """
    rule = _RULE.get()
    if rule is None:
        return None
    linear, own = rule
    if id(eqn) not in own:
        return UNKNOWN
    return tuple(isinstance(v, _compat.Var) and v in linear for v in eqn.invars)
