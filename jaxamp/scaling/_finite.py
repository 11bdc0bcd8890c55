"""The one finiteness check and tree select shared by every loss-scaling API.

`DynamicLossScale` (jmp-style), `DynamicScalerState` (jaxamp-style), `GradScaler`
(torch-style) and `skip_nonfinite_updates` (optax) all decide "was this step
finite?" and "keep the old values or take the new ones?" here, so they agree on
what counts as non-finite and on which leaves are looked at. `checked_scalar` is
the one validation of user-given scales and counters (finite, in range, of the
right kind) that the scaler states share, and `check_scale_bounds` the one check
that a scale lies within its ``[min, max]`` bounds.

Every decision is taken once for all devices (`on_every_device`): under `jax.jit`
over a global mesh the arrays are global and so is the check; inside `shard_map`
or `jax.pmap` each device sees only its own values, so the per-device flag is
reduced over the mesh axes the values differ over, with one scalar collective.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat

__all__ = [
    "AxisName",
    "all_finite",
    "check_axis_name",
    "check_scale_bounds",
    "checked_scalar",
    "first_finite",
    "is_inexact_leaf",
    "local_all_finite",
    "on_every_device",
    "select_tree",
]

T = TypeVar("T")

# A mesh or pmap axis name, or a tuple of them, as `jax.lax.psum` takes.
AxisName = Hashable | tuple[Hashable, ...]


def is_inexact_leaf(x: Any) -> bool:
    """Whether `x` is a leaf whose values can be inf or NaN.

    Floating and complex arrays (jax, including tracers, or numpy) and Python
    floats/complexes qualify. Integer and boolean arrays can never be non-finite,
    and non-array leaves (``None``, strings, functions inside an equinox Module,
    ``float0`` gradients) carry no numbers, so those are all skipped.
    """
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return jnp.issubdtype(x.dtype, jnp.inexact)
    return isinstance(x, (float, complex))


NOT_LOSS_SCALED = "__jaxamp_not_loss_scaled__"
"""A class attribute: a gradient of an object of this class is not scaled by the loss scale.

