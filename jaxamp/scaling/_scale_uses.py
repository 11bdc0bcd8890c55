"""Whether a loss scale amp was given reached a backward pass before the optimizer read it.

``amp(loss, loss_scale=opt_state)`` scales the backward pass of a gradient
taken *of* the amp'd function. Around a function that takes its gradient
itself (``amp(jax.grad(loss))``, amp of an ``eqx.filter_value_and_grad``
-decorated loss) there is no such pass: the inner backward runs in float16
unscaled, and small gradients flush to zero without a word. Nothing in one
call tells the two apart (the gradient may be taken later, of a jitted or
scanned program), but by the time `loss_scaling`'s update reads the scale
the backward pass has been traced, or never will be: amp records each scale
it was given (`record_use`), its backward rule marks the record, and the
update (`check_scale_use`) says so where none was marked.

The same record tells the update when the loss was scaled by another scale
than its own: an amp'd function built once and called again with a newer
state, or given another optimizer's (a GAN's generator loss given the
discriminator's state), or a `loss_scaling` optimizer whose gradients no amp
call scaled at all.
"""

from __future__ import annotations

import collections
import warnings
import weakref
from typing import Any

import jax


class ScaleUse:
    """amp's calls given one scale array: whether the backward pass of any of them was traced."""

    __slots__ = ("scaler", "differentiated", "trace")

    def __init__(self, scaler: Any):
        # Weakly: a tracer kept past its trace is a leak (`jax.checking_leaks`);
        # a dead one tells a reused id from the array recorded.
        self.scaler = weakref.ref(scaler)
        self.differentiated = False
        # Which program the scale is a value of (None: concrete, eager).
        self.trace = _trace_id(scaler)


# The latest scales amp was given, by the id of the state's array: a scale
# whose update is never called here (it runs in another trace) is dropped in turn.
_USES: collections.OrderedDict[int, ScaleUse] = collections.OrderedDict()
_KEPT = 64
# Whether amp was given a scale at all in this process: none means the
# gradients that update receives were scaled by no amp call at all.
_scaled_any = False


def record_use(scaler: Any) -> ScaleUse | None:
    """The record of `scaler` (the optimizer state's scale array), made on amp's first call with it.

    None where `scaler` takes no weak reference (a NumPy scalar): nothing to tell the update.
    """
    global _scaled_any
    _scaled_any = True
    use = _USES.get(id(scaler))
    if use is None or use.scaler() is not scaler:
        try:
            use = ScaleUse(scaler)
        except TypeError:
            return None
        _USES[id(scaler)] = use
        while len(_USES) > _KEPT:
            _USES.popitem(last=False)
    return use


def note_live_call(live: Any) -> None:
    """amp scaled a call by `live`, a transformation's live scale: the next update knows whose scale it was."""
    global _scaled_any
    _scaled_any = True
    _lives_since_update[id(live)] = weakref.ref(live)


# The live scales amp calls read since the last update ran, by id (weakly: a
# transformation dropped with its optimizer is not kept alive here).
_lives_since_update: dict[int, weakref.ref] = {}


def read_since_update(live: Any) -> bool:
    """Whether an amp call read `live` since the last update ran."""
    return any(ref() is live for ref in _lives_since_update.values())


def _scaled_by_another_live_scale(live: Any) -> bool:
    """Whether amp calls since the last update read some other transformation's live scale, and not `live`."""
    lives = [ref() for ref in _lives_since_update.values()]
    _lives_since_update.clear()
    read = [other for other in lives if other is not None]
    return bool(read) and all(other is not live for other in read)


def check_live_use(live: Any) -> None:
    """Warn where the gradients an update given to amp as ``loss_scale=tx`` receives were scaled by another's scale."""
    if _scaled_by_another_live_scale(live):
        _warn_another_live_scale()


def _warn_another_live_scale() -> None:
    warnings.warn(
        "jaxamp.loss_scaling's update receives gradients that amp scaled by another loss_scaling "
        "transformation's live scale (amp was given loss_scale=<that transformation>, not this one): "
        "this update's scale steered no backward pass, yet moves by overflows at the other's, and the "
        "other's cells follow a state they do not update (where optax.MultiSteps holds the other, amp "
        "handed back zeros and flagged the other, so this update applies them as a step). Give each "
        "loss the transformation that applies its gradients: jaxamp.amp(loss, compute_dtype='f16', loss_scale=tx).",
        UserWarning,
        stacklevel=4,
    )


def _trace_id(x: Any) -> int | None:
    trace = getattr(x, "_trace", None) if isinstance(x, jax.core.Tracer) else None
    return None if trace is None else id(trace)


def check_scale_use(scaler: Any, live: Any = None) -> None:
    """Warn where the gradients `loss_scaling`'s update receives were not scaled by `scaler`, its own scale.

    Where amp was given `scaler`: whether a gradient was taken of what amp
    made. Where it was not: whether amp was given another scale in the same
    program (a stale or foreign state, or another transformation's live
    scale: `live` is this one's), or, with no record at all, none.
    """
    by_another_live_scale = _scaled_by_another_live_scale(live)
    use = _USES.pop(id(scaler), None)
    if use is not None and use.scaler() is scaler:
        if not use.differentiated:
            _warn_never_differentiated()
        return
    if by_another_live_scale:
        _warn_another_live_scale()
        return
    here = _trace_id(scaler)
    if any(u.scaler() is not None and u.trace == here for u in _USES.values()):
        warnings.warn(
            "jaxamp.loss_scaling's update reads a loss scale that no amp call was given, while amp was "
            "given another scale in this step: the gradients were scaled by that one. amp's loss_scale "
            "is an older state of this optimizer (an amp'd function built once and called again: make "
            "it in the step, jaxamp.amp(loss, compute_dtype='f16', loss_scale=opt_state), with the "
            "state of this step) or another optimizer's state (give each loss its own optimizer's).",
            UserWarning,
            stacklevel=3,
        )
    elif not _scaled_any:
        warnings.warn(
            "jaxamp.loss_scaling's update reads a loss scale that no jaxamp.amp call was given: the "
            "gradients were not loss-scaled, and float16 gradients below 6e-8 flushed to zero. Pass "
            "the optimizer state to amp: jax.grad(jaxamp.amp(loss, compute_dtype='f16', "
            "loss_scale=opt_state)). (Where the script scales and unscales the loss itself, filter "
            "this warning.)",
            UserWarning,
            stacklevel=3,
        )


def _warn_never_differentiated() -> None:
    warnings.warn(
        "jaxamp.loss_scaling's update reads a loss scale that jaxamp.amp was given (loss_scale=), but no "
        "gradient was taken of the function amp made: its scale reached no backward pass. Where that "
        "function takes its gradient itself (amp(jax.grad(loss)), amp of an eqx.filter_value_and_grad-"
        "decorated loss), the backward pass ran in half precision unscaled, and small gradients flushed "
        "to zero. Put amp inside the gradient: jax.value_and_grad(jaxamp.amp(loss, compute_dtype='f16', "
        "loss_scale=opt_state)).",
        UserWarning,
        stacklevel=4,
    )
