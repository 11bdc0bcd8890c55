"""Convert an optimizer state between a plain optimizer's and `loss_scaling`'s.

A checkpoint written by a run without loss scaling holds ``adam``'s state; the
float16 run's target holds a `LossScaleState` around it, so Orbax refuses the
restore (``TypeError: Type mismatch at key path ('opt_state',)``), and the
other way round. `without_loss_scaling_state` takes the wrapper out (use it on
the restore target, or to go back to a run without loss scaling);
`with_loss_scaling_state` puts it around a plain state, with the fresh scale
of the transformation it is given, as that transformation's ``init`` would.

Both accept the state anywhere in a pytree (a flax ``TrainState``, a dict such
as MaxText's checkpoint or an ``nnx.to_pure_dict`` tree) and in either of the
two forms a `LossScaleState` takes: the NamedTuple optax builds, or the dict of
its fields (``{"inner_state": ..., "scaler_state": {...}, "last_finite": ...,
"step_finite": ...}``) that nnx's state and checkpoint layouts write. Leaves
may be arrays or abstract (``jax.ShapeDtypeStruct``, for a restore target).

`restore_across_loss_scaling` puts both around a framework's restore function,
so a driver changes precision across a checkpoint in one line and still
resumes its own checkpoints.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import _compat
from ._dynamic_scaler import DynamicScalerState
from ._live_scale import find_live_scale, replicated_like
from ._loss_scaling import LossScaleState, loss_scaling

__all__ = ["restore_across_loss_scaling", "with_loss_scaling_state", "without_loss_scaling_state"]

T = TypeVar("T")
_LOG = logging.getLogger("jaxamp")

_FIELDS = frozenset(LossScaleState._fields)
# Where an optimizer state sits in a training state: flax TrainState's field,
# MaxText's checkpoint layout and an nnx.Optimizer's pure dict.
_OPT_STATE = "opt_state"


def _is_dict_form(x: Any) -> bool:
    return isinstance(x, Mapping) and set(map(str, x.keys())) == _FIELDS


def _is_wrapped(x: Any) -> bool:
    return isinstance(x, LossScaleState) or _is_dict_form(x)


def _is_wrapped_or_variable(x: Any) -> bool:
    """A node `without_loss_scaling_state` does not rebuild: nnx's Variables stay the objects they are."""
    return _is_wrapped(x) or ("flax.nnx" in sys.modules and _compat.nnx_is_object(x))


def _describe(x: Any) -> str:
    """``"<type> <repr>"`` on one line, cut at 200 characters."""
    text = " ".join(repr(x).split())
    return f"{type(x).__name__} {text[:200]}{'...' if len(text) > 200 else ''}"


def without_loss_scaling_state(tree: Any) -> Any:
    """`tree` with every `LossScaleState` in it replaced by its ``inner_state``.

    The optimizer state of ``jaxamp.loss_scaling(opt)`` becomes ``opt``'s, as a
    run without loss scaling (or the checkpoint it wrote) holds it. Works on
    the state itself, on any pytree holding it (a flax ``TrainState``, a dict),
    on the dict form nnx and MaxText's checkpoints write, and on abstract
    trees (a restore target).

    Example, restoring a plain checkpoint into a loss-scaled run::

        target = jaxamp.scaling.without_loss_scaling_state(abstract_state)
        restored = checkpointer.restore(path, target)
        state = jaxamp.scaling.with_loss_scaling_state(restored, tx)

    Raises:
        ValueError: `tree` holds no loss-scaling state (nothing to take out).
    """
    found = []

    def strip(x: Any) -> Any:
        if isinstance(x, LossScaleState):
            found.append(x)
            return strip(x.inner_state)
        if _is_dict_form(x):
            found.append(x)
            return strip(x["inner_state"])
        return x

    out = jax.tree_util.tree_map(strip, tree, is_leaf=_is_wrapped_or_variable)
    if not found:
        raise ValueError(
            "jaxamp.scaling.without_loss_scaling_state: the tree holds no jaxamp.LossScaleState "
            f"(nor its dict form with keys {sorted(_FIELDS)}), so there is no loss scaling to take "
            f"out; got {_describe(tree)}."
        )
    return out


