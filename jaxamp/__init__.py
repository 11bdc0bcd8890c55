"""jaxamp: automatic mixed precision for JAX.

`amp` is the transform; the rest are loss scaling, precision policies, diagnostics
and (in `jaxamp.sharding`) multi-device helpers.
"""

from ._dtypes import cast_floating, half_dtype, parse_dtype

__all__ = [
    "cast_floating",
    "half_dtype",
    "parse_dtype",
]

# Policies
from .policies._policy import Policy, cast_to_full, cast_to_half, get_policy

__all__ += ["Policy", "cast_to_full", "cast_to_half", "get_policy"]

# The transform
from ._amp import amp, init_fp8_state
from .fp8._differentiable import Fp8HigherOrderError
from .fp8._recipe import Fp8Recipe
from .fp8._state import Fp8State
from .transform._rules import (
    default_amp_policy,
    use_compute_precision,
    use_current_precision,
    use_full_range_precision,
    use_normalisation_precision,
    use_original_precision,
    use_precision,
    use_widest_precision,
)
from .transform._scopes import amp_stop

__all__ += [
    "Fp8HigherOrderError",
    "Fp8Recipe",
    "Fp8State",
    "amp",
    "amp_stop",
    "default_amp_policy",
    "init_fp8_state",
    "use_compute_precision",
    "use_current_precision",
    "use_full_range_precision",
    "use_normalisation_precision",
    "use_original_precision",
    "use_precision",
    "use_widest_precision",
]

# Loss scaling
from .scaling._dynamic_scaler import (
    DynamicLossScaler,
    DynamicScalerState,
    dynamic_scale_grad,
    dynamic_scale_tx,
    dynamic_scale_value_and_grad,
)
from .scaling._finite import all_finite, select_tree
from .scaling._grad_scaler import GradScaler
from .scaling._loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    register_empty_pytree,
    warn_if_not_floating,
)
from .scaling._loss_scaling import LossScaleState, loss_scaling
from .scaling._optax import (
    SkipNonFiniteState,
    apply_if_finite_updates,
    skip_nonfinite_updates,
)

__all__ += [
    "DynamicLossScale",
    "DynamicLossScaler",
    "DynamicScalerState",
    "GradScaler",
    "LossScale",
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
    "register_empty_pytree",
    "select_tree",
    "skip_nonfinite_updates",
    "warn_if_not_floating",
]

# Diagnostics
from .diagnostics._compare import ComparisonReport, GradientError, ScopeError, compare
from .diagnostics._explain import (
    AmpReport,
    AmpRow,
    NonFiniteReport,
    explain,
    find_nonfinite,
)

__all__ += [
    "AmpReport",
    "AmpRow",
    "ComparisonReport",
    "GradientError",
    "NonFiniteReport",
    "ScopeError",
    "compare",
    "explain",
    "find_nonfinite",
]

# The numerics monitor
from .monitoring import (
    MonitorRecorder,
    MonitorStats,
    PolicySuggestion,
    monitor,
    monitor_report,
    suggest_policy,
)

__all__ += ["MonitorRecorder", "MonitorStats", "PolicySuggestion", "monitor", "monitor_report", "suggest_policy"]

from . import monitoring, optim, sharding  # noqa: E402  (jaxamp.monitoring, jaxamp.optim, jaxamp.sharding after `import jaxamp`)

__all__ += ["monitoring", "optim", "sharding"]
