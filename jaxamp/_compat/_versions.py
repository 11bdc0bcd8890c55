"""What differs between the supported JAX releases, and the error for an internal that moved.

The differences are detected once, at import, as the named flags below (each
says the release that brought it); the accessors of the other `_compat`
modules branch on them, and raise `JaxInternalsChanged` when an internal they
read has moved.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import jax

__all__ = [
    "BWD_RETURNS_LOGS",
    "HAS_FLATTREE",
    "HAS_INLINE_ENUM",
    "JaxInternalsChanged",
]

# --- version flags: what changed between supported JAX releases -------------


# 0.11: scan stores its operand layout as a `FlatTree` (``ft_in``: constants,
# carry, xs) instead of ``num_consts``/``num_carry``; shard_map's sub-function
# returns a `jax._src.flattree` tree instead of `tree_util.FlatTree`.
HAS_FLATTREE = importlib.util.find_spec("jax._src.flattree") is not None
# 0.11: custom_vjp backward rules may return logs, so bwd returns (cts, logs).
BWD_RETURNS_LOGS = hasattr(jax.custom_vjp, "defvjp_with_logs")
# 0.11: ``jit(inline=True)`` means "inline at lowering"; inlining while tracing
# (what jax.numpy asks for) is ``inline=Inline.JAX_EARLY``. 0.10 has only the bool.
HAS_INLINE_ENUM = hasattr(jax, "Inline")


class JaxInternalsChanged(RuntimeError):
    """A JAX internal amp relies on has moved in this JAX release.

    Raised only by this module's accessors, never for errors in user code or
    in policy rules, so the evaluation loop can fall back (with a warning) for
    exactly this case and let everything else propagate.
    """


# What moving an internal looks like from the outside.
_DRIFT_ERRORS: tuple[type[BaseException], ...] = (ImportError, AttributeError, KeyError, TypeError)


def _internal(fn: Callable) -> Callable:
    # For accessors that read JAX internals and call no user code: any of the
    # errors above raised inside them can only mean the internals moved.
    @functools.wraps(fn)
    def accessor(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except _DRIFT_ERRORS as err:
            raise JaxInternalsChanged(f"{fn.__name__}: {type(err).__name__}: {err}") from err

    return accessor
