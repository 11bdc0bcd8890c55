"""The range facts: exp of x - max(x) runs in float16 (jaxamp/analyses/_ranges.py)."""

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxamp
from jaxamp import default_amp_policy, use_full_range_precision, use_original_precision

from jaxpr_walk import float_operand_dtypes

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals

KEY_A, KEY_B = jax.random.split(jax.random.key(0))
Q = jax.random.normal(KEY_A, (6, 16))
K = jax.random.normal(KEY_B, (6, 16))
LABELS = jnp.arange(6) % 6
# These programs end in their exponentials: without the tail entry (which
# runs a program's last ops, its loss, in float32; tests/test_tail.py), the
# range rule decides them as it decides an attention softmax that feeds a
# matmul.
NO_TAIL = {key: rule for key, rule in default_amp_policy.items() if key != "amp_tail"}


def _scores(q, k):
    # A matmul's output: in the compute dtype under amp, as attention scores are.
    return 4.0 * (q @ k.T)


BOUNDED = {
    "jax.nn.softmax": lambda q, k: jnp.sum(jax.nn.softmax(_scores(q, k), axis=-1) ** 2),
    "jax.nn.log_softmax": lambda q, k: jnp.sum(jax.nn.log_softmax(_scores(q, k))),
    "optax cross-entropy": lambda q, k: jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels(_scores(q, k), LABELS)
    ),
    "hand-written keepdims": lambda q, k: jnp.sum(jnp.exp((s := _scores(q, k)) - jnp.max(s, axis=-1, keepdims=True))),
    "max over two axes": lambda q, k: jnp.sum(jnp.exp((s := _scores(q, k)) - jnp.max(s))),
    "across jit calls": lambda q, k: jnp.sum(
        jnp.exp(jax.jit(jnp.subtract)(s := _scores(q, k), jax.jit(lambda x: jnp.max(x, -1, keepdims=True))(s)))
    ),
    "exp2 and expm1": lambda q, k: jnp.sum(
        jnp.exp2(d := (s := _scores(q, k)) - jnp.max(s, -1, keepdims=True)) + jnp.expm1(d)
    ),
}


def _exp_rows(fn, amp_policy=NO_TAIL):
    report = jaxamp.explain(fn, compute_dtype="f16", amp_policy=amp_policy)(Q, K)
    return [r for r in report.rows if r.primitive in ("exp", "exp2", "expm1")]


@pytest.mark.newest_only
@pytest.mark.parametrize("name", BOUNDED)
def test_bounded_exponentials_run_in_float16(name):
    fn = BOUNDED[name]
    rows = _exp_rows(fn)
    assert rows, "no exp found"
    assert all(r.decided_by == "range" for r in rows), rows
    amp_fn = jaxamp.amp(fn, compute_dtype="f16", amp_policy=NO_TAIL)
    jaxpr = jax.make_jaxpr(amp_fn)(Q, K)
    exps = float_operand_dtypes(jaxpr, ("exp", "exp2", "expm1"))
    assert exps and all(d == (jnp.float16,) for _, d in exps), exps
    # Numerics: float16 exponentials of values <= 0 lose at most float16 rounding.
    np.testing.assert_allclose(float(amp_fn(Q, K)), float(fn(Q, K)), rtol=1e-2)
    grads = jax.grad(amp_fn, argnums=(0, 1))(Q, K)
    assert all(g.dtype == jnp.float32 and jnp.all(jnp.isfinite(g)) for g in grads)


