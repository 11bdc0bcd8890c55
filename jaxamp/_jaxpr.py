"""Walking jaxprs: the matmul primitives and the bodies an equation carries.

Shared by the transform's analyses (`jaxamp._tail`), fp8 mode and the
diagnostics, below all of them so none imports another to walk a program.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from . import _compat
from ._rules import _COMPUTE_PRIMITIVES

__all__ = ["MATMUL_NAMES", "bodies"]

# The primitives amp runs in the compute dtype: matmuls, convolutions and the
# grouped matmul of mixture-of-experts layers.
MATMUL_NAMES = frozenset(_COMPUTE_PRIMITIVES)


def bodies(eqn: Any) -> Iterator[Any]:
    """The jaxprs an equation carries in its parameters, in parameter order."""
    for value in eqn.params.values():
        for body in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(body, (_compat.Jaxpr, _compat.ClosedJaxpr)):
                yield body
