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
from typing import Any, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np

from ._finite import first_finite

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
        warnings.warn(f"Expected floating type for {var_name}, got {dtype}")


def _scale_leaves(tree: T, factor: Any) -> T:
    return jax.tree_util.tree_map(lambda leaf: leaf * factor, tree)


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

    def adjust(self, grads_finite: jax.Array) -> "NoOpLossScale":
        """Returns `self`; there is nothing to adapt."""
        del grads_finite
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

    def adjust(self, grads_finite: jax.Array) -> "StaticLossScale":
        """Returns `self`; a static scale never changes."""
        del grads_finite
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

    def adjust(self, grads_finite: jax.Array) -> "DynamicLossScale":
        """The next loss scale, given whether this step's gradients were finite.

        Args:
            grads_finite: a boolean scalar, e.g. from `jaxamp.all_finite`.

        Returns:
            A new `DynamicLossScale`; `self` is not modified.

        Raises:
            AssertionError: if `grads_finite` is not a scalar.
        """
        assert grads_finite.ndim == 0, "Expected boolean scalar"
        grown = jax.lax.select(
            self.counter == (self.period - 1),
            first_finite(self.loss_scale * self.factor, self.loss_scale),
            self.loss_scale,
        )
        shrunk = jnp.maximum(self.min_loss_scale, self.loss_scale / self.factor)
        return DynamicLossScale(
            loss_scale=jax.lax.select(grads_finite, grown, shrunk),
            # Multiplying by the predicate zeroes the counter on a non-finite step.
            counter=((self.counter + 1) % self.period) * grads_finite,
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
    def tree_unflatten(cls, static: Any, leaves: Any) -> "DynamicLossScale":
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

LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]