def with_loss_scaling_state(tree: Any, tx: Any) -> Any:
    """`tree` with its optimizer state wrapped as ``tx``'s, a `jaxamp.loss_scaling` transformation.

    The optimizer state is ``tree``'s ``opt_state`` (a flax ``TrainState``'s
    field, or the ``"opt_state"`` key of a dict at any depth: MaxText's
    checkpoint layout, ``nnx.to_pure_dict(nnx.state(optimizer))``), or `tree`
    itself where it has none. It becomes the state ``tx.init`` would have made
    around it: ``LossScaleState(inner_state=<it, unchanged>, scaler_state=<tx's
    initial scale and schedule>, last_finite=True, step_finite=True)``, as a
    NamedTuple, or in the dict form where the optimizer state is all dicts.
    Where ``tx`` puts the wrapper inside another (``optax.MultiSteps(
    loss_scaling(opt), k)``), it goes at the same place in the state. New
    arrays are replicated over the mesh of the state's sharded leaves; an
    abstract state gets abstract ones.

    Args:
        tree: the training or optimizer state, written without loss scaling.
        tx: the ``jaxamp.loss_scaling(opt)`` transformation the run will use
            (or a wrapper around it, or the function
            `jaxamp.scaling.loss_scaling_factory` made); ``opt`` must be the
            optimizer whose state `tree` holds.

    Raises:
        TypeError: `tx` is not a gradient transformation holding one
            `jaxamp.loss_scaling`.
        ValueError: the state already holds loss scaling, `tree` holds more
            than one ``opt_state``, or the state is not shaped like ``tx``'s
            at the wrapper's place.
    """
    tx = getattr(tx, "_jaxamp_loss_scaling", tx)  # a loss_scaling_factory's function
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise TypeError(
            "jaxamp.scaling.with_loss_scaling_state: tx must be the jaxamp.loss_scaling(optimizer) "
            f"transformation the run uses; got {_describe(tx)}."
        )
    path, fresh = _fresh_parts(tx)
    located = _locate(tree)
    if located is None:
        return _wrap_at(tree, path, fresh, tree)
    (where,) = located
    return _replace_at(tree, where, lambda opt_state: _wrap_at(opt_state, path, fresh, tree))


def _fresh_parts(tx: Any) -> tuple[tuple, tuple]:
    """Where ``tx``'s state holds its `LossScaleState`, and that state's scaler_state/last/step_finite.

    ``tx.init`` runs on an empty parameter tree under `jax.jit`, outputs
    limited to the loss-scaling fields, so nothing of the wrapped optimizer's
    state is built.
    """
    try:
        shape = jax.eval_shape(tx.init, {})
    except Exception as e:  # noqa: BLE001  (any init failure: the message names tx)
        raise TypeError(
            "jaxamp.scaling.with_loss_scaling_state: tx.init failed on an empty parameter tree, so "
            f"its initial scale cannot be read ({type(e).__name__}: {e}); tx: {_describe(tx)}."
        ) from e
    paths = [
        p
        for p, leaf in jax.tree_util.tree_flatten_with_path(shape, is_leaf=lambda x: isinstance(x, LossScaleState))[0]
        if isinstance(leaf, LossScaleState)
    ]
    if len(paths) != 1:
        raise TypeError(
            "jaxamp.scaling.with_loss_scaling_state: tx must hold exactly one jaxamp.loss_scaling "
            f"transformation; its state holds {len(paths)} LossScaleStates. tx: {_describe(tx)}."
        )
    (path,) = paths

    def parts() -> tuple:
        state = _get_at(tx.init({}), path)
        return state.scaler_state, state.last_finite, state.step_finite

    return path, tuple(jax.device_get(jax.jit(parts)()))


def _locate(tree: Any) -> list[tuple] | None:
    """The key path of the one ``opt_state`` in `tree` (a list of one), None where there is none."""
    found: list[tuple] = []

    def visit(x: Any, path: tuple) -> None:
        if isinstance(x, Mapping):
            for k, v in x.items():
                if k == _OPT_STATE:
                    found.append((*path, jax.tree_util.DictKey(k)))
                else:
                    visit(v, (*path, jax.tree_util.DictKey(k)))
        elif dataclasses.is_dataclass(x) and not isinstance(x, type) and hasattr(x, _OPT_STATE):
            found.append((*path, jax.tree_util.GetAttrKey(_OPT_STATE)))
        elif type(x) in (tuple, list):  # what a restore function returns beside the state
            for i, v in enumerate(x):
                visit(v, (*path, jax.tree_util.SequenceKey(i)))

    visit(tree, ())
    if len(found) > 1:
        raise ValueError(
            "jaxamp.scaling.with_loss_scaling_state: the tree holds "
            f"{len(found)} opt_state entries ({', '.join(jax.tree_util.keystr(p) for p in found)}); "
            "convert each optimizer state on its own."
        )
    return found or None


