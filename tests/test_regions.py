"""Norm layers hand their result on in the compute dtype (jaxamp/analyses/_regions.py)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp import (
    default_amp_policy,
    use_normalisation_precision,
    use_original_precision,
)

from jaxpr_walk import float_operand_dtypes

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals

KEY_W, KEY_X = jax.random.split(jax.random.key(0))
W = jax.random.normal(KEY_W, (16, 32)) / 4
X = jax.random.normal(KEY_X, (8, 16))
# These blocks end their programs: without the tail entry (which runs what
# follows the last matmul in float32; tests/test_tail.py) they run as the
# same block does inside a model, followed by the next matmul.
NO_TAIL = {key: rule for key, rule in default_amp_policy.items() if key != "amp_tail"}


def _group_norm_block(w, x):
    norm = eqx.nn.GroupNorm(4, 32)
    h = jax.vmap(norm)(x @ w)  # a matmul's output (compute dtype) enters the norm
    return jax.nn.relu(h)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.newest_only
def test_norm_output_leaves_in_compute_dtype(dtype):
    amp = jaxamp.amp(_group_norm_block, compute_dtype=dtype, amp_policy=NO_TAIL)
    jaxpr = jax.make_jaxpr(amp)(W, X)
    # The ReLU after the norm runs in the compute dtype, as in hand-cast code.
    relus = float_operand_dtypes(jaxpr, ("max",))
    assert relus and all(t == dtype for t in relus[-1][1]), relus
    # The norm itself still ran in float32: its result is the float32 layer
    # applied to the half-precision activation, rounded once.
    h = (X @ W).astype(dtype).astype(jnp.float32)
    expected = jax.nn.relu(jax.vmap(eqx.nn.GroupNorm(4, 32))(h)).astype(dtype)
    np.testing.assert_allclose(amp(W, X).astype(jnp.float32), expected.astype(jnp.float32), rtol=1e-2, atol=1e-2)
    # Gradients stay float32 for float32 parameters.
    assert jax.grad(lambda w: jnp.sum(amp(w, X)))(W).dtype == jnp.float32


def test_norm_of_a_float32_input_stays_float32():
    def fn(x):  # no matmul: the activation entering the norm is float32
        return jax.nn.relu(jax.vmap(eqx.nn.LayerNorm(16))(x))

    jaxpr = jax.make_jaxpr(jaxamp.amp(fn, compute_dtype="bf16"))(X)
    relus = float_operand_dtypes(jaxpr, ("max",))
    assert relus and all(t == jnp.float32 for _, d in relus for t in d), relus


def _stats_layer(w, x):
    h = x @ w
    with jax.named_scope("my_norm"):
        mean = jnp.mean(h, axis=0)
        out = (h - mean) * jax.lax.rsqrt(jnp.var(h, axis=0) + 1e-5)
    return jnp.tanh(out), mean


@pytest.mark.newest_only
def test_only_results_of_the_activations_shape_are_rounded():
    table = NO_TAIL | {"my_norm": use_normalisation_precision}
    jaxpr = jax.make_jaxpr(jaxamp.amp(_stats_layer, compute_dtype="bf16", amp_policy=table))(W, X)
    tanhs = float_operand_dtypes(jaxpr, ("tanh",))
    assert tanhs == [("tanh", (jnp.bfloat16,))]
    # The statistic (another shape) leaves in float32: amp returns it as is.
    _, mean = jaxamp.amp(_stats_layer, compute_dtype="bf16", amp_policy=table)(W, X)
    np.testing.assert_allclose(mean, jnp.mean(X @ W, axis=0), rtol=2e-2, atol=2e-2)


@pytest.mark.newest_only
def test_a_plain_original_precision_scope_hands_on_float32():
    table = default_amp_policy | {"my_norm": use_original_precision}
    jaxpr = jax.make_jaxpr(jaxamp.amp(_stats_layer, compute_dtype="bf16", amp_policy=table))(W, X)
    assert float_operand_dtypes(jaxpr, ("tanh",)) == [("tanh", (jnp.float32,))]


def test_explain_and_default_table():
    assert default_amp_policy["eqx.nn.GroupNorm"] is use_normalisation_precision
    report = jaxamp.explain(_group_norm_block, compute_dtype="bf16")(W, X)
    assert any(r.decided_by == "scope:eqx.nn.GroupNorm" for r in report.rows)


@pytest.mark.newest_only
def test_inside_a_model_the_norm_hands_on_in_compute_dtype_with_the_default_table():
    def two_layers(w, x):
        return jnp.sum(_group_norm_block(w, x) @ w.T)

    relus = float_operand_dtypes(jax.make_jaxpr(jaxamp.amp(two_layers, compute_dtype="bf16"))(W, X), ("max",))
    assert relus and all(t == jnp.bfloat16 for t in relus[-1][1]), relus
