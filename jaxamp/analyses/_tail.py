"""The program's tail: its loss, and the log-probabilities it is computed from.

PyTorch's autocast runs `log_softmax`, `cross_entropy`, `nll_loss`, `mse_loss`
and the other loss functions in float32, and MaxText casts logits to float32
before its loss: a loss computed in half precision is a half-precision number
(a bfloat16 cross-entropy is off by up to 2**-8 relatively), and every logged
value shows it. amp finds the same region in any program, whatever library
wrote the loss.

**Definition.** The tail is two sets of equations, both run by the table's
``"amp_tail"`` entry (`use_original_precision`: float32 where the program had
float32):

* the loss: the equations downstream of a matmul whose results reach no
  matmul or convolution and flow only into scalar outputs of the program (the
  value being optimised): a head's bias, the cross-entropy or squared error
  and the reductions that make the loss;
* log-probabilities, wherever a jaxpr computes them (`log_probabilities`): a
  ``log`` of a ``reduce_sum`` of an ``exp`` (log-softmax, logsumexp, every
  cross-entropy), from the values it normalises (their maximum, the shifted
  values, the exponentials and their sum) to the log, and all that follows
  the log and reaches no matmul (per-token log-probabilities, per-example
  losses, their gathers and sums). This part does not depend on where the
  code sits: a vector of losses, a log-softmax inside a `jax.jit`, a
  `jax.checkpoint` or a custom derivative's body is float32 as at top level.

An attention softmax feeds a matmul and has no log: it is not part of it. A
function that returns activations or logits (a layer, a model's forward) has
no tail there and runs by the table as jaxamp 0.0.4 runs it. An entry the
user wrote for a primitive comes first (see
`jaxamp.transform._scopes.choose_rule`).

Both are found across calls: the bodies of ``jit``'d functions (every
``jax.numpy`` function amp keeps as a call), ``jax.checkpoint`` and custom
derivatives' primal functions are walked where they are called, so a loss
whose matmul and log-softmax sit in one inner ``jax.jit`` is the loss it is
inline. Each equation is named by its `Path`. A loop or cond in the tail has
its whole body run as tail. A program without matmuls has no loss tail.

**The last matmuls** (`Tail.last_matmuls`, which fp8 mode keeps in bfloat16)
are where the loss tail starts: the matmuls whose results reach the program's
outputs with no matmul after them (the logits head). They are found by their
place in the flattened program, not by shape or by equation: a layer's body
shared by every layer (one jit'd function called in each) holds the head only
at the call that computes it. A loop whose matmuls are last (a loss computed
inside a scan) is entered: there a matmul is last when no matmul follows it in
the same iteration or, through the carry, in a later one. A shard_map's body is
entered too, and so are a cond's branches, whose paths name the branch after
the cond's equation (``(cond, branch, equation...)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from .. import _compat
from .._jaxpr import MATMUL_NAMES, holds_matmul

__all__ = ["Path", "Tail", "find_tail", "path_body", "paths_in", "tail_paths"]


Path = tuple[int, ...]
"""An equation's place: its index, after the indices of the calls whose bodies hold it, outermost first."""


class _Node(NamedTuple):
    """An equation of the flattened program: calls replaced by their bodies, variables renamed."""

    path: Path
    name: str
    invars: tuple[Any, ...]  # keys of non-literal operands
    outvars: tuple[Any, ...]
    matmul: bool
    eqn: Any


class Tail(NamedTuple):
    """What `find_tail` found, each equation named by its `Path`."""

    paths: frozenset[Path]  # the tail: the loss and the log-probabilities
    last_matmuls: frozenset[Path]  # the matmuls the loss tail starts after (a program's only)


def tail_paths(jaxpr: Any, program: bool = True) -> frozenset[Path]:
    """`find_tail`'s paths: every equation of `jaxpr` in its tail."""
    return find_tail(jaxpr, program).paths


def find_tail(jaxpr: Any, program: bool = True) -> Tail:
    """The tail of `jaxpr`: its loss (for a program) and its log-probabilities, and its last matmuls.

    Args:
        jaxpr: an open jaxpr: the amp'd program, or a body inside it.
        program: whether `jaxpr` is the amp'd program, whose scalar outputs
            are its loss and whose outputs define its last matmuls; a body's
            outputs are not.
    """
    nodes, outputs = _flatten(jaxpr)
    found = _log_probabilities(nodes)
    if not program:
        return Tail(found, frozenset())
    scalar = {k for k, v in zip(outputs, jaxpr.outvars) if k is not None and getattr(v.aval, "shape", None) == ()}
    keys = [k for k in outputs if k is not None]
    return Tail(found | _loss(nodes, keys, scalar), _last_matmuls(nodes, set(keys)))


