"""The loss scale as metrics: a flat dict a logger takes, and `jax.monitoring` events.

A framework that owns the training loop (Tunix, MaxText, a flax ``TrainState``
script) logs a dict of scalars per step; the scale, how many steps were skipped
and whether the last one was are three more entries in it. `scale_metrics`
reads them from whatever ``amp(loss_scale=...)`` accepts, inside `jax.jit` or
out. `record_scale_metrics` hands them to `jax.monitoring`'s listeners, on the
host, for code that collects metrics there rather than from the step's outputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._loss_scaling import LossScaleState, find_scale_state

__all__ = ["METRIC_NAMES", "SKIPPED_STEP_EVENT", "host_metrics", "record_scale_metrics", "scale_metrics"]

METRIC_NAMES = ("loss_scale", "skipped_steps", "last_step_finite")

# `jax.monitoring` names its own events as paths ("/jax/compilation_cache/...").
EVENT_PREFIX = "/jaxamp/loss_scaling/"
SKIPPED_STEP_EVENT = EVENT_PREFIX + "skipped_step"


def scale_metrics(state: Any, finite: Any = None) -> dict[str, jax.Array]:
    """The loss scale, the skipped steps and whether the last step was finite, as a flat dict.

    For a logger (a print, tensorboardX's ``add_scalar``, Tunix's or MaxText's
    metrics dict): ``metrics | jaxamp.scaling.scale_metrics(opt_state)``. Works
    inside `jax.jit` (the values are arrays, fetched with the step's other
    outputs) and out; under `jax.pmap` each value has the replicas' axis.

    Args:
        state: anything ``amp(loss_scale=...)`` takes as a state: an optimizer
            state holding one `LossScaleState` (inside `optax.chain`,
            `optax.MultiSteps`, `optax.inject_hyperparams`, a flax
            ``TrainState``, an ``nnx.Optimizer``'s ``opt_state``...), a
            `LossScaleState` or a `DynamicScalerState`.
        finite: whether the last step was finite (a boolean scalar), for a
            bare `DynamicScalerState`, which does not keep it (the ``finite``
            that `update_scale` returns). A `LossScaleState` keeps its own.

    Returns:
        ``{"loss_scale": float32, "skipped_steps": int32}``, plus
        ``"last_step_finite"`` (bool) where it is known: PyTorch's
        ``scaler.get_scale()``, Keras' ``optimizer.dynamic_scale`` and flax's
        ``dynamic_scale.scale`` are ``"loss_scale"``; ``"skipped_steps"``
        counts every non-finite step since the scale was made.

    Raises:
        ValueError: `state` holds no loss scale, or several.
    """
    holder = find_scale_state(state, "scale_metrics's state")
    scaler = holder.scaler_state if isinstance(holder, LossScaleState) else holder
    # `jnp.asarray` also reads the `nnx.Optimizer`'s wrapped leaves.
    metrics = {
        "loss_scale": jnp.asarray(scaler.scaler, jnp.float32),
        "skipped_steps": jnp.asarray(scaler.total_resets, jnp.int32),
    }
    if finite is None and isinstance(holder, LossScaleState):
        finite = holder.last_finite
    if finite is not None:
        metrics["last_step_finite"] = jnp.asarray(finite, jnp.bool_)
    return metrics


def _is_metrics(x: Any) -> bool:
    # The step's whole metrics dict may come back: its other entries are not read.
    return isinstance(x, Mapping) and "loss_scale" in x and "skipped_steps" in x


def host_metrics(state_or_metrics: Any, what: str) -> dict[str, Any]:
    """`scale_metrics` as Python numbers, from a state or from the dict it made (fetched from a step).

    Replicated values (a `jax.pmap` state) give their first replica's:
    every replica takes the same decision.

    Raises:
        TypeError: a traced value: this reads on the host, outside `jax.jit`.
    """
    metrics = state_or_metrics if _is_metrics(state_or_metrics) else scale_metrics(state_or_metrics)
    if any(isinstance(v, jax.core.Tracer) for v in jax.tree_util.tree_leaves(metrics)):
        raise TypeError(
            f"{what} reads the loss scale on the host and got traced values: call it outside "
            "jax.jit, on the state or the jaxamp.scaling.scale_metrics(...) dict the step returns."
        )
    kinds = {"loss_scale": float, "skipped_steps": int, "last_step_finite": bool}
    # In one order: a jitted step hands its dict back with the keys sorted.
    return {name: kinds[name](np.asarray(metrics[name]).reshape(-1)[0]) for name in METRIC_NAMES if name in metrics}


def record_scale_metrics(state_or_metrics: Any, **tags: str | int) -> dict[str, Any]:
    """Record the loss scale's metrics as `jax.monitoring` events, on the host.

    Each metric goes to `jax.monitoring.record_scalar` as
    ``/jaxamp/loss_scaling/<name>`` (``last_step_finite`` as 0 or 1), and a
    skipped step also records the event ``/jaxamp/loss_scaling/skipped_step``
    (`jax.monitoring.record_event`): every listener registered with
    ``jax.monitoring.register_scalar_listener`` or
    ``register_event_listener`` receives them, with `tags`.

    Args:
        state_or_metrics: what `scale_metrics` takes, or the dict it returned
            (fetched from a jitted step; other entries of it are left alone).
        **tags: passed to the listeners (``step=i``); strings or ints, in the
            same order every call, as `jax.monitoring` asks.

    Returns:
        The metrics as Python numbers.

    Raises:
        TypeError: called under `jax.jit`: listeners run on the host.
        ValueError: as `scale_metrics`.
    """
    values = host_metrics(state_or_metrics, "jaxamp.scaling.record_scale_metrics")
    for name, value in values.items():
        jax.monitoring.record_scalar(EVENT_PREFIX + name, int(value) if isinstance(value, bool) else value, **tags)
    if values.get("last_step_finite") is False:
        jax.monitoring.record_event(SKIPPED_STEP_EVENT, **tags)
    return values
