"""Loss scaling inside `jax.grad`: identities whose backward scales or unscales the cotangent.

``amp(loss, loss_scale=...)`` puts `unscale_on_backward` on each floating input
of the rewritten program and `scale_on_backward` on each floating output. The
forward pass is untouched (the loss comes back unscaled); in the backward pass
the loss's cotangent is multiplied by the scale before it enters the
half-precision ops, and each input's cotangent is divided by it, in float32,
before it leaves. So any transform that differentiates the amp'd function
(`jax.grad`, `equinox.filter_grad`, `nnx.grad`, under `vmap`, `scan`, `pmap`
or `shard_map`) gets true-scale gradients from a scaled backward pass:
non-finite where that pass overflowed, which `loss_scaling`'s update skips.
"""

from __future__ import annotations

import contextvars
import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import _compat
from .._jaxpr import equations_in
from ._backward_scale import scaling_backward
from ._dynamic_scaler import DynamicScalerState
from ._finite import checked_scalar, is_inexact_leaf, local_all_finite, on_every_device, select_tree
from ._live_scale import LiveScale, find_live_scale
from ._loss_scaling import LossScaleState, find_scaler_state, is_scale_state
from ._scale_uses import ScaleUse, note_live_call, record_use

__all__ = [
    "LossScaling",
    "as_loss_scale",
    "keep_returned_state",
    "scale_on_backward",
    "unscale_checked_on_backward",
    "unscale_on_backward",
]


def _wide(dtype: Any) -> Any:
    # Scaling and unscaling run in float32 at least, so neither the product
    # (before the cast back) nor the quotient over- or underflows on the way.
    return jnp.promote_types(dtype, jnp.float32)


@jax.custom_vjp
def scale_on_backward(x: jax.Array, scale: jax.Array) -> jax.Array:
    """`x`, whose cotangent is multiplied by `scale` (in float32, then cast to `x`'s dtype)."""
    return x


def _scale_fwd(x, scale):
    return x, scale


def _scale_bwd(scale, g):
    wide = _wide(g.dtype)
    return (g.astype(wide) * scale.astype(wide)).astype(g.dtype), jnp.zeros_like(scale)


scale_on_backward.defvjp(_scale_fwd, _scale_bwd)


@jax.custom_vjp
def unscale_on_backward(x: jax.Array, scale: jax.Array) -> jax.Array:
    """`x`, whose cotangent is divided by `scale` (in float32, then cast to `x`'s dtype)."""
    return x


def _unscale_bwd(scale, g):
    wide = _wide(g.dtype)
    return (g.astype(wide) / scale.astype(wide)).astype(g.dtype), jnp.zeros_like(scale)


