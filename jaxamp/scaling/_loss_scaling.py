"""`loss_scaling`: dynamic loss scaling as an optax wrapper, its scale kept in the optimizer state.

The explicit-state path (`dynamic_scale_value_and_grad`) makes a training script
thread a second state, a `DynamicScalerState`, beside the optimizer's. Here the
optimizer state holds it: ``jaxamp.loss_scaling(optax.adam(1e-3))`` is an optax
transformation like any other (it goes into `optax.chain`, `optax.MultiSteps`,
a flax ``TrainState``, an ``nnx.Optimizer``, an Orbax checkpoint), and
``jaxamp.amp(loss, compute_dtype="f16", loss_scale=opt_state)`` reads the
scale from that state inside `jax.grad` (see `find_scaler_state`).

Both paths move the scale with `next_scaler_state` and decide finiteness with
`gradients_finite`'s two functions: one implementation of the rules.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import _compat
from .._dtypes import array_part
from ._dynamic_scaler import DynamicScalerState, host_scaler_state, next_scaler_state
from ._finite import AxisName, check_axis_name, select_tree
from ._live_scale import LiveScale, model_identity
from ._optax import check_optimizer, gradients_finite, update_if_finite
from ._scale_uses import check_live_use, check_scale_use, read_since_update

__all__ = ["LossScaleState", "find_scale_state", "find_scaler_state", "is_scale_state", "loss_scaling"]


class LossScaleState(NamedTuple):
    """The state of `loss_scaling`: the wrapped optimizer's state and the loss scale.

    Attributes:
        inner_state: the wrapped optimizer's state, exactly as after the last
            finite step.
        scaler_state: the loss scale and its schedule, a `DynamicScalerState`
            (``scaler``: the scale; ``count``: finite steps since it last
            changed; ``total_resets``: how many steps were skipped, each
            non-finite; ``patience``, ``adjust_factor``, ``min_scaler``,
            ``max_scaler``: the schedule), moved by the same rule as
            `dynamic_scale_value_and_grad` moves it.
        last_finite: whether the latest gradients were finite on every device
            (bool scalar); false means that step's updates were zeros.
        step_finite: around `optax.MultiSteps`, whether every micro-batch of
            the real step under way was finite so far (True otherwise).
    """

    inner_state: Any
    scaler_state: DynamicScalerState
    last_finite: jax.Array
    step_finite: jax.Array

    @property
    def scale(self) -> jax.Array:
        """The current loss scale (float32 scalar): ``scaler_state.scaler``."""
        return self.scaler_state.scaler


def loss_scaling(
    optimizer: optax.GradientTransformation,
    *,
    scaler: Any = 2.0**15,
    patience: Any = 2000,
    adjust_factor: Any = 2.0,
    min_scaler: Any = 1.0,
    max_scaler: Any = 2.0**24,
    axis_name: AxisName | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Wrap `optimizer` with dynamic loss scaling; the scale lives in its state.

    Pair it with ``jaxamp.amp(loss, compute_dtype="f16", loss_scale=opt_state)``,
    which scales the half-precision backward pass by the state's scale and
    hands back gradients in their true scale. Each update then:

    * decides whether the gradients are finite, the same on every device
      (`axis_name`, as `jaxamp.all_finite`);
    * finite: returns the wrapped optimizer's updates and state;
    * not finite: returns zero updates and the wrapped optimizer's state bit for
      bit as it was (pair with `jaxamp.scaling.apply_if_finite_updates` and
      ``opt_state.last_finite`` where the parameters' exact bits matter:
      ``p + 0.0`` turns ``-0.0`` into ``+0.0``);
    * moves the scale by the rule every jaxamp scaler shares
      (`jaxamp.scaling._scale_schedule.next_scale`) and counts a skipped
      step in ``scaler_state.total_resets``.

    The gradients it receives are true-scale (amp unscales them, or the
    script does); the scale is only read from the state, by amp. The update
    warns where they were not scaled by this state's scale: amp was given
    an older state, another optimizer's, or none (docs/loss_scaling.md).

    It must own the whole update for a skipped step to commit nothing: wrap
    the chain, the ``multi_transform`` or the ``MultiSteps``, not a part of
    it (amp refuses those placements).

    Where the framework owns the step (Tunix, MaxText) and the state never
    reaches the loss, give amp the transformation instead: ``tx =
    loss_scaling(opt)``, handed to the framework, and ``amp(loss,
    compute_dtype="f16", loss_scale=tx)``. amp then reads the scale from
    cells the transformation keeps (`jax.Ref`), which this update writes with
    the scale of the state it made; an overflow travels in the gradients, as
    with the state. Inside ``optax.MultiSteps`` too (a Tunix trainer's order,
    where the backward pass hands back zeros and a flag): the real step is
    skipped where any of its micro-batches overflowed. Not inside a
    ``shard_map`` or ``pmap`` body (pass the state there). A state the cells
    do not follow (the first step after a restore, a rollback, a second state
    on one transformation) steps at the cells' scale: an overflow above its
    own is skipped and its scale kept (docs/loss_scaling.md). A restore
    through `jaxamp.scaling.restore_across_loss_scaling` sets the cells to
    the restored scale.

    With gradient accumulation and the state given to amp, wrap the accumulator:
    ``loss_scaling(optax.MultiSteps(opt, k))``. The decision is then one per
    real step, as PyTorch's ``GradScaler`` makes it around accumulated
    gradients: a non-finite micro-batch is not accumulated (MultiSteps counts
    it, so the real step still comes every ``k`` micro-batches), and at the
    real step the wrapped optimizer steps only if all ``k`` were finite;
    otherwise the real step is skipped (zero updates, the wrapped optimizer's
    state and MultiSteps' step count as they were, the accumulator emptied)
    and the scale shrinks once. ``patience`` counts real steps. Not the other
    way round: optax's ``MultiSteps`` resets its accumulator by multiplying it
    by 0, which leaves a NaN a NaN, so one non-finite micro-batch would poison
    every later step (amp refuses that order).

    Args:
        optimizer: any optax gradient transformation (for a function that
            builds one, `loss_scaling_factory`).
        scaler: the initial loss scale (float, within the bounds).
        patience: finite steps in a row before the scale grows (int >= 0).
        adjust_factor: growth multiplier and shrink divisor (float >= 1).
        min_scaler: the floor of the scale (float > 0).
        max_scaler: the ceiling of the scale (finite float >= min_scaler).
        axis_name: inside `jax.pmap` or a ``shard_map(check_vma=False)``, the
            axes the gradients differ over (a name or a tuple of names), so
            every device skips the same steps and keeps the same scale. Not
            needed under `jax.jit` or in a ``shard_map`` with ``check_vma=True``
            (see `jaxamp.all_finite`); without it inside `pmap` the update
            raises a ValueError asking for it. ``()`` where each device
            trains a model of its own (an ensemble: one optimizer definition,
            a state per device, each member deciding alone).

    Returns:
        A `GradientTransformationExtraArgs` whose state is a `LossScaleState`.

    Raises:
        TypeError: `optimizer` is not a gradient transformation, `axis_name` is
            not a name or tuple of names, or a schedule value has the wrong kind.
        ValueError: a schedule value out of range (as `DynamicScalerState`).
    """
    if callable(optimizer) and not hasattr(optimizer, "update"):
        raise TypeError(
            f"jaxamp.loss_scaling expects an optax GradientTransformation (with init and update), got the "
            f"function {_name(optimizer)}. For a function that builds the optimizer (a framework's "
            "factory), use jaxamp.scaling.loss_scaling_factory."
        )
    inner = check_optimizer(optimizer, "jaxamp.loss_scaling")
    return _scaled(inner, *_schedule(scaler, patience, adjust_factor, min_scaler, max_scaler, axis_name))


