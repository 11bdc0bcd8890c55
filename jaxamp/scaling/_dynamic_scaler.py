"""jaxamp's dynamic loss scaler: `DynamicScalerState` and the scaled grad transforms.

`dynamic_scale_grad(fun)` and `dynamic_scale_value_and_grad(fun)` behave like
`jax.grad` / `equinox.filter_grad` (and the value-and-grad variants) of `fun`, except
that `fun`'s output is multiplied by the current scale before differentiating, the
results are divided by it afterwards, and the scaler state comes back moved by
the rule every jaxamp scaler shares (`jaxamp.scaling._scale_schedule.next_scale`),
a non-finite step also counted in ``total_resets``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import _compat
from ..transform import _nnx
from ._backward_scale import scaling_backward
from ._finite import (
    AxisName,
    check_axis_name,
    check_scale_bounds,
    checked_scalar,
    is_inexact_leaf,
    local_all_finite,
    map_gradients,
    on_every_device,
)
from ._scale_schedule import next_scale

__all__ = [
    "DynamicLossScaler",
    "DynamicScalerState",
    "default_scale_fn",
    "default_unscale_fn",
    "dynamic_scale_grad",
    "dynamic_scale_tx",
    "dynamic_scale_value_and_grad",
    "next_scaler_state",
]


# Each field's dtype, smallest allowed value, and whether that value is allowed.
# (`checked_scalar` also rejects inf and NaN, so `max_scaler` is finite.)
_FIELD_RULES: dict[str, tuple[Any, float, bool]] = {
    "patience": (jnp.int32, 0, True),
    "adjust_factor": (jnp.float32, 1.0, True),
    "scaler": (jnp.float32, 0.0, False),
    "count": (jnp.int32, 0, True),
    "total_resets": (jnp.int32, 0, True),
    "min_scaler": (jnp.float32, 0.0, False),
    "max_scaler": (jnp.float32, 0.0, False),
}


def _check_field(name: str, value: Any, host: bool = False) -> jax.Array:
    dtype, lower, inclusive = _FIELD_RULES[name]
    return checked_scalar(f"DynamicScalerState {name}", value, dtype, lower=lower, inclusive=inclusive, host=host)


class DynamicScalerState(NamedTuple):
    """The state of jaxamp's dynamic loss scaler (a NamedTuple, hence a pytree).

    Python numbers and arrays of a compatible kind are accepted and stored as
    scalar arrays of a fixed dtype, so the state can be carried through `jax.jit`
    and `lax.while_loop` without retracing or dtype mismatches.

    Attributes:
        patience: number of consecutive finite steps to wait before growing the
            scale (int32; integer input only).
        adjust_factor: the scale is multiplied by this to grow and divided by it to
            shrink (float32, ``>= 1``).
        scaler: the current scale (float32, within ``[min_scaler, max_scaler]``).
        count: finite steps in a row since the last non-finite or growth step
            (int32); a growth step at ``max_scaler`` restarts it too.
        total_resets: how many non-finite steps were seen so far (int32).
        min_scaler: shrinking never takes the scale below this (float32,
            ``> 0``; default 1.0, as jmp's ``min_loss_scale``). A non-finite step
            at this scale is not recomputed by ``redo_on_nan``: it would fail again.
        max_scaler: growing never takes the scale above this (float32, finite,
            ``>= min_scaler``; default ``2**24``, as NVIDIA apex's
            ``max_loss_scale``). Growth that would overflow to inf is refused too.

    The bounds exist because a scale that reaches 0 (``0 * loss``, then
    ``0 / 0 = NaN`` gradients on every step) or inf never recovers.

    Fields that are all strings or None are kept as given, unchecked: that is
    the state's structure with a name per leaf, which pytree utilities build by
    calling a NamedTuple's class (Levanter's checkpointer names its files so).

    Raises:
        TypeError: a bool, a float for an integer field, or a non-numeric value.
        ValueError: a non-scalar, or a concrete value out of range (negative
            counts, ``scaler <= 0``, ``adjust_factor < 1``, ``min_scaler <= 0``,
            ``min_scaler > max_scaler``, ``scaler`` outside
            ``[min_scaler, max_scaler]``, inf or NaN).
    """

    patience: jax.Array
    adjust_factor: jax.Array
    scaler: jax.Array
    # The seed's field name; it shadows tuple.count, which nothing here calls.
    count: jax.Array  # type: ignore[assignment]
    total_resets: jax.Array
    min_scaler: jax.Array
    max_scaler: jax.Array


# A direct NamedTuple (its one base is `tuple`), not a subclass of one: pytree
# utilities that recognise NamedTuples by ``type(x).__bases__ == (tuple,)``, as
# Levanter's checkpointer does (`levanter.utils.jax_utils.leaf_key_paths`), would
# otherwise take the state for a plain tuple and fail to match it against the
# state (a pytree structure error at the first save). `typing.NamedTuple` forbids
# a `__new__` in the class body, so the validating one is set here.
def _new(
    cls: type,
    patience: Any = 2000,
    adjust_factor: Any = 2.0,
    scaler: Any = 2**15,
    count: Any = 0,
    total_resets: Any = 0,
    min_scaler: Any = 1.0,
    max_scaler: Any = 2.0**24,
) -> DynamicScalerState:
    values = (patience, adjust_factor, scaler, count, total_resets, min_scaler, max_scaler)
    if all(v is None or isinstance(v, str) for v in values):
        # The structure rebuilt with a name (or None) per leaf, as Levanter's
        # `leaf_key_paths` rebuilds a NamedTuple (``type(x)(**fields)``) to name
        # the checkpoint's files; not a state, so not validated.
        return tuple.__new__(cls, values)
    return _validated(values, host=False)


_new.__qualname__ = "DynamicScalerState.__new__"
DynamicScalerState.__new__ = staticmethod(_new)  # type: ignore[method-assign,assignment]


def _validated(values: tuple, host: bool) -> DynamicScalerState:
    """`DynamicScalerState` of `values` (one per field, in order), each checked; see `checked_scalar`'s `host`."""
    fields = DynamicScalerState._fields
    state = tuple.__new__(DynamicScalerState, tuple(_check_field(n, v, host) for n, v in zip(fields, values)))
    check_scale_bounds(
        "DynamicScalerState",
        ("scaler", state.scaler),
        ("min_scaler", state.min_scaler),
        ("max_scaler", state.max_scaler),
    )
    return state


