"""float8 matmuls: ``amp(fn, compute_dtype="fp8")`` or ``compute_dtype=Fp8Recipe(...)``.

`Fp8Recipe` chooses the scaling recipe (tensorwise, rowwise, mxfp8, blockwise,
delayed) and which matmuls stay in bfloat16. The delayed recipe's amax
histories are an `Fp8State`, made once by `init_fp8_state` and threaded
through the train step. `Fp8HigherOrderError` is raised where a derivative of
an already traced derivative would move a float8 residual. The guide is
docs/float8.md.

The modules behind these names (quantisers, scaling schemes, the per-device
products, the differentiable matmul) are internal.
"""

from ._differentiable import Fp8HigherOrderError
from ._recipe import Fp8Recipe
from ._state import Fp8State, init_fp8_state

__all__ = ["Fp8HigherOrderError", "Fp8Recipe", "Fp8State", "init_fp8_state"]
