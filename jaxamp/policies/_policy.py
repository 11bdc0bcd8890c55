"""Mixed-precision policies: the dtypes of parameters, computation and outputs.

`Policy` is jmp's three-dtype record and `get_policy` reads the string grammar
jmp and eformer share (``"bf16"``, ``"p=f32,c=bf16,o=f32"``). Dtype names, the
platform half type and the casting rule itself live in `jaxamp._dtypes`, so a
policy string and ``amp(compute_dtype=...)`` accept the same names.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, TypeVar

import numpy as np

from .._dtypes import (
    _DTYPE_NAMES,
    canonical_compute_dtype,
    cast_floating,
    dtype_short_name,
    half_dtype,
    is_castable,
    parse_dtype,
)

__all__ = ["Policy", "cast_to_full", "cast_to_half", "dtype_to_names", "get_policy"]

T = TypeVar("T")

# jmp's table (dtype -> names, short name first) under jmp's name, so code written
# against `jmp._src.policy` ports unchanged. Keyed by the scalar type as well as
# the numpy dtype: jmp users index it with `jnp.float32`, which hashes like
# `np.float32` but not like `np.dtype("float32")`.
dtype_to_names: types.MappingProxyType = types.MappingProxyType(
    {key: names for dtype, names in _DTYPE_NAMES.items() for key in (dtype, dtype.type)}
)

_KEY_TO_FIELD = {
    "p": "param_dtype",
    "params": "param_dtype",
    "c": "compute_dtype",
    "compute": "compute_dtype",
    "o": "output_dtype",
    "output": "output_dtype",
}
_EXPECTED_KEYS = "p/params, c/compute or o/output"
_EXAMPLES = "a dtype such as 'bf16', or key=value pairs such as 'p=f32,c=bf16,o=f32'"


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which dtype parameters are stored in, computation runs in, and outputs use.

    Frozen and hashable, so it can be a static argument of `jax.jit` or a static
    field of an `equinox.Module`. The fields always hold `numpy.dtype` objects:
    ``Policy(jnp.float32, ...) == Policy(np.float32, ...) == Policy("f32", ...)``,
    and each field compares equal to ``jnp.float32``-style scalar types.

    Attributes:
        param_dtype: dtype parameters are stored (and optimised) in.
        compute_dtype: dtype the forward and backward computation runs in.
        output_dtype: dtype of the function's outputs.

    Raises:
        ValueError: on construction, for a dtype name `parse_dtype` does not know.
        TypeError: on construction, for a value that is not float32, bfloat16 or
            float16 (amp never casts to other dtypes, float64 included).

    Example:
        >>> policy = Policy(jnp.float32, jnp.bfloat16, jnp.float32)
        >>> str(policy)
        'p=f32,c=bf16,o=f32'
        >>> policy == get_policy("p=f32,c=bf16,o=f32")
        True
    """

    param_dtype: np.dtype
    compute_dtype: np.dtype
    output_dtype: np.dtype

    def __post_init__(self):
        for field in dataclasses.fields(self):
            dtype = canonical_compute_dtype(getattr(self, field.name), argname=field.name)
            # Normalising here is what makes policies built from `jnp.float32`,
            # `np.float32` or "f32" equal and hash alike; the class is frozen,
            # hence object.__setattr__.
            object.__setattr__(self, field.name, dtype)

    def cast_to_param(self, tree: T) -> T:
        """Cast the floating array leaves of `tree` to `param_dtype`.

        Args:
            tree: any pytree; jax and numpy arrays stay jax and numpy arrays.

        Returns:
            `tree` with floating array leaves cast; other leaves are untouched.
        """
        return cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: T) -> T:
        """Cast the floating array leaves of `tree` to `compute_dtype`.

        Args:
            tree: any pytree; jax and numpy arrays stay jax and numpy arrays.

        Returns:
            `tree` with floating array leaves cast; other leaves are untouched.
        """
        return cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: T) -> T:
        """Cast the floating array leaves of `tree` to `output_dtype`.

        Args:
            tree: any pytree; jax and numpy arrays stay jax and numpy arrays.

        Returns:
            `tree` with floating array leaves cast; other leaves are untouched.
        """
        return cast_floating(tree, self.output_dtype)

    def with_output_dtype(self, output_dtype: Any) -> Policy:
        """A copy of this policy with another output dtype.

        Args:
            output_dtype: a dtype or dtype name, validated as in the constructor.

        Returns:
            A new `Policy`; this one is unchanged.

        Raises:
            ValueError, TypeError: as the constructor does, for an invalid dtype.
        """
        return dataclasses.replace(self, output_dtype=output_dtype)

    def __str__(self) -> str:
        # Short names, so that `get_policy(str(policy)) == policy`.
        dtypes = (self.param_dtype, self.compute_dtype, self.output_dtype)
        param, compute, output = (dtype_short_name(d) for d in dtypes)
        return f"p={param},c={compute},o={output}"

    @classmethod
    def from_string(cls, policy: str) -> Policy:
        """Parse a policy string.

        The grammar:

        * one dtype name (``"f32"``, ``"float32"``, ``"full"``, ``"bf16"``,
          ``"bfloat16"``, ``"f16"``, ``"float16"``, ``"half"``) sets all three
          dtypes;
        * otherwise comma-separated ``key=value`` pairs with keys ``p``/``params``,
          ``c``/``compute`` and ``o``/``output``, in any order. Params default to
          float32, compute follows params and output follows compute, so
          ``"c=f16"`` is ``"p=f32,c=f16,o=f16"``.

        ``"full"`` is float32 and ``"half"`` the platform's half type (see
        `half_dtype`). Case and whitespace around keys and values are ignored.

        Args:
            policy: the policy string.

        Returns:
            The `Policy` the string describes.

        Raises:
            TypeError: if `policy` is not a string.
            ValueError: for an empty string, an empty or malformed entry, an
                unknown or repeated key, or an unknown or unsupported dtype
                (``"Unknown dtype: f17 ..."``); the message names the text.
        """
        if not isinstance(policy, str):
            raise TypeError(
                f"Policy.from_string expects a string ({_EXAMPLES}), got {policy!r} of type {type(policy).__name__}."
            )
        if not policy.strip():
            raise ValueError(f"Empty policy string {policy!r}: expected {_EXAMPLES}.")
        if "=" not in policy:
            dtype = _parse_policy_dtype(policy, policy)
            return cls(dtype, dtype, dtype)

        dtypes: dict[str, np.dtype] = {}
        for entry in policy.split(","):
            key, equals, value = entry.partition("=")
            key = key.strip().lower()
            if not equals:
                raise ValueError(
                    f"Malformed entry {entry.strip()!r} in policy {policy!r}: expected "
                    f"key=value with key {_EXPECTED_KEYS}, e.g. 'c=bf16'."
                )
            field = _KEY_TO_FIELD.get(key)
            if field is None:
                raise ValueError(f"Unknown key {key!r} in policy {policy!r}: expected {_EXPECTED_KEYS}.")
            if field in dtypes:
                # "p=f32,params=bf16" is as ambiguous as "p=f32,p=bf16".
                raise ValueError(f"Repeated key {key!r} in policy {policy!r}: {field} is already set.")
            dtypes[field] = _parse_policy_dtype(value, policy)

        param = dtypes.get("param_dtype", np.dtype(np.float32))
        compute = dtypes.get("compute_dtype", param)
        return cls(param, compute, dtypes.get("output_dtype", compute))


