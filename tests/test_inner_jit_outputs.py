"""Losses that call an inner jit'd function, whatever its outputs are (issue 58, defect 1).

A jit'd body's outputs are variables of its jaxpr, or literals where it
returns a constant (``eqx.filter_jit`` always returns one, so every haliax dot
and every Levanter model has them), and a literal is not hashable: the
analyses that match a body's outputs to its inputs (which are forwarded
unchanged) must pass literals by. Hypothesis draws the inner function's
outputs (constants, literals, inputs forwarded unchanged, computed values
with a matmul), how it is jit'd (`jax.jit`, `eqx.filter_jit`, nested) and the
compute dtype, and checks that:

* ``jax.grad(jaxamp.amp(loss))`` runs and matches the float32 gradient within
  `GRAD_ULPS` units of the compute dtype's roundoff (relative to the
  gradient's largest entry);
* every matmul of the amp'd loss, the inner function's included, runs in the
  compute dtype, in its jaxpr and in its gradient's.

Shapes are drawn from short ranges so the compilation cache works, and
examples are few: the file runs in well under a minute on two cores.
"""

from __future__ import annotations

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import jaxamp

from jaxpr_walk import assert_all_matmuls_in

# Literal outputs are how JAX writes constants in a jaxpr, which varies by
# release: run on the oldest supported JAX too (.ci/run).
pytestmark = pytest.mark.jax_internals

F16, BF16 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16)
UNIT_ROUNDOFF = {F16: 2.0**-11, BF16: 2.0**-8}
# The loss is a few tanh layers and matmuls of width <= 8: rounding operands
# and results to the compute dtype costs at most 5.4 u of the largest
# gradient entry (measured over 300 random draws); 16 u leaves room for the
# outliers hypothesis looks for without hiding a wrong gradient (a dropped or
# doubled output is off by 10^3 u or more).
GRAD_ULPS = 16

# What the inner function returns, per output: `a` its activation input, `w` its weight.
OUTPUTS = {
    "python constant": lambda a, w: 2.0,
    "float32 scalar": lambda a, w: jnp.float32(0.25),
    "integer constant": lambda a, w: 3,
    "forwarded activation": lambda a, w: a,
    "forwarded weight": lambda a, w: w,
    "matmul": lambda a, w: jnp.tanh(a @ w),
}
JITS = {"jax.jit": jax.jit, "eqx.filter_jit": eqx.filter_jit}

EXAMPLES = settings(max_examples=30, deadline=None)


def _inner(kinds: tuple[str, ...], jits: tuple[str, ...]):
    """The inner function returning `kinds`, jit'd by each of `jits`, innermost first."""

    def inner(a, w):
        return tuple(OUTPUTS[kind](a, w) for kind in kinds)

    for name in jits:
        inner = JITS[name](inner)
    return inner


def _loss(inner):
    """A loss whose every inner output counts in its value, and so in its gradient."""

    def loss(x, w):
        h = jnp.tanh(x @ w)
        total = jnp.sum(h)
        for out in inner(h, w):
            out = jnp.asarray(out, jnp.float32)
            # Scalars scale h; a (width, width) weight multiplies it.
            total = total + (jnp.sum(h @ out) if out.shape == w.shape else jnp.sum(out * h))
        return total

    return loss


@st.composite
def problems(draw):
    kinds = tuple(draw(st.lists(st.sampled_from(sorted(OUTPUTS)), min_size=1, max_size=4)))
    jits = tuple(draw(st.lists(st.sampled_from(sorted(JITS)), min_size=1, max_size=3)))
    dtype = draw(st.sampled_from([F16, BF16]))
    rows, width = draw(st.sampled_from([2, 3])), draw(st.sampled_from([4, 8]))
    seed = draw(st.integers(0, 2**16))
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, (rows, width))
    w = jax.random.normal(k2, (width, width)) / np.sqrt(width)
    return kinds, jits, dtype, x, w


@EXAMPLES
@given(problems())
def test_grad_of_amp_matches_float32_whatever_an_inner_jit_returns(problem):
    kinds, jits, dtype, x, w = problem
    loss = _loss(_inner(kinds, jits))
    amp_loss = jaxamp.amp(loss, compute_dtype=dtype)

    grads = jax.grad(amp_loss, argnums=(0, 1))(x, w)
    expected = jax.grad(loss, argnums=(0, 1))(x, w)
    for got, want in zip(grads, expected):
        assert got.dtype == jnp.float32
        want = np.asarray(want, np.float64)
        tolerance = GRAD_ULPS * UNIT_ROUNDOFF[dtype] * np.max(np.abs(want))
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=tolerance)

    # The outer matmul, and the inner function's where it has one.
    matmuls = 1 + kinds.count("matmul") + kinds.count("forwarded weight")
    assert_all_matmuls_in(jax.make_jaxpr(amp_loss)(x, w), dtype, at_least=matmuls)
    assert_all_matmuls_in(jax.make_jaxpr(jax.grad(amp_loss, argnums=(0, 1)))(x, w), dtype, at_least=matmuls)


@pytest.mark.parametrize("compute_dtype", ["bf16", "f16"])
def test_the_issue_reproduction_runs(compute_dtype):
    def loss(x):
        return jnp.sum(eqx.filter_jit(lambda a: a * 2.0)(x))

    grads = jax.grad(jaxamp.amp(loss, compute_dtype=compute_dtype))(jnp.ones(3))
    np.testing.assert_array_equal(grads, np.full(3, 2.0, np.float32))


def test_the_diagnostics_read_an_inner_jit_returning_a_constant():
    # explain, compare, find_nonfinite and the monitor plan the same analyses as amp.
    loss = _loss(_inner(("python constant", "forwarded activation", "matmul"), ("eqx.filter_jit", "jax.jit")))
    x, w = jnp.ones((2, 4)) / 4, jnp.eye(4)
    report = jaxamp.explain(loss, compute_dtype="bf16")(x, w)
    assert report.low_precision_flop_fraction == 1.0
    assert jaxamp.compare(loss, compute_dtype="bf16")(x, w) is not None
    assert jaxamp.find_nonfinite(loss, compute_dtype="bf16")(x, w) is None
    _, stats = jaxamp.monitoring.monitor(jax.grad(jaxamp.amp(loss, compute_dtype="bf16")))(x, w)
    assert stats is not None
