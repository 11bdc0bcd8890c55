"""Every JAX internal jaxamp touches, and every difference between JAX versions.

The interpreter must re-emit equations with their source information, trace new
bodies for higher-order primitives in the *current* context (axis names, meshes,
outer transformations), and rebuild the sub-functions that custom-derivative and
shard_map primitives bind with. JAX has no public API for these, so they live
here: a JAX upgrade should touch this file and nothing else.

Supported: JAX 0.10.x through 0.12.x (see ``pyproject.toml``). Differences
between versions are detected once, at import, as the named flags below; the
accessors a handler calls raise `JaxInternalsChanged` when an internal they
read has moved, which is the only error amp turns into a fallback.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex_core
from jax._src import config as _config
from jax._src import core as _core
from jax._src import linear_util as _lu
from jax._src import source_info_util as _source_info
from jax._src.ad_util import SymbolicZero, Zero
from jax._src.interpreters import partial_eval as _pe
from jax._src.interpreters.ad import CustomVJPException
from jax._src.state.types import AbstractRef as _AbstractRef
from jax.sharding import PartitionSpec as P

__all__ = [
    "BWD_RETURNS_LOGS",
    "HAS_FLATTREE",
    "HAS_INLINE_ENUM",
    "CatalogueOp",
    "ClosedJaxpr",
    "CustomVJPException",
    "DropVar",
    "JaxInternalsChanged",
    "Jaxpr",
    "JaxprEqn",
    "Literal",
    "Primitive",
    "SymbolicZero",
    "Var",
    "Zero",
    "abstract_value",
    "bind_remat",
    "ambient_scopes",
    "call_body",
    "closed_call_p",
    "cond_p",
    "custom_jvp_call_p",
    "custom_jvp_subfuns",
    "custom_vjp_call_p",
    "custom_vjp_subfuns",
    "eager_trace_context",
    "eqn_scopes",
    "eqn_source",
    "eqn_transposed",
    "eqn_user_frame",
    "frame_line",
    "has_nnx_objects",
    "is_differentiation_tracer",
    "is_zero",
    "jit_params_with_extra_outputs",
    "jaxpr_as_fun",
    "jit_p",
    "lax_op_catalogue",
    "lax_primitives_by_name",
    "legacy_context_mesh",
    "linear_call_p",
    "manual_axes",
    "mark_varying",
    "matmul_cotangents",
    "nnx_flatten",
    "nnx_is_object",
    "nnx_iter_graph",
    "nnx_raw_value",
    "nnx_split",
    "pack_bwd_result",
    "primitives_by_name",
    "remat_p",
    "saved_residuals",
    "scan_layout",
    "scan_p",
    "scan_params_with_extra_consts",
    "shard_map_body",
    "shard_map_mesh_axes",
    "shard_map_p",
    "tangent_aval",
    "trace_keeping_calls",
    "trace_to_closed_jaxpr",
    "trace_to_jaxpr_with_consts_as_inputs",
    "tracks_varying_axes",
    "unpack_bwd_result",
    "varying_axes",
    "while_p",
    "with_dtype",
    "wrap_fun",
    "zeros_like_aval",
]

# jaxamp's frames are never the user's line: equations amp emits (and calls its
# forward trace records) are attributed to the user code beneath them, as
# JAX's own frames are.
_source_info.register_exclusion(os.path.dirname(os.path.abspath(__file__)) + os.sep)

# --- version flags: what changed between supported JAX releases -------------

# 0.11: scan stores its operand layout as a `FlatTree` (``ft_in``: constants,
# carry, xs) instead of ``num_consts``/``num_carry``; shard_map's sub-function
# returns a `jax._src.flattree` tree instead of `tree_util.FlatTree`.
HAS_FLATTREE = importlib.util.find_spec("jax._src.flattree") is not None
# 0.11: custom_vjp backward rules may return logs, so bwd returns (cts, logs).
BWD_RETURNS_LOGS = hasattr(jax.custom_vjp, "defvjp_with_logs")
# 0.11: ``jit(inline=True)`` means "inline at lowering"; inlining while tracing
# (what jax.numpy asks for) is ``inline=Inline.JAX_EARLY``. 0.10 has only the bool.
HAS_INLINE_ENUM = hasattr(jax, "Inline")

if HAS_FLATTREE:
    from jax._src import flattree as _flattree

    _flatten_tree = _flattree.flatten
else:
    from jax._src.tree_util import FlatTree as _FlatTree

    _flatten_tree = _FlatTree.flatten


class JaxInternalsChanged(RuntimeError):
    """A JAX internal amp relies on has moved in this JAX release.

    Raised only by this module's accessors, never for errors in user code or
    in policy rules, so the evaluation loop can fall back (with a warning) for
    exactly this case and let everything else propagate.
    """


# What moving an internal looks like from the outside.
_DRIFT_ERRORS: tuple[type[BaseException], ...] = (ImportError, AttributeError, KeyError, TypeError)


def _internal(fn: Callable) -> Callable:
    # For accessors that read JAX internals and call no user code: any of the
    # errors above raised inside them can only mean the internals moved.
    @functools.wraps(fn)
    def accessor(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except _DRIFT_ERRORS as err:
            raise JaxInternalsChanged(f"{fn.__name__}: {type(err).__name__}: {err}") from err

    return accessor


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

from jax._src.custom_derivatives import linear_call_p  # noqa: E402  (not part of jax.extend)

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
    return tuple(
        entry.name
        for entry in name_stack.stack
        if isinstance(entry, _source_info.Scope)
    )


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

    def __exit__(self, *exc: object) -> bool:
        outer, inner = self._managers
        try:
            inner.__exit__(*exc)
        finally:
            outer.__exit__(*exc)
        return False


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
        if primitive is not jit_p or not _inlined_while_tracing(params) or _needs_inlining(
            tracers, params
        ):
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


def trace_to_jaxpr_with_consts_as_inputs(
    fn: Callable, in_avals: Sequence[Any]
) -> tuple[ClosedJaxpr, list[Any]]:
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
    return remat_p.bind(
        *consts, *args, jaxpr=program.jaxpr, prevent_cse=True, differentiated=False, policy=policy
    )


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


def mark_varying(x: Any, axes: Sequence[Any]) -> Any:
    """`x` typed as varying over the manual `axes` (a no-op where types carry no varying axes)."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    if not missing or not tracks_varying_axes():
        return x
    return jax.lax.pcast(x, missing, to="varying")


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