def loss_scaling_factory(
    factory: Callable[..., optax.GradientTransformation],
    *,
    scaler: Any = 2.0**15,
    patience: Any = 2000,
    adjust_factor: Any = 2.0,
    min_scaler: Any = 1.0,
    max_scaler: Any = 2.0**24,
    axis_name: AxisName | None = None,
) -> Callable[..., optax.GradientTransformationExtraArgs]:
    """`factory`, a function that builds an optax optimizer, made to build it wrapped in `loss_scaling`.

    For a framework that builds its optimizer itself (MaxText's
    ``optimizers.get_optimizer``): patch its factory with this, and give amp
    the returned function, ``amp(loss, compute_dtype="f16",
    loss_scale=optimizers.get_optimizer)``, before any optimizer exists.
    Every optimizer it builds shares one live scale, which amp reads.

    Args:
        factory: a function returning an optax gradient transformation.
        scaler: the initial loss scale, as `loss_scaling`'s.
        patience: as `loss_scaling`'s.
        adjust_factor: as `loss_scaling`'s.
        min_scaler: as `loss_scaling`'s.
        max_scaler: as `loss_scaling`'s.
        axis_name: as `loss_scaling`'s.

    Returns:
        A function with `factory`'s signature and name.

    Raises:
        TypeError: `factory` is not callable (the returned function raises one
            where `factory` returns no gradient transformation), or a setting
            has the wrong kind, as `loss_scaling`.
        ValueError: a schedule value out of range.
    """
    if not callable(factory) or hasattr(factory, "update"):
        raise TypeError(
            "jaxamp.scaling.loss_scaling_factory expects a function that builds an optax optimizer, got "
            f"{type(factory).__name__}: {factory!r:.200}. Wrap an optimizer itself with jaxamp.loss_scaling."
        )
    settings = _schedule(scaler, patience, adjust_factor, min_scaler, max_scaler, axis_name)

    @functools.wraps(factory)
    def build(*args: Any, **kwargs: Any) -> optax.GradientTransformationExtraArgs:
        inner = check_optimizer(factory(*args, **kwargs), f"jaxamp.loss_scaling of {_name(factory)}")
        return _scaled(inner, *settings)

    build._jaxamp_live_scale = settings[2]  # type: ignore[attr-defined]
    # What `with_loss_scaling_state` reads the initial scale and the wrapper's place from.
    build._jaxamp_loss_scaling = _scaled(check_optimizer(optax.identity(), "loss_scaling_factory"), *settings)  # type: ignore[attr-defined]
    return build


