"""Choosing a PartitionSpec per leaf, and constraining shardings inside programs."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from ._mesh import _context_mesh, get_names_from_partition_spec
from ._tree import named_tree_map

__all__ = ["match_partition_rules", "with_sharding_constraint"]


def match_partition_rules(rules: Iterable[tuple[str | re.Pattern[str], PartitionSpec]], params: Any) -> Any:
    """Give every leaf of `params` the PartitionSpec of the first rule it matches.

    Each leaf's path is rendered with `tree_path_to_string` and ``sep="/"``: a dict
    ``{"layers": [{"w": ...}]}`` gives ``"layers/0/w"``, an Equinox MLP
    ``"layers/0/weight"``, an ``optax.adamw`` state ``"0/mu/layers/0/w"`` (so rules
    written for the params, anchored at the end with ``$``, also fit the
    optimizer's moments). `params` may hold arrays or `jax.ShapeDtypeStruct` (from
    `jax.eval_shape`), so specs can be computed before anything is allocated.

    Leaves that cannot be partitioned are replicated (``PartitionSpec()``) without
    consulting the rules: scalars, arrays of a single element, and non-array leaves
    (Python numbers, the activation functions inside Equinox modules, ...).

    Args:
        rules: ``(regex, PartitionSpec)`` pairs, tried in order with `re.search`
            against the path; the first match wins. End with ``(".*", P())`` to
            replicate everything else.
        params: the pytree (dict, Equinox module, optax state, ...).

    Returns:
        A pytree with the structure of `params` whose leaves are `PartitionSpec`.

    Raises:
        TypeError: if a rule is not a ``(pattern, PartitionSpec)`` pair.
        ValueError: if a pattern is not a valid regular expression, no rule
            matches an array leaf (the message names its path), or the matching
            spec has more entries than the leaf has dimensions.
    """
    compiled = _compile_rules(rules)

    def spec_for(path: str, leaf: Any) -> PartitionSpec:
        shape = getattr(leaf, "shape", None)
        if shape is None or len(shape) == 0 or math.prod(shape) == 1:
            return PartitionSpec()
        for pattern, spec in compiled:
            if pattern.search(path) is not None:
                if len(spec) > len(shape):
                    raise ValueError(
                        f"Partition rule {pattern.pattern!r} gives {spec} to {path!r}, "
                        f"but that leaf has shape {tuple(shape)}: a spec may not have "
                        "more entries than the array has dimensions."
                    )
                return spec
        raise ValueError(
            f"No partition rule matches the leaf at {path!r} (shape {tuple(shape)}); "
            f"rules tried: {[pattern.pattern for pattern, _ in compiled]}. Add a rule "
            "for it, or end the rules with ('.*', PartitionSpec()) to replicate the rest."
        )

    return named_tree_map(spec_for, params, sep="/")


def _compile_rules(
    rules: Iterable[tuple[str | re.Pattern[str], PartitionSpec]],
) -> list[tuple[re.Pattern[str], PartitionSpec]]:
    compiled = []
    for rule in rules:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2):
            raise TypeError(f"Each partition rule must be a (regex, PartitionSpec) pair, got {rule!r}.")
        pattern, spec = rule
        if not isinstance(spec, PartitionSpec):
            raise TypeError(f"Partition rule {pattern!r} maps to {spec!r}, expected a jax.sharding.PartitionSpec.")
        try:
            compiled.append((re.compile(pattern), spec))
        except (re.error, TypeError) as e:
            raise ValueError(f"Partition rule pattern {pattern!r} is not a valid regular expression: {e}.") from None
    return compiled


def with_sharding_constraint(x: Any, partition_specs: Any) -> Any:
    """Constrain the sharding of `x`, but only where the current mesh allows it.

    Model code can then carry its constraints everywhere: without a mesh, or on a
    mesh that lacks one of the named axes (say ``"tp"`` on a pure-FSDP mesh),
    it runs unchanged. Works inside `jax.jit` and eagerly, under ``jax.set_mesh``
    or the legacy ``with mesh:``.

    On a mesh with ``Auto`` axes this is `jax.lax.with_sharding_constraint`. On a
    mesh whose named axes are ``Explicit`` (the `jax.make_mesh` default) JAX's
    constraint would only assert the sharding, so the array is resharded with
    `jax.sharding.reshard` instead. Axes that are ``Manual`` (inside
    `jax.shard_map`) cannot be constrained; `x` is then returned unchanged.

    Args:
        x: an array or pytree of arrays.
        partition_specs: a `PartitionSpec`, or a pytree of them that is a prefix of
            `x`'s structure.

    Returns:
        `x` with the constraint applied, or `x` itself when no mesh is active or
        the mesh lacks (or cannot constrain) one of the named axes.

    Raises:
        TypeError: if `partition_specs` holds something other than specs.
    """
    names = get_names_from_partition_spec(partition_specs)
    mesh = _context_mesh()
    if mesh is None or not set(names) <= set(mesh.axis_names):
        return x
    axis_types = dict(zip(mesh.axis_names, mesh.axis_types))
    if any(axis_types[name] == AxisType.Manual for name in names):
        return x

    def to_sharding(spec: Any) -> NamedSharding:
        if not isinstance(spec, PartitionSpec):
            raise TypeError(f"with_sharding_constraint expects PartitionSpec leaves, got {spec!r}.")
        return NamedSharding(mesh, spec)

    shardings = jax.tree_util.tree_map(to_sharding, partition_specs, is_leaf=lambda s: isinstance(s, PartitionSpec))
    explicit_mesh = any(t == AxisType.Explicit for t in axis_types.values())
    if explicit_mesh and all(axis_types[name] == AxisType.Explicit for name in names):
        return jax.sharding.reshard(x, shardings)
    return jax.lax.with_sharding_constraint(x, shardings)
