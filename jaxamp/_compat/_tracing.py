"""Jaxprs and tracing.

JAX's jaxpr types and primitives, tracing bodies in the current context,
equations' sources and scopes, the parameters of higher-order primitives, and
custom derivatives' sub-functions.

The interpreter must re-emit equations with their source information, trace new
bodies for higher-order primitives in the *current* context (axis names, meshes,
outer transformations), and rebuild the sub-functions that custom-derivative and
shard_map primitives bind with. JAX has no public API for these.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.extend.core as jex_core
from jax._src import config as _config
from jax._src import core as _core
from jax._src import linear_util as _lu
from jax._src import source_info_util as _source_info
from jax._src.ad_util import SymbolicZero, Zero
from jax._src.custom_derivatives import linear_call_p  # (not part of jax.extend)
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import partial_eval as _pe
from jax._src.interpreters.ad import CustomVJPException
from jax._src.state.types import AbstractRef as _AbstractRef

from ._versions import _DRIFT_ERRORS, BWD_RETURNS_LOGS, HAS_FLATTREE, HAS_INLINE_ENUM, _internal

__all__ = [
    "ClosedJaxpr",
    "CustomVJPException",
    "DropVar",
    "Jaxpr",
    "JaxprEqn",
    "Literal",
    "Primitive",
    "SymbolicZero",
    "Var",
    "Zero",
    "abstract_value",
    "ambient_scopes",
    "bind_remat",
    "call_body",
    "call_params_with_extra_inputs",
    "closed_call_p",
    "cond_p",
    "consts_as_inputs",
    "custom_jvp_call_p",
    "custom_jvp_subfuns",
    "custom_vjp_call_p",
    "custom_vjp_subfuns",
    "differentiation_depth",
    "eager_trace_context",
    "outside_traces",
    "eqn_scopes",
    "eqn_source",
    "eqn_transposed",
    "eqn_user_frame",
    "frame_line",
    "is_differentiation_tracer",
    "is_zero",
    "jaxpr_as_fun",
    "jit_p",
    "jit_params_with_extra_outputs",
    "linear_call_p",
    "lax_modules",
    "matmul_cotangents",
    "pack_bwd_result",
    "primitives_by_name",
    "primitives_in",
    "remat_p",
    "rule_jaxpr",
    "saved_residuals",
    "scan_layout",
    "scan_p",
    "scan_params_with_extra_consts",
    "shaped_array",
    "shard_map_body",
    "shard_map_mesh_axes",
    "shard_map_p",
    "staging",
    "compiling",
    "forward_mode",
    "mapped",
    "tangent_aval",
    "trace_keeping_calls",
    "trace_to_closed_jaxpr",
    "trace_to_jaxpr_with_consts_as_inputs",
    "unpack_bwd_result",
    "while_p",
    "with_dtype",
    "wrap_fun",
    "zeros_like_aval",
]


# jaxamp's frames are never the user's line: equations amp emits (and calls its
# forward trace records) are attributed to the user code beneath them, as
# JAX's own frames are.
_source_info.register_exclusion(os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)


if HAS_FLATTREE:
    from jax._src import flattree as _flattree

    _flatten_tree = _flattree.flatten
else:
    from jax._src.tree_util import FlatTree as _FlatTree  # type: ignore[attr-defined]  # JAX 0.10

    _flatten_tree = _FlatTree.flatten


ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr
JaxprEqn = jex_core.JaxprEqn
Literal = jex_core.Literal
DropVar = jex_core.DropVar
Primitive = jex_core.Primitive
Var = jex_core.Var
jaxpr_as_fun = jex_core.jaxpr_as_fun

_prims = jex_core.primitives
jit_p = _prims.jit_p
closed_call_p = _prims.closed_call_p
remat_p = _prims.remat_p
scan_p = _prims.scan_p
while_p = _prims.while_p
cond_p = _prims.cond_p
custom_jvp_call_p = _prims.custom_jvp_call_p
custom_vjp_call_p = _prims.custom_vjp_call_p


try:  # shard_map_p is not (yet) part of jax.extend.
    from jax._src.shard_map import shard_map_p
except ImportError:  # pragma: no cover - very old layouts
    from jax.experimental.shard_map import shard_map_p  # type: ignore


def abstract_value(x: Any) -> Any:
    """The abstract value (shape, dtype, weak type, sharding, vma) of `x`."""
    return jax.typeof(x)


def shaped_array(shape: Sequence[int], dtype: Any) -> Any:
    """An abstract value of `shape` and `dtype` (no sharding): a stand-in for an operand not at hand."""
    return _core.ShapedArray(tuple(shape), dtype)


def with_dtype(aval: Any, dtype: Any) -> Any:
    """`aval` with its dtype replaced (weak type dropped when the dtype changes)."""
    if aval.dtype == dtype:
        return aval
    return aval.update(dtype=dtype, weak_type=False)


def _scope_names(name_stack: Any) -> tuple[str, ...]:
    # Transform entries ("jvp", "transpose", "vmap") are not user scopes.
    return tuple(entry.name for entry in name_stack.stack if isinstance(entry, _source_info.Scope))


def eqn_scopes(eqn: JaxprEqn) -> tuple[str, ...]:
    """The `jax.named_scope` names recorded on an equation, outermost first.

    Relative to the jaxpr the equation belongs to: a body traced inside
    ``jax.jit`` records only the scopes opened inside it.
    """
    return _scope_names(eqn.source_info.name_stack)


def eqn_transposed(eqn: JaxprEqn) -> bool:
    """Whether `eqn` belongs to a backward pass: JAX's transpose marked its name stack."""
    return any(
        isinstance(entry, _source_info.Transform) and entry.name == "transpose"
        for entry in eqn.source_info.name_stack.stack
    )


