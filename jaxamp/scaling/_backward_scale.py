"""The loss scale of the backward pass being traced, for the amp calls inside it.

A loss scaler multiplies the loss (or its cotangent) by a scale, so every
cotangent of the program it differentiates carries that factor. Most of amp
is linear in it, but a rule that keeps cotangent statistics from one step to
the next (fp8's delayed amax histories) must know it, or a scale that grows
between steps saturates the next cotangent. Whatever scales a loss sets it
here (`scaling_backward`) while the loss is traced; amp reads it
(`backward_scale`) and hands it to the program it rewrites
(`AmpOptions.run`'s ``cotangent_scale``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

__all__ = ["backward_scale", "scaling_backward"]

_SCALE: contextvars.ContextVar[Any] = contextvars.ContextVar("jaxamp_backward_scale", default=None)


def backward_scale() -> Any:
    """The factor the enclosing scalers multiply the traced loss's cotangent by (a scalar), or None."""
    return _SCALE.get()


@contextlib.contextmanager
def scaling_backward(scale: Any) -> Iterator[None]:
    """Within: the loss being traced is differentiated `scale` times larger (on top of any enclosing scaler)."""
    outer = _SCALE.get()
    token = _SCALE.set(scale if outer is None else outer * scale)
    try:
        yield
    finally:
        _SCALE.reset(token)