Set on `jaxamp.fp8.Fp8State`, whose "gradient" is the step's observed amaxes, not
a derivative of the loss: unscaling it would divide the forward amaxes by the
loss scale. `map_gradients` leaves such objects as they are.
"""


def map_gradients(fn: Any, tree: T) -> T:
    """``fn`` applied to every leaf of a gradient `tree`, but those of objects marked `NOT_LOSS_SCALED`."""
    marked = lambda x: getattr(type(x), NOT_LOSS_SCALED, False)  # noqa: E731
    return jax.tree_util.tree_map(lambda x: x if marked(x) else fn(x), tree, is_leaf=marked)


def local_all_finite(tree: Any) -> jax.Array:
    """Whether every inexact leaf of `tree` is free of inf and NaN, on this device only.

    The same check as `all_finite` without the reduction across devices: inside
    `shard_map` or `pmap` its answer may differ from one device to the next.
    """
    checks = [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree_util.tree_leaves(tree) if is_inexact_leaf(leaf)]
    if not checks:
        return jnp.array(True)
    return jnp.stack(checks).all()


def all_finite(tree: Any, axis_name: AxisName | None = None) -> jax.Array:
    """Whether every inexact leaf of `tree` is free of inf and NaN, on every device.

    Args:
        tree: any pytree. Only inexact leaves (see `is_inexact_leaf`) are checked.
        axis_name: inside `shard_map` or `jax.pmap`, the mesh axes (a name or a
            tuple of names, as `jax.lax.psum` takes) over which the values differ
            between devices; the answer is reduced over them, so every device
            gets the same one. See `on_every_device` for what happens without it.

    Returns:
        A boolean scalar array. ``True`` for ``None``, empty trees and trees
        without inexact leaves, since there is nothing that could have overflowed.

    Raises:
        ValueError: see `on_every_device`.
    """
    return on_every_device(local_all_finite(tree), axis_name, what="jaxamp.all_finite")


def check_axis_name(axis_name: Any, what: str) -> AxisName | None:
    """Validate an ``axis_name`` argument: None, a hashable name or a tuple of them.

    Raises:
        TypeError: for a list or another unhashable value, or a tuple holding one.
    """
    if axis_name is None:
        return None
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    for name in names:
        if isinstance(name, (tuple, list)) or not isinstance(name, Hashable):
            raise TypeError(
                f"{what}: axis_name must be a mesh or pmap axis name or a tuple of names "
                f"(as jax.lax.psum takes), got {axis_name!r}."
            )
    return axis_name


def on_every_device(ok: Any, axis_name: AxisName | None = None, *, what: str) -> jax.Array:
    """`ok` made one decision for all devices: true only where true on each.

    * `axis_name` given: the flag is reduced over those axes with one scalar
      collective (``axis_name=()`` keeps it per device, on purpose). Inside a
      `shard_map` with ``check_vma=True``, axes the flag still varies over after
      that are an error: devices along them would decide differently.
    * no `axis_name`, outside `shard_map` and `pmap` (plain code, or `jax.jit`
      over a mesh, where arrays are global): the flag is already everyone's.
    * no `axis_name`, inside a `shard_map` with ``check_vma=True`` (the
      default): JAX's types record the manual axes the flag varies over, and it
      is reduced over exactly those (none, and no collective, when the values
      were already reduced, e.g. by `jax.lax.pmean`).
    * no `axis_name`, inside `jax.pmap` or a `shard_map` with
      ``check_vma=False``: JAX does not record which values differ between
      devices, so there is nothing to decide by. A `ValueError` asks for
      `axis_name` rather than letting each device decide alone (which lets
      scales and parameters drift apart, and a redo loop around a collective
      hang).

    Args:
        ok: a boolean scalar, this device's answer (or a short boolean vector
            of answers, all reduced with the one collective).
        axis_name: as above.
        what: the API name error messages start with.

    Returns:
        Booleans shaped like `ok`, the same on every device along the reduced axes.

    Raises:
        ValueError: as above, or for an axis name that is not bound here.
        TypeError: for an `axis_name` that is not a name or a tuple of names.
    """
    axis_name = check_axis_name(axis_name, what)
    ok = jnp.asarray(ok)
    if ok.dtype != jnp.bool_ or ok.ndim > 1:
        raise TypeError(f"{what}: expected a boolean scalar or vector, got {ok.dtype}{list(ok.shape)}.")
    if axis_name is None:
        manual = _compat.manual_axes()
        if not manual:
            return ok
        if not _compat.tracks_varying_axes():
            names = manual[0] if len(manual) == 1 else manual
            unnamed = any(_compat.is_unnamed_axis(name) for name in manual)
            together = (
                "name the pmap's axis (jax.pmap(step, axis_name='batch')) and pass that name as axis_name"
                if unnamed
                else f"pass axis_name={names!r} (the axes the batch or the gradients are split over)"
            )
            raise ValueError(
                f"{what} runs per device here (inside jax.pmap or a shard_map with "
                f"check_vma=False, over mesh axes {manual}), where JAX does not record "
                "which values differ between devices. Where the devices split one model's "
                f"batch, {together}, so that all devices decide once together and their "
                "scales and parameters cannot drift apart. Where each device trains a model "
                "of its own (an ensemble), or every device is known to see the same values, "
                "pass axis_name=(): each device decides alone."
            )
        varying = _compat.varying_axes(ok)
        if not varying:
            return ok
        axis_name = tuple(name for name in manual if name in varying)
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not names:
        return ok
    try:
        bad_devices = jax.lax.psum(jnp.logical_not(ok).astype(jnp.int32), axis_name)
    except NameError as err:
        raise ValueError(
            f"{what}: axis_name={axis_name!r} names an axis that is not bound here "
            f"({err}); pass the names of the shard_map mesh axes or the pmap axis the "
            "call runs under."
        ) from None
    agreed = bad_devices == 0
    if _compat.manual_axes() and _compat.tracks_varying_axes():
        rest = _compat.varying_axes(agreed)
        if rest:
            raise ValueError(
                f"{what}: the values also differ between devices along mesh axes "
                f"{tuple(sorted(map(str, rest)))}, which axis_name={axis_name!r} does not "
                "include, so devices along them would decide differently; add them to "
                "axis_name (or leave axis_name out to reduce over every axis the values "
                "vary over)."
            )
    return agreed


def select_tree(pred: Any, a: T, b: T) -> T:
    """Take every leaf from `a` where `pred` is true, else from `b` (jmp's select_tree).

    Selecting (rather than branching with `lax.cond`) returns the very bits of the
    chosen tree, so a skipped step leaves parameters and optimizer state exactly as
    they were, and it behaves the same under `vmap`.

    Non-array leaves (the activation function or other fields of an Equinox
    module) are not selected between: they must be the same in both trees, and
    come back as they are.

    Args:
        pred: a boolean scalar (a 0-d bool array or a Python bool).
        a: the tree returned where `pred` is true.
        b: a tree with the same structure, shapes and dtypes as `a`.

    Returns:
        A tree shaped like `a` and `b`.

    Raises:
        AssertionError: "expected boolean scalar ..." if `pred` is not a 0-d bool
            (the exception type jmp raises; it is raised explicitly so that
            ``python -O`` does not drop the check).
        ValueError: if the trees differ in a non-array leaf.
    """
    shape, dtype = jnp.shape(pred), jnp.result_type(pred)
    if shape != () or dtype != jnp.bool_:
        raise AssertionError(f"expected boolean scalar for the select predicate, got {dtype}{list(shape)}")
    return jax.tree_util.tree_map(lambda x, y: _select_leaf(pred, x, y), a, b)


_NUMERIC = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


def _select_leaf(pred: jax.Array, x: Any, y: Any) -> Any:
    if isinstance(x, (bool, int, float, complex)) and type(x) is type(y) and x == y:
        return x  # a Python number in a module's fields stays a Python number
    if isinstance(x, _NUMERIC) and isinstance(y, _NUMERIC):
        return jax.lax.select(pred, jnp.asarray(x), jnp.asarray(y))
    # Equinox modules keep functions, strings and other objects as leaves: they
    # are part of the model, not of its state, and pass through when the same.
    if x is y or (not isinstance(x, _NUMERIC) and not isinstance(y, _NUMERIC) and _same(x, y)):
        return x
    raise ValueError(
        f"select_tree: the two trees differ in a non-array leaf ({x!r} vs {y!r}); "
        "only array leaves can be selected between."
    )


def _same(x: Any, y: Any) -> bool:
    try:
        return bool(x == y)
    except Exception:  # noqa: BLE001 - an object whose == is not a bool is not "the same"
        return False


def first_finite(candidate: jax.Array, fallback: jax.Array) -> jax.Array:
    """`candidate` if all its values are finite, else `fallback`.

    Used when growing a loss scale: a scale that overflows to inf would turn every
    later loss into inf, so growth is refused instead.
    """
    return jax.lax.select(jnp.isfinite(candidate).all(), candidate, fallback)


def _concrete(value: Any) -> np.ndarray | None:
    """`value` as a numpy array, or None when it is traced and cannot be inspected."""
    try:
        return np.asarray(value)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def checked_scalar(
    what: str, value: Any, dtype: Any, *, lower: float, inclusive: bool = True, host: bool = False
) -> jax.Array:
    """Validate a user-given scale or counter and return it as a `dtype` scalar array.

    Scaler state must have fixed dtypes to be carried through `jit` and
    `lax.while_loop`, but nothing is converted across kinds behind the user's
    back: Python ints are accepted for any field (they are untyped literals),
    Python floats and floating arrays only for a floating `dtype`, integer arrays
    only for an integer `dtype`, bools never.

    Args:
        what: how error messages name the value, e.g. ``"GradScaler init_scale"``.
        value: a Python number or a scalar array (possibly traced).
        dtype: the dtype to store, e.g. ``jnp.float32`` or ``jnp.int32``.
        lower: the smallest allowed value.
        inclusive: whether `lower` itself is allowed.
        host: keep a Python or numpy `value` on the host, as a numpy scalar:
            no device array is made, so JAX's backends are not started.

    Returns:
        A 0-d array of `dtype`.

    Raises:
        TypeError: for bools, non-numbers, or a value of the wrong kind.
        ValueError: for a non-scalar, or a concrete value that is inf, NaN or
            below the bound. Traced values are only checked for dtype and shape.
    """
    floating = jnp.issubdtype(dtype, jnp.floating)
    expected = "a float or int" if floating else "an int"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, jax.Array, np.ndarray, np.generic)):
        raise TypeError(f"{what} must be {expected} scalar, got {value!r} of type {type(value).__name__}.")
    kind_ok = isinstance(value, int) or jnp.issubdtype(
        jnp.result_type(value), jnp.integer if not floating else jnp.floating
    )
    if not kind_ok:
        raise TypeError(
            f"{what} must be {expected} scalar, got {value!r} with dtype "
            f"{np.dtype(jnp.result_type(value)).name}; convert it explicitly if intended."
        )
    if jnp.ndim(value) != 0:
        raise ValueError(f"{what} must be a scalar, got shape {jnp.shape(value)}.")
    concrete = _concrete(value)
    if concrete is not None:
        in_range = concrete >= lower if inclusive else concrete > lower
        if not (np.isfinite(concrete) and in_range):
            bound = ">=" if inclusive else ">"
            raise ValueError(f"{what} must be finite and {bound} {lower}, got {value!r}.")
    if host and not isinstance(value, jax.Array):
        return np.asarray(value, dtype=dtype)  # type: ignore[return-value]  # an array all the same
    return jnp.asarray(value, dtype=dtype)


def check_scale_bounds(what: str, scale: tuple[str, Any], lower: tuple[str, Any], upper: tuple[str, Any]) -> None:
    """Check ``lower <= upper`` and ``lower <= scale <= upper``, for concrete values.

    Each argument is a ``(name, value)`` pair, so the message names the fields as
    the user knows them. The values are already validated scalars (see
    `checked_scalar`); comparisons involving a traced value are skipped, like
    `checked_scalar`'s range checks.

    Args:
        what: the owner, e.g. ``"DynamicScalerState"``.
        scale: the scale's name and value.
        lower: the lower bound's name and value.
        upper: the upper bound's name and value.

    Raises:
        ValueError: the message names the offending values and the bounds.
    """
    (scale_name, s), (lower_name, lo), (upper_name, hi) = scale, lower, upper
    s, lo, hi = map(_concrete, (s, lo, hi))
    if lo is not None and hi is not None and not lo <= hi:
        raise ValueError(
            f"{what} {lower_name} must be <= {upper_name}, got {lower_name}={lo.item()!r} "
            f"and {upper_name}={hi.item()!r}."
        )
    if s is not None and lo is not None and not s >= lo:
        raise ValueError(
            f"{what} {scale_name} must be >= {lower_name}={lo.item()!r}, got "
            f"{s.item()!r}; lower {lower_name} if that scale is intended."
        )
    if s is not None and hi is not None and not s <= hi:
        raise ValueError(
            f"{what} {scale_name} must be <= {upper_name}={hi.item()!r}, got "
            f"{s.item()!r}; raise {upper_name} if that scale is intended."
        )
