"""Floating-point dtype names, parsing and the set of dtypes amp may cast.

One place decides which dtypes are "ours" to cast (float32, float16, bfloat16:
never ints, bools, float64 or complex) and how user-facing dtype strings are read,
so `amp(compute_dtype=...)`, `Policy.from_string` and `parse_dtype` agree.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "CASTABLE_DTYPES",
    "array_part",
    "canonical_compute_dtype",
    "cast_floating",
    "dtype_short_name",
    "half_dtype",
    "is_castable",
    "parse_dtype",
]

# The only dtypes amp ever converts from or to. float64 and complex are left alone:
# a user who enabled x64 or works in complex numbers asked for that precision.
CASTABLE_DTYPES: frozenset[np.dtype] = frozenset(np.dtype(d) for d in (jnp.float32, jnp.float16, jnp.bfloat16))

# First name of each tuple is the short name used by `str(Policy)`.
_DTYPE_NAMES: dict[np.dtype, tuple[str, ...]] = {
    np.dtype(jnp.float32): ("f32", "float32", "full", "fp32"),
    np.dtype(jnp.bfloat16): ("bf16", "bfloat16"),
    np.dtype(jnp.float16): ("f16", "float16", "fp16"),
    np.dtype(jnp.float64): ("f64", "float64", "fp64"),
}
_NAME_TO_DTYPE: dict[str, np.dtype] = {name: dtype for dtype, names in _DTYPE_NAMES.items() for name in names}
_ACCEPTED = ", ".join(sorted(_NAME_TO_DTYPE) + ["half"])


def half_dtype() -> np.dtype:
    """The half-precision dtype for the current default backend.

    Returns:
        `bfloat16` on TPU (where float16 has no fast path), `float16` elsewhere.
    """
    platform = jax.local_devices()[0].platform
    return np.dtype(jnp.bfloat16 if platform == "tpu" else jnp.float16)


def parse_dtype(value: str) -> np.dtype:
    """Parse a dtype abbreviation such as ``"f32"``, ``"bf16"``, ``"full"`` or ``"half"``.

    Args:
        value: the name; surrounding whitespace and case are ignored. ``"half"`` is
            the platform's half type (see `half_dtype`), ``"full"`` is float32.

    Returns:
        The corresponding `numpy.dtype`.

    Raises:
        TypeError: if `value` is not a string.
        ValueError: if the name is unknown, e.g. ``"Unknown dtype: f17"``.
    """
    if not isinstance(value, str):
        raise TypeError(f"parse_dtype expects a string such as 'bf16', got {value!r}.")
    key = value.strip().lower()
    if key == "half":
        return half_dtype()
    try:
        return _NAME_TO_DTYPE[key]
    except KeyError:
        raise ValueError(f"Unknown dtype: {value} (expected one of: {_ACCEPTED}).") from None


# Names diagnostics show for the float8 formats of amp's fp8 mode. Not parsed:
# no compute dtype or policy is float8 (fp8 mode is named "fp8", see `jaxamp.fp8._matmul`).
_FLOAT8_SHORT_NAMES: dict[np.dtype, str] = {
    np.dtype(jnp.float8_e4m3fn): "e4m3",
    np.dtype(jnp.float8_e5m2): "e5m2",
}


def dtype_short_name(dtype: Any) -> str:
    """The short name of a floating dtype (``"f32"``, ``"bf16"``, ``"e4m3"``...), or its numpy name."""
    dtype = np.dtype(dtype)
    names = _DTYPE_NAMES.get(dtype)
    return names[0] if names else _FLOAT8_SHORT_NAMES.get(dtype, dtype.name)


def is_castable(dtype: Any) -> bool:
    """Whether amp may convert values of this dtype (float32, float16 or bfloat16)."""
    try:
        return np.dtype(dtype) in CASTABLE_DTYPES
    except TypeError:
        return False


def canonical_compute_dtype(value: Any, *, argname: str = "compute_dtype") -> np.dtype:
    """Validate a user-supplied compute dtype and return it as a `numpy.dtype`.

    Accepts dtype objects (``jnp.bfloat16``, ``np.dtype("float16")``) and the names
    `parse_dtype` knows. Only float16, bfloat16 and float32 are valid compute dtypes.

    Raises:
        ValueError: for an unknown dtype name.
        TypeError: for anything that is not a floating dtype amp can compute in.
    """
    if isinstance(value, str):
        key = value.strip().lower()
        if key == "half" or key in _NAME_TO_DTYPE:
            dtype = parse_dtype(key)
        else:
            try:
                dtype = np.dtype(key)
            except TypeError:
                raise ValueError(
                    f"Unknown {argname} {value!r}: expected one of {_ACCEPTED}, or a dtype such as jnp.bfloat16."
                ) from None
    else:
        try:
            # np.dtype(None) is float64, which would report "got float64" for a
            # missing dtype: treat None as the non-dtype it is.
            if value is None:
                raise TypeError
            dtype = np.dtype(value)
        except TypeError:
            raise TypeError(
                f"{argname} must be a floating dtype (jnp.float16, jnp.bfloat16, "
                f"jnp.float32) or its name, got {value!r}."
            ) from None
    if dtype not in CASTABLE_DTYPES:
        raise TypeError(
            f"{argname} must be float16, bfloat16 or float32, got {dtype.name}: amp "
            "only computes in these floating dtypes."
        )
    return dtype


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Cast every floating-point array leaf of `tree` (jax or numpy) to `dtype`.

    Integer, boolean and complex leaves and non-array leaves (Python scalars,
    strings, objects) are returned untouched. This is jmp's `_cast_floating_to`,
    shared by `Policy.cast_to_*`, `cast_to_full`/`cast_to_half` and the sharding
    helpers' `dtype_specs`.
    """

    def cast(x):
        if isinstance(x, (np.ndarray, jax.Array)) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jax.tree_util.tree_map(cast, tree)


def array_part(tree: Any) -> Any:
    """`tree` with the non-array leaves of every Equinox module in it replaced by ``None``.

    An Equinox module keeps its activation function, strings and Python
    numbers (a dropout rate) among its leaves; Equinox's convention is that
    only its arrays are parameters (`equinox.filter_grad` gives the rest
    ``None`` gradients), so the optimizers see exactly
    ``eqx.filter(module, eqx.is_array)`` and a module can be passed as it is.
    Leaves outside modules are kept: a Python number in a dict of parameters
    is a parameter, and is checked as one.
    """

    def filtered(node: Any) -> Any:
        return eqx.filter(node, eqx.is_array) if isinstance(node, eqx.Module) else node

    return jax.tree_util.tree_map(filtered, tree, is_leaf=lambda node: isinstance(node, eqx.Module))
