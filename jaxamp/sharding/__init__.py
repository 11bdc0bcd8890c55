"""Mesh and sharding helpers: build meshes, pick partition specs by regex, and
shard/gather parameter pytrees (after fjformer's / EasyLM's ``mesh_utils``).

All of them work with the mesh made current by ``jax.set_mesh(mesh)`` and with the
legacy ``with mesh:`` context. The guides are docs/sharding.md and
docs/distributed.md.
"""

from ._mesh import (
    create_mesh,
    get_jax_mesh,
    get_names_from_partition_spec,
    names_in_current_mesh,
)
from ._partition import match_partition_rules, with_sharding_constraint
from ._shard_gather import make_shard_and_gather_fns
from ._tree import (
    flatten_tree,
    get_metrics,
    get_weight_decay_mask,
    named_tree_map,
    tree_apply,
    tree_path_to_string,
    wrap_function_with_rng,
)

__all__ = [
    "create_mesh",
    "flatten_tree",
    "get_jax_mesh",
    "get_metrics",
    "get_names_from_partition_spec",
    "get_weight_decay_mask",
    "make_shard_and_gather_fns",
    "match_partition_rules",
    "named_tree_map",
    "names_in_current_mesh",
    "tree_apply",
    "tree_path_to_string",
    "with_sharding_constraint",
    "wrap_function_with_rng",
]
