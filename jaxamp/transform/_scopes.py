"""Named scopes: `amp_stop`, and choosing the rule for an equation.

amp reads the `jax.named_scope` names recorded on each equation. A policy table's
string keys match those names; its primitive keys match the equation's primitive.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax

from ._rules import default_amp_policy, use_full_range_precision

__all__ = [
    "AMP_DEFAULT",
    "AMP_RANGE",
    "AMP_REQUESTED",
    "AMP_STATISTICS",
    "AMP_STOP",
    "AMP_TAIL",
    "MODE_ENTRY",
    "RuleChoice",
    "amp_stop",
    "choose_rule",
]

AMP_STOP = "amp_stop"
AMP_DEFAULT = "amp_default"
# The entry for normalisation statistics (see `jaxamp.analyses._statistics`).
AMP_STATISTICS = "amp_statistics"
# The entry for range-limited ops whose result the range facts bound (see
# `jaxamp.analyses._ranges`); it replaces only the default `use_full_range_precision`.
AMP_RANGE = "amp_range"
# The entry for a matmul whose program asked for a precision (see
# `jaxamp.transform._rules.requested_precision`) or widened its operands from
# half precision (see `jaxamp.analyses._upcasts`).
AMP_REQUESTED = "amp_requested"
# The entry for the program's tail: what runs after its last matmul (see
# `jaxamp.analyses._tail`).
AMP_TAIL = "amp_tail"
# The attribute that marks a rule an amp mode puts in place of a default entry.
MODE_ENTRY = "jaxamp_mode_entry"


@contextlib.contextmanager
def _stopped():
    # A generator context manager is also a decorator that makes a fresh scope
    # per call, so one definition serves `@amp_stop` and `with amp_stop():`,
    # recursion and threads included. The scope is recorded on every equation
    # traced inside, including those of jit'd functions and loop bodies.
    with jax.named_scope(AMP_STOP):
        yield


def amp_stop(fn: Callable | None = None):
    """Switch amp off for a function or a block: its ops run at original precision.

    Usable as a decorator (``@amp_stop``) or a context manager
    (``with amp_stop(): ...``). Works by opening the named scope ``"amp_stop"``,
    whose entry in the default policy is `use_original_precision`.

    Args:
        fn: the function to run without amp; omit it for the context-manager form.

    Returns:
        The wrapped function, or a context manager when `fn` is None.
    """
    if fn is None:
        return _stopped()
    if not callable(fn):
        raise TypeError(f"amp_stop expects a function to decorate (or no argument, as a context manager), got {fn!r}.")
    return _stopped()(fn)


class RuleChoice(NamedTuple):
    """The rule for one equation and which table entry supplied it."""

    rule: Callable
    # "amp_stop", "scope:<name>", "user", "requested", "tail", "statistics", "range",
    # "primitive" (the default table's entry) or "amp_default"
    decided_by: str


def choose_rule(
    policy: Mapping[Any, Callable],
    scopes: Sequence[str],
    primitive: Any,
    statistic: bool = False,
    bounded: bool = False,
    tail: bool = False,
    requested: bool = False,
) -> RuleChoice | None:
    """Pick the policy entry for an equation.

    What the user wrote comes before what amp infers. In order:

    1. ``amp_stop``, when active: the user's explicit off switch;
    2. the outermost active named scope with an entry;
    3. the primitive's entry, where it differs from `default_amp_policy`'s
       (an entry the user wrote: ``"user"``);
    4. ``"amp_requested"``, for a matmul whose program asked for a precision
       (`requested`; see `jaxamp.transform._rules.requested_precision`), or
       widened its operands from half precision (`jaxamp.analyses._upcasts`): the
       program's word on one matmul, below the table's on all of them, whose
       rule is given the request's parameters;
    5. ``"amp_tail"``, for an equation of the program's loss (`tail`; see
       `jaxamp.analyses._tail`);
    6. ``"amp_statistics"``, for an equation computing normalisation
       statistics (`statistic`);
    7. ``"amp_range"``, for a range-limited equation whose result is known to
       be bounded (`bounded`) and whose entry is `use_full_range_precision`;
    8. the primitive's default entry (``"primitive"``), then ``"amp_default"``.

    Returns None when nothing matches (the caller keeps the original precision).
    """
    if AMP_STOP in scopes and AMP_STOP in policy:
        return RuleChoice(policy[AMP_STOP], AMP_STOP)
    for scope in scopes:
        if scope in policy:
            return RuleChoice(policy[scope], f"scope:{scope}")
    rule = policy.get(primitive)
    if rule is not None and _written_by_user(rule, primitive):
        return RuleChoice(rule, "user")
    if requested and AMP_REQUESTED in policy:
        return RuleChoice(policy[AMP_REQUESTED], "requested")
    if tail and AMP_TAIL in policy:
        return RuleChoice(policy[AMP_TAIL], "tail")
    if statistic and AMP_STATISTICS in policy:
        return RuleChoice(policy[AMP_STATISTICS], "statistics")
    if bounded and AMP_RANGE in policy and rule is use_full_range_precision:
        return RuleChoice(policy[AMP_RANGE], "range")
    if rule is not None:
        return RuleChoice(rule, "primitive")
    if AMP_DEFAULT in policy:
        return RuleChoice(policy[AMP_DEFAULT], AMP_DEFAULT)
    return None


def _written_by_user(rule: Callable, primitive: Any) -> bool:
    # A mode of amp's own (fp8, float32 gradient reductions) replaces default
    # entries with rules that say so (`MODE_ENTRY`); those are amp's too.
    return rule is not default_amp_policy.get(primitive) and not getattr(rule, MODE_ENTRY, False)
