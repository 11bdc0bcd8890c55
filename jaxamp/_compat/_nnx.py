"""The flax NNX adapter: split, flatten and walk nnx objects in graph mode, whatever the flax release."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax

__all__ = [
    "has_nnx_objects",
    "nnx_flatten",
    "nnx_is_object",
    "nnx_iter_graph",
    "nnx_raw_value",
    "nnx_split",
]

# --- flax nnx (jaxamp/transform/_nnx.py) ---
# Called only once the program itself has imported flax.nnx: jaxamp never
# imports flax. flax 0.12 added a tree mode (``nnx.set_graph_mode(False)``, or
# ``graph=False``) that cannot express Variables shared between modules; amp
# needs graph mode whatever the user's default, and releases before it have
# graph mode only, and no ``graph`` argument.


@functools.cache
def _nnx_graph_mode(fn: Callable) -> dict[str, Any]:
    import inspect

    return {"graph": True} if "graph" in inspect.signature(fn).parameters else {}


def nnx_split(node: Any) -> tuple[Any, Any]:
    """``nnx.split(node)`` in graph mode: ``(graphdef, state)``."""
    from flax import nnx

    return nnx.split(node, **_nnx_graph_mode(nnx.split))


def nnx_flatten(node: Any) -> tuple[Any, Any]:
    """``nnx.graph.flatten(node)`` in graph mode: ``(graphdef, flat_state)``.

    `flat_state` iterates as ``(path, leaf)`` pairs in path order, each leaf the
    node's own `nnx.Variable` object (or a bare array attribute), not a copy.
    """
    from flax import nnx

    return nnx.graph.flatten(node, **_nnx_graph_mode(nnx.graph.flatten))


def nnx_iter_graph(node: Any) -> Iterator[tuple[tuple, Any]]:
    """``nnx.iter_graph(node)`` in graph mode: every node and leaf, shared ones once."""
    from flax import nnx

    return nnx.graph.iter_graph(node, **_nnx_graph_mode(nnx.graph.iter_graph))


def nnx_raw_value(leaf: Any) -> Any:
    """The value a flat-state leaf holds: a Variable's raw value, or the leaf itself."""
    from flax import nnx

    if not isinstance(leaf, nnx.Variable):
        return leaf
    if hasattr(leaf, "get_raw_value"):  # flax >= 0.12 (``raw_value`` warns there)
        return leaf.get_raw_value()
    return leaf.raw_value


def has_nnx_objects(tree: Any, variables: bool = True) -> bool:
    """Whether an nnx object (Module, Rngs, Variable...) is among `tree`'s leaves.

    With ``variables=False``, only graph nodes (Modules, Rngs...): a Variable
    (as in the state `nnx.split` returns) flattens like any pytree.
    """
    if "flax.nnx" not in sys.modules:
        return False
    from flax import nnx

    leaves = jax.tree_util.tree_leaves(tree, is_leaf=nnx_is_object)
    return any(nnx_is_object(leaf) and (variables or not isinstance(leaf, nnx.Variable)) for leaf in leaves)


def nnx_is_object(x: Any) -> bool:
    """Whether `x` is an nnx object the graph API splits: a Module, `nnx.Rngs`, a Variable...

    Not a bare `jax.Ref`, which flax 0.12's ``is_graph_node`` also accepts: amp
    treats those the same whether or not flax is imported.
    """
    from flax import nnx

    return isinstance(x, nnx.Variable) or nnx.graph.is_node_module(x)