def _parse_policy_dtype(value: str, policy: str) -> np.dtype:
    """`parse_dtype`, refusing dtypes a `Policy` cannot hold, with `policy` as context."""
    if not value.strip():
        raise ValueError(f"Missing dtype after '=' in policy {policy!r}: expected {_EXAMPLES}.")
    dtype = parse_dtype(value)
    # Checked here rather than left to the constructor so that a bad *string*
    # is a ValueError, like every other grammar error.
    if not is_castable(dtype):
        raise ValueError(
            f"Unsupported dtype: {value.strip()} ({dtype.name}) in policy {policy!r}: "
            "a policy uses float32 (f32/full), bfloat16 (bf16), float16 (f16) or half."
        )
    return dtype


def get_policy(policy: Policy | str) -> Policy:
    """A `Policy` from a policy string, or the given `Policy` itself.

    Args:
        policy: a `Policy` (returned as is) or a string in the grammar of
            `Policy.from_string`, e.g. ``"bf16"`` or ``"p=f32,c=bf16,o=f32"``.

    Returns:
        The `Policy`.

    Raises:
        TypeError: if `policy` is neither a `Policy` nor a string.
        ValueError: if the string is not a valid policy (see `Policy.from_string`).
    """
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        return Policy.from_string(policy)
    raise TypeError(
        f"get_policy expects a Policy or a policy string ({_EXAMPLES}), got {policy!r} of type {type(policy).__name__}."
    )


def cast_to_full(tree: T) -> T:
    """Cast the floating array leaves of `tree` to float32.

    Args:
        tree: any pytree of jax arrays, numpy arrays and other leaves.

    Returns:
        `tree` with floating array leaves in float32; other leaves are untouched.
    """
    return cast_floating(tree, np.float32)


def cast_to_half(tree: T) -> T:
    """Cast the floating array leaves of `tree` to the platform's half type.

    Args:
        tree: any pytree of jax arrays, numpy arrays and other leaves.

    Returns:
        `tree` with floating array leaves in `half_dtype()` (bfloat16 on TPU,
        float16 elsewhere); other leaves are untouched.
    """
    return cast_floating(tree, half_dtype())