def ambient_scopes() -> tuple[str, ...]:
    """The named scopes active where the caller is running, outermost first."""
    return _scope_names(_source_info.current_name_stack())


@_internal
def outside_traces() -> Any:
    """A context in which JAX computes eagerly, whatever traces enclose the caller (jit, grad, linearize).

    `jax.ensure_compile_time_eval` leaves a differentiation trace in place, and
    a `jax.Ref` made under one is that trace's: a value to keep across calls is
    made here.
    """
    return _core.eval_context()


def eager_trace_context() -> Any:
    """JAX's tracing configuration if the caller runs eagerly, else None.

    The configuration (x64, matmul precision, axis environment...) is what
    `jax.jit` keys its cache on besides the arguments; None when a JAX
    transformation is active, or when this JAX moved these internals (amp then
    simply does not cache eager calls).
    """
    try:
        if not _core.trace_ctx.is_top_level():
            return None
        return _config.trace_context()
    except _DRIFT_ERRORS:  # pragma: no cover - future JAX
        return None


def _enclosing_traces() -> Iterator[Any]:
    """The caller's trace and those around it, innermost first."""
    trace = _core.trace_ctx.trace
    while trace is not None:
        yield trace
        trace = getattr(trace, "parent_trace", None)


def staging() -> bool:
    """Whether the caller runs where values are staged into a program (under `jax.jit`, a scan body...).

    False eagerly, and under transformations that compute as they go (eager
    `jax.grad` or `jax.vmap`): there, a concrete array the caller holds is
    read anew on each call, while a staged program keeps it as a constant.
    """
    try:
        return any(isinstance(t, _pe.DynamicJaxprTrace) for t in _enclosing_traces())
    except _DRIFT_ERRORS:  # pragma: no cover - future JAX
        return False


# Staging traces whose programs are control flow or remat inside the caller's
# computation (`DebugInfo.traced_for`), not a compiled function of its own.
_CONTROL_FLOW_TRACES = frozenset({"scan", "checkpoint / remat", "cond", "while_body", "while_cond", "switch"})