def _get_at(x: Any, path: tuple) -> Any:
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            x = x[key.key]
        elif isinstance(key, jax.tree_util.GetAttrKey):
            x = getattr(x, key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            x = x[key.idx]
        else:
            raise ValueError(f"jaxamp.scaling.with_loss_scaling_state: cannot follow key {key!r}.")
    return x


def _replace_at(x: Any, path: tuple, fn: Any) -> Any:
    if not path:
        return fn(x)
    key, rest = path[0], path[1:]
    if isinstance(key, jax.tree_util.DictKey):
        out = dict(x) if type(x) is not dict else x.copy()
        out[key.key] = _replace_at(x[key.key], rest, fn)
        return type(x)(out) if type(x) is not dict else out
    if isinstance(key, jax.tree_util.GetAttrKey):
        new = _replace_at(getattr(x, key.name), rest, fn)
        if isinstance(x, eqx.Module):  # its __init__ may not take its fields (Levanter's TrainerState)
            return eqx.tree_at(lambda m: getattr(m, key.name), x, new, is_leaf=lambda v: v is None)
        if hasattr(x, "_replace"):
            return x._replace(**{key.name: new})
        if hasattr(x, "replace"):  # flax struct dataclasses (TrainState)
            return x.replace(**{key.name: new})
        return dataclasses.replace(x, **{key.name: new})
    if isinstance(key, jax.tree_util.SequenceKey):
        items = list(x)
        items[key.idx] = _replace_at(items[key.idx], rest, fn)
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    raise ValueError(f"jaxamp.scaling.with_loss_scaling_state: cannot follow key {key!r}.")


def _all_dicts(x: Any) -> bool:
    """Whether the optimizer state is in dict form: no tuple nodes anywhere (nnx's pure dicts, checkpoints)."""
    if isinstance(x, Mapping):
        return all(_all_dicts(v) for v in x.values())
    return not isinstance(x, (tuple, list))


def _wrap_at(opt_state: Any, path: tuple, fresh: tuple, whole: Any) -> Any:
    dict_form = _all_dicts(opt_state)
    if _holds_loss_scaling(opt_state):
        raise ValueError(
            "jaxamp.scaling.with_loss_scaling_state: the optimizer state already holds a "
            f"jaxamp.LossScaleState (or its dict form); got {_describe(opt_state)}."
        )
    if dict_form:
        # The dict form names fields where the NamedTuple form has attributes.
        path = tuple(
            jax.tree_util.DictKey(k.name) if isinstance(k, jax.tree_util.GetAttrKey) else k
            for k in path  # MultiSteps' inner_opt_state...
        )
    try:
        inner = _get_at(opt_state, path)
    except (KeyError, AttributeError, IndexError, TypeError) as e:
        raise ValueError(
            "jaxamp.scaling.with_loss_scaling_state: tx keeps its loss scaling at "
            f"{jax.tree_util.keystr(path)} of its state, which this optimizer state lacks; "
            f"got {_describe(opt_state)}."
        ) from e
    scaler_state, last_finite, step_finite = _place(fresh, inner if jax.tree_util.tree_leaves(inner) else whole)

    def wrap(inner: Any) -> Any:
        if dict_form:
            return {
                "inner_state": inner,
                "scaler_state": dict(zip(DynamicScalerState._fields, scaler_state)),
                "last_finite": last_finite,
                "step_finite": step_finite,
            }
        return LossScaleState(
            inner_state=inner, scaler_state=scaler_state, last_finite=last_finite, step_finite=step_finite
        )

    return _replace_at(opt_state, path, wrap)


def _place(fresh: tuple, like: Any) -> tuple:
    """The fresh scale parts as arrays like `like`'s leaves: abstract, replicated on their mesh, or plain."""
    leaves = jax.tree_util.tree_leaves(like)
    replicated = replicated_like(like)
    if leaves and all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves):
        return jax.tree_util.tree_map(
            lambda v: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype, sharding=replicated), fresh
        )
    if replicated is None:
        return jax.tree_util.tree_map(jnp.asarray, fresh)
    return jax.tree_util.tree_map(lambda v: jax.device_put(np.asarray(v), replicated), fresh)


