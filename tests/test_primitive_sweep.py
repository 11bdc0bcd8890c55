"""Every floating-point-relevant `jax.lax` primitive through `jaxamp.amp`.

Each case is a small function and its inputs. It runs plainly (the float32
reference) and through ``amp`` with float16 and with bfloat16, along two routes:

* ``f32``: the operands arrive as the caller gave them, so the rule table's
  "follow the operands" and "original precision" rules see float32 values;
* ``half``: every floating operand first goes through a matmul that amp runs in
  the compute dtype (a ``dot_general`` with the scalar 1, which only rounds), so
  the primitive under test receives half-precision operands, as it would after
  a linear layer.

For every case and route: no crash; the output's pytree structure, shapes and
dtypes equal the plain function's; floating outputs are within a per-dtype
tolerance of float32 (`UNIT_ROUNDOFF` times the case's ``ulps``); integer and
boolean outputs are exactly equal. Inputs are chosen so that rounding them to
half precision cannot flip a discrete result: values that decide comparisons,
sorts, argmax, floor/round or a rem quotient are exactly representable in both
half types and at least 1/8 apart, and continuous ops get domains where they are
well conditioned.

JAX's own catalogue of lax operations (`jax_catalogue.lax_op_catalogue`) is
swept too, one case per operation and float dtype it accepts, so an operation a
new JAX release adds is tested before a user meets it: every primitive it binds
has an entry in the default table, and under amp, along both routes, it runs,
returns the plain function's dtypes and shapes, and never receives a float
dtype the catalogue does not list for it.

Then, with no tolerance at all: integer, boolean, float64 and complex programs
pass through amp bit-for-bit with no convert_element_type added;
`lax.bitcast_convert_type` sees its operand's original dtype; every matmul and
convolution of the amp'd jaxpr takes compute-dtype operands; a `pure_callback`
receives float32.

No case may reach amp's fallbacks: a warning that the policy table has no entry
for a primitive, or that amp has no handler for a higher-order one, fails it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import jaxamp
from jaxamp.transform import _interpreter

from jax_catalogue import lax_op_catalogue
from jaxpr_walk import assert_all_matmuls_in, float_operand_dtypes, iter_eqns

F32, F16, BF16 = np.dtype(jnp.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16)
SHORT_NAMES = {F16: "f16", BF16: "bf16"}
# The oldest-JAX leg of .ci/run runs every case on float16 operands with
# float16 compute; bfloat16's runs and the float32 route (the same operations
# behind a cast) take the same code paths.
COMPUTE_DTYPES = [
    pytest.param(d, id=name, marks=pytest.mark.newest_only if d == BF16 else ()) for d, name in SHORT_NAMES.items()
]
ROUTES = ("f32", "half")

# Unit roundoff u (half the gap between 1 and the next float): float16 keeps 11
# significant bits (10 stored), bfloat16 only 8 (7 stored) with float32's
# exponent range, so one rounding moves a value by at most u relative.
UNIT_ROUNDOFF = {F16: 2.0**-11, BF16: 2.0**-8}

# An elementwise op fed rounded operands, computing in half precision and
# rounding its result errs by a few u: each operand's rounding (times the op's
# condition number, kept near 1 by the domains below) plus the op's own and its
# result's rounding. 8 u covers that with a margin.
DEFAULT_ULPS = 8
# Ops that accumulate a handful of terms (reductions over <= 12 elements,
# cumulative ops, matmuls and convolutions over <= 18 products, softmax's sum)
# add about one rounding per term; and a few-step algorithm (linear algebra on
# a well-conditioned 4x4 matrix, FFTs over 8 points, gradients through two
# such ops) multiplies the error by a small condition number.
ACCUMULATING_ULPS = 32
ALGORITHM_ULPS = 64

pytestmark = [
    pytest.mark.jax_internals,
    pytest.mark.filterwarnings("error:amp policy table:UserWarning"),
    pytest.mark.filterwarnings("error:jaxamp has no handler:UserWarning"),
    pytest.mark.usefixtures("fresh_warnings"),
]


# Fixed inputs: the same every run, so a pass is not luck of the draw.
RNG = np.random.default_rng(0)
SHAPE = (3, 4)


# --- inputs ----------------------------------------------------------------------


def uniform(lo, hi, shape=SHAPE):
    """float32 values in [lo, hi): for ops that are continuous there."""
    return RNG.uniform(lo, hi, shape).astype(np.float32)


def distinct(shape=SHAPE):
    """Distinct multiples of 1/8 around zero: exact in both half types, 1/8 apart."""
    n = int(np.prod(shape))
    return ((RNG.permutation(n) - n // 2) / 8).reshape(shape).astype(np.float32)


def off_integer(shape=SHAPE):
    """Exactly representable values at least 1/8 from any integer or half-integer.

    floor, ceil, round, rem and float-to-int conversion jump at those points.
    """
    fractions = RNG.choice([0.125, 0.375, 0.625, 0.875], shape)
    return (RNG.integers(-3, 4, shape) + fractions).astype(np.float32)


def ints(hi, shape=SHAPE, dtype=np.int32):
    return RNG.integers(0, hi, shape).astype(dtype)


def spd(n=4):
    """A symmetric positive definite matrix with condition number below 3."""
    b = RNG.uniform(-0.5, 0.5, (n, n))
    return (np.eye(n) * n + b @ b.T).astype(np.float32)


# --- cases and routes ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    fn: Callable
    args: tuple
    ulps: float = DEFAULT_ULPS


def case(name, fn, *args, ulps=DEFAULT_ULPS):
    return Case(name, fn, args, ulps)


def unary(name, fn, lo, hi, **kwargs):
    return case(name, fn, uniform(lo, hi), **kwargs)


def is_float32(x):
    return isinstance(x, (np.ndarray, jax.Array)) and x.dtype == F32


def to_compute_dtype(x):
    """``x * 1`` as an elementwise matmul: amp runs it (and so returns it) in half.

    A dot_general with no contracting dimensions against a scalar multiplies
    each element by 1, so inf and nan survive and nothing but rounding changes.
    """
    if not is_float32(x):
        return x
    return lax.dot_general(x, jnp.float32(1), (((), ()), ((), ())))


def routed(fn, route):
    if route == "f32":
        return fn

    @functools.wraps(fn)
    def half_operands(*args):
        return fn(*jax.tree.map(to_compute_dtype, args))

    return half_operands


def assert_same_types(actual, expected):
    """Same pytree; leaves of the same dtypes and shapes (arrays or `jax.ShapeDtypeStruct`s).

    Returns the leaves, as ``(actual, expected)`` pairs.
    """
    actual_leaves, actual_tree = jax.tree.flatten(actual)
    expected_leaves, expected_tree = jax.tree.flatten(expected)
    assert actual_tree == expected_tree
    for a, e in zip(actual_leaves, expected_leaves):
        assert (np.dtype(a.dtype), a.shape) == (np.dtype(e.dtype), e.shape)
    return list(zip(actual_leaves, expected_leaves))


def assert_matches(actual, expected, rtol, *, magnitude=0.0):
    """Same pytree, shapes and dtypes; floats within `rtol`, the rest exact.

    The absolute tolerance is `rtol` times the output's largest finite
    magnitude, or `magnitude` where that is larger: outputs that cancel to near
    zero (sin near pi, a sum of mixed signs) or that a last step squashes carry
    the error of the magnitudes they were computed from.
    """
    for a, e in assert_same_types(actual, expected):
        a, e = np.asarray(a), np.asarray(e)
        if jnp.issubdtype(e.dtype, jnp.inexact):
            wide = np.complex128 if jnp.issubdtype(e.dtype, jnp.complexfloating) else np.float64
            a, e = a.astype(wide), e.astype(wide)
            scale = np.max(np.abs(e[np.isfinite(e)]), initial=magnitude)
            np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale, equal_nan=True)
        else:
            np.testing.assert_array_equal(a, e)


def check(c: Case, dtype, route):
    fn = routed(c.fn, route)
    args = jax.tree.map(jnp.asarray, c.args)  # as a jax user holds them: `.at` works
    expected = fn(*args)
    actual = jaxamp.amp(fn, compute_dtype=dtype)(*args)
    assert_matches(actual, expected, UNIT_ROUNDOFF[dtype] * c.ulps)
    # What fn returns, amp returns: an Array stays an Array, weak types too.
    assert jax.tree.map(_leaf_kind, actual) == jax.tree.map(_leaf_kind, expected)


def _leaf_kind(leaf):
    if isinstance(leaf, jax.Array):
        return ("Array", jax.typeof(leaf).weak_type)
    return type(leaf)


def runs(c: Case, *, f32_route_dtypes=(F16,)):
    """The (case, dtype, route) parameters of `c`.

    The ``half`` route runs with each compute dtype. Along the ``f32`` route
    only matmuls and convolutions see the compute dtype (everything else keeps
    float32 operands and so runs the same program whatever it is): one compute
    dtype covers it, and the sweeps of cases with matmuls ask for both
    (`f32_route_dtypes`).
    """
    combos = [("half", F16), ("half", BF16)] + [("f32", d) for d in f32_route_dtypes]
    return [
        pytest.param(
            c,
            dtype,
            route,
            id=f"{c.name}-{route}-{SHORT_NAMES[dtype]}",
            marks=pytest.mark.newest_only if dtype == BF16 or route == "f32" else (),
        )
        for route, dtype in combos
    ]


def sweep(cases, *, oldest_jax=True, **kwargs):
    """Parametrize a test over `cases` x compute dtypes x routes (see `runs`).

    ``oldest_jax=False``: the oldest-JAX leg of .ci/run skips the whole sweep
    (operations amp treats alike whatever their primitive: JAX's own catalogue
    of them runs there, in `test_catalogue_operation_under_amp`).
    """
    params = [p for c in cases for p in runs(c, **kwargs)]
    if not oldest_jax:
        params = [pytest.param(*p.values, id=p.id, marks=pytest.mark.newest_only) for p in params]
    return pytest.mark.parametrize("c, dtype, route", params)


# --- elementwise ------------------------------------------------------------------------

# Unary ops on domains where they are well conditioned: away from poles,
# branch points, zeros of the result where the op is steep, and overflow.
UNARY_DOMAINS = {
    lax.exp: (-3, 3),
    lax.exp2: (-3, 3),
    lax.log: (0.5, 4),
    lax.log1p: (-0.5, 2),
    lax.expm1: (-2, 2),
    lax.tanh: (-3, 3),
    lax.logistic: (-4, 4),
    lax.sin: (-3, 3),
    lax.cos: (-3, 3),
    lax.tan: (-1.2, 1.2),
    lax.asin: (-0.9, 0.9),
    lax.acos: (-0.9, 0.9),
    lax.atan: (-3, 3),
    lax.sinh: (-3, 3),
    lax.cosh: (-3, 3),
    lax.asinh: (-3, 3),
    lax.acosh: (1.2, 4),
    lax.atanh: (-0.9, 0.9),
    lax.sqrt: (0.1, 4),
    lax.rsqrt: (0.1, 4),
    lax.cbrt: (-4, 4),
    lax.erf: (-2, 2),
    lax.erfc: (-2, 2),
    lax.erf_inv: (-0.9, 0.9),
    lax.lgamma: (0.5, 4),
    lax.digamma: (0.5, 4),
    lax.bessel_i0e: (-3, 3),
    lax.bessel_i1e: (-3, 3),
}

UNARY = [
    *(unary(op.__name__, op, lo, hi) for op, (lo, hi) in UNARY_DOMAINS.items()),
    unary("square", lax.square, -3, 3),
    unary("log2", jnp.log2, 0.5, 4),  # one primitive from JAX 0.11.2, log and div before
    # Each one polynomial primitive (Horner's rule) from JAX 0.12, mul and add before.
    unary("polyval", lambda x: jnp.polyval(jnp.array([0.5, -1.0, 2.0]), x), -1, 1, ulps=ACCUMULATING_ULPS),
    unary("sinc", jnp.sinc, -1.5, 1.5, ulps=ACCUMULATING_ULPS),
    unary("integer_pow", lambda x: lax.integer_pow(x, 3), -2, 2),
    unary("integer_pow_negative", lambda x: lax.integer_pow(x, -2), 0.5, 2),
    unary("pow_scalar_exponent", lambda x: lax.pow(x, 2.5), 0.5, 2),
    unary("neg", lax.neg, -3, 3),
    case("abs", lax.abs, distinct()),
    case("sign", lax.sign, np.array([[-2.5, -0.0, 0.0, 1.25]], np.float32)),
    case("floor", lax.floor, off_integer()),
    case("ceil", lax.ceil, off_integer()),
    case("round_away", lax.round, off_integer()),
    case("round_even", lambda x: lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN), off_integer()),
    case("is_finite", lax.is_finite, np.array([1.5, np.inf, -np.inf, np.nan, -0.0], np.float32)),
    # Replacement values a half type can hold: nan_to_num's default,
    # finfo(float32).max, saturates to the half type's largest finite value
    # (see test_amp.py's saturation test).
    case(
        "isnan_nan_to_num",
        lambda x: (jnp.isnan(x), jnp.nan_to_num(x, posinf=1e4, neginf=-1e4)),
        np.array([1.5, np.inf, -np.inf, np.nan], np.float32),
    ),
    unary("reduce_precision_f16", lambda x: lax.reduce_precision(x, 5, 10), -3, 3),
    unary("reduce_precision_bf16", lambda x: lax.reduce_precision(x, 8, 7), -3, 3),
    unary("astype_float16", lambda x: x.astype(jnp.float16), -3, 3),
    # Under float16 this rounds twice (to float16, then to bfloat16): up to one
    # bfloat16 roundoff, which is 8 float16 ones.
    unary("astype_bfloat16", lambda x: x.astype(jnp.bfloat16), -3, 3, ulps=2 * DEFAULT_ULPS),
    case("astype_int32", lambda x: x.astype(jnp.int32), off_integer()),
    unary("real_imag_complex", lambda x: lax.complex(x, 2 * x), -2, 2),
]

BINARY = [
    case("add", lax.add, uniform(-2, 2), uniform(-2, 2)),
    case("sub", lax.sub, uniform(-2, 2), uniform(-2, 2)),
    case("mul", lax.mul, uniform(-2, 2), uniform(-2, 2)),
    case("div", lax.div, uniform(-2, 2), uniform(0.5, 2) * RNG.choice([-1, 1], SHAPE).astype(np.float32)),
    case("rem", lax.rem, np.array([2.5, -3.75, 5.25, 0.5], np.float32), np.array([1.5, 1.625, 2.0, 0.75], np.float32)),
    case("max", lax.max, distinct(), distinct()),
    case("min", lax.min, distinct(), distinct()),
    case("atan2", lax.atan2, uniform(-2, 2), uniform(0.5, 2)),
    case("nextafter", lax.nextafter, distinct(), distinct()),
    case("pow", lax.pow, uniform(0.5, 2), uniform(-2, 2)),
    case("igamma", lax.igamma, uniform(1, 3), uniform(0.5, 3)),
    case("igammac", lax.igammac, uniform(1, 3), uniform(0.5, 3)),
    case("polygamma", lambda x: lax.polygamma(jnp.ones_like(x), x), uniform(0.5, 3)),
    case("zeta", lax.zeta, uniform(2, 4), uniform(0.5, 2)),
    case("broadcast_scalar_operand", lambda x: x * 3.0 + 1.0, uniform(-2, 2)),
    case("logaddexp_hypot", lambda x, y: (jnp.logaddexp(x, y), jnp.hypot(x, y)), uniform(-2, 2), uniform(0.5, 2)),
    # Queries 1/16 off the grid of sorted points: rounding moves none across one.
    case(
        "searchsorted_interp",
        lambda s, q: (jnp.searchsorted(s, q), jnp.interp(q, s, jnp.sin(s))),
        np.sort(distinct((12,))),
        distinct() + np.float32(1 / 16),
    ),
]

# Some pairs equal, the others at least 1/8 apart: rounding cannot flip them.
_LEFT = distinct()
_RIGHT = np.where(RNG.random(SHAPE) < 0.4, _LEFT, distinct()).astype(np.float32)

SELECTION = [
    *(case(f"compare_{op.__name__}", op, _LEFT, _RIGHT) for op in (lax.eq, lax.ne, lax.lt, lax.le, lax.gt, lax.ge)),
    case("select_n_bool", lambda p, a, b: lax.select_n(p, a, b), ints(2).astype(bool), uniform(-2, 2), uniform(-2, 2)),
    case(
        "select_n_int32",
        lambda i, a, b, c: lax.select_n(i, a, b, c),
        ints(3),
        uniform(-2, 2),
        uniform(-2, 2),
        uniform(-2, 2),
    ),
    case("where_from_compare", lambda x, y: jnp.where(x > 0, x, y), distinct(), uniform(-2, 2)),
    case("clamp_scalar_bounds", lambda x: lax.clamp(np.float32(-0.5), x, np.float32(0.5)), distinct()),
    case("clamp_array_bounds", lax.clamp, uniform(-2, -1), uniform(-3, 3), uniform(1, 2)),
    case("clip", lambda x: jnp.clip(x, -1.0, 1.0), distinct()),
]

# --- reductions and cumulative ops ----------------------------------------------------------

REDUCTIONS = [
    case("reduce_sum", lambda x: (jnp.sum(x), jnp.sum(x, axis=0)), uniform(-2, 2), ulps=ACCUMULATING_ULPS),
    case("reduce_prod", lambda x: jnp.prod(x, axis=1), uniform(0.8, 1.25), ulps=ACCUMULATING_ULPS),
    case("reduce_max", lambda x: (jnp.max(x), jnp.max(x, axis=1)), distinct()),
    case("reduce_min", lambda x: (jnp.min(x), jnp.min(x, axis=0)), distinct()),
    case("argmax", lambda x: (jnp.argmax(x), jnp.argmax(x, axis=1)), distinct()),
    case("argmin", lambda x: (jnp.argmin(x), jnp.argmin(x, axis=0)), distinct()),
    case("reduce_and_or_of_compare", lambda x: (jnp.all(x > 0, axis=1), jnp.any(x > 1, axis=0)), distinct()),
    case(
        "reduce_and_or_xor_bools",
        lambda b: (jnp.all(b, axis=1), jnp.any(b), lax.reduce_xor(b, (0,))),
        ints(2).astype(bool),
    ),
    case(
        "mean_var_std",
        lambda x: (jnp.mean(x, axis=1), jnp.var(x), jnp.std(x, axis=0)),
        uniform(-2, 2),
        ulps=ACCUMULATING_ULPS,
    ),
    case(
        "cumsum",
        lambda x: (lax.cumsum(x, axis=1), lax.cumsum(x, axis=0, reverse=True)),
        uniform(0, 2),
        ulps=ACCUMULATING_ULPS,
    ),
    case(
        "cumprod",
        lambda x: (lax.cumprod(x, axis=1), lax.cumprod(x, axis=0, reverse=True)),
        uniform(0.8, 1.25),
        ulps=ACCUMULATING_ULPS,
    ),
    case("cummax", lambda x: (lax.cummax(x, axis=1), lax.cummax(x, axis=0, reverse=True)), distinct()),
    case("cummin", lambda x: (lax.cummin(x, axis=1), lax.cummin(x, axis=0, reverse=True)), distinct()),
    case("cumlogsumexp", lambda x: lax.cumlogsumexp(x, axis=1), uniform(-2, 2), ulps=ACCUMULATING_ULPS),
    case(
        "jnp_cumsum_cumprod",
        lambda x: (jnp.cumsum(x), jnp.cumprod(x, axis=0)),
        uniform(0.8, 1.25),
        ulps=ACCUMULATING_ULPS,
    ),
]

# --- structural ------------------------------------------------------------------------------

STRUCTURAL = [
    case("reshape", lambda x: x.reshape(2, 6), uniform(-2, 2)),
    case("transpose", lambda x: lax.transpose(x[None], (2, 0, 1)), uniform(-2, 2)),
    case("broadcast_in_dim", lambda x: lax.broadcast_in_dim(x, (2, 3, 4), (1, 2)), uniform(-2, 2)),
    case("squeeze_expand_dims", lambda x: lax.squeeze(lax.expand_dims(x, (0, 2)), (0,)), uniform(-2, 2)),
    case("slice_strided", lambda x: lax.slice(x, (0, 1), (3, 4), (2, 2)), uniform(-2, 2)),
    case("dynamic_slice", lambda x, i: lax.dynamic_slice(x, (i, 1), (2, 2)), uniform(-2, 2), np.int32(1)),
    case("dynamic_slice_clamped_index", lambda x, i: lax.dynamic_slice(x, (i, i), (2, 2)), uniform(-2, 2), np.int32(7)),
    case(
        "dynamic_update_slice",
        lambda x, u, i: lax.dynamic_update_slice(x, u, (i, 0)),
        uniform(-2, 2),
        uniform(-2, 2, (1, 4)),
        np.int32(2),
    ),
    case("concatenate", lambda x, y: lax.concatenate([x, y, x], 0), uniform(-2, 2), uniform(-2, 2, (2, 4))),
    case("pad_interior_negative", lambda x: lax.pad(x, np.float32(0.5), [(1, 2, 1), (-1, 0, 0)]), uniform(-2, 2)),
    case("pad_with_traced_value", lambda x, v: lax.pad(x, v, [(1, 1, 0), (0, 2, 1)]), uniform(-2, 2), np.float32(1.5)),
    case("rev", lambda x: lax.rev(x, (0, 1)), uniform(-2, 2)),
    case("iota", lambda x: x + lax.broadcasted_iota(jnp.float32, x.shape, 1), uniform(-2, 2)),
    case("split", lambda x: jnp.split(x, [1, 3], axis=1), uniform(-2, 2)),
    case("tile_roll", lambda x: jnp.roll(jnp.tile(x, (1, 2)), 3, axis=1), uniform(-2, 2)),
]

# --- gather and scatter ------------------------------------------------------------------------

# amp(jax.grad(f)) hits the same bug wherever a gather's transpose is a scatter-add.
_ROWS = np.array([2, 0, 2, 1], np.int32)  # duplicates: scatters must combine them
_UNIQUE_ROWS = np.array([2, 0], np.int32)

GATHER_SCATTER = [
    case("gather_rows", lambda x, i: x[i], uniform(-2, 2), _ROWS),
    case("gather_columns", lambda x, i: x[:, i], uniform(-2, 2), _ROWS),
    case("take_along_axis", lambda x, i: jnp.take_along_axis(x, i, axis=1), uniform(-2, 2), ints(4)),
    case(
        "gather_fill_out_of_bounds",
        lambda x: x.at[jnp.array([0, 7, 2])].get(mode="fill", fill_value=-1.0),
        uniform(-2, 2),
    ),
    case("scatter_set", lambda x, u: x.at[_UNIQUE_ROWS].set(u), uniform(-2, 2), uniform(-2, 2, (2, 4))),
    case("scatter_add", lambda x, u: x.at[_ROWS].add(u), uniform(-2, 2), uniform(-2, 2, (4, 4))),
    case("scatter_mul", lambda x, u: x.at[_ROWS].multiply(u), uniform(-2, 2), uniform(0.5, 1.5, (4, 4))),
    case("scatter_min", lambda x, u: x.at[_ROWS].min(u), distinct(), distinct((4, 4))),
    case("scatter_max", lambda x, u: x.at[_ROWS].max(u), distinct(), distinct((4, 4))),
    case(
        "scatter_add_drop_out_of_bounds",
        lambda x, u: x.at[jnp.array([0, 9])].add(u, mode="drop"),
        uniform(-2, 2),
        uniform(-2, 2, (2, 4)),
    ),
    case(
        "lax_scatter_add",
        lambda x, u: lax.scatter_add(
            x,
            _ROWS[:, None],
            u,
            lax.ScatterDimensionNumbers(
                update_window_dims=(1,), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,)
            ),
        ),
        uniform(-2, 2),
        uniform(-2, 2, (4, 4)),
    ),
]

# --- sort and top_k ------------------------------------------------------------------------------

SORTING = [
    case("sort", lambda x: (jnp.sort(x, axis=1), jnp.sort(x, axis=0, descending=True)), distinct()),
    case("sort_multi_operand", lambda k, v, i: lax.sort((k, v, i), num_keys=1), distinct(), uniform(-2, 2), ints(100)),
    case(
        "sort_two_keys",
        lambda k1, k2, v: lax.sort((k1, k2, v), num_keys=2),
        np.floor(distinct()).astype(np.float32),
        distinct(),
        uniform(-2, 2),
    ),
    case("argsort", lambda x: jnp.argsort(x, axis=1), distinct()),
    case("top_k", lambda x: lax.top_k(x, 3), distinct()),
    case("approx_max_k", lambda x: lax.approx_max_k(x, 2), distinct()),
]

# --- windows -----------------------------------------------------------------------------------

_IMAGE = (5, 6)


def _window(x, init, op, padding="VALID"):
    return lax.reduce_window(x, np.float32(init), op, (2, 2), (1, 2), padding)


WINDOWS = [
    case("reduce_window_sum", lambda x: _window(x, 0, lax.add), uniform(-2, 2, _IMAGE)),
    case("reduce_window_max", lambda x: _window(x, -np.inf, lax.max, "SAME"), distinct(_IMAGE)),
    case("reduce_window_min", lambda x: _window(x, np.inf, lax.min), distinct(_IMAGE)),
    case("avg_pool", lambda x: _window(x, 0, lax.add, "SAME") / 4, uniform(-2, 2, _IMAGE)),
    # Lambdas are not recognised as monoids: these bind the generic
    # reduce_window with the computation as a jaxpr.
    case("reduce_window_generic_add", lambda x: _window(x, 0, lambda a, b: a + b), uniform(-2, 2, _IMAGE)),
    case("reduce_window_generic_max", lambda x: _window(x, -np.inf, lambda a, b: jnp.maximum(a, b)), distinct(_IMAGE)),
    case(
        "reduce_window_dilated",
        lambda x: lax.reduce_window(
            x, np.float32(0), lax.add, (2, 2), (1, 1), "VALID", base_dilation=(2, 1), window_dilation=(1, 2)
        ),
        uniform(-2, 2, _IMAGE),
    ),
]

# --- matmuls and convolutions --------------------------------------------------------------------

_NWC, _NCHW = ("NWC", "WIO", "NWC"), ("NCHW", "OIHW", "NCHW")
_GROUPS = np.array([2, 1, 3], np.int32)

MATMULS = [
    case(
        "matmul_bias",
        lambda x, w, b: x @ w + b,
        uniform(-1, 1),
        uniform(-1, 1, (4, 5)),
        uniform(-1, 1, (5,)),
        ulps=ACCUMULATING_ULPS,
    ),
    case(
        "dot_general_batch_dims",
        lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
        uniform(-1, 1, (2, 3, 4)),
        uniform(-1, 1, (2, 4, 5)),
        ulps=ACCUMULATING_ULPS,
    ),
    case(
        "dot_general_batch_and_contract_first",
        lambda a, b: lax.dot_general(a, b, (((0,), (1,)), ((2,), (0,)))),
        uniform(-1, 1, (4, 3, 2)),
        uniform(-1, 1, (2, 4, 5)),
        ulps=ACCUMULATING_ULPS,
    ),
    case(
        "dot_preferred_float32",
        lambda a, b: lax.dot(a, b, preferred_element_type=jnp.float32),
        uniform(-1, 1),
        uniform(-1, 1, (4, 2)),
        ulps=ACCUMULATING_ULPS,
    ),
    case(
        "matvec_and_outer",
        lambda m, v: (m @ v, jnp.outer(v, v)),
        uniform(-1, 1),
        uniform(-1, 1, (4,)),
        ulps=ACCUMULATING_ULPS,
    ),
    case(
        "conv1d",
        lambda x, k: lax.conv_general_dilated(x, k, (1,), "SAME", dimension_numbers=_NWC),
        uniform(-1, 1, (2, 8, 4)),
        uniform(-0.5, 0.5, (3, 4, 3)),
        ulps=ACCUMULATING_ULPS,
    ),
    case(
        "conv2d_grouped",
        lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=_NCHW, feature_group_count=2),
        uniform(-1, 1, (2, 4, 5, 5)),
        uniform(-0.5, 0.5, (4, 2, 3, 3)),
        ulps=ACCUMULATING_ULPS,
    ),
    case(
        "conv2d_strided_dilated",
        lambda x, k: lax.conv_general_dilated(
            x, k, (2, 1), ((1, 1), (0, 1)), lhs_dilation=(1, 2), rhs_dilation=(2, 1), dimension_numbers=_NCHW
        ),
        uniform(-1, 1, (1, 2, 6, 4)),
        uniform(-0.5, 0.5, (3, 2, 2, 2)),
        ulps=ACCUMULATING_ULPS,
    ),
    case(
        "conv_transpose1d",
        lambda x, k: lax.conv_transpose(x, k, (2,), "SAME", dimension_numbers=_NWC),
        uniform(-1, 1, (2, 5, 4)),
        uniform(-0.5, 0.5, (3, 4, 3)),
        ulps=ACCUMULATING_ULPS,
    ),
    case(
        "conv_transpose2d",
        lambda x, k: lax.conv_transpose(
            x, k, (2, 2), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"), transpose_kernel=True
        ),
        uniform(-1, 1, (1, 3, 3, 2)),
        uniform(-0.5, 0.5, (2, 2, 4, 2)),
        ulps=ACCUMULATING_ULPS,
    ),
    case(
        "lax_map_matmul",
        lambda xs, w: lax.map(lambda x: jnp.tanh(x @ w), xs),
        uniform(-1, 1),
        uniform(-1, 1, (4, 4)),
        ulps=ACCUMULATING_ULPS,
    ),
    case("one_hot_matmul", lambda labels, w: jax.nn.one_hot(labels, 4) @ w, ints(4, (5,)), uniform(-1, 1, (4, 3))),
    # Mixture of experts: rows 0-1 to expert 0, row 2 to expert 1, 3-5 to expert 2.
    case(
        "ragged_dot",
        lambda x, w, groups: lax.ragged_dot(x, w, groups),
        uniform(-1, 1, (6, 4)),
        uniform(-1, 1, (3, 4, 5)),
        _GROUPS,
        ulps=ACCUMULATING_ULPS,
    ),
]

# --- random numbers drawn inside the function -----------------------------------------------------

_KEY = jax.random.key(0)
_RAW_KEY = jax.random.PRNGKey(1)

# jax.random's samplers wrap even a raw uint32 key into a typed key internally.

RANDOM = [
    case("random_normal", lambda key, x: jax.random.normal(key, x.shape) * x, _KEY, uniform(0.5, 2)),
    case(
        "random_uniform_split",
        lambda key, x: x + jax.random.uniform(jax.random.split(key)[1], x.shape),
        _RAW_KEY,
        uniform(-2, 2),
    ),
    case(
        "random_bernoulli",
        lambda key, x: jnp.where(jax.random.bernoulli(key, 0.5, x.shape), x, 0.0),
        _KEY,
        uniform(-2, 2),
    ),
    # Logits 3 apart: rounding them moves no sample across a Gumbel tie.
    case(
        "random_categorical",
        lambda key, logits: jax.random.categorical(key, logits, shape=(8, 4)),
        _RAW_KEY,
        np.array([0.0, 3.0, 6.0, 9.0], np.float32) - 6.0,
    ),
    case(
        "random_truncated_normal_dropout",
        lambda key, x: (
            jax.random.truncated_normal(key, -1.0, 1.0, x.shape) + x,
            x * jax.random.bernoulli(key, 0.8, x.shape) / 0.8,
        ),
        _KEY,
        uniform(-2, 2),
    ),
]

# --- linear algebra and FFT ---------------------------------------------------------------------------

_SPD = spd()


def _reconstruct_eigh(a):
    w, v = jnp.linalg.eigh(a)
    return w, (v * w) @ v.T  # sign-independent: eigenvectors' signs are arbitrary


def _reconstruct_svd(a):
    u, s, vh = jnp.linalg.svd(a)
    return s, (u * s) @ vh


LINALG = [
    case("inv", jnp.linalg.inv, _SPD, ulps=ALGORITHM_ULPS),
    case("solve", jnp.linalg.solve, _SPD, uniform(-1, 1, (4, 2)), ulps=ALGORITHM_ULPS),
    case("cholesky", jnp.linalg.cholesky, _SPD, ulps=ALGORITHM_ULPS),
    case("qr", jnp.linalg.qr, _SPD, ulps=ALGORITHM_ULPS),
    case("svd", _reconstruct_svd, _SPD, ulps=ALGORITHM_ULPS),
    case("eigh", _reconstruct_eigh, _SPD, ulps=ALGORITHM_ULPS),
    case("det", jnp.linalg.det, _SPD, ulps=ALGORITHM_ULPS),
    case("slogdet", lambda a: tuple(jnp.linalg.slogdet(a)), _SPD, ulps=ALGORITHM_ULPS),
    case(
        "norms",
        lambda a, v: (
            jnp.linalg.norm(v),
            jnp.linalg.norm(a),
            jnp.linalg.norm(a, 2),
            jnp.linalg.norm(a, 1),
            jnp.linalg.norm(a, np.inf),
        ),
        _SPD,
        uniform(-1, 1, (4,)),
        ulps=ALGORITHM_ULPS,
    ),
    case(
        "solve_triangular",
        lambda a, b: jax.scipy.linalg.solve_triangular(a, b, lower=True),
        np.tril(_SPD),
        uniform(-1, 1, (4, 2)),
        ulps=ALGORITHM_ULPS,
    ),
    case("lu_factor", jax.scipy.linalg.lu_factor, _SPD, ulps=ALGORITHM_ULPS),
]

FFT = [
    case("fft_of_real", jnp.fft.fft, uniform(-1, 1, (2, 8)), ulps=ALGORITHM_ULPS),
    case(
        "rfft_irfft",
        lambda x: (jnp.fft.rfft(x), jnp.fft.irfft(jnp.fft.rfft(x), n=8)),
        uniform(-1, 1, (2, 8)),
        ulps=ALGORITHM_ULPS,
    ),
    case("fft2_abs", lambda x: jnp.abs(jnp.fft.fft2(x)), uniform(-1, 1, (4, 4)), ulps=ALGORITHM_ULPS),
]

# --- custom computations, loops and scans ------------------------------------------------------------


def _argmax_by_reduce(x):
    """Variadic `lax.reduce` with a user computation: (max value, its column)."""

    def keep_larger(a, b):
        (av, ai), (bv, bi) = a, b
        pick = av >= bv
        return lax.select(pick, av, bv), lax.select(pick, ai, bi)

    columns = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return lax.reduce((x, columns), (np.float32(-np.inf), np.int32(0)), keep_larger, (1,))


def _linear_recurrence(x):
    """h_t = 0.5 h_{t-1} + x_t as an associative scan over (decay, value) pairs."""

    def combine(left, right):
        (a1, b1), (a2, b2) = left, right
        return a1 * a2, b1 * a2 + b2

    return lax.associative_scan(combine, (jnp.full_like(x, 0.5), x), axis=1)[1]


CUSTOM = [
    # A lambda is not recognised as the add monoid: this binds reduce with a jaxpr.
    case(
        "reduce_custom_jaxpr",
        lambda x: lax.reduce(x, np.float32(0), lambda a, b: a + b, (0,)),
        uniform(-2, 2),
        ulps=ACCUMULATING_ULPS,
    ),
    case("reduce_variadic_custom", _argmax_by_reduce, distinct()),
    case("lax_map", lambda x: lax.map(lambda row: jnp.sin(row) * row.sum(), x), uniform(-1, 1), ulps=ACCUMULATING_ULPS),
    case(
        "associative_scan_add",
        lambda x: lax.associative_scan(jnp.add, x, axis=1),
        uniform(0, 2),
        ulps=ACCUMULATING_ULPS,
    ),
    case("associative_scan_recurrence", _linear_recurrence, uniform(0, 2), ulps=ACCUMULATING_ULPS),
    case("optimization_barrier", lambda x, y: lax.optimization_barrier((x * 2, y + 1)), uniform(-2, 2), uniform(-2, 2)),
    case("stop_gradient", lambda x: lax.stop_gradient(x) * x, uniform(-2, 2)),
    case("checkpoint_name", lambda x: checkpoint_name(x * 2, "h") + 1, uniform(-2, 2)),
]

# --- jax.nn ---------------------------------------------------------------------------------------------

NN = [
    unary("softmax", lambda x: jax.nn.softmax(x, axis=-1), -3, 3, ulps=ACCUMULATING_ULPS),
    unary("log_softmax", lambda x: jax.nn.log_softmax(x, axis=0), -3, 3, ulps=ACCUMULATING_ULPS),
    unary("gelu_tanh", lambda x: jax.nn.gelu(x, approximate=True), -3, 3),
    unary("gelu_erf", lambda x: jax.nn.gelu(x, approximate=False), -3, 3),
    unary("silu", jax.nn.silu, -3, 3),
    case("relu", jax.nn.relu, distinct()),
    unary("logsumexp", lambda x: (jax.nn.logsumexp(x), jax.nn.logsumexp(x, axis=1)), -3, 3, ulps=ACCUMULATING_ULPS),
    case("one_hot", lambda labels: jax.nn.one_hot(labels, 5), ints(5)),
    # Attention masking with -1e9; the last row is masked out entirely, where
    # float32 gives a uniform row and an overflowed mask gives nan.
    case(
        "masked_softmax",
        lambda x, keep: jax.nn.softmax(jnp.where(keep, x, -1e9)),
        uniform(-3, 3),
        np.array([[1, 1, 0, 1], [0, 1, 1, 1], [0, 0, 0, 0]], bool),
        ulps=ACCUMULATING_ULPS,
    ),
    unary(
        "sigmoid_softplus_log_sigmoid", lambda x: (jax.nn.sigmoid(x), jax.nn.softplus(x), jax.nn.log_sigmoid(x)), -3, 3
    ),
    unary("elu_leaky_relu_glu", lambda x: (jax.nn.elu(x), jax.nn.leaky_relu(x), jax.nn.glu(x)), -3, 3),
    unary("standardize", lambda x: jax.nn.standardize(x, axis=-1), -3, 3, ulps=ACCUMULATING_ULPS),
]

# --- functions that are gradients: backward-pass primitives -----------------------------------------------


def _grad(f):
    """The gradient of ``sum(f(x))`` with respect to the first argument."""
    return jax.grad(lambda x, *rest: jnp.sum(f(x, *rest)))


GRADIENTS = [
    # select_and_scatter_add / select_and_gather_add come from max pooling's transpose.
    case("grad_max_pool", _grad(lambda x: _window(x, -np.inf, lax.max, "SAME")), distinct(_IMAGE)),
    case("grad_avg_pool", _grad(lambda x: _window(x, 0, lax.add) / 4), uniform(-2, 2, _IMAGE)),
    case("grad_gather", _grad(lambda x, i: x[i] ** 2), uniform(-2, 2), _ROWS),
    case("grad_sort", _grad(lambda x, w: jnp.sort(x, axis=1) * w), distinct(), uniform(-2, 2)),
    case(
        "grad_cumulative",
        _grad(lambda x: lax.cumsum(x, axis=1) * lax.cummax(x, axis=0) + lax.cumprod(x, axis=1)),
        np.abs(distinct()) + 0.5,
        ulps=ALGORITHM_ULPS,
    ),
    case(
        "grad_conv",
        _grad(lambda k, x: lax.conv_general_dilated(x, k, (1,), "SAME", dimension_numbers=_NWC) ** 2),
        uniform(-0.5, 0.5, (3, 4, 3)),
        uniform(-1, 1, (2, 8, 4)),
        ulps=ALGORITHM_ULPS,
    ),
    case("grad_dot", _grad(lambda w, x: jnp.tanh(x @ w)), uniform(-1, 1, (4, 5)), uniform(-1, 1), ulps=ALGORITHM_ULPS),
    case(
        "grad_ragged_dot",
        _grad(lambda w, x: jnp.tanh(lax.ragged_dot(x, w, _GROUPS))),
        uniform(-1, 1, (3, 4, 5)),
        uniform(-1, 1, (6, 4)),
        ulps=ALGORITHM_ULPS,
    ),
    # Derivatives 1 - x**2 (one_minus_square from JAX 0.11.2) and 1 / (x log 2).
    case(
        "grad_tanh_asin_atanh_log2",
        _grad(lambda x: jnp.tanh(x) + jnp.arcsin(x / 2) + jnp.arctanh(x / 2) + jnp.log2(x + 2)),
        uniform(-1, 1),
        ulps=ALGORITHM_ULPS,
    ),
    case(
        "grad_softmax_logsumexp",
        _grad(lambda x: jax.nn.softmax(x) * x + jax.nn.logsumexp(x)),
        uniform(-2, 2),
        ulps=ALGORITHM_ULPS,
    ),
    case(
        "grad_dynamic_slice_pad",
        _grad(lambda x, i: lax.pad(lax.dynamic_slice(x, (i, 0), (2, 3)), np.float32(0), [(1, -1, 1), (0, 0, 0)]) ** 2),
        uniform(-2, 2),
        np.int32(1),
    ),
    case("grad_top_k_reduce_max", _grad(lambda x: lax.top_k(x, 2)[0] * jnp.max(x, axis=1, keepdims=True)), distinct()),
]


@sweep(UNARY + BINARY + SELECTION, oldest_jax=False)
def test_elementwise(c, dtype, route):
    check(c, dtype, route)


@sweep(REDUCTIONS, oldest_jax=False)
def test_reductions_and_cumulative(c, dtype, route):
    check(c, dtype, route)


@sweep(STRUCTURAL + GATHER_SCATTER + SORTING + WINDOWS, oldest_jax=False)
def test_structural_gather_sort_window(c, dtype, route):
    check(c, dtype, route)


@sweep(MATMULS, f32_route_dtypes=(F16, BF16))
@pytest.mark.newest_only
def test_matmul_and_conv_values(c, dtype, route):
    check(c, dtype, route)


@sweep(RANDOM + LINALG + FFT, oldest_jax=False)
def test_random_linalg_fft(c, dtype, route):
    check(c, dtype, route)


@sweep(CUSTOM + NN)
@pytest.mark.newest_only
def test_custom_computations_and_nn(c, dtype, route):
    check(c, dtype, route)


@sweep(GRADIENTS, f32_route_dtypes=(F16, BF16))
@pytest.mark.newest_only
def test_gradients_as_functions(c, dtype, route):
    check(c, dtype, route)


@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
@pytest.mark.parametrize("c", MATMULS, ids=lambda c: c.name)
@pytest.mark.newest_only
def test_matmul_and_conv_operands_are_in_compute_dtype(c, dtype):
    """amp's jaxpr runs each dot_general/conv (nested in scans too) on compute-dtype operands."""
    assert_all_matmuls_in(jax.make_jaxpr(jaxamp.amp(c.fn, compute_dtype=dtype))(*c.args), dtype)