def compiling() -> bool:
    """Whether the caller runs inside a function JAX compiles and caches as a whole (`jax.jit`, `pmap`...).

    `staging`, less the bodies of `lax.scan`, `lax.cond`, `lax.while_loop`
    and `jax.checkpoint` called eagerly: those run as they are traced, while
    a jit'd function's constants are kept for its later calls. True wherever
    the kind of trace cannot be read.
    """
    try:
        return any(
            isinstance(t, _pe.DynamicJaxprTrace)
            and getattr(getattr(t.frame, "debug_info", None), "traced_for", None) not in _CONTROL_FLOW_TRACES
            for t in _enclosing_traces()
        )
    except _DRIFT_ERRORS:  # pragma: no cover - future JAX
        return staging()


def mapped() -> bool:
    """Whether the caller runs under `jax.vmap` (a batching trace encloses it): values may be one per example."""
    from jax._src.interpreters import batching

    try:
        return any(isinstance(t, batching.BatchTrace) for t in _enclosing_traces())
    except _DRIFT_ERRORS:  # pragma: no cover - future JAX
        return True  # unknown: the caller takes the path that is right under vmap too


def forward_mode() -> bool:
    """Whether the caller runs under forward-mode differentiation (`jax.jvp`, `jacfwd`, `hessian`).

    Reverse mode (`jax.grad`, `jax.vjp`) linearizes with its own trace, so a
    JVP trace around the caller is forward mode. False where reverse mode
    still runs on JVP traces (``jax_use_direct_linearize`` off) or the traces
    cannot be read.
    """
    if not getattr(jax.config, "jax_use_direct_linearize", True):
        return False
    try:
        return any(isinstance(t, _ad.JVPTrace) for t in _enclosing_traces())
    except _DRIFT_ERRORS:  # pragma: no cover - future JAX
        return False


class eqn_source:
    """Re-emit under `eqn`'s traceback and name stack, as `jax.core.eval_jaxpr` does.

    Keeps user source lines and named scopes on the rewritten program, so nested
    amp calls, profilers and `jaxamp.explain` still see them. A class rather
    than a generator context manager: it is entered once per equation.
    """

    __slots__ = ("_managers",)

    def __init__(self, eqn: JaxprEqn):
        name_stack = _source_info.current_name_stack() + eqn.source_info.name_stack
        self._managers = (
            _source_info.user_context(eqn.source_info.traceback, name_stack=name_stack),
            eqn.ctx.manager,
        )

    def __enter__(self) -> None:
        outer, inner = self._managers
        outer.__enter__()
        try:
            inner.__enter__()
        except BaseException:
            outer.__exit__(*sys.exc_info())
            raise

    def __exit__(self, *exc: object) -> None:
        outer, inner = self._managers
        try:
            inner.__exit__(*exc)
        finally:
            outer.__exit__(*exc)


def eqn_user_frame(eqn: JaxprEqn) -> Any:
    """The innermost user (non-JAX, non-stdlib) frame that emitted `eqn`, or None.

    Has ``file_name``, ``function_name`` and ``start_line``.
    """
    return _source_info.user_frame(eqn.source_info.traceback)


def frame_line(frame: Any) -> str | None:
    """``"file.py:123 (function)"`` for a frame from `eqn_user_frame`, or None."""
    if frame is None:
        return None
    return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"


def _debug_info(name: str, num_args: int | None = None) -> Any:
    # JAX 0.10.0's while-loop JVP concatenates `arg_names`: give one per input.
    arg_names = None if num_args is None else ("",) * num_args
    return _lu.DebugInfo("jaxamp", name, arg_names, None)


def wrap_fun(fn: Callable, like: Any = None, name: str = "amp", num_args: int | None = None) -> Any:
    """Wrap a Python callable as the `WrappedFun` that primitives' subfuns expect."""
    debug_info = getattr(like, "debug_info", None) or _debug_info(name, num_args)
    return _lu.wrap_init(fn, debug_info=debug_info)


def trace_to_closed_jaxpr(fn: Callable, in_avals: Sequence[Any]) -> ClosedJaxpr:
    """Trace ``fn(*args)`` (flat in, flat out) at `in_avals` in the current context.

    Unlike `jax.make_jaxpr` this keeps the caller's axis environment and mesh, so
    bodies of loops inside `shard_map` or `vmap` with collectives trace correctly.
    """
    in_avals = list(in_avals)
    fun = wrap_fun(fn, name=getattr(fn, "__name__", "amp_body"), num_args=len(in_avals))
    jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(fun, in_avals)
    return ClosedJaxpr(jaxpr, consts)


def _inlined_while_tracing(params: dict) -> bool:
    inline = params.get("inline")
    if HAS_INLINE_ENUM:
        return inline == jax.Inline.JAX_EARLY
    return inline is True


class _CallKeepingTrace(_pe.DynamicJaxprTrace):
    """A jaxpr trace that records calls of inline jit'd functions as calls.

    JAX inlines the body of a ``jit(..., inline=True)`` function (most of
    ``jax.numpy``) into the jaxpr being traced. Under ``jax.grad`` it first
    linearizes that body once per distinct jaxpr and reuses the result at every
    call site; a jaxpr in which all of them are already inlined is linearized
    equation by equation instead, which made a 12-layer GPT trace 1.8x slower
    under amp than without it. Kept as ``jit`` equations (their ``inline`` flag
    untouched), amp rewrites each distinct body once and binds it as a call, so
    JAX's caches hit as they do for the user's own program, and JAX still inlines
    it wherever amp binds it inside a jaxpr trace.
    """

    def process_primitive(self, primitive, tracers, params, /):
        if primitive is not jit_p or not _inlined_while_tracing(params) or _needs_inlining(tracers, params):
            return super().process_primitive(primitive, tracers, params)
        source_info = _source_info.current()
        tracers = [self.to_jaxpr_tracer(t, source_info=source_info) for t in tracers]
        return self.default_process_primitive(primitive, tracers, params, source_info=source_info)


def _needs_inlining(tracers: Sequence[Any], params: dict) -> bool:
    # Mutable references and "high" (hijax) types need JAX's own staging rule,
    # and compiler options on a nested jit are an error it reports.
    jaxpr = params["jaxpr"]
    return bool(
        params.get("compiler_options_kvs")
        or getattr(jaxpr.jaxpr, "is_high", False)
        or any(isinstance(c, _core.Ref) for c in jaxpr.consts)
        or any(isinstance(jax.typeof(t), _AbstractRef) for t in tracers)
    )


def trace_keeping_calls(fn: Callable, in_avals: Sequence[Any]) -> ClosedJaxpr:
    """`trace_to_closed_jaxpr`, with calls of inline jit'd functions kept as calls.

    For amp's trace of the user's function (see `_CallKeepingTrace`). Equivalent
    to JAX's ``trace_to_jaxpr_dynamic`` with the call-keeping trace; on a JAX
    whose tracing internals moved, falls back to the ordinary trace (correct,
    only slower to differentiate).
    """
    in_avals = list(in_avals)
    fun = wrap_fun(fn, name=getattr(fn, "__name__", "amp_fn"), num_args=len(in_avals))
    try:
        trace = _CallKeepingTrace(fun.debug_info, parent_trace=_core.trace_ctx.trace)
    except _DRIFT_ERRORS:  # pragma: no cover - future JAX
        return trace_to_closed_jaxpr(fn, in_avals)
    # As trace_to_jaxpr_dynamic: the equations' metadata is rooted here, not at
    # the caller's name stack and traceback.
    with (
        _core.ensure_no_leaks(trace),
        _source_info.reset_name_stack(),
        _pe.TracebackScope(),
    ):
        source_info = _source_info.current()
        in_tracers = [trace.new_arg(a, source_info=source_info) for a in in_avals]
        with _core.set_current_trace(trace):
            out = fun.call_wrapped(*in_tracers)
        out_tracers = [trace.to_jaxpr_tracer(x, source_info=source_info) for x in out]
        jaxpr, consts = trace.frame.to_jaxpr(trace, out_tracers, fun.debug_info, source_info)
        del trace, in_tracers, out_tracers, out
    return ClosedJaxpr(jaxpr, consts)