def _primitives_in(modules: Sequence[Any]) -> dict[str, Primitive]:
    # A module also holds the primitives it imports: the first module seen
    # naming a primitive wins, so list defining modules first.
    found: dict[str, Primitive] = {}
    for module in modules:
        for obj in vars(module).values():
            if isinstance(obj, Primitive):
                found.setdefault(obj.name, obj)
    return found


def _lax_modules() -> list[Any]:
    import pkgutil

    import jax._src.lax as lax_pkg

    return [
        importlib.import_module(info.name)
        for info in pkgutil.walk_packages(lax_pkg.__path__, f"{lax_pkg.__name__}.")
    ]


def lax_primitives_by_name() -> dict[str, Primitive]:
    """Every primitive of JAX's lax package (``jax._src.lax`` and its subpackages), by name.

    Several (collectives, linear algebra, special functions, control flow) are
    not re-exported from `jax.lax`.
    """
    return _primitives_in(_lax_modules())


# Modules outside the lax package that define primitives programs bind,
# directly or through jax.numpy, jax.random, callbacks and kernels. Some exist
# only on the releases noted; a module this release lacks, or cannot import
# (Pallas without its dependencies), is skipped, and tests/test_default_table.py
# names the table entries that then resolve to nothing.
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

    `lax_primitives_by_name` plus ``pvary``, ``name``
    (`jax.ad_checkpoint.checkpoint_name`), callbacks, ``ffi_call``,
    ``pallas_call``, cuDNN kernels, sharding and random-key primitives. Imports
    those modules not imported yet (Pallas's among them). Computed once: do not
    modify the result.
    """
    modules = _lax_modules()
    for name in _PRIMITIVE_MODULES:
        try:
            modules.append(importlib.import_module(name))
        except ImportError:
            continue
    return _primitives_in(modules)


class CatalogueOp(NamedTuple):
    """One operation of JAX's own catalogue of lax operations (`lax_op_catalogue`)."""

    name: str  # the jax.lax function, or "reduce[<primitive>, init=<value>]" for lax.reduce
    fn: Callable[..., Any]  # takes `nargs` arrays of one dtype
    nargs: int
    dtypes: tuple[Any, ...]  # numpy dtypes JAX's own tests run it with


def lax_op_catalogue() -> list[CatalogueOp]:
    """Every operation JAX's own lax tests sweep, with the operand dtypes each accepts.

    Read from ``jax._src.internal_test_util.lax_test_util``, which ships with
    JAX: ``lax_ops`` (elementwise operations by `jax.lax` name),
    ``lax_reduce_ops`` (`jax.lax.reduce` with an initial value and computation
    JAX recognises as a monoid, so it binds ``reduce_sum``, ``reduce_max``...),
    ``lax_named_reduce_ops`` (`jax.lax.reduce_sum`...) and
    ``lax_out_dtype_ops``. An operation listed in several of its records
    (``sqrt`` for floats and for complex numbers) is one entry with their dtypes
    merged. Reductions reduce over axis 0. The dtypes are those of the default
    backend that JAX runs as such: 64-bit types only with ``jax_enable_x64``
    (an operation left with none is omitted). Raises when the module has moved
    or dropped one of these lists, so tests built on it fail instead of
    sweeping fewer operations.
    """
    import numpy as np
    from jax._src.internal_test_util import lax_test_util as catalogue

    entries: dict[str, CatalogueOp] = {}

    def add(name: str, fn: Callable[..., Any], nargs: int, dtypes: Sequence[Any]) -> None:
        known = entries[name].dtypes if name in entries else ()
        # Records list 64-bit types whatever jax_enable_x64 says; JAX would
        # silently run those at 32 bits.
        usable = [np.dtype(d) for d in dtypes if jax.dtypes.canonicalize_dtype(d) == np.dtype(d)]
        merged = tuple(dict.fromkeys((*known, *usable)))
        if merged:
            entries[name] = CatalogueOp(name, fn, nargs, merged)

    for record in (*catalogue.lax_ops(), *catalogue.lax_out_dtype_ops()):
        add(record.op, getattr(jax.lax, record.op), record.nargs, record.dtypes)
    for record in catalogue.lax_reduce_ops():
        # One entry per initial value: each is the monoid's identity for its dtypes only.
        name = f"reduce[{record.primitive.name}, init={record.init_val}]"
        add(name, _monoid_reduction(record.op, record.init_val), 1, record.dtypes)
    for record in catalogue.lax_named_reduce_ops():
        add(record.op.__name__, functools.partial(record.op, axes=(0,)), 1, record.dtypes)
    return list(entries.values())


def _monoid_reduction(op: Callable, init_val: Any) -> Callable[[Any], Any]:
    import numpy as np

    def reduce(x: Any) -> Any:
        # A wrapping conversion: -1 stands for all bits set in any integer type.
        return jax.lax.reduce(x, np.array(init_val).astype(x.dtype), op, (0,))

    return reduce


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


def legacy_context_mesh() -> Any:
    """The mesh entered with the deprecated ``with mesh:`` context manager, if any.

    JAX offers no public accessor for it: ``jax.sharding.get_mesh`` and
    ``get_abstract_mesh`` only see meshes set with ``jax.set_mesh``. Older user
    code still says ``with mesh:``, so we read JAX's thread-local resource stack.

    Returns:
        The innermost such mesh, or ``None`` when none is entered or when this JAX
        version no longer has the legacy context (then there is nothing to find).
    """
    from jax.sharding import Mesh

    try:
        from jax._src.mesh import thread_resources
    except ImportError:
        return None
    mesh = getattr(getattr(thread_resources, "env", None), "physical_mesh", None)
    if not isinstance(mesh, Mesh) or mesh.empty:
        return None
    return mesh


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
    from jax._src.interpreters import ad as _ad

    rule = _ad.primitive_transposes[primitive]

    def undefined(x: Any) -> Any:
        aval = x if isinstance(x, _core.AbstractValue) else jax.typeof(x)
        return _ad.UndefinedPrimal(aval if dtype is None else with_dtype(aval, dtype))

    d_lhs = rule(g, undefined(lhs), rhs, *rest, **params)[0] if only != "rhs" else None
    d_rhs = rule(g, lhs, undefined(rhs), *rest, **params)[1] if only != "lhs" else None
    return d_lhs, d_rhs


# --- fp8 scales per shard (jaxamp/fp8/_schemes.py) ---
# On an Explicit mesh an array's type names the mesh axes each dimension is
# split over (`jax.typeof(x).sharding`); on an Auto mesh it names none (XLA
# places the array after tracing), and inside `shard_map` the manual axes are
# not in the spec (the body sees one shard).


def explicit_shards(x: Any) -> dict[int, tuple[int, Any]]:
    """The dimensions of `x` split over Explicit mesh axes: ``{dim: (shards, spec entry)}``.

    Only dimensions whose size the number of shards divides are listed.
    """
    aval = jax.typeof(x)
    sharding = getattr(aval, "sharding", None)
    spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
    if spec is None or mesh is None or not getattr(mesh, "axis_names", ()):
        return {}
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    found = {}
    for dim, entry in enumerate(spec):
        if entry is None or entry == P.UNCONSTRAINED:
            continue
        names = entry if isinstance(entry, tuple) else (entry,)
        if not all(types.get(name) == jax.sharding.AxisType.Explicit for name in names):
            continue
        shards = math.prod(sizes[name] for name in names)
        if shards > 1 and aval.shape[dim] % shards == 0:
            found[dim] = (shards, entry)
    return found


def on_auto_mesh(*xs: Any) -> bool:
    """Whether `xs` run on a mesh of several devices whose axes are all Auto (XLA splits them after tracing).

    The mesh is the operands' (``jax.jit`` of arrays placed with a
    `NamedSharding`) or the context's (``jax.set_mesh``); never inside
    `shard_map`, whose body sees one device's shard.
    """
    if manual_axes():
        return False
    meshes = [getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None) for x in xs]
    for mesh in (*meshes, jax.sharding.get_abstract_mesh()):
        names = getattr(mesh, "axis_names", ())
        if names and math.prod(mesh.axis_sizes) > 1:
            return all(kind == jax.sharding.AxisType.Auto for kind in mesh.axis_types)
    return False


