"""Precision rules and the default policy table.

A rule decides the dtypes one equation runs in. Its signature is the seed's::

    rule(compute_dtype, original_dtypes, *invars, **bind_params) -> (invars, bind_params)

``original_dtypes`` are the operand dtypes the user's program had; ``invars`` are
the operands as amp currently holds them (possibly already in compute dtype).
Rules only ever convert float32, float16 and bfloat16 values: integers, booleans,
float64 and complex numbers pass through untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from . import _compat
from ._casting import cast_value, dtype_of, saturating_cast
from ._dtypes import canonical_compute_dtype, is_castable

__all__ = [
    "PolicyTable",
    "Rule",
    "default_amp_policy",
    "use_compute_precision",
    "use_current_precision",
    "use_full_range_precision",
    "use_original_precision",
    "use_precision",
    "use_widest_precision",
]

Rule = Callable[..., tuple[Sequence[Any], dict[str, Any]]]


def _cast_operands(
    invars: Sequence[Any], original_dtypes: Sequence[Any], target, cast=cast_value
) -> list:
    # Only operands the user's program had as castable floats move: an operand
    # that was float64 or an integer keeps whatever it is.
    return [
        cast(x, target(orig)) if is_castable(orig) else x
        for x, orig in zip(invars, original_dtypes)
    ]


def _with_preferred_element_type(params: dict, dtype: Any) -> dict:
    preferred = params.get("preferred_element_type")
    if preferred is not None and is_castable(preferred):
        params = dict(params, preferred_element_type=np.dtype(dtype))
    return params


def use_compute_precision(compute_dtype, original_dtypes, *invars, **bind_params):
    """Run the equation in `compute_dtype`.

    Casts every float32/float16/bfloat16 operand to `compute_dtype` and, for
    matmuls and convolutions, accumulates into `compute_dtype`
    (``preferred_element_type``).
    """
    invars = _cast_operands(invars, original_dtypes, lambda _: compute_dtype)
    return invars, _with_preferred_element_type(bind_params, compute_dtype)


def use_original_precision(compute_dtype, original_dtypes, *invars, **bind_params):
    """Run the equation in the dtypes the user's program gave its operands."""
    invars = _cast_operands(invars, original_dtypes, lambda orig: orig)
    return invars, bind_params


def use_precision(dtype: Any) -> Rule:
    """A rule that runs equations in `dtype`, whatever amp's compute dtype is.

    Args:
        dtype: float16, bfloat16 or float32, or a name such as ``"bf16"``.

    Returns:
        A rule for an `amp_policy` table.
    """
    dtype = canonical_compute_dtype(dtype, argname="use_precision dtype")

    def rule(compute_dtype, original_dtypes, *invars, **bind_params):
        return use_compute_precision(dtype, original_dtypes, *invars, **bind_params)

    rule.__name__ = rule.__qualname__ = f"use_precision({np.dtype(dtype).name})"
    return rule


def _widest(dtypes: Sequence[Any]) -> np.dtype:
    dtypes = {np.dtype(d) for d in dtypes}
    if len(dtypes) == 1:
        return dtypes.pop()
    # float16 and bfloat16 have the same width but neither holds the other.
    return np.dtype(jnp.float32)


def use_widest_precision(compute_dtype, original_dtypes, *invars, **bind_params):
    """Run the equation in the widest of its operands' original float dtypes."""
    castable = [d for d in original_dtypes if is_castable(d)]
    if not castable:
        return list(invars), bind_params
    return use_compute_precision(_widest(castable), original_dtypes, *invars, **bind_params)


def use_current_precision(compute_dtype, original_dtypes, *invars, **bind_params):
    """Keep the precision the operands already have.

    For elementwise and structural ops. Operands that had the same dtype in the
    user's program must agree again: when amp has since moved some of them to
    `compute_dtype` (a matmul output meeting a float32 bias), all of them go to
    `compute_dtype`, as hand-cast code would; any other disagreement falls back to
    the original dtype.
    """
    target: dict[np.dtype, np.dtype] = {}
    castable = [(x, np.dtype(o)) for x, o in zip(invars, original_dtypes) if is_castable(o)]
    for orig in {o for _, o in castable}:
        current = {np.dtype(dtype_of(x)) for x, o in castable if o == orig and is_castable(dtype_of(x))}
        if len(current) == 1:
            target[orig] = current.pop()
        elif np.dtype(compute_dtype) in current:
            target[orig] = np.dtype(compute_dtype)
        else:
            target[orig] = orig
    # Saturating: the operand moved down is often a constant (a mask value).
    invars = _cast_operands(
        invars, original_dtypes, lambda orig: target[np.dtype(orig)], cast=saturating_cast
    )
    return invars, bind_params


