"""jmp-compatible loss scales: `NoOpLossScale`, `StaticLossScale`, `DynamicLossScale`.

These behave exactly like DeepMind jmp's classes of the same names (same fields,
pytree layout, arithmetic and warnings), so code written against ``jmp`` works with
``jaxamp`` by changing the import. The one deliberate difference: jmp forgets a
custom `DynamicLossScale.min_loss_scale` whenever the scale is flattened (for
example on its way through `jax.jit`); here a concrete ``min_loss_scale`` is kept.
Also, rebuilding a scale from pytree leaves skips the dtype warnings, which are
meant for values users pass, not for JAX's placeholders.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from ._finite import AxisName, map_gradients, on_every_device
from ._scale_schedule import next_scale

__all__ = [
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "register_empty_pytree",
    "warn_if_not_floating",
]

T = TypeVar("T")


def register_empty_pytree(cls: type) -> None:
    """Register `cls` as a pytree node without leaves.

    The whole instance becomes static (treedef) data, so it must be hashable and
    comparable; a change of instance means a retrace under `jax.jit`.

    Args:
        cls: the class to register.
    """
    jax.tree_util.register_pytree_node(cls, lambda obj: ((), obj), lambda obj, _: obj)


def warn_if_not_floating(x: Any, var_name: str) -> None:
    """Warn if `x` does not have a floating dtype.

    JAX may rebuild pytrees with a bare ``object()`` in every leaf to learn their
    structure; see
    https://jax.readthedocs.io/en/latest/pytrees.html#custom-pytrees-and-initialization.
    Such placeholders are ignored rather than warned about.

    Args:
        x: an array, Python number, tracer or placeholder.
        var_name: the field name the warning names.
    """
    if type(x) is object:
        return
    dtype = jax.eval_shape(lambda: x).dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        warnings.warn(f"Expected floating type for {var_name}, got {dtype}", stacklevel=2)


def _scale_leaves(tree: T, factor: Any) -> T:
    return map_gradients(lambda leaf: leaf * factor, tree)


@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
    """A loss scale that does nothing: `scale` and `unscale` return their input."""

    @property
    def loss_scale(self) -> int:
        return 1

    def scale(self, tree: T) -> T:
        """Returns `tree` itself."""
        return tree

    def unscale(self, tree: T) -> T:
        """Returns `tree` itself."""
        return tree

    def adjust(self, grads_finite: jax.Array, axis_name: AxisName | None = None) -> NoOpLossScale:
        """Returns `self`; there is nothing to adapt."""
        del grads_finite, axis_name
        return self


@dataclasses.dataclass(frozen=True)
class StaticLossScale:
    """Multiplies and divides by a constant.

    The instance is static pytree data (it has no leaves), exactly as in jmp.

    Attributes:
        loss_scale: the constant (a Python number or array).
    """

    loss_scale: Any

    def scale(self, tree: T) -> T:
        """Every leaf of `tree` times `loss_scale`."""
        return _scale_leaves(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        """Every leaf of `tree` times ``1 / loss_scale``."""
        return _scale_leaves(tree, 1 / self.loss_scale)

    def adjust(self, grads_finite: jax.Array, axis_name: AxisName | None = None) -> StaticLossScale:
        """Returns `self`; a static scale never changes."""
        del grads_finite, axis_name
        return self


def _default_min_loss_scale() -> np.ndarray:
    return np.ones([], np.float32)


def _hashable_key(value: Any) -> Any:
    """A hashable stand-in for a concrete scalar, or None if `value` is traced."""
    try:
        array = np.asarray(value)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None
    return (array.dtype.str, array.shape, array.tobytes())


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """A loss scale that grows while gradients stay finite and shrinks when they don't.

    It looks for the largest scale that keeps gradients finite::

        if grads_finite:
            counter = (counter + 1) % period
            if counter == 0:  # `period` finite steps in a row
                loss_scale = loss_scale * factor, unless that overflows
        else:
            counter = 0
            loss_scale = max(min_loss_scale, loss_scale / factor)

    This is the rule all of jaxamp's scalers share (``_scale_schedule.next_scale``,
    with ``patience = period - 1`` and no upper bound but float32's range). For the
    counters `adjust` produces, ``0 <= counter < period``, it is jmp's exactly; a
    counter constructed at ``period`` or above grows the scale on the next finite
    step, where jmp would wrap it around without growing.

    Typical use::

        loss_scale = jaxamp.DynamicLossScale(jnp.float32(2**15))
        for _ in range(num_steps):
            loss = loss_scale.scale(loss)            # inside the loss function
            grads = loss_scale.unscale(grads)
            grads_finite = jaxamp.all_finite(grads)
            loss_scale = loss_scale.adjust(grads_finite)
            # apply the update only if grads_finite (see `jaxamp.select_tree`)

    Pytree layout (as jmp): leaves ``(loss_scale, counter)``; ``period`` and
    ``factor`` are static. Unlike jmp, a concrete ``min_loss_scale`` is kept in the
    static data instead of being reset to 1 when the pytree is rebuilt (a traced
    one, created inside `jit`, still is: static data must be hashable).

    Attributes:
        loss_scale: the current scale; should be floating (a warning says otherwise).
        counter: finite steps since the scale last changed (int32 scalar).
        period: finite steps between two growths.
        factor: growth and shrink factor.
        min_loss_scale: the scale never shrinks below this; should be floating.
    """

    loss_scale: Any
    counter: Any = dataclasses.field(default_factory=lambda: np.zeros([], np.int32))
    period: int = 2000
    factor: int = 2
    min_loss_scale: Any = dataclasses.field(default_factory=_default_min_loss_scale)

    def __post_init__(self) -> None:
        warn_if_not_floating(self.loss_scale, "loss_scale")
        warn_if_not_floating(self.min_loss_scale, "min_loss_scale")

    def scale(self, tree: T) -> T:
        """Every leaf of `tree` times `loss_scale`."""
        return _scale_leaves(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        """Every leaf of `tree` times ``1 / loss_scale``."""
        return _scale_leaves(tree, 1 / self.loss_scale)

    def adjust(self, grads_finite: jax.Array, axis_name: AxisName | None = None) -> DynamicLossScale:
        """The next loss scale, given whether this step's gradients were finite.

        Args:
            grads_finite: a boolean scalar, e.g. from `jaxamp.all_finite`.
            axis_name: inside `shard_map` or `jax.pmap`, the axes (a name or a
                tuple of names) `grads_finite` is reduced over first, so every
                device keeps the same scale (see `jaxamp.all_finite`). Not
                needed when `grads_finite` came from ``all_finite(grads,
                axis_name=...)``.

        Returns:
            A new `DynamicLossScale`; `self` is not modified.

        Raises:
            AssertionError: if `grads_finite` is not a scalar.
            TypeError: if it is a scalar but not boolean.
        """
        assert grads_finite.ndim == 0, "Expected boolean scalar"
        if grads_finite.dtype == jnp.bool_:
            grads_finite = on_every_device(grads_finite, axis_name, what="DynamicLossScale.adjust")
        # jmp grows on the `period`-th finite step in a row: after `period - 1`
        # finite steps that did not grow. jmp has no upper bound; growth that
        # would overflow to inf is refused, as in jmp.
        loss_scale, counter = next_scale(
            self.loss_scale,
            self.counter,
            grads_finite,
            patience=self.period - 1,
            growth_factor=self.factor,
            backoff_divisor=self.factor,
            min_scale=self.min_loss_scale,
            max_scale=jnp.inf,
        )
        return DynamicLossScale(
            loss_scale=loss_scale,
            counter=counter,
            period=self.period,
            factor=self.factor,
            min_loss_scale=self.min_loss_scale,
        )

    def tree_flatten(self) -> tuple[tuple[Any, Any], tuple[Any, Any, Any]]:
        """Leaves ``(loss_scale, counter)``; static ``(period, factor, min_loss_scale)``."""
        # An array is not hashable, so the minimum travels as bytes and is rebuilt.
        key = _hashable_key(self.min_loss_scale)
        return (self.loss_scale, self.counter), (self.period, self.factor, key)

    @classmethod
    def tree_unflatten(cls, static: Any, leaves: Any) -> DynamicLossScale:
        """Rebuild from `tree_flatten`'s output (a traced minimum comes back as 1)."""
        period, factor, key = static
        if key is None:
            min_loss_scale = _default_min_loss_scale()
        else:
            dtype, shape, raw = key
            min_loss_scale = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
        # Skip __post_init__: JAX fills leaves with placeholders and tracers, which
        # must not trigger warnings meant for users.
        obj = object.__new__(cls)
        for name, value in zip(
            ("loss_scale", "counter", "period", "factor", "min_loss_scale"),
            (*leaves, period, factor, min_loss_scale),
        ):
            object.__setattr__(obj, name, value)
        return obj


jax.tree_util.register_pytree_node_class(DynamicLossScale)
register_empty_pytree(NoOpLossScale)
register_empty_pytree(StaticLossScale)

LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale
