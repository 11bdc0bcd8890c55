"""Building device meshes and asking which mesh (if any) is active.

"The current mesh" is whatever the user made current with ``jax.set_mesh(mesh)``
(the modern way, seen both outside and inside `jax.jit`) or, failing that, with the
deprecated ``with mesh:`` context manager.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, PartitionSpec

from .._compat import legacy_context_mesh

__all__ = [
    "create_mesh",
    "get_jax_mesh",
    "get_names_from_partition_spec",
    "names_in_current_mesh",
]


def create_mesh(
    axis_dims: Sequence[int] = (1, -1, 1, 1),
    axis_names: Sequence[str] = ("dp", "fsdp", "tp", "sp"),
    backend: str = "",
) -> Mesh:
    """Create a device mesh over all devices of a backend.

    Example: on 8 devices, ``create_mesh((2, -1, 1, 1))`` has shape
    ``{"dp": 2, "fsdp": 4, "tp": 1, "sp": 1}``.

    Args:
        axis_dims: the size of each mesh axis. At most one entry may be ``-1``; it
            takes whatever is left of the device count.
        axis_names: one unique name per entry of `axis_dims`.
        backend: the platform whose devices to use (``"cpu"``, ``"gpu"``,
            ``"tpu"``); ``""`` means JAX's default backend.

    Returns:
        A `jax.sharding.Mesh` with ``Auto`` axes (sharding propagated by the
        compiler, constrained with `with_sharding_constraint`), its devices laid out
        by `jax.make_mesh` to follow the hardware topology.

    Raises:
        ValueError: if `axis_dims` and `axis_names` differ in length, a name is
            repeated, a size is neither ``-1`` nor positive, ``-1`` appears more
            than once, or the sizes cannot be arranged over the device count.
    """
    devices = jax.devices(backend) if backend else jax.devices()
    names = _check_axis_names(axis_names)
    shape = _resolve_axis_dims(axis_dims, names, len(devices))
    return _make_mesh(shape, names, devices, topology_aware=True)


def get_jax_mesh(axis_dims: str, names: Sequence[str]) -> Mesh:
    """Create a mesh over all devices from a command-line style string.

    Two forms are accepted:

    - positional, one size per name: ``"1,-1,1,1"`` with
      ``names=("dp", "fsdp", "tp", "sp")``;
    - named, ``"dp:2,tp:4"``: each entry is ``name:size``; names not mentioned get
      size 1. The mesh axes always follow the order of `names`.

    Sizes follow `create_mesh`'s rules (one ``-1`` absorbs the remaining devices).
    A leading ``"!"`` (``"!dp:2,tp:4"``) keeps the devices in ``jax.devices()``
    order instead of laying them out along the hardware topology.

    Args:
        axis_dims: the mesh shape as a string, e.g. ``"1,-1,1,1"`` or ``"dp:2,tp:4"``.
        names: the mesh axis names, in mesh order.

    Returns:
        A `jax.sharding.Mesh` with ``Auto`` axes over ``jax.devices()``.

    Raises:
        TypeError: if `axis_dims` is not a string.
        ValueError: if the string is malformed, mixes both forms, names an axis
            that is not in `names` (or one twice), gives the wrong number of
            positional sizes, or the sizes do not fit the device count.
    """
    if not isinstance(axis_dims, str):
        raise TypeError(
            f"get_jax_mesh expects axis_dims as a string such as '1,-1,1,1' or "
            f"'dp:2,tp:4', got {axis_dims!r}; use create_mesh for a sequence of ints."
        )
    names = _check_axis_names(names)
    spec = axis_dims.strip()
    topology_aware = not spec.startswith("!")
    spec = spec.lstrip("!").strip()
    entries = [entry.strip() for entry in spec.split(",")] if spec else []
    if not entries or any(not entry for entry in entries):
        raise ValueError(
            f"Cannot parse axis_dims {axis_dims!r}: expected comma-separated sizes "
            "such as '1,-1,1,1' or name:size pairs such as 'dp:2,tp:4'."
        )
    named = [":" in entry for entry in entries]
    if all(named):
        dims = _parse_named_dims(axis_dims, entries, names)
    elif not any(named):
        dims = [_parse_int(axis_dims, entry) for entry in entries]
    else:
        raise ValueError(
            f"axis_dims {axis_dims!r} mixes positional sizes and name:size pairs; "
            "use one form, e.g. '1,-1,1,1' or 'dp:2,fsdp:-1'."
        )
    devices = jax.devices()
    shape = _resolve_axis_dims(dims, names, len(devices))
    return _make_mesh(shape, names, devices, topology_aware=topology_aware)


def names_in_current_mesh(*names: str) -> bool:
    """Whether every one of `names` is an axis of the current mesh.

    The current mesh is the one set with ``jax.set_mesh`` (visible outside and
    inside `jax.jit`) or, failing that, the one entered with the deprecated
    ``with mesh:``.

    Args:
        *names: mesh axis names.

    Returns:
        ``True`` if all names are axes of the current mesh; ``False`` if any is
        not, or if no mesh is active and at least one name was given. With no
        names the answer is vacuously ``True``.

    Raises:
        TypeError: if a name is not a string.
    """
    for name in names:
        if not isinstance(name, str):
            raise TypeError(
                f"names_in_current_mesh expects axis names as separate strings, got "
                f"{name!r}; unpack a collection with names_in_current_mesh(*names)."
            )
    mesh = _context_mesh()
    axis_names = () if mesh is None else mesh.axis_names
    return set(names) <= set(axis_names)


def get_names_from_partition_spec(partition_specs: Any) -> list[str]:
    """The mesh axis names used by one or more partition specs.

    Args:
        partition_specs: a `PartitionSpec`; a dict, list or tuple of them (nested
            freely, ``None`` entries ignored); a pytree whose leaves are
            `PartitionSpec`; or a single axis name.

    Returns:
        The distinct axis names in order of first appearance, e.g.
        ``["dp", "fsdp", "tp"]`` for ``P(("dp", "fsdp"), None, "tp")``.

    Raises:
        TypeError: if an entry is neither a spec, a name, ``None`` nor a container.
    """
    names: dict[str, None] = {}  # an insertion-ordered set
    _collect_names(partition_specs, names)
    return list(names)


def _collect_names(item: Any, names: dict[str, None]) -> None:
    if item is None or item is PartitionSpec.UNCONSTRAINED:
        return
    if isinstance(item, str):
        names[item] = None
    elif isinstance(item, PartitionSpec):
        for entry in item:
            _collect_names(entry, names)
    elif isinstance(item, Mapping):
        for value in item.values():
            _collect_names(value, names)
    elif isinstance(item, (list, tuple)):
        for value in item:
            _collect_names(value, names)
    else:
        leaves = jax.tree_util.tree_leaves(item, is_leaf=lambda x: isinstance(x, PartitionSpec))
        # A non-container leaf comes back as itself: nothing we know how to read.
        if leaves == [item]:
            raise TypeError(
                f"Expected a PartitionSpec, an axis name, None or a container of "
                f"them, got {item!r} of type {type(item).__name__}."
            )
        for leaf in leaves:
            _collect_names(leaf, names)


def _context_mesh() -> Mesh | AbstractMesh | None:
    """The active mesh, concrete when possible, abstract inside traced code."""
    abstract = jax.sharding.get_abstract_mesh()
    if not abstract.empty:
        concrete = _set_mesh_concrete()
        # Eager constraints need real devices, but only the abstract mesh carries
        # the axis types in force here (Manual inside shard_map, say): prefer the
        # concrete one only while the two agree.
        if concrete is not None and concrete.abstract_mesh == abstract:
            return concrete
        return abstract
    return legacy_context_mesh()


def _concrete_context_mesh() -> Mesh | None:
    """The active mesh with its devices (what placing an array needs), or None."""
    mesh = _set_mesh_concrete()
    return mesh if mesh is not None else legacy_context_mesh()


def _set_mesh_concrete() -> Mesh | None:
    try:
        mesh = jax.sharding.get_mesh()
    except (ValueError, RuntimeError):
        # `get_mesh` refuses to run while tracing; callers fall back to the
        # abstract mesh there.
        return None
    return None if mesh.empty else mesh


def _check_axis_names(axis_names: Sequence[str]) -> tuple[str, ...]:
    if isinstance(axis_names, str):
        raise TypeError(
            f"axis_names must be a sequence of names such as ('dp', 'fsdp'), got the string {axis_names!r}."
        )
    names = tuple(axis_names)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"Mesh axis names must be strings, got {name!r} in {names}.")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"Mesh axis names must be unique, got {names} (repeated: {repeated}).")
    return names


def _resolve_axis_dims(axis_dims: Sequence[int], names: tuple[str, ...], device_count: int) -> tuple[int, ...]:
    """Check the sizes against `names` and the device count; fill in the -1."""
    dims = tuple(axis_dims)
    if len(dims) != len(names):
        raise ValueError(
            f"axis_dims {dims} has {len(dims)} entries but axis_names {names} has {len(names)}; give one size per axis."
        )
    for dim in dims:
        # bool is an int subclass; True as a size is certainly a mistake.
        if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
            raise ValueError(f"Mesh axis sizes must be integers, got {dim!r} in {dims}.")
        if dim != -1 and dim < 1:
            raise ValueError(
                f"Mesh axis sizes must be positive or -1 (take the remaining devices), got {dim} in {dims}."
            )
    dims = tuple(int(dim) for dim in dims)
    if dims.count(-1) > 1:
        raise ValueError(
            f"At most one mesh axis size may be -1, got {dims}: which axis takes the "
            "remaining devices would be ambiguous."
        )
    fixed = math.prod(dim for dim in dims if dim != -1)
    if -1 in dims:
        if device_count % fixed:
            raise ValueError(
                f"The fixed axis sizes in {dims} multiply to {fixed}, which does not "
                f"divide the device count {device_count}."
            )
        return tuple(device_count // fixed if dim == -1 else dim for dim in dims)
    if fixed != device_count:
        raise ValueError(
            f"Mesh shape {dims} needs {fixed} devices but there are {device_count}; "
            "use -1 for one axis to absorb the remaining devices."
        )
    return dims


def _parse_int(axis_dims: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"Cannot parse {text!r} in axis_dims {axis_dims!r} as an integer size.") from None


def _parse_named_dims(axis_dims: str, entries: list[str], names: tuple[str, ...]) -> list[int]:
    sizes: dict[str, int] = {}
    for entry in entries:
        name, _, size = (part.strip() for part in entry.partition(":"))
        if name not in names:
            raise ValueError(
                f"axis_dims {axis_dims!r} names axis {name!r}, which is not one of the mesh axis names {names}."
            )
        if name in sizes:
            raise ValueError(f"axis_dims {axis_dims!r} gives axis {name!r} more than once.")
        sizes[name] = _parse_int(axis_dims, size)
    return [sizes.get(name, 1) for name in names]


def _make_mesh(shape: tuple[int, ...], names: tuple[str, ...], devices: list, *, topology_aware: bool) -> Mesh:
    # Auto axes, as `Mesh(...)` has always made: `jax.make_mesh` defaults to Explicit
    # axes in current JAX, which would turn every sharding into part of the types.
    axis_types = (AxisType.Auto,) * len(shape)
    if topology_aware:
        return jax.make_mesh(shape, names, axis_types=axis_types, devices=devices)
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), names, axis_types=axis_types)
