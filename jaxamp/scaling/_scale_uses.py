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
update (`warn_if_never_differentiated`) says so where none was marked.
"""

from __future__ import annotations

import collections
import warnings
import weakref
from typing import Any


class ScaleUse:
    """amp's calls given one scale array: whether the backward pass of any of them was traced."""

    __slots__ = ("scaler", "differentiated")

    def __init__(self, scaler: Any):
        # Weakly: a tracer kept past its trace is a leak (`jax.checking_leaks`);
        # a dead one tells a reused id from the array recorded.
        self.scaler = weakref.ref(scaler)
        self.differentiated = False


# The latest scales amp was given, by the id of the state's array: a scale
# whose update is never called here (it runs in another trace) is dropped in turn.
_USES: collections.OrderedDict[int, ScaleUse] = collections.OrderedDict()
_KEPT = 64


def record_use(scaler: Any) -> ScaleUse | None:
    """The record of `scaler` (the optimizer state's scale array), made on amp's first call with it.

    None where `scaler` takes no weak reference (a NumPy scalar): nothing to tell the update.
    """
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


def warn_if_never_differentiated(scaler: Any) -> None:
    """Warn where amp was given `scaler` and no gradient was taken of the function it made."""
    use = _USES.pop(id(scaler), None)
    if use is None or use.scaler() is not scaler or use.differentiated:
        return
    warnings.warn(
        "jaxamp.loss_scaling's update reads a loss scale that jaxamp.amp was given (loss_scale=), but no "
        "gradient was taken of the function amp made: its scale reached no backward pass. Where that "
        "function takes its gradient itself (amp(jax.grad(loss)), amp of an eqx.filter_value_and_grad-"
        "decorated loss), the backward pass ran in half precision unscaled, and small gradients flushed "
        "to zero. Put amp inside the gradient: jax.value_and_grad(jaxamp.amp(loss, compute_dtype='f16', "
        "loss_scale=opt_state)).",
        UserWarning,
        stacklevel=3,
    )
