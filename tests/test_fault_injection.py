"""A float16 training loop survives NaN/inf gradients injected on random steps.

Dynamic loss scaling with `redo_on_nan` absorbs ordinary float16 overflow inside
the step, so the only steps that come back non-finite are the injected ones; on
exactly those, `skip_nonfinite_updates` + `apply_if_finite_updates` must leave
parameters and optimizer state bit for bit unchanged, and training must still
converge. The same loop is run with a `GradScaler`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

STEPS = 240
POISON_RATE = 0.08


def _mlp(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return (h @ params["w2"] + params["b2"])[:, 0]


def _loss(params, x, y, poison):
    loss = jnp.mean((_mlp(params, x) - y) ** 2)
    # A traced flag, so the same compiled step can be poisoned or not.
    return loss * jnp.where(poison, jnp.inf, 1.0)


def _manual_f16_loss(params, x, y, poison):
    params, x = jaxamp.cast_floating((params, x), jnp.float16)
    return _loss(params, x, y.astype(jnp.float16), poison)


LOSSES = {"amp": jaxamp.amp(_loss, compute_dtype=jnp.float16), "manual_cast": _manual_f16_loss}


def _problem():
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(keys[0], (128, 4))
    y = jnp.sin(x @ jnp.array([1.0, -2.0, 0.5, 1.5]))
    params = {
        "w1": jax.random.normal(keys[1], (4, 32)) * 0.5,
        "b1": jnp.zeros(32),
        "w2": jax.random.normal(keys[2], (32, 1)) * 0.2,
        "b2": jnp.zeros(1),
    }
    poison = np.random.default_rng(0).random(STEPS) < POISON_RATE
    poison[:3] = False  # a clean start gives a clean reference loss
    return params, x, y, poison


def _bits(tree):
    return [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree)]


def _clean_loss(params, x, y):
    return float(_loss(params, x, y, False))


@pytest.mark.parametrize("cast", sorted(LOSSES))
def test_dynamic_scaler_skips_exactly_the_poisoned_steps(cast):
    params, x, y, poison = _problem()
    optimizer = jaxamp.skip_nonfinite_updates(optax.adam(3e-2))
    grad_fn = jaxamp.dynamic_scale_value_and_grad(LOSSES[cast], filter=False, redo_on_nan=3)

    @jax.jit
    def train_step(params, opt_state, scaler_state, poison):
        scaler_state, (_, grads) = grad_fn(params, x, y, poison, dynamic_scaler_state=scaler_state)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = jaxamp.apply_if_finite_updates(params, updates, opt_state.last_finite)
        return params, opt_state, scaler_state

    opt_state = optimizer.init(params)
    scaler_state = jaxamp.DynamicScalerState(scaler=2**15, patience=4)
    start = _clean_loss(params, x, y)
    skipped = []
    for step in range(STEPS):
        before = _bits((params, opt_state.inner_state))
        resets = int(scaler_state.total_resets)
        params, opt_state, scaler_state = train_step(params, opt_state, scaler_state, poison[step])
        unchanged = _bits((params, opt_state.inner_state)) == before
        skipped.append(not bool(opt_state.last_finite))
        assert unchanged == skipped[-1], f"step {step}"
        assert bool(jaxamp.all_finite(params)), f"step {step}"
        if poison[step]:
            # The first attempt and all three retries failed.
            assert int(scaler_state.total_resets) - resets == 4
    np.testing.assert_array_equal(skipped, poison)
    assert int(opt_state.total_notfinite) == poison.sum()
    assert _clean_loss(params, x, y) < 0.2 * start


def test_grad_scaler_skips_exactly_the_poisoned_steps():
    params, x, y, poison = _problem()
    optimizer = optax.adam(3e-2)
    amp_loss = LOSSES["amp"]

    @jax.jit
    def train_step(params, opt_state, scaler, poison):
        grads = jax.grad(lambda p: scaler.scale(amp_loss(p, x, y, poison)))(params)
        params, opt_state, scaler = scaler.step(optimizer, grads, opt_state, params)
        return params, opt_state, scaler.found_inf, scaler.update()

    opt_state = optimizer.init(params)
    # A small initial scale: torch's GradScaler has no redo, so float16 overflow
    # from a too-large scale would skip extra steps.
    scaler = jaxamp.GradScaler(init_scale=2.0**8, growth_interval=1000)
    start = _clean_loss(params, x, y)
    for step in range(STEPS):
        before = _bits((params, opt_state))
        params, opt_state, found_inf, scaler = train_step(params, opt_state, scaler, poison[step])
        assert bool(found_inf) == poison[step], f"step {step}"
        assert (_bits((params, opt_state)) == before) == poison[step], f"step {step}"
        assert bool(jaxamp.all_finite(params))
    assert scaler.get_scale() == 2.0**8 * 0.5 ** poison.sum()
    assert _clean_loss(params, x, y) < 0.2 * start
