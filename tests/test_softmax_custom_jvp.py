"""`jax.nn.softmax` under amp with JAX's ``jax_softmax_custom_jvp`` on and off (issue 58, defect 2).

With the flag on (Levanter turns it on), softmax is a `jax.custom_jvp`
whose rule computes the tangent ``y * (t - sum(y * t))``: a float32 sum
meeting a float16 ``y``. amp moved the sum down to float16 with a saturating
cast, a clamp that JAX cannot transpose, and the backward pass failed with
an AssertionError. A tangent is now cast plainly (it is linear), in the rule
and in the bodies the rule runs it through; the rule's primal values still
saturate.

Every compute dtype (float16 with and without a loss scale, bfloat16), flag
on and off: gradients match float32's within `GRAD_ULPS` units of the
compute dtype's roundoff (relative to the largest entry), and the matmuls
run in the compute dtype, forward and backward.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp

from jaxpr_walk import assert_all_matmuls_in, iter_eqns

# The flag's softmax is JAX's, and differs between releases: run on the
# oldest supported JAX too (.ci/run).
pytestmark = pytest.mark.jax_internals

F16, BF16 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16)
UNIT_ROUNDOFF = {F16: 2.0**-11, BF16: 2.0**-8}
AMP_OPTIONS = {
    "bf16": {"compute_dtype": "bf16"},
    "f16": {"compute_dtype": "f16"},
    "f16, loss_scale": {"compute_dtype": "f16", "loss_scale": 2.0**10},
}
# Two matmuls and a softmax of width 16 (measured worst over every case here:
# 6.4 u in float16, 5.0 u in bfloat16); 16 u leaves room for other XLA
# versions without hiding a wrong gradient (a tangent lost or counted twice
# is off by more than 10^3 u).
GRAD_ULPS = 16

KEYS = jax.random.split(jax.random.key(0), 4)
X = jax.random.normal(KEYS[0], (8, 16))
W = jax.random.normal(KEYS[1], (16, 16)) / 4
V = jax.random.normal(KEYS[2], (16, 16)) / 4
MASK = jax.random.bernoulli(KEYS[3], 0.7, (8, 16)).at[0].set(False)  # row 0 fully masked

LOSSES = {
    # The reproduction.
    "softmax(x @ w)": lambda x, w: jnp.sum(jax.nn.softmax(x @ w) ** 2),
    # Its probabilities feed a matmul, as attention's do.
    "softmax(x @ w) @ v": lambda x, w: jnp.sum(jnp.tanh(jax.nn.softmax(x @ w) @ V)),
    "masked softmax over axis 0": lambda x, w: jnp.sum(jax.nn.softmax(x @ w, axis=0, where=MASK) * jnp.cos(x @ w)),
}


@pytest.fixture(params=[False, True], ids=["flag off", "flag on"])
def softmax_custom_jvp(request):
    """JAX's ``jax_softmax_custom_jvp`` set for the test, then restored."""
    before = jax.config.jax_softmax_custom_jvp
    jax.config.update("jax_softmax_custom_jvp", request.param)
    yield request.param
    jax.config.update("jax_softmax_custom_jvp", before)


def _compute_dtype(options: dict) -> np.dtype:
    return F16 if options["compute_dtype"] == "f16" else BF16


def _assert_grads_match(got, want, dtype) -> None:
    for g, e in zip(got, want):
        assert g.dtype == jnp.float32
        e = np.asarray(e, np.float64)
        tolerance = GRAD_ULPS * UNIT_ROUNDOFF[dtype] * np.max(np.abs(e))
        np.testing.assert_allclose(np.asarray(g, np.float64), e, rtol=0, atol=tolerance)


