"""Per-leaf functions that place arrays on the mesh and bring them back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._dtypes import cast_floating, parse_dtype
from ._mesh import _concrete_context_mesh
from ._tree import tree_path_to_string

__all__ = ["make_shard_and_gather_fns"]


def make_shard_and_gather_fns(
    partition_specs: Any, dtype_specs: Any = None, *, mesh: Mesh | None = None
) -> tuple[Any, Any]:
    """Build, for every leaf, a function that shards it and one that gathers it.

    Typical use, with ``specs = match_partition_rules(rules, params)``::

        shard_fns, gather_fns = make_shard_and_gather_fns(specs, jnp.bfloat16)
        with jax.set_mesh(mesh):
            params = tree_apply(shard_fns, params)     # placed on the mesh
        host_params = tree_apply(gather_fns, params)   # numpy, e.g. to save

    A shard function casts its leaf (floating leaves only, see
    `jaxamp.policies.cast_floating`) and places it with ``NamedSharding(mesh, spec)``. A
    gather function brings the whole array to the host as a `numpy.ndarray` (across
    processes too, when the array spans several hosts) and applies the same cast.
    Both pass non-array leaves (Python numbers, functions) through untouched.

    Args:
        partition_specs: a pytree whose leaves are `PartitionSpec`, e.g. from
            `match_partition_rules`.
        dtype_specs: ``None`` to keep every dtype; one floating dtype for all
            leaves (``jnp.bfloat16``, ``"bf16"``, ``np.float32``...); or a pytree
            with the structure of `partition_specs` whose leaves are such dtypes,
            ``None`` (keep) or anything with a ``.dtype`` (an array, a
            `jax.ShapeDtypeStruct`: use its dtype).
        mesh: the mesh to place arrays on. ``None`` uses the mesh current when a
            shard function is *called* (``jax.set_mesh`` or the legacy
            ``with mesh:``).

    Returns:
        ``(shard_fns, gather_fns)``, two pytrees with the structure of
        `partition_specs` whose leaves are one-argument functions; apply them with
        `tree_apply`.

    Raises:
        ValueError: if `dtype_specs` does not match the structure of
            `partition_specs`, or names an unknown dtype.
        TypeError: if a leaf of `partition_specs` is not a `PartitionSpec`, or a
            dtype is not floating (only floating leaves are ever cast).
        RuntimeError: when a shard function is called with no `mesh` given and
            no mesh active.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        partition_specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
    paths = [tree_path_to_string(path, sep="/") for path, _ in flat]
    specs = [spec for _, spec in flat]
    for path, spec in zip(paths, specs):
        if not isinstance(spec, PartitionSpec):
            raise TypeError(f"partition_specs leaf at {path!r} is {spec!r}, expected a jax.sharding.PartitionSpec.")

    if dtype_specs is None or jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(dtype_specs)):
        dtype_leaves = [_to_dtype(dtype_specs, where=None)] * len(specs)
    else:
        try:
            dtype_leaves = treedef.flatten_up_to(dtype_specs)
        except (ValueError, TypeError) as e:
            raise ValueError(
                "dtype_specs must be one dtype or a pytree with the structure of "
                f"partition_specs; the structures differ: {e}"
            ) from None
        dtype_leaves = [_to_dtype(d, where=path) for d, path in zip(dtype_leaves, paths)]

    shard_fns = treedef.unflatten([_make_shard_fn(spec, dtype, mesh) for spec, dtype in zip(specs, dtype_leaves)])
    gather_fns = treedef.unflatten([_make_gather_fn(dtype) for dtype in dtype_leaves])
    return shard_fns, gather_fns


def _to_dtype(spec: Any, *, where: str | tuple[str, ...] | None) -> np.dtype | None:
    """Read one dtype spec; `where` is the leaf path it applies to (None: all)."""
    if spec is None:
        return None
    label = "dtype_specs" if where is None else f"dtype_specs at {where!r}"
    try:
        if isinstance(spec, str):
            dtype = parse_dtype(spec) if _is_jaxamp_name(spec) else np.dtype(spec)
        elif hasattr(spec, "dtype") and not isinstance(spec, type):
            dtype = np.dtype(spec.dtype)
        else:
            dtype = np.dtype(spec)
    except TypeError:
        raise ValueError(
            f"Unknown dtype: {spec!r} in {label}; expected a floating "
            "dtype such as jnp.bfloat16 or 'bf16', None, or an array-like with a dtype."
        ) from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"{label} is {dtype.name}, expected a floating dtype: only "
            "floating leaves are cast, so a non-floating target has no meaning."
        )
    return dtype


def _is_jaxamp_name(name: str) -> bool:
    try:
        parse_dtype(name)
    except ValueError:
        return False
    return True


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _make_shard_fn(spec: PartitionSpec, dtype: np.dtype | None, mesh: Mesh | None) -> Callable[[Any], Any]:
    def shard_fn(x: Any) -> Any:
        if not _is_array(x):
            return x
        target = mesh if mesh is not None else _concrete_context_mesh()
        if target is None:
            raise RuntimeError(
                f"Cannot shard an array of shape {np.shape(x)} with {spec}: no mesh is "
                "active. Call the shard functions under `with jax.set_mesh(mesh):` or "
                "pass mesh= to make_shard_and_gather_fns."
            )
        if isinstance(x, np.generic):
            x = np.asarray(x)
        if dtype is not None:
            x = cast_floating(x, dtype)
        sharding = NamedSharding(target, spec)
        if jax.process_count() > 1 and not (isinstance(x, jax.Array) and not x.is_fully_addressable):
            # Multi-host: every process holds the same host value; each one builds
            # only its own shards rather than asking device_put to move one copy.
            host = np.asarray(x)
            return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
        return jax.device_put(x, sharding)

    return shard_fn


def _make_gather_fn(dtype: np.dtype | None) -> Callable[[Any], Any]:
    def gather_fn(x: Any) -> Any:
        if not _is_array(x):
            return x
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            host = np.asarray(multihost_utils.process_allgather(x, tiled=True))
        else:
            host = np.asarray(jax.device_get(x))
        # Cast on the host, after the transfer, so an upcast (bf16 -> f32 for a
        # checkpoint) never needs the larger copy in device memory.
        return host if dtype is None else cast_floating(host, dtype)

    return gather_fn
