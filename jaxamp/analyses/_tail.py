"""The program's tail: its loss, the equations after its last matmul that reduce to a scalar output.

PyTorch's autocast runs `log_softmax`, `cross_entropy`, `nll_loss`, `mse_loss`
and the other loss functions in float32, and MaxText casts logits to float32
before its loss: a loss computed in half precision is a half-precision number
(a bfloat16 cross-entropy is off by up to 2**-8 relatively), and every logged
value shows it. amp finds the same region in any program, whatever library
wrote the loss.

**Definition.** The tail is the equations downstream of a matmul whose results
reach no matmul or convolution and flow only into scalar outputs of the
program (the value being optimised): a head's bias, log-softmax, logsumexp,
the cross-entropy or squared error and the reductions that make the loss. It
runs by the table's ``"amp_tail"`` entry (`use_original_precision`: float32
where the program had float32). An attention softmax feeds a matmul and is
not part of it; a function that returns activations, logits or any other
non-scalar (a layer, a model's forward) has no tail where those flow, and runs
by the table as jaxamp 0.0.4 runs it. An entry the user wrote for a
primitive comes first (see `jaxamp.transform._scopes.choose_rule`).

Only the amp'd program's own equations are classified; a call in the tail
(``jax.nn.log_softmax`` is a jit'd function) has its whole body run as tail.
A program without matmuls has no tail: amp leaves it as its table says.
"""

from __future__ import annotations

from typing import Any

from .. import _compat
from .._jaxpr import holds_matmul

__all__ = ["tail_equations"]


def tail_equations(jaxpr: Any) -> frozenset[int]:
    """Indices of `jaxpr`'s equations downstream of a matmul that reduce to scalar outputs only.

    Args:
        jaxpr: the amp'd program (an open jaxpr).

    Returns:
        The tail's equation indices: each is downstream of a matmul, reaches
        no matmul, and reaches the program's outputs only through scalar
        ones; empty when the program has no matmul.
    """
    eqns = jaxpr.eqns
    matmul = [holds_matmul(eqn) for eqn in eqns]
    if not any(matmul):
        return frozenset()
    # Backwards: which variables some matmul, a scalar output or another
    # output (eventually) reads.
    feeds_matmul: set[Any] = set()
    feeds_scalar: set[Any] = set()
    feeds_other: set[Any] = set()
    for v in jaxpr.outvars:
        if not isinstance(v, _compat.Literal):
            (feeds_scalar if getattr(v.aval, "shape", None) == () else feeds_other).add(v)
    in_loss = [False] * len(eqns)
    for i in reversed(range(len(eqns))):
        eqn = eqns[i]
        operands = [v for v in eqn.invars if not isinstance(v, _compat.Literal)]
        reaches = [
            matmul[i] or any(o in feeds_matmul for o in eqn.outvars),
            any(o in feeds_scalar for o in eqn.outvars),
            any(o in feeds_other for o in eqn.outvars),
        ]
        for reached, feeds in zip(reaches, (feeds_matmul, feeds_scalar, feeds_other)):
            if reached:
                feeds.update(operands)
        in_loss[i] = reaches == [False, True, False]
    # Forwards: which variables a matmul's result flows into.
    after: set[Any] = set()
    tail = set()
    for i, eqn in enumerate(eqns):
        downstream = any(v in after for v in eqn.invars if not isinstance(v, _compat.Literal))
        if matmul[i] or downstream:
            after.update(eqn.outvars)
        if downstream and in_loss[i]:
            tail.add(i)
    return frozenset(tail)