# The oldest-JAX leg takes float16 alone: the softmax JAX traces is the same whatever amp runs it in.
ON_OLDEST_JAX = "f16"


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(options, id=name, marks=() if name == ON_OLDEST_JAX else pytest.mark.newest_only)
        for name, options in AMP_OPTIONS.items()
    ],
)
@pytest.mark.parametrize("name", LOSSES)
def test_grad_matches_float32_with_the_flag_on_and_off(softmax_custom_jvp, name, options):
    loss = LOSSES[name]
    # The flag decides whether softmax is a custom_jvp function.
    custom = any(e.primitive.name == "custom_jvp_call" for e in iter_eqns(jax.make_jaxpr(loss)(X, W)))
    assert custom == softmax_custom_jvp

    dtype = _compute_dtype(options)
    amp_loss = jaxamp.amp(loss, **options)
    grad = jax.grad(amp_loss, argnums=(0, 1))
    _assert_grads_match(grad(X, W), jax.grad(loss, argnums=(0, 1))(X, W), dtype)

    assert_all_matmuls_in(jax.make_jaxpr(amp_loss)(X, W), dtype)
    # The backward pass's too: the forward matmuls, and at least one transpose of each.
    forward = len([e for e in iter_eqns(jax.make_jaxpr(loss)(X, W)) if e.primitive.name == "dot_general"])
    assert_all_matmuls_in(jax.make_jaxpr(grad)(X, W), dtype, at_least=2 * forward)


def _tangent(y, t):
    return y * (t - jnp.sum(y * t, axis=-1, keepdims=True))


# Where a custom_jvp rule computes its tangent: in the rule, or in a body it
# calls (a jit'd helper, as every haliax and equinox function is; a cond; a scan).
RULE_BODIES = {
    "in the rule": _tangent,
    "jax.jit": jax.jit(_tangent),
    "eqx.filter_jit": eqx.filter_jit(_tangent),
    "jit in a jit": jax.jit(lambda y, t: jax.jit(_tangent)(y, t) * 1.0),
    "cond": lambda y, t: jax.lax.cond(True, _tangent, lambda y, t: t, y, t),
    "scan": lambda y, t: jax.lax.scan(lambda c, _: (_tangent(y, c), None), t, None, length=1)[0],
}


def _softmax_with_rule(tangent):
    """A softmax whose custom_jvp rule computes its tangent with `tangent`, as JAX's does."""

    @jax.custom_jvp
    def softmax(s):
        return jax.nn.softmax(s)

    @softmax.defjvp
    def softmax_jvp(primals, tangents):
        ((s,), (t,)) = primals, tangents
        y = softmax(s)
        return y, tangent(y, t)

    return softmax


@pytest.mark.parametrize("options", AMP_OPTIONS.values(), ids=AMP_OPTIONS.keys())
@pytest.mark.parametrize("where", RULE_BODIES)
def test_a_rule_computing_its_tangent_in_a_body_it_calls(where, options):
    softmax = _softmax_with_rule(RULE_BODIES[where])

    def loss(x, w):
        return jnp.sum(softmax(x @ w) ** 2)

    dtype = _compute_dtype(options)
    amp_loss = jaxamp.amp(loss, **options)
    _assert_grads_match(jax.grad(amp_loss, argnums=(0, 1))(X, W), jax.grad(loss, argnums=(0, 1))(X, W), dtype)
    assert_all_matmuls_in(jax.make_jaxpr(amp_loss)(X, W), dtype)


def test_a_rules_primal_values_still_saturate_to_float16():
    # A float32 fill of -1e9 (an attention mask's) met in float16 in a jit'd
    # helper of the rule: cast plainly it would be -inf, and the fully masked
    # row's softmax NaN; saturated, the row is uniform, as in float32.
    def masked(s, fill):
        return jax.nn.softmax(jnp.where(MASK, s, fill))

    @jax.custom_jvp
    def masked_softmax(s, fill):
        return masked(s, fill)

    @masked_softmax.defjvp
    def masked_softmax_jvp(primals, tangents):
        (s, fill), (t, _) = primals, tangents
        y = jax.jit(masked)(s, fill)
        return y, jax.jit(_tangent)(y, jnp.where(MASK, t, 0.0))

    def loss(x, w):
        fill = jnp.full(MASK.shape, -1e9, jnp.float32)
        return jnp.sum(jnp.tanh(masked_softmax(x @ w, fill) @ V))

    value, grads = jax.value_and_grad(jaxamp.amp(loss, compute_dtype="f16"), argnums=(0, 1))(X, W)
    want_value, want_grads = jax.value_and_grad(loss, argnums=(0, 1))(X, W)
    np.testing.assert_allclose(value, want_value, rtol=GRAD_ULPS * UNIT_ROUNDOFF[F16])
    _assert_grads_match(grads, want_grads, F16)