# --- rules in JAX's global tables (jaxamp/fp8) ---------------------------------
# JAX looks up a primitive's batching rule and lowering in process-wide tables.
# Importing jaxamp changes none of them (tests/test_import_side_effects.py):
# fp8 mode installs the rules it needs when it first traces a float8 product,
# for jaxamp's own primitives, and a batching rule for `linear_call` where JAX
# has none; it never replaces a rule another library's operations go through.


def _once(install: Callable[[], None]) -> Callable[[], None]:
    """`install()` run by the first call only, whichever thread makes it."""
    lock = threading.Lock()
    done = False

    @functools.wraps(install)
    def run() -> None:
        nonlocal done
        if done:
            return
        with lock:
            if not done:
                install()
                done = True

    return run


# `jax.custom_derivatives.linear_call` (a linear function with a custom
# transpose) has jvp and transpose rules but, on JAX 0.10-0.12, no batching
# rule, so `jax.jacfwd`, `jax.hessian` and `vmap` of a gradient could not pass
# through one. The rule below batches the function and its transpose alike.


def _linear_call_batcher(axis_data, args, dims, *, callee, transpose_thunk, num_callee_consts, num_res):
    from jax._src.interpreters import batching

    params = dict(callee=callee, transpose_thunk=transpose_thunk, num_callee_consts=num_callee_consts, num_res=num_res)
    if all(d is None for d in dims):
        outs = linear_call_p.bind(*args, **params)
        return outs, [None] * len(outs)
    fixed = num_callee_consts + num_res
    moved = [x if d is None else jax.numpy.moveaxis(x, d, 0) for x, d in zip(args, dims)]
    # Every linear input batched: the transpose gives one cotangent per input.
    moved[fixed:] = [
        x if d is not None else jax.lax.broadcast(x, (axis_data.size,)) for x, d in zip(moved[fixed:], dims[fixed:])
    ]
    fixed_batched = [d is not None for d in dims[:fixed]]
    batched_callee, _ = batching.batch_jaxpr(callee, axis_data, fixed_batched + [True] * (len(args) - fixed), True)

    def batched_transpose():
        transpose, t_consts = transpose_thunk()
        cotangents = len(transpose.in_avals) - len(t_consts) - num_res
        in_batched = [False] * len(t_consts) + fixed_batched[num_callee_consts:] + [True] * cotangents
        return batching.batch_jaxpr(transpose, axis_data, in_batched, True)[0], t_consts

    outs = linear_call_p.bind(*moved, **dict(params, callee=batched_callee, transpose_thunk=batched_transpose))
    return outs, [0] * len(outs)


