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

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .._casting import cast_value, dtype_of, saturating_cast
from .._dtypes import canonical_compute_dtype, is_castable
from .._jaxpr import COMPUTE_PRIMITIVES

__all__ = [
    "PolicyTable",
    "Rule",
    "default_amp_policy",
    "requested_accumulation",
    "requested_precision",
    "use_compute_precision",
    "use_current_precision",
    "use_full_range_precision",
    "use_normalisation_precision",
    "use_original_precision",
    "use_precision",
    "use_widest_precision",
]

Rule = Callable[..., tuple[Sequence[Any], dict[str, Any]]]


def _cast_operands(invars: Sequence[Any], original_dtypes: Sequence[Any], target, cast=cast_value) -> list:
    # Only operands the user's program had as castable floats move: an operand
    # that was float64 or an integer keeps whatever it is.
    return [cast(x, target(orig)) if is_castable(orig) else x for x, orig in zip(invars, original_dtypes)]


def requested_accumulation(original_dtypes: Sequence[Any], params: Mapping[str, Any]) -> np.dtype | None:
    """The wider result a matmul's program asked for, or None.

    A ``preferred_element_type`` wider than every floating operand the program
    gave the matmul (``jnp.einsum(a_bf16, b_bf16, preferred_element_type=float32)``,
    the scores of ``jax.nn.dot_product_attention``) is a request the program
    made explicitly; a float32 one on float32 operands is JAX's default, not
    a request.
    """
    preferred = params.get("preferred_element_type")
    operands = [np.dtype(d) for d in original_dtypes[:2] if is_castable(d)]
    if preferred is None or not is_castable(preferred) or not operands:
        return None
    preferred = np.dtype(preferred)
    return preferred if all(d.itemsize < preferred.itemsize for d in operands) else None


# Precisions that ask a matmul for more than one half-precision pass: on
# float32 operands a request for float32 (or its multi-pass emulation).
_WIDE_PRECISIONS = frozenset({jax.lax.Precision.HIGH, jax.lax.Precision.HIGHEST})


def requested_precision(original_dtypes: Sequence[Any], params: Mapping[str, Any]) -> str:
    """What a matmul's program asked for beyond amp's compute dtype, in words; ``""`` if nothing.

    Two requests, both written into the program: a wider result than its
    half-precision operands (`requested_accumulation`), and, on float32
    operands, a precision of ``HIGH`` or ``HIGHEST`` or a dot algorithm preset
    that takes float32 inputs only (``F32_F32_F32``, ``TF32_TF32_F32``,
    ``BF16_BF16_F32_X3``...). amp runs such a matmul as written (the table's
    ``"amp_requested"`` entry).
    """
    operands = [np.dtype(d) for d in original_dtypes[:2] if is_castable(d)]
    if not operands:
        return ""
    wider = requested_accumulation(original_dtypes, params)
    if wider is not None:
        names = " x ".join(np.dtype(d).name for d in operands)
        return f"a {wider.name} result of {names} operands"
    if any(d != np.dtype(jnp.float32) for d in operands):
        return ""
    precision = params.get("precision")
    if isinstance(precision, jax.lax.DotAlgorithmPreset):
        inputs = precision.supported_lhs_types
        if inputs and all(np.dtype(t).itemsize >= 4 for t in inputs):
            return f"precision {precision.name}"
        return ""
    asked = precision if isinstance(precision, tuple) else (precision,)
    wide = [p for p in asked if isinstance(p, jax.lax.Precision) and p in _WIDE_PRECISIONS]
    return f"precision {wide[0].name}" if wide else ""


def _with_preferred_element_type(params: dict, dtype: Any, original_dtypes: Sequence[Any]) -> dict:
    preferred = params.get("preferred_element_type")
    if preferred is not None and is_castable(preferred) and requested_accumulation(original_dtypes, params) is None:
        params = dict(params, preferred_element_type=np.dtype(dtype))
    return params