def trace_to_jaxpr_with_consts_as_inputs(fn: Callable, in_avals: Sequence[Any]) -> tuple[ClosedJaxpr, list[Any]]:
    """Like `trace_to_closed_jaxpr`, with the constants moved to leading inputs.

    Loop primitives take their constants as operands (``num_consts``), not
    closed over.
    """
    return consts_as_inputs(trace_to_closed_jaxpr(fn, in_avals))


def consts_as_inputs(closed: ClosedJaxpr) -> tuple[ClosedJaxpr, list[Any]]:
    """`closed` taking its constants as leading inputs, and those constants."""
    return ClosedJaxpr(_pe.convert_constvars_jaxpr(closed.jaxpr), ()), list(closed.consts)


def bind_remat(program: ClosedJaxpr, consts: Sequence[Any], args: Sequence[Any], policy: Callable) -> list:
    """``jax.checkpoint(program, policy=policy)(*args)``, binding JAX's remat primitive directly.

    `program` takes its constants as leading inputs (see
    `trace_to_jaxpr_with_consts_as_inputs`). Binding the same jaxpr object at
    every call, as `jax.checkpoint` (which traces afresh) cannot, lets JAX's
    caches of its derivatives (JVP, partial evaluation, transpose: keyed by the
    jaxpr) serve every call.
    """
    return remat_p.bind(*consts, *args, jaxpr=program.jaxpr, prevent_cse=True, differentiated=False, policy=policy)


@_internal
def scan_layout(params: dict) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a scan equation (see `HAS_FLATTREE`)."""
    if not HAS_FLATTREE:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


@_internal
def scan_params_with_extra_consts(params: dict, jaxpr: ClosedJaxpr, num_extra: int) -> dict:
    """Scan parameters for `jaxpr`, which takes `num_extra` new leading constants."""
    new = dict(params, jaxpr=jaxpr)
    if num_extra == 0:
        return new
    if not HAS_FLATTREE:
        new["num_consts"] = params["num_consts"] + num_extra
        if "linear" in params:  # dropped from scan's parameters in later releases
            new["linear"] = (False,) * num_extra + tuple(params["linear"])
        return new
    consts, carry, xs = params["ft_in"].unpack()
    # The same grouping JAX's own scan partial-eval uses for added residuals.
    new["ft_in"] = _flattree.pack(((_flattree.nones(num_extra), consts), carry, xs))
    return new


@_internal
def shard_map_body(
    eqn_params: dict,
    body: Callable,
    extra_out_specs: Callable[[], Sequence[Any]] = tuple,
    extra_in_specs: Sequence[Any] = (),
) -> dict:
    """Bind parameters for `shard_map_p` whose body runs ``body(*args) -> outs``.

    `shard_map_p.get_bind_params` turns the stored jaxpr into a sub-function
    returning a `FlatTree` tagged with the output specs; we swap in our own body
    with the same return convention (`body` is only called later, by JAX).
    `extra_out_specs()`, asked after `body` has run, gives the specs of the
    outputs `body` returns after the equation's own; `extra_in_specs` those of
    the inputs it takes before the equation's own.
    """
    params = shard_map_p.get_bind_params(eqn_params)
    if extra_in_specs:
        params["in_specs"] = (*extra_in_specs, *params["in_specs"])
        if params.get("debug_info") is not None:  # its argument names no longer line up
            params["debug_info"] = params["debug_info"].with_unknown_names()

    def run(*args):
        outs = list(body(*args))
        return _flatten_tree(outs).with_aux((*eqn_params["out_specs"], *extra_out_specs()))

    params["subfuns"] = (run,)
    return params


@_internal
def jit_params_with_extra_outputs(params: dict, jaxpr: ClosedJaxpr, num_extra: int) -> dict:
    """`jit_p` parameters for `jaxpr`, which returns `num_extra` outputs after the equation's own."""
    from jax._src.sharding_impls import UNSPECIFIED

    return dict(
        params,
        jaxpr=jaxpr,
        out_shardings=(*params["out_shardings"], *(UNSPECIFIED,) * num_extra),
        out_layouts=(*params["out_layouts"], *(None,) * num_extra),
    )