# --- JAX's own op catalogue --------------------------------------------------------------------------------
# Values are arbitrary here (the cases above check numerics): one small operand
# per argument, inside most operations' domains.

CATALOGUE = lax_op_catalogue()
FLOATS = (F32, F16, BF16)


def catalogue_operands(op, dtype):
    values = np.linspace(0.55, 0.95, 3) if jnp.issubdtype(dtype, jnp.floating) else np.ones(3)
    return (jnp.asarray(values.astype(dtype)),) * op.nargs


def bound_primitives(fn, *args):
    return {eqn.primitive for eqn in iter_eqns(jax.make_jaxpr(fn)(*args))}


@pytest.mark.parametrize("op", CATALOGUE, ids=lambda op: op.name)
def test_catalogue_operation_is_classified(op):
    """Every primitive the operation binds, at any dtype it accepts, has a table entry or a handler."""
    bound = set().union(*(bound_primitives(op.fn, *catalogue_operands(op, d)) for d in op.dtypes))
    table = jaxamp.default_amp_policy
    assert sorted(p.name for p in bound if p not in table and p not in _interpreter.HANDLERS) == []


def catalogue_runs(dtype):
    """(route, compute dtype) pairs for operands of `dtype`.

    Both routes with both compute dtypes for float32 operands; half-precision
    operands are what the ``half`` route would make them already, so they
    arrive as given, under each compute dtype.
    """
    routes = ROUTES if dtype == F32 else ("f32",)
    return [(route, compute) for route in routes for compute in (F16, BF16)]