def _with_algorithm(params: dict, dtype: Any) -> dict:
    """`params` without a dot algorithm preset that cannot take `dtype` operands.

    A program may name the algorithm of a matmul (``jax.nn.dot_product_attention``
    asks for ``BF16_BF16_F32`` on bfloat16 operands). Where amp moves the
    operands to a dtype the preset does not take (float16), the matmul runs
    with the backend's default algorithm, its ``preferred_element_type``
    deciding the accumulation, as JAX's attention itself falls back where its
    preset is unsupported; presets for the other dtype (``F16_F16_F32``) are
    not supported on every backend (not on CPU).
    """
    preset = params.get("precision")
    if not isinstance(preset, jax.lax.DotAlgorithmPreset) or preset.supported_lhs_types is None:
        return params
    if np.dtype(dtype) in {np.dtype(t) for t in preset.supported_lhs_types}:
        return params
    return dict(params, precision=None)


def use_compute_precision(compute_dtype, original_dtypes, *invars, **bind_params):
    """Run the equation in `compute_dtype`.

    Casts every float32/float16/bfloat16 operand to `compute_dtype` and, for
    matmuls and convolutions, accumulates into `compute_dtype`
    (``preferred_element_type``), unless the program asked for a wider result
    than its operands (`requested_accumulation`): that result is kept. A dot
    algorithm the program named is kept where it takes `compute_dtype`
    operands (`_with_algorithm`).
    """
    invars = _cast_operands(invars, original_dtypes, lambda _: compute_dtype)
    params = _with_preferred_element_type(bind_params, compute_dtype, original_dtypes)
    return invars, _with_algorithm(params, compute_dtype)


def use_original_precision(compute_dtype, original_dtypes, *invars, **bind_params):
    """Run the equation in the dtypes the user's program gave its operands."""
    invars = _cast_operands(invars, original_dtypes, lambda orig: orig)
    return invars, bind_params


def use_normalisation_precision(compute_dtype, original_dtypes, *invars, **bind_params):
    """Original precision inside a norm layer, whose result goes on in `compute_dtype`.

    For a named scope around a whole normalisation layer: its equations run
    as `use_original_precision`, and where an activation entered the layer in
    `compute_dtype`, the layer's results of the activation's shape leave it in
    `compute_dtype`, as flax's ``LayerNorm(dtype=jnp.bfloat16)`` returns
    bfloat16 after float32 statistics (see `jaxamp.analyses._regions`). A float32
    result would otherwise make every following elementwise op (a ReLU, a
    residual add) run, and save its input for the backward pass, in float32.
    """
    return use_original_precision(compute_dtype, original_dtypes, *invars, **bind_params)


use_normalisation_precision.hands_on_in_compute_dtype = True  # type: ignore[attr-defined]


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
    distinct = {np.dtype(d) for d in dtypes}
    if len(distinct) == 1:
        return distinct.pop()
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
    invars = _cast_operands(invars, original_dtypes, lambda orig: target[np.dtype(orig)], cast=saturating_cast)
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


# --- the default table --------------------------------------------------------
# Every primitive of JAX's lax package and of JAX's own op catalogue has an
# entry here or a handler in `_higher_order` (tests/test_default_table.py and
# tests/test_primitive_sweep.py fail on a JAX release that adds one), and so do
# the primitives programs bind from elsewhere in JAX: checkpoint names,
# sharding, callbacks, kernels, random keys. "amp_default" is left to
# primitives from outside JAX; it warns when it sends operands amp had moved to
# half precision back.

# PyTorch autocast's "lower precision" list: matmuls and convolutions.
# ragged_dot_general is the grouped matmul of mixture-of-experts layers.

# From PyTorch autocast's float32 list, in lax terms: ops whose accuracy suffers
# in half precision (sums lose bits, log near 1 loses digits).
_FULL_PRECISION_PRIMITIVES = (
    "log",
    "log1p",
    "log2",
    "rsqrt",
    "erf_inv",
    "lgamma",
    "digamma",
    "igamma",
    "igammac",
    "igamma_grad_a",
    "polygamma",
    "zeta",
    "bessel_i0e",
    "bessel_i1e",
    "regularized_incomplete_beta",
    "tan",
    "acos",
    "asin",
    "acosh",
    "asinh",
    "atanh",
    "reduce_sum",
    "reduce_prod",
    "cumsum",
    "cumprod",
    "cumlogsumexp",
    "reduce_precision",
    # Scatters that combine values carry a combiner jaxpr typed for the
    # original dtype (they appear in amp(jax.grad(f)), as transposed gathers).
    "scatter-add",
    "scatter-sub",
    "scatter-mul",
    "scatter-min",
    "scatter-max",
)