@_internal
def call_params_with_extra_inputs(primitive: Any, params: dict, jaxpr: ClosedJaxpr, num_extra: int) -> dict:
    """Parameters of a `jit_p` or `closed_call_p` equation whose body `jaxpr` takes `num_extra` new leading inputs.

    The new inputs are unsharded-unspecified, not donated and laid out by XLA.
    """
    if primitive is closed_call_p:
        return dict(params, call_jaxpr=jaxpr)
    from jax._src.sharding_impls import UNSPECIFIED

    return dict(
        params,
        jaxpr=jaxpr,
        in_shardings=(*(UNSPECIFIED,) * num_extra, *params["in_shardings"]),
        in_layouts=(*(None,) * num_extra, *params["in_layouts"]),
        donated_invars=(*(False,) * num_extra, *params["donated_invars"]),
    )


@_internal
def shard_map_mesh_axes(eqn_params: dict) -> tuple[tuple[Any, int], ...]:
    """``((name, size), ...)`` of the mesh axes a `shard_map` equation makes manual (runs per device over)."""
    mesh = eqn_params["mesh"]
    # 0.11 renamed ``manual_axes`` to ``newly_manual_axes``.
    manual = eqn_params["newly_manual_axes" if "newly_manual_axes" in eqn_params else "manual_axes"]
    return tuple((name, size) for name, size in mesh.shape.items() if name in manual)


def is_differentiation_tracer(x: Any) -> bool:
    """Whether `x` is being differentiated (a JVP or linearize tracer)."""
    from jax._src.interpreters import ad

    return isinstance(x, (ad.JVPTracer, getattr(ad, "LinearizeTracer", ad.JVPTracer)))


def differentiation_depth(x: Any) -> int:
    """How many differentiations (JVP or linearize traces, nested) `x` is traced under.

    1 under `jax.grad` or `jax.jvp`; 2 under a Hessian or `jax.jvp` of
    `jax.grad`. `vmap` levels between them are looked through.
    """
    from jax._src.interpreters import ad, batching

    differentiating = (ad.JVPTracer, getattr(ad, "LinearizeTracer", ad.JVPTracer))
    depth = 0
    while True:
        if isinstance(x, differentiating):
            depth, x = depth + 1, x.primal
        elif isinstance(x, batching.BatchTracer):
            x = x.val
        else:
            return depth


@_internal
def custom_jvp_subfuns(eqn_params: dict) -> tuple[dict, Any, Any]:
    """Split `custom_jvp_call` params into bind params, the primal jaxpr and the jvp thunk."""
    params = dict(eqn_params)
    call_jaxpr = params.pop("call_jaxpr")
    num_consts = params.pop("num_consts")
    jvp_jaxpr_fun = params.pop("jvp_jaxpr_fun", None) or params.pop("jvp_jaxpr_thunk")
    return params, (call_jaxpr, num_consts), jvp_jaxpr_fun


@_internal
def custom_vjp_subfuns(eqn_params: dict) -> tuple[dict, Any, Any, Any]:
    """Split `custom_vjp_call` params into bind params, primal jaxpr, fwd thunk and bwd.

    The bwd returned already accounts for constants (zero cotangents for them),
    as JAX's own `get_bind_params` arranges.
    """
    from jax._src.custom_derivatives import _handle_consts_in_bwd

    params = dict(eqn_params)
    call_jaxpr = params.pop("call_jaxpr")
    num_consts = params.pop("num_consts")
    fwd_jaxpr_thunk = params.pop("fwd_jaxpr_thunk")
    const_avals = call_jaxpr.in_avals[:num_consts]
    bwd = _handle_consts_in_bwd(params.pop("bwd"), const_avals)
    return params, (call_jaxpr, num_consts), fwd_jaxpr_thunk, bwd


