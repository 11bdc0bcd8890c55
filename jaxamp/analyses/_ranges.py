"""Value ranges: the ``exp`` equations whose result cannot overflow float16.

Under a float16 compute dtype, amp keeps ``exp``, ``exp2`` and ``expm1`` in
float32 (`use_full_range_precision`): ``exp`` of anything past 11.1 overflows
float16. That costs memory where it matters most: a softmax's probabilities,
the largest tensor attention saves for its backward pass, come out in float32.
But every numerically careful softmax (jax.nn's, optax's, flax's, Hugging
Face's) computes ``exp(x - max(x))``, whose operand is at most 0, so its result
lies in (0, 1]: safe in float16. This pass proves that from the jaxpr, and amp
runs such equations by the table's ``"amp_range"`` entry (the compute dtype by
default); `jaxamp.explain` reports them as decided by ``range``.

Facts tracked per value (anything else has no fact):

* `MaxOf`: the value is at least the maximum of variable ``of`` over
  ``axes``: a ``reduce_max`` of it, kept so through ``max`` with anything,
  ``stop_gradient``, conversions and the broadcasts that put the reduced axes
  back where they were (``keepdims``); ``layout`` says whether the reduced axes
  are dropped (``"reduced"``) or present, of size 1 or full (``"aligned"``);
* `NONPOSITIVE`: at most 0 (up to the rounding of a maximum converted to
  another dtype: ``exp`` of it is then at most 1.004, still bounded): ``x - m``
  for an aligned ``m = MaxOf(x)``, a literal <= 0, and
  ``max``/``min``/``select_n``/broadcasts of such values.

A ``MaxOf`` crosses into a called body (the ``jit``'d functions of
``jax.numpy``) when the variable it refers to is passed too: it is then
expressed relative to the body's inputs (`Arg`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _compat

__all__ = [
    "NONPOSITIVE",
    "Arg",
    "FiniteTest",
    "MaxOf",
    "Outside",
    "aliases",
    "bounded",
    "enter_call",
    "leave_call",
    "literal_fact",
    "resolve_inputs",
    "transfer",
]

NONPOSITIVE = "nonpositive"

# Primitives whose result lies in a bounded interval when their operand is <= 0.
_BOUNDED_WHEN_NONPOSITIVE = frozenset({"exp", "exp2", "expm1"})
# Single-operand primitives that keep a value's fact unchanged.
_ELEMENTWISE_IDENTITY = frozenset(
    {"stop_gradient", "convert_element_type", "copy", "reduce_precision", "pvary"}
)


@dataclasses.dataclass(frozen=True)
class Arg:
    """The `index`-th input of a called body (a `MaxOf` across a call boundary)."""

    index: int


@dataclasses.dataclass(frozen=True)
class Outside:
    """A variable of the caller not passed to the called body.

    ``operand``: the position, at the call, of the first operand whose fact
    refers to it, so that two facts about the same variable stay equal.
    """

    operand: int


@dataclasses.dataclass(frozen=True)
class MaxOf:
    """At least the maximum of variable `of` over `axes` (see the module docstring)."""

    of: Any
    axes: tuple[int, ...]
    layout: str  # "reduced" or "aligned"


@dataclasses.dataclass(frozen=True)
class FiniteTest:
    """``is_finite(m)`` for a `MaxOf` fact `of`: logsumexp's guard."""

    of: MaxOf


def bounded(eqn: Any, facts: Sequence[Any]) -> bool:
    """Whether `eqn` computes a range-limited function of a value known to be <= 0."""
    return eqn.primitive.name in _BOUNDED_WHEN_NONPOSITIVE and facts[0] == NONPOSITIVE


def literal_fact(value: Any) -> Any:
    """The fact of a literal operand."""
    try:
        return NONPOSITIVE if np.all(np.asarray(value) <= 0) else None
    except TypeError:
        return None


def transfer(eqn: Any, operands: Sequence[Any], facts: Sequence[Any]) -> Any:
    """The fact of the (single) output of first-order equation `eqn`.

    Args:
        eqn: the equation.
        operands: its operands, each replaced by the variable it is known to
            equal (see `aliases`).
        facts: the facts of its operands (None: nothing known).

    Returns:
        The output's fact, or None.
    """
    name = eqn.primitive.name
    if name == "reduce_max":
        (operand,) = operands
        if isinstance(operand, _compat.Literal):
            return None
        return MaxOf(operand, tuple(eqn.params["axes"]), "reduced")
    if name in _ELEMENTWISE_IDENTITY:
        return facts[0]
    if name == "broadcast_in_dim":
        return _broadcast(facts[0], eqn)
    if name == "reshape":
        return _reshape(facts[0], eqn)
    if name == "sub":
        x, fact = operands[0], facts[1]
        # A maximum over every axis is a scalar: it broadcasts to any position.
        if isinstance(fact, MaxOf) and fact.of is x and (
            fact.layout == "aligned" or len(fact.axes) == len(_shape(x))
        ):
            return NONPOSITIVE
        return None
    if name == "max":
        # max(m, anything) is still at least m, if it keeps m's layout.
        out = _shape(eqn.outvars[0])
        for v, fact in zip(eqn.invars, facts):
            if isinstance(fact, MaxOf) and (
                _shape(v) == out if fact.layout == "reduced" else _aligned(fact, out)
            ):
                return fact
        return NONPOSITIVE if all(f == NONPOSITIVE for f in facts) else None
    if name == "min":
        return NONPOSITIVE if NONPOSITIVE in facts else None
    if name == "is_finite":
        return FiniteTest(facts[0]) if isinstance(facts[0], MaxOf) else None
    if name == "select_n":
        predicate, cases = facts[0], facts[1:]
        # logsumexp: where(is_finite(m), m, 0). Where m is not finite, x holds
        # an infinity (or only -inf), and the result is non-finite in float32 too.
        if (
            isinstance(predicate, FiniteTest)
            and len(cases) == 2
            and cases[0] == NONPOSITIVE
            and cases[1] == predicate.of
        ):
            return predicate.of
        return NONPOSITIVE if all(f == NONPOSITIVE for f in cases) else None
    return None


