"""A functional, jit-able counterpart of PyTorch's ``torch.amp.GradScaler``.

PyTorch's scaler mutates itself and the optimizer; here every method returns new
values instead, and the scaler is an immutable pytree that can be passed through
`jax.jit` (its scale, growth tracker, inf flag and settings are arrays, so a
checkpoint holds them all; whether it is enabled and where it is in an iteration
are static)::

    scaler = jaxamp.GradScaler()
    grads = jax.grad(lambda p: scaler.scale(loss_fn(p)))(params)
    params, opt_state, scaler = scaler.step(optimizer, grads, opt_state, params)
    scaler = scaler.update()

The update rule is torch's: a step with inf/NaN gradients is skipped and multiplies
the scale by ``backoff_factor``; after ``growth_interval`` finite steps in a row the
scale is multiplied by ``growth_factor`` (unless that overflows). Unlike torch, the
scale stays within ``[min_scale, max_scale]`` (see `GradScaler`); the rule itself
is the one all of jaxamp's scalers share (``_scale_schedule.next_scale``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from ._finite import (
    AxisName,
    check_axis_name,
    check_scale_bounds,
    checked_scalar,
    is_inexact_leaf,
    local_all_finite,
    map_gradients,
    on_every_device,
    select_tree,
)
from ._optax import apply_if_finite_updates
from ._scale_schedule import next_scale

__all__ = ["GradScaler"]

T = TypeVar("T")

# Where the scaler is within an iteration; torch tracks the same per optimizer.
_READY, _UNSCALED, _STEPPED = "ready", "unscaled", "stepped"


def _real_number(name: str, value: Any) -> float:
    # Settings are given as Python numbers, validated, then carried as arrays.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a Python float, got {value!r} of type {type(value).__name__}.")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}.")
    return float(value)


def _check_growth_factor(value: Any) -> float:
    value = _real_number("growth_factor", value)
    if not value > 1.0:
        raise ValueError(f"growth_factor must be > 1.0, got {value}.")
    return value


def _check_backoff_factor(value: Any) -> float:
    value = _real_number("backoff_factor", value)
    if not 0.0 < value < 1.0:
        raise ValueError(f"backoff_factor must be in (0, 1), got {value}.")
    return value


def _check_growth_interval(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"growth_interval must be a positive int, got {value!r} of type {type(value).__name__}.")
    if value <= 0:
        raise ValueError(f"growth_interval must be a positive int, got {value}.")
    return int(value)


def _setting(value: float | int) -> jax.Array:
    """A validated Python setting as the scalar array the scaler carries."""
    return jnp.asarray(value, jnp.int32 if isinstance(value, int) else jnp.float32)


def _check_scale(name: str, value: Any) -> jax.Array:
    return checked_scalar(f"GradScaler {name}", value, jnp.float32, lower=0.0, inclusive=False)


def _check_bounds(min_scale: Any, max_scale: Any) -> tuple[float, float]:
    min_scale = _real_number("min_scale", min_scale)
    max_scale = _real_number("max_scale", max_scale)
    if not min_scale > 0.0:
        raise ValueError(f"min_scale must be > 0.0, got {min_scale}.")
    if not min_scale <= max_scale:
        raise ValueError(f"min_scale must be <= max_scale, got min_scale={min_scale} and max_scale={max_scale}.")
    return min_scale, max_scale


def _check_scale_in_bounds(
    name: str, scale: jax.Array, min_scale: float | jax.Array, max_scale: float | jax.Array
) -> None:
    check_scale_bounds("GradScaler", (name, scale), ("min_scale", min_scale), ("max_scale", max_scale))


class GradScaler(eqx.Module):
    """Loss scaling with PyTorch ``GradScaler`` semantics, as an immutable pytree.

    Args:
        init_scale: the initial scale (positive and finite).
        growth_factor: multiplies the scale after ``growth_interval`` finite steps
            in a row; must be > 1.
        backoff_factor: multiplies the scale after a non-finite step; in (0, 1).
        growth_interval: consecutive finite steps needed to grow; a positive int.
        enabled: if False, `scale`/`unscale` are identities, `step` always applies
            the update and `update` does nothing.
        min_scale: backing off never takes the scale below this (positive).
        max_scale: growing never takes the scale above this (finite,
            ``>= min_scale``; ``2**24`` by default, NVIDIA apex's
            ``max_loss_scale``).
        axis_name: inside `shard_map` or `jax.pmap`, the axes (a name or a
            tuple of names) over which the inf check of `unscale`/`step` is
            reduced, so every device skips the same steps and keeps the same
            scale; see `jaxamp.all_finite` for what happens without it there.

    torch's ``GradScaler`` has neither bound: its scale can back off to 0 in a
    long enough run of inf/NaN steps, after which ``0 * loss`` and ``0 / 0``
    make every step non-finite, and nothing brings it back. The bounds (and
    `init_scale` having to lie within them) are the only difference from torch's
    update rule.

    Raises:
        TypeError: a non-numeric or bool argument, a non-int growth interval, or a
            non-bool ``enabled``.
        ValueError: an argument out of its range (including ``init_scale``
            outside ``[min_scale, max_scale]``); the message names the value.
    """

    _scale: jax.Array
    _growth_tracker: jax.Array
    _found_inf: jax.Array
    # The settings are array leaves, not static fields, so that they travel
    # with the scaler through a checkpoint (as torch's `state_dict` carries
    # them): a scaler restored into a target built with other settings takes
    # the saved ones.
    _growth_factor: jax.Array
    _backoff_factor: jax.Array
    _growth_interval: jax.Array
    _enabled: bool = eqx.field(static=True)
    _stage: str = eqx.field(static=True)
    _min_scale: jax.Array
    _max_scale: jax.Array
    _axis_name: AxisName | None = eqx.field(static=True)

    def __init__(
        self,
        init_scale: float = 65536.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        axis_name: AxisName | None = None,
    ):
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {enabled!r}.")
        self._scale = _check_scale("init_scale", init_scale)
        self._growth_tracker = jnp.zeros([], jnp.int32)
        self._found_inf = jnp.array(False)
        self._growth_factor = _setting(_check_growth_factor(growth_factor))
        self._backoff_factor = _setting(_check_backoff_factor(backoff_factor))
        self._growth_interval = _setting(_check_growth_interval(growth_interval))
        self._enabled = enabled
        self._stage = _READY
        self._min_scale, self._max_scale = map(_setting, _check_bounds(min_scale, max_scale))
        self._axis_name = check_axis_name(axis_name, "GradScaler")
        _check_scale_in_bounds("init_scale", self._scale, self._min_scale, self._max_scale)

    def _replace(self, **changes: Any) -> GradScaler:
        # Static fields can't be swapped with `eqx.tree_at`, and `__init__` takes
        # user-facing arguments, so build the new instance field by field, as
        # equinox itself does when unflattening.
        new = object.__new__(type(self))
        for field in dataclasses.fields(self):
            value = changes.pop(field.name, getattr(self, field.name))
            object.__setattr__(new, field.name, value)
        assert not changes, f"unknown GradScaler fields {sorted(changes)}"
        return new

    def scale(self, tree: T) -> T:
        """Multiply every floating leaf of `tree` (typically the loss) by the scale.

        The product is computed in each leaf's own dtype, like torch: a float16 loss
        stays float16, so an overflow shows up as inf.

        Raises:
            TypeError: for a leaf that is not floating (integers are not scaled).
        """
        if not self._enabled:
            return tree

        def scale_leaf(leaf):
            if not is_inexact_leaf(leaf):
                raise TypeError(f"GradScaler.scale expects floating-point values, got {leaf!r}.")
            leaf = jnp.asarray(leaf)
            return leaf * self._scale.astype(leaf.dtype)

        return jax.tree_util.tree_map(scale_leaf, tree)

    def unscale(self, grads: T) -> tuple[T, GradScaler]:
        """Divide gradients by the scale and record whether any was inf or NaN.

        Call it before working on the gradients (e.g. clipping); `step` then uses
        them as they are. Each leaf keeps its dtype; the product is formed in
        float32. Non-floating leaves (``None``, integers) pass through.

        Returns:
            ``(unscaled_grads, scaler)``; the new scaler remembers the inf check.

        Raises:
            RuntimeError: if called twice, or after `step`, before `update`.
        """
        if not self._enabled:
            return grads, self
        if self._stage == _UNSCALED:
            raise RuntimeError("unscale() has already been called since the last update().")
        if self._stage == _STEPPED:
            raise RuntimeError("unscale() is being called after step(); call update() first.")
        inv_scale = 1.0 / self._scale

        def unscale_leaf(leaf):
            if not is_inexact_leaf(leaf):
                return leaf
            leaf = jnp.asarray(leaf)
            return (leaf.astype(jnp.float32) * inv_scale).astype(leaf.dtype)

        unscaled = map_gradients(unscale_leaf, grads)
        finite = on_every_device(local_all_finite(unscaled), self._axis_name, what="GradScaler.unscale")
        found_inf = jnp.logical_not(finite)
        return unscaled, self._replace(_found_inf=found_inf, _stage=_UNSCALED)

    def step(
        self,
        optimizer: optax.GradientTransformation,
        grads: Any,
        opt_state: Any,
        params: Any,
        **extra_args: Any,
    ) -> tuple[Any, Any, GradScaler]:
        """Unscale `grads` (unless `unscale` was called) and apply one optimizer step.

        If any gradient is inf or NaN the step is skipped: `params` and `opt_state`
        are returned bit for bit unchanged.

        Args:
            optimizer: an optax gradient transformation.
            grads: the scaled gradients, or unscaled ones if `unscale` was called.
            opt_state: the optimizer's state.
            params: the parameters.
            **extra_args: passed to ``optimizer.update`` (e.g. ``value`` for
                line-search optimizers).

        Returns:
            ``(params, opt_state, scaler)``.

        Raises:
            TypeError: if `optimizer` has no ``update`` function.
            RuntimeError: if `step` was already called since the last `update`.
        """
        if not callable(getattr(optimizer, "update", None)):
            raise TypeError(f"step expects an optax GradientTransformation, got {optimizer!r}.")
        if self._stage == _STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        scaler = self
        if self._enabled and self._stage == _READY:
            grads, scaler = self.unscale(grads)
        updates, new_opt_state = optimizer.update(grads, opt_state, params, **extra_args)
        if not self._enabled:
            return optax.apply_updates(params, updates), new_opt_state, self
        finite = jnp.logical_not(scaler._found_inf)
        return (
            apply_if_finite_updates(params, updates, finite),
            select_tree(finite, new_opt_state, opt_state),
            scaler._replace(_stage=_STEPPED),
        )

    def update(self, new_scale: Any = None) -> GradScaler:
        """The scaler for the next iteration.

        Without `new_scale`: after a step with inf/NaN gradients the scale is
        multiplied by ``backoff_factor`` (but not below ``min_scale``) and the
        growth tracker reset; otherwise the tracker counts one more finite step
        and, on reaching ``growth_interval``, the scale is multiplied by
        ``growth_factor`` (capped at ``max_scale``, kept if the product overflows)
        and the tracker reset. With `new_scale`, the scale is set to it and the
        tracker is left alone, as in torch.

        Args:
            new_scale: optional new scale, a float or a floating scalar array,
                within ``[min_scale, max_scale]`` (checked unless traced).

        Returns:
            A new `GradScaler`, ready for the next `unscale`/`step`.

        Raises:
            RuntimeError: without `new_scale`, if no `step` or `unscale` recorded an
                inf check since the last update.
            TypeError, ValueError: for an invalid `new_scale`.
        """
        if not self._enabled:
            return self
        ready = dict(_found_inf=jnp.array(False), _stage=_READY)
        if new_scale is not None:
            scale = _check_scale("new_scale", new_scale)
            _check_scale_in_bounds("new_scale", scale, self._min_scale, self._max_scale)
            return self._replace(_scale=scale, **ready)
        if self._stage == _READY:
            raise RuntimeError("No inf checks were recorded prior to update(); call step() or unscale() first.")
        # torch grows when `growth_tracker + 1 >= growth_interval`.
        scale, tracker = next_scale(
            self._scale,
            self._growth_tracker,
            jnp.logical_not(self._found_inf),
            patience=self._growth_interval - 1,
            growth_factor=self._growth_factor,
            backoff_factor=self._backoff_factor,
            min_scale=self._min_scale,
            max_scale=self._max_scale,
        )
        return self._replace(_scale=scale, _growth_tracker=tracker, **ready)

    @property
    def found_inf(self) -> jax.Array:
        """Whether the gradients seen by the latest `unscale`/`step` had inf or NaN.

        Reset to False by `update`; read it between `step` and `update` to log
        skipped steps.
        """
        return self._found_inf

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled); not under `jit`."""
        return float(self._scale) if self._enabled else 1.0

    def is_enabled(self) -> bool:
        """Whether scaling is enabled."""
        return self._enabled

    def get_growth_factor(self) -> float:
        """The growth factor, a Python float; not under `jit`."""
        return float(self._growth_factor)

    def get_backoff_factor(self) -> float:
        """The backoff factor, a Python float; not under `jit`."""
        return float(self._backoff_factor)

    def get_growth_interval(self) -> int:
        """The growth interval, a Python int; not under `jit`."""
        return int(self._growth_interval)

    def set_growth_factor(self, new_factor: float) -> GradScaler:
        """A copy with another growth factor (> 1)."""
        return self._replace(_growth_factor=_setting(_check_growth_factor(new_factor)))

    def set_backoff_factor(self, new_factor: float) -> GradScaler:
        """A copy with another backoff factor (in (0, 1))."""
        return self._replace(_backoff_factor=_setting(_check_backoff_factor(new_factor)))

    def set_growth_interval(self, new_interval: int) -> GradScaler:
        """A copy with another growth interval (a positive int)."""
        return self._replace(_growth_interval=_setting(_check_growth_interval(new_interval)))

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state as Python numbers, for checkpoints (host side only).

        Returns:
            torch's five entries ``{"scale", "growth_factor", "backoff_factor",
            "growth_interval", "_growth_tracker"}`` plus ``"min_scale"`` and
            ``"max_scale"``, or ``{}`` when disabled. Take it after `update`.
        """
        if not self._enabled:
            return {}
        return {
            "scale": float(self._scale),
            "growth_factor": self.get_growth_factor(),
            "backoff_factor": self.get_backoff_factor(),
            "growth_interval": self.get_growth_interval(),
            "_growth_tracker": int(self._growth_tracker),
            "min_scale": float(self._min_scale),
            "max_scale": float(self._max_scale),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> GradScaler:
        """A scaler with the state from `state_dict` (returns `self` when disabled).

        A torch state dict has no ``"min_scale"``/``"max_scale"``; this scaler's
        own bounds are kept then.

        Raises:
            RuntimeError: for an empty dict (saved from a disabled scaler).
            KeyError: if one of torch's five entries is missing.
            TypeError, ValueError: for invalid values, including a ``"scale"``
                outside the bounds (construct the scaler with wider ones).
        """
        if not self._enabled:
            return self
        if not state_dict:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled GradScaler."
            )
        missing = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"} - set(state_dict)
        if missing:
            raise KeyError(f"GradScaler state dict is missing {sorted(missing)}.")
        tracker = checked_scalar("GradScaler _growth_tracker", state_dict["_growth_tracker"], jnp.int32, lower=0)
        min_scale, max_scale = _check_bounds(
            state_dict.get("min_scale", float(self._min_scale)),
            state_dict.get("max_scale", float(self._max_scale)),
        )
        scale = _check_scale("scale", state_dict["scale"])
        _check_scale_in_bounds("scale", scale, min_scale, max_scale)
        return self._replace(
            _scale=scale,
            _growth_tracker=tracker,
            _found_inf=jnp.array(False),
            _growth_factor=_setting(_check_growth_factor(state_dict["growth_factor"])),
            _backoff_factor=_setting(_check_backoff_factor(state_dict["backoff_factor"])),
            _growth_interval=_setting(_check_growth_interval(state_dict["growth_interval"])),
            _stage=_READY,
            _min_scale=_setting(min_scale),
            _max_scale=_setting(max_scale),
        )
