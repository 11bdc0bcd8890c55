"""jaxamp's dynamic loss scaler: `DynamicScalerState` and the scaled grad transforms.

`dynamic_scale_grad(fun)` and `dynamic_scale_value_and_grad(fun)` behave like
`jax.grad` / `equinox.filter_grad` (and the value-and-grad variants) of `fun`, except
that `fun`'s output is multiplied by the current scale before differentiating, the
results are divided by it afterwards, and the scaler state comes back adjusted by
the rule shared with the other scalers (`jaxamp._scale_schedule.next_scale`):

* finite step: if ``count >= patience`` the scale is multiplied by ``adjust_factor``
  (capped at ``max_scaler``, kept if the product overflows) and ``count`` restarts
  at 0, otherwise ``count`` goes up by one;
* non-finite step: the scale is divided by ``adjust_factor`` (but not below
  ``min_scaler``), ``count`` restarts at 0 and ``total_resets`` goes up by one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

from ._finite import all_finite, check_scale_bounds, checked_scalar, is_inexact_leaf
from ._scale_schedule import next_scale

__all__ = [
    "DynamicLossScaler",
    "DynamicScalerState",
    "default_scale_fn",
    "default_unscale_fn",
    "dynamic_scale_grad",
    "dynamic_scale_tx",
    "dynamic_scale_value_and_grad",
]


class _Fields(NamedTuple):
    patience: jax.Array
    adjust_factor: jax.Array
    scaler: jax.Array
    count: jax.Array
    total_resets: jax.Array
    min_scaler: jax.Array
    max_scaler: jax.Array


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


def _check_field(name: str, value: Any) -> jax.Array:
    dtype, lower, inclusive = _FIELD_RULES[name]
    return checked_scalar(
        f"DynamicScalerState {name}", value, dtype, lower=lower, inclusive=inclusive
    )


class DynamicScalerState(_Fields):
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

    Raises:
        TypeError: a bool, a float for an integer field, or a non-numeric value.
        ValueError: a non-scalar, or a concrete value out of range (negative
            counts, ``scaler <= 0``, ``adjust_factor < 1``, ``min_scaler <= 0``,
            ``min_scaler > max_scaler``, ``scaler`` outside
            ``[min_scaler, max_scaler]``, inf or NaN).
    """

    __slots__ = ()

    def __new__(
        cls,
        patience: Any = 2000,
        adjust_factor: Any = 2.0,
        scaler: Any = 2**15,
        count: Any = 0,
        total_resets: Any = 0,
        min_scaler: Any = 1.0,
        max_scaler: Any = 2.0**24,
    ) -> "DynamicScalerState":
        values = (patience, adjust_factor, scaler, count, total_resets, min_scaler, max_scaler)
        state = tuple.__new__(
            cls, tuple(_check_field(name, value) for name, value in zip(cls._fields, values))
        )
        check_scale_bounds(
            "DynamicScalerState",
            ("scaler", state.scaler),
            ("min_scaler", state.min_scaler),
            ("max_scaler", state.max_scaler),
        )
        return state


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


def _checked_state(state: Any) -> DynamicScalerState:
    if not isinstance(state, DynamicScalerState):
        raise TypeError(
            "dynamic_scaler_state must be a jaxamp.DynamicScalerState, got "
            f"{type(state).__name__}: {state!r}."
        )
    # Re-validate: states rebuilt with `_replace` or `tree_map` skipped `__new__`.
    return DynamicScalerState(*state)


def _next_state(state: DynamicScalerState, finite: jax.Array) -> DynamicScalerState:
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
    """Multiply the value to differentiate by the scale, in the value's own dtype.

    Args:
        output: what the user's function returned: the scalar value, or a
            ``(value, aux)`` pair for ``has_aux=True`` (a scalar is never a tuple
            or list, so a pair is recognised by its type). ``aux`` is untouched.
        state: the current scaler state.

    Returns:
        `output` with its value scaled. A float16 value overflowing to inf here is
        the signal that the scale is too large.
    """
    if isinstance(output, (tuple, list)):
        value, aux = output
        return default_scale_fn(value, state), aux
    value = jnp.asarray(output)
    return value * state.scaler.astype(value.dtype)


def default_unscale_fn(results: Any, state: DynamicScalerState) -> Any:
    """Divide every inexact leaf of `results` by the scale.

    The division promotes float16/bfloat16 leaves to the scaler's dtype (float32),
    so unscaled gradients do not underflow; float64 leaves stay float64. Integer,
    boolean and non-array leaves (e.g. equinox's ``None`` gradients) are returned
    unchanged.
    """
    return jax.tree_util.tree_map(
        lambda leaf: leaf / state.scaler if is_inexact_leaf(leaf) else leaf, results
    )


