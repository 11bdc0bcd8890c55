"""JAX's own catalogues of lax operations and primitives.

For the sweeps of tests/test_primitive_sweep.py and tests/test_default_table.py.

Read from JAX internals that ship with it (its own tests' catalogue), which
only the tests use: jaxamp's compat layer keeps what the package itself needs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from jaxamp import _compat

__all__ = ["CatalogueOp", "lax_op_catalogue", "lax_primitives_by_name"]


def lax_primitives_by_name() -> dict[str, _compat.Primitive]:
    """Every primitive of JAX's lax package (``jax._src.lax`` and its subpackages), by name.

    Several (collectives, linear algebra, special functions, control flow) are
    not re-exported from `jax.lax`.
    """
    return _compat.primitives_in(_compat.lax_modules())


class CatalogueOp(NamedTuple):
    """One operation of JAX's own catalogue of lax operations (`lax_op_catalogue`)."""

    name: str  # the jax.lax function, or "reduce[<primitive>, init=<value>]" for lax.reduce
    fn: Callable[..., Any]  # takes `nargs` arrays of one dtype
    nargs: int
    dtypes: tuple[Any, ...]  # numpy dtypes JAX's own tests run it with


def lax_op_catalogue() -> list[CatalogueOp]:
    """Every operation JAX's own lax tests sweep, with the operand dtypes each accepts.

    Read from ``jax._src.internal_test_util.lax_test_util``, which ships with
    JAX: ``lax_ops`` (elementwise operations by `jax.lax` name),
    ``lax_reduce_ops`` (`jax.lax.reduce` with an initial value and computation
    JAX recognises as a monoid, so it binds ``reduce_sum``, ``reduce_max``...),
    ``lax_named_reduce_ops`` (`jax.lax.reduce_sum`...) and
    ``lax_out_dtype_ops``. An operation listed in several of its records
    (``sqrt`` for floats and for complex numbers) is one entry with their dtypes
    merged. Reductions reduce over axis 0. The dtypes are those of the default
    backend that JAX runs as such: 64-bit types only with ``jax_enable_x64``
    (an operation left with none is omitted). Raises when the module has moved
    or dropped one of these lists, so tests built on it fail instead of
    sweeping fewer operations.
    """
    import numpy as np
    from jax._src.internal_test_util import lax_test_util as catalogue

    entries: dict[str, CatalogueOp] = {}

    def add(name: str, fn: Callable[..., Any], nargs: int, dtypes: Sequence[Any]) -> None:
        known = entries[name].dtypes if name in entries else ()
        # Records list 64-bit types whatever jax_enable_x64 says; JAX would
        # silently run those at 32 bits.
        usable = [np.dtype(d) for d in dtypes if jax.dtypes.canonicalize_dtype(d) == np.dtype(d)]
        merged = tuple(dict.fromkeys((*known, *usable)))
        if merged:
            entries[name] = CatalogueOp(name, fn, nargs, merged)

    for record in (*catalogue.lax_ops(), *catalogue.lax_out_dtype_ops()):
        add(record.op, getattr(jax.lax, record.op), record.nargs, record.dtypes)
    for record in catalogue.lax_reduce_ops():
        # One entry per initial value: each is the monoid's identity for its dtypes only.
        name = f"reduce[{record.primitive.name}, init={record.init_val}]"
        add(name, _monoid_reduction(record.op, record.init_val), 1, record.dtypes)
    for record in catalogue.lax_named_reduce_ops():
        add(record.op.__name__, functools.partial(record.op, axes=(0,)), 1, record.dtypes)
    return list(entries.values())


def _monoid_reduction(op: Callable, init_val: Any) -> Callable[[Any], Any]:
    import numpy as np

    def reduce(x: Any) -> Any:
        # A wrapping conversion: -1 stands for all bits set in any integer type.
        return jax.lax.reduce(x, np.array(init_val).astype(x.dtype), op, (0,))

    return reduce
