"""The evaluation loop: re-run a jaxpr equation by equation under a policy table.

Each equation is re-emitted with its source information, its operands cast by
the rule the policy table picks. Higher-order primitives (jit, scan, while, cond,
remat, custom derivatives, shard_map) are handed to the handler registered for
them here (`register`; the handlers live in `_higher_order`), which interpret
their bodies with this same loop. The registry sits beside the loop, as JAX
keeps its per-primitive rule tables beside each interpreter.
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from .. import _compat
from .._casting import dtype_of, linear_values, shared_casts
from .._dtypes import is_castable
from .._jaxpr import MATMUL_NAMES, holds_matmul, merge_runs
from ..analyses._regions import Regions
from ..analyses._statistics import plan_statistics
from ..analyses._tail import Path, Tail, find_tail, path_body, paths_in
from ..analyses._upcasts import plan_upcasts
from . import _site_state
from ._linearity import context_key, entering_bodies, tangent_operands
from ._rules import PolicyTable, requested_precision, use_original_precision
from ._scopes import AMP_DEFAULT, RuleChoice, choose_rule

__all__ = [
    "HANDLERS",
    "AmpContext",
    "EquationEvent",
    "EquationRewrite",
    "Handler",
    "differentiation_depth",
    "explicit_upcast",
    "interpret",
    "is_last_matmul",
    "register",
    "warn_once",
]


@dataclasses.dataclass(frozen=True)
class EquationEvent:
    """What amp did to one equation; passed to an `AmpContext.observer`."""

    eqn: Any
    scopes: tuple[str, ...]
    decided_by: str
    original_dtypes: tuple[Any, ...]
    dtypes_before: tuple[Any, ...]  # as amp held the operands on arrival
    dtypes_after: tuple[Any, ...]  # as the rule passed them to the primitive
    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...]
    trip_count: int
    call_sites: tuple[Any, ...] = ()  # enclosing higher-order equations, outermost first
    detail: str = ""  # what an equation-rewriting rule did, or why it declined
    # ``replay(*operands) -> outputs``: the same rule applied to other operands
    # (as they would arrive: amp's dtypes on arrival), for `jaxamp.compare`.
    replay: Callable[..., tuple] | None = None

    @property
    def user_frame(self) -> Any:
        """The user's frame that emitted the equation, or None.

        An equation inside a ``jax.numpy`` function's jit'd body has no user
        frame of its own; as when JAX inlines that body, it is attributed to the
        innermost enclosing call that has one.
        """
        for eqn in (self.eqn, *reversed(self.call_sites)):
            frame = _compat.eqn_user_frame(eqn)
            if frame is not None:
                return frame
        return None


class EquationRewrite(NamedTuple):
    """An equation-rewriting rule's answer for one equation.

    A rule object may define, besides the rule signature,
    ``rewrite_equation(compute_dtype, original_dtypes, eqn, *invars, **bind_params)``
    returning one of these; amp asks it before calling the rule. It is for a
    rule that must replace the equation, not only cast its operands (fp8 mode
    quantises both operands, runs the matmul in float8 and rescales, see
    `jaxamp.fp8._matmul`). While it runs, `differentiation_depth` and
    `is_last_matmul` say where the equation stands.

    Attributes:
        fn: ``fn(*invars) -> outputs`` (a list for multiple-result primitives),
            computed in place of the equation; None: the rule declines and amp
            calls it as an ordinary rule.
        operand_dtypes: the dtypes `fn` runs the operands in, for diagnostics.
        detail: what the rule did, or why it declined, for diagnostics.
    """

    fn: Callable[..., Any] | None
    operand_dtypes: tuple[Any, ...]
    detail: str


@dataclasses.dataclass(frozen=True)
class AmpContext:
    """Everything an equation's evaluation depends on besides its operands.

    Attributes:
        compute_dtype: the low-precision dtype rules cast to.
        policy: the table of rules, keyed by primitive or scope name: a
            `PolicyTable` snapshot, hashable by contents (caches key on it).
        scopes: named scopes active around the jaxpr being interpreted,
            outermost first (bodies of nested jaxprs record theirs relatively).
        observer: called with an `EquationEvent` per first-order equation
            (diagnostics); None in normal use.
        inline: evaluate bodies of jit/scan/while/cond/remat/custom rules
            directly instead of re-binding their primitive, so an eager caller
            sees every equation's concrete output (`find_nonfinite`).
        trip_count: how many times the jaxpr runs per call of the outermost
            function (scan lengths multiplied), for FLOP accounting.
        call_sites: the higher-order equations whose bodies enclose this
            jaxpr, outermost first, for attributing equations to source lines.
        statistics_inputs: ``(body, arguments)`` when the next jaxpr to be
            interpreted is the body of a call: what `plan_statistics` plans
            it with at this call site (see `jaxamp.analyses._statistics`).
        tail: the jaxpr is the body of a loop or cond in the program's tail
            (see `jaxamp.analyses._tail`): all of it runs by the ``"amp_tail"`` entry.
        tail_inside: ``(body, paths)`` when the next jaxpr to be interpreted
            is the body of a call: the `jaxamp.analyses._tail.Path` of each of
            its equations in the tail, as its caller's analysis found them.
        last_matmuls_inside: ``(body, paths)`` when the next jaxpr to be
            interpreted is the body of a call, a loop or a shard_map, or a
            cond's branch (`jaxamp.analyses._tail.path_body`): the paths of
            the program's last matmuls in it (`jaxamp.analyses._tail.Tail.last_matmuls`).
        upcasts_inside: ``(body, classes)`` when the next jaxpr to be
            interpreted is the body of a call, a scan or a shard_map: the
            classes of its inputs at this call site, which
            `jaxamp.analyses._upcasts.plan_upcasts` plans it with (which of
            them the program widened from half precision).
        recompute: evaluate norm regions and the program's tail under
            `jax.checkpoint` (see `_evaluate_recomputed`); off for programs
            that are never differentiated (eager calls), where it only costs.
        differentiated: how many differentiations enclose the values of the
            call sites around this jaxpr (`_compat.differentiation_depth`):
            a body is traced on abstract values, which no longer show it.
            Rules read it for each equation with `differentiation_depth`.
        around_custom_vjp: ``around_custom_vjp(eqn, invals, call) -> outvals``,
            run in place of each ``jax.custom_vjp`` call's handler (``call(invals)``):
            loss scaling hands its backward rules true-scale cotangents with
            it (`jaxamp.scaling._in_grad`). It counts its uses (``calls``), so
            a body that closes over its values is not shared, and says what it
            cannot reach (``unreachable(where)``). Not passed into custom rules.
    """

    compute_dtype: np.dtype
    policy: PolicyTable
    scopes: tuple[str, ...] = ()
    observer: Callable[[EquationEvent], None] | None = None
    inline: bool = False
    trip_count: int = 1
    call_sites: tuple[Any, ...] = ()
    statistics_inputs: tuple[Any, tuple] | None = None
    tail: bool = False
    tail_inside: tuple[Any, frozenset] | None = None
    last_matmuls_inside: tuple[Any, frozenset] | None = None
    upcasts_inside: tuple[Any, tuple] | None = None
    recompute: bool = True
    differentiated: int = 0
    around_custom_vjp: Any = None

    def nested(
        self, eqn: Any, statistics_inputs: tuple[Any, tuple] | None = None, invals: Sequence[Any] = ()
    ) -> AmpContext:
        """The context for the bodies of `eqn`, a higher-order equation called with `invals`."""
        return dataclasses.replace(
            self,
            scopes=self.scopes + _compat.eqn_scopes(eqn),
            call_sites=self.call_sites + (eqn,),
            statistics_inputs=statistics_inputs,
            tail_inside=None,
            last_matmuls_inside=None,
            upcasts_inside=None,
            differentiated=max(self.differentiated, *map(_compat.differentiation_depth, invals), 0),
            around_custom_vjp=_around_custom_vjp_in(self.around_custom_vjp, eqn),
        )

    def repeated(self, times: int) -> AmpContext:
        """The context for a loop body that runs `times` times per call."""
        return dataclasses.replace(self, trip_count=self.trip_count * times)


def _around_custom_vjp_in(around: Any, eqn: Any) -> Any:
    """`AmpContext.around_custom_vjp` for the bodies of `eqn`.

    JAX traces custom rules apart from the program, so a value of the caller's
    trace cannot reach them; a shard_map body is traced per shard, where it
    could only arrive as a constant JAX refuses.
    """
    if around is None or eqn.primitive in (_compat.custom_vjp_call_p, _compat.custom_jvp_call_p):
        return None
    if eqn.primitive is _compat.shard_map_p:
        return around.unreachable("a shard_map body")
    return around


Handler = Callable[["AmpContext", Any, list], Sequence[Any]]
"""``handler(ctx, eqn, invals) -> outputs`` for one higher-order primitive.

