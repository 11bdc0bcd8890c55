"""Handlers for higher-order primitives: one per primitive, in a registry.

A handler interprets its primitive's bodies with the amp loop under the same
policy and the same active scopes, then re-binds the primitive with its own
parameters kept (shardings, donation, remat policy, scan length/unroll, the
custom derivative rules). Loops and conds need their carries and branch outputs
type-stable, so their handlers settle dtypes before binding.

Each handler registers itself with `_interpreter.register` on import
(``handler(ctx, eqn, invals) -> list of outputs``; `ctx` is already the nested
context, scopes of `eqn` included).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .._casting import cast_value, dtype_of
from .._dtypes import is_castable
from . import _site_state
from ._interpreter import AmpContext, Handler, interpret, register
from ._linearity import context_key, tangents_of

__all__: list[str] = []  # handlers register themselves; nothing to import


# --- helpers -----------------------------------------------------------------


def _avals_like(original_avals: Sequence[Any], values: Sequence[Any]) -> list:
    # The body's own view of its inputs (shape, sharding, varying axes) with the
    # dtype amp currently holds: loop bodies see per-iteration slices, shard_map
    # bodies per-shard blocks, which the operands' own avals would not give.
    return [_compat.with_dtype(a, dtype_of(v)) for a, v in zip(original_avals, values)]


def _amp_body(jaxpr: Any, consts: Sequence[Any], ctx: AmpContext, out_dtypes: Sequence[Any] | None = None) -> Callable:
    """A flat function running `jaxpr` under amp, optionally casting its outputs."""

    def body(*args):
        outs = interpret(jaxpr, consts, args, ctx)
        return outs if out_dtypes is None else _cast_all(outs, out_dtypes)

    return body


def _cast_all(values: Sequence[Any], dtypes: Sequence[Any]) -> list:
    return [cast_value(x, d) for x, d in zip(values, dtypes)]


def _out_dtypes(closed: Any) -> list:
    return [a.dtype for a in closed.out_avals]


def _threads_site_state() -> bool:
    state = _site_state.active()
    return state is not None and not state.paused


# --- calls: jit, closed_call, remat ----------------------------------------------


# amp'd bodies of call-like jaxprs, per original jaxpr. The same jit'd function
# called in every layer has one jaxpr; handing JAX one amp'd jaxpr for it too
# keeps JAX's own per-jaxpr caches (JVP, transpose, lowering) hitting, which
# is most of the cost of tracing a deep model.
_AMP_BODIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _amp_closed_jaxpr(ctx: AmpContext, closed: Any, invals: list) -> Any:
    """`closed` re-traced under amp for operands as amp holds them.

    A body whose sites take values of a call's state (`_site_state`) closes
    over them: it is never shared, and its constants hold them (see `_call_handler`).
    """
    cacheable = ctx.observer is None and not ctx.inline
    # The policy is a `PolicyTable` snapshot, hashed by its contents, so a
    # table edited between calls never serves a body rewritten under the old one.
    # The body's statistics plan depends on its operands' classes at this call.
    # The operands' dtypes stand for the avals traced with (`_avals_like` of
    # the body's own avals and these dtypes), built only on a miss.
    statistics = ctx.statistics_inputs[1] if ctx.statistics_inputs is not None else None
    dtypes = tuple([dtype_of(v) for v in invals])
    # Rules tell first derivatives from higher ones only (`differentiation_depth`).
    higher_order = ctx.differentiated >= 2
    # Where sites take no values (`_site_state.paused`), rules rewrite them otherwise.
    paused = bool(_site_state.pause_reason())
    # Which of its equations are the program's tail depends on the call site.
    # So do the program's last matmuls: a layer shared by every layer holds the head at one call.
    tail = (
        ctx.tail,
        ctx.tail_inside[1] if ctx.tail_inside is not None else None,
        ctx.last_matmuls_inside[1] if ctx.last_matmuls_inside is not None else None,
    )
    # Which of its operands the program widened from half precision (`jaxamp.analyses._upcasts`).
    upcasts = ctx.upcasts_inside[1] if ctx.upcasts_inside is not None else None
    # Inside a custom_jvp rule: which of its operands are tangents, cast without saturating.
    tangents = context_key()
    key = (
        dtypes,
        ctx.compute_dtype,
        ctx.policy,
        ctx.scopes,
        statistics,
        ctx.recompute,
        higher_order,
        paused,
        tail,
        upcasts,
        tangents,
    )
    if cacheable:
        try:
            return _AMP_BODIES[closed][key]
        except (KeyError, TypeError):
            pass
    state = _site_state.active()
    start = state.position if state is not None else 0
    around = ctx.around_custom_vjp
    around_calls = around.calls if around is not None else 0
    body = _amp_body(closed.jaxpr, closed.consts, ctx)
    new = _compat.trace_to_closed_jaxpr(body, _avals_like(closed.in_avals, invals))
    # A body that closed over a value of this call (a site state's, a loss
    # scale's) holds it as a constant: it serves this call alone.
    closes_over_call = (state is not None and state.position != start) or (
        around is not None and around.calls != around_calls
    )
    if cacheable and not closes_over_call:
        try:
            _AMP_BODIES.setdefault(closed, {})[key] = new
        except TypeError:  # an unhashable or non-weakrefable jaxpr: no caching
            pass
    return new


def _call_handler(primitive: Any, jaxpr_param: str) -> Handler:
    """Handler for a call-like primitive whose body is the closed jaxpr `jaxpr_param`."""

    def handler(ctx: AmpContext, eqn: Any, invals: list) -> Sequence[Any]:
        closed = eqn.params[jaxpr_param]
        if ctx.inline:
            return interpret(closed.jaxpr, closed.consts, invals, ctx)
        new = _amp_closed_jaxpr(ctx, closed, invals)
        if any(isinstance(c, jax.core.Tracer) for c in new.consts):
            # Values of the caller's trace (a site state's): passed in as
            # inputs, since a closed jaxpr's constants are not differentiated
            # (the state's gradient, its update, would be lost).
            new, hoisted = _compat.consts_as_inputs(new)
            params = _compat.call_params_with_extra_inputs(primitive, eqn.params, new, len(hoisted))
            return primitive.bind(*hoisted, *invals, **primitive.get_bind_params(params))
        params = dict(eqn.params, **{jaxpr_param: new})
        return primitive.bind(*invals, **primitive.get_bind_params(params))

    return handler


register(_compat.jit_p)(_call_handler(_compat.jit_p, "jaxpr"))
register(_compat.closed_call_p)(_call_handler(_compat.closed_call_p, "call_jaxpr"))


@register(_compat.remat_p)
def _remat(ctx: AmpContext, eqn: Any, invals: list) -> Sequence[Any]:
    jaxpr = eqn.params["jaxpr"]
    if ctx.inline:
        return interpret(jaxpr, (), invals, ctx)
    body = _amp_body(jaxpr, (), ctx)
    in_avals = _avals_like([v.aval for v in jaxpr.invars], invals)
    new, consts = _compat.trace_to_jaxpr_with_consts_as_inputs(body, in_avals)
    return _compat.remat_p.bind(*consts, *invals, **dict(eqn.params, jaxpr=new.jaxpr))


# --- loops: scan, while ------------------------------------------------------------


def _settle_carry(
    trace: Callable[[list, list | None], Any],
    carry_dtypes: list,
    original_dtypes: list,
    num_carry: int,
) -> tuple[Any, list]:
    """Choose carry dtypes that a loop body maps to themselves.

    First the dtypes the carry arrives in; where the body changes one (a float32
    hidden state that leaves a matmul in compute dtype), the dtype it leaves in,
    so the loop runs in compute dtype as hand-cast code would; where that is not
    stable either, the original dtype, with the body's result cast back to it.

    Args:
        trace: ``trace(carry_dtypes, cast_carry_out_to)`` traces the body.
    Returns:
        The traced body and the settled carry dtypes.
    """
    dtypes = list(carry_dtypes)
    traced = trace(dtypes, None)
    for attempt in range(2):
        out = _out_dtypes(traced)[:num_carry]
        if out == dtypes:
            return traced, dtypes
        if attempt == 0:
            dtypes = [o if is_castable(o) and is_castable(d) else d for o, d in zip(out, dtypes)]
            traced = trace(dtypes, None)
    dtypes = [d if o == d else orig for o, d, orig in zip(out, dtypes, original_dtypes)]
    return trace(dtypes, dtypes), dtypes


@register(_compat.scan_p)
def _scan(ctx: AmpContext, eqn: Any, invals: list) -> Sequence[Any]:
    params = eqn.params
    closed = params["jaxpr"]
    num_consts, num_carry = _compat.scan_layout(params)
    consts = invals[:num_consts]
    init = invals[num_consts : num_consts + num_carry]
    xs = invals[num_consts + num_carry :]
    if ctx.inline:
        return _scan_inline(ctx, eqn, consts, init, xs)
    length = params["length"]
    body_ctx = ctx.repeated(length)
    in_avals = closed.in_avals
    original_carry = [a.dtype for a in in_avals[num_consts : num_consts + num_carry]]
    # With a site state, the body also takes its iteration's index (see `_site_state`).
    state = _site_state.active() if _threads_site_state() else None
    start = state.position if state is not None else 0

    def trace(carry_dtypes, cast_to):
        out_dtypes = None if cast_to is None else [*cast_to, *_out_dtypes(closed)[num_carry:]]
        carry_avals = [
            _compat.with_dtype(a, d) for a, d in zip(in_avals[num_consts : num_consts + num_carry], carry_dtypes)
        ]
        avals = [
            *_avals_like(in_avals[:num_consts], consts),
            *carry_avals,
            *_avals_like(in_avals[num_consts + num_carry :], xs),
        ]
        if state is None:
            return _trace_loop_body(closed, body_ctx, avals, out_dtypes)
        state.rewind(start)
        index = _compat.abstract_value(np.int32(0))
        return _trace_loop_body(closed, body_ctx, [*avals, index], out_dtypes, loop=(state, length))

    traced, carry_dtypes = _settle_carry(trace, [dtype_of(x) for x in init], original_carry, num_carry)
    _report(ctx, traced)
    if state is not None:
        return _scan_with_index(traced, params, consts, _cast_all(init, carry_dtypes), xs)
    new_params = _compat.scan_params_with_extra_consts(params, traced.closed, len(traced.hoisted))
    return _compat.scan_p.bind(*traced.hoisted, *consts, *_cast_all(init, carry_dtypes), *xs, **new_params)


class _Traced(NamedTuple):
    """A traced loop body: its jaxpr, the constants hoisted to leading inputs,
    and its observer events, held back because `_settle_carry` may trace a body
    up to three times and diagnostics must see the kept trace only once."""

    closed: Any
    hoisted: list
    events: list

    @property
    def out_avals(self):
        return self.closed.out_avals


def _trace_loop_body(body_jaxpr, ctx: AmpContext, avals: list, out_dtypes, loop=None) -> _Traced:
    """Trace a loop body under amp; with `loop` ``(site state, length)``, its last input is the iteration."""
    events: list = []
    if ctx.observer is not None:
        ctx = dataclasses.replace(ctx, observer=events.append)
    body = _amp_body(body_jaxpr.jaxpr, body_jaxpr.consts, ctx, out_dtypes)
    if loop is not None:
        state, length = loop
        amp_body = body

        def body(*args):
            with state.loop(args[-1], length):
                return amp_body(*args[:-1])

    return _Traced(*_compat.trace_to_jaxpr_with_consts_as_inputs(body, avals), events)


def _scan_with_index(traced: _Traced, params: dict, consts: list, init: list, xs: list) -> list:
    """The amp'd scan body run by `jax.lax.scan`, with ``arange(length)`` as its last input.

    Through the public API, not by binding ``scan_p`` with one more input:
    scan's parameters describe its inputs differently across JAX releases.
    """
    num_carry, length = len(init), params["length"]
    body = _compat.jaxpr_as_fun(traced.closed)

    def step(carry, inputs):
        x, index = inputs
        outs = body(*traced.hoisted, *consts, *carry, *x, index)
        return list(outs[:num_carry]), list(outs[num_carry:])

    iterations = jnp.arange(length, dtype=np.int32)
    carry, ys = jax.lax.scan(
        step,
        list(init),
        (list(xs), iterations),
        length=length,
        reverse=params["reverse"],
        unroll=params.get("unroll", 1),
    )
    return [*carry, *ys]


def _report(ctx: AmpContext, traced: _Traced) -> None:
    if ctx.observer is not None:
        for event in traced.events:
            ctx.observer(event)


def _scan_inline(ctx, eqn, consts, init, xs):
    params = eqn.params
    closed = params["jaxpr"]
    _, num_carry = _compat.scan_layout(params)
    length = params["length"]
    carry, ys = list(init), []
    steps = range(length - 1, -1, -1) if params["reverse"] else range(length)
    for i in steps:
        outs = interpret(closed.jaxpr, closed.consts, [*consts, *carry, *(x[i] for x in xs)], ctx)
        carry, y = outs[:num_carry], outs[num_carry:]
        ys.append(y)
    if params["reverse"]:
        ys.reverse()
    stacked = [
        jnp.stack([y[j] for y in ys]) if ys else jnp.zeros((0, *a.shape), a.dtype)
        for j, a in enumerate(closed.out_avals[num_carry:])
    ]
    return [*carry, *stacked]


@register(_compat.while_p)
def _while(ctx: AmpContext, eqn: Any, invals: list) -> Sequence[Any]:
    params = eqn.params
    cond_closed, body_closed = params["cond_jaxpr"], params["body_jaxpr"]
    cond_n, body_n = params["cond_nconsts"], params["body_nconsts"]
    cond_consts = invals[:cond_n]
    body_consts = invals[cond_n : cond_n + body_n]
    init = invals[cond_n + body_n :]
    if ctx.inline:
        carry = list(init)
        while bool(interpret(cond_closed.jaxpr, cond_closed.consts, [*cond_consts, *carry], ctx)[0]):
            carry = interpret(body_closed.jaxpr, body_closed.consts, [*body_consts, *carry], ctx)
        return carry
    body_avals = body_closed.in_avals
    original_carry = [a.dtype for a in body_avals[body_n:]]
    state = _site_state.active()
    start = state.position if state is not None else 0

    def trace(carry_dtypes, cast_to):
        avals = [
            *_avals_like(body_avals[:body_n], body_consts),
            *(_compat.with_dtype(a, d) for a, d in zip(body_avals[body_n:], carry_dtypes)),
        ]
        if state is not None:  # one value per site for every iteration (see `_site_state`)
            state.rewind(start)
        return _trace_loop_body(body_closed, ctx, avals, cast_to)

    traced, carry_dtypes = _settle_carry(trace, [dtype_of(x) for x in init], original_carry, len(init))
    _report(ctx, traced)
    cond_avals = [
        *_avals_like(cond_closed.in_avals[:cond_n], cond_consts),
        *(_compat.with_dtype(a, d) for a, d in zip(cond_closed.in_avals[cond_n:], carry_dtypes)),
    ]
    new_cond, cond_hoisted = _compat.trace_to_jaxpr_with_consts_as_inputs(
        _amp_body(cond_closed.jaxpr, cond_closed.consts, ctx), cond_avals
    )
    new_params = dict(
        params,
        cond_jaxpr=new_cond,
        body_jaxpr=traced.closed,
        cond_nconsts=cond_n + len(cond_hoisted),
        body_nconsts=body_n + len(traced.hoisted),
    )
    return _compat.while_p.bind(
        *cond_hoisted,
        *cond_consts,
        *traced.hoisted,
        *body_consts,
        *_cast_all(init, carry_dtypes),
        **new_params,
    )


# --- cond ------------------------------------------------------------------------


@register(_compat.cond_p)
def _cond(ctx: AmpContext, eqn: Any, invals: list) -> Sequence[Any]:
    branches = eqn.params["branches"]
    index, ops = invals[0], invals[1:]
    if ctx.inline:
        chosen = branches[int(min(max(int(index), 0), len(branches) - 1))]
        return interpret(chosen.jaxpr, chosen.consts, ops, ctx)
    traced = [
        _compat.trace_to_closed_jaxpr(_amp_body(b.jaxpr, b.consts, ctx), _avals_like(b.in_avals, ops)) for b in branches
    ]
    # Branches must agree on output types: where amp left them disagreeing, all
    # return the dtype the user's program had.
    original = [v.aval.dtype for v in eqn.outvars]
    per_output = zip(*(_out_dtypes(t) for t in traced))
    out_dtypes = [ds[0] if len(set(ds)) == 1 else o for ds, o in zip(per_output, original)]
    # Re-trace each amp'd branch with every branch's constants as leading
    # inputs, so all branches take the same operands.
    all_consts = [c for t in traced for c in t.consts]
    offsets = [0]
    for t in traced:
        offsets.append(offsets[-1] + len(t.consts))
    op_avals = [_compat.abstract_value(x) for x in ops]
    const_avals = [_compat.abstract_value(c) for c in all_consts]

    def joined(i, t):
        def branch(*args):
            consts, operands = args[: len(all_consts)], args[len(all_consts) :]
            outs = _compat.jaxpr_as_fun(_compat.ClosedJaxpr(t.jaxpr, consts[offsets[i] : offsets[i + 1]]))(*operands)
            return _cast_all(outs, out_dtypes)

        return _compat.trace_to_closed_jaxpr(branch, [*const_avals, *op_avals])

    new_branches = tuple(joined(i, t) for i, t in enumerate(traced))
    return _compat.cond_p.bind(index, *all_consts, *ops, **dict(eqn.params, branches=new_branches))


# --- custom derivatives -------------------------------------------------------------

# Why a custom rule's sites take no state (`_site_state.pause`): JAX traces
# and transposes its rules apart from the program, so no value can pass in.
_IN_CUSTOM_RULE = "inside a %s function, whose rules JAX traces apart from the program"


@register(_compat.custom_jvp_call_p)
def _custom_jvp(ctx: AmpContext, eqn: Any, invals: list) -> Sequence[Any]:
    params, (call_jaxpr, num_consts), jvp_jaxpr_fun = _compat.custom_jvp_subfuns(eqn.params)
    if ctx.inline:
        return interpret(call_jaxpr.jaxpr, call_jaxpr.consts, invals, ctx)
    with _site_state.paused(_IN_CUSTOM_RULE % "jax.custom_jvp"):
        primal = _amp_closed_jaxpr(ctx, call_jaxpr, invals)
    out_dtypes = _out_dtypes(primal)

    def jvp(*xs):
        # JAX's own `lift_jvp`, with the user's jvp rule interpreted under amp
        # and its outputs brought to the types of the amp'd primal.
        n = len(xs) // 2
        primals, tangents = xs[num_consts:n], xs[n + num_consts :]
        zeros = [isinstance(t, _compat.SymbolicZero) for t in tangents]
        *traced, out_zeros = jvp_jaxpr_fun.call_wrapped(*zeros)
        rule = _compat.rule_jaxpr(*traced)
        nonzero = [t for t in tangents if not isinstance(t, _compat.SymbolicZero)]
        with (
            tangents_of(rule.jaxpr, rule.jaxpr.invars[len(primals) :]),
            _site_state.paused(_IN_CUSTOM_RULE % "jax.custom_jvp"),
        ):
            out = interpret(rule.jaxpr, rule.consts, [*primals, *nonzero], ctx)
        out_primals = _cast_all(out[: len(out_zeros)], out_dtypes)
        nonzero_out = iter(out[len(out_zeros) :])
        out_tangents = [
            _compat.SymbolicZero(_compat.tangent_aval(_compat.abstract_value(p)))
            if z
            else cast_value(next(nonzero_out), dtype_of(p))
            for p, z in zip(out_primals, out_zeros)
        ]
        return [*out_primals, *out_tangents]

    params["subfuns"] = (
        _compat.wrap_fun(_compat.jaxpr_as_fun(primal), like=call_jaxpr.jaxpr),
        _compat.wrap_fun(jvp, like=jvp_jaxpr_fun),
    )
    return _compat.custom_jvp_call_p.bind(*invals, **params)


@register(_compat.custom_vjp_call_p)
def _custom_vjp(ctx: AmpContext, eqn: Any, invals: list) -> Sequence[Any]:
    params, (call_jaxpr, num_consts), fwd_jaxpr_thunk, bwd = _compat.custom_vjp_subfuns(eqn.params)
    if ctx.inline:
        return interpret(call_jaxpr.jaxpr, call_jaxpr.consts, invals, ctx)
    with _site_state.paused(_IN_CUSTOM_RULE % "jax.custom_vjp"):
        primal = _amp_closed_jaxpr(ctx, call_jaxpr, invals)
    out_dtypes = _out_dtypes(primal)
    num_out = len(out_dtypes)
    in_dtypes = [dtype_of(x) for x in invals]

    def fwd(*args):
        # JAX's `lift_fwd`, with the forward rule interpreted under amp.
        vals, nonzeros = args[::2], args[1::2]
        primals = vals[num_consts:]
        if any(nonzeros[:num_consts]):
            raise _compat.CustomVJPException()
        rule = _compat.rule_jaxpr(*fwd_jaxpr_thunk.call_wrapped(*nonzeros[num_consts:]))
        with _site_state.paused(_IN_CUSTOM_RULE % "jax.custom_vjp"):
            out = interpret(rule.jaxpr, rule.consts, primals, ctx)
        res, outs = out[: len(out) - num_out], out[len(out) - num_out :]
        return [*res, *_cast_all(outs, out_dtypes)]

    def amp_bwd(*args):
        if any(_compat.is_zero(a) for a in args):
            # Symbolic-zero cotangents cannot be traced: run the rule as written.
            cts, logs = _compat.unpack_bwd_result(bwd.call_wrapped(*args))
        else:
            cts, logs = _amp_bwd_call(ctx, bwd, args)
        # Cotangents must match the primal inputs as amp passed them.
        cts = [o if _compat.is_zero(o) else cast_value(o, d) for o, d in zip(cts, in_dtypes)]
        return _compat.pack_bwd_result(cts, logs)

    params["subfuns"] = (
        _compat.wrap_fun(_compat.jaxpr_as_fun(primal), like=call_jaxpr.jaxpr),
        _compat.wrap_fun(fwd, like=fwd_jaxpr_thunk),
        _compat.wrap_fun(amp_bwd, like=bwd),
    )
    return _compat.custom_vjp_call_p.bind(*invals, **params)


def _amp_bwd_call(ctx: AmpContext, bwd: Any, args: tuple) -> tuple[list, Any]:
    """Run a custom_vjp backward rule under amp: trace it, then interpret it."""
    captured: dict = {}

    def flat_bwd(*a):
        cts, logs = _compat.unpack_bwd_result(bwd.call_wrapped(*a))
        log_leaves, captured["log_tree"] = jax.tree_util.tree_flatten(logs)
        captured["cts"] = cts
        return [o for o in cts if not _compat.is_zero(o)] + log_leaves

    closed = _compat.trace_to_closed_jaxpr(flat_bwd, [_compat.abstract_value(a) for a in args])
    with _site_state.paused(_IN_CUSTOM_RULE % "jax.custom_vjp"):
        outs = interpret(closed.jaxpr, closed.consts, args, ctx)
    num_cts = len(outs) - captured["log_tree"].num_leaves
    computed = iter(outs[:num_cts])
    cts = [o if _compat.is_zero(o) else next(computed) for o in captured["cts"]]
    return cts, jax.tree_util.tree_unflatten(captured["log_tree"], outs[num_cts:])


# --- shard_map ----------------------------------------------------------------------


@register(_compat.shard_map_p)
def _shard_map(ctx: AmpContext, eqn: Any, invals: list) -> Sequence[Any]:
    body = _amp_body(eqn.params["jaxpr"], (), ctx)
    if not _threads_site_state():
        params = _compat.shard_map_body(eqn.params, body)
        return list(_compat.shard_map_p.bind(*invals, **params))
    # The body takes the site state's values as replicated inputs (see
    # `_site_state`); JAX traces it during the bind, maybe more than once.
    state = _site_state.active()
    assert state is not None  # (_threads_site_state)
    passed = state.passed()
    start = state.position
    summed = () if eqn.params["check_vma"] else tuple(name for name, _ in _compat.shard_map_mesh_axes(eqn.params))

    def with_state(*args: Any) -> Sequence[Any]:
        state.rewind(start)
        inner = state.entering(args[: len(passed)], summed)
        with _site_state.threading(inner):
            outs = body(*args[len(passed) :])
        state.rewind(inner.position)
        return outs

    replicated = (jax.sharding.PartitionSpec(),) * len(passed)
    params = _compat.shard_map_body(eqn.params, with_state, extra_in_specs=replicated)
    return list(_compat.shard_map_p.bind(*passed, *invals, **params))