@pytest.mark.parametrize(
    "op, dtype",
    [
        pytest.param(op, dtype, id=f"{op.name}-{SHORT_NAMES.get(dtype, 'f32')}")
        for op in CATALOGUE
        for dtype in op.dtypes
        if dtype in FLOATS
    ],
)
def test_catalogue_operation_under_amp(op, dtype):
    """Runs, keeps the plain function's dtypes and shapes, and gets only dtypes JAX lists for it.

    An operation that takes float32 and wider only (conj, complex) is never
    handed half-precision operands, not even after a half matmul.
    """
    args = catalogue_operands(op, dtype)
    # amp's casts are its own: what the operation binds besides them is checked.
    own = {p.name for p in bound_primitives(op.fn, *args)} - {"convert_element_type"}
    for route, compute_dtype in catalogue_runs(dtype):
        fn = routed(op.fn, route)
        amp_fn = jaxamp.amp(fn, compute_dtype=compute_dtype)
        assert_same_types(amp_fn(*args), jax.eval_shape(fn, *args))
        unlisted = {
            (name, d.name)
            for name, dtypes in float_operand_dtypes(jax.make_jaxpr(amp_fn)(*args), own)
            for d in dtypes
            if d not in op.dtypes
        }
        assert unlisted == set(), (route, compute_dtype.name)