def _check_redo_on_nan(redo_on_nan: Any) -> None:
    if isinstance(redo_on_nan, bool) or not isinstance(redo_on_nan, int):
        raise TypeError(
            f"redo_on_nan must be a non-negative int, got {redo_on_nan!r} of type "
            f"{type(redo_on_nan).__name__}."
        )
    if redo_on_nan < 0:
        raise ValueError(f"redo_on_nan must be a non-negative int, got {redo_on_nan}.")


def _redo_until_finite(
    evaluate: Callable[[DynamicScalerState], tuple[jax.Array, DynamicScalerState, Any]],
    state: DynamicScalerState,
    redo_on_nan: int,
) -> tuple[DynamicScalerState, Any]:
    """Call `evaluate` until its result is finite, at most ``redo_on_nan + 1`` times.

    A non-finite attempt that could not lower the scale (it was already at
    ``min_scaler``) ends the loop too: a retry would compute the same thing again.

    `evaluate` is traced once, in the loop body, so the differentiated function is
    compiled once rather than once before the loop and again inside it. The loop
    carries only the array part of the results; the rest (Python numbers or
    objects in ``aux``) cannot change between attempts and is put back at the end.
    """
    _, _, result_shapes = eqx.filter_eval_shape(evaluate, state)
    array_shapes, static = eqx.partition(
        result_shapes, lambda leaf: isinstance(leaf, jax.ShapeDtypeStruct)
    )
    placeholder = jax.tree_util.tree_map(
        lambda s: jnp.zeros(s.shape, s.dtype), array_shapes
    )

    def keep_going(carry):
        _, _, retry, attempts = carry
        return (attempts == 0) | (retry & (attempts <= redo_on_nan))

    def attempt(carry):
        state, _, _, attempts = carry
        finite, next_state, results = evaluate(state)
        arrays, _ = eqx.partition(results, eqx.is_array)
        retry = ~finite & (next_state.scaler < state.scaler)
        return next_state, arrays, retry, attempts + 1

    init = (state, placeholder, jnp.array(False), jnp.array(0, jnp.int32))
    state, arrays, _, _ = jax.lax.while_loop(keep_going, attempt, init)
    return state, eqx.combine(arrays, static)


def dynamic_scale_tx(
    transform: Callable[..., Callable],
    redo_on_nan: int = 0,
    unscale_fn: Callable[[Any, DynamicScalerState], Any] = default_unscale_fn,
    scale_fn: Callable[[Any, DynamicScalerState], Any] = default_scale_fn,
    *,
    finite_fn: Callable[[Any], jax.Array] = all_finite,
) -> Callable[..., Callable]:
    """Add dynamic loss scaling to a gradient transform such as `jax.grad`.

    Args:
        transform: called as ``transform(scaled_fun, *args, **kwargs)``; returns the
            function computing the (scaled) results, e.g. `jax.value_and_grad`.
        redo_on_nan: how many times a non-finite step is recomputed, each time with
            the scale already reduced, before its results are returned as they are.
            The recomputation runs in a `lax.while_loop`, so it works under `jit`.
            It also stops once the scale is at ``min_scaler``, where it cannot be
            reduced further.
        unscale_fn: ``unscale_fn(results, state)`` undoes the scaling on the
            transform's results.
        scale_fn: ``scale_fn(output, state)`` scales the user function's output.
        finite_fn: ``finite_fn(unscaled_results)`` decides whether the step was
            finite; by default every inexact leaf of the results is checked.

    Returns:
        ``scaled_transform(fun, *args, **kwargs)``, which returns a function taking
        ``fun``'s arguments plus a required keyword ``dynamic_scaler_state`` and
        returning ``(next_dynamic_scaler_state, unscaled_results)``.

    Raises:
        TypeError, ValueError: if `redo_on_nan` is not a non-negative int.
    """
    _check_redo_on_nan(redo_on_nan)

    def scaled_transform(fun: Callable, *args: Any, **kwargs: Any) -> Callable:
        if not callable(fun):
            raise TypeError(f"expected a function to differentiate, got {fun!r}.")

        def scaled_fn(*f_args: Any, dynamic_scaler_state: Any, **f_kwargs: Any):
            def evaluate(state: DynamicScalerState):
                def scaled_fun(*a, **k):
                    return scale_fn(fun(*a, **k), state)

                results = transform(scaled_fun, *args, **kwargs)(*f_args, **f_kwargs)
                results = unscale_fn(results, state)
                finite = finite_fn(results)
                return finite, _next_state(state, finite), results

            state = _checked_state(dynamic_scaler_state)
            if redo_on_nan == 0:
                _, state, results = evaluate(state)
                return state, results
            return _redo_until_finite(evaluate, state, redo_on_nan)

        return scaled_fn

    return scaled_transform


