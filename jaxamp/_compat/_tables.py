"""Rules in JAX's global tables: batching and lowering rules fp8 mode needs, installed on its first use."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax._src import core as _core

from ._tracing import linear_call_p, trace_to_closed_jaxpr

__all__ = [
    "OwnPrimitive",
    "dot_general_batch_dims",
    "ensure_linear_call_batching",
]

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