def _schedule(
    scaler: Any, patience: Any, adjust_factor: Any, min_scaler: Any, max_scaler: Any, axis_name: Any
) -> tuple[DynamicScalerState, Any, LiveScale]:
    """The validated initial scaler state, axis name and live scale of a `loss_scaling` call."""
    axis_name = check_axis_name(axis_name, "jaxamp.loss_scaling")
    # Validated once here, by the class both paths share; the messages name
    # its fields, which are these keywords.
    initial = host_scaler_state(
        patience=patience,
        adjust_factor=adjust_factor,
        scaler=scaler,
        min_scaler=min_scaler,
        max_scaler=max_scaler,
    )

    # Kept as numpy values where concrete: `init` then makes its arrays in the
    # context it runs in (inside a `shard_map` over an Explicit mesh, a jax
    # array made out here would be a closed-over input, which JAX rejects),
    # fresh per call, so the state can be donated to a jit'd step.
    initial = jax.tree_util.tree_map(_as_numpy_if_concrete, initial)
    # Its cells need the initial scale as a number, and no enclosing trace: a
    # transformation made inside a jitted step would not outlive it.
    concrete = isinstance(initial.scaler, np.ndarray) and not _compat.staging()
    live = LiveScale(initial.scaler if concrete else None)
    return initial, axis_name, live


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _scaled(
    inner: optax.GradientTransformationExtraArgs, initial: DynamicScalerState, axis_name: Any, live: LiveScale
) -> optax.GradientTransformationExtraArgs:
    """`loss_scaling`'s transformation around the validated `inner`, its scale in `live`'s cells."""

    def init(params: Any) -> LossScaleState:
        live.place_like(params)
        if live.initial_scale is not None and _called_by_nan_intolerant_wrapper():
            live.wrapped_by_nan_intolerant()
        return LossScaleState(
            inner_state=inner.init(array_part(params)),
            scaler_state=jax.tree_util.tree_map(jnp.array, initial),
            last_finite=jnp.array(True),
            step_finite=jnp.array(True),
        )

    def update(updates: Any, state: LossScaleState, params: Any = None, **extra_args: Any):
        # Named as optax's protocol names them: frameworks call update(updates=..., state=..., params=...).
        grads = updates
        if not isinstance(state, LossScaleState):
            raise TypeError(
                f"jaxamp.loss_scaling's update expects the LossScaleState its init made, got {type(state).__name__}."
            )
        finite = gradients_finite(grads, axis_name, what="jaxamp.loss_scaling")
        # Given to amp as ``loss_scale=tx``, amp read the scale from the cells,
        # which follow this state; not inside a pmap or shard_map body, which
        # cannot close over them (amp reads the state there).
        reads_cells = live.attached and not _compat.manual_axes()
        if reads_cells and _compat.mapped():
            if read_since_update(live):
                check_live_use(live)  # this update has run: the next one starts afresh
                raise ValueError(
                    "jaxamp.loss_scaling's update runs under jax.vmap (over optimizer states: an ensemble), "
                    "and amp read this transformation's live scale (loss_scale=tx), which is one for all of "
                    "them: the members' scales could not move apart. Give amp each member's state inside "
                    "the vmapped function: jaxamp.amp(loss, compute_dtype='f16', loss_scale=opt_state)."
                )
            reads_cells = False  # the overflow is in the gradients, as with the state
        stale = model = None
        if reads_cells and live.zeros_on_overflow:
            # A wrapper that cannot take a NaN: the overflow is in the flag.
            model = model_identity(grads, None if params is None else array_part(params))
            overflow, stale = live.overflow_since_commit(state.scaler_state, model)
            finite = finite & ~overflow
        elif reads_cells:
            stale = live.ran_above(state.scaler_state)
        if reads_cells:
            check_live_use(live)
        else:
            check_scale_use(state.scaler_state.scaler, live)
        if isinstance(state.inner_state, optax.MultiStepsState):
            steps, new_state = _accumulating_update(inner, state, finite, grads, params, **extra_args)
        else:
            steps, inner_state = update_if_finite(inner, finite, grads, state.inner_state, params, **extra_args)
            new_state = LossScaleState(
                inner_state=inner_state,
                scaler_state=next_scaler_state(state.scaler_state, finite),
                last_finite=finite,
                step_finite=finite,
            )
        if stale is not None:
            # An overflow at a scale above the state's (the first step after a
            # restore, a rollback) says nothing of the state's scale, which is
            # kept; the step is still skipped: inside MultiSteps the window
            # carries it to the real step, whose mean took that micro-batch's zeros.
            moved = new_state.scaler_state
            kept_scale = moved._replace(scaler=state.scaler_state.scaler, count=state.scaler_state.count)
            new_state = new_state._replace(scaler_state=select_tree(stale & ~finite, kept_scale, moved))
            live.commit(~finite, stale, new_state.scaler_state, model)
        return steps, new_state

    update._jaxamp_live_scale = live  # type: ignore[attr-defined]
    return optax.GradientTransformationExtraArgs(init, update)


