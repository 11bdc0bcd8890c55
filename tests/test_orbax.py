"""Every jaxamp state round-trips through Orbax's standard checkpointing API.

Saved with `orbax.checkpoint.StandardCheckpointer` and restored into a target
of the same structure: values bit for bit, dtypes, PRNG keys (typed and raw)
and the pytree structure come back, and a restored scaler behaves as the saved
one, settings included.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxamp
from jaxamp.optim import cast_state, low_precision_params

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals


def _params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w": jax.random.normal(k1, (4, 3)).astype(jnp.bfloat16), "b": jax.random.normal(k2, (3,))}


def _after_a_step(optimizer, params):
    state = optimizer.init(params)
    grads = jax.tree_util.tree_map(lambda p: jnp.full(p.shape, 0.3, p.dtype), params)
    _, state = optimizer.update(grads, state, params)
    return state


def _grad_scaler_after_a_step():
    grad_scaler = jaxamp.GradScaler(init_scale=2.0**12, growth_interval=3, min_scale=0.5)
    return grad_scaler.unscale(_params())[1].update()


def _rounded_optimizer(rounding):
    key = jax.random.key(3)
    if rounding == "stochastic":
        return low_precision_params(cast_state(optax.adamw(1e-3), rounding="stochastic", key=key), key=key)
    return low_precision_params(optax.sgd(1e-3), rounding=rounding)


# One of each state type jaxamp defines, after a step, so nothing is a default;
# built by the test that saves it (not at collection, and one at a time).
STATES = {
    "dynamic_scaler": lambda: jaxamp.DynamicScalerState(scaler=2.0**10, count=7, total_resets=2, patience=50),
    "grad_scaler": _grad_scaler_after_a_step,
    "jmp_loss_scale": lambda: jaxamp.DynamicLossScale(jnp.float32(2.0**9), jnp.int32(5), period=10),
    "skip_nonfinite": lambda: _after_a_step(jaxamp.scaling.skip_nonfinite_updates(optax.adam(1e-3)), _params()),
    "stochastic_rounding": lambda: _after_a_step(_rounded_optimizer("stochastic"), _params()),
    "kahan": lambda: _after_a_step(_rounded_optimizer("kahan"), _params()),
    "raw_key": lambda: {"key": jax.random.PRNGKey(11)},  # Orbax saves trees, not bare arrays
    "typed_key": lambda: {"key": jax.random.key(12)},
}


def _leaves(tree):
    return [
        jax.random.key_data(leaf) if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) else leaf
        for leaf in jax.tree_util.tree_leaves(tree)
    ]


def _save_and_restore(tmp_path, tree, target=None):
    path = tmp_path / "checkpoint"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, tree)
        checkpointer.wait_until_finished()
        return checkpointer.restore(path, target if target is not None else tree)


@pytest.mark.parametrize("name", sorted(STATES))
def test_orbax_round_trips_every_state(tmp_path, name):
    state = STATES[name]()
    restored = _save_and_restore(tmp_path, state)
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(state)
    for before, after in zip(_leaves(state), _leaves(restored)):
        assert after.dtype == before.dtype and after.shape == before.shape
        np.testing.assert_array_equal(np.asarray(after), np.asarray(before))
    for before, after in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(restored)):
        assert jax.typeof(after) == jax.typeof(before)  # a typed key stays typed


def test_orbax_restored_grad_scaler_keeps_its_saved_settings(tmp_path):
    # The target is built with the defaults (growth interval 2000, ...): the
    # saved settings win, as torch's GradScaler.load_state_dict makes them.
    saved = jaxamp.GradScaler(
        init_scale=8.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3, min_scale=2.0, max_scale=2.0**10
    )
    restored = _save_and_restore(tmp_path, saved, target=jaxamp.GradScaler())
    assert restored.state_dict() == saved.state_dict()
    assert restored.get_growth_interval() == 3 and restored.get_growth_factor() == 4.0
    # And it behaves so: three finite steps grow the scale by 4.
    grads = {"w": jnp.ones(2)}
    for _ in range(3):
        _, _, restored = restored.step(optax.sgd(0.1), grads, optax.sgd(0.1).init(grads), grads)
        restored = restored.update()
    assert restored.get_scale() == 32.0


@pytest.mark.newest_only
def test_orbax_restored_dynamic_scaler_keeps_its_saved_settings(tmp_path):
    saved = jaxamp.DynamicScalerState(patience=3, adjust_factor=4.0, scaler=8.0, min_scaler=2.0, max_scaler=2.0**10)
    restored = _save_and_restore(tmp_path, saved, target=jaxamp.DynamicScalerState())
    for field in saved._fields:
        assert np.asarray(getattr(restored, field)) == np.asarray(getattr(saved, field)), field


@pytest.mark.newest_only
def test_orbax_restores_a_train_state_under_jit_and_keeps_training(tmp_path):
    # A whole f16 train state; training resumed from the checkpoint matches
    # training that never stopped, bit for bit.
    params = {"w": jnp.ones((3, 2)) / 3}
    optimizer = jaxamp.scaling.skip_nonfinite_updates(optax.adam(1e-2))
    grad_fn = jaxamp.dynamic_scale_value_and_grad(
        jaxamp.amp(lambda p, x: jnp.mean((x @ p["w"]) ** 2), compute_dtype="f16"), filter=False
    )

    @jax.jit
    def step(state, x):
        params, opt_state, scaler = state
        scaler, (_, grads) = grad_fn(params, x, dynamic_scaler_state=scaler)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return jaxamp.scaling.apply_if_finite_updates(params, updates, opt_state.last_finite), opt_state, scaler

    xs = [jnp.full((4, 3), i + 1.0) for i in range(4)]
    state = (params, optimizer.init(params), jaxamp.DynamicScalerState(patience=1))
    for x in xs[:2]:
        state = step(state, x)
    restored = _save_and_restore(tmp_path, state)
    for x in xs[2:]:
        state, restored = step(state, x), step(restored, x)
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