# --- what amp must leave alone: bit-for-bit -----------------------------------------------------------------


def converts(jaxpr):
    """The (from, to) dtypes of every convert_element_type in `jaxpr`, as a multiset."""
    return collections.Counter(
        (eqn.invars[0].aval.dtype, eqn.params["new_dtype"])
        for eqn in iter_eqns(jaxpr)
        if eqn.primitive.name == "convert_element_type"
    )


def assert_untouched(fn, *args):
    """amp adds no conversion to `fn` and its results are identical, bit for bit."""
    args = jax.tree.map(jnp.asarray, args)
    amp_fn = jaxamp.amp(fn, compute_dtype=BF16)
    assert converts(jax.make_jaxpr(amp_fn)(*args)) == converts(jax.make_jaxpr(fn)(*args))
    expected, actual = fn(*args), amp_fn(*args)
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        assert a.dtype == e.dtype
        # Identical bits: compare as unsigned integers of the same width
        # (nan == nan, and -0.0 != 0.0).
        a, e = np.asarray(a), np.asarray(e)
        assert a.tobytes() == e.tobytes(), (a, e)


_I = ints(7) - 3
_J = ints(5, (4, 3)) - 2

INTEGER_PROGRAMS = [
    pytest.param(
        lambda i, j: (i @ j, i * 3 + 1, i // 2, lax.rem(i, 3), -i, jnp.abs(i), jnp.sign(i)),
        (_I, _J),
        id="arithmetic_and_matmul",
    ),
    pytest.param(
        lambda i, j: (
            jnp.sum(i),
            jnp.prod(i, axis=0),
            jnp.max(i, axis=1),
            jnp.argmax(i),
            jnp.cumsum(i, axis=1),
            lax.cummax(i, axis=0),
        ),
        (_I, _J),
        id="reductions",
    ),
    pytest.param(
        lambda i, j: (jnp.sort(i, axis=1), lax.top_k(i, 2), i[j[:, 0] % 3], i.at[jnp.array([0, 0])].add(5)),
        (_I, _J),
        id="sort_gather_scatter",
    ),
    pytest.param(
        lambda i, j: (i >> 1, i << 2, i & 6, lax.population_count(i), lax.clz(i), i ^ 5), (_I, _J), id="bitwise"
    ),
    pytest.param(lambda i, j: lax.reduce_window(i, 0, lax.add, (2, 2), (1, 1), "VALID"), (_I, _J), id="reduce_window"),
    pytest.param(
        lambda a, b: lax.dot(a, b, preferred_element_type=jnp.int32),
        (ints(100, (3, 4), np.int8), ints(100, (4, 2), np.int8)),
        id="int8_dot_to_int32",
    ),
    pytest.param(
        lambda a, b: lax.conv_general_dilated(
            a, b, (1,), "SAME", dimension_numbers=_NWC, preferred_element_type=jnp.int32
        ),
        (ints(10, (1, 6, 2), np.int8), ints(10, (3, 2, 2), np.int8)),
        id="int8_conv_to_int32",
    ),
    pytest.param(
        lambda b, c: (
            b & c,
            b | c,
            ~b,
            b ^ c,
            jnp.all(b, axis=0),
            jnp.any(b),
            lax.select_n(b, c, ~c),
            jnp.sort(b, axis=1),
            b[jnp.array([2, 0])],
        ),
        (ints(2).astype(bool), ints(2).astype(bool)),
        id="bool",
    ),
    pytest.param(
        lambda key: (jax.random.randint(key, (3,), 0, 9), jax.random.permutation(key, 5)), (_KEY,), id="random_integers"
    ),
]


@pytest.mark.parametrize("fn, args", INTEGER_PROGRAMS)
def test_integer_and_boolean_programs_pass_through(fn, args):
    assert_untouched(fn, *args)


_C = (uniform(-1, 1, (4, 4)) + 1j * uniform(-1, 1, (4, 4))).astype(np.complex64)

COMPLEX_PROGRAMS = [
    pytest.param(lambda z: (z @ z, z * z + 1j, jnp.conj(z), jnp.exp(z), jnp.sum(z, axis=0)), id="arithmetic"),
    pytest.param(lambda z: (jnp.fft.fft(z), jnp.fft.ifft(z), jnp.fft.fft2(z)), id="fft"),
    pytest.param(lambda z: (jnp.abs(z), jnp.real(z), jnp.imag(z), jnp.angle(z)), id="to_real"),
    pytest.param(jnp.linalg.inv, id="inv"),
]


@pytest.mark.parametrize("fn", COMPLEX_PROGRAMS)
@pytest.mark.newest_only
def test_complex_programs_pass_through(fn):
    assert_untouched(fn, _C)


FLOAT64_PROGRAMS = [
    pytest.param(
        lambda x, w: (x @ w, jnp.tanh(x) + 1, jnp.exp(x), jnp.sum(x), jnp.cumsum(x, axis=1)),
        id="matmul_and_elementwise",
    ),
    pytest.param(
        lambda x, w: (jax.nn.softmax(x), jnp.sort(x), jnp.argmax(x), x[jnp.array([1, 0])]), id="nn_sort_gather"
    ),
    pytest.param(
        lambda x, w: lax.conv_general_dilated(
            x[None, :, :, None], w[:2, :2, None, None], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        ),
        id="conv",
    ),
    pytest.param(lambda x, w: (jnp.linalg.inv(w @ w.T + 4 * jnp.eye(4)), jnp.fft.rfft(x)), id="linalg_fft"),
    pytest.param(lambda x, w: jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w), id="grad"),
]