def _nan_intolerant_inits() -> frozenset[Any]:
    """The code of the inits of optax's wrappers that cannot take a NaN gradient from amp.

    ``MultiSteps`` resets its accumulator by multiplying it by 0 (a NaN stays);
    ``apply_if_finite`` reverts the wrapped state on a NaN, so the scale would
    not shrink.
    """
    apply_if_finite = optax.apply_if_finite(optax.identity(), 1)
    return frozenset({optax.MultiSteps.init.__code__, apply_if_finite.init.__code__})


_NAN_INTOLERANT_INITS = _nan_intolerant_inits()
# How far up the init's callers a wrapper is looked for (through `optax.chain` and the like).
_WRAPPER_DEPTH = 6


def _called_by_nan_intolerant_wrapper() -> bool:
    """Whether `loss_scaling`'s init (the caller's caller) runs inside one of `_NAN_INTOLERANT_INITS`.

    The wrappers hold the transformation without a way for it to see them
    (Tunix builds ``optax.MultiSteps(tx, k)`` itself); their init is the one
    moment the transformation is called from inside them.
    """
    frame: types.FrameType | None = sys._getframe(2)
    for _ in range(_WRAPPER_DEPTH):
        if frame is None:
            return False
        if frame.f_code in _NAN_INTOLERANT_INITS:
            return True
        frame = frame.f_back
    return False


