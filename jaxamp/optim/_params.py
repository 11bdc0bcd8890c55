"""`low_precision_params`: train parameters stored in bfloat16 (or float16).

Adding a small update to a bfloat16 parameter and rounding to nearest loses it
entirely once the update is below half the parameter's spacing (``2**-9`` to
``2**-8`` of its magnitude): with Adam's steps of about the learning rate, a
weight in [1, 2) ignores every step of a learning rate below 0.004, and
training stalls as the schedule decays. Stochastic rounding keeps the expected parameter on the
float32 trajectory; a Kahan compensation buffer keeps what rounding lost and
adds it to the next step. Both are rounding choices made after the wrapped
optimizer has computed its float32 step, so any optax optimizer works.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._dtypes import array_part
from ._checks import as_optimizer
from ._rounding import STORAGE_DTYPES, check_rounding, leaf_keys, round_to

__all__ = ["LowPrecisionParamsState", "low_precision_params"]

_F32 = np.dtype(jnp.float32)
_ROUNDINGS = ("stochastic", "kahan", "nearest")


class LowPrecisionParamsState(NamedTuple):
    """State of `low_precision_params`.

    Attributes:
        inner_state: the wrapped optimizer's state (built from float32 copies of
            the parameters, so in float32 unless the optimizer is `cast_state`'d).
        compensation: ``rounding="kahan"`` only (None otherwise): per
            half-precision parameter, in its dtype, what rounding the last step
            lost; `optax.MaskedNode` for float32 parameters, which are not rounded.
        key: ``rounding="stochastic"`` only (None otherwise): the PRNG key of the
            next step.
    """

    inner_state: Any
    compensation: Any
    key: Any


def low_precision_params(
    optimizer: optax.GradientTransformation,
    *,
    rounding: str = "stochastic",
    key: jax.Array | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wrap `optimizer` for parameters stored in bfloat16 or float16.

    Each step, the wrapped optimizer sees float32 gradients and float32 copies of
    the parameters; the new value ``param + update`` is computed in float32 and
    rounded to the parameter's own dtype by `rounding`. The returned updates are
    float32, ``rounded - param``, so that the usual
    ``optax.apply_updates(params, updates)`` (float32 ``param + update``, cast
    back to the parameter's dtype) lands exactly on the rounded value: the
    rounded value is a neighbour of a float32 sum at the parameter's scale, so
    the float32 round trip through the difference reproduces it (the tests check
    this property, zero crossings included). Use `optax.apply_updates`, not
    `equinox.apply_updates`, which returns ``param + update`` without casting it
    back, i.e. in float32.

    float32 parameters are left to the wrapped optimizer: their updates pass
    through unchanged.

    Put `jaxamp.scaling.skip_nonfinite_updates` (or a loss scaler's skip) *outside* this
    wrapper, so that a skipped step keeps the compensation buffer and the key.

    Args:
        optimizer: any optax gradient transformation.
        rounding: how the float32 result becomes the parameter's dtype:
            ``"stochastic"``: up or down at random, unbiased (see
            `jaxamp.optim.stochastic_round`), from `key`; ``"kahan"``: to
            nearest, carrying what was lost (a buffer in the parameter's dtype)
            into the next step; ``"nearest"``: plain rounding, which loses every
            update below half a spacing (for comparison).
        key: a PRNG key, required by ``"stochastic"`` (and refused otherwise). It
            is split every step, so a run is reproducible from it.

    Returns:
        A `GradientTransformationExtraArgs` whose state is a
        `LowPrecisionParamsState`; its ``update(grads, state, params)`` requires
        `params`.

    Raises:
        TypeError: `optimizer` is not a gradient transformation, `key` is not a
            PRNG key; at ``init``/``update``: a parameter is not a bfloat16,
            float16 or float32 array (integers, bools, float64 and complex are
            never cast), or a gradient is not bfloat16, float16 or float32.
        ValueError: an unknown `rounding`, a missing key for ``"stochastic"``, a
            key for another mode; ``update`` without `params`.
    """
    owner = "low_precision_params"
    inner = as_optimizer(owner, optimizer)
    key = check_rounding(owner, rounding, key, _ROUNDINGS)

    def init(params: Any) -> LowPrecisionParamsState:
        params = array_part(params)
        _check_leaves("parameter", params)
        compensation = None
        if rounding == "kahan":
            compensation = jax.tree.map(lambda p: optax.MaskedNode() if p.dtype == _F32 else jnp.zeros_like(p), params)
        return LowPrecisionParamsState(inner.init(_upcast(params)), compensation, key)

    def update(updates, state: LowPrecisionParamsState, params=None, **extra_args):
        # Named as optax's protocol names them: frameworks call update(updates=..., state=..., params=...).
        grads = updates
        if params is None:
            raise ValueError(f"{owner} computes each new value from the parameters: call update(grads, state, params).")
        params = array_part(params)
        _check_leaves("parameter", params)
        _check_leaves("gradient", grads)
        params32 = _upcast(params)
        steps, inner_state = inner.update(_upcast(grads), state.inner_state, params32, **extra_args)

        treedef = jax.tree.structure(params)
        leaves = treedef.flatten_up_to(params)
        n = len(leaves)
        kahan = rounding == "kahan"
        compensation = treedef.flatten_up_to(state.compensation) if kahan else [None] * n
        next_key, keys = leaf_keys(state.key, n) if key is not None else (None, [None] * n)
        results = [
            _round_step(*args, rounding) for args in zip(leaves, treedef.flatten_up_to(steps), compensation, keys)
        ]
        updates = treedef.unflatten([u for u, _ in results])
        compensation = treedef.unflatten([c for _, c in results]) if kahan else None
        return updates, LowPrecisionParamsState(inner_state, compensation, next_key)

    return optax.GradientTransformationExtraArgs(init, update)


def _round_step(param, step, compensation, key, rounding):
    """``(float32 update, new compensation)`` for one parameter."""
    if param.dtype == _F32:
        return step, compensation
    old = param.astype(_F32)
    target = old + step
    if rounding == "kahan":
        target = target + compensation.astype(_F32)
        new = target.astype(param.dtype)
    else:
        new = round_to(target, param.dtype, rounding, key)
    new32 = new.astype(_F32)
    # target - new32 is exact: new is target's nearest neighbour.
    lost = (target - new32).astype(param.dtype) if rounding == "kahan" else None
    return new32 - old, lost


def _upcast(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.astype(_F32), tree)


def _check_leaves(what: str, tree: Any) -> None:
    """TypeError unless every leaf is a bfloat16, float16 or float32 array."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        is_array = isinstance(leaf, (jax.Array, np.ndarray))
        if is_array and leaf.dtype in STORAGE_DTYPES:
            continue
        found = f"dtype {leaf.dtype}" if is_array else f"a {type(leaf).__name__}"
        advice = (
            "leave other leaves out of the optimizer, e.g. with "
            "eqx.filter(model, eqx.is_inexact_array) or optax.partition"
            if what == "parameter"
            else "cast them explicitly if that is intended"
        )
        raise TypeError(
            f"low_precision_params: the {what} at {jax.tree_util.keystr(path) or 'the root'} "
            f"is {found}; only bfloat16, float16 and float32 arrays are accepted (integers, "
            f"bools, float64 and complex are never cast): {advice}."
        )
