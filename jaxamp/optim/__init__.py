"""Low-precision parameters and optimizer state, as optax transformations.

`low_precision_params` wraps an optimizer for parameters stored in bfloat16
(stochastic rounding or a Kahan compensation buffer, so small updates are not
lost); `cast_state` stores any optimizer's state in bfloat16. With both, AdamW
holds 6 bytes per parameter (8 with Kahan) instead of 12. The guide is
docs/optimizer_precision.md.
"""

from ._params import LowPrecisionParamsState, low_precision_params
from ._rounding import stochastic_round
from ._state import CastStateState, cast_state

__all__ = [
    "CastStateState",
    "LowPrecisionParamsState",
    "cast_state",
    "low_precision_params",
    "stochastic_round",
]
