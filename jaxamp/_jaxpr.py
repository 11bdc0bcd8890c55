"""Walking jaxprs: the matmul primitives, the bodies an equation carries, matmul FLOPs.

Shared by the program analyses (`jaxamp.analyses`), the transform's rules, fp8
mode and the diagnostics, below all of them so none imports another to walk a
program.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Hashable, Iterable, Iterator, MutableMapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from . import _compat

__all__ = [
    "COMPUTE_PRIMITIVES",
    "MATMUL_NAMES",
    "bodies",
    "equation_flops",
    "equations_in",
    "holds_matmul",
    "matmul_name",
    "matmuls_in",
    "memoised_per_jaxpr",
    "merge_runs",
    "source_label",
    "trace_array_leaves",
]

# The primitives amp runs in the compute dtype: matmuls, convolutions and the
# grouped matmul of mixture-of-experts layers.
COMPUTE_PRIMITIVES = ("dot_general", "conv_general_dilated", "ragged_dot_general")
MATMUL_NAMES = frozenset(COMPUTE_PRIMITIVES)


def bodies(eqn: Any) -> Iterator[Any]:
    """The jaxprs an equation carries in its parameters, in parameter order."""
    for value in eqn.params.values():
        for body in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(body, (_compat.Jaxpr, _compat.ClosedJaxpr)):
                yield body


def equations_in(jaxpr: Any, *, enter: Callable[[Any], bool] | None = None) -> Iterator[Any]:
    """The equations of `jaxpr` in program order, those of nested bodies included.

    A body (a jit'd function, a loop body, a cond's branches in order, a
    custom rule's primal, a Pallas kernel) is walked where its equation stands.

    Args:
        jaxpr: an open or closed jaxpr.
        enter: which equations' bodies to walk (all when None).
    """
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield eqn
        if enter is not None and not enter(eqn):
            continue
        for body in bodies(eqn):
            yield from equations_in(body, enter=enter)


def matmuls_in(jaxpr: Any, *, enter: Callable[[Any], bool] | None = None) -> Iterator[Any]:
    """The matmul equations of `jaxpr` in program order, those of nested bodies included (see `equations_in`)."""
    return (eqn for eqn in equations_in(jaxpr, enter=enter) if eqn.primitive.name in MATMUL_NAMES)


def matmul_name(eqn: Any) -> str:
    """The primitive's name, or the matmul an op declares it stands for.

    fp8 mode's per-device products on an Auto mesh (`jaxamp.fp8._partitioned`)
    are jaxamp primitives whose ``how`` parameter names the matmul they
    compute (``jaxamp_matmul``).
    """
    return getattr(eqn.params.get("how"), "jaxamp_matmul", None) or eqn.primitive.name


def holds_matmul(eqn: Any) -> bool:
    """Whether `eqn` is a matmul or carries one in a body (a call, a loop...)."""
    return eqn.primitive.name in MATMUL_NAMES or any(next(matmuls_in(body), None) is not None for body in bodies(eqn))


def memoised_per_jaxpr(cache: MutableMapping[Any, dict], jaxpr: Any, key: Hashable, make: Callable[[], Any]) -> Any:
    """``make()``, kept in `cache` (weak in `jaxpr`) under `key`: an analysis of one jaxpr, done once per key.

    A jaxpr that takes no weak reference is analysed anew on each call.
    """
    try:
        per_jaxpr = cache.setdefault(jaxpr, {})
    except TypeError:  # not weak-referenceable
        per_jaxpr = {}
    found = per_jaxpr.get(key)
    if found is None:
        found = per_jaxpr[key] = make()
    return found


def merge_runs(runs: Iterable[tuple[int, int]]) -> dict[int, int]:
    """Runs of equations (start, end exclusive) with overlapping ones merged: start -> end."""
    merged: dict[int, int] = {}
    last = None
    for start, end in sorted(runs):
        if last is not None and start < merged[last]:
            merged[last] = max(merged[last], end)
        else:
            merged[start], last = end, start
    return merged


def equation_flops(eqn: Any) -> int:
    """FLOPs (2 x multiply-adds) of a matmul or convolution, from its shapes; else 0.

    A dot_general costs ``2 * batch * M * N * K``. A ragged_dot_general (the
    grouped matmul of `jax.lax.ragged_dot`) costs the same, as if its groups
    covered every row: each lhs element meets one group's ``N`` rhs columns, so
    ``ragged_dot(lhs[m, k], rhs[g, k, n], group_sizes)`` costs ``2 * m * k * n``.
    A convolution costs ``2 * output size * kernel window * input features per
    group``.
    """
    name = eqn.primitive.name
    if name in ("dot_general", "ragged_dot_general"):
        if name == "dot_general":
            dimension_numbers, rhs_group = eqn.params["dimension_numbers"], ()
        else:
            ragged = eqn.params["ragged_dot_dimension_numbers"]
            dimension_numbers, rhs_group = ragged.dot_dimension_numbers, ragged.rhs_group_dimensions
        (_, rhs_contract), (_, rhs_batch) = dimension_numbers
        lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
        rhs_free = [d for i, d in enumerate(rhs) if i not in (*rhs_contract, *rhs_batch, *rhs_group)]
        return 2 * math.prod(lhs) * math.prod(rhs_free)
    if name == "conv_general_dilated":
        out = eqn.outvars[0].aval.shape
        kernel = eqn.invars[1].aval.shape
        out_feature_dim = eqn.params["dimension_numbers"].rhs_spec[0]
        # Each output element is a dot over (input features / groups) x window.
        return 2 * math.prod(out) * math.prod(kernel) // kernel[out_feature_dim]
    return 0


def source_label(eqn: Any, call_sites: Iterable[Any] = ()) -> str | None:
    """``"file.py:12 (function)"``: the user line that emitted `eqn`, or None.

    An equation inside a ``jax.numpy`` function's jit'd body has no user line
    of its own; it gets the innermost enclosing call's (`call_sites`,
    outermost first), as when JAX inlines that body.
    """
    for site in (eqn, *reversed(tuple(call_sites))):
        frame = _compat.eqn_user_frame(site)
        if frame is not None:
            return f"{os.path.basename(frame.file_name)}:{frame.start_line} ({frame.function_name})"
    return None


def trace_array_leaves(
    fn: Callable, args: tuple, kwargs: dict, trace: Callable = _compat.trace_to_closed_jaxpr
) -> tuple[Any, list, Any, Callable]:
    """Trace ``fn(*args, **kwargs)`` with the array leaves of its arguments as inputs.

    Every other leaf (Python scalars, strings, callables, Equinox static
    fields) is static, as `equinox.filter_make_jaxpr` treats them, and so are
    the non-array leaves of `fn`'s output.

    Args:
        trace: ``trace(flat_fn, in_avals) -> ClosedJaxpr`` (`_compat`'s tracers).

    Returns:
        ``(closed, flat_args, out_tree, rebuild)``: the jaxpr; its inputs; the
        tree of `fn`'s array outputs; ``rebuild(outs)``, `fn`'s output from
        the jaxpr's evaluated outputs.
    """
    dynamic, static = eqx.partition((args, kwargs), eqx.is_array)
    flat_args, in_tree = jax.tree_util.tree_flatten(dynamic)
    out_info: list = []

    def flat_fn(*flat):
        call_args, call_kwargs = eqx.combine(jax.tree_util.tree_unflatten(in_tree, flat), static)
        out_dynamic, out_static = eqx.partition(fn(*call_args, **call_kwargs), eqx.is_array)
        out_flat, out_tree = jax.tree_util.tree_flatten(out_dynamic)
        out_info[:] = [out_tree, out_static]
        return [jnp.asarray(x) for x in out_flat]

    closed = trace(flat_fn, [_compat.abstract_value(x) for x in flat_args])
    out_tree, out_static = out_info

    def rebuild(outs: list) -> Any:
        return eqx.combine(jax.tree_util.tree_unflatten(out_tree, outs), out_static)

    return closed, flat_args, out_tree, rebuild
