"""Gradient accumulation with loss scaling: one scale, one decision, one unscale per step.

The recipe of docs/distributed.md ("Gradient accumulation"), as PyTorch documents
it for its GradScaler: every micro-batch's loss is scaled by the same scale, the
*scaled* gradients are summed, and the sum is unscaled once (`GradScaler.step`
unscales, and `unscale` twice raises), checked once, applied or skipped as a
whole, and the scale is updated once.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

MICRO, ROWS, D = 4, 8, 3
TRUE_W = jnp.array([1.0, -2.0, 0.5])


def loss_fn(w, x, y):
    return jnp.mean((x @ w - y) ** 2)


amp_loss = jaxamp.amp(loss_fn, compute_dtype="f16")
optimizer = optax.adam(1e-1)


@jax.jit
def train_step(w, opt_state, scaler, xs, ys):
    def micro_step(grad_sum, batch):
        grads = jax.grad(lambda w: scaler.scale(amp_loss(w, *batch)))(w)
        return grad_sum + grads, None

    scaled_sum, _ = jax.lax.scan(micro_step, jnp.zeros_like(w), (xs, ys))
    w, opt_state, scaler = scaler.step(optimizer, scaled_sum / xs.shape[0], opt_state, w)
    return w, opt_state, scaler.update(), scaler.found_inf


def _data(poison=None):
    xs = jax.random.normal(jax.random.PRNGKey(0), (MICRO, ROWS, D))
    if poison is not None:
        xs = xs.at[poison, 0, 0].set(jnp.nan)
    return xs, xs @ TRUE_W


def test_accumulated_step_equals_the_whole_batch_gradient():
    xs, ys = _data()
    w = jnp.full(D, 0.1)
    scaler = jaxamp.GradScaler(init_scale=2.0**10)
    opt_state = optimizer.init(w)
    new_w, _, _, found_inf = train_step(w, opt_state, scaler, xs, ys)
    whole = jax.grad(loss_fn)(w, xs.reshape(-1, D), ys.reshape(-1))
    updates, _ = optimizer.update(whole, opt_state, w)
    assert not bool(found_inf)
    np.testing.assert_allclose(new_w, w + updates, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("poison", range(MICRO))
def test_one_nonfinite_micro_batch_skips_the_whole_step_and_shrinks_once(poison):
    xs, ys = _data(poison)
    w = jnp.full(D, 0.1)
    scaler = jaxamp.GradScaler(init_scale=2.0**10, growth_interval=1)
    opt_state = optimizer.init(w)
    new_w, new_opt_state, new_scaler, found_inf = train_step(w, opt_state, scaler, xs, ys)
    assert bool(found_inf)
    assert np.asarray(new_w).tobytes() == np.asarray(w).tobytes()
    for a, b in zip(jax.tree_util.tree_leaves(new_opt_state), jax.tree_util.tree_leaves(opt_state)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert new_scaler.get_scale() == 2.0**9  # once, not once per micro-batch


def test_the_scale_grows_once_per_step_not_per_micro_batch():
    xs, ys = _data()
    w, scaler = jnp.full(D, 0.1), jaxamp.GradScaler(init_scale=2.0**4, growth_interval=1)
    opt_state = optimizer.init(w)
    for expected in (2.0**5, 2.0**6):
        w, opt_state, scaler, _ = train_step(w, opt_state, scaler, xs, ys)
        assert scaler.get_scale() == expected


def test_training_converges():
    xs, ys = _data()
    w, scaler = jnp.zeros(D), jaxamp.GradScaler()
    opt_state = optimizer.init(w)
    for _ in range(150):
        w, opt_state, scaler, _ = train_step(w, opt_state, scaler, xs, ys)
    np.testing.assert_allclose(w, TRUE_W, atol=5e-2)


def test_unscaling_a_micro_batch_twice_is_an_error():
    scaler = jaxamp.GradScaler()
    _, scaler = scaler.unscale({"w": jnp.ones(2)})
    with pytest.raises(RuntimeError, match="unscale\\(\\) has already been called"):
        scaler.unscale({"w": jnp.ones(2)})
