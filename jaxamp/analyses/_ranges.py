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

* `View`: the value is variable ``of`` with its dimensions rearranged
  (``transpose``, reshapes and broadcasts that only add or drop dimensions of
  size 1): ``dims[i]`` is the dimension of ``of`` that the value's dimension
  ``i`` holds (None: an added dimension of size 1). attention implementations
  (``jax.nn.dot_product_attention``) transpose the scores between their
  row maximum and the subtraction;
* `MaxOf`: the value is at least the maximum of variable ``of`` over
  ``axes``: a ``reduce_max`` of it (or of a `View` of it), kept so through
  ``max`` with anything, ``stop_gradient``, conversions, transposes,
  reshapes and the broadcasts that put the reduced axes back; ``dims`` maps
  the value's dimensions to those of ``of`` as for a `View` (a reduced axis,
  or None, where the value is constant along the dimension);
* `NONPOSITIVE`: at most 0 (up to the rounding of a maximum converted to
  another dtype: ``exp`` of it is then at most 1.004, still bounded): ``x - m``
  for an ``m = MaxOf(x)`` laid out as ``x`` (or as the same `View` of its
  variable), a literal <= 0, and ``max``/``min``/``select_n``/broadcasts of
  such values.

A `MaxOf` or `View` crosses into a called body (the ``jit``'d functions of
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
    "View",
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
_ELEMENTWISE_IDENTITY = frozenset({"stop_gradient", "convert_element_type", "copy", "reduce_precision", "pvary"})


@dataclasses.dataclass(frozen=True)
class Arg:
    """The `index`-th input of a called body (a `MaxOf` or `View` across a call boundary)."""

    index: int


@dataclasses.dataclass(frozen=True)
class Outside:
    """A variable of the caller not passed to the called body.

    ``operand``: the position, at the call, of the first operand whose fact
    refers to it, so that two facts about the same variable stay equal.
    """

    operand: int


@dataclasses.dataclass(frozen=True)
class View:
    """Variable `of`, its dimensions rearranged as `dims` says (see the module docstring)."""

    of: Any
    dims: tuple[int | None, ...]


@dataclasses.dataclass(frozen=True)
class MaxOf:
    """At least the maximum of variable `of` over `axes`, laid out as `dims` (see the module docstring)."""

    of: Any
    axes: tuple[int, ...]
    dims: tuple[int | None, ...]


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
        view = _view(operands[0], facts[0])
        if view is None:
            return None
        axes = set(eqn.params["axes"])
        reduced = tuple(d for i, d in enumerate(view.dims) if i in axes and d is not None)
        kept = tuple(d for i, d in enumerate(view.dims) if i not in axes)
        return MaxOf(view.of, reduced, kept)
    if name in _ELEMENTWISE_IDENTITY:
        return facts[0]
    if name in ("transpose", "broadcast_in_dim", "reshape"):
        fact = facts[0]
        if fact == NONPOSITIVE:
            return NONPOSITIVE
        if not isinstance(fact, MaxOf):
            fact = _view(operands[0], fact)
        dims = None if fact is None else _moved_dims(eqn, fact)
        return None if dims is None else dataclasses.replace(fact, dims=dims)
    if name == "sub":
        view, fact = _view(operands[0], facts[0]), facts[1]
        if view is not None and isinstance(fact, MaxOf) and fact.of is view.of:
            if _covers(fact, view, _shape(eqn.invars[0]), _shape(eqn.invars[1])):
                return NONPOSITIVE
        return None
    if name == "max":
        # max(m, anything) is still at least m, if it keeps m's shape.
        out = _shape(eqn.outvars[0])
        for v, fact in zip(eqn.invars, facts):
            if isinstance(fact, MaxOf) and _shape(v) == out:
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
        # A body may return a literal (``eqx.filter_jit``'s constant output), which is not hashable.
        return {k: inputs[v] for k, v in enumerate(body.outvars) if not isinstance(v, _compat.Literal) and v in inputs}
    if eqn.primitive.name in ("convert_element_type", "copy"):
        (operand,) = eqn.invars
        dtypes = (getattr(operand.aval, "dtype", None), eqn.outvars[0].aval.dtype)
        if all(d is not None and np.issubdtype(d, np.floating) for d in dtypes):
            return {0: 0}
    return {}


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(getattr(v.aval, "shape", ()))


def _view(operand: Any, fact: Any) -> View | None:
    """`operand` as a `View` of a variable: its fact, or itself unrearranged."""
    if isinstance(fact, View):
        return fact
    if isinstance(operand, _compat.Literal):
        return None
    return View(operand, tuple(range(len(_shape(operand)))))


def _covers(fact: MaxOf, view: View, x_shape: tuple, m_shape: tuple) -> bool:
    """Whether ``m >= x`` elementwise, for ``x`` laid out as `view` and ``m`` as `fact`.

    Where ``m`` follows a dimension of the variable, ``x`` must hold the same
    one; where ``m`` is constant (a reduced axis, or an added dimension),
    ``x`` must hold a reduced axis or have size 1 there.
    """
    if not m_shape and set(fact.axes) >= set(view.dims) - {None}:
        return True  # a maximum over every axis, a scalar: it broadcasts to any position
    # `sub` broadcasts dimensions of size 1 (JAX 0.12 leaves the broadcast implicit).
    if len(x_shape) != len(m_shape) or any(m not in (1, x) for m, x in zip(m_shape, x_shape)):
        return False
    for mine, theirs, size in zip(fact.dims, view.dims, x_shape):
        if mine is not None and mine not in fact.axes:
            if mine != theirs:
                return False
        elif theirs not in fact.axes and size != 1:
            return False
    return True


def _moved_dims(eqn: Any, fact: View | MaxOf) -> tuple[int | None, ...] | None:
    """`fact`'s dims after a transpose, reshape or broadcast, or None where they are lost.

    A `View` stays one only through equations that keep every element once (a
    broadcast may only add dimensions of size 1); a `MaxOf` may also be
    broadcast along dimensions where it is constant, which become None.
    """
    dims = fact.dims
    name = eqn.primitive.name
    if name == "transpose":
        return tuple(dims[p] for p in eqn.params["permutation"])
    shape_in, shape_out = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    if name == "broadcast_in_dim":
        out: list[int | None] = [None] * len(shape_out)
        for d, position in enumerate(eqn.params["broadcast_dimensions"]):
            grown = shape_in[d] != shape_out[position]
            if grown and (isinstance(fact, View) or (dims[d] is not None and dims[d] not in fact.axes)):
                return None  # grown along a dimension the value varies in
            out[position] = None if grown else dims[d]
        added = [size for k, size in enumerate(shape_out) if k not in eqn.params["broadcast_dimensions"]]
        if isinstance(fact, View) and any(size != 1 for size in added):
            return None
        return tuple(out)
    # A reshape that only adds or drops dimensions of size 1.
    if eqn.params.get("dimensions") is not None:
        return None
    if [n for n in shape_in if n != 1] != [n for n in shape_out if n != 1]:
        return None
    sized = iter(d for d, n in zip(dims, shape_in) if n != 1)
    return tuple(next(sized) if n != 1 else None for n in shape_out)


def _rebase(fact: Any, move) -> Any:
    # Apply `move` to the variable a fact refers to (None: the fact is lost).
    if isinstance(fact, FiniteTest):
        inner = _rebase(fact.of, move)
        return None if inner is None else FiniteTest(inner)
    if isinstance(fact, (MaxOf, View)):
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
    return [_rebase(f, lambda _, of: invars[of.index] if isinstance(of, Arg) else of) for f in facts]


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
            return outer.of if isinstance(outer, (MaxOf, View)) else None
        source = call_invars[index[of]] if of in index else None
        return None if source is None or isinstance(source, _compat.Literal) else source

    return [_rebase(fact, move) for fact in facts]
