"""Error against float32, blamed where it starts: `compare`.

`compare` runs a function twice on the same batch, equation by equation (as
`find_nonfinite` does): in float32 as written, and under amp. For each named
scope (or, outside any scope, each source line) it reports two
signal-to-quantisation-noise ratios of the values the scope hands on:

* **accumulated**: amp's values against float32's: the scope's own error and
  everything that reached it;
* **local**: the scope run under amp and in float32 on the same inputs,
  the float32 run's values as amp hands them over (rounded to the dtype amp
  passes them in): the error the scope itself adds, its hand-over included.
  This is the shadow comparison of PyTorch's Numeric Suite, and what names
  the layer to fix: a layer downstream of a bad one has a poor accumulated
  figure but a good local one.

Gradients are compared per argument leaf (``jax.grad`` of the amp'd function
against ``jax.grad`` of the float32 one), accumulated only: each leaf's
gradient is the whole backward pass's doing.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .._casting import cast_value, dtype_of
from .._dtypes import dtype_short_name, is_castable
from .._jaxpr import source_label
from .._options import AmpOptions
from ..transform._interpreter import EquationEvent
from ._explain import _check_callable

__all__ = ["ComparisonReport", "GradientError", "ScopeError", "compare"]


@dataclasses.dataclass(frozen=True)
class ScopeError:
    """One scope's error against float32, as SQNR in dB (higher is better; +inf: exact).

    Attributes:
        scope: the `jax.named_scope` path (``"model/block_0/attn"``), or, for
            equations outside any scope, their source line.
        local_db: the scope run under amp against the scope run in float32,
            both on the float32 run's inputs: the error the scope itself adds.
        accumulated_db: the scope's values in the amp run against float32:
            its own error and what reached it.
        equations: how many equations the scope ran.
        dtypes: the dtypes its equations computed in (``("bf16", "f32")``).
    """

    scope: str
    local_db: float
    accumulated_db: float
    equations: int
    dtypes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class GradientError:
    """One argument leaf's gradient under amp against float32 (SQNR in dB).

    Attributes:
        path: the leaf's path in the arguments (``"[0]['params']['w']"``).
        sqnr_db: SQNR of amp's gradient against the float32 gradient.
    """

    path: str
    sqnr_db: float


@dataclasses.dataclass(frozen=True)
class ComparisonReport:
    """What `compare` found; ``str()`` lists the scopes worst first.

    Attributes:
        compute_dtype: amp's compute dtype (``"bf16"``, ``"e4m3"``...).
        output_db: SQNR of the function's floating outputs.
        scopes: one `ScopeError` per scope, worst local figure first.
        gradients: one `GradientError` per floating argument leaf, worst
            first; empty when the function returns neither a floating scalar
            nor a ``(floating scalar, aux)`` pair.
    """

    compute_dtype: str
    output_db: float
    scopes: tuple[ScopeError, ...]
    gradients: tuple[GradientError, ...]

    def __str__(self) -> str:
        lines = [
            f"amp ({self.compute_dtype}) against float32: outputs {_db(self.output_db)}; "
            "SQNR in dB, higher is better; worst first"
        ]
        width = max((len(s.scope) for s in self.scopes), default=5)
        lines.append(f"{'scope':<{width}}  {'local':>8}  {'accumulated':>11}  equations  dtypes")
        for s in self.scopes:
            lines.append(
                f"{s.scope:<{width}}  {_db(s.local_db):>8}  {_db(s.accumulated_db):>11}  "
                f"{s.equations:>9}  {','.join(s.dtypes)}"
            )
        if self.gradients:
            width = max(len(g.path) for g in self.gradients)
            lines.append(f"{'gradient':<{width}}  {'SQNR':>8}")
            lines.extend(f"{g.path:<{width}}  {_db(g.sqnr_db):>8}" for g in self.gradients)
        return "\n".join(lines)


def _db(value: float) -> str:
    if math.isnan(value) or value == -math.inf:
        return "nonfinite"
    return "exact" if value == math.inf else f"{value:.1f}"


def compare(fn: Callable, **amp_options: Any) -> Callable[..., ComparisonReport]:
    """Compare `fn` under amp with `fn` in float32, scope by scope.

    Runs eagerly, equation by equation, twice (float32 as written, and under
    amp with `amp_options`), plus one gradient of each when `fn` returns a
    floating scalar, or a ``(loss, aux)`` pair (the loss is differentiated,
    as with ``has_aux=True``; aux's floating leaves count in the outputs'
    figure). For a diagnosis on one batch, not for a training loop.

    Loop bodies (``lax.scan``, ``while_loop``) start every iteration from the
    float32 run's values in the local figure, and report the last iteration.

    Args:
        fn: the function, as you would pass it to `amp`.
        **amp_options: `amp`'s keyword arguments (``compute_dtype="fp8"``,
            ``policy="p=f32,c=f16,o=f32"``...).

    Returns:
        A function taking `fn`'s arguments (concrete arrays, not tracers) and
        returning a `ComparisonReport`.

    Example:
        >>> print(jaxamp.compare(loss, compute_dtype="f16")(params, batch))  # doctest: +SKIP
    """
    options = AmpOptions.resolve(**amp_options)
    # The same interpreter with an empty table runs every equation as written,
    # so both runs emit the same equations in the same order.
    reference = AmpOptions(compute_dtype=np.dtype(np.float32), table={})
    _check_callable(fn, "compare")

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> ComparisonReport:
        _check_concrete(args, kwargs)
        amp_events: list[EquationEvent] = []
        float32_events: list[EquationEvent] = []
        with jax.disable_jit():
            amp_out = options.run(fn, args, kwargs, observer=amp_events.append, inline=True)
            float32_out = reference.run(fn, args, kwargs, observer=float32_events.append, inline=True)
        if [e.eqn.primitive for e in amp_events] != [e.eqn.primitive for e in float32_events]:
            raise RuntimeError(
                "compare: the float32 and amp runs of the function took different paths "
                f"({len(float32_events)} and {len(amp_events)} equations): it must compute "
                "the same equations on the same arguments (no Python randomness or state "
                "that changes between calls)."
            )
        compute = "e4m3" if options.fp8 is not None else dtype_short_name(options.compute_dtype)
        return ComparisonReport(
            compute_dtype=compute,
            output_db=_sqnr(_floats(float32_out), _floats(amp_out)),
            scopes=_scope_errors(amp_events, float32_events, float32_out),
            gradients=_gradient_errors(fn, options, args, kwargs, float32_out),
        )

    return run


def _check_concrete(args: tuple, kwargs: dict) -> None:
    for leaf in jax.tree.leaves((args, kwargs)):
        if isinstance(leaf, jax.core.Tracer):
            raise TypeError(
                "compare runs the function eagerly and needs concrete arrays, got a tracer "
                f"({leaf.aval}): call it outside jit, grad and vmap."
            )


def _is_floating(x: Any) -> bool:
    return jnp.issubdtype(getattr(x, "dtype", np.int32), jnp.floating)


def _floats(tree: Any) -> list:
    return [x for x in jax.tree.leaves(tree) if _is_floating(x)]


def _sqnr(reference: Sequence[Any], approximate: Sequence[Any]) -> float:
    """10 log10(signal / noise) over all pairs; +inf when equal, -inf when non-finite."""
    signal = noise = 0.0
    for ref, x in zip(reference, approximate, strict=True):
        ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
        x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
        finite = np.isfinite(ref)
        if not np.array_equal(np.isfinite(x), finite) or not np.array_equal(x[~finite], ref[~finite], equal_nan=True):
            return -math.inf  # amp's value went non-finite where float32's did not (or differs)
        signal += float(np.sum(ref[finite] ** 2))
        noise += float(np.sum((x[finite] - ref[finite]) ** 2))
    if noise == 0.0:
        return math.inf
    return 10.0 * math.log10(signal / noise) if signal > 0 else -math.inf


def _group(event: EquationEvent) -> str:
    if event.scopes:
        return "/".join(event.scopes)
    return source_label(event.eqn, event.call_sites) or event.eqn.primitive.name


def _arrive(value: Any, dtype: Any) -> Any:
    """`value` as amp held it on arrival at an equation (rounded to `dtype`)."""
    if is_castable(dtype_of(value)) and is_castable(dtype):
        return cast_value(value, dtype)
    return value


@dataclasses.dataclass
class _Values:
    """One variable's values: in the two runs, and in its scope's two shadow runs.

    The shadows run the scope on the float32 run's inputs, under amp and in
    float32 (`shadow_float32`, the reference of the local figure).
    """

    float32: Any
    amp: Any
    shadow: Any
    shadow_float32: Any


def _scope_errors(amp_events: list, float32_events: list, float32_out: Any) -> tuple[ScopeError, ...]:
    group_of: dict[Any, str] = {}  # variable -> the group that produced it last
    values: dict[str, dict[Any, _Values]] = defaultdict(dict)
    leaves: set[Any] = set()  # variables read by another group, or returned
    read: set[Any] = set()
    # The function's outputs are the float32 run's own arrays (amp casts
    # nothing there), which tells them from values nothing reads (JAX's
    # derivative helpers, such as logsumexp's sign).
    returned = {id(x) for x in jax.tree.leaves(float32_out)}
    equations: dict[str, int] = defaultdict(int)
    dtypes: dict[str, set] = defaultdict(set)
    for event, reference in zip(amp_events, float32_events):
        group = _group(event)
        equations[group] += 1
        dtypes[group].update(dtype_short_name(d) for d in event.dtypes_after if is_castable(d))
        operands, float32_operands = [], []
        for k, v in enumerate(event.eqn.invars):
            original, arrival = event.original_dtypes[k], event.dtypes_before[k]
            own = None if isinstance(v, _compat.Literal) else values[group].get(v)
            if own is not None and group_of.get(v) == group:
                operands.append(own.shadow)
                float32_operands.append(own.shadow_float32)
                read.add(v)
                continue
            arrived = _arrive(reference.inputs[k], arrival)
            operands.append(arrived)
            float32_operands.append(_arrive(arrived, original))
            if isinstance(v, _compat.Literal) or v not in group_of:
                continue
            read.add(v)
            leaves.add(v)
            # Handed over rounded (a norm region hands on in the compute
            # dtype): the rounding is the producer's error.
            produced = values[group_of[v]].get(v)  # None: not floating
            if produced is not None:
                produced.amp = _arrive(produced.amp, arrival)
                produced.shadow = _arrive(produced.shadow, arrival)
        shadow = event.replay(*operands)
        shadow_float32 = reference.replay(*float32_operands)
        outputs = zip(event.eqn.outvars, reference.outputs, event.outputs, shadow, shadow_float32)
        for v, float32, amp, own, own_float32 in outputs:
            if isinstance(v, _compat.DropVar):
                continue
            group_of[v] = group
            if id(float32) in returned:
                leaves.add(v)
            if _is_floating(float32):
                values[group][v] = _Values(float32, amp, own, own_float32)
            else:
                values[group].pop(v, None)
    errors = []
    for group, by_variable in values.items():
        # What the group hands on; failing that, what nothing reads.
        handed_on = [x for v, x in by_variable.items() if v in leaves] or [
            x for v, x in by_variable.items() if v not in read
        ]
        if not handed_on:
            continue
        errors.append(
            ScopeError(
                scope=group,
                local_db=_sqnr([x.shadow_float32 for x in handed_on], [x.shadow for x in handed_on]),
                accumulated_db=_sqnr([x.float32 for x in handed_on], [x.amp for x in handed_on]),
                equations=equations[group],
                dtypes=tuple(sorted(dtypes[group])),
            )
        )
    return tuple(sorted(errors, key=lambda e: (e.local_db, e.accumulated_db)))


def _is_floating_scalar(x: Any) -> bool:
    return (
        isinstance(x, (jax.Array, np.ndarray, np.generic, float)) and jnp.ndim(x) == 0 and _is_floating(jnp.asarray(x))
    )


def _differentiable_value(out: Any) -> Callable[[Any], Any] | None:
    """How to pick the value to differentiate out of `fn`'s output, or None if there is none.

    A floating scalar is the value; a ``(value, aux)`` pair with a floating
    scalar first is a loss with auxiliary outputs (``has_aux=True`` in
    `jax.grad`), as `explain` and `amp` take it.
    """
    if _is_floating_scalar(out):
        return lambda o: o
    if isinstance(out, (tuple, list)) and len(out) == 2 and _is_floating_scalar(out[0]):
        return lambda o: o[0]
    return None


def _gradient_errors(fn: Callable, options: AmpOptions, args: tuple, kwargs: dict, out: Any) -> tuple:
    value_of = _differentiable_value(out)
    if value_of is None:
        return ()
    paths, treedef = jax.tree_util.tree_flatten_with_path(args)
    floating = [k for k, (_, leaf) in enumerate(paths) if _is_floating(leaf)]
    leaves = [leaf for _, leaf in paths]

    def with_leaves(f: Callable) -> Callable:
        def loss(chosen: list) -> Any:
            new = list(leaves)
            for k, x in zip(floating, chosen):
                new[k] = x
            return value_of(f(*jax.tree.unflatten(treedef, new), **kwargs))

        return loss

    chosen = [leaves[k] for k in floating]
    float32 = jax.grad(with_leaves(fn))(chosen)
    amp = jax.grad(with_leaves(lambda *a, **kw: options.run(fn, a, kw)))(chosen)
    errors = [
        GradientError(jax.tree_util.keystr(paths[k][0]), _sqnr([ref], [got]))
        for k, ref, got in zip(floating, float32, amp)
    ]
    return tuple(sorted(errors, key=lambda e: e.sqnr_db))