def host_scaler_state(**fields: Any) -> DynamicScalerState:
    """``DynamicScalerState(**fields)``, its Python and numpy values kept as numpy scalars.

    Validated as the class validates, without making a device array: an
    optimizer built before `jax.distributed.initialize` (a driver that patches a
    framework's optimizer factory at import) must not start JAX's backends.
    """
    # The class's own signature: its defaults, and a TypeError naming an unknown field.
    bound = inspect.signature(DynamicScalerState.__new__).bind(DynamicScalerState, **fields)
    bound.apply_defaults()
    return _validated(tuple(bound.arguments[name] for name in DynamicScalerState._fields), host=True)


def _flatten_with_keys(state: DynamicScalerState):
    keys = (jax.tree_util.GetAttrKey(name) for name in state._fields)
    return tuple(zip(keys, state)), None


# Registered explicitly (this takes precedence over JAX's NamedTuple handling) so
# that rebuilding a state from leaves bypasses `__new__`: JAX and equinox rebuild
# pytrees with tracers, placeholders, bools or None in the leaves.
jax.tree_util.register_pytree_with_keys(
    DynamicScalerState,
    _flatten_with_keys,
    lambda _, leaves: tuple.__new__(DynamicScalerState, tuple(leaves)),
    lambda state: (tuple(state), None),
)

DynamicLossScaler = DynamicScalerState