# The rest of PyTorch's float32 list: ops that overflow float16's range.
_RANGE_LIMITED_PRIMITIVES = ("exp", "exp2", "expm1", "pow", "cosh", "sinh")

# Elementwise, structural and communication ops: they follow their operands
# (see use_current_precision).
_CURRENT_PRECISION_PRIMITIVES = (
    # n-ary elementwise
    "add",
    "add_any",
    "sub",
    "mul",
    "div",
    "rem",
    "max",
    "min",
    "atan2",
    "select_n",
    "clamp",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "eq_to",
    "lt_to",
    "le_to",
    "and",
    "or",
    "xor",
    "not",
    # Horner's rule (jnp.polyval, jnp.sinc from JAX 0.12): JAX 0.10 ran
    # these as mul and add.
    "polynomial",
    # unary elementwise
    "neg",
    "abs",
    "sign",
    "floor",
    "ceil",
    "round",
    "is_finite",
    "tanh",
    "logistic",
    "sin",
    "cos",
    "atan",
    "sqrt",
    "cbrt",
    "square",
    "integer_pow",
    "erf",
    "erfc",
    "real",
    "imag",
    "convert_element_type",
    # 1 - x**2, the derivative of tanh, asin, acos and atanh from JAX 0.11.2:
    # JAX 0.10 ran it as square (or mul) and sub.
    "one_minus_square",
    # reductions that pick an element, and integer-only ops
    "reduce_max",
    "reduce_min",
    "reduce_and",
    "reduce_or",
    "reduce_xor",
    "argmax",
    "argmin",
    "cummax",
    "cummin",
    "clz",
    "population_count",
    "shift_left",
    "shift_right_arithmetic",
    "shift_right_logical",
    "mulhi",
    # structural
    "reshape",
    "transpose",
    "broadcast_in_dim",
    "squeeze",
    "stack",
    "unstack",
    "tile",
    "slice",
    "dynamic_slice",
    "dynamic_update_slice",
    "gather",
    "concatenate",
    "pad",
    "rev",
    "iota",
    "select_and_gather_add",
    "sort",
    "top_k",
    "approx_top_k",
    "scatter",
    "split",
    "zeros_like",
    "reduce_window_sum",
    "reduce_window_max",
    "reduce_window_min",
    "select_and_scatter_add",
    # Identities that name, place or order a value. A float32 copy of a named
    # value (checkpoint_name's "name", the idiom of remat policies such as
    # save_only_these_names) would double what the policy saves.
    "name",
    "copy",
    "stop_gradient",
    "optimization_barrier",
    "tie",
    "stage",
    "sharding_constraint",
    "reshard",
    "device_put",
    "shard_alike",
    "layout_constraint",
    "relayout",
    "dce_sink",
    # Collectives: a tensor-parallel layer keeps its compute dtype across its
    # all-reduce (lax.psum binds psum_invariant inside shard_map), and so do
    # the casts between varying, invariant, reduced and unreduced values.
    "psum",
    "psum_invariant",
    "pmax",
    "pmin",
    "unreduced_psum",
    "unreduced_pmax",
    "unreduced_pmin",
    "all_gather",
    "all_gather_invariant",
    "all_gather_reduced",
    "all_to_all",
    "ragged_all_to_all",
    "ppermute",
    "psend",
    "precv",
    "reduce_scatter",
    "unreduced_reduce_scatter",
    "axis_index",
    "pbroadcast",
    "pbroadcast_dynamic",
    "pvary",
    "preduced",
    "reduced_vary_cast",
    "reduced_vary_cast_p",
    "vary_unreduced_cast",
    "vary_unreduced_cast_p",
    "all_gather_start",
    "all_gather_done",
    "all_gather_reduced_start",
    "psum_start",
    "psum_invariant_start",
    "unreduced_psum_start",
    "psum_done",
    "reduce_scatter_start",
    "unreduced_reduce_scatter_start",
    "reduce_scatter_done",
    "all_to_all_start",
    "all_to_all_done",
    "ppermute_start",
    "ppermute_done",
    "pbroadcast_start",
    "pbroadcast_done",
    # No floating operand (tokens, random keys, shapes): no rule casts anything.
    "after_all",
    "create_token",
    "empty",
    "empty2",
    "platform_index",
    "rng_bit_generator",
    "random_seed",
    "random_bits",
    "random_split",
    "random_fold_in",
    "random_wrap",
    "random_unwrap",
    "random_clone",
    "threefry2x32",
    "iota_2x32_shape",
)

