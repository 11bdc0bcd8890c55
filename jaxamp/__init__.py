"""jaxamp: automatic mixed precision for JAX.

The top level holds what a first training step needs: `amp` (and
`amp_module`, for flax nnx models a framework calls itself) and its policy
table (`default_amp_policy`, the ``use_*`` rules, `amp_stop`), the loss
scalers for float16 (`loss_scaling`, the optax wrapper whose state holds the
scale; jaxamp's `DynamicScalerState`, jmp's loss scales, PyTorch's
`GradScaler`), jmp's `Policy` helpers, and the three diagnostics `explain`,
`find_nonfinite` and `compare`. Feature families live in their
namespaces, each with its guide under docs/:

- `jaxamp.fp8`: float8 recipes and the delayed recipe's state;
- `jaxamp.scaling`: every loss-scaling name, the optax wrappers included;
- `jaxamp.diagnostics`: the diagnostics and their report types;
- `jaxamp.monitoring`: the numerics monitor;
- `jaxamp.policies`: policies and dtype helpers;
- `jaxamp.optim`: low-precision parameters and optimizer state;
- `jaxamp.sharding`: mesh and partitioning helpers.
"""

import warnings as _warnings  # private: dir(jaxamp) lists the API only

# The namespaces, bound as attributes so that `import jaxamp` is enough to
# write `jaxamp.fp8.Fp8Recipe`.
from . import diagnostics, fp8, monitoring, optim, policies, scaling, sharding  # noqa: F401
from ._amp import amp
from ._amp_module import amp_module
from .diagnostics import compare, explain, find_nonfinite
from .policies import Policy, cast_to_full, cast_to_half, get_policy, half_dtype
from .scaling import (
    DynamicLossScale,
    DynamicLossScaler,
    DynamicScalerState,
    GradScaler,
    LossScale,
    LossScaleState,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    dynamic_scale_grad,
    dynamic_scale_value_and_grad,
    loss_scaling,
    select_tree,
)
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

# The namespaces are not in `__all__`: `from jaxamp import *` brings the names,
# and the namespaces are one attribute away. The groups are the module docstring's.
__all__ = [
    "DynamicLossScale",
    "DynamicLossScaler",
    "DynamicScalerState",
    "GradScaler",
    "LossScaleState",
    "LossScale",
    "NoOpLossScale",
    "Policy",
    "StaticLossScale",
    "all_finite",
    "amp",
    "amp_module",
    "amp_stop",
    "cast_to_full",
    "cast_to_half",
    "compare",
    "default_amp_policy",
    "dynamic_scale_grad",
    "dynamic_scale_value_and_grad",
    "explain",
    "find_nonfinite",
    "get_policy",
    "half_dtype",
    "loss_scaling",
    "select_tree",
    "use_compute_precision",
    "use_current_precision",
    "use_full_range_precision",
    "use_normalisation_precision",
    "use_original_precision",
    "use_precision",
    "use_widest_precision",
]

# Names that were at the top level in 0.1.0 and now live in a namespace: the old
# spelling still works, for one release, with a DeprecationWarning naming the
# new place (equinox's and optax's way of moving names). Not in `dir(jaxamp)`,
# so completion offers only the current spellings.
_MOVED = {
    "Fp8HigherOrderError": "fp8",
    "Fp8Recipe": "fp8",
    "Fp8State": "fp8",
    "init_fp8_state": "fp8",
    "MonitorRecorder": "monitoring",
    "MonitorStats": "monitoring",
    "PolicySuggestion": "monitoring",
    "monitor": "monitoring",
    "monitor_report": "monitoring",
    "suggest_policy": "monitoring",
    "AmpReport": "diagnostics",
    "AmpRow": "diagnostics",
    "ComparisonReport": "diagnostics",
    "GradientError": "diagnostics",
    "NonFiniteReport": "diagnostics",
    "ScopeError": "diagnostics",
    "SkipNonFiniteState": "scaling",
    "apply_if_finite_updates": "scaling",
    "dynamic_scale_tx": "scaling",
    "register_empty_pytree": "scaling",
    "skip_nonfinite_updates": "scaling",
    "warn_if_not_floating": "scaling",
    "cast_floating": "policies",
    "parse_dtype": "policies",
}


def __getattr__(name: str) -> object:
    # Called only for names this module does not define: the moved ones.
    namespace = _MOVED.get(name)
    if namespace is None:
        raise AttributeError(f"module 'jaxamp' has no attribute {name!r}")
    _warnings.warn(
        f"jaxamp.{name} has moved to jaxamp.{namespace}.{name}; the old spelling is deprecated "
        "and will be removed in the next release.",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(globals()[namespace], name)