@_internal
def rule_jaxpr(jaxpr: Jaxpr, consts: Sequence[Any]) -> ClosedJaxpr:
    """A custom rule's traced ``(jaxpr, consts)`` as one `ClosedJaxpr`.

    For the results of a custom_jvp call's ``jvp_jaxpr_fun`` and a custom_vjp
    call's ``fwd_jaxpr_thunk``. On JAX 0.10 the jaxpr's constvars pair with
    `consts`; from 0.12 (jaxprs carry their constants) the thunks trace with
    ``trace_to_jaxpr_dynamic``, whose jaxpr has no constvars: its constants are
    its leading plain inputs, as ``core.eval_jaxpr(jaxpr, consts, *args)``
    reads them, and `ClosedJaxpr` attaches them. Either way the result's
    ``.jaxpr.constvars`` pair with its ``.consts`` and its ``.jaxpr.invars``
    are the rule's own inputs, as `interpret` expects.
    """
    consts = list(consts)
    closed = ClosedJaxpr(jaxpr, consts)
    if len(closed.jaxpr.constvars) != len(consts):
        raise TypeError(f"{len(consts)} constants for {len(closed.jaxpr.constvars)} constvars")
    return closed


def unpack_bwd_result(result: Any) -> tuple[list, Any]:
    """``(cotangents, logs)`` from a custom_vjp bwd sub-function's result."""
    if BWD_RETURNS_LOGS:
        cts, logs = result
        return list(cts), logs
    return list(result), None


def pack_bwd_result(cts: list, logs: Any) -> Any:
    """The inverse of `unpack_bwd_result`."""
    return (cts, logs) if BWD_RETURNS_LOGS else cts


def tangent_aval(aval: Any) -> Any:
    return aval.to_tangent_aval()


def is_zero(x: Any) -> bool:
    """Whether `x` is one of JAX's symbolic zero cotangents/tangents."""
    return isinstance(x, (Zero, SymbolicZero))


# Call-like primitives whose operands are their body's inputs one for one, each
# with the parameter that holds the body.
_CALL_BODY_PARAMS: dict[Any, str] = {
    jit_p: "jaxpr",
    closed_call_p: "call_jaxpr",
    remat_p: "jaxpr",
    custom_jvp_call_p: "call_jaxpr",
    custom_vjp_call_p: "call_jaxpr",
}


def call_body(eqn: JaxprEqn) -> Jaxpr | None:
    """The open body jaxpr of a call-like equation (jit, remat, custom rules' primal), or None."""
    param = _CALL_BODY_PARAMS.get(eqn.primitive)
    body = eqn.params.get(param) if param is not None else None
    return getattr(body, "jaxpr", body)


def primitives_in(modules: Sequence[Any]) -> dict[str, Primitive]:
    # A module also holds the primitives it imports: the first module seen
    # naming a primitive wins, so list defining modules first.
    found: dict[str, Primitive] = {}
    for module in modules:
        for obj in vars(module).values():
            if isinstance(obj, Primitive):
                found.setdefault(obj.name, obj)
    return found


def lax_modules() -> list[Any]:
    import pkgutil

    import jax._src.lax as lax_pkg

    return [
        importlib.import_module(info.name) for info in pkgutil.walk_packages(lax_pkg.__path__, f"{lax_pkg.__name__}.")
    ]


_PRIMITIVE_MODULES = (
    "jax._src.core",  # pvary, reduced_vary_cast, mutable arrays
    "jax._src.ad_util",  # add_any, zeros_like, stop_gradient
    "jax._src.pjit",  # sharding_constraint, reshard, layout_constraint, relayout
    "jax._src.dispatch",  # device_put
    "jax._src.shard_alike",  # shard_alike (to 0.11.1)
    "jax._src.ad_checkpoint",  # name: jax.ad_checkpoint.checkpoint_name
    "jax._src.hijax",  # call_hi_primitive: primitives defined in Python
    "jax._src.state.primitives",  # reads and writes of mutable arrays
    "jax._src.callback",  # pure_callback, io_callback
    "jax._src.debugging",  # debug_callback, debug_print, inspect_sharding
    "jax._src.buffer_callback",
    "jax._src.ffi",  # ffi_call
    "jax._src.pallas.pallas_call",
    "jax._src.cudnn.fused_attention_stablehlo",  # cuDNN attention
    "jax._src.cudnn.scaled_matmul_stablehlo",
    "jax._src.random.prng",  # key operations (from 0.10.2)
    "jax._src.random.core",  # random_gamma, random_clone (from 0.10.2)
    "jax._src.random.threefry2x32",  # (from 0.10.2)
    "jax._src.prng",  # key operations, threefry2x32 (to 0.10.1)
    "jax._src.random",  # random_gamma, random_clone (to 0.10.1)
)