`ctx` is already the nested context (the scopes of `eqn` included).
"""

HANDLERS: dict[Any, Handler] = {}


def register(*primitives: Any) -> Callable[[Handler], Handler]:
    """Register the decorated handler for each of `primitives`.

    Args:
        *primitives: primitive objects; None entries (a primitive this JAX
            version lacks) are skipped.

    Returns:
        A decorator that registers its handler and returns it unchanged.
    """

    def decorator(handler: Handler) -> Handler:
        for primitive in primitives:
            if primitive is not None:
                HANDLERS[primitive] = handler
        return handler

    return decorator


def interpret(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], ctx: AmpContext) -> list:
    """Evaluate `jaxpr` on `args` under amp.

    Args:
        jaxpr: an open `Jaxpr` (its constants passed as `consts`).
        consts: values for ``jaxpr.constvars``.
        args: values for ``jaxpr.invars``; their dtypes may differ from the
            jaxpr's own avals (amp moves values to compute dtype).
        ctx: the compute dtype, policy and active scopes.

    Returns:
        The values of ``jaxpr.outvars``, in whatever dtypes amp left them.
    """
    env: dict[Any, Any] = {}
    for v, value in zip(jaxpr.constvars, consts):
        _write(env, v, value)
    for v, value in zip(jaxpr.invars, args, strict=True):
        _write(env, v, value)
    program = not ctx.call_sites  # the amp'd program itself, not a body inside it
    # A loop or cond body in the tail runs as tail whole (`AmpContext.tail`);
    # a call's body was classified with its caller (`AmpContext.tail_inside`);
    # any other is classified here. The last matmuls are the program's: a
    # body's come from its caller.
    found = find_tail(jaxpr) if program else Tail(frozenset(), frozenset())
    paths: frozenset[Path] = frozenset()
    if not ctx.tail:
        given_tail = ctx.tail_inside
        if given_tail is not None and given_tail[0] is jaxpr:
            paths = given_tail[1]
        else:
            paths = found.paths if program else find_tail(jaxpr, program=False).paths
    given_last = None if ctx.last_matmuls_inside is None else paths_in(ctx.last_matmuls_inside, jaxpr)
    last_matmuls = found.last_matmuls if given_last is None else given_last
    inside, last_inside = _inside(paths), _inside(last_matmuls)
    # Equations in the tail, calls holding some of it among them (for the
    # runs recomputed under `jax.checkpoint`).
    tail = frozenset(p[0] for p in paths if len(p) == 1) | {i for i in inside if not holds_matmul(jaxpr.eqns[i])}

    given = ctx.statistics_inputs
    plan = plan_statistics(jaxpr, *(given[1] if given is not None and given[0] is jaxpr else ()))
    regions = Regions(jaxpr, ctx.policy, ctx.scopes)
    given_upcasts = ctx.upcasts_inside
    upcasts = plan_upcasts(jaxpr, given_upcasts[1] if given_upcasts is not None and given_upcasts[0] is jaxpr else None)

    def evaluate(i: int, eqn: Any, env: dict, casts: dict) -> None:
        invals = [_read(env, v) for v in eqn.invars]
        handler = HANDLERS.get(eqn.primitive)
        in_tail = ctx.tail or (i,) in paths
        with _compat.eqn_source(eqn):
            if handler is not None:
                call_inputs = plan.call_inputs.get(i)
                body = _compat.call_body(eqn)
                nested = ctx.nested(eqn, None if call_inputs is None else (body, call_inputs), invals)
                if in_tail and not nested.tail:
                    nested = dataclasses.replace(nested, tail=True)
                elif body is not None and not in_tail:
                    nested = dataclasses.replace(nested, tail_inside=(body, inside.get(i, frozenset())))
                entered = path_body(eqn)
                if entered is not None:
                    nested = dataclasses.replace(nested, last_matmuls_inside=(entered, last_inside.get(i, frozenset())))
                if entered is not None and i in upcasts.body_inputs:
                    nested = dataclasses.replace(nested, upcasts_inside=(entered, upcasts.body_inputs[i]))
                with entering_bodies(eqn):
                    if eqn.primitive is _compat.custom_vjp_call_p and ctx.around_custom_vjp is not None:
                        outvals = ctx.around_custom_vjp(
                            eqn, invals, lambda ins: _run_handler(handler, ctx, nested, eqn, list(ins))
                        )
                    else:
                        outvals = _run_handler(handler, ctx, nested, eqn, invals)
            else:
                outvals = _apply_rule(
                    ctx,
                    eqn,
                    invals,
                    statistic=i in plan.statistics,
                    bounded=i in plan.bounded,
                    tail=in_tail,
                    last_matmul=(i,) in last_matmuls,
                    upcast=upcasts.requests.get(i, ""),
                    casts=casts,
                )
        if not eqn.primitive.multiple_results:
            outvals = [outvals]
        if regions.active:
            outvals = regions.hand_on(i, eqn, invals, outvals, ctx.compute_dtype)
        for v, value in zip(eqn.outvars, outvals, strict=True):
            _write(env, v, value)

    # Diagnostics watch every equation's value, so they see everything unwrapped.
    recomputed, last_use = {}, {}
    if ctx.recompute and ctx.observer is None and not ctx.inline:
        recomputed = _recomputed_runs(jaxpr, regions.runs(), plan.norm_runs, tail)
    if recomputed:
        last_use = _last_uses(jaxpr)
    casts: dict = {}  # see `shared_casts`
    i = 0
    while i < len(jaxpr.eqns):
        run = recomputed.get(i)
        if run is None:
            evaluate(i, jaxpr.eqns[i], env, casts)
            i += 1
        else:
            # What else decides how amp rewrites the run's equations: the
            # context, the statistics plan (of the equations and of the
            # bodies they call, planned with their operands' classes), and
            # which operands are a custom_jvp rule's tangents.
            key = (
                ctx.compute_dtype, ctx.policy, ctx.scopes, ctx.tail, ctx.differentiated >= 2, context_key(),
                tuple(
                    (
                        k in plan.statistics, k in plan.bounded, (k,) in paths, inside.get(k), plan.call_inputs.get(k),
                        upcasts.requests.get(k), upcasts.body_inputs.get(k), tangent_operands(jaxpr.eqns[k]),
                    )
                    for k in run
                ),
            )  # fmt: skip
            _evaluate_recomputed(jaxpr, run, last_use, env, evaluate, key)
            i = run.stop
    return [_read(env, v) for v in jaxpr.outvars]


def _read(env: dict, v: Any) -> Any:
    return v.val if isinstance(v, _compat.Literal) else env[v]


def _write(env: dict, v: Any, value: Any) -> None:
    if not isinstance(v, _compat.DropVar):
        env[v] = value


def _recomputed_runs(
    jaxpr: Any, region_runs: dict[int, int], norm_runs: dict[int, int], tail: frozenset[int]
) -> dict[int, range]:
    """The runs of equations amp evaluates under `jax.checkpoint`, by their first index.

    Runs of a norm region's equations (`Regions.runs`), of a norm the
    statistics pass found (`StatisticsPlan.norm_runs`: flax's and haiku's
    norm layers) and of the program's tail (`jaxamp.analyses._tail`): all
    run in float32 on values that arrive in the compute dtype, so saving
    their inputs and recomputing the rest keeps float32 activations out of
    the residuals (see `_evaluate_recomputed`). Overlapping runs (a region
    or a norm inside the tail, a batch norm whose running averages the tail
    updates) are merged into one. Runs with side effects (a
    `jax.debug.print`) are left alone: a recompute would repeat them.
    """
    tail_runs = []
    for start in sorted(tail):
        if start - 1 in tail:
            continue
        end = start
        while end in tail:
            end += 1
        tail_runs.append((start, end))
    runs = merge_runs((*tail_runs, *region_runs.items(), *norm_runs.items()))
    recomputed, previous_end = {}, 0
    for start, end in runs.items():
        # A value broadcast just before the run (haiku's ``Linear`` broadcasts
        # its bias to the output's shape) is recomputed, not saved in float32.
        while start > previous_end and _expands(jaxpr.eqns[start - 1]):
            start -= 1
        if not any(jaxpr.eqns[k].effects for k in range(start, end)):
            recomputed[start] = range(start, end)
        previous_end = end
    return recomputed


def _expands(eqn: Any) -> bool:
    """Whether `eqn` makes a larger value out of smaller ones (a broadcast, an iota)."""
    if eqn.effects or _compat.call_body(eqn) is not None or len(eqn.outvars) != 1:
        return False
    size = math.prod(getattr(eqn.outvars[0].aval, "shape", ()))
    return all(isinstance(v, _compat.Literal) or math.prod(getattr(v.aval, "shape", ())) < size for v in eqn.invars)


def _last_uses(jaxpr: Any) -> dict[Any, int]:
    """The index of the last equation reading each variable (``len(eqns)``: an output)."""
    last = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, _compat.Literal):
                last[v] = i
    for v in jaxpr.outvars:
        if not isinstance(v, _compat.Literal):
            last[v] = len(jaxpr.eqns)
    return last


def _evaluate_recomputed(
    jaxpr: Any, run: range, last_use: dict[Any, int], env: dict, evaluate: Callable, context: Any
) -> None:
    """Evaluate the equations `run` under `jax.checkpoint`, saving only their inputs.

    A norm region runs in float32 (`use_normalisation_precision`), and so does
    the program's tail, on inputs that arrive in the compute dtype.
    Differentiated as is, they would save float32 activations (a norm's
    centred and normalised values, the loss's softmax) for the backward pass;
    under `jax.checkpoint` they save their half-precision inputs, and the
    backward pass recomputes the rest in float32 from them, statistics
    included (see the comment on the policy below), as apex's memory-efficient LayerNorm
    recomputes from what it saved. Values and gradients are the same.

    Runs of the same structure (every layer's norm in an unrolled model) share
    one traced program, `context` (what else decides how amp rewrites them)
    being equal: JAX then differentiates it once, not once per layer.
    """
    eqns = [jaxpr.eqns[k] for k in run]
    defined: set = set()
    read_first: dict = {}  # the run's inputs, in order of first use
    for eqn in eqns:
        for v in eqn.invars:
            if not isinstance(v, _compat.Literal) and v not in defined:
                read_first.setdefault(v, None)
        defined.update(eqn.outvars)
    inputs = list(read_first)
    outputs = [v for eqn in eqns for v in eqn.outvars if last_use.get(v, -1) >= run.stop]

    def recompute(*values: Any) -> list:
        local = dict(zip(inputs, values))
        casts: dict = {}  # casts made in this trace stay in it
        for i, eqn in zip(run, eqns):
            evaluate(i, eqn, local, casts)
        return [local[v] for v in outputs]

    values = [env[v] for v in inputs]
    avals = [_compat.abstract_value(x) for x in values]
    # Where sites take no values (`_site_state.paused`), rules rewrite them otherwise.
    paused = bool(_site_state.pause_reason())
    key: Any = (_structure(eqns, inputs, outputs), context, tuple(avals), paused)
    try:
        program = _RECOMPUTED.get(key)
    except TypeError:  # an unhashable parameter, literal or context: traced afresh
        key, program = None, None
    if program is None:
        state = _site_state.active()
        start = state.position if state is not None else 0
        program = _compat.trace_to_jaxpr_with_consts_as_inputs(recompute, avals)
        # A run whose sites took values of this call's state is never shared.
        took_sites = state is not None and state.position != start
        if key is not None and not took_sites and not any(isinstance(c, jax.core.Tracer) for c in program[1]):
            _RECOMPUTED[key] = program
            if len(_RECOMPUTED) > _RECOMPUTED_MAXSIZE:
                del _RECOMPUTED[next(iter(_RECOMPUTED))]
    closed, consts = program
    # Saving nothing but the inputs, not even the run's reductions (a norm's
    # row sums, a softmax's normaliser): XLA may skip rounding the run's
    # half-precision input in the forward pass (it allows excess precision)
    # while the recompute reads the rounded value, so saved statistics could
    # disagree with the recomputed values they normalise (a 2.7% gradient
    # error measured on a transformer's loss). Recomputed from one input,
    # forward and backward agree.
    nothing_saveable = jax.checkpoint_policies.nothing_saveable
    env.update(zip(outputs, _compat.bind_remat(closed, consts, values, nothing_saveable)))


# Traced recomputed runs by structure (see `_evaluate_recomputed`), oldest first.
_RECOMPUTED: dict[Any, tuple[Any, list]] = {}
_RECOMPUTED_MAXSIZE = 256


def _structure(eqns: list, inputs: list, outputs: list) -> tuple:
    """A description of a run of equations: what each computes from what.

    Two runs with the same description (primitives, parameters, named scopes,
    literals and wiring) are the same computation. Hashable unless a
    parameter is.
    """
    where: dict[Any, tuple] = {v: ("in", k) for k, v in enumerate(inputs)}
    parts = []
    for position, eqn in enumerate(eqns):
        operands: list[tuple] = []
        for v in eqn.invars:
            if isinstance(v, _compat.Literal):
                literal = np.asarray(v.val)
                operands.append(("literal", literal.dtype.str, literal.tobytes()))
            else:
                operands.append(where[v])
        parts.append((eqn.primitive, tuple(sorted(eqn.params.items())), tuple(operands), _compat.eqn_scopes(eqn)))
        for k, v in enumerate(eqn.outvars):
            where[v] = ("eqn", position, k)
    return tuple(parts), tuple(where[v] for v in outputs)


def _inside(paths: frozenset[Path]) -> dict[int, frozenset[Path]]:
    """`paths` inside bodies, by the index of the equation holding the body, relative to it."""
    inside: dict[int, frozenset[Path]] = {}
    for path in paths:
        if len(path) > 1:
            inside[path[0]] = inside.get(path[0], frozenset()) | {path[1:]}
    return inside


def _run_handler(handler: Handler, ctx: AmpContext, nested: AmpContext, eqn: Any, invals: list) -> Any:
    try:
        return handler(nested, eqn, invals)
    except _compat.JaxInternalsChanged as err:
        # Only a `_compat` accessor raises this: a JAX release moved an internal
        # the handler needs. Running the primitive unchanged at original
        # precision is slower but correct. Errors from rules and from the
        # user's own code inside the body are not caught: they propagate as
        # raised, on every call.
        warn_once(
            ("internals", eqn.primitive.name),
            f"jaxamp could not rewrite {eqn.primitive.name!r} on JAX {jax.__version__} "
            f"({err}); it runs at original precision (float32 where your program "
            "had float32). Please report this with your JAX version.",
        )
        return _apply_rule(ctx, eqn, invals, force_original=True)


_DIFFERENTIATED: contextvars.ContextVar[int] = contextvars.ContextVar("jaxamp_differentiated", default=0)
_LAST_MATMUL: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxamp_last_matmul", default=False)
_UPCAST: contextvars.ContextVar[str] = contextvars.ContextVar("jaxamp_upcast", default="")


def explicit_upcast() -> str:
    """For an equation-rewriting rule: what the program asked for by widening the matmul's operands, or ``""``.

    A matmul whose operands the program widened from half precision
    (``q.astype(jnp.float32)``; see `jaxamp.analyses._upcasts`), in words
    (``"float32 operands widened from bfloat16"``). The operands' dtypes
    cannot show it: the request is in the program around the equation.
    """
    return _UPCAST.get()


def is_last_matmul() -> bool:
    """For an equation-rewriting rule: whether it rewrites one of the program's last matmuls.

    A matmul whose result reaches the program's outputs with no matmul after
    it (the logits head), found by its place in the program
    (`jaxamp.analyses._tail.Tail.last_matmuls`): at one call of a body shared
    by every layer, not at the others.
    """
    return _LAST_MATMUL.get()


def differentiation_depth() -> int:
    """For an equation-rewriting rule: how many differentiations enclose the equation it rewrites.

    The largest `_compat.differentiation_depth` of its operands and of the
    operands of the calls around it (`AmpContext.differentiated`): 1 under
    `jax.grad` or `jax.jvp`, 2 under a Hessian. A derivative taken of a
    `jax.jit`'d function after tracing it (`jax.jvp(jax.jit(jax.grad(f)))`)
    is not seen: it differentiates the traced program.
    """
    return _DIFFERENTIATED.get()


_warned: set[tuple[str, str]] = set()


def warn_once(key: tuple[str, str], message: str, category: type[Warning] = RuntimeWarning) -> None:
    """Warn with `message` the first time `key` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, category, stacklevel=4)


def _warn_if_moved_back(eqn: Any, choice: RuleChoice, params: dict, before, after, compute_dtype) -> None:
    # A precision change nobody asked for: amp had moved an operand to the
    # compute dtype, and only the fallback (no table entry, or a body amp
    # cannot rewrite) sends it back, so this op and what follows it run at
    # original precision. Said once per primitive, naming the fix.
    moved = [(b, a) for b, a in zip(before, after) if b != a and is_castable(b) and is_castable(a)]
    if choice.decided_by not in (AMP_DEFAULT, "original") or not moved:
        return
    name = eqn.primitive.name
    back_to = ", ".join(sorted({np.dtype(a).name for _, a in moved}))
    if "subfuns" in params:
        message = (
            f"jaxamp has no handler for the higher-order primitive {name!r}, so it cannot "
            f"rewrite its body: its operands, which amp had moved to "
            f"{np.dtype(compute_dtype).name}, go back to {back_to} and the body runs at "
            "original precision. Please report this primitive."
        )
    else:
        key = f"jax.lax.{name}_p" if hasattr(jax.lax, f"{name}_p") else f"the {name!r} primitive"
        message = (
            f"amp policy table has no entry for primitive {name!r}, so {choice.decided_by!r} "
            f"ran it at original precision: its operands, which amp had moved to "
            f"{np.dtype(compute_dtype).name}, went back to {back_to}, and what follows runs "
            f"at that precision too. If {name!r} is safe in half precision, add "
            f"{{{key}: jaxamp.use_current_precision}} to your table "
            f"(amp(fn, amp_policy=jaxamp.default_amp_policy | {{...}})); to keep it at "
            "original precision without this warning, map it to jaxamp.use_original_precision."
        )
    warn_once(("amp_default", name), message, UserWarning)


def _apply_rule(
    ctx: AmpContext,
    eqn: Any,
    invals: list,
    force_original: bool = False,
    statistic: bool = False,
    bounded: bool = False,
    tail: bool = False,
    last_matmul: bool = False,
    upcast: str = "",
    casts: dict | None = None,
) -> Any:
    scopes = ctx.scopes + _compat.eqn_scopes(eqn)
    original = tuple(getattr(v.aval, "dtype", None) for v in eqn.invars)
    params = eqn.primitive.get_bind_params(eqn.params)
    # An unknown higher-order primitive (or one whose handler failed): its body
    # cannot be rewritten, so it gets exactly the operands it was traced with.
    choice, request = None, ""
    if "subfuns" not in params and not force_original:
        if eqn.primitive.name in MATMUL_NAMES:
            # What the matmul's parameters ask for, else what the program
            # asked for by widening its operands (`jaxamp.analyses._upcasts`).
            request = requested_precision(original, eqn.params) or upcast
        choice = choose_rule(ctx.policy, scopes, eqn.primitive, statistic, bounded, tail, bool(request))
    if choice is None:
        choice = RuleChoice(use_original_precision, "original")
    before = tuple(dtype_of(x) for x in invals)

    def run(operands: list, casts: dict) -> tuple[Any, list, tuple, Any]:
        """``(outputs, operands as bound, their dtypes, the rewrite or None)``."""
        rewrite = None
        if hasattr(choice.rule, "rewrite_equation"):
            site_state = _site_state.active()
            if site_state is not None:  # names the equation's site, should the rule take one
                site_state.scopes = scopes
            depth = max(ctx.differentiated, *map(_compat.differentiation_depth, operands), 0)
            token, last = _DIFFERENTIATED.set(depth), _LAST_MATMUL.set(last_matmul)
            widened = _UPCAST.set(upcast)
            try:
                rewrite = choice.rule.rewrite_equation(ctx.compute_dtype, original, eqn, *operands, **params)
            finally:
                _UPCAST.reset(widened)
                _LAST_MATMUL.reset(last)
                _DIFFERENTIATED.reset(token)
        if rewrite is not None and rewrite.fn is not None:
            return rewrite.fn(*operands), operands, tuple(rewrite.operand_dtypes), rewrite
        with shared_casts(casts), linear_values(_tangents(eqn, operands)):
            new_invals, new_params = _call_rule(choice, ctx.compute_dtype, original, operands, params)
        bound = eqn.primitive.bind(*new_invals, **new_params)
        return bound, new_invals, tuple(dtype_of(x) for x in new_invals), rewrite

    outvals, new_invals, after, rewrite = run(invals, {} if casts is None else casts)
    if (rewrite is None or rewrite.fn is None) and not force_original:
        # (A handler that failed has warned already.)
        _warn_if_moved_back(eqn, choice, params, before, after, ctx.compute_dtype)
    if ctx.observer is not None:
        outs = tuple(outvals) if eqn.primitive.multiple_results else (outvals,)

        def replay(*operands: Any) -> tuple:
            result = run(list(operands), {})[0]
            return tuple(result) if eqn.primitive.multiple_results else (result,)

        ctx.observer(
            EquationEvent(
                eqn=eqn,
                scopes=scopes,
                decided_by=choice.decided_by,
                original_dtypes=original,
                dtypes_before=before,
                dtypes_after=after,
                inputs=tuple(new_invals),
                outputs=outs,
                trip_count=ctx.trip_count,
                call_sites=ctx.call_sites,
                detail=(
                    rewrite.detail
                    if rewrite is not None
                    else f"the program asks for {request}"
                    if choice.decided_by == "requested"
                    else ""
                ),
                replay=replay,
            )
        )
    return outvals


def _tangents(eqn: Any, operands: list) -> list:
    """The operands of `eqn` that are tangents of the custom_jvp rule being interpreted (see `linear_values`)."""
    tangents = tangent_operands(eqn)
    if not isinstance(tangents, tuple):
        return []
    return [x for x, is_tangent in zip(operands, tangents) if is_tangent]


def _call_rule(choice: RuleChoice, compute_dtype, original, invals, params):
    result = choice.rule(compute_dtype, original, *invals, **params)
    try:
        new_invals, new_params = result
        new_invals = list(new_invals)
        new_params = dict(new_params)
    except (TypeError, ValueError):
        raise TypeError(
            f"amp policy rule {_rule_name(choice.rule)} (chosen by {choice.decided_by}) "
            f"must return (invars, bind_params), got {type(result).__name__}: {result!r:.200}."
        ) from None
    if len(new_invals) != len(invals):
        raise ValueError(
            f"amp policy rule {_rule_name(choice.rule)} (chosen by {choice.decided_by}) "
            f"returned {len(new_invals)} operands for a primitive that takes "
            f"{len(invals)}: a rule must return one value per operand."
        )
    return new_invals, new_params


def _rule_name(rule: Callable) -> str:
    return getattr(rule, "__qualname__", None) or repr(rule)