@_once
def ensure_linear_call_batching() -> None:
    """Give `linear_call` a batching rule, unless JAX has one (call before binding one)."""
    from jax._src.interpreters import batching

    if linear_call_p not in batching.fancy_primitive_batchers:
        batching.fancy_primitive_batchers[linear_call_p] = _linear_call_batcher


class OwnPrimitive:
    """``op(*args, **static)``: ``fn(*args, **static)`` (one array) bound as one equation of a jaxamp primitive.

    The equation holds `fn`'s jaxpr, traced at bind in the caller's context,
    and `static` (hashable). JAX evaluates and lowers it as that jaxpr, except
    that under `jax.export` it lowers ``export(*args, **static)`` instead (for
    an `fn` that cannot be serialized, such as a `custom_partitioning` op,
    whose partitioner runs in this process); ``jax.vmap`` calls
    ``batch(args, dims, **static) -> (out, out_dim)``. The batching rule and
    the lowering go into JAX's tables when the primitive is first bound.
    """

    def __init__(self, name: str, fn: Callable[..., Any], *, batch: Callable[..., Any], export: Callable[..., Any]):
        self._fn, self._batch, self._export = fn, batch, export
        self.primitive = _core.Primitive(name)
        self.primitive.def_impl(lambda *args, call, **static: _core.jaxpr_as_fun(call)(*args)[0])
        self.primitive.def_abstract_eval(lambda *avals, call, **static: call.out_avals[0])
        self._install = _once(self._install_rules)

    def __call__(self, *args: Any, **static: Any) -> Any:
        self._install()
        call = trace_to_closed_jaxpr(lambda *xs: [self._fn(*xs, **static)], [jax.typeof(x) for x in args])
        return self.primitive.bind(*args, call=call, **static)

    def _install_rules(self) -> None:
        from jax._src.interpreters import batching, mlir

        def batched(args: Sequence[Any], dims: Sequence[Any], *, call: Any, **static: Any) -> tuple[Any, Any]:
            return self._batch(args, dims, **static)

        def lowering(ctx: Any, *args: Any, call: Any, **static: Any) -> Any:
            if getattr(ctx.module_context.lowering_parameters, "for_export", False):
                export = functools.partial(self._export, **static)
                return mlir.lower_fun(export, multiple_results=False)(ctx, *args)
            return mlir.lower_fun(_core.jaxpr_as_fun(call), multiple_results=True)(ctx, *args)

        batching.primitive_batchers[self.primitive] = batched
        mlir.register_lowering(self.primitive, lowering)