@pytest.mark.parametrize("fn", FLOAT64_PROGRAMS)
@pytest.mark.newest_only
def test_float64_programs_pass_through(fn):
    # x64 only inside the test: the rest of the suite keeps JAX's float32 default.
    with jax.enable_x64(True):
        assert_untouched(fn, uniform(-1, 1).astype(np.float64), uniform(-1, 1, (4, 4)).astype(np.float64))


@pytest.mark.newest_only
def test_float64_beside_float32_is_untouched():
    """In one program, the float32 matmul runs in half and the float64 one does not."""

    def f(x32, x64):
        return x32 @ x32.T, x64 @ x64.T

    with jax.enable_x64(True):
        x32, x64 = uniform(-1, 1), uniform(-1, 1).astype(np.float64)
        jaxpr = jax.make_jaxpr(jaxamp.amp(f, compute_dtype=BF16))(x32, x64)
        operands = [
            tuple(v.aval.dtype for v in e.invars) for e in iter_eqns(jaxpr) if e.primitive.name == "dot_general"
        ]
        assert sorted(operands, key=str) == sorted([(BF16, BF16), (np.dtype(np.float64),) * 2], key=str)
        half, full = jaxamp.amp(f, compute_dtype=BF16)(x32, x64)
        assert half.dtype == F32
        assert np.asarray(full).tobytes() == np.asarray(f(x32, x64)[1]).tobytes()