def _loss_scaling_states(tree: Any) -> list:
    """The `LossScaleState`s in `tree`, in either form."""
    return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=_is_wrapped) if _is_wrapped(x)]


def _holds_loss_scaling(tree: Any) -> bool:
    return bool(_loss_scaling_states(tree))


def restore_across_loss_scaling(restore: Callable[..., T], tx: Any = None) -> Callable[..., T]:
    """`restore`, a framework's restore function, made to take checkpoints written with or without loss scaling.

    `restore` is called with a restore target among its arguments, the one
    holding an optimizer state (MaxText's ``checkpointing.load_state_if_possible``
    and its ``abstract_unboxed_pre_state``, Levanter's ``load_checkpoint`` and
    its ``tree``), and returns what it restored; or it restores in place into
    an ``nnx.Optimizer`` among its arguments (Tunix's
    ``CheckpointManager.maybe_restore`` and its ``optimizer``). The returned
    function calls it as given first, so a run resumes its own checkpoints as
    before. Where that fails and the target holds `loss_scaling`'s state, it
    restores into the target without it and wraps the optimizer state in the
    result with `tx`'s initial scale (`with_loss_scaling_state`): a checkpoint
    of a float32 or bfloat16 run resumes in float16. Where the target holds
    none, it restores into the target with it and takes it out of the result
    (`without_loss_scaling_state`): a float16 run's checkpoint resumes without
    loss scaling. An ``nnx.Optimizer`` holds its state in the other form for
    the second try. Either conversion is logged once per call (logger
    ``"jaxamp"``); where the second try fails too, the first error is raised.
    A call with no optimizer state among its arguments (parameters alone) is
    passed through.

    Where amp reads `tx`'s live scale (``loss_scale=tx``, a framework's
    loop), the scale of the state restored is set as that live scale, so the
    first step after a restore runs at it, not at the initial scale (where it
    could overflow and be skipped).

    For a framework that looks the function up at call time, one line::

        checkpointing.load_state_if_possible = jaxamp.scaling.restore_across_loss_scaling(
            checkpointing.load_state_if_possible, optimizers.get_optimizer)

    Args:
        restore: the function that restores into a target it is given.
        tx: the run's `jaxamp.loss_scaling` transformation, or the function
            `loss_scaling_factory` made, whose initial scale a converted state
            starts at. None in a run without loss scaling (where a float16
            run's checkpoint is read, its wrapper is taken to be
            `loss_scaling`'s around the whole optimizer; pass the
            transformation that run used where it sat elsewhere, inside
            ``optax.MultiSteps``).

    Returns:
        A function with `restore`'s signature and name.

    Raises:
        TypeError: `restore` is not callable; when called, more than one
            argument holds an optimizer state, or the target holds loss
            scaling and `tx` is None.
    """
    if not callable(restore):
        raise TypeError(
            "jaxamp.scaling.restore_across_loss_scaling expects the function that restores a checkpoint, "
            f"got {_describe(restore)}."
        )

    @functools.wraps(restore)
    def restore_either(*args: Any, **kwargs: Any) -> T:
        bound = _bound(restore, args, kwargs)
        name = _target_name(restore, bound)
        if name is None:  # no optimizer state to restore (parameters alone): nothing to convert
            return restore(*args, **kwargs)
        target = bound.arguments[name]
        if _compat.nnx_is_optimizer(target):
            return _restore_into(target, lambda: restore(*args, **kwargs), tx, restore)
        scaled = _holds_loss_scaling(target)
        if scaled and tx is None:
            raise TypeError(
                f"jaxamp.scaling.restore_across_loss_scaling: {name} holds jaxamp.loss_scaling's state, so a "
                "checkpoint written without it is wrapped with the run's initial scale: pass the run's "
                "transformation (or the loss_scaling_factory function) as tx."
            )

        def in_the_other_form() -> T:
            if scaled:
                bound.arguments[name] = without_loss_scaling_state(target)
            else:
                bound.arguments[name] = with_loss_scaling_state(target, _default_loss_scaling() if tx is None else tx)
            return restore(*bound.args, **bound.kwargs)

        restored, converted = _as_given_else(lambda: restore(*args, **kwargs), in_the_other_form)
        if converted:
            _log_conversion(restore, scaled)
            restored = with_loss_scaling_state(restored, tx) if scaled else without_loss_scaling_state(restored)
        _follow(tx, restored)
        return restored

    return restore_either