def aliases(eqn: Any, body: Any = None) -> dict[int, int]:
    """Which outputs of `eqn` equal, for this analysis, which of its operands.

    ``{output index: operand index}``: the outputs of a called body that
    return one of its inputs unchanged (``jnp.real`` of a real array), and
    float-to-float conversions (rounding is monotonic, so the maximum of the
    converted values is the converted maximum).
    """
    if body is not None:
        inputs = {v: i for i, v in enumerate(body.invars)}
        return {k: inputs[v] for k, v in enumerate(body.outvars) if v in inputs}
    if eqn.primitive.name in ("convert_element_type", "copy"):
        (operand,) = eqn.invars
        dtypes = (getattr(operand.aval, "dtype", None), eqn.outvars[0].aval.dtype)
        if all(d is not None and np.issubdtype(d, np.floating) for d in dtypes):
            return {0: 0}
    return {}


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(getattr(v.aval, "shape", ()))


def _keepdims_shape(fact: MaxOf) -> tuple[int, ...]:
    return tuple(1 if i in fact.axes else n for i, n in enumerate(_shape(fact.of)))


def _aligned(fact: MaxOf, shape: tuple[int, ...]) -> bool:
    full = _shape(fact.of)
    return len(shape) == len(full) and all(
        n == full[i] if i not in fact.axes else n in (1, full[i]) for i, n in enumerate(shape)
    )


def _broadcast(fact: Any, eqn: Any) -> Any:
    if fact == NONPOSITIVE:
        return NONPOSITIVE
    if not isinstance(fact, MaxOf):
        return None
    shape = tuple(eqn.params["shape"])
    dims = tuple(eqn.params["broadcast_dimensions"])
    kept = tuple(i for i in range(len(_shape(fact.of))) if i not in fact.axes)
    if fact.layout == "reduced" and dims == kept and _aligned(fact, shape):
        return dataclasses.replace(fact, layout="aligned")
    if fact.layout == "aligned" and dims == tuple(range(len(shape))) and _aligned(fact, shape):
        return fact
    return None


def _reshape(fact: Any, eqn: Any) -> Any:
    if fact == NONPOSITIVE:
        return NONPOSITIVE
    if not isinstance(fact, MaxOf):
        return None
    if fact.layout == "reduced" and _shape(eqn.outvars[0]) == _keepdims_shape(fact):
        return dataclasses.replace(fact, layout="aligned")
    return None


def _rebase(fact: Any, move) -> Any:
    # Apply `move` to the variable a fact refers to (None: the fact is lost).
    if isinstance(fact, FiniteTest):
        inner = _rebase(fact.of, move)
        return None if inner is None else FiniteTest(inner)
    if isinstance(fact, MaxOf):
        of = move(fact, fact.of)
        return None if of is None else dataclasses.replace(fact, of=of)
    return fact


def enter_call(facts: Sequence[Any], invars: Sequence[Any]) -> tuple[Any, ...]:
    """The facts of a called body's inputs, from its operands' facts at the call.

    A `MaxOf` refers to the body input `Arg` its variable is passed as, or, if
    it is not passed, to an `Outside` marker (the body cannot subtract it from
    anything, but may hand it back out, as ``jnp.where`` does).
    """
    if all(f is None for f in facts):  # the common case, kept cheap
        return tuple(facts)
    position = {v: i for i, v in enumerate(invars) if not isinstance(v, _compat.Literal)}

    first: dict[Any, int] = {}
    for k, fact in enumerate(facts):
        _rebase(fact, lambda _, of, k=k: first.setdefault(of, k))

    def move(_, of):
        return Arg(position[of]) if of in position else Outside(first[of])

    return tuple(_rebase(fact, move) for fact in facts)


def resolve_inputs(facts: Sequence[Any], invars: Sequence[Any]) -> list[Any]:
    """Facts of a body's inputs, with `Arg` references turned into its variables."""
    return [
        _rebase(f, lambda _, of: invars[of.index] if isinstance(of, Arg) else of) for f in facts
    ]


def leave_call(
    facts: Sequence[Any],
    body_invars: Sequence[Any],
    call_invars: Sequence[Any],
    call_facts: Sequence[Any],
) -> list[Any]:
    """The facts of a call's outputs, from its body's output facts.

    Args:
        facts: the body's output facts.
        body_invars: the body's input variables.
        call_invars: the call's operands.
        call_facts: the operands' facts at the call (what `Outside` stood for).
    """
    if all(f is None for f in facts):
        return list(facts)
    index = {v: i for i, v in enumerate(body_invars)}

    def move(fact, of):
        if isinstance(of, Outside):
            # The body passed a fact through from this operand.
            outer = call_facts[of.operand]
            outer = outer.of if isinstance(outer, FiniteTest) else outer
            return outer.of if isinstance(outer, MaxOf) else None
        source = call_invars[index[of]] if of in index else None
        return None if source is None or isinstance(source, _compat.Literal) else source

    return [_rebase(fact, move) for fact in facts]
