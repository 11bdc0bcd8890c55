"""Normalisation statistics: find the equations that must stay in float32.

Norm layers from every library (flax linen and nnx, haiku, Hugging Face,
``jax.nn.standardize``) compute the same few things: a mean (a ``reduce_sum``
scaled by a constant), a centred value ``x - mean``, a variance from squares,
and a normalised value ``x * rsqrt(var + eps)``. They write
``x.astype(float32)`` for them, but when amp traces, ``x`` is already float32,
so no cast is recorded; without help, an ``x`` that amp moved to bfloat16 (a
matmul's output) would be centred, squared and scaled in bfloat16. Matching
layer names cannot cover every library, so amp recognises the computation
itself, by a dataflow pass over each jaxpr:

* a *moment* is the output of ``reduce_sum``, or arithmetic of moments and
  constants (``sum / n``, ``mean2 - mean**2``, ``var + eps``), reshaped or
  broadcast;
* a *normaliser* is ``rsqrt`` of anything but a constant (a batch norm's
  running variance counts), or ``sqrt`` of a moment, or such a
  value scaled by constants, moments or per-feature parameters (values
  broadcast from fewer elements, e.g. flax's ``rsqrt(var + eps) * scale``).

The *statistics equations*, run at original precision (the table's
``"amp_statistics"`` entry), are then: ``sub`` of a moment from an activation
(centring), ``mul``/``div`` of an activation by a normaliser (normalising),
and a square (``square``, ``integer_pow`` by 2, ``x * x``) whose result is
summed (a second moment). A softmax stays in the compute dtype: its sum of
``exp`` is a moment, but dividing by a moment is not normalising by one of
these, and ``x - max(x)`` subtracts no moment, so its probabilities (what
attention saves for backward) keep their small dtype.

The pass sees through calls (the ``jit``'d functions of ``jax.numpy``, remat,
custom derivatives' primal bodies): a call's body is planned with the classes
of its operands at that call site, and amp caches rewritten bodies per those
classes. Loop and cond bodies are planned on their own.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _compat
from .._jaxpr import holds_matmul, memoised_per_jaxpr, merge_runs
from . import _ranges

__all__ = ["CONSTANT", "MOMENT", "NORMALISER", "OTHER", "StatisticsPlan", "plan_statistics"]

# Classes of values. CONSTANT: literals, closed-over scalars and what is
# computed from them alone.
OTHER, MOMENT, NORMALISER, CONSTANT = 0, 1, 2, 3

# Ops through which a value keeps its class: they move or convert elements
# without combining them with others.
_TRANSPARENT = frozenset(
    {
        "broadcast_in_dim",
        "reshape",
        "squeeze",
        "expand_dims",
        "convert_element_type",
        "copy",
        "transpose",
        "reduce_precision",
        "pvary",
        "psum",
        "psum_invariant",
    }
)
_ARITHMETIC = frozenset({"add", "add_any", "sub", "mul", "div", "max", "min", "neg"})
# What a norm's affine part (``* scale + bias``) is made of.
_AFFINE = _TRANSPARENT | {"add", "sub", "mul"}


@dataclasses.dataclass(frozen=True)
class StatisticsPlan:
    """What the pass found in one jaxpr, for operands of given classes.

    Attributes:
        statistics: indices of the equations to run at original precision.
        bounded: indices of range-limited equations (``exp``...) whose result
            the range facts bound (see `jaxamp.analyses._ranges`).
        call_inputs: for call equations, by index, the arguments the body is
            planned with: its inputs' classes, which of its outputs the
            caller sums, and its inputs' range facts.
        out_classes: the class of each of the jaxpr's outputs.
        out_ranges: the range fact of each of the jaxpr's outputs.
        summed_inputs: per input, whether the jaxpr sums it (it feeds a
            ``reduce_sum``, possibly through transparent ops or calls), so a
            caller knows a square passed in is a second moment.
        statistic_outputs: per output, whether a statistics equation made it
            (in this jaxpr or in a body it calls).
        normalised_outputs: per output, whether it is a normalised activation.
        norm_runs: contiguous runs of equations (start -> end, exclusive)
            that compute a normalised activation from the activation alone:
            its statistics, its centring and the normalising multiply (see
            `_norm_runs`). The interpreter recomputes them in the backward
            pass instead of saving their float32 values.
    """

    statistics: frozenset[int]
    bounded: frozenset[int]
    call_inputs: dict[int, tuple[tuple[int, ...], tuple[bool, ...], tuple[Any, ...]]]
    out_classes: tuple[int, ...]
    out_ranges: tuple[Any, ...]
    summed_inputs: tuple[bool, ...]
    statistic_outputs: tuple[bool, ...] = ()
    normalised_outputs: tuple[bool, ...] = ()
    norm_runs: dict[int, int] = dataclasses.field(default_factory=dict)


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def plan_statistics(
    jaxpr: Any,
    in_classes: Sequence[int] | None = None,
    summed_outputs: Sequence[bool] | None = None,
    in_ranges: Sequence[Any] | None = None,
) -> StatisticsPlan:
    """The statistics plan of an open `jaxpr`.

    Args:
        jaxpr: an open jaxpr.
        in_classes: one class per input (``OTHER`` for all when None).
        summed_outputs: per output, whether the caller sums it (none when None).
        in_ranges: one range fact per input (none known when None).

    Returns:
        The plan (memoised per jaxpr and arguments).
    """
    key = (
        tuple(in_classes) if in_classes is not None else (OTHER,) * len(jaxpr.invars),
        tuple(summed_outputs) if summed_outputs is not None else (False,) * len(jaxpr.outvars),
        tuple(in_ranges) if in_ranges is not None else (None,) * len(jaxpr.invars),
    )
    return memoised_per_jaxpr(_PLANS, jaxpr, key, lambda: _plan(jaxpr, *key))


def _size(var: Any) -> int:
    return int(np.prod(getattr(var.aval, "shape", ()), dtype=np.int64))


def _plan(
    jaxpr: Any,
    in_classes: tuple[int, ...],
    summed_outputs: tuple[bool, ...],
    in_ranges: tuple[Any, ...],
) -> StatisticsPlan:
    cls: dict[Any, int] = dict(zip(jaxpr.invars, in_classes))
    ranges: dict[Any, Any] = dict(zip(jaxpr.invars, _ranges.resolve_inputs(in_ranges, jaxpr.invars)))
    bounded: set[int] = set()
    # Variables known to equal an earlier one (see `_ranges.aliases`).
    alias: dict[Any, Any] = {}
    # Values broadcast from fewer elements: per-feature parameters, not activations.
    per_feature: set[Any] = set()
    statistics: set[int] = set()
    call_inputs: dict[int, tuple[tuple[int, ...], tuple[bool, ...], tuple[Any, ...]]] = {}
    # Variables some equation (or the caller) sums.
    summed: set[Any] = {v for v, s in zip(jaxpr.outvars, summed_outputs) if s and not isinstance(v, _compat.Literal)}
    call_summed: dict[int, tuple[bool, ...]] = {}
    squares: dict[Any, int] = {}  # output of a square -> its equation's index
    # Equations whose result is a normalised activation (a call's too), and
    # the variables statistics equations made (in calls' bodies too).
    normalised: set[int] = set()
    made_by_statistics: set[Any] = set()

    # Closed-over scalars are constants like literals; closed-over arrays may
    # be data (running statistics captured by an inference function).
    constvars = {v for v in jaxpr.constvars if _size(v) <= 1}

    def of(v: Any) -> int:
        if isinstance(v, _compat.Literal):
            return CONSTANT
        return cls.get(v, CONSTANT if v in constvars else OTHER)

    def range_of(v: Any) -> Any:
        if isinstance(v, _compat.Literal):
            return _ranges.literal_fact(v.val)
        return ranges.get(v)

    bodies = [_compat.call_body(eqn) for eqn in jaxpr.eqns]
    # Walk backwards first to know which variables end up summed: a square
    # is a second moment only if it is summed.
    for i in reversed(range(len(jaxpr.eqns))):
        eqn, body = jaxpr.eqns[i], bodies[i]
        name = eqn.primitive.name
        if name == "reduce_sum" or (name in _TRANSPARENT and any(o in summed for o in eqn.outvars)):
            summed.update(v for v in eqn.invars if not isinstance(v, _compat.Literal))
        elif body is not None:
            call_summed[i] = tuple(o in summed for o in eqn.outvars)
            # Which inputs a body sums does not depend on their classes.
            inner = plan_statistics(body, None, call_summed[i])
            summed.update(
                v for v, s in zip(eqn.invars, inner.summed_inputs) if s and not isinstance(v, _compat.Literal)
            )

    for i, (eqn, body) in enumerate(zip(jaxpr.eqns, bodies)):
        name = eqn.primitive.name
        ins = [of(v) for v in eqn.invars]
        outs = [OTHER] * len(eqn.outvars)
        facts = [range_of(v) for v in eqn.invars]
        operands = [alias.get(v, v) if not isinstance(v, _compat.Literal) else v for v in eqn.invars]
        alias.update((eqn.outvars[o], operands[k]) for o, k in _ranges.aliases(eqn, body).items())
        if body is None and len(eqn.outvars) == 1:
            ranges[eqn.outvars[0]] = _ranges.transfer(eqn, operands, facts)
            if _ranges.bounded(eqn, facts):
                bounded.add(i)
        if body is not None:
            call_inputs[i] = (tuple(ins), call_summed[i], _ranges.enter_call(facts, operands))
            inner = plan_statistics(body, *call_inputs[i])
            outs = list(inner.out_classes)
            out_facts = _ranges.leave_call(inner.out_ranges, body.invars, operands, facts)
            ranges.update(zip(eqn.outvars, out_facts))
            made_by_statistics.update(v for v, s in zip(eqn.outvars, inner.statistic_outputs) if s)
            if any(inner.normalised_outputs):
                normalised.add(i)
        elif name == "reduce_sum":
            outs = [MOMENT]
        elif name in _TRANSPARENT and len(ins) == 1:
            outs = [ins[0]]
            (source,) = eqn.invars
            if isinstance(source, _compat.Literal):
                pass
            elif source in per_feature or (name == "broadcast_in_dim" and _size(source) < _size(eqn.outvars[0])):
                per_feature.add(eqn.outvars[0])
        elif name == "rsqrt" and ins[0] != CONSTANT:
            # Of a variance, or of a running variance at inference; but not
            # attention's rsqrt(head_dim), a constant.
            outs = [NORMALISER]
        elif name == "sqrt" and ins[0] == MOMENT:
            outs = [NORMALISER]
        elif name in ("square", "integer_pow") and (name == "square" or eqn.params.get("y") == 2):
            outs = [MOMENT] if ins[0] == MOMENT else [OTHER]
            if ins[0] != MOMENT:
                squares[eqn.outvars[0]] = i
        elif name in _ARITHMETIC:
            outs = [_arithmetic(name, eqn, ins, per_feature, statistics, i, squares)]
            if i in statistics:
                made_by_statistics.update(eqn.outvars)
                if name in ("mul", "div") and outs[0] == OTHER:
                    normalised.add(i)
        for v, c in zip(eqn.outvars, outs):
            cls[v] = c

    statistics.update(i for v, i in squares.items() if v in summed)
    made_by_statistics.update(v for v, i in squares.items() if v in summed)
    normalised_vars = {v for i in normalised for v in jaxpr.eqns[i].outvars}
    return StatisticsPlan(
        statistics=frozenset(statistics),
        bounded=frozenset(bounded),
        call_inputs=call_inputs,
        out_classes=tuple(of(v) for v in jaxpr.outvars),
        out_ranges=tuple(range_of(v) for v in jaxpr.outvars),
        summed_inputs=tuple(v in summed for v in jaxpr.invars),
        statistic_outputs=tuple(not isinstance(v, _compat.Literal) and v in made_by_statistics for v in jaxpr.outvars),
        normalised_outputs=tuple(not isinstance(v, _compat.Literal) and v in normalised_vars for v in jaxpr.outvars),
        norm_runs=_norm_runs(jaxpr, cls, made_by_statistics, normalised, per_feature),
    )


def _norm_runs(
    jaxpr: Any,
    cls: dict[Any, int],
    made_by_statistics: set[Any],
    normalised: set[int],
    per_feature: set[Any],
) -> dict[int, int]:
    """Runs of equations from a norm's first statistic to its normalised result.

    For each normalising equation, the equations it depends on through
    statistics (centred values, summed squares), moments and normalisers,
    back to the activation and the parameters (values of class ``OTHER``
    that no statistics equation made), span a contiguous run up to it. The
    run goes on through the layer's affine part (``* scale + bias``, done
    after normalising, as hand-written norms do): equations that combine the
    normalised value with per-feature values only, and those preparing such
    values, so the scale's gradient recomputes the normalised value instead
    of saving it in float32.

    A run holding a matmul or a side effect is dropped, not shortened:
    recomputing part of a norm from statistics computed outside it could
    mix an unrounded activation with its rounded copy (see
    `jaxamp.transform._interpreter._evaluate_recomputed`). Overlapping runs
    (a norm normalising twice) are merged.
    """
    if not normalised:
        return {}
    eqns = jaxpr.eqns
    producer = {v: i for i, eqn in enumerate(eqns) for v in eqn.outvars}

    def heavy(k: int) -> bool:
        return holds_matmul(eqns[k]) or bool(eqns[k].effects)

    spans = []
    for last in sorted(normalised):
        needed, stack = {last}, [last]
        while stack:
            for v in eqns[stack.pop()].invars:
                k = None if isinstance(v, _compat.Literal) else producer.get(v)
                if k is None or k in needed:
                    continue
                if v in made_by_statistics or cls.get(v) in (MOMENT, NORMALISER):
                    needed.add(k)
                    stack.append(k)
        first = min(needed)
        if any(heavy(k) for k in range(first, last + 1)):
            continue
        end = _affine_end(eqns, last, per_feature)
        # A lone equation gains nothing: the body of `jnp.multiply`, or a
        # call to a whole norm (its body has the run).
        if end - first > 1:
            spans.append((first, end))
    return merge_runs(spans)


def _is_affine(eqn: Any) -> bool:
    """Whether `eqn` can be part of a norm's affine part: `_AFFINE` ops, or a call of only those."""
    body = _compat.call_body(eqn)
    if body is None:
        return eqn.primitive.name in _AFFINE
    return all(_is_affine(inner) for inner in body.eqns)