def use_full_range_precision(compute_dtype, original_dtypes, *invars, **bind_params):
    """Original precision where float16's range is at stake, else current precision.

    For ops that overflow float16 (``exp`` past 11.1, ``pow``, ``cosh``...).
    bfloat16 has float32's exponent range, so under a bfloat16 compute dtype these
    ops stay in bfloat16, as hand-cast bfloat16 code runs them: a softmax then
    keeps its probabilities (the largest tensor saved for the backward pass of
    attention) in bfloat16 instead of float32.
    """
    narrow = np.dtype(jnp.float16)
    if np.dtype(compute_dtype) == narrow or any(
        is_castable(dtype_of(x)) and np.dtype(dtype_of(x)) == narrow for x in invars
    ):
        return use_original_precision(compute_dtype, original_dtypes, *invars, **bind_params)
    return use_current_precision(compute_dtype, original_dtypes, *invars, **bind_params)


# PyTorch autocast's "lower precision" list: matmuls and convolutions.
_COMPUTE_PRIMITIVES = ("dot_general", "conv_general_dilated")

# From PyTorch autocast's float32 list, in lax terms: ops whose accuracy suffers
# in half precision (sums lose bits, log near 1 loses digits).
_FULL_PRECISION_PRIMITIVES = (
    "log", "log1p", "rsqrt", "erf_inv", "lgamma", "digamma", "igamma", "igammac",
    "igamma_grad_a", "polygamma", "zeta", "bessel_i0e", "bessel_i1e", "tan",
    "acos", "asin", "acosh", "asinh", "atanh",
    "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp",
    "reduce_precision",
    # Scatters that combine values carry a combiner jaxpr typed for the
    # original dtype (they appear in amp(jax.grad(f)), as transposed gathers).
    "scatter-add", "scatter-mul", "scatter-min", "scatter-max",
)

# The rest of PyTorch's float32 list: ops that overflow float16's range.
_RANGE_LIMITED_PRIMITIVES = ("exp", "exp2", "expm1", "pow", "cosh", "sinh")

# Elementwise and structural ops: they follow their operands (see
# use_current_precision). Anything not listed (FFI calls, pallas kernels,
# primitives added to JAX after this list) runs at original precision.
_CURRENT_PRECISION_PRIMITIVES = (
    # n-ary elementwise
    "add", "add_any", "sub", "mul", "div", "rem", "max", "min", "atan2",
    "nextafter", "select_n", "clamp", "eq", "ne", "lt", "le", "gt", "ge",
    "and", "or", "xor", "not",
    # unary elementwise
    "neg", "abs", "sign", "floor", "ceil", "round", "is_finite", "tanh",
    "logistic", "sin", "cos", "atan", "sqrt", "cbrt", "square", "integer_pow",
    "erf", "erfc", "copy", "stop_gradient", "real", "imag", "conj",
    "convert_element_type", "reduce_max", "reduce_min", "reduce_and",
    "reduce_or", "reduce_xor", "argmax", "argmin", "cummax", "cummin",
    "optimization_barrier",
    # structural
    "reshape", "transpose", "broadcast_in_dim", "squeeze",
    "slice", "dynamic_slice", "dynamic_update_slice", "gather", "concatenate",
    "pad", "rev", "iota", "select_and_gather_add", "sort", "top_k",
    "scatter",
    "reduce_window_sum", "reduce_window_max", "reduce_window_min",
    "select_and_scatter_add", "split", "sharding_constraint",
    "mesh_cast", "reshard", "device_put", "pvary", "psum", "pmax", "pmin",
    "all_gather", "all_to_all", "ppermute", "psum_scatter", "reduce_scatter",
    "axis_index", "pbroadcast", "pcast",
)