# Deliberately kept at original precision, whatever amp holds their operands
# in: what these compute is defined by, or implemented only for, the dtypes the
# program gave them. Not an accuracy judgement, as the float32 list above is.
_ORIGINAL_PRECISION_PRIMITIVES = (
    # Linear algebra: LAPACK and cuSOLVER kernels take float32 and wider, and a
    # factorisation multiplies rounding errors by the matrix's condition number.
    "cholesky",
    "cholesky_update",
    "eig",
    "eigh",
    "geqp3",
    "geqrf",
    "hessenberg",
    "householder_product",
    "lu",
    "lu_pivots_to_permutation",
    "ormqr",
    "qr",
    "schur",
    "svd",
    "symmetric_product",
    "triangular_solve",
    "tridiagonal",
    "tridiagonal_solve",
    # FFT: XLA's FFT takes float32 and complex64 and wider only.
    "fft",
    # Defined by the operand's dtype: a bitcast reinterprets its bits,
    # nextafter steps one unit in its last place (2**13 float32 steps in
    # float16); conj and complex take float32 and wider only; extended-dtype
    # conversions and block-scaled matmuls take the exact (quantised) dtypes
    # the program chose.
    "bitcast_convert_type",
    "nextafter",
    "conj",
    "complex",
    "to_edtype",
    "from_edtype",
    "scaled_dot",
    "scaled_matmul",
    "scaled_matmul_wrapper",
    # Host callbacks: the host function was written for the dtypes it was
    # declared with (most numpy and scipy code has no bfloat16).
    "pure_callback",
    "io_callback",
    "debug_callback",
    "debug_print",
    "inspect_sharding",
    "buffer_callback",
    # Compiled kernels (FFI calls, Pallas, cuDNN attention), built for the
    # dtypes they were traced with.
    "ffi_call",
    "pallas_call",
    "dot_product_attention_fwd",
    "dot_product_attention_bwd",
    "dot_product_attention_fwd_wrapper",
    "dot_product_attention_bwd_wrapper",
    "dot_product_attention_fp8_fwd",
    "dot_product_attention_fp8_bwd",
    "dot_product_attention_fp8_fwd_wrapper",
    "dot_product_attention_fp8_bwd_wrapper",
    # Bodies traced for the original dtypes, which amp does not rewrite: the
    # computations of generic reductions and windows, linear solves,
    # composites, JAX 0.10's eval_jaxpr (from 0.12 the closed call, which has a
    # handler), and primitives defined in Python (hijax: JAX 0.12's
    # jnp.searchsorted, nonzero, ldexp, frexp), built for their operands' types.
    "reduce",
    "reduce_window",
    "select_and_scatter",
    "custom_linear_solve",
    "composite",
    "eval_jaxpr",
    "call_hi_primitive",
    # Mutable arrays keep the dtype they were created with.
    "new_ref",
    "freeze",
    "get",
    "swap",
    "addupdate",
    # Samplers draw in the dtype the program asked for.
    "random_gamma",
    "rng_uniform",
)

# Each name list with its rule. A name belongs to one list (tests check).
_RULES_BY_NAME_LIST = (
    (COMPUTE_PRIMITIVES, use_compute_precision),
    (_FULL_PRECISION_PRIMITIVES, use_original_precision),
    (_RANGE_LIMITED_PRIMITIVES, use_full_range_precision),
    (_CURRENT_PRECISION_PRIMITIVES, use_current_precision),
    (_ORIGINAL_PRECISION_PRIMITIVES, use_original_precision),
)