def path_body(eqn: Any) -> Any:
    """The open jaxpr that paths inside `eqn` index: a call's body, a loop's (scan, while) or a shard_map's.

    For a cond, the tuple of its branches' jaxprs: a path's next element picks the branch.
    """
    if eqn.primitive is _compat.cond_p:
        return tuple(b.jaxpr for b in eqn.params["branches"])
    body = _compat.call_body(eqn)
    if body is None and eqn.primitive in _ENTERED:
        body = eqn.params[_ENTERED[eqn.primitive]]
    return getattr(body, "jaxpr", body)


# What `_last_matmuls` enters besides calls, and the parameter holding each one's body.
_ENTERED = {_compat.scan_p: "jaxpr", _compat.while_p: "body_jaxpr", _compat.shard_map_p: "jaxpr"}


def _last_matmuls(nodes: list[_Node], counted: set[Any], carries: Sequence[tuple[Any, Any]] = ()) -> frozenset[Path]:
    """Matmul nodes whose results reach `counted` variables and no matmul.

    Args:
        nodes: a flattened program or loop body.
        counted: the variables whose values leave it (the outputs that count).
        carries: a loop body's ``(carry in, carry out)`` pairs: what a carry's
            input reaches, its output reaches too (in the next iteration).
    """
    extra_matmul: set[Any] = set()
    extra_counted: set[Any] = set()
    while True:
        to_matmul, to_counted = set(extra_matmul), counted | extra_counted
        for node in reversed(nodes):
            if node.matmul or any(o in to_matmul for o in node.outvars):
                to_matmul.update(node.invars)
            if any(o in to_counted for o in node.outvars):
                to_counted.update(node.invars)
        more_matmul = {out for into, out in carries if into in to_matmul} - extra_matmul
        more_counted = {out for into, out in carries if into in to_counted} - extra_counted
        if not more_matmul and not more_counted:
            break
        extra_matmul |= more_matmul
        extra_counted |= more_counted
    found: set[Path] = set()
    for node in nodes:
        if not node.matmul or any(o in to_matmul for o in node.outvars):
            continue
        reaching = [o in to_counted for o in node.outvars]
        if not any(reaching):
            continue
        if node.name in MATMUL_NAMES:
            found.add(node.path)
        elif node.eqn.primitive in _ENTERED:
            found |= {(*node.path, *p) for p in _last_matmuls_inside(node.eqn, reaching)}
        elif node.eqn.primitive is _compat.cond_p:
            for b, branch in enumerate(node.eqn.params["branches"]):
                branch_nodes, outputs = _flatten(branch.jaxpr)
                counted_here = {k for k, r in zip(outputs, reaching) if r and k is not None}
                found |= {(*node.path, b, *p) for p in _last_matmuls(branch_nodes, counted_here)}
    return frozenset(found)


def paths_in(given: tuple[Any, frozenset[Path]], jaxpr: Any) -> frozenset[Path] | None:
    """The paths of ``given = (path_body(eqn), paths)`` that index `jaxpr`, or None where it is not that body.

    A cond's branch takes the paths that start with its index.
    """
    body, paths = given
    if body is jaxpr:
        return paths
    if isinstance(body, tuple):
        for b, branch in enumerate(body):
            if branch is jaxpr:
                return frozenset(p[1:] for p in paths if p and p[0] == b)
    return None


def _last_matmuls_inside(eqn: Any, reaching: list[bool]) -> frozenset[Path]:
    """`_last_matmuls` of a loop's or shard_map's body, given which of its results reach the outputs."""
    body = path_body(eqn)
    skip, num_carry = 0, 0
    if eqn.primitive is _compat.scan_p:
        skip, num_carry = _compat.scan_layout(eqn.params)
    elif eqn.primitive is _compat.while_p:
        skip, num_carry = eqn.params["body_nconsts"], len(body.outvars)
    nodes, outputs = _flatten(body)
    # `_flatten` names a body's inputs ``((), var)``.
    carries = [(((), body.invars[skip + k]), outputs[k]) for k in range(num_carry)]
    counted = {k for k, r in zip(outputs, reaching) if r and k is not None}
    return _last_matmuls(nodes, counted, [c for c in carries if c[1] is not None])


def _flatten(jaxpr: Any) -> tuple[list[_Node], list[Any]]:
    """`jaxpr`'s equations with call bodies inlined, and the keys of its outputs (None: a literal)."""
    nodes: list[_Node] = []

    def walk(jaxpr: Any, prefix: Path, env: dict) -> list[Any]:
        def key(v: Any) -> Any:
            return None if isinstance(v, _compat.Literal) else env.setdefault(v, (prefix, v))

        for i, eqn in enumerate(jaxpr.eqns):
            path = (*prefix, i)
            body = _compat.call_body(eqn)
            if body is not None and len(body.invars) == len(eqn.invars) and len(body.outvars) == len(eqn.outvars):
                inner = {b: key(v) for b, v in zip(body.invars, eqn.invars) if key(v) is not None}
                for out, k in zip(eqn.outvars, walk(body, path, inner)):
                    env[out] = (path, out) if k is None else k
                continue
            matmul = eqn.primitive.name in MATMUL_NAMES or holds_matmul(eqn)
            ins = tuple(k for k in map(key, eqn.invars) if k is not None)
            nodes.append(_Node(path, eqn.primitive.name, ins, tuple(map(key, eqn.outvars)), matmul, eqn))
        return [key(v) for v in jaxpr.outvars]

    outputs = walk(jaxpr, (), {})
    return nodes, outputs


