"""Pytree helpers keyed by a leaf's path, and small training-loop utilities."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

__all__ = [
    "flatten_tree",
    "get_metrics",
    "get_weight_decay_mask",
    "named_tree_map",
    "tree_apply",
    "tree_path_to_string",
    "wrap_function_with_rng",
]


def tree_path_to_string(path: Sequence[Any], sep: str | None = None) -> str | tuple[str, ...]:
    """Render a pytree key path (from `jax.tree_util.tree_flatten_with_path`).

    Each key becomes a bare string: `DictKey` its key, `GetAttrKey` the attribute
    name, `SequenceKey` and `FlattenedIndexKey` the index; any other key type its
    ``str``. For an Equinox MLP the path of the first weight reads
    ``("layers", "0", "weight")``, or ``"layers/0/weight"`` with ``sep="/"``.

    Args:
        path: a sequence of key entries.
        sep: the separator; ``None`` returns the parts as a tuple.

    Returns:
        The parts joined with `sep`, or the tuple of parts when `sep` is ``None``.
    """
    keys = tuple(_key_to_string(key) for key in path)
    return keys if sep is None else sep.join(keys)


def _key_to_string(key: Any) -> str:
    if isinstance(key, DictKey):
        return str(key.key)
    if isinstance(key, GetAttrKey):
        return key.name
    if isinstance(key, SequenceKey):
        return str(key.idx)
    if isinstance(key, FlattenedIndexKey):
        return str(key.key)
    return str(key)


def flatten_tree(xs: Any, is_leaf: Callable[[Any], bool] | None = None, sep: str | None = None) -> dict[Any, Any]:
    """Flatten a pytree to a dict from leaf path to leaf.

    Example: ``flatten_tree({"a": {"b": 1}, "c": [2]}, sep="/")`` is
    ``{"a/b": 1, "c/0": 2}``.

    Args:
        xs: the pytree.
        is_leaf: as in `jax.tree_util.tree_flatten_with_path`.
        sep: joins the path parts (see `tree_path_to_string`); ``None`` keys the
            dict by tuples of parts.

    Returns:
        A dict in flattening order, keyed by the rendered paths.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(xs, is_leaf=is_leaf)
    return {tree_path_to_string(path, sep=sep): leaf for path, leaf in flat}


def named_tree_map(
    f: Callable[..., Any],
    tree: Any,
    *rest: Any,
    is_leaf: Callable[[Any], bool] | None = None,
    sep: str | None = None,
) -> Any:
    """`jax.tree_util.tree_map` whose function also receives the leaf's path.

    Args:
        f: called as ``f(path, leaf, *rest_leaves)``, `path` rendered by
            `tree_path_to_string` with `sep`.
        tree: the pytree whose structure (and paths) drive the map.
        *rest: further pytrees with `tree`'s structure (or it as a prefix).
        is_leaf: as in `jax.tree_util.tree_map`.
        sep: see `tree_path_to_string`.

    Returns:
        A pytree with `tree`'s structure holding the results of `f`.
    """
    return jax.tree_util.tree_map_with_path(
        lambda path, x, *r: f(tree_path_to_string(path, sep=sep), x, *r),
        tree,
        *rest,
        is_leaf=is_leaf,
    )


def tree_apply(fns: Any, tree: Any) -> Any:
    """Apply a pytree of functions leafwise: ``fn(x)`` for each matching pair.

    Typically ``tree_apply(shard_fns, params)`` with the functions from
    `make_shard_and_gather_fns`.

    Args:
        fns: a pytree whose leaves are one-argument callables.
        tree: a pytree with the structure of `fns` (or `fns` as its prefix).

    Returns:
        A pytree with the structure of `fns` holding the results.
    """
    return jax.tree_util.tree_map(lambda fn, x: fn(x), fns, tree)


def get_weight_decay_mask(exclusions: str | Sequence[str]) -> Callable[[Any], Any]:
    """Build a weight-decay mask function for ``optax.adamw(..., mask=...)``.

    Args:
        exclusions: regular expressions, matched with `re.search` against each
            leaf's ``/``-joined path (e.g. ``"layers/0/b"``); leaves matching any
            of them get no weight decay. A single string is one pattern.

    Returns:
        A function of the params returning a pytree of bools with their
        structure: ``False`` where the path matches an exclusion, else ``True``.

    Raises:
        ValueError: if a pattern is not a valid regular expression.
    """
    patterns = _compile_patterns([exclusions] if isinstance(exclusions, str) else exclusions)

    def decay(path: str, _leaf: Any) -> bool:
        return not any(pattern.search(path) for pattern in patterns)

    def weight_decay_mask(params: Any) -> Any:
        return named_tree_map(decay, params, sep="/")

    return weight_decay_mask


def _compile_patterns(patterns: Sequence[str]) -> list[re.Pattern[str]]:
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except (re.error, TypeError) as e:
            raise ValueError(f"Invalid regular expression {pattern!r}: {e}.") from None
    return compiled


def get_metrics(metrics: Any, unreplicate: bool = False, stack: bool = False) -> Any:
    """Bring training metrics to the host as plain Python/NumPy values.

    Args:
        metrics: a dict of scalar metrics, or (with `stack`) a sequence of such
            dicts, e.g. one per step.
        unreplicate: the metrics carry a leading device axis (as returned by
            `jax.pmap`); keep its first entry.
        stack: stack the sequence of metric pytrees leafwise into arrays with a
            leading axis of the sequence length.

    Returns:
        With `stack`, the pytree of stacked `numpy.ndarray`; otherwise a dict
        mapping each key to a Python ``float``.

    Raises:
        TypeError: without `stack`, if `metrics` is not a mapping.
        ValueError: without `stack`, if a metric is not a scalar.
    """
    if unreplicate:
        metrics = jax.tree_util.tree_map(lambda x: x[0], metrics)
    metrics = jax.device_get(metrics)
    if stack:
        return jax.tree_util.tree_map(lambda *xs: np.stack(xs), *metrics)
    if not isinstance(metrics, Mapping):
        raise TypeError(
            f"get_metrics expects a dict of scalar metrics, got {type(metrics).__name__}; "
            "pass stack=True for a sequence of metric dicts."
        )
    out = {}
    for key, value in metrics.items():
        if np.size(value) != 1:
            raise ValueError(
                f"Metric {key!r} has shape {np.shape(value)}, expected a scalar; "
                "reduce it first or pass unreplicate=True for per-device copies."
            )
        out[key] = float(np.reshape(value, ()))
    return out


def wrap_function_with_rng(rng: jax.Array) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator that feeds a fresh PRNG key to each call of the wrapped function.

    The decorated ``f(rng, *args, **kwargs)`` is called as ``f(*args, **kwargs)``;
    each call splits the held key and passes one half, so successive calls draw
    different randomness while the whole sequence stays reproducible from `rng`.
    The key is Python state: use it around, not inside, `jax.jit`.

    Args:
        rng: the initial key (``jax.random.key`` or ``jax.random.PRNGKey``).

    Returns:
        The decorator.
    """

    def wrap_function(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            nonlocal rng
            rng, split_rng = jax.random.split(rng)
            return function(split_rng, *args, **kwargs)

        return wrapped

    return wrap_function