def _as_given_else(as_given: Callable[[], T], other_form: Callable[[], T]) -> tuple[T, bool]:
    """``as_given()``, else ``other_form()`` (and whether it came to that); where both fail, the first error.

    The second try's own error (the target cannot take the other form, or there
    is no checkpoint at all) says less than the first.
    """
    try:
        return as_given(), False
    except Exception as first:  # noqa: BLE001  (a framework's restore raises its own kinds)
        try:
            return other_form(), True
        except Exception:  # noqa: BLE001
            raise first from None


def _restore_into(optimizer: Any, call: Callable[[], T], tx: Any, restore: Any) -> T:
    """`call()` of `restore`, which restores into `optimizer` (an `nnx.Optimizer`) in place, from either form.

    Where the first try fails, the optimizer holds its state in the other form
    for the second, sharing its Variables (the wrapped optimizer's state is the
    same objects in both), so what is restored into them stays when its own
    form is put back: around it, the initial scale; out of it, the scale dropped.
    """
    own = optimizer.opt_state
    scaled = _holds_loss_scaling(own)

    def in_the_other_form() -> T:
        try:
            if scaled:
                optimizer.opt_state = without_loss_scaling_state(own)
            else:
                template = _default_loss_scaling() if tx is None else tx
                optimizer.opt_state = jax.tree_util.tree_map(
                    _compat.nnx_optimizer_leaf, with_loss_scaling_state(own, template), is_leaf=_compat.nnx_is_object
                )
            return call()
        finally:
            optimizer.opt_state = own

    result, converted = _as_given_else(call, in_the_other_form)
    if converted:
        _log_conversion(restore, scaled)
    _follow(tx, optimizer.opt_state)
    return result


def _log_conversion(restore: Any, scaled: bool) -> None:
    _LOG.warning(
        "jaxamp.scaling.restore_across_loss_scaling: %s restored a checkpoint written %s loss scaling; "
        "its optimizer state was converted (%s).",
        getattr(restore, "__qualname__", "restore"),
        "without" if scaled else "with",
        "wrapped at the initial loss scale" if scaled else "loss scaling taken out",
    )


def _follow(tx: Any, restored: Any) -> None:
    """Set `tx`'s live scale to the one loss scale `restored` holds, where it holds one, concrete."""
    live = None if tx is None else find_live_scale(tx)
    found = _loss_scaling_states(restored)
    if live is None or len(found) != 1:
        return
    scaler = found[0].scaler_state if isinstance(found[0], LossScaleState) else found[0]["scaler_state"]
    fields = [
        scaler[k] if isinstance(scaler, Mapping) else getattr(scaler, k) for k in ("scaler", "count", "total_resets")
    ]
    if any(isinstance(f, (jax.ShapeDtypeStruct, jax.core.Tracer)) for f in fields):
        return
    live.follow(*(np.asarray(jnp.asarray(f)) for f in fields))


def _bound(fn: Callable[..., Any], args: tuple, kwargs: dict) -> inspect.BoundArguments:
    try:
        return inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError):
        # No signature to bind by (a builtin): the arguments by position and name.
        params = [inspect.Parameter(f"arg{i}", inspect.Parameter.POSITIONAL_ONLY) for i in range(len(args))]
        params += [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in kwargs]
        return inspect.Signature(params).bind(*args, **kwargs)


def _target_name(fn: Callable[..., Any], bound: inspect.BoundArguments) -> str | None:
    """The name of the one argument holding an optimizer state (or loss scaling), the restore target; None: none."""
    names = [
        name
        for name, value in bound.arguments.items()
        if _compat.nnx_is_optimizer(value)
        or _holds_loss_scaling(value)
        or (_is_tree(value) and _locate(value) is not None)
    ]
    if not names:
        return None
    if len(names) > 1:
        raise TypeError(
            f"jaxamp.scaling.restore_across_loss_scaling: {getattr(fn, '__qualname__', fn)!s} was called with "
            f"{len(names)} arguments holding an optimizer state ({', '.join(names)}); it needs "
            "one at most, the restore target (a tree with an opt_state entry or field, or an nnx.Optimizer)."
        )
    return names[0]


def _is_tree(x: Any) -> bool:
    return isinstance(x, (Mapping, tuple, list)) or (dataclasses.is_dataclass(x) and not isinstance(x, type))


@functools.lru_cache(maxsize=1)
def _default_loss_scaling() -> Any:
    """`loss_scaling` around a whole optimizer, default schedule: the wrapper's place and fields in a state."""
    return loss_scaling(optax.identity())
