"""Every JAX internal jaxamp touches, and every difference between JAX versions.

JAX has no public API for much of what the interpreter does (re-emitting
equations with their source information, tracing bodies of higher-order
primitives in the *current* context, rebuilding the sub-functions of custom
derivative and shard_map primitives), so it lives here, and only here: every
``jax._src`` import of the package is in this subpackage
(tests/test_architecture.py), and a JAX upgrade should touch nothing else.
By concern:

- `_versions`: the differences between supported releases, detected once at
  import as named flags, and `JaxInternalsChanged`, which the accessors raise
  when an internal they read has moved (the only error amp turns into a
  fallback);
- `_tracing`: jaxpr types and primitives, tracing, equations' sources and
  scopes, higher-order primitives' parameters, custom derivatives;
- `_sharding`: meshes, manual axes and the axes values vary over;
- `_tables`: rules in JAX's global tables that fp8 mode installs on first use
  (importing jaxamp changes none: tests/test_import_side_effects.py);
- `_nnx`: the flax NNX adapter, and every difference between flax releases
  (flax is imported only by the program).

Callers say ``_compat.name``: every public name of these modules is here.

Supported: JAX 0.10.x through 0.12.x (see ``pyproject.toml``).
"""

from . import _nnx, _sharding, _tables, _tracing, _versions
from ._nnx import *  # noqa: F403
from ._sharding import *  # noqa: F403
from ._tables import *  # noqa: F403
from ._tracing import *  # noqa: F403
from ._versions import *  # noqa: F403

__all__ = [*_versions.__all__, *_tracing.__all__, *_sharding.__all__, *_tables.__all__, *_nnx.__all__]
