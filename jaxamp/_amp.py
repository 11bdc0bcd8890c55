"""`amp`: trace a function to a jaxpr and re-run it in mixed precision."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from . import _compat, _higher_order, _nnx  # noqa: F401  (_higher_order registers the handlers)
from ._dtypes import canonical_compute_dtype
from ._interpreter import AmpContext, interpret
from ._casting import cast_value
from ._rules import default_amp_policy, freeze

__all__ = ["AmpOptions", "amp"]

_UNSET: Any = object()
_PRIMITIVE_NAMES = frozenset(
    getattr(key, "name", None) for key in default_amp_policy if not isinstance(key, str)
)


def amp(
    fn: Callable | None = None,
    *,
    compute_dtype: Any = _UNSET,
    amp_policy: Mapping[Any, Callable] | None = None,
    policy: Any = None,
) -> Callable:
    """Make `fn` run in mixed precision.

    `fn` is traced to a jaxpr and every equation, including those inside jit'd
    functions, scans, while loops, conds, remat blocks, custom_jvp/custom_vjp
    rules and shard_map bodies, is re-run with its operands cast by the rule
    `amp_policy` picks for it. Array outputs come back in the dtypes `fn` itself
    returns.

    Usable as ``amp(f)``, ``amp(f, compute_dtype="bf16")``, ``@amp`` and
    ``@amp(compute_dtype=jnp.bfloat16)``.

    Args:
        fn: the function. Array leaves of its arguments are traced; everything
            else (Python scalars, strings, callables, Equinox static fields) is
            static, as `equinox.filter_make_jaxpr` treats them.
        compute_dtype: the low-precision dtype (``jnp.float16`` by default,
            ``jnp.bfloat16``, or a name: ``"bf16"``, ``"f16"``, ``"half"``...).
        amp_policy: the rule table, keyed by primitive (``jax.lax.add_p``) or by
            `jax.named_scope` name; `default_amp_policy` when omitted.
        policy: a `jaxamp.Policy` or policy string (``"p=f32,c=bf16,o=f32"``):
            compute in its compute dtype and cast floating outputs to its
            output dtype. Cannot be combined with `compute_dtype`.

    Returns:
        The mixed-precision function (or a decorator when `fn` is omitted).

    Raises:
        TypeError: `fn` is not callable, `compute_dtype` is not a float16,
            bfloat16 or float32 dtype, or `amp_policy` is malformed.
        ValueError: an unknown dtype name or policy string.
    """
    options = AmpOptions.resolve(compute_dtype=compute_dtype, amp_policy=amp_policy, policy=policy)
    if fn is None:
        return functools.partial(amp, compute_dtype=compute_dtype, amp_policy=amp_policy, policy=policy)
    if not callable(fn):
        raise TypeError(
            f"amp expects a callable (a function, or an Equinox module with a "
            f"__call__ method), got {type(fn).__name__}: {fn!r:.100}."
        )

    @functools.wraps(fn)
    def amp_fn(*args, **kwargs):
        return options.run(fn, args, kwargs)

    return amp_fn


@dataclasses.dataclass(frozen=True)
class AmpOptions:
    """amp's validated settings; `amp`, `explain` and `find_nonfinite` share them."""

    compute_dtype: np.dtype
    table: Mapping[Any, Callable]
    output_dtype: np.dtype | None = None

    @classmethod
    def resolve(
        cls, *, compute_dtype: Any = _UNSET, amp_policy: Any = None, policy: Any = None
    ) -> AmpOptions:
        """Validate `amp`'s keyword arguments (see `amp`)."""
        compute, output_dtype = _resolve_dtypes(compute_dtype, policy)
        table = _check_policy_table(default_amp_policy if amp_policy is None else amp_policy)
        return cls(compute, table, output_dtype)

    def run(self, fn: Callable, args: tuple, kwargs: dict, *, observer=None, inline=False) -> Any:
        """Trace ``fn(*args, **kwargs)`` and evaluate it under amp."""
        closed, flat_args, num_outs, rebuild = _trace(fn, args, kwargs)
        ctx = AmpContext(
            compute_dtype=self.compute_dtype,
            policy=freeze(self.table),
            scopes=_compat.ambient_scopes(),
            observer=observer,
            inline=inline,
        )

        outs = interpret(closed.jaxpr, closed.consts, flat_args, ctx)
        outs = [cast_value(x, a.dtype) for x, a in zip(outs, closed.out_avals)]
        if self.output_dtype is not None:
            # fn's own outputs only: state written back into flax nnx arguments
            # keeps its dtypes.
            outs[:num_outs] = [cast_value(x, self.output_dtype) for x in outs[:num_outs]]
        # Re-emitted straight into the caller's trace (grad, vmap, an outer jit),
        # like the user's own code: calls keep their jaxprs (see
        # `_compat.trace_keeping_calls`), so JAX differentiates each distinct
        # body once and source lines stay the user's.
        return rebuild(outs)


