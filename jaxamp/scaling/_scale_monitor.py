"""`LossScaleMonitor`: warns, once, when a float16 run's loss scale is unhealthy.

Two failures look alike in a loss curve that stops moving: the scale has
collapsed to its floor and steps still overflow (no scale helps: the values
themselves leave float16's range, or the data holds inf/NaN), or most recent
steps are skipped. The window of recent steps lives here, on the host, and not
in the optimizer state: a field added to `LossScaleState` would break every
checkpoint saved without it. Only totals are read from the state
(``skipped_steps``), so a restored run's monitor simply starts a new window.
"""

from __future__ import annotations

import collections
import warnings
from typing import Any

import jax.numpy as jnp
import numpy as np

from ._loss_scaling import LossScaleState, find_scale_state
from ._metrics import _is_metrics, host_metrics, record_scale_metrics

__all__ = ["LossScaleMonitor"]

_WHAT_TO_DO = (
    "Check the data for inf/NaN (jaxamp.find_nonfinite on a failing batch), lower the learning "
    "rate, or train in bfloat16 (compute_dtype='bf16'), whose range needs no loss scale."
)


class LossScaleMonitor:
    """A host-side health check of the loss scale, fed once per step.

    ``monitor.update(opt_state)`` (or the `scale_metrics` dict a jitted step
    returns) after each step warns once, with the numbers and what to do:

    * a step overflowed with the scale at its floor (``min_scaler``): no
      smaller scale is left to try;
    * more than ``max_skipped_fraction`` of the last `window` steps were skipped.

    With ``record=True`` each update also sends the metrics to
    `jax.monitoring`'s listeners (`record_scale_metrics`, tagged with the
    step): where a framework logs through them (Tunix's metrics logger, its
    TensorBoard), one ``monitor.update(opt_state, step)`` in its step hook
    both logs the scale and warns.

    Args:
        window: how many recent steps the skipped fraction is taken over.
        max_skipped_fraction: the fraction of them that may be skipped.
        min_scale: the scale's floor; by default the state's ``min_scaler``,
            or ``1.0`` (the default floor) when fed a metrics dict.
        record: also record each update's metrics as `jax.monitoring` events.

    Raises:
        ValueError: `window` below 1, or `max_skipped_fraction` outside ``[0, 1)``.
    """

    def __init__(
        self,
        window: int = 100,
        max_skipped_fraction: float = 0.5,
        min_scale: float | None = None,
        record: bool = False,
    ):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"LossScaleMonitor window must be an int >= 1, got {window!r}.")
        if not 0.0 <= max_skipped_fraction < 1.0:
            raise ValueError(f"LossScaleMonitor max_skipped_fraction must be in [0, 1), got {max_skipped_fraction!r}.")
        self.window = window
        self.max_skipped_fraction = max_skipped_fraction
        self.min_scale = min_scale
        self.record = bool(record)
        self._seen: collections.deque[tuple[int, int]] = collections.deque()  # (step, skipped_steps)
        self._calls = 0
        self._last_scale: float | None = None
        self.warned_floor = False
        self.warned_skipping = False

    def update(self, state_or_metrics: Any, step: int | None = None) -> dict[str, Any]:
        """Read one step's metrics, warn where they are unhealthy, and return them as Python numbers.

        Args:
            state_or_metrics: what `scale_metrics` takes, or the dict it returned.
            step: the training step, where the monitor is not fed every step
                (then the window counts steps, not calls); by default, calls.
                A step given again (a hook run per micro-batch) is read, not
                counted, recorded or warned about twice.

        Returns:
            The metrics as Python numbers (`scale_metrics`'s keys), for the logger.
        """
        values = host_metrics(state_or_metrics, "LossScaleMonitor.update")
        self._calls += 1
        step = self._calls if step is None else int(step)
        if self._seen and step == self._seen[-1][0]:
            return values  # this step was seen already (a hook called per micro-batch)
        if self.record:
            record_scale_metrics(values, step=step)
        skipped = values["skipped_steps"]
        # The scale this step ran with is the one the previous update saw.
        ran_with, self._last_scale = self._last_scale, values["loss_scale"]
        previous = self._seen[-1][1] if self._seen else None
        self._seen.append((step, skipped))
        # Keep the oldest entry that still spans `window` steps.
        while len(self._seen) >= 2 and step - self._seen[1][0] >= self.window:
            self._seen.popleft()
        if "last_step_finite" in values:
            overflowed = not values["last_step_finite"]
        else:
            overflowed = previous is not None and skipped != previous
        at_floor = ran_with is not None and ran_with <= self._floor(state_or_metrics)
        if not self.warned_floor and overflowed and at_floor:
            self.warned_floor = True
            warnings.warn(
                f"jaxamp loss scaling: the loss scale is at its floor ({values['loss_scale']}) and step "
                f"{step} still overflowed ({skipped} steps skipped in all): no smaller scale is left, the "
                f"loss or its gradients leave float16's range unscaled. {_WHAT_TO_DO}",
                UserWarning,
                stacklevel=2,
            )
        first_step, first_skipped = self._seen[0]
        span = step - first_step
        mostly_skipped = span >= self.window and skipped - first_skipped > self.max_skipped_fraction * span
        if not self.warned_skipping and mostly_skipped:
            self.warned_skipping = True
            warnings.warn(
                f"jaxamp loss scaling: {skipped - first_skipped} of the last {span} steps were skipped "
                f"(non-finite gradients; {skipped} in all, scale {values['loss_scale']}): training "
                f"hardly moves. A healthy run skips a few steps while the scale settles. {_WHAT_TO_DO}",
                UserWarning,
                stacklevel=2,
            )
        return values

    def _floor(self, state_or_metrics: Any) -> float:
        if self.min_scale is not None:
            return float(self.min_scale)
        if _is_metrics(state_or_metrics):
            return 1.0
        holder = find_scale_state(state_or_metrics, "LossScaleMonitor.update's state")
        scaler = holder.scaler_state if isinstance(holder, LossScaleState) else holder
        # `jnp.asarray` reads an `nnx.Optimizer`'s wrapped leaf; replicas agree.
        return float(np.asarray(jnp.asarray(scaler.min_scaler)).reshape(-1)[0])