def dot_general_batch_dims(ndims: tuple[int, int], mapped: tuple[Any, Any], dimension_numbers: Any) -> tuple[Any, int]:
    """``(dimension numbers, result's mapped dim)`` of a ``dot_general`` whose operands gained vmap's `mapped` dims."""
    from jax._src.lax.lax import _dot_general_batch_dim_nums

    return _dot_general_batch_dim_nums(ndims, mapped, dimension_numbers)


# --- devices deciding together (jaxamp/scaling/_finite.py) ---
# Inside `shard_map` (and `jax.pmap`, which JAX 0.10+ runs as a shard_map) the
# abstract mesh names the manual axes, and with ``check_vma=True`` every value's
# type records the manual axes it varies over. Neither has a public accessor on
# 0.10-0.12 (`jax.typeof(x).vma` moved to ``.mat.varying``).


@_internal
def manual_axes() -> tuple[Any, ...]:
    """The mesh axes the caller runs per device over (`shard_map`, `pmap`), or ()."""
    return tuple(jax.sharding.get_abstract_mesh().manual_axes)


@_internal
def tracks_varying_axes() -> bool:
    """Whether values' types record the manual axes they vary over (``check_vma``)."""
    return bool(_config._check_vma.value)


@_internal
def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes over which `x` may differ between devices (its vma)."""
    return varying_axes_of_type(jax.typeof(x))


@_internal
def varying_axes_of_type(aval: Any) -> frozenset:
    """`varying_axes` of a value of type `aval`."""
    mat = getattr(aval, "mat", None)
    return frozenset(getattr(mat, "varying", ())) if mat is not None else frozenset()


@_internal
def zeros_like_aval(aval: Any) -> jax.Array:
    """Zeros of `aval`'s full type: shape, dtype, sharding and varying axes."""
    from jax._src.ad_util import zeros_like_aval as _zeros_like_aval

    return _zeros_like_aval(aval)