def _accumulating_update(
    inner: optax.GradientTransformation,
    state: LossScaleState,
    finite: jax.Array,
    grads: Any,
    params: Any,
    **extra_args: Any,
) -> tuple[Any, LossScaleState]:
    """`loss_scaling`'s update around `optax.MultiSteps`: one decision per real step.

    A non-finite micro-batch goes in as zeros (MultiSteps' accumulator stays
    finite and its micro-step counter advances); the real step is taken only
    if every micro-batch of it was finite, and the scale moves once, there.
    """
    old: optax.MultiStepsState = state.inner_state
    params = None if params is None else array_part(params)
    clean = select_tree(finite, grads, jax.tree_util.tree_map(jnp.zeros_like, grads))
    updates, new = inner.update(clean, old, params, **extra_args)
    step_finite = state.step_finite & finite
    real_step = new.gradient_step != old.gradient_step
    skipped = real_step & ~step_finite
    # A skipped real step commits nothing: the wrapped optimizer's state and
    # the step count stay; the accumulator and micro-step are MultiSteps' reset.
    kept = new._replace(inner_opt_state=old.inner_opt_state, gradient_step=old.gradient_step)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, updates)
    return select_tree(skipped, zeros, updates), LossScaleState(
        inner_state=select_tree(skipped, kept, new),
        scaler_state=select_tree(real_step, next_scaler_state(state.scaler_state, step_finite), state.scaler_state),
        last_finite=finite,
        step_finite=step_finite | real_step,
    )


def _as_numpy_if_concrete(x: jax.Array) -> Any:
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return x  # traced (e.g. a hyperparameter of optax.inject_hyperparams)


def is_scale_state(x: Any) -> bool:
    """Whether `x` is a `LossScaleState` or a `DynamicScalerState`: what holds a loss scale."""
    return isinstance(x, (LossScaleState, DynamicScalerState))


def find_scaler_state(tree: Any, what: str = "loss_scale") -> DynamicScalerState:
    """The one `DynamicScalerState` in `tree`: an optimizer state holding a `LossScaleState`.

    The wrapper may sit anywhere in the optimizer state (inside `optax.chain`,
    `optax.MultiSteps`, `optax.inject_hyperparams`, a flax ``TrainState``'s
    ``opt_state``, an ``nnx.Optimizer``'s ``opt_state``...): it is found by
    type, and must be there exactly once, since two scales would leave it
    ambiguous which one the loss was scaled by.

    Args:
        tree: a pytree: an optimizer state, a `LossScaleState` or a
            `DynamicScalerState`.
        what: how error messages name `tree`.

    Raises:
        ValueError: no `LossScaleState` (nor `DynamicScalerState`) in `tree`, or
            more than one.
    """
    state = find_scale_state(tree, what)
    return state.scaler_state if isinstance(state, LossScaleState) else state


def find_scale_state(tree: Any, what: str = "loss_scale") -> LossScaleState | DynamicScalerState:
    """The one `LossScaleState` (or bare `DynamicScalerState`) in `tree`, as `find_scaler_state` finds it.

    The holder itself, for what the `LossScaleState` keeps beside the scale
    (``last_finite``).
    """
    found = [leaf for leaf in jax.tree_util.tree_leaves(tree, is_leaf=is_scale_state) if is_scale_state(leaf)]
    if len(found) != 1:
        problem = "holds no" if not found else f"holds {len(found)} loss scales:"
        raise ValueError(
            f"{what} must be an optimizer state holding exactly one jaxamp.LossScaleState "
            f"(the state of jaxamp.loss_scaling(optimizer)), a jaxamp.DynamicScalerState "
            f"or a scale array; got a {type(tree).__name__} that {problem} "
            + (
                "LossScaleState. Wrap the optimizer in jaxamp.loss_scaling."
                if not found
                else "wrap only one optimizer in jaxamp.loss_scaling, or pass the one scale "
                "to use (e.g. opt_state.scale)."
            )
        )
    (state,) = found
    return state
