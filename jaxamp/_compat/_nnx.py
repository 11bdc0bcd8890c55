"""The flax NNX adapter: split, flatten, walk and read nnx objects in graph mode, whatever the flax release."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "has_nnx_objects",
    "nnx_attributes",
    "nnx_flatten",
    "nnx_is_bookkeeping",
    "nnx_is_object",
    "nnx_is_optimizer",
    "nnx_iter_graph",
    "nnx_optimizer_leaf",
    "nnx_marked",
    "nnx_metadata",
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


def nnx_is_optimizer(x: Any) -> bool:
    """Whether `x` is an `nnx.Optimizer` (False where flax's nnx was never imported)."""
    if "flax.nnx" not in sys.modules:
        return False
    from flax import nnx

    return isinstance(x, nnx.Optimizer)


def nnx_optimizer_leaf(x: Any) -> Any:
    """`x` as an `nnx.Optimizer` holds its state's leaves: a Variable stays, an array is wrapped."""
    from flax import nnx

    if isinstance(x, nnx.Variable):
        return x
    return nnx.optimizer.OptArray(x) if jnp.ndim(x) == 0 else nnx.optimizer.OptVariable(x)


def nnx_is_object(x: Any) -> bool:
    """Whether `x` is an nnx object the graph API splits: a Module, `nnx.Rngs`, a Variable...

    Not a bare `jax.Ref`, which flax 0.12's ``is_graph_node`` also accepts: amp
    treats those the same whether or not flax is imported.
    """
    from flax import nnx

    return isinstance(x, nnx.Variable) or _is_node_module()(x)


@functools.cache
def _is_node_module() -> Callable[[Any], bool]:
    """flax's test for a graph node type (Module, Rngs, Optimizer...): not a Variable, not a `jax.Ref`."""
    from flax.nnx import graph

    if hasattr(graph, "is_node_module"):  # flax >= 0.12.7
        return graph.is_node_module
    registry = graph.GRAPH_REGISTRY  # what is_node_module reads (flax 0.10 to 0.12.6 have it)
    return lambda x: type(x) in registry


# flax's record of the trace an object was made in (flax 0.12's ``_pytree__state``,
# ``_object__state`` before): a copy merged inside a trace has its own, which
# must never reach the caller's object.
_TRACE_STATE = ("_pytree__state", "_object__state")
# flax's other bookkeeping in an object's __dict__; flax 0.12's ``_pytree__nodes``
# marks which attributes are data (state) and which static.
_BOOKKEEPING = ("_pytree__", "_object__")
_DATA_MARKS = "_pytree__nodes"


def nnx_attributes(node: Any) -> dict[str, Any] | None:
    """A graph node's attributes as set on it (its ``__dict__``); None for a Variable or a node without one.

    All of them (flax's own bookkeeping, such as which are data, too) but the
    trace the node was made in. A `functools.cached_property` writes here.
    """
    from flax import nnx

    if isinstance(node, nnx.Variable) or not hasattr(node, "__dict__"):
        return None
    return {name: value for name, value in vars(node).items() if name not in _TRACE_STATE}


def nnx_is_bookkeeping(name: str) -> bool:
    """Whether an attribute is flax's own record about the object rather than the user's."""
    return name.startswith(_BOOKKEEPING)


def nnx_marked(before: dict[str, Any], after: dict[str, Any]) -> set[str]:
    """The attributes flax marked data or static anew between two `nnx_attributes` of one object.

    Those set (or deleted) through flax's own ``__setattr__``, which marks an
    attribute data when its value is an array and static otherwise (a tracer
    too: flax 0.12.12 counts one static). `functools.cached_property` writes the
    ``__dict__`` directly, unmarked.
    """
    old, new = before.get(_DATA_MARKS) or {}, after.get(_DATA_MARKS) or {}
    return {name for name in {*old, *new} if name not in old or name not in new or old[name] != new[name]}


def nnx_metadata(leaf: Any) -> dict | None:
    """A copy of a Variable's metadata (sharding names, ...); None for a bare array leaf."""
    from flax import nnx

    return dict(leaf.get_metadata()) if isinstance(leaf, nnx.Variable) else None