@functools.cache
def primitives_by_name() -> dict[str, Primitive]:
    """Every primitive of the lax package and of the other modules defining ones programs bind, by name.

    The primitives of the lax package (`lax_modules`) plus ``pvary``, ``name``
    (`jax.ad_checkpoint.checkpoint_name`), callbacks, ``ffi_call``,
    ``pallas_call``, cuDNN kernels, sharding and random-key primitives. Imports
    those modules not imported yet (Pallas's among them). Computed once: do not
    modify the result.
    """
    modules = lax_modules()
    for name in _PRIMITIVE_MODULES:
        try:
            modules.append(importlib.import_module(name))
        except ImportError:
            continue
    return primitives_in(modules)


# --- benchmarks ---
def saved_residuals(fn: Callable, *args: Any) -> list[tuple[Any, str]]:
    """The values reverse-mode differentiation of ``fn(*args)`` keeps for the backward pass.

    What `jax.ad_checkpoint.print_saved_residuals` prints, as data: one
    ``(aval, description)`` per residual, the description saying where it comes
    from (an argument, a constant, or the primitive and source line producing it).
    Arguments may be `jax.ShapeDtypeStruct`s: nothing is computed.
    """
    from jax._src.ad_checkpoint import saved_residuals as _saved_residuals

    return _saved_residuals(fn, *args)


# --- matmul cotangents (jaxamp/transform/_accumulation.py, jaxamp/fp8/_matmul.py) ---
# JAX's own transpose rule of a matmul, called with the operands amp holds (half
# precision, or float8) and the accumulation dtype amp wants: the same dimension
# numbers, output shardings and varying axes as JAX's autodiff would give, at
# the operand types of this call (nothing traced elsewhere, nothing cached).


@_internal
def matmul_cotangents(
    primitive: Any,
    g: Any,
    lhs: Any,
    rhs: Any,
    rest: Sequence[Any],
    params: dict,
    dtype: Any = None,
    only: str | None = None,
) -> tuple[Any, Any]:
    """``(d_lhs, d_rhs)`` of ``primitive.bind(lhs, rhs, *rest, **params)`` for cotangent `g`.

    `primitive`'s registered transpose rule (``dot_general``,
    ``conv_general_dilated``, ``ragged_dot_general``) evaluated on the given
    operands; ``params["preferred_element_type"]`` is the gradient matmuls'
    accumulation dtype. Each cotangent is returned in `dtype`, or in its
    operand's dtype when `dtype` is None (the rule converts at the end).
    With ``only="lhs"`` (``"rhs"``) the other cotangent is not computed: None,
    and the side computed may be given as its abstract value alone.
    """
    rule = _ad.primitive_transposes[primitive]

    def undefined(x: Any) -> Any:
        aval = x if isinstance(x, _core.AbstractValue) else jax.typeof(x)
        return _ad.UndefinedPrimal(aval if dtype is None else with_dtype(aval, dtype))

    d_lhs = rule(g, undefined(lhs), rhs, *rest, **params)[0] if only != "rhs" else None
    d_rhs = rule(g, lhs, undefined(rhs), *rest, **params)[1] if only != "lhs" else None
    return d_lhs, d_rhs


@_internal
def zeros_like_aval(aval: Any) -> jax.Array:
    """Zeros of `aval`'s full type: shape, dtype, sharding and varying axes."""
    from jax._src.ad_util import zeros_like_aval as _zeros_like_aval

    return _zeros_like_aval(aval)
