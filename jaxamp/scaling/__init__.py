"""Loss scaling for float16: four APIs that share one finiteness check (docs/loss_scaling.md).

- jaxamp's own scaler: `DynamicScalerState` with `dynamic_scale_value_and_grad`
  and `dynamic_scale_grad` (`DynamicLossScaler` is another name for the state),
  and `dynamic_scale_tx`, the transform they are built on. It skips a non-finite
  step, or recomputes it with a smaller scale (``redo_on_nan``).
- DeepMind jmp's loss scales: `DynamicLossScale`, `StaticLossScale`,
  `NoOpLossScale` (the `LossScale` union), with jmp's `register_empty_pytree` and
  `warn_if_not_floating`.
- `GradScaler`: PyTorch's ``torch.amp.GradScaler``, functional and jit-able.
- `loss_scaling`: an optax wrapper whose state (`LossScaleState`) holds the
  scale, for ``amp(..., loss_scale=opt_state)`` to scale inside the gradient:
  float16 as bfloat16 plus two lines.

`all_finite` says whether a pytree is free of inf and NaN, on every device,
and `select_tree` takes one of two pytrees by it (jmp's pair).
`skip_nonfinite_updates` wraps an optax optimizer so that a non-finite step
changes nothing (its state is a `SkipNonFiniteState`), and
`apply_if_finite_updates` applies the updates on a finite step and leaves the
parameters' bits alone on a skipped one.

`scale_metrics` reads the scale, the skipped steps and whether the last step
was finite out of any state amp's ``loss_scale=`` takes, as a flat dict for a
logger; `record_scale_metrics` sends them to `jax.monitoring`'s listeners, and
`LossScaleMonitor` warns when a run's scale collapses or most steps are
skipped. `update_scale` is the scale's step rule for a script whose optimizer
is not optax's.
`with_loss_scaling_state` and `without_loss_scaling_state` convert an
optimizer state (anywhere in a training state or checkpoint tree) between a
plain optimizer's and `loss_scaling`'s, so a checkpoint written without loss
scaling resumes with it, and back; `restore_across_loss_scaling` puts them
around a framework's restore function.

`loss_scaling`, the scalers, the jmp loss scales, `all_finite` and `select_tree` are also at
the top level (`jaxamp.DynamicScalerState`...). The guide is
docs/loss_scaling.md.
"""

from ._convert import restore_across_loss_scaling, with_loss_scaling_state, without_loss_scaling_state
from ._dynamic_scaler import (
    DynamicLossScaler,
    DynamicScalerState,
    dynamic_scale_grad,
    dynamic_scale_tx,
    dynamic_scale_value_and_grad,
)
from ._finite import all_finite, select_tree
from ._grad_scaler import GradScaler
from ._loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    register_empty_pytree,
    warn_if_not_floating,
)
from ._loss_scaling import LossScaleState, loss_scaling, loss_scaling_factory
from ._metrics import record_scale_metrics, scale_metrics
from ._optax import SkipNonFiniteState, apply_if_finite_updates, skip_nonfinite_updates
from ._scale_monitor import LossScaleMonitor
from ._update_scale import update_scale

__all__ = [
    "DynamicLossScale",
    "DynamicLossScaler",
    "DynamicScalerState",
    "GradScaler",
    "LossScale",
    "LossScaleMonitor",
    "LossScaleState",
    "NoOpLossScale",
    "SkipNonFiniteState",
    "StaticLossScale",
    "all_finite",
    "apply_if_finite_updates",
    "dynamic_scale_grad",
    "dynamic_scale_tx",
    "dynamic_scale_value_and_grad",
    "loss_scaling",
    "loss_scaling_factory",
    "record_scale_metrics",
    "register_empty_pytree",
    "restore_across_loss_scaling",
    "scale_metrics",
    "select_tree",
    "skip_nonfinite_updates",
    "update_scale",
    "warn_if_not_floating",
    "with_loss_scaling_state",
    "without_loss_scaling_state",
]