unscale_on_backward.defvjp(_scale_fwd, _unscale_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _scale_and_mark(x: jax.Array, scale: jax.Array, use: ScaleUse) -> jax.Array:
    """`scale_on_backward`, whose backward rule also marks `use` differentiated (`record_use`)."""
    return x


def _mark_fwd(x, scale, use):
    return x, scale


def _mark_bwd(use, scale, g):
    use.differentiated = True
    return _scale_bwd(scale, g)


_scale_and_mark.defvjp(_mark_fwd, _mark_bwd)


@jax.custom_vjp
def unscale_checked_on_backward(x: jax.Array, scale: jax.Array) -> jax.Array:
    """`x`, whose cotangent is divided by `scale`, all NaN where any of its elements is not finite.

    Where the gradients leave the scaled backward pass, one identity per
    value the program differentiates (its arguments, the values it closes
    over): each cotangent depends on its own value alone, so under `jax.vmap`
    a value shared by the batch (``in_axes=None``, closed over) gets its
    cotangent summed over the batch once, not once per example. A non-finite
    cotangent is NaN throughout, so an elementwise clip or cast between amp
    and the optimizer (``jnp.clip`` turns an inf into its bound) cannot hide
    the overflow from the update.
    """
    return x


def _unscale_checked_bwd(scale, g):
    # Decided by this value's own cotangent, with no collective: it varies
    # over the devices its cotangent varies over (a replicated value's stays
    # replicated inside a shard_map), so an overflow on one device of a
    # data-parallel step reaches the others through the gradient's own
    # all-reduce, and an ensemble's member (a model per device under `pmap`)
    # is not held back by another's.
    finite = local_all_finite(g)
    true_scale = _unscale_bwd(scale, g)[0]
    return jnp.where(finite, true_scale, jnp.full_like(true_scale, jnp.nan)), jnp.zeros_like(scale)


unscale_checked_on_backward.defvjp(_scale_fwd, _unscale_checked_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def unscale_checked_live(x: jax.Array, scale: jax.Array, live: LiveScale) -> jax.Array:
    """`unscale_checked_on_backward` for a live scale, which is told the scale it ran at and whether it overflowed.

    NaN where the cotangent is not finite, as given the state; zeros where a
    wrapper that cannot take a NaN holds the transformation (optax's
    ``MultiSteps`` keeps a NaN in its accumulator for good): the update skips
    the step by the flag there.
    """
    return x


def _unscale_live_fwd(x, scale, live):
    return x, scale


def _unscale_live_bwd(live, scale, g):
    # Noted where the backward pass is traced: a forward-only call (an eval)
    # scaled no gradient an update could receive.
    note_live_call(live)
    finite = local_all_finite(g)
    overflowed = live.note_backward(scale, finite)
    true_scale = _unscale_bwd(scale, g)[0]
    return jnp.where(finite, true_scale, overflowed.astype(true_scale.dtype)), jnp.zeros_like(scale)


unscale_checked_live.defvjp(_unscale_live_fwd, _unscale_live_bwd)


def _is_scalable(x: Any) -> bool:
    return is_inexact_leaf(x) and not isinstance(x, (float, complex))


_SCALING: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxamp_loss_scaling", default=False)


class LossScaling:
    """amp's ``loss_scale=``: validated when amp is made, applied to each call by `run`.

    The scale's one way through a call: find it in what amp was given (and
    refuse an optimizer placement whose skipped step would commit state),
    wrap everything the program differentiates, its arguments and the values
    it closes over, in identities whose backward unscales and decides
    finiteness (`unscale_checked_on_backward`), scale the outputs'
    cotangents (`scale_on_backward`), hand custom_vjp rules true-scale
    cotangents (`around_custom_vjp`), and keep module state where the forward
    pass was not finite (`keep_returned_state`).
    """

    def __init__(self, loss_scale: Any):
        self.given = loss_scale
        scalar = isinstance(loss_scale, (int, float, *_SCALE_ARRAYS))
        self.live = None if scalar else find_live_scale(loss_scale)
        self.from_state = not scalar and _holds_scale_state(loss_scale)
        if self.live is not None and not self.from_state:
            self.live.attach()  # the only scale amp was given
        elif self.live is None and _built_per_step(loss_scale):
            raise ValueError(
                "amp's loss_scale is an optax.inject_hyperparams transformation, which builds the "
                "optimizer it wraps anew at every init and update: a jaxamp.loss_scaling built there "
                "keeps no scale between steps for amp to read. Put the wrapper outside: "
                "tx = jaxamp.loss_scaling(optax.inject_hyperparams(optax.adamw)(learning_rate=...)), "
                "hand tx to the framework and give amp the same tx (or give amp the optimizer state, "
                "loss_scale=opt_state)."
            )
        elif self.live is None and isinstance(loss_scale, optax.GradientTransformation):
            raise ValueError(
                "amp's loss_scale is an optax transformation that holds no jaxamp.loss_scaling: there is "
                "no loss scale to read. Wrap the optimizer, tx = jaxamp.loss_scaling(optax.adamw(...)), "
                "hand tx to the framework and give amp the same tx."
            )
        else:
            as_loss_scale(loss_scale)  # a bad value (or two scales in a state) is named when amp is made
        if self.from_state:
            check_placement(loss_scale, live=self.live is not None)
        elif self.live is not None:
            # An `nnx.Optimizer` (or a trainer holding one) shows where the wrapper sits.
            opt_state = getattr(getattr(loss_scale, "optimizer", loss_scale), "opt_state", None)
            if opt_state is not None:
                check_placement(opt_state, live=True)

    def _reads_live(self) -> bool:
        """Whether this call reads the live scale: given no state, or a state the compiled step does not take.

        A state that is a value of the step (an argument, as under ``pmap``)
        is read as before; one held from outside (an ``nnx.Optimizer`` given
        to amp before the framework's ``nnx.jit``) would be a constant there.
        """
        if self.live is None:
            return False
        if not self.from_state:
            return True
        scale = as_loss_scale(self.given)
        return not isinstance(scale, jax.core.Tracer) and _compat.compiling()

    def run(self, call: Callable[..., Any], inputs: Any) -> Any:
        """``call(**hooks)`` (`AmpOptions.run`'s keywords) with the scale applied; its output, state kept.

        Inside another amp call that scales, `call()` runs unscaled: the outer
        amp scales the cotangent once, where it enters the backward pass.
        """
        if _SCALING.get():
            return call()
        if _compat.forward_mode():
            raise TypeError(
                "jaxamp.amp(..., loss_scale=...) is differentiated in forward mode here (jax.jvp, "
                "jax.jacfwd, jax.hessian): loss scaling scales a backward pass, and forward mode has "
                "none. Take forward-mode derivatives of amp without loss_scale (bfloat16 needs none), "
                "or use reverse mode (jax.grad, jax.jacrev)."
            )
        scale_outputs: Any = scale_on_backward
        unscale_inputs: Any = unscale_checked_on_backward
        if self._reads_live():
            assert self.live is not None
            self.live.attach()
            scale = self.live.read_scale()
            # Under `jax.vmap` (per-example inputs, an ensemble's parameters) one
            # flag cannot take a decision per example: the overflow travels in
            # the gradient, NaN, as with the state (which any update skips).
            if _compat.mapped():
                note_live_call(self.live)
            else:
                unscale_inputs = functools.partial(unscale_checked_live, live=self.live)
        else:
            if self.live is not None:
                # Read from the state, the placements the live scale allows are not all allowed.
                check_placement(self.given)
            scale = as_loss_scale(self.given)
            if self.from_state:
                check_scale_is_live(scale)
            # A scale given as an array may be the state's own (``opt_state.scale``):
            # recorded too, so the update finds it.
            scaler = find_scaler_state(self.given).scaler if self.from_state else self.given
            # `nnx.Optimizer` holds it in a Variable; its update reads the value.
            use = record_use(_compat.nnx_raw_value(scaler) if _compat.has_nnx_objects(scaler) else scaler)
            if use is not None:
                scale_outputs = lambda x, scale: _scale_and_mark(x, scale, use)  # noqa: E731

        def wrap_inputs(args: list, consts: list) -> tuple[list, list]:
            # Closed-over values are tracers where a gradient is taken of them
            # (a closure's parameters, an Equinox module passed as the function).
            values = [*args, *consts]
            chosen = [
                i for i, v in enumerate(values) if _is_scalable(v) and (i < len(args) or isinstance(v, jax.core.Tracer))
            ]
            for i in chosen:
                values[i] = unscale_inputs(values[i], scale)
            return values[: len(args)], values[len(args) :]

        hooks = {
            "wrap_inputs": wrap_inputs,
            "wrap_outputs": lambda flat: [scale_outputs(v, scale) if _is_scalable(v) else v for v in flat],
            "keep_state": lambda out, updates: forward_finite((loss_leaves(out), updates)),
            "around_custom_vjp": _CustomVJPScaling(scale),
            "check_program": warn_if_differentiated_inside,
        }
        token = _SCALING.set(True)
        try:
            with scaling_backward(scale):
                out = call(**hooks)
        finally:
            _SCALING.reset(token)
        return keep_returned_state(self.given, inputs, out)


class _CustomVJPScaling:
    """`AmpContext.around_custom_vjp` for a scaled call: each rule sees true-scale cotangents.

    Around the rule's call, its outputs' cotangents are divided by the scale
    before the rule runs and its inputs' multiplied by it after, so a rule
    that is not linear in its cotangent (JAX's ``clip_gradient``) acts on the
    true values, while the backward pass around it stays scaled. A rule whose
    outputs are float16 is left as written (its cotangent unscaled in float16
    would flush), and so is one amp cannot reach; amp says so once.
    """

    def __init__(self, scale: jax.Array, unreachable_in: str | None = None):
        self.scale = scale
        self.unreachable_in = unreachable_in
        self.calls = 0

    def __call__(self, eqn: Any, invals: list, call: Callable[[list], Any]) -> Any:
        if self.unreachable_in is not None:
            _warn_unscaled_rule(f"a custom_vjp function inside {self.unreachable_in}")
            return call(invals)
        if any(v.aval.dtype == jnp.float16 for v in eqn.outvars):
            _warn_unscaled_rule("a custom_vjp function whose outputs are float16")
            return call(invals)
        self.calls += 1
        ins = [scale_on_backward(v, self.scale) if _is_scalable(v) else v for v in invals]
        return [unscale_on_backward(o, self.scale) if _is_scalable(o) else o for o in call(ins)]

    def unreachable(self, where: str) -> _CustomVJPScaling:
        """The hook for bodies the scale cannot reach (`where`): it runs rules as written, and says so."""
        return _CustomVJPScaling(self.scale, unreachable_in=where)


def warn_if_differentiated_inside(program: Any) -> None:
    """Warn where the traced program holds a backward pass: the function amp wraps takes its gradient itself.

    ``amp(jax.grad(loss), loss_scale=...)`` (or amp of an
    ``eqx.filter_value_and_grad``-decorated loss): the loss scale reaches
    only a backward pass taken *of* amp's function, so this one runs in half
    precision unscaled and small gradients flush to zero. Said here, when the
    program is traced, so a gradient jitted apart from the update is caught too.
    """
    if any(_compat.eqn_transposed(eqn) for eqn in equations_in(program)):
        warnings.warn(
            "jaxamp.amp(..., loss_scale=...) wraps a function that takes a gradient itself (its traced "
            "program holds a backward pass): the loss scale reaches only a gradient taken of the function "
            "amp makes, so this backward pass runs in half precision unscaled, and small gradients flush "
            "to zero. Put amp inside the gradient: jax.value_and_grad(jaxamp.amp(loss, compute_dtype='f16', "
            "loss_scale=opt_state)).",
            UserWarning,
            stacklevel=2,
        )


def _built_per_step(tx: Any) -> bool:
    """Whether `tx` is an ``optax.inject_hyperparams`` transformation (it builds its inner one per call)."""
    return "inject_hyperparams" in getattr(getattr(tx, "update", None), "__qualname__", "")


def _holds_scale_state(tree: Any) -> bool:
    """Whether `tree` holds a `LossScaleState` or `DynamicScalerState` among its pytree nodes."""
    return any(is_scale_state(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=is_scale_state))


def _warn_unscaled_rule(what: str) -> None:
    warnings.warn(
        f"jaxamp.amp(..., loss_scale=...) meets {what}: its backward rule sees the loss-scaled "
        "cotangent. That is exact for rules linear in the cotangent (most are), not for one that "
        "clips or normalises it (jax's clip_gradient pattern).",
        UserWarning,
        stacklevel=2,
    )


def check_placement(tree: Any, live: bool = False) -> None:
    """Raise where the `LossScaleState` in `tree` sits where a skipped step would not be a clean skip.

    Its zero updates and kept state make a skipped step a no-op only where
    the wrapper owns the whole update: transformations after it in an
    ``optax.chain`` (weight decay, another optimizer) would still step, a
    stateful one before it would advance, the other partitions of
    ``optax.multi_transform`` or ``optax.masked`` would take the NaN
    gradients, and ``optax.MultiSteps`` around it keeps a NaN in its
    accumulator (it resets it by multiplying by 0) for every later step.
    ``optax.apply_if_finite`` around it puts the wrapper's state back on a
    non-finite step, so the scale would not shrink.

    Raises:
        ValueError: naming the placement and the order that works.
    """
    paths = [
        path
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_scale_state)[0]
        if is_scale_state(leaf)
    ]
    if len(paths) != 1:
        return  # `find_scaler_state` says what is wrong
    node = tree
    for key in paths[0]:
        problem = _placement_problem(node, key, live)
        if problem:
            raise ValueError(f"amp's loss_scale holds jaxamp.loss_scaling's state {problem}")
        node = _child(node, key)
        if node is None:
            return


_WRAP_WHOLE = (
    "so a skipped (non-finite) step would still change the parameters or the optimizer state. Wrap the "
    "whole optimizer instead: jaxamp.loss_scaling(optax.chain(...)), jaxamp.loss_scaling(optax.multi_transform"
    "(...)), jaxamp.loss_scaling(optax.MultiSteps(opt, k)) (docs/loss_scaling.md, placements)."
)


def _placement_problem(node: Any, key: Any, live: bool) -> str | None:
    """What is wrong with the wrapper's state at `key` of `node`, and what works; None where nothing is."""
    name = getattr(key, "name", None)
    # A live scale's overflow leaves zeros, not NaN, in MultiSteps' accumulator.
    if not live and isinstance(node, optax.MultiStepsState) and name == "inner_opt_state":
        return (
            "inside optax.MultiSteps, whose accumulator keeps a NaN micro-batch for every later step. "
            "Wrap the accumulator, jaxamp.loss_scaling(optax.MultiSteps(opt, k)); where a framework "
            "builds the MultiSteps around your optimizer (Tunix's gradient_accumulation_steps), give "
            "amp the transformation instead of its state: jaxamp.amp(loss, compute_dtype='f16', "
            "loss_scale=tx), or jaxamp.amp_module(model, compute_dtype='f16', loss_scale=optimizer) "
            "for a flax nnx model (docs/loss_scaling.md, placements)."
        )
    # Nor does apply_if_finite see a live scale's overflow: it takes the zeros as finite.
    if not live and isinstance(node, optax.ApplyIfFiniteState) and name == "inner_state":
        return (
            "inside optax.apply_if_finite, which puts the wrapper's state back on a non-finite step: the "
            "loss scale would not shrink until max_consecutive_errors overflows in a row, and every step "
            "at the overflowing scale would be skipped. jaxamp.loss_scaling skips a non-finite step "
            "itself: drop apply_if_finite, or put it inside, jaxamp.loss_scaling(optax.apply_if_finite"
            "(opt, k)) (docs/loss_scaling.md, placements)."
        )
    if isinstance(node, optax.MultiTransformState):
        return "in one partition of optax.multi_transform (the others would take the non-finite gradients), " + (
            _WRAP_WHOLE
        )
    if isinstance(node, optax.MaskedState):
        return "inside optax.masked (the parameters it leaves out would take the non-finite gradients), " + (
            _WRAP_WHOLE
        )
    if type(node) is tuple and isinstance(key, jax.tree_util.SequenceKey):
        if key.idx + 1 < len(node):
            return "inside an optax.chain with transformations after it (they would still step), " + _WRAP_WHOLE
        if any(jax.tree_util.tree_leaves(sibling) for sibling in node[: key.idx]):
            return "inside an optax.chain after a stateful transformation (its state would advance), " + _WRAP_WHOLE
    return None


def _child(node: Any, key: Any) -> Any:
    if isinstance(key, jax.tree_util.SequenceKey):
        return node[key.idx]
    if isinstance(key, jax.tree_util.GetAttrKey):
        return getattr(node, key.name)
    if isinstance(key, jax.tree_util.DictKey):
        return node[key.key]
    return None  # a custom node's child: not followed


def check_scale_is_live(scale: jax.Array) -> None:
    """Raise where a scale read from an optimizer state would be a constant of the program being compiled.

    A state the jitted function closes over (or that `amp` was given outside
    it) is read once, when the function is traced: every later step would run
    with that scale while `loss_scaling` moves the one in the state, and a
    step that overflowed at it would overflow again, skipped, forever. The
    bodies of a `lax.scan` or `jax.checkpoint` called eagerly are no such
    program: there the state's current scale is read.

    Raises:
        ValueError: `scale` is a concrete array and the caller runs inside
            `jax.jit` (or another compiled function).
    """
    if not isinstance(scale, jax.core.Tracer) and _compat.compiling():
        raise ValueError(
            "amp's loss_scale is an optimizer state the function being compiled does not take as an "
            "argument (it closes over it, or amp was given it outside): its scale would be a constant "
            "of the compiled program, and later steps would not see the scale jaxamp.loss_scaling "
            "moves. Pass the optimizer state into the jitted function and give that to amp: "
            "`def step(params, opt_state, batch): ... jaxamp.amp(loss, compute_dtype='f16', "
            "loss_scale=opt_state)`; or, for a fixed scale, pass a Python float."
        )


def forward_finite(tree: Any) -> jax.Array:
    """Whether every inexact leaf of `tree` (a forward pass's loss and module state) is finite on every device.

    Inside `jax.pmap` or a ``shard_map(check_vma=False)`` each device sees its
    own batch: the answer is reduced over all their mesh axes, so a NaN on one
    device keeps the module state on all (statistics synced across devices
    would otherwise commit it). Elsewhere `on_every_device` decides, with no
    collective where the values are global. The backward pass's check is each
    cotangent's own (`unscale_checked_on_backward`).
    """
    ok = local_all_finite(tree)
    manual = _compat.manual_axes()
    if manual and not _compat.tracks_varying_axes():
        return on_every_device(ok, tuple(manual), what="amp's loss_scale")
    return on_every_device(ok, what="amp's loss_scale")


def loss_leaves(out: Any) -> list:
    """The leaves of `out` whose non-finite value means the step will be skipped: the loss.

    The first element of a tuple whose first element is a floating scalar
    (``return loss, aux``, as ``has_aux`` takes it): a NaN metric beside it
    (the accuracy of an empty batch) does not hold back the state of a step
    that is applied. Otherwise the floating scalars of `out`: a non-scalar
    output (logits, predictions) may hold an inf by design (a mask), and no
    gradient is taken of it; where `out` has no floating scalar, all of it.
    """
    if isinstance(out, (tuple, list)) and out and is_inexact_leaf(out[0]) and jnp.ndim(out[0]) == 0:
        return [out[0]]
    leaves = [x for x in jax.tree_util.tree_leaves(out) if is_inexact_leaf(x)]
    scalars = [x for x in leaves if jnp.ndim(x) == 0]
    return scalars or leaves


# A scale given as an array (a fixed or traced scale, not an optimizer state).
_SCALE_ARRAYS = (jax.Array, np.ndarray, np.generic)


def as_loss_scale(loss_scale: Any) -> jax.Array:
    """amp's ``loss_scale=`` argument as a float32 scalar array.

    Accepted: an optimizer state holding one `LossScaleState` (see
    `find_scaler_state`), a `LossScaleState` or `DynamicScalerState`, or the
    scale itself (a Python number or a floating scalar array, finite and > 0
    where it is concrete).

    Raises:
        TypeError: a bool, a non-number, or an integer or non-scalar array
            that is not an optimizer state.
        ValueError: a concrete scale that is not finite and > 0, or a state
            tree without exactly one `LossScaleState`.
    """
    if isinstance(loss_scale, (LossScaleState, DynamicScalerState)):
        return _scale_of(find_scaler_state(loss_scale))
    if isinstance(loss_scale, (bool, np.bool_)):
        raise TypeError(
            f"amp's loss_scale must be an optimizer state from jaxamp.loss_scaling or a "
            f"positive float scale, got the bool {loss_scale!r}."
        )
    if isinstance(loss_scale, (int, float)):
        return checked_scalar("amp's loss_scale", loss_scale, jnp.float32, lower=0.0, inclusive=False)
    if isinstance(loss_scale, _SCALE_ARRAYS):
        if not jnp.issubdtype(jnp.result_type(loss_scale), jnp.floating):
            raise TypeError(
                "amp's loss_scale must be a floating scalar (the loss scale) or an optimizer "
                f"state from jaxamp.loss_scaling, got an array of dtype {jnp.result_type(loss_scale)}."
            )
        if jnp.ndim(loss_scale) != 0:
            raise TypeError(
                "amp's loss_scale must be a scalar (one scale for the whole loss) or an "
                f"optimizer state from jaxamp.loss_scaling, got an array of shape {jnp.shape(loss_scale)}."
            )
        return checked_scalar("amp's loss_scale", loss_scale, jnp.float32, lower=0.0, inclusive=False)
    return _scale_of(find_scaler_state(loss_scale, "amp's loss_scale"))


def _scale_of(state: DynamicScalerState) -> jax.Array:
    # `jnp.asarray` also reads an array held in a wrapper, as `nnx.Optimizer`
    # holds its state's leaves (in `nnx.OptState` variables).
    return jnp.asarray(state.scaler, jnp.float32)


def _is_eqx_state(x: Any) -> bool:
    return isinstance(x, eqx.nn.State)


def _signature(tree: Any) -> list[tuple[tuple[str, ...], tuple[int, ...], Any]]:
    """Each leaf's key path (as names: a dict and a flax FrozenDict alike), shape and dtype."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(tuple(str(getattr(k, "key", k)) for k in path), jnp.shape(v), jnp.result_type(v)) for path, v in leaves]


def batch_stats_of(given: Any) -> Any:
    """The ``batch_stats`` a flax ``TrainState`` (or a dict) given as amp's `loss_scale` holds, else None."""
    stats = given.get("batch_stats") if isinstance(given, Mapping) else getattr(given, "batch_stats", None)
    return stats if _is_array_mapping(stats) else None


def _is_array_mapping(x: Any) -> bool:
    """Module state a loss can thread: a dict (or FrozenDict) of arrays, one at least floating, by module.

    Its arrays sit two levels down or more, under the names of the modules
    that own them (haiku's ``{"mlp/~/batch_norm": {"mean_ema": ...}}``,
    Linen's ``{"BatchNorm_0": {"mean": ...}}``); a flat dict of arrays is a
    batch or a result (``{"image": x}``), never taken for state.
    """
    if not isinstance(x, Mapping):
        return False
    leaves = jax.tree_util.tree_flatten_with_path(x)[0]
    return (
        bool(leaves)
        and all(isinstance(v, (jax.Array, np.ndarray)) and len(path) >= 2 for path, v in leaves)
        and any(is_inexact_leaf(v) for _, v in leaves)
    )


def _mappings_taken(inputs: Any) -> list[Any]:
    """The dicts of arrays among the loss's arguments, and those one level inside them.

    haiku's ``state`` (``apply(params, state, rng, x)``), Linen statistics
    passed alone, or in the ``variables`` dict whose ``"batch_stats"`` entry
    ``apply(..., mutable=...)`` returns anew.
    """
    args, kwargs = inputs
    found = []
    for value in (*args, *kwargs.values()):
        if _is_array_mapping(value):
            found.append(value)
            found.extend(v for v in value.values() if _is_array_mapping(v))
    return found


def _same_leaves(a: Any, b: Any) -> bool:
    return all(x is y for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def _state_signature(x: Any) -> str | None:
    """How returned state is matched to given state, or None where `x` is no state.

    An `equinox.nn.State` by its structure, shapes and dtypes; a dict of arrays
    by its key paths, shapes and dtypes.
    """
    if _is_eqx_state(x):
        leaves = jax.tree_util.tree_leaves(x)
        return f"{jax.tree_util.tree_structure(x)!r}{[(jnp.shape(v), jnp.result_type(v)) for v in leaves]!r}"
    if _is_array_mapping(x):
        return repr(_signature(x))
    return None


def _given_state(loss_scale: Any, inputs: Any) -> dict[str, Any]:
    """The state the loss was given, by `_state_signature`; a signature two different trees share is dropped."""
    eqx_states = [x for x in jax.tree_util.tree_leaves(inputs, is_leaf=_is_eqx_state) if _is_eqx_state(x)]
    stats = batch_stats_of(loss_scale)
    by_signature: dict[str, Any] = {}
    ambiguous = set()
    for tree in eqx_states + ([stats] if stats is not None else []) + _mappings_taken(inputs):
        key = _state_signature(tree)
        if key in by_signature and not _same_leaves(by_signature[key], tree):
            ambiguous.add(key)
        by_signature.setdefault(key, tree)  # type: ignore[arg-type]
    return {k: v for k, v in by_signature.items() if k not in ambiguous}


def keep_returned_state(loss_scale: Any, inputs: Any, out: Any) -> Any:
    """`out`, the module state it returns replaced by the state the loss was given where the forward was not finite.

    A loss over stateful modules returns the new state beside the loss (``return
    loss, state``): a NaN batch would make it NaN, and the script would commit
    it although the step is skipped. Returned state is recognised, and the
    given value handed back in its place:

    - an `equinox.nn.State` with the structure, shapes and dtypes of one among
      the loss's arguments (a GAN's generator and discriminator states alike);
    - a dict (or FrozenDict) of arrays with the key paths, shapes and dtypes of
      one the loss took as an argument, or one level inside one (haiku's
      ``state``; Linen's statistics, from ``variables["batch_stats"]``), or of
      the ``batch_stats`` of the flax ``TrainState`` given as `loss_scale`
      (flax's ``examples/imagenet`` pattern).

    Two different given trees of one signature leave it unrecognised: amp
    cannot tell which one a returned tree continues. Everything else in `out`
    comes back as the loss computed it. Decided once, on every device
    (`forward_finite`), by the loss and the returned state (`loss_leaves`), as
    amp keeps flax nnx module state. A step skipped for an overflow of the
    backward pass alone is not seen here:
    ``select_tree(opt_state.last_finite, new, old)`` keeps its state too.
    """
    given = _given_state(loss_scale, inputs)

    def old_of(x: Any) -> Any:
        if not given or not (_is_eqx_state(x) or isinstance(x, Mapping)):
            return None
        old = given.get(_state_signature(x))  # type: ignore[arg-type]
        if old is None or _is_eqx_state(x):
            return old
        # The old values in `x`'s container (a dict where the state holds a FrozenDict).
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(x), jax.tree_util.tree_leaves(old))

    is_state = lambda x: old_of(x) is not None  # noqa: E731
    returned = [x for x in jax.tree_util.tree_leaves(out, is_leaf=is_state) if is_state(x)]
    if not returned:
        return out
    finite = forward_finite((loss_leaves(out), returned))
    return jax.tree_util.tree_map(
        lambda x: select_tree(finite, x, old_of(x)) if is_state(x) else x, out, is_leaf=is_state
    )