# Names of the lists above that only some supported JAX releases (0.10.0 to
# 0.12.x) define: name -> (first release defining it, first release no longer
# defining it), None where open. Every other name must resolve on every
# supported release, and these exactly where their range says (checked by
# tests/test_default_table.py on the running release).
_RELEASE_SPECIFIC_NAMES: dict[str, tuple[tuple[int, ...] | None, tuple[int, ...] | None]] = {
    "stack": ((0, 10, 1), None),
    "stage": ((0, 10, 1), None),
    "unstack": ((0, 10, 1), None),
    "mulhi": ((0, 10, 2), None),
    "relayout": ((0, 11, 1), None),
    "unreduced_pmax": ((0, 11, 1), None),
    "unreduced_pmin": ((0, 11, 1), None),
    "log2": ((0, 11, 2), None),
    "one_minus_square": ((0, 11, 2), None),
    "polynomial": ((0, 12, 0), None),
    "pbroadcast_dynamic": ((0, 12, 0), None),
    "reduced_vary_cast": ((0, 12, 0), None),
    "vary_unreduced_cast": ((0, 12, 0), None),
    "reduced_vary_cast_p": (None, (0, 12, 0)),
    "vary_unreduced_cast_p": (None, (0, 12, 0)),
    "pbroadcast_start": (None, (0, 11, 1)),
    "pbroadcast_done": (None, (0, 11, 1)),
    "psum_start": (None, (0, 11, 1)),
    "unreduced_psum_start": (None, (0, 11, 1)),
    "unreduced_reduce_scatter_start": (None, (0, 11, 1)),
    "shard_alike": (None, (0, 11, 2)),
}


def _primitive_names() -> set[str]:
    """Every primitive name the default table lists."""
    return {name for names, _ in _RULES_BY_NAME_LIST for name in names}


def _default_table() -> dict[Any, Rule]:
    table: dict[Any, Rule] = {"amp_stop": use_original_precision, "amp_default": use_original_precision}
    # Equinox's normalisation layers open these scopes. PyTorch keeps layer and
    # group norm in float32 too: their variance squares activations.
    for layer in ("LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm"):
        table[f"eqx.nn.{layer}"] = use_normalisation_precision
    for names, rule in _RULES_BY_NAME_LIST:
        table.update(dict.fromkeys(names, rule))
    return table


def _resolve_primitive_names(table: dict[Any, Rule]) -> dict[Any, Rule]:
    """`table` with each primitive name replaced by the primitive of that name.

    The table is keyed by primitive objects (as the seed documents, e.g.
    `jax.lax.add_p`) and scope strings; primitive names only make the lists
    above readable. A listed name the running JAX does not define is left out:
    `_unresolved_primitive_names` says which, and tests check each is one
    `_RELEASE_SPECIFIC_NAMES` expects this release to lack.
    """
    by_name = _compat.primitives_by_name()
    names = _primitive_names()
    return {
        by_name[key] if key in names else key: rule for key, rule in table.items() if key not in names or key in by_name
    }


def _unresolved_primitive_names() -> set[str]:
    """The names of the default table that the running JAX defines no primitive for."""
    return _primitive_names() - _compat.primitives_by_name().keys()


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
        # norm layer wrote them (see `jaxamp.analyses._statistics`).
        "amp_statistics": use_original_precision,
        # exp(x - max(x)) and the like: results in (0, 1], safe in float16
        # (see `jaxamp.analyses._ranges`).
        "amp_range": use_current_precision,
        # What runs after the program's last matmul (the loss): float32, as
        # PyTorch's autocast runs its loss functions (see `jaxamp.analyses._tail`).
        "amp_tail": use_original_precision,
        # A matmul whose program asked for a precision (`requested_precision`)
        # or widened its operands from half precision (`jaxamp.analyses._upcasts`):
        # run as written.
        "amp_requested": use_original_precision,
    }
)
"""The default amp policy table (read-only; see `PolicyTable`)."""