def _resolve_dtypes(compute_dtype: Any, policy: Any) -> tuple[np.dtype, np.dtype | None]:
    if policy is None:
        value = jnp.float16 if compute_dtype is _UNSET else compute_dtype
        return canonical_compute_dtype(value), None
    from ._policy import get_policy

    resolved = get_policy(policy)
    if compute_dtype is not _UNSET and np.dtype(
        canonical_compute_dtype(compute_dtype)
    ) != np.dtype(resolved.compute_dtype):
        raise ValueError(
            f"amp got compute_dtype={compute_dtype!r} and policy={str(resolved)!r}, "
            "which disagree: pass one of them."
        )
    return np.dtype(resolved.compute_dtype), np.dtype(resolved.output_dtype)


def _check_policy_table(table: Any) -> Mapping[Any, Callable]:
    if not isinstance(table, Mapping):
        raise TypeError(
            f"amp_policy must be a dict mapping primitives or scope names to rules, "
            f"got {type(table).__name__}."
        )
    for key, rule in table.items():
        if not isinstance(key, (str, _compat.Primitive)):
            raise TypeError(
                f"amp_policy keys must be primitives (e.g. jax.lax.add_p) or "
                f"jax.named_scope names, got {key!r} ({type(key).__name__})."
            )
        if isinstance(key, str) and key in _PRIMITIVE_NAMES:
            warnings.warn(
                f"amp_policy key {key!r} is matched against jax.named_scope names, "
                f"not primitives; to key the primitive, use its object "
                f"(e.g. jax.lax.{key}_p).",
                UserWarning,
                stacklevel=3,
            )
        if not callable(rule):
            raise TypeError(
                f"amp_policy[{key!r}] must be a rule function "
                f"rule(compute_dtype, original_dtypes, *invars, **bind_params), got {rule!r}."
            )
    return table


def _trace(fn: Callable, args: tuple, kwargs: dict):
    """Trace `fn` with the array leaves of its arguments as inputs.

    Returns:
        ``(closed, flat_args, num_outs, rebuild)``: the jaxpr; its inputs; how
        many of its leading outputs are `fn`'s own (the rest are the state that
        `fn` changed in flax nnx objects among its arguments, see `_nnx`); and
        ``rebuild(outs)``, which builds `fn`'s output from the evaluated outputs
        and writes that state back into the caller's objects.
    """
    nnx_call = _nnx.lift(fn, args, kwargs)
    if nnx_call is not None:
        fn, args, kwargs = nnx_call.fn, nnx_call.args, nnx_call.kwargs
    dynamic, static = eqx.partition((args, kwargs), eqx.is_array)
    flat_args, in_tree = jax.tree_util.tree_flatten(dynamic)
    out_info: list = []

    def flat_fn(*flat):
        call_args, call_kwargs = eqx.combine(jax.tree_util.tree_unflatten(in_tree, flat), static)
        out = fn(*call_args, **call_kwargs)
        out_dynamic, out_static = eqx.partition(out, eqx.is_array)
        out_flat, out_tree = jax.tree_util.tree_flatten(out_dynamic)
        out_info[:] = [out_tree, out_static]
        return [jnp.asarray(x) for x in out_flat]

    in_avals = [_compat.abstract_value(x) for x in flat_args]
    closed = _compat.trace_keeping_calls(flat_fn, in_avals)
    out_tree = out_info[0]
    # The nnx call returns ``(out, state updates)``: out's leaves come first.
    num_outs = out_tree.num_leaves if nnx_call is None else out_tree.children()[0].num_leaves

    def rebuild(outs):
        out_tree, out_static = out_info
        out = eqx.combine(jax.tree_util.tree_unflatten(out_tree, outs), out_static)
        return out if nnx_call is None else nnx_call.finish(out)

    return closed, flat_args, num_outs, rebuild