def checked_scaler_state(state: Any) -> DynamicScalerState:
    if not isinstance(state, DynamicScalerState):
        raise TypeError(
            f"dynamic_scaler_state must be a jaxamp.DynamicScalerState, got {type(state).__name__}: {state!r}."
        )
    # Re-validate: states rebuilt with `_replace` or `tree_map` skipped `__new__`.
    return DynamicScalerState(*state)


def next_scaler_state(state: DynamicScalerState, finite: jax.Array) -> DynamicScalerState:
    """`state` after one step, given whether the step was finite on every device.

    The one place a `DynamicScalerState` moves: `dynamic_scale_tx` and the
    optax wrapper `jaxamp.loss_scaling` (whose state holds one) both call it,
    so the two paths take bit-identical scales and counts from the same
    sequence of steps. The rule itself is `next_scale`; a non-finite step also
    counts one more reset (a skipped step).
    """
    scaler, count = next_scale(
        state.scaler,
        state.count,
        finite,
        patience=state.patience,
        growth_factor=state.adjust_factor,
        backoff_divisor=state.adjust_factor,
        min_scale=state.min_scaler,
        max_scale=state.max_scaler,
    )
    resets = jnp.where(finite, state.total_resets, state.total_resets + 1)
    return state._replace(scaler=scaler, count=count, total_resets=resets)


def default_scale_fn(output: Any, state: DynamicScalerState) -> Any:
    """Multiply the value to differentiate by the scale, in float32 at least.

    Args:
        output: what the user's function returned: the scalar value, or a
            ``(value, aux)`` pair for ``has_aux=True`` (a scalar is never a tuple
            or list, so a pair is recognised by its type). ``aux`` is untouched.
        state: the current scaler state.

    Returns:
        `output` with its value scaled. A float16 or bfloat16 value is scaled in
        float32, so the scaled value cannot overflow: a non-finite value then
        always means the loss itself was (bad data, an overflow in the forward
        pass), which no scale fixes. The backward pass is the same either way:
        the scale enters the program as the value's cotangent, in its dtype.
    """
    if isinstance(output, (tuple, list)):
        value, aux = output
        return default_scale_fn(value, state), aux
    value = jnp.asarray(output)
    dtype = jnp.promote_types(value.dtype, state.scaler.dtype)
    return value.astype(dtype) * state.scaler.astype(dtype)


def default_unscale_fn(results: Any, state: DynamicScalerState) -> Any:
    """Divide every inexact leaf of `results` by the scale.

    Gradients of a `jaxamp.fp8.Fp8State` (the observed amaxes, not derivatives)
    are left as they are. The division promotes float16/bfloat16 leaves to the scaler's dtype (float32),
    so unscaled gradients do not underflow; float64 leaves stay float64. Integer,
    boolean and non-array leaves (e.g. equinox's ``None`` gradients) are returned
    unchanged.
    """
    return map_gradients(lambda leaf: leaf / state.scaler if is_inexact_leaf(leaf) else leaf, results)


def _check_redo_on_nan(redo_on_nan: Any) -> None:
    if isinstance(redo_on_nan, bool) or not isinstance(redo_on_nan, int):
        raise TypeError(
            f"redo_on_nan must be a non-negative int, got {redo_on_nan!r} of type {type(redo_on_nan).__name__}."
        )
    if redo_on_nan < 0:
        raise ValueError(f"redo_on_nan must be a non-negative int, got {redo_on_nan}.")


class _Attempt(NamedTuple):
    finite: jax.Array  # the step's results are finite on every device
    fixable: jax.Array  # a smaller scale may make them so: the value was finite
    next_state: DynamicScalerState
    results: Any