def _affine_end(eqns: Sequence[Any], last: int, per_feature: set[Any]) -> int:
    """Where a norm's run ends: after `last` and the affine equations that follow it.

    Affine equations (`_is_affine`) hold no matmul and no side effect.
    """
    normalised = set(eqns[last].outvars)
    size = max(_size(v) for v in normalised)
    end = last + 1
    for k in range(last + 1, len(eqns)):
        eqn = eqns[k]
        if not _is_affine(eqn):
            break
        operands = [v for v in eqn.invars if not isinstance(v, _compat.Literal)]
        if not any(v in normalised for v in operands):
            if all(_size(o) < size for o in eqn.outvars):
                continue  # preparing a parameter (a reshape of the scale)
            break
        if not all(v in normalised or v in per_feature or _size(v) < size for v in operands):
            break
        normalised.update(eqn.outvars)
        end = k + 1
    return end


def _arithmetic(name, eqn, ins, per_feature, statistics, index, squares) -> int:
    known = [c for c in ins if c != CONSTANT]
    if all(c == MOMENT for c in known):
        return MOMENT if known else CONSTANT
    if all(c in (MOMENT, NORMALISER) for c in known):
        return NORMALISER
    if len(ins) != 2:
        return OTHER
    (a, b), (va, vb) = ins, eqn.invars
    if name == "sub" and {a, b} == {MOMENT, OTHER}:
        statistics.add(index)  # centring: x - mean
        return OTHER
    if name in ("mul", "div") and NORMALISER in (a, b):
        other_var = vb if a == NORMALISER else va
        if name == "div" and b != NORMALISER:
            return OTHER  # a normaliser divided by an activation: not a norm
        statistics.add(index)
        # rsqrt(var) * scale stays a normaliser; x * rsqrt(var) is normalised.
        # Broadcast from fewer elements, explicitly or by lax's size-1 dims.
        per_feature_other = isinstance(other_var, _compat.Literal) or (
            other_var in per_feature or _size(other_var) < _size(eqn.outvars[0])
        )
        return NORMALISER if per_feature_other else OTHER
    if name == "mul" and va is vb and a == OTHER:
        squares[eqn.outvars[0]] = index  # x * x
    return OTHER
