"""The monitor's program walk: re-emit a traced step with its statistics as extra outputs.

The step (typically ``jax.value_and_grad`` of an amp'd loss, optimizer update
and all) is traced to a jaxpr; its backward pass is ordinary equations there,
which JAX's transpose marked in their name stacks (``transpose(jvp(scope))``).
This walk re-emits every equation unchanged and, beside it, measures
(`_measure.measure`) each operand and result of a low-precision matmul or
convolution and each value a named scope hands on, forward and backward.

Higher-order equations are re-emitted with their bodies walked and the
bodies' measurements as extra outputs, combined where the body runs more than
once: a scan's per-iteration vectors come out stacked and are reduced, a while
loop carries an accumulator, a cond's branches return zeros for the others'
sites, a `shard_map` stacks its devices' vectors. Recomputations in a backward
pass (``rematted_computation``) are not measured again.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from .. import _compat
from .._jaxpr import MATMUL_NAMES, holds_matmul, matmul_name, source_label
from ._measure import NUM_MAX_FIELDS, combine, is_low_precision, measure

__all__ = ["Site", "walk"]

_RECOMPUTE = "rematted_computation"  # JAX's scope around a remat's recomputation


@dataclasses.dataclass(frozen=True)
class Site:
    """One measured place in the program.

    Attributes:
        direction: ``"forward"`` (values) or ``"backward"`` (cotangents).
        scope: the `jax.named_scope` path (``"block_0/attn"``), or the user
            line (``"model.py:12 (loss)"``) of an equation outside any scope.
        name: what is measured there: ``"dot_general[0].lhs"`` (``.rhs``,
            ``.out``, except for a float8 matmul, whose product is in scaled
            units; numbered in program order within the scope and
            direction), or ``"output[k]"`` for the k-th value the scope hands on.
        dtype: the dtype the value is stored in (underflow and headroom are
            relative to it).
        fp8: the value is a float8 matmul operand (``source_amax`` and
            ``scale`` are measured).
        handed_in: the value is a matmul operand another scope made (and
            handed on): the report and `suggest_policy` judge a scope by
            the values it makes, so an operand is its maker's doing.
    """

    direction: str
    scope: str
    name: str
    dtype: str
    fp8: bool = False
    handed_in: bool = False

    @property
    def kind(self) -> str:
        """``"matmul"`` or ``"boundary"``."""
        return "boundary" if self.name.startswith("output[") else "matmul"


@dataclasses.dataclass(frozen=True)
class _Context:
    scopes: tuple[str, ...] = ()
    backward: bool = False
    recompute: bool = False
    call_sites: tuple[Any, ...] = ()


class _Walk:
    """State shared by one walk of a program: options and site numbering."""

    def __init__(self, headroom_bits: float):
        self.headroom_bits = headroom_bits
        self.counters: dict[tuple, int] = {}

    def number(self, direction: str, scope: str, base: str) -> int:
        key = (direction, scope, base)
        self.counters[key] = self.counters.get(key, -1) + 1
        return self.counters[key]


Taps = list  # [(Site, vector)]


def walk(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], headroom_bits: float) -> tuple[list, Taps]:
    """Evaluate `jaxpr` on `args`, measuring as it goes: ``(outputs, [(Site, vector)])``."""
    return _run(_Walk(headroom_bits), jaxpr, consts, args, _Context())


def _run(state: _Walk, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], ctx: _Context) -> tuple[list, Taps]:
    env: dict[Any, Any] = {}
    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    paths = [ctx.scopes + _compat.eqn_scopes(eqn) for eqn in jaxpr.eqns]
    producers = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    made_in = {v: _user_scopes(path) for eqn, path in zip(jaxpr.eqns, paths) for v in eqn.outvars}
    handed_on = _handed_on(jaxpr, made_in, paths, ctx.scopes)
    constant = _constant_values(jaxpr)
    taps: Taps = []

    def read(v):
        return v.val if isinstance(v, _compat.Literal) else env[v]

    for eqn, path in zip(jaxpr.eqns, paths):
        backward = ctx.backward or _compat.eqn_transposed(eqn)
        recompute = ctx.recompute or (backward and _RECOMPUTE in path)
        path = _user_scopes(path)
        direction = "backward" if backward else "forward"
        invals = [read(v) for v in eqn.invars]
        handler = _HANDLERS.get(eqn.primitive)
        # fp8's per-device product on an Auto mesh quantises inside: its
        # sites are its compute-dtype operands and its result.
        matmul = matmul_name(eqn)
        if handler is None and holds_matmul(eqn) and matmul not in MATMUL_NAMES:
            handler = _opaque  # a Pallas kernel...: bound as is, said once
        if handler is not None:
            nested = _Context(path, backward, recompute, ctx.call_sites + (eqn,))
            outvals, inner = handler(state, nested, eqn, invals)
            taps += inner
        else:
            outvals = _unchanged(eqn, invals)
        for v, x in zip(eqn.outvars, outvals, strict=True):
            if not isinstance(v, _compat.DropVar):
                env[v] = x
        if recompute:
            continue
        scope = "/".join(path) or source_label(eqn, ctx.call_sites) or eqn.primitive.name
        measured = set()
        if matmul in MATMUL_NAMES and any(is_low_precision(x.dtype) for x in invals[:2]):
            k = state.number(direction, scope, matmul)
            named = [(eqn.invars[0], "lhs"), (eqn.invars[1], "rhs"), (eqn.outvars[0], "out")]
            if any(str(x.dtype).startswith("float8") for x in invals[:2]):
                # A float8 product is in the operands' scaled units until it is
                # rescaled: its value is the one the scope hands on.
                named = named[:2]
            for v, role in named:
                source = _fp8_source(v, producers, read)
                name = f"{matmul}[{k}].{role}"
                made = made_in.get(v) if not isinstance(v, _compat.Literal) else None
                handed_in = made is not None and made[: len(path)] != path
                site = Site(direction, scope, name, np.dtype(v.aval.dtype).name, source is not None, handed_in)
                taps.append((site, _measure_var(state, v, producers, constant, read, source)))
                if not isinstance(v, _compat.Literal):
                    measured.add(v)
        for v in eqn.outvars:
            # (A constant handed on, a where's fill value, is the program's, not a numerics risk.)
            if v in handed_on and v not in measured and v not in constant:
                k = state.number(direction, scope, "output")
                site = Site(direction, scope, f"output[{k}]", np.dtype(v.aval.dtype).name)
                taps.append((site, _measure_var(state, v, producers, constant, read)))
    return [read(v) for v in jaxpr.outvars], taps


def _user_scopes(path: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(s for s in path if s != _RECOMPUTE)


def _is_floating(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _handed_on(jaxpr: Any, made_in: dict, paths: list[tuple[str, ...]], outer: tuple[str, ...]) -> set:
    """Floating values made inside a named scope (deeper than `outer`) and read outside it (or returned)."""
    handed = set()
    readers = [(eqn.invars, _user_scopes(p)) for eqn, p in zip(jaxpr.eqns, paths)]
    readers.append((jaxpr.outvars, outer))
    for invars, path in readers:
        for v in invars:
            made = made_in.get(v) if not isinstance(v, _compat.Literal) else None
            if made is not None and len(made) > len(outer) and path[: len(made)] != made and _is_floating(v.aval):
                handed.add(v)
    return handed


def _constant_values(jaxpr: Any) -> set:
    """The variables of `jaxpr` computed from constants alone (no input, no effect)."""
    constant = set(jaxpr.constvars)
    for eqn in jaxpr.eqns:
        if not eqn.effects and all(isinstance(v, _compat.Literal) or v in constant for v in eqn.invars):
            constant.update(eqn.outvars)
    return constant


def _measure_var(state: _Walk, v: Any, producers: dict, constant: set, read, source: tuple | None = None) -> Any:
    """`measure` of the value of `v`, from the smaller value it was broadcast from if it was.

    A broadcast's statistics are its operand's, counts multiplied: cheaper, and
    XLA would otherwise constant-fold the reduction of a broadcast constant
    (the backward pass's seed of ones, zeros) element by element at compile
    time, which takes seconds for an activation-sized one. Any other value
    made of constants alone is measured behind an optimization barrier, for
    the same reason.
    """
    v = _before_pvary(v, producers)
    eqn = producers.get(v) if not isinstance(v, _compat.Literal) else None
    copies = 1
    while eqn is not None and eqn.primitive.name == "broadcast_in_dim":
        operand = eqn.invars[0]
        copies *= int(np.prod(v.aval.shape)) // max(int(np.prod(getattr(operand.aval, "shape", ()))), 1)
        v = operand
        eqn = producers.get(v) if not isinstance(v, _compat.Literal) else None
    x = jnp.asarray(read(v), v.aval.dtype)
    if x.size > 1 and not isinstance(v, _compat.Literal) and v in constant:
        x = jax.lax.optimization_barrier(x)
    vector = measure(x, state.headroom_bits, *(source or ()))
    if copies > 1:
        vector = vector.at[NUM_MAX_FIELDS:].multiply(np.float32(copies))
    return vector


def _before_pvary(v: Any, producers: dict) -> Any:
    """The value `v` was made device-varying from (JAX adds a ``pvary`` before a
    replicated weight meets a batch-sharded activation), or `v`: a copy per
    device is one value, not one per device (see `_per_device`)."""
    eqn = producers.get(v) if not isinstance(v, _compat.Literal) else None
    while eqn is not None and eqn.primitive.name in ("pvary", "pcast") and len(eqn.invars) == 1:
        v = eqn.invars[0]
        eqn = producers.get(v) if not isinstance(v, _compat.Literal) else None
    return v


def _fp8_source(v: Any, producers: dict, read) -> tuple[Any, Any] | None:
    """``(value quantised, scale)`` behind a float8 operand, when this body quantised it.

    Follows jaxamp's quantiser (`jaxamp.fp8._quantize`): convert to float8 of
    a select between the value and ``clamp(value / scale)``.
    """
    if isinstance(v, _compat.Literal) or not str(v.aval.dtype).startswith("float8"):
        return None
    chain = producers.get(v)
    if chain is None or chain.primitive.name != "convert_element_type":
        return None
    chosen = producers.get(chain.invars[0])
    candidates = chosen.invars[1:] if chosen is not None and chosen.primitive.name == "select_n" else [chain.invars[0]]
    for candidate in candidates:
        clamp = producers.get(candidate)
        if clamp is None or clamp.primitive.name != "clamp":
            continue
        divide = producers.get(clamp.invars[1])
        if divide is not None and divide.primitive.name == "div":
            return read(divide.invars[0]), read(divide.invars[1])
    return None


# --- higher-order equations --------------------------------------------------------


def _walked(state: _Walk, ctx: _Context, jaxpr: Any, consts: Sequence[Any], sites: list, each=None):
    """A body function running `jaxpr` walked: its outputs, then its vectors
    (through `each` when given); the vectors' sites go into `sites` when JAX traces it."""

    def body(*args):
        outs, taps = _run(state, jaxpr, consts, args, ctx)
        sites[:] = [s for s, _ in taps]
        return [*outs, *(x if each is None else each(x) for _, x in taps)]

    return body


def _trace_body(state: _Walk, ctx: _Context, jaxpr: Any, consts: Sequence[Any], avals: Sequence[Any]):
    """`jaxpr` walked and traced: a closed jaxpr returning its outputs then its
    vectors, and the vectors' sites."""
    sites: list = []
    return _compat.trace_to_closed_jaxpr(_walked(state, ctx, jaxpr, consts, sites), avals), sites


def _split(outs: Sequence[Any], count: int, sites: list) -> tuple[list, Taps]:
    return list(outs[:count]), list(zip(sites, outs[count:]))


def _call(param: str):
    def handler(state, ctx, eqn, invals):
        closed = eqn.params[param]
        traced, sites = _trace_body(state, ctx, closed.jaxpr, closed.consts, closed.in_avals)
        count = len(closed.out_avals)
        if eqn.primitive is _compat.jit_p:
            params = _compat.jit_params_with_extra_outputs(eqn.params, traced, len(sites))
        else:
            params = dict(eqn.params, **{param: traced})
        with _compat.eqn_source(eqn):
            outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
        return _split(outs, count, sites)

    return handler


def _inline(param: str):
    # A custom_jvp/custom_vjp function, or a linear_call (fp8 mode's gradient
    # matmuls), in a program that is not differentiated further (`monitor`
    # refuses to be): the body it calls is what runs.
    def handler(state, ctx, eqn, invals):
        closed = eqn.params[param]
        return _run(state, closed.jaxpr, closed.consts, invals, ctx)

    return handler


def _remat(state, ctx, eqn, invals):
    jaxpr = eqn.params["jaxpr"]
    sites: list = []
    body = _walked(state, ctx, jaxpr, (), sites)
    traced, consts = _compat.trace_to_jaxpr_with_consts_as_inputs(body, [v.aval for v in jaxpr.invars])
    with _compat.eqn_source(eqn):
        outs = _compat.remat_p.bind(*consts, *invals, **dict(eqn.params, jaxpr=traced.jaxpr))
    return _split(outs, len(jaxpr.outvars), sites)


def _scan(state, ctx, eqn, invals):
    params = eqn.params
    closed = params["jaxpr"]
    num_consts, num_carry = _compat.scan_layout(params)
    traced, sites = _trace_body(state, ctx, closed.jaxpr, closed.consts, closed.in_avals)
    if not sites:
        return _unchanged(eqn, invals), []
    consts, init = invals[:num_consts], invals[num_consts : num_consts + num_carry]
    xs = invals[num_consts + num_carry :]
    count = len(closed.out_avals)

    def body(carry, x):
        outs = _compat.jaxpr_as_fun(traced)(*consts, *carry, *x)
        return outs[:num_carry], (outs[num_carry:count], outs[count:])

    with _compat.eqn_source(eqn):
        carry, (ys, stacked) = jax.lax.scan(
            body, list(init), list(xs), length=params["length"], reverse=params["reverse"], unroll=params["unroll"]
        )
    return [*carry, *ys], [(site, combine(x)) for site, x in zip(sites, stacked)]


def _while(state, ctx, eqn, invals):
    params = eqn.params
    cond_closed, body_closed = params["cond_jaxpr"], params["body_jaxpr"]
    cond_n, body_n = params["cond_nconsts"], params["body_nconsts"]
    traced, sites = _trace_body(state, ctx, body_closed.jaxpr, body_closed.consts, body_closed.in_avals)
    if not sites:
        return _unchanged(eqn, invals), []
    cond_consts, body_consts, init = invals[:cond_n], invals[cond_n : cond_n + body_n], invals[cond_n + body_n :]
    count = len(init)

    def cond(state):
        return _compat.jaxpr_as_fun(cond_closed)(*cond_consts, *state[0])[0]

    def body(state):
        carry, totals = state
        outs = _compat.jaxpr_as_fun(traced)(*body_consts, *carry)
        totals = [combine(jnp.stack([t, x])) for t, x in zip(totals, outs[count:])]
        return outs[:count], totals

    # Accumulators typed as the body leaves them (varying axes included).
    zeros = [_compat.zeros_like_aval(a) for a in traced.out_avals[count:]]
    with _compat.eqn_source(eqn):
        carry, totals = jax.lax.while_loop(cond, body, (list(init), zeros))
    return list(carry), list(zip(sites, totals))


def _cond(state, ctx, eqn, invals):
    index, ops = invals[0], invals[1:]
    branches = eqn.params["branches"]
    traced = [_trace_body(state, ctx, b.jaxpr, b.consts, b.in_avals) for b in branches]
    all_sites = [s for _, sites in traced for s in sites]
    if not all_sites:
        return _unchanged(eqn, invals), []
    count = len(eqn.outvars)
    extra_avals = [a for t, _ in traced for a in t.out_avals[count:]]

    def branch(i):
        def run(*operands):
            outs = _compat.jaxpr_as_fun(traced[i][0])(*operands)
            vectors = [_compat.zeros_like_aval(a) for a in extra_avals]
            start = sum(len(s) for _, s in traced[:i])
            vectors[start : start + len(traced[i][1])] = outs[count:]
            return [*outs[:count], *vectors]

        return run

    with _compat.eqn_source(eqn):
        outs = jax.lax.switch(index, [branch(i) for i in range(len(branches))], *ops)
    return _split(outs, count, all_sites)


def _shard_map(state, ctx, eqn, invals):
    axes = _compat.shard_map_mesh_axes(eqn.params)
    names = tuple(name for name, _ in axes)
    jaxpr = eqn.params["jaxpr"]
    sites: list = []
    count = len(jaxpr.outvars)
    body = _walked(state, ctx, jaxpr, (), sites, each=lambda x: _per_device(x, axes))
    spec = PartitionSpec(names)
    params = _compat.shard_map_body(eqn.params, body, extra_out_specs=lambda: [spec] * len(sites))
    with _compat.eqn_source(eqn):
        outs = list(_compat.shard_map_p.bind(*invals, **params))
    return list(outs[:count]), [(site, combine(x)) for site, x in zip(sites, outs[count:])]


def _per_device(vector: Any, axes: tuple[tuple[Any, int], ...]) -> Any:
    """A device's vector as one row of the stack over `axes`; counts of a value
    replicated over some of them divided among its copies."""
    if _compat.tracks_varying_axes():
        varying = _compat.varying_axes(vector)
        copies = int(np.prod([size for name, size in axes if name not in varying]))
        if copies > 1:
            vector = vector.at[NUM_MAX_FIELDS:].divide(np.float32(copies))
    return _compat.mark_varying(vector, [name for name, _ in axes])[None]


def _unchanged(eqn: Any, invals: list) -> list:
    with _compat.eqn_source(eqn):
        outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(outs) if eqn.primitive.multiple_results else [outs]


_warned: set[str] = set()


def _opaque(state, ctx, eqn, invals):
    name = eqn.primitive.name
    if name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"jaxamp.monitoring.monitor does not look inside {name!r} equations: the matmuls in their "
            "bodies are not measured (their results still are where a named scope hands them "
            "on).",
            RuntimeWarning,
            stacklevel=4,
        )
    return _unchanged(eqn, invals), []


_HANDLERS = {
    _compat.jit_p: _call("jaxpr"),
    _compat.closed_call_p: _call("call_jaxpr"),
    _compat.remat_p: _remat,
    _compat.scan_p: _scan,
    _compat.while_p: _while,
    _compat.cond_p: _cond,
    _compat.custom_jvp_call_p: _inline("call_jaxpr"),
    _compat.custom_vjp_call_p: _inline("call_jaxpr"),
    _compat.linear_call_p: _inline("callee"),
    _compat.shard_map_p: _shard_map,
}