# --- flax nnx (jaxamp/transform/_nnx.py) ---
# Called only once the program itself has imported flax.nnx: jaxamp never
# imports flax. flax 0.12 added a tree mode (``nnx.set_graph_mode(False)``, or
# ``graph=False``) that cannot express Variables shared between modules; amp
# needs graph mode whatever the user's default, and releases before it have
# graph mode only, and no ``graph`` argument.


@functools.cache
def _nnx_graph_mode(fn: Callable) -> dict[str, bool]:
    import inspect

    return {"graph": True} if "graph" in inspect.signature(fn).parameters else {}


def nnx_split(node: Any) -> tuple[Any, Any]:
    """``nnx.split(node)`` in graph mode: ``(graphdef, state)``."""
    from flax import nnx

    return nnx.split(node, **_nnx_graph_mode(nnx.split))


def nnx_flatten(node: Any) -> tuple[Any, Any]:
    """``nnx.graph.flatten(node)`` in graph mode: ``(graphdef, flat_state)``.

    `flat_state` iterates as ``(path, leaf)`` pairs in path order, each leaf the
    node's own `nnx.Variable` object (or a bare array attribute), not a copy.
    """
    from flax import nnx

    return nnx.graph.flatten(node, **_nnx_graph_mode(nnx.graph.flatten))


def nnx_iter_graph(node: Any) -> Iterator[tuple[tuple, Any]]:
    """``nnx.iter_graph(node)`` in graph mode: every node and leaf, shared ones once."""
    from flax import nnx

    return nnx.graph.iter_graph(node, **_nnx_graph_mode(nnx.graph.iter_graph))


def nnx_raw_value(leaf: Any) -> Any:
    """The value a flat-state leaf holds: a Variable's raw value, or the leaf itself."""
    from flax import nnx

    if not isinstance(leaf, nnx.Variable):
        return leaf
    if hasattr(leaf, "get_raw_value"):  # flax >= 0.12 (``raw_value`` warns there)
        return leaf.get_raw_value()
    return leaf.raw_value


def has_nnx_objects(tree: Any, variables: bool = True) -> bool:
    """Whether an nnx object (Module, Rngs, Variable...) is among `tree`'s leaves.

    With ``variables=False``, only graph nodes (Modules, Rngs...): a Variable
    (as in the state `nnx.split` returns) flattens like any pytree.
    """
    if "flax.nnx" not in sys.modules:
        return False
    from flax import nnx

    leaves = jax.tree_util.tree_leaves(tree, is_leaf=nnx_is_object)
    return any(nnx_is_object(leaf) and (variables or not isinstance(leaf, nnx.Variable)) for leaf in leaves)


def nnx_is_object(x: Any) -> bool:
    """Whether `x` is an nnx object the graph API splits: a Module, `nnx.Rngs`, a Variable...

    Not a bare `jax.Ref`, which flax 0.12's ``is_graph_node`` also accepts: amp
    treats those the same whether or not flax is imported.
    """
    from flax import nnx

    return isinstance(x, nnx.Variable) or nnx.graph.is_node_module(x)