def _redo_until_finite(
    attempt: Callable[[DynamicScalerState, Any], _Attempt],
    state: DynamicScalerState,
    redo_on_nan: int,
    operand: Any = None,
) -> tuple[DynamicScalerState, Any]:
    """Call `attempt` until its result is finite, at most ``redo_on_nan + 1`` times.

    It stops early when a retry cannot help: the value itself was not finite
    (no scale fixes bad data or a forward overflow), or the scale was already at
    ``min_scaler``.

    The user's function is traced once, to a jaxpr, and the loop's body
    evaluates that jaxpr: the first attempt is the loop's first iteration, so
    the step is compiled once, and a trace-time side effect in the loss (a
    ``batch.pop``) happens once, as under `jax.value_and_grad`. The loop's
    initial carry takes each result's full type from the jaxpr (sharding on
    Explicit meshes, varying axes inside `shard_map`). Parts of the results
    that are not arrays (Python numbers or objects in ``aux``) cannot change
    between attempts and are put back at the end. `operand` (a pytree of arrays:
    the state of flax nnx modules) is an input of the traced attempt rather
    than a value it closes over, as flax requires of the modules it merges.
    """
    state_leaves, state_def = jax.tree_util.tree_flatten((state, operand))
    layout: dict[str, Any] = {}

    def flat_attempt(*leaves: Any) -> list[Any]:
        result = attempt(*jax.tree_util.tree_unflatten(state_def, leaves))
        arrays, layout["static"] = eqx.partition(result.results, eqx.is_array)
        flat, layout["treedef"] = jax.tree_util.tree_flatten(result._replace(results=arrays))
        return flat

    traced = _compat.trace_to_closed_jaxpr(flat_attempt, [_compat.abstract_value(leaf) for leaf in state_leaves])
    run_attempt = _compat.jaxpr_as_fun(traced)

    def body(carry):
        state, _, _, attempts = carry
        flat = run_attempt(*jax.tree_util.tree_leaves((state, operand)))
        result = jax.tree_util.tree_unflatten(layout["treedef"], flat)
        retry = ~result.finite & result.fixable & (result.next_state.scaler < state.scaler)
        return result.next_state, result.results, retry, attempts + 1

    def keep_going(carry):
        _, _, retry, attempts = carry
        return (attempts == 0) | (retry & (attempts <= redo_on_nan))

    placeholder = jax.tree_util.tree_unflatten(
        layout["treedef"], [_compat.zeros_like_aval(aval) for aval in traced.out_avals]
    ).results
    init = (state, placeholder, jnp.array(False), jnp.array(0, jnp.int32))
    state, arrays, _, _ = jax.lax.while_loop(keep_going, body, init)
    return state, eqx.combine(arrays, layout["static"])


