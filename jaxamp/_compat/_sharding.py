"""Meshes and the axes values vary over.

The legacy mesh context, Explicit and Auto meshes, shard_map's manual axes
and the types that record the axes a value varies over.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
from jax._src import config as _config
from jax.sharding import PartitionSpec as P

from ._versions import _internal

__all__ = [
    "context_mesh",
    "explicit_shards",
    "is_unnamed_axis",
    "legacy_context_mesh",
    "manual_axes",
    "mark_varying",
    "on_auto_mesh",
    "tracks_varying_axes",
    "varying_axes",
    "varying_axes_of_type",
]


def legacy_context_mesh() -> Any:
    """The mesh entered with the deprecated ``with mesh:`` context manager, if any.

    JAX offers no public accessor for it: ``jax.sharding.get_mesh`` and
    ``get_abstract_mesh`` only see meshes set with ``jax.set_mesh``. Older user
    code still says ``with mesh:``, so we read JAX's thread-local resource stack.

    Returns:
        The innermost such mesh, or ``None`` when none is entered or when this JAX
        version no longer has the legacy context (then there is nothing to find).
    """
    from jax.sharding import Mesh

    try:
        from jax._src.mesh import thread_resources
    except ImportError:
        return None
    mesh = getattr(getattr(thread_resources, "env", None), "physical_mesh", None)
    if not isinstance(mesh, Mesh) or mesh.empty:
        return None
    return mesh


@_internal
def context_mesh() -> Any:
    """The concrete mesh the caller runs under (``jax.set_mesh`` or ``with mesh:``), also inside `jax.jit`; else None.

    ``jax.sharding.get_mesh`` refuses to answer inside `jax.jit`, where a
    jitted step that closes over arrays must find them on its mesh's devices.
    """
    from jax._src import mesh as mesh_lib

    mesh = mesh_lib.get_concrete_mesh()
    if mesh is not None and not mesh.empty:
        return mesh
    return legacy_context_mesh()


# --- fp8 scales per shard (jaxamp/fp8/_schemes.py) ---
# On an Explicit mesh an array's type names the mesh axes each dimension is
# split over (`jax.typeof(x).sharding`); on an Auto mesh it names none (XLA
# places the array after tracing), and inside `shard_map` the manual axes are
# not in the spec (the body sees one shard).


def explicit_shards(x: Any) -> dict[int, tuple[int, Any]]:
    """The dimensions of `x` split over Explicit mesh axes: ``{dim: (shards, spec entry)}``.

    Only dimensions whose size the number of shards divides are listed.
    """
    aval = jax.typeof(x)
    sharding = getattr(aval, "sharding", None)
    spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
    if spec is None or mesh is None or not getattr(mesh, "axis_names", ()):
        return {}
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    found = {}
    for dim, entry in enumerate(spec):
        if entry is None or entry == P.UNCONSTRAINED:
            continue
        names = entry if isinstance(entry, tuple) else (entry,)
        if not all(types.get(name) == jax.sharding.AxisType.Explicit for name in names):
            continue
        shards = math.prod(sizes[name] for name in names)
        if shards > 1 and aval.shape[dim] % shards == 0:
            found[dim] = (shards, entry)
    return found


def on_auto_mesh(*xs: Any) -> bool:
    """Whether `xs` run on a mesh of several devices whose axes are all Auto (XLA splits them after tracing).

    The mesh is the operands' (``jax.jit`` of arrays placed with a
    `NamedSharding`) or the context's (``jax.set_mesh``); never inside
    `shard_map`, whose body sees one device's shard.
    """
    if manual_axes():
        return False
    meshes = [getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None) for x in xs]
    for mesh in (*meshes, jax.sharding.get_abstract_mesh()):
        if mesh is not None and mesh.axis_names and math.prod(mesh.axis_sizes) > 1:
            return all(kind == jax.sharding.AxisType.Auto for kind in mesh.axis_types)
    return False


# --- devices deciding together (jaxamp/scaling/_finite.py) ---
# Inside `shard_map` (and `jax.pmap`, which JAX 0.10+ runs as a shard_map) the
# abstract mesh names the manual axes, and with ``check_vma=True`` every value's
# type records the manual axes it varies over. Neither has a public accessor on
# 0.10-0.12 (`jax.typeof(x).vma` moved to ``.mat.varying``).


@_internal
def manual_axes() -> tuple[Any, ...]:
    """The mesh axes the caller runs per device over (`shard_map`, `pmap`), or ()."""
    return tuple(jax.sharding.get_abstract_mesh().manual_axes)


def is_unnamed_axis(name: Any) -> bool:
    """Whether `name` is the axis JAX binds for a `jax.pmap` given no ``axis_name`` (no caller can name it).

    JAX 0.10 names it ``'<axis 0x...>'``, later releases ``'_internal_pmap_axis_name'``.
    """
    return not isinstance(name, str) or name.startswith(("_", "<axis "))


@_internal
def tracks_varying_axes() -> bool:
    """Whether values' types record the manual axes they vary over (``check_vma``)."""
    return bool(_config._check_vma.value)


@_internal
def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes over which `x` may differ between devices (its vma)."""
    return varying_axes_of_type(jax.typeof(x))


@_internal
def varying_axes_of_type(aval: Any) -> frozenset:
    """`varying_axes` of a value of type `aval`."""
    mat = getattr(aval, "mat", None)
    return frozenset(getattr(mat, "varying", ())) if mat is not None else frozenset()


def mark_varying(x: Any, axes: Sequence[Any]) -> Any:
    """`x` typed as varying over the manual `axes` (a no-op where types carry no varying axes)."""
    missing = tuple(a for a in axes if a not in varying_axes(x))
    if not missing or not tracks_varying_axes():
        return x
    return jax.lax.pcast(x, missing, to="varying")
