"""`jaxamp.scaling.update_scale`: the scale's step rule for a script whose optimizer is not optax's.

It moves a `DynamicScalerState` exactly as `loss_scaling` moves its own (one
rule), decides finiteness as every scaler does, and a step skipped with
`jax.lax.cond` leaves the hand-written optimizer's state bit for bit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp.scaling import update_scale

pytestmark = pytest.mark.filterwarnings("ignore:jaxamp.loss_scaling's update reads a loss scale")


def _bits(tree):
    return [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree)]


def test_a_finite_step_counts_a_nonfinite_one_halves_and_counts_a_skip():
    state = jaxamp.DynamicScalerState(scaler=2.0**10, patience=1)
    state, finite = update_scale(state, {"w": jnp.ones(3)})
    assert bool(finite) and float(state.scaler) == 2.0**10 and int(state.count) == 1
    state, finite = update_scale(state, {"w": jnp.ones(3)})  # patience reached: grows
    assert bool(finite) and float(state.scaler) == 2.0**11 and int(state.count) == 0
    state, finite = update_scale(state, {"w": jnp.array([1.0, jnp.nan, 0.0])})
    assert not bool(finite) and float(state.scaler) == 2.0**10
    assert int(state.total_resets) == 1 and int(state.count) == 0


@pytest.mark.parametrize("seed", range(3))
def test_the_same_states_as_loss_scaling_under_jit(seed):
    rng = np.random.default_rng(seed)
    steps = rng.random(40) < 0.3  # True: a non-finite step
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1), scaler=8.0, patience=2, min_scaler=2.0, max_scaler=64.0)
    params = {"w": jnp.zeros(2)}
    opt_state = optimizer.init(params)
    state = jaxamp.DynamicScalerState(scaler=8.0, patience=2, min_scaler=2.0, max_scaler=64.0)
    update = jax.jit(update_scale)
    for bad in steps:
        grads = {"w": jnp.array([jnp.inf if bad else 1.0, 0.0])}
        _, opt_state = optimizer.update(grads, opt_state, params)
        state, finite = update(state, grads)
        assert bool(finite) == (not bad)
        assert _bits(state) == _bits(opt_state.scaler_state)
    assert int(state.total_resets) == int(steps.sum())


def test_the_decision_itself_is_taken_as_it_is():
    state = jaxamp.DynamicScalerState(scaler=8.0)
    assert float(update_scale(state, False)[0].scaler) == 4.0
    assert float(update_scale(state, jnp.array(False))[0].scaler) == 4.0
    new, finite = update_scale(state, np.bool_(True))
    assert bool(finite) and int(new.count) == 1
    with pytest.raises(TypeError, match="booleans of shape \\(2,\\)"):
        update_scale(state, jnp.array([True, False]))


def test_not_a_scaler_state():
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1))
    with pytest.raises(TypeError, match="expects a jaxamp.DynamicScalerState .* got LossScaleState"):
        update_scale(optimizer.init({"w": jnp.zeros(2)}), True)


def _adam(params, grads, opt, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8):
    count = opt["count"] + 1
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, opt["mu"], grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g**2, opt["nu"], grads)
    step = lambda p, m, v: p - lr * (m / (1 - b1**count)) / (jnp.sqrt(v / (1 - b2**count)) + eps)  # noqa: E731
    return jax.tree.map(step, params, mu, nu), {"mu": mu, "nu": nu, "count": count}


def test_a_hand_written_adam_step_in_float16_skips_bit_for_bit():
    def loss_fn(params, x):
        return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - 1.0) ** 2)

    @jax.jit
    def train_step(state, x):
        loss = jaxamp.amp(loss_fn, compute_dtype="f16", loss_scale=state["scaler"])
        value, grads = jax.value_and_grad(loss)(state["params"], x)
        state["scaler"], finite = update_scale(state["scaler"], grads)
        state["params"], state["opt"] = jax.lax.cond(
            finite, _adam, lambda p, g, o: (p, o), state["params"], grads, state["opt"]
        )
        return state, value

    params = {"w1": jnp.full((4, 8), 0.1), "w2": jnp.full((8, 1), -0.1)}
    zeros = jax.tree.map(jnp.zeros_like, params)
    state = {"params": params, "opt": {"mu": zeros, "nu": zeros, "count": jnp.array(0)}}
    state["scaler"] = jaxamp.DynamicScalerState(scaler=2.0**12)
    x = jnp.ones((2, 4))
    state, first = train_step(state, x)
    assert int(state["opt"]["count"]) == 1 and int(state["scaler"].count) == 1
    before = _bits((state["params"], state["opt"]))
    state, value = train_step(state, x.at[0, 0].set(jnp.nan))
    assert np.isnan(float(value))
    assert _bits((state["params"], state["opt"])) == before  # skipped: the very bits
    assert float(state["scaler"].scaler) == 2.0**11 and int(state["scaler"].total_resets) == 1
    state, value = train_step(state, x)
    assert int(state["opt"]["count"]) == 2 and float(value) < float(first)


def test_every_replica_takes_the_same_decision():
    n = jax.local_device_count()
    grads = jnp.ones((n, 3)).at[n - 1, 0].set(jnp.inf)  # one replica overflowed
    states = jax.tree.map(lambda a: jnp.stack([a] * n), jaxamp.DynamicScalerState(scaler=16.0))
    new, finite = jax.pmap(lambda s, g: update_scale(s, g, axis_name="i"), axis_name="i")(states, grads)
    assert not np.asarray(finite).any() and np.asarray(new.scaler).tolist() == [8.0] * n
    with pytest.raises(ValueError, match="axis_name"):
        jax.pmap(lambda s, g: update_scale(s, g), axis_name="i")(states, grads)