def dynamic_scale_tx(
    transform: Callable[..., Callable],
    redo_on_nan: int = 0,
    unscale_fn: Callable[[Any, DynamicScalerState], Any] = default_unscale_fn,
    scale_fn: Callable[[Any, DynamicScalerState], Any] = default_scale_fn,
    *,
    finite_fn: Callable[[Any], jax.Array] | None = None,
    value_fn: Callable[[Any], Any] | None = None,
    axis_name: AxisName | None = None,
) -> Callable[..., Callable]:
    """Add dynamic loss scaling to a gradient transform such as `jax.grad`.

    Args:
        transform: called as ``transform(scaled_fun, *args, **kwargs)``; returns the
            function computing the (scaled) results, e.g. `jax.value_and_grad`.
        redo_on_nan: how many times a non-finite step is recomputed, each time with
            the scale already reduced, before its results are returned as they are
            (0, the default, skips the step and shrinks the scale once, as flax's
            ``DynamicScale`` and torch's ``GradScaler`` do). The recomputation runs
            in a `lax.while_loop`, so it works under `jit`. It stops once the scale
            is at ``min_scaler``, and after the first attempt when `value_fn`'s
            values are not finite: a smaller scale cannot fix those.
        unscale_fn: ``unscale_fn(results, state)`` undoes the scaling on the
            transform's results.
        scale_fn: ``scale_fn(output, state)`` scales the user function's output.
        finite_fn: ``finite_fn(unscaled_results)`` decides, on each device,
            whether the step was finite; by default every inexact leaf of the
            results is checked.
        value_fn: ``value_fn(unscaled_results)`` picks the function's value out
            of the results (for `jax.value_and_grad`, ``lambda r: r[0]``); if
            not given, every non-finite step is worth a redo.
        axis_name: the mesh or pmap axes to decide over inside `shard_map` or
            `jax.pmap` (see `jaxamp.all_finite`): every device then takes the
            same decision and keeps the same scaler state.

    Returns:
        ``scaled_transform(fun, *args, **kwargs)``, which returns a function taking
        ``fun``'s arguments plus a required keyword ``dynamic_scaler_state`` and
        returning ``(next_dynamic_scaler_state, unscaled_results)``.

    Raises:
        TypeError, ValueError: if `redo_on_nan` is not a non-negative int or
            `axis_name` is not a name or tuple of names; when called, as
            `jaxamp.all_finite` inside `pmap` or `shard_map`.
    """
    _check_redo_on_nan(redo_on_nan)
    axis_name = check_axis_name(axis_name, "dynamic_scale_tx")
    local_finite = finite_fn if finite_fn is not None else local_all_finite

    def scaled_transform(fun: Callable, *args: Any, **kwargs: Any) -> Callable:
        if not callable(fun):
            raise TypeError(f"expected a function to differentiate, got {fun!r}.")

        def evaluate(*f_args: Any, _scaler_state: DynamicScalerState, **f_kwargs: Any):
            # One attempt's unscaled results, and this device's finite flags.
            def scaled_fun(*a, **k):
                if scale_fn is not default_scale_fn:  # its factor is unknown: amp sees none
                    return scale_fn(fun(*a, **k), _scaler_state)
                with scaling_backward(_scaler_state.scaler):
                    return scale_fn(fun(*a, **k), _scaler_state)

            results = transform(scaled_fun, *args, **kwargs)(*f_args, **f_kwargs)
            results = unscale_fn(results, _scaler_state)
            flags = [local_finite(results)]
            if redo_on_nan and value_fn is not None:
                flags.append(local_all_finite(value_fn(results)))
            return results, jnp.stack(flags)

        def scaled_fn(*f_args: Any, dynamic_scaler_state: Any, **f_kwargs: Any):
            # flax nnx modules among the arguments: the transform runs on
            # copies merged from their state (inside the redo loop's trace,
            # too), and what the loss changed in them (batch statistics, RNG
            # counts) is written back into the caller's objects at the end,
            # as `nnx.value_and_grad` does; a skipped step writes back the
            # values from before it.
            graph = None
            if _nnx.has_nnx_objects((f_args, f_kwargs)):
                graph = _nnx.GraphCall(
                    evaluate, f_args, {**f_kwargs, "_scaler_state": None}, owner="jaxamp's loss scaler"
                )

            def attempt(state: DynamicScalerState, module_state: Any = None) -> _Attempt:
                if graph is None:
                    results, flags = evaluate(*f_args, _scaler_state=state, **f_kwargs)
                else:
                    before = graph.values(module_state)
                    call_kwargs = {**graph.kwargs, "_scaler_state": state}
                    (results, flags), changes = graph.fn(module_state, *graph.args[1:], **call_kwargs)
                # One collective for both flags.
                agreed = on_every_device(flags, axis_name, what="dynamic loss scaling")
                finite = agreed[0]
                fixable = agreed[-1] if len(agreed) > 1 else jnp.array(True)
                if graph is not None:
                    updates, created = changes
                    results = (results, (graph.changes_if(finite, updates, before), created))
                return _Attempt(finite, fixable, next_scaler_state(state, finite), results)

            state = checked_scaler_state(dynamic_scaler_state)
            module_state = None if graph is None else graph.args[0]
            if redo_on_nan == 0:
                result = attempt(state, module_state)
                state, results = result.next_state, result.results
            else:
                state, results = _redo_until_finite(attempt, state, redo_on_nan, module_state)
            return state, results if graph is None else graph.finish(results)

        return scaled_fn

    return scaled_transform


