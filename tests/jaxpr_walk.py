"""Test helper: walk a jaxpr and every jaxpr nested in it.

Independent of jaxamp's own code (it reads only public jaxpr structure), so
tests that count dtypes do not trust the implementation they check.
"""

from collections.abc import Iterator

import jax

MATMUL_PRIMITIVES = ("dot_general", "ragged_dot_general", "conv_general_dilated")


def iter_eqns(jaxpr) -> Iterator:
    """Every equation of `jaxpr` (open or closed), nested bodies included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _nested(eqn):
            yield from iter_eqns(sub)


def _nested(eqn):
    # custom_jvp/custom_vjp keep their rules as thunks, not params: only the
    # primal body is reachable statically (their traced derivative rules show
    # up in the jaxpr of jax.grad instead).
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
                yield v


def scan_num_consts(params) -> int:
    """Leading constant operands of a scan equation (JAX 0.10 and 0.11 layouts)."""
    if "num_consts" in params:
        return params["num_consts"]
    return len(params["ft_in"].unpack()[0])


def float_operand_dtypes(jaxpr, names) -> list[tuple[str, tuple]]:
    """(primitive name, floating operand dtypes) of every equation of `jaxpr` binding one of `names`.

    Nested equations included; integer operands (a ragged dot's group sizes) left out.
    """
    return [
        (eqn.primitive.name, tuple(d for d in (v.aval.dtype for v in eqn.invars) if _is_float(d)))
        for eqn in iter_eqns(jaxpr)
        if eqn.primitive.name in names
    ]


def _is_float(dtype) -> bool:
    return jax.numpy.issubdtype(dtype, jax.numpy.floating)


def matmul_operand_dtypes(jaxpr) -> list[tuple[str, tuple]]:
    """(primitive name, floating operand dtypes) of every matmul/conv in `jaxpr`."""
    return float_operand_dtypes(jaxpr, MATMUL_PRIMITIVES)


def assert_all_matmuls_in(jaxpr, dtype, *, at_least=1):
    """Every matmul/conv in `jaxpr` has all its floating operands in `dtype`."""
    found = matmul_operand_dtypes(jaxpr)
    assert len(found) >= at_least, f"expected at least {at_least} matmuls, found {found}"
    wrong = [(name, dts) for name, dts in found if any(d != dtype for d in dts)]
    assert not wrong, f"matmuls not in {jax.numpy.dtype(dtype).name}: {wrong}"
    return len(found)


__all__ = [
    "assert_all_matmuls_in",
    "float_operand_dtypes",
    "iter_eqns",
    "matmul_operand_dtypes",
    "scan_num_consts",
]