@pytest.mark.newest_only
def test_mixed_program_leaves_non_float32_outputs_identical():
    """Ints, bools and complex numbers beside a half-precision matmul keep their bits."""

    def f(x, i, b, z):
        return x @ x.T, i * 2 + jnp.argmax(x @ x.T, axis=1)[:, None], ~b, z * z

    args = (distinct(), _I, ints(2).astype(bool), _C[:3])
    amp_f = jaxamp.amp(f, compute_dtype=F16)
    added = converts(jax.make_jaxpr(amp_f)(*args)) - converts(jax.make_jaxpr(f)(*args))
    assert added and all(src in (F32, F16) and dst in (F32, F16) for src, dst in added)
    # Against the program compiled whole, as amp's is: op by op, XLA may round
    # the complex product's parts another way (it does at -O0 on JAX 0.10).
    for actual, expected in zip(amp_f(*args)[1:], jax.jit(f)(*args)[1:]):
        assert np.asarray(actual).tobytes() == np.asarray(expected).tobytes()


@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("target", [jnp.int32, jnp.uint32, jnp.uint8, jnp.int16])
@pytest.mark.newest_only
def test_bitcast_sees_the_original_dtype(target, route, dtype):
    """A bitcast of a float32 value reinterprets float32 bits, even after a half matmul.

    The inputs are exact in both half types, so the half route's rounding leaves
    the bits the plain function sees.
    """
    fn = routed(lambda x: lax.bitcast_convert_type(x, target), route)
    x = distinct()
    expected = fn(x)
    actual = jaxamp.amp(fn, compute_dtype=dtype)(x)
    assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape)
    np.testing.assert_array_equal(actual, expected)


@pytest.mark.parametrize("dtype", COMPUTE_DTYPES)
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.newest_only
def test_pure_callback_runs_at_original_precision(route, dtype):
    """A host callback gets the float32 operands it was declared with, whatever amp held them in."""
    seen = []

    def host_sin(x):
        seen.append(x.dtype)
        return np.sin(x)

    def f(x):
        y = jax.pure_callback(host_sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return y * 2

    fn = routed(f, route)
    x = uniform(-2, 2)
    expected = fn(x)
    seen.clear()
    actual = jaxamp.amp(fn, compute_dtype=dtype)(x)
    assert seen and set(seen) == {F32}
    assert_matches(actual, expected, UNIT_ROUNDOFF[dtype] * DEFAULT_ULPS)
