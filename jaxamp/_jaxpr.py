"""Walking jaxprs: the matmul primitives and the bodies an equation carries.

Shared by the transform's analyses (`jaxamp._tail`), fp8 mode and the
diagnostics, below all of them so none imports another to walk a program.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from . import _compat
from ._rules import _COMPUTE_PRIMITIVES

__all__ = ["MATMUL_NAMES", "bodies", "matmuls_in"]

# The primitives amp runs in the compute dtype: matmuls, convolutions and the
# grouped matmul of mixture-of-experts layers.
MATMUL_NAMES = frozenset(_COMPUTE_PRIMITIVES)


def bodies(eqn: Any) -> Iterator[Any]:
    """The jaxprs an equation carries in its parameters, in parameter order."""
    for value in eqn.params.values():
        for body in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(body, (_compat.Jaxpr, _compat.ClosedJaxpr)):
                yield body


def matmuls_in(jaxpr: Any, *, enter: Callable[[Any], bool] | None = None) -> Iterator[Any]:
    """The matmul equations of `jaxpr` in program order, those of nested bodies included.

    A body (a jit'd function, a loop body, a cond's branches in order, a
    custom rule's primal, a Pallas kernel) is walked where its equation stands.

    Args:
        jaxpr: an open or closed jaxpr.
        enter: which equations' bodies to walk (all when None).
    """
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        if eqn.primitive.name in MATMUL_NAMES:
            yield eqn
        if enter is not None and not enter(eqn):
            continue
        for body in bodies(eqn):
            yield from matmuls_in(body, enter=enter)