def _default_table() -> dict[Any, Rule]:
    table: dict[Any, Rule] = {"amp_stop": use_original_precision, "amp_default": use_original_precision}
    # Equinox's normalisation layers open these scopes. PyTorch keeps layer and
    # group norm in float32 too: their variance squares activations.
    for layer in ("LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm"):
        table[f"eqx.nn.{layer}"] = use_original_precision
    for name in _COMPUTE_PRIMITIVES:
        table[name] = use_compute_precision
    for name in _FULL_PRECISION_PRIMITIVES:
        table[name] = use_original_precision
    for name in _RANGE_LIMITED_PRIMITIVES:
        table[name] = use_full_range_precision
    for name in _CURRENT_PRECISION_PRIMITIVES:
        table[name] = use_current_precision
    return table


def _resolve_primitive_names(table: dict[Any, Rule]) -> dict[Any, Rule]:
    # The table is keyed by primitive objects (as the seed documents, e.g.
    # `jax.lax.add_p`) and scope strings; primitive names only make the lists
    # above readable. Names this JAX version lacks are dropped.
    by_name = _compat.lax_primitives_by_name()
    return {
        by_name.get(key, key): rule
        for key, rule in table.items()
        if key in by_name or key in ("amp_stop", "amp_default") or key.startswith("eqx.nn.")
    }


class PolicyTable(Mapping):
    """A read-only policy table, hashed by its contents.

    `default_amp_policy` is one, so editing it in place fails loudly instead of
    being ignored by amp's caches; build your own table with
    ``default_amp_policy | {key: rule}`` (a plain dict). amp also freezes the
    table it is given at each call (`freeze`), so amp'd bodies are cached per
    table *contents*: a dict the user mutates between calls is seen afresh.
    """

    __slots__ = ("_entries", "_hash")

    def __init__(self, entries: Mapping[Any, Rule]):
        self._entries = dict(entries)
        self._hash: int | None = None

    def __getitem__(self, key: Any) -> Rule:
        return self._entries[key]

    def get(self, key: Any, default: Any = None) -> Any:
        # Mapping.get goes through __getitem__ and an exception per miss; this
        # is called for every equation amp evaluates.
        return self._entries.get(key, default)

    def __contains__(self, key: Any) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[Any]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __or__(self, other: Any) -> dict[Any, Rule]:
        if not isinstance(other, Mapping):
            return NotImplemented
        return {**self._entries, **other}

    def __ror__(self, other: Any) -> dict[Any, Rule]:
        if not isinstance(other, Mapping):
            return NotImplemented
        return {**other, **self._entries}

    def __hash__(self) -> int:
        # Raises TypeError for an unhashable rule: then amp does not cache.
        if self._hash is None:
            self._hash = hash(frozenset(self._entries.items()))
        return self._hash

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, PolicyTable):
            return self._entries == other._entries
        return isinstance(other, Mapping) and self._entries == dict(other)

    def _read_only(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "amp policy tables such as jaxamp.default_amp_policy are read-only: build "
            "your own with `table = jaxamp.default_amp_policy | {jax.lax.exp_p: rule}` "
            "and pass it as amp(fn, amp_policy=table)."
        )

    __setitem__ = __delitem__ = update = pop = popitem = setdefault = clear = _read_only

    def copy(self) -> dict[Any, Rule]:
        """The entries as a new, mutable dict."""
        return dict(self._entries)

    def __repr__(self) -> str:
        return f"PolicyTable({len(self._entries)} entries)"


def freeze(table: Mapping[Any, Rule]) -> PolicyTable:
    """`table` as a `PolicyTable`: a snapshot of its entries, unless it is one."""
    return table if isinstance(table, PolicyTable) else PolicyTable(table)


default_amp_policy: PolicyTable = PolicyTable(
    {
        **_resolve_primitive_names(_default_table()),
        # Centring, squaring and normalising by moments, whichever library's
        # norm layer wrote them (see `jaxamp._statistics`).
        "amp_statistics": use_original_precision,
    }
)
"""The default amp policy table (read-only; see `PolicyTable`)."""
