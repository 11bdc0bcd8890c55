"""`cast_state`: keep any optax optimizer's state in bfloat16 (or float16).

optax's Adam has ``mu_dtype`` for its first moment and nothing for the second,
and most other optimizers have neither. Wrapping the optimizer instead stores
every floating array of its state in the chosen dtype, whatever the optimizer,
and hands the optimizer float32 copies, so its arithmetic is unchanged.

Rounding Adam's second moment to nearest in bfloat16 has a catch: with the usual
``b2 = 0.999`` a step changes ``nu`` by 0.1%, less than half of bfloat16's
relative spacing (0.2 to 0.4%), so ``nu`` can grow but never decay.
``rounding="stochastic"`` lets it decay on average.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._dtypes import array_part
from ._checks import as_optimizer
from ._rounding import (
    STORAGE_DTYPES,
    check_rounding,
    leaf_keys,
    round_to,
    storage_dtype,
)

__all__ = ["CastStateState", "cast_state"]

_F32 = np.dtype(jnp.float32)
_ROUNDINGS = ("nearest", "stochastic")


class CastStateState(NamedTuple):
    """State of `cast_state`.

    Attributes:
        inner_state: the wrapped optimizer's state, with its float32 arrays of at
            least one dimension stored in the storage dtype.
        key: ``rounding="stochastic"`` only (None otherwise): the PRNG key of the
            next step.
    """

    inner_state: Any
    key: Any


def cast_state(
    optimizer: optax.GradientTransformation,
    dtype: Any = jnp.bfloat16,
    *,
    rounding: str = "nearest",
    key: jax.Array | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Store `optimizer`'s floating state (Adam's ``mu`` and ``nu``, momentum...) in `dtype`.

    At ``init`` every float32 array of the optimizer's state with at least one
    dimension is rounded to nearest in `dtype`. Each ``update`` upcasts the
    arrays stored in `dtype` to float32, runs the optimizer, and rounds the new
    state back by `rounding`. Integer leaves (step counts), keys and float64 or
    complex leaves are never touched, and neither are float32 scalars: they cost
    nothing to keep, and some are hyperparameters (`optax.inject_hyperparams`)
    that rounding would change. The updates are the optimizer's own.

    Works with any optimizer whose new state has the structure of the old one,
    as optax's do, including chains, `optax.MultiSteps` (whose accumulated
    gradients are then stored in `dtype` too) and `low_precision_params`.

    Args:
        optimizer: any optax gradient transformation.
        dtype: the storage dtype: ``jnp.bfloat16`` (default), ``jnp.float16`` or
            ``jnp.float32`` (which stores nothing differently, for comparisons),
            or a name such as ``"bf16"``.
        rounding: ``"nearest"`` (default) or ``"stochastic"`` (unbiased, from
            `key`; see `jaxamp.optim.stochastic_round`), for the state written by
            each update. There is no ``"kahan"``: a compensation buffer per state
            array would give back the memory this saves.
        key: a PRNG key, required by ``"stochastic"`` (and refused otherwise),
            split every step.

    Returns:
        A `GradientTransformationExtraArgs` whose state is a `CastStateState`.

    Raises:
        TypeError: `optimizer` is not a gradient transformation, `dtype` is not a
            storage dtype, `key` is not a PRNG key; at ``update``, the optimizer
            returned something other than a float32, bfloat16 or float16 array
            where its state held a stored one.
        ValueError: an unknown `rounding`, a missing key for ``"stochastic"``, a
            key for ``"nearest"``.
    """
    owner = "cast_state"
    inner = as_optimizer(owner, optimizer)
    dtype = storage_dtype(f"{owner} dtype", dtype)
    key = check_rounding(owner, rounding, key, _ROUNDINGS)

    def is_stored(leaf: Any) -> bool:
        return _is_array(leaf) and leaf.dtype == dtype and leaf.ndim >= 1

    def init(params: Any) -> CastStateState:
        def store(leaf):
            if _is_array(leaf) and leaf.dtype == _F32 and leaf.ndim >= 1:
                return leaf.astype(dtype)
            return leaf

        return CastStateState(jax.tree.map(store, inner.init(array_part(params))), key)

    def update(updates, state: CastStateState, params=None, **extra_args):
        upcast = jax.tree.map(lambda x: x.astype(_F32) if is_stored(x) else x, state.inner_state)
        params = None if params is None else array_part(params)
        updates, new_inner = inner.update(updates, upcast, params, **extra_args)

        old = jax.tree_util.tree_leaves_with_path(state.inner_state)
        treedef = jax.tree.structure(state.inner_state)
        new = treedef.flatten_up_to(new_inner)
        stored = [i for i, (_, leaf) in enumerate(old) if is_stored(leaf)]
        n = len(stored)
        next_key, keys = leaf_keys(state.key, n) if key is not None else (None, [None] * n)
        for i, k in zip(stored, keys):
            leaf = new[i]
            if not (_is_array(leaf) and leaf.dtype in STORAGE_DTYPES):
                raise TypeError(
                    f"{owner}: the optimizer's state at {jax.tree_util.keystr(old[i][0])} was "
                    f"stored in {dtype.name}, but its update returned {leaf!r} there; "
                    "cast_state needs a float32, bfloat16 or float16 array back."
                )
            new[i] = round_to(leaf.astype(_F32), dtype, rounding, k)
        return updates, CastStateState(treedef.unflatten(new), next_key)

    return optax.GradientTransformationExtraArgs(init, update)


def _is_array(leaf: Any) -> bool:
    # numpy too: a state restored from a checkpoint may hold numpy arrays.
    return isinstance(leaf, (jax.Array, np.ndarray))