UNBOUNDED = {
    "plain exp": lambda q, k: jnp.sum(jnp.exp(_scores(q, k))),
    "minus the mean": lambda q, k: jnp.sum(jnp.exp(_scores(q, k) - jnp.mean(_scores(q, k), -1, keepdims=True))),
    # The max over rows, broadcast along columns: not the max of each element's row.
    "misaligned max": lambda q, k: jnp.sum(jnp.exp((s := _scores(q, k)) - jnp.max(s, axis=0, keepdims=True).T)),
    "max of another value": lambda q, k: jnp.sum(jnp.exp(_scores(q, k) - jnp.max(_scores(k, q), -1, keepdims=True))),
    # A masked max bounds only the unmasked elements.
    "masked max": lambda q, k: jnp.sum(
        jnp.exp((s := _scores(q, k)) - jnp.max(s, -1, keepdims=True, where=jnp.eye(6, dtype=bool), initial=-jnp.inf))
    ),
    # logsumexp's guard, but guarding one maximum and passing on another.
    "a guard of another maximum": lambda q, k: jnp.sum(
        jnp.exp(
            (s := _scores(q, k))
            - jax.jit(lambda ma, mb: jnp.where(jnp.isfinite(ma), mb, 0.0))(
                jnp.max(s, -1, keepdims=True), jnp.max(_scores(k, q), -1, keepdims=True)
            )
        )
    ),
    "the max minus x": lambda q, k: jnp.sum(jnp.exp(jnp.max(s := _scores(q, k), -1, keepdims=True) - s)),
}


@pytest.mark.parametrize("name", UNBOUNDED)
def test_unbounded_exponentials_stay_in_float32(name):
    rows = _exp_rows(UNBOUNDED[name])
    assert rows and all(r.decided_by == "primitive" for r in rows), rows
    assert all(r.dtypes_after == ("f32",) for r in rows), rows


@pytest.mark.newest_only
def test_fully_masked_rows_stay_finite():
    # Row 0 is masked entirely (finfo.min, as the benchmark GPT masks), row 1
    # partially with -inf; under float16 the scores saturate to -65504.
    mask = jnp.ones((6, 6), bool).at[0].set(False)
    neg_inf_mask = jnp.ones((6, 6), bool).at[1, 3:].set(False)

    def attention(q, k):
        s = _scores(q, k)
        s = jnp.where(mask, s, jnp.finfo(s.dtype).min)
        s = jnp.where(neg_inf_mask, s, -jnp.inf)
        return jax.nn.softmax(s, axis=-1) @ k

    amp = jaxamp.amp(attention, compute_dtype="f16")
    out = amp(Q, K)
    assert jnp.all(jnp.isfinite(out))
    np.testing.assert_allclose(out, attention(Q, K), atol=2e-2)
    np.testing.assert_allclose(out[0], jnp.mean(K, axis=0), atol=1e-2)  # uniform weights
    grads = jax.grad(lambda q, k: jnp.sum(amp(q, k)), argnums=(0, 1))(Q, K)
    assert all(jnp.all(jnp.isfinite(g)) for g in grads)


@pytest.mark.newest_only
def test_the_range_entry_can_be_switched_off_and_respects_the_users_primitive_entry():
    softmax = BOUNDED["jax.nn.softmax"]
    off = _exp_rows(softmax, amp_policy=NO_TAIL | {"amp_range": use_full_range_precision})
    assert all(r.decided_by == "range" and r.dtypes_after == ("f32",) for r in off)
    pinned = NO_TAIL | {jax.lax.exp_p: use_original_precision}
    rows = _exp_rows(softmax, amp_policy=pinned)
    assert rows and all(r.decided_by == "user" and r.dtypes_after == ("f32",) for r in rows)


@pytest.mark.newest_only
@settings(max_examples=25, deadline=None)
@given(
    scale=st.floats(1.0, 3e3),
    q=hnp.arrays(np.float32, (4, 8), elements=st.floats(-1, 1, width=32)),
)
def test_softmax_of_large_scores_matches_float32(scale, q):
    # Scores up to ~2.4e4 in magnitude: exp of them would overflow float16,
    # exp of them minus their row maximum does not.
    def fn(q):
        return jax.nn.softmax(scale * (q @ q.T), axis=-1)

    out = jaxamp.amp(fn, compute_dtype="f16")(q)
    assert out.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_allclose(out, fn(q), atol=scale * 5e-3 + 2e-3)