# Both entry points differentiate with a value-and-grad transform (the grad-only
# one drops the value at the end): the value says whether a redo can help.
# `_Layout` says how its results split into the scaled part (unscaled and
# checked for finiteness) and `aux` (neither: it does not depend on the scale,
# so a NaN in it must not shrink the scale or trigger recomputation).
class _Layout(NamedTuple):
    split: Callable[[Any], tuple[Any, Callable[[Any], Any]]]
    value: Callable[[Any], Any]
    checked: Callable[[Any], Any]  # what decides whether the step was finite
    returned: Callable[[Any], Any]  # what the entry point returns


def _layout(has_aux: bool, with_value: bool) -> _Layout:
    if has_aux:

        def split(results):
            (value, aux), grads = results
            return (value, grads), lambda scaled: ((scaled[0], aux), scaled[1])

        value = lambda results: results[0][0]  # noqa: E731
        grads_and_aux = lambda results: (results[1], results[0][1])  # noqa: E731
    else:

        def split(results):
            return results, lambda scaled: scaled

        value = lambda results: results[0]  # noqa: E731
        grads_and_aux = lambda results: results[1]  # noqa: E731
    if with_value:
        return _Layout(split, value, lambda results: split(results)[0], lambda results: results)
    return _Layout(split, value, lambda results: results[1], grads_and_aux)


def _value_and_grad(fun: Callable, *, filter: bool, **kwargs: Any) -> Callable:
    """The value-and-grad transform for the arguments a call brings.

    flax nnx modules are differentiated as `nnx.value_and_grad` does (with
    respect to their `nnx.Param`s, their other state carried through);
    everything else by `equinox.filter_value_and_grad` (``filter=True``) or
    `jax.value_and_grad`.
    """

    def value_and_grad(*args: Any, **call_kwargs: Any) -> Any:
        if _nnx.has_nnx_objects((args, call_kwargs)):
            if not filter:
                raise TypeError(
                    "jaxamp's dynamic loss scaling got flax nnx objects with filter=False: "
                    "jax.value_and_grad cannot differentiate them (their RNG keys and "
                    "counters are not differentiable). Use filter=True (the default), "
                    "which differentiates their nnx.Param state as nnx.value_and_grad does."
                )
            from flax import nnx

            return nnx.value_and_grad(fun, **kwargs)(*args, **call_kwargs)
        transform = eqx.filter_value_and_grad if filter else jax.value_and_grad
        return transform(fun, **kwargs)(*args, **call_kwargs)

    return value_and_grad


def _aux_aware_tx(
    fun: Any,
    *,
    with_value: bool,
    has_aux: Any,
    redo_on_nan: Any,
    filter: Any,
    axis_name: Any,
    kwargs: dict[str, Any],
) -> Callable:
    for name, flag in (("has_aux", has_aux), ("filter", filter)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}.")
    layout = _layout(has_aux, with_value)

    def unscale_fn(results, state):
        scaled, rebuild = layout.split(results)
        return rebuild(default_unscale_fn(scaled, state))

    tx = dynamic_scale_tx(
        functools.partial(_value_and_grad, filter=filter),
        redo_on_nan=redo_on_nan,
        unscale_fn=unscale_fn,
        finite_fn=lambda results: local_all_finite(layout.checked(results)),
        value_fn=layout.value,
        axis_name=axis_name,
    )
    scaled_fn = tx(fun, has_aux=has_aux, **kwargs)

    def entry_point(*args: Any, **kwargs: Any):
        state, results = scaled_fn(*args, **kwargs)
        return state, layout.returned(results)

    return entry_point


