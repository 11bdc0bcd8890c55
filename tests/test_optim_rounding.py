"""jaxamp.optim.stochastic_round: exact values stay exact, the rest round without bias.

Unbiasedness is checked statistically: over N roundings of one value x between
neighbours lo < x < hi, each result is hi with probability p = (x - lo) / (hi - lo),
so the mean has standard error (hi - lo) * sqrt(p (1 - p) / N). Every check allows
5 standard errors (a correct implementation fails one with probability 6e-7);
the keys are fixed, so each check gives the same answer on every run.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxamp.optim import stochastic_round

N = 100_000
BF16, F16 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16)


# Compiled once per dtype and shape: op-by-op dispatch would dominate the run time.
_round = jax.jit(stochastic_round, static_argnums=1)


def _many(x, dtype, key):
    return _round(jnp.broadcast_to(x, (N,)), dtype, key)


def _padded(values, size=64):
    # One shape for every Hypothesis example, so one compilation.
    x = np.zeros(size, np.float32)
    x[: len(values)] = values
    return x


def _neighbours(x: np.float32, dtype) -> tuple[float, float]:
    """The representable values of `dtype` just below and above `x` (numpy, no JAX)."""
    nearest = np.float32(x).astype(dtype)
    if float(nearest) == float(x):
        return float(x), float(x)
    toward = dtype.type(np.inf if float(nearest) < float(x) else -np.inf)
    other = np.nextafter(nearest, toward)
    return tuple(sorted((float(nearest), float(other))))


def _assert_unbiased(x, dtype, key=None):
    key = jax.random.key(0) if key is None else key
    x = np.float32(x)
    lo, hi = _neighbours(x, dtype)
    out = np.asarray(_many(x, dtype, key)).astype(np.float64)
    if lo == hi:
        assert np.all(out == float(x))
        return
    assert set(np.unique(out)) <= {lo, hi}, (x, np.unique(out))
    p = (float(x) - lo) / (hi - lo)
    standard_error = (hi - lo) * np.sqrt(p * (1 - p) / N)
    # Documented: below float16's smallest subnormal, p is quantised to 2**-23.
    quantisation = (hi - lo) * 2.0**-23 if dtype == F16 and abs(x) < 2.0**-24 else 0.0
    bound = 5 * standard_error + quantisation
    assert abs(out.mean() - float(x)) <= bound, (x, out.mean(), standard_error)


# Just below and above powers of two (the spacing halves below them), negative
# values, and the extremes of each dtype's range.
BF16_CASES = [
    1.0 - 2.0**-10,  # between 1 - 2**-8 and 1: p = 0.75
    1.0 + 2.0**-10,  # between 1 and 1 + 2**-7: p = 0.125
    1.0 + 2.0**-20,  # p = 2**-13, far below the spacing
    -(1.0 - 2.0**-10),
    -(1.0 + 2.0**-10),
    -3.0e-3,
    2.0**-126 * 1.3,  # bfloat16's (and float32's) smallest normal values
    -(2.0**-126) * 1.7,
    1.2e38,
    -3.3e38,
    0.1,
    1e-4 + 1e-9,
]
F16_CASES = [
    1.0 - 2.0**-13,
    1.0 + 2.0**-13,
    -(1.0 + 2.0**-12),
    2.0**-14 * (1 + 2.0**-12),  # float16's smallest normal
    2.0**-14 * (1 - 2.0**-12),  # ... and its largest subnormal, just below
    3.3 * 2.0**-24,  # subnormals: float16's spacing 2**-24 there
    -5.5 * 2.0**-24,
    0.25 * 2.0**-24,  # below the smallest subnormal: rounds to 0 or 2**-24
    65000.0,
    -0.1,
]


@pytest.mark.parametrize("x", BF16_CASES)
def test_bfloat16_rounding_is_unbiased_at_boundaries(x):
    _assert_unbiased(x, BF16)


@pytest.mark.parametrize("x", F16_CASES)
def test_float16_rounding_is_unbiased_at_boundaries_and_subnormals(x):
    _assert_unbiased(x, F16)


# Finite float32 values short of bfloat16's largest finite value (3.39e38).
_FINITE_F32 = st.floats(
    min_value=float(np.float32(-3.0e38)),
    max_value=float(np.float32(3.0e38)),
    allow_nan=False,
    allow_subnormal=False,
    width=32,
)


@settings(max_examples=60, deadline=None)
@given(x=_FINITE_F32, seed=st.integers(0, 2**31 - 1))
def test_bfloat16_rounding_is_unbiased_for_any_value(x, seed):
    _assert_unbiased(x, BF16, jax.random.key(seed))


@settings(max_examples=60, deadline=None)
@given(
    x=st.floats(-65000.0, 65000.0, width=32, allow_subnormal=False),
    seed=st.integers(0, 2**31 - 1),
)
def test_float16_rounding_is_unbiased_for_any_value(x, seed):
    _assert_unbiased(x, F16, jax.random.key(seed))


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(_FINITE_F32, min_size=1, max_size=64),
    dtype=st.sampled_from([BF16, F16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_representable_values_stay_exact(values, dtype, seed):
    with np.errstate(over="ignore"):  # float16 overflows to inf, which stays exact too
        exact = _padded(values).astype(dtype)
    out = _round(exact.astype(np.float32), dtype, jax.random.key(seed))
    assert out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), exact.view(np.uint16))


@settings(max_examples=100, deadline=None)
@given(values=st.lists(_FINITE_F32, min_size=1, max_size=64), seed=st.integers(0, 2**31 - 1))
def test_results_are_the_neighbours_of_the_input(values, seed):
    x = _padded(values)
    out = np.asarray(_round(x, BF16, jax.random.key(seed))).astype(np.float64)
    bounds = np.array([_neighbours(v, BF16) for v in x])
    assert np.all((out == bounds[:, 0]) | (out == bounds[:, 1]))


def test_special_values_and_overflow():
    big = float(ml_dtypes.finfo(jnp.bfloat16).max)
    x = [np.inf, -np.inf, np.nan, 0.0, -0.0, 3.39e38, -3.39e38, 3.4e38]
    out = np.asarray(_round(np.array(x, np.float32), BF16, jax.random.key(0))).astype(np.float32)
    assert out[0] == np.inf and out[1] == -np.inf and np.isnan(out[2])
    assert np.signbit(out[4]) and not np.signbit(out[3])
    # Between the largest finite value (3.3895e38) and the point where nearest
    # rounding gives inf (3.3961e38): saturates, never inf by chance; beyond, inf.
    assert list(out[5:]) == [big, -big, np.inf]
    assert _round(np.float32(7e4), F16, jax.random.key(0)) == np.inf


def test_same_key_same_bits_and_float32_passes_through():
    x = jax.random.normal(jax.random.key(1), (1000,))
    a = _round(x, BF16, jax.random.key(2))
    b = _round(x, BF16, jax.random.key(2))
    c = _round(x, BF16, jax.random.PRNGKey(3))  # legacy keys work too
    assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
    assert not np.array_equal(np.asarray(a).view(np.uint16), np.asarray(c).view(np.uint16))
    np.testing.assert_array_equal(stochastic_round(x, "f32", jax.random.key(0)), x)


@pytest.mark.parametrize(
    "x, dtype, match",
    [
        (np.ones(3, np.float64), jnp.bfloat16, "got float64"),
        (jnp.ones(3, jnp.int32), jnp.bfloat16, "got int32"),
        (jnp.ones(3, jnp.float32), jnp.int8, "must be one of bfloat16, float16, float32"),
        (jnp.ones(3, jnp.float32), "f8", "got 'f8'"),
    ],
)
def test_bad_input_is_a_type_error(x, dtype, match):
    with pytest.raises(TypeError, match=match):
        stochastic_round(x, dtype, jax.random.key(0))