# How each transform's results split into the scaled part (unscaled and checked for
# finiteness) and `aux` (neither: it does not depend on the scale, so a NaN in it
# must not shrink the scale or trigger recomputation).
def _whole(results):
    return results, lambda scaled: scaled


def _grads_aux(results):
    grads, aux = results
    return grads, lambda scaled: (scaled, aux)


def _value_aux_grads(results):
    (value, aux), grads = results
    return (value, grads), lambda scaled: ((scaled[0], aux), scaled[1])


def _aux_aware_tx(
    fun: Any,
    transform: Callable[..., Callable],
    split: Callable[[Any], tuple[Any, Callable[[Any], Any]]],
    has_aux: Any,
    redo_on_nan: Any,
    filter: Any,
    kwargs: dict[str, Any],
) -> Callable:
    for name, flag in (("has_aux", has_aux), ("filter", filter)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}.")

    def unscale_fn(results, state):
        scaled, rebuild = split(results)
        return rebuild(default_unscale_fn(scaled, state))

    tx = dynamic_scale_tx(
        transform,
        redo_on_nan=redo_on_nan,
        unscale_fn=unscale_fn,
        finite_fn=lambda results: all_finite(split(results)[0]),
    )
    return tx(fun, has_aux=has_aux, **kwargs)


def dynamic_scale_grad(
    fun: Callable,
    *,
    has_aux: bool = False,
    redo_on_nan: int = 0,
    filter: bool = True,
    **kwargs: Any,
) -> Callable:
    """Like `jax.grad(fun)`, with dynamic loss scaling.

    Args:
        fun: the function to differentiate; returns a scalar, or ``(scalar, aux)``
            with ``has_aux=True``.
        has_aux: as in `jax.grad`.
        redo_on_nan: how many times a step with non-finite gradients is
            recomputed with a reduced scale before it is returned as it is (fewer
            if the scale reaches ``min_scaler`` first).
        filter: differentiate with `equinox.filter_grad` (w.r.t. the inexact arrays
            of the first argument; other leaves get ``None``) if True, with
            `jax.grad` if False.
        **kwargs: passed on to the grad transform (e.g. ``argnums`` for `jax.grad`).

    Returns:
        A function taking ``fun``'s arguments and a required keyword argument
        ``dynamic_scaler_state`` (a `DynamicScalerState`), returning
        ``(next_state, grads)``, or ``(next_state, (grads, aux))`` with
        ``has_aux=True``. Gradients are unscaled and (if half precision) float32.
        Only the gradients decide whether the step was finite.

    Raises:
        TypeError: for non-bool ``has_aux``/``filter``, a bad ``redo_on_nan``, or
            (when called) a ``dynamic_scaler_state`` that is not a
            `DynamicScalerState`.
    """
    transform = eqx.filter_grad if filter else jax.grad
    split = _grads_aux if has_aux else _whole
    return _aux_aware_tx(fun, transform, split, has_aux, redo_on_nan, filter, kwargs)


def dynamic_scale_value_and_grad(
    fun: Callable,
    *,
    has_aux: bool = False,
    redo_on_nan: int = 10,
    filter: bool = True,
    **kwargs: Any,
) -> Callable:
    """Like `jax.value_and_grad(fun)`, with dynamic loss scaling.

    Args:
        fun: the function to differentiate; returns a scalar, or ``(scalar, aux)``
            with ``has_aux=True``.
        has_aux: as in `jax.value_and_grad`.
        redo_on_nan: how many times a step with a non-finite value or gradients is
            recomputed with a reduced scale before it is returned as it is (fewer
            if the scale reaches ``min_scaler`` first).
        filter: use `equinox.filter_value_and_grad` if True, `jax.value_and_grad`
            if False.
        **kwargs: passed on to the transform.

    Returns:
        A function taking ``fun``'s arguments and a required keyword argument
        ``dynamic_scaler_state``, returning ``(next_state, (value, grads))``, or
        ``(next_state, ((value, aux), grads))`` with ``has_aux=True``. Value and
        gradients are unscaled and (if half precision) float32; only they, not
        ``aux``, decide whether the step was finite.

    Raises:
        TypeError: as for `dynamic_scale_grad`.
    """
    transform = eqx.filter_value_and_grad if filter else jax.value_and_grad
    split = _value_aux_grads if has_aux else _whole
    return _aux_aware_tx(fun, transform, split, has_aux, redo_on_nan, filter, kwargs)