def dynamic_scale_grad(
    fun: Callable,
    *,
    has_aux: bool = False,
    redo_on_nan: int = 0,
    filter: bool = True,
    axis_name: AxisName | None = None,
    **kwargs: Any,
) -> Callable:
    """Like `jax.grad(fun)`, with dynamic loss scaling.

    Args:
        fun: the function to differentiate; returns a scalar, or ``(scalar, aux)``
            with ``has_aux=True``.
        has_aux: as in `jax.grad`.
        redo_on_nan: how many times a step with non-finite gradients is
            recomputed with a reduced scale before it is returned as it is (fewer
            if the scale reaches ``min_scaler`` first, none if `fun`'s value
            itself is not finite: no scale fixes that). 0, the default, skips
            the step and shrinks the scale once.
        filter: differentiate with `equinox.filter_grad` (w.r.t. the inexact arrays
            of the first argument; other leaves get ``None``) if True, with
            `jax.grad` if False.
        axis_name: inside `shard_map` or `jax.pmap`, the axes to decide over, so
            every device takes the same step and keeps the same scaler state
            (see `jaxamp.all_finite`).
        **kwargs: passed on to the grad transform (e.g. ``argnums`` for `jax.grad`).

    Returns:
        A function taking ``fun``'s arguments and a required keyword argument
        ``dynamic_scaler_state`` (a `DynamicScalerState`), returning
        ``(next_state, grads)``, or ``(next_state, (grads, aux))`` with
        ``has_aux=True``. Gradients are unscaled and (if half precision) float32.
        Only the gradients decide whether the step was finite.

    Raises:
        TypeError: for non-bool ``has_aux``/``filter``, a bad ``redo_on_nan`` or
            ``axis_name``, or (when called) a ``dynamic_scaler_state`` that is not
            a `DynamicScalerState`.
        ValueError: when called inside `jax.pmap` or a ``shard_map(check_vma=False)``
            without ``axis_name`` (see `jaxamp.all_finite`).
    """
    return _aux_aware_tx(
        fun,
        with_value=False,
        has_aux=has_aux,
        redo_on_nan=redo_on_nan,
        filter=filter,
        axis_name=axis_name,
        kwargs=kwargs,
    )


def dynamic_scale_value_and_grad(
    fun: Callable,
    *,
    has_aux: bool = False,
    redo_on_nan: int = 0,
    filter: bool = True,
    axis_name: AxisName | None = None,
    **kwargs: Any,
) -> Callable:
    """Like `jax.value_and_grad(fun)`, with dynamic loss scaling.

    Args:
        fun: the function to differentiate; returns a scalar, or ``(scalar, aux)``
            with ``has_aux=True``.
        has_aux: as in `jax.value_and_grad`.
        redo_on_nan: how many times a step with non-finite gradients is
            recomputed with a reduced scale before it is returned as it is (fewer
            if the scale reaches ``min_scaler`` first, none if the value itself
            is not finite). 0, the default (as in jaxamp's API document, flax's
            ``DynamicScale`` and torch's ``GradScaler``), skips the step and
            shrinks the scale once.
        filter: use `equinox.filter_value_and_grad` if True, `jax.value_and_grad`
            if False.
        axis_name: as for `dynamic_scale_grad`.
        **kwargs: passed on to the transform.

    Returns:
        A function taking ``fun``'s arguments and a required keyword argument
        ``dynamic_scaler_state``, returning ``(next_state, (value, grads))``, or
        ``(next_state, ((value, aux), grads))`` with ``has_aux=True``. Value and
        gradients are unscaled and (if half precision) float32; only they, not
        ``aux``, decide whether the step was finite.

    Raises:
        TypeError, ValueError: as for `dynamic_scale_grad`.
    """
    return _aux_aware_tx(
        fun,
        with_value=True,
        has_aux=has_aux,
        redo_on_nan=redo_on_nan,
        filter=filter,
        axis_name=axis_name,
        kwargs=kwargs,
    )
