"""The program's tail: the equations after its last matmul, which compute the loss.

PyTorch's autocast runs `log_softmax`, `cross_entropy`, `nll_loss`, `mse_loss`
and the other loss functions in float32, and MaxText casts logits to float32
before its loss: a loss computed in half precision is a half-precision number
(a bfloat16 cross-entropy is off by up to 2**-8 relatively), and every logged
value shows it. amp finds the same region in any program, whatever library
wrote the loss: the equations whose results reach no matmul or convolution,
i.e. everything between the last matmuls and the outputs (a head's bias,
log-softmax, logsumexp, the cross-entropy or squared error and the reductions
that make the loss), and runs them by the table's ``"amp_tail"`` entry
(`use_original_precision`: float32 where the program had float32). An
attention softmax feeds a matmul and is not part of it.

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
    """Indices of `jaxpr`'s equations downstream of a matmul whose results reach none.

    Args:
        jaxpr: the amp'd program (an open jaxpr).

    Returns:
        The tail's equation indices; empty when the program has no matmul.
    """
    eqns = jaxpr.eqns
    matmul = [holds_matmul(eqn) for eqn in eqns]
    if not any(matmul):
        return frozenset()
    # Backwards: which variables some matmul (eventually) reads.
    feeds: set[Any] = set()
    reaches_matmul = [False] * len(eqns)
    for i in reversed(range(len(eqns))):
        eqn = eqns[i]
        if matmul[i] or any(o in feeds for o in eqn.outvars):
            reaches_matmul[i] = True
            feeds.update(v for v in eqn.invars if not isinstance(v, _compat.Literal))
    # Forwards: which variables a matmul's result flows into.
    after: set[Any] = set()
    tail = set()
    for i, eqn in enumerate(eqns):
        downstream = any(v in after for v in eqn.invars if not isinstance(v, _compat.Literal))
        if matmul[i] or downstream:
            after.update(eqn.outvars)
        if downstream and not reaches_matmul[i]:
            tail.add(i)
    return frozenset(tail)