def _loss(nodes: list[_Node], outputs: list[Any], scalar: set[Any]) -> frozenset[Path]:
    """Nodes downstream of a matmul, reaching none, that reach the outputs only through `scalar` ones."""
    if not any(n.matmul for n in nodes):
        return frozenset()
    # Backwards: which variables some matmul, a scalar output or another
    # output (eventually) reads.
    feeds_matmul: set[Any] = set()
    feeds_scalar: set[Any] = set(scalar)
    feeds_other: set[Any] = set(outputs) - scalar
    in_loss = [False] * len(nodes)
    for i in reversed(range(len(nodes))):
        node = nodes[i]
        reaches = [
            node.matmul or any(o in feeds_matmul for o in node.outvars),
            any(o in feeds_scalar for o in node.outvars),
            any(o in feeds_other for o in node.outvars),
        ]
        for reached, feeds in zip(reaches, (feeds_matmul, feeds_scalar, feeds_other)):
            if reached:
                feeds.update(node.invars)
        in_loss[i] = reaches == [False, True, False]
    # Forwards: which variables a matmul's result flows into.
    after: set[Any] = set()
    tail = set()
    for i, node in enumerate(nodes):
        downstream = any(v in after for v in node.invars)
        if node.matmul or downstream:
            after.update(node.outvars)
        if downstream and in_loss[i]:
            tail.add(node.path)
    return frozenset(tail)


# What a log-normaliser's value passes through between its exponentials,
# their sum and the log: shapes, an absolute value (logsumexp's sign), a
# where-mask (``select_n``, ``mul``).
_CARRIERS = frozenset(
    {"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "abs", "convert_element_type", "select_n", "mul"}
)


def _log_probabilities(nodes: list[_Node]) -> frozenset[Path]:
    """Nodes computing log-probabilities: log-softmax, logsumexp and what follows them.

    For each ``log`` of a ``reduce_sum`` of an ``exp`` (through `_CARRIERS`):
    the nodes on the paths from the values the exponentials normalise (``x``
    of ``exp(x - max(x))``) to the log, and those downstream of the log that
    reach no matmul. Paths never cross a matmul.
    """
    producer = {v: i for i, node in enumerate(nodes) for v in node.outvars}

    def source(v: Any, name: str) -> int | None:
        # The node named `name` that `v` comes from through `_CARRIERS`.
        k = producer.get(v)
        if k is None:
            return None
        if nodes[k].name == name:
            return k
        if nodes[k].name not in _CARRIERS:
            return None
        # select_n's cases, mul's factors: the one that leads back.
        return next((f for f in (source(u, name) for u in nodes[k].invars) if f is not None), None)

    logs, roots = set(), set()
    for i, node in enumerate(nodes):
        if node.name != "log" or not node.invars:
            continue
        total = source(node.invars[0], "reduce_sum")
        exp = None if total is None or not nodes[total].invars else source(nodes[total].invars[0], "exp")
        if exp is None or not nodes[exp].invars:
            continue
        logs.add(i)
        shifted = nodes[exp].invars[0]
        k = producer.get(shifted)
        # exp(x - max(x)): the values normalised are x, so that their maximum
        # (and logsumexp's addition of it back) is part of it.
        roots.add(nodes[k].invars[0] if k is not None and nodes[k].name == "sub" and nodes[k].invars else shifted)
    if not logs:
        return frozenset()
    # Forwards from the roots and from the logs, backwards from the logs and
    # from every matmul (what reaches one is not log-probabilities).
    from_roots: set[Any] = set(roots)
    after_log: set[Any] = set()
    downstream_of_roots, downstream_of_logs = set(), set()
    for i, node in enumerate(nodes):
        if not node.matmul and any(v in from_roots for v in node.invars):
            downstream_of_roots.add(i)
            from_roots.update(node.outvars)
        if i in logs or (not node.matmul and any(v in after_log for v in node.invars)):
            downstream_of_logs.add(i)
            after_log.update(node.outvars)
    to_logs: set[Any] = set()
    to_matmul: set[Any] = set()
    upstream_of_logs, reaches_matmul = set(), set()
    for i in reversed(range(len(nodes))):
        node = nodes[i]
        if i in logs or (not node.matmul and any(o in to_logs for o in node.outvars)):
            upstream_of_logs.add(i)
            to_logs.update(node.invars)
        if node.matmul or any(o in to_matmul for o in node.outvars):
            reaches_matmul.add(i)
            to_matmul.update(node.invars)
    chosen = (downstream_of_roots & upstream_of_logs) | (downstream_of_logs - reaches_matmul)
    return frozenset(nodes[i].path for i in chosen)
