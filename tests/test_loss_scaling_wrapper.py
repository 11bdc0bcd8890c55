"""`jaxamp.loss_scaling`: the optax wrapper whose state holds the loss scale.

Its scale moves exactly as `DynamicScalerState`'s does on the same sequence of
finite and non-finite steps (one implementation), a skipped step leaves the
inner optimizer state bit for bit, and the state composes with optax's
combinators (chain, MultiSteps, inject_hyperparams) and Orbax.
"""

import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxamp
from jaxamp.scaling._loss_scaling import find_scaler_state

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = [
    pytest.mark.jax_internals,
    # The wrapper is fed gradients made by hand here, not by an amp given its
    # scale: the update's warning of that is tested in test_loss_scale_reach.py.
    pytest.mark.filterwarnings("ignore:jaxamp.loss_scaling's update reads a loss scale that no jaxamp.amp call"),
]


def _bits(tree):
    return [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree)]


def _params():
    return {"w": jnp.array([1.0, -2.0, 0.5]), "b": jnp.array(0.25)}


def _grads(bad=False):
    value = jnp.nan if bad else 0.5
    return {"w": jnp.array([0.5, 1.0, -1.0]), "b": jnp.array(value)}


def _scaler_fields(state):
    return [np.asarray(x).tobytes() for x in (state.scaler, state.count, state.total_resets)]


# --- the same transitions as DynamicScalerState --------------------------------


@functools.cache
def _steppers(patience, adjust_factor, min_scaler, max_scaler):
    wrapper = jaxamp.loss_scaling(
        optax.sgd(0.1),
        scaler=8.0,
        patience=patience,
        adjust_factor=adjust_factor,
        min_scaler=min_scaler,
        max_scaler=max_scaler,
    )

    @jax.jit
    def wrapper_step(state, bad):
        grads = {"w": jnp.where(bad, jnp.nan, jnp.ones(3))}
        return wrapper.update(grads, state, {"w": jnp.ones(3)})[1]

    # The explicit-state path, with a loss whose gradient is non-finite when `bad`.
    grad = jaxamp.dynamic_scale_grad(lambda p, bad: jnp.sum(p["w"] * jnp.where(bad, jnp.nan, 1.0)))

    @jax.jit
    def scaler_step(state, bad):
        return grad({"w": jnp.ones(3)}, bad, dynamic_scaler_state=state)[0]

    return wrapper, wrapper_step, scaler_step


@settings(max_examples=25, deadline=None)
@given(
    steps=st.lists(st.booleans(), min_size=1, max_size=24),
    patience=st.integers(0, 3),
    adjust_factor=st.sampled_from([1.0, 2.0, 3.0]),
    bounds=st.sampled_from([(1.0, 2.0**24), (2.0, 16.0), (8.0, 8.0), (0.5, 100.0)]),
)
@pytest.mark.newest_only
def test_the_wrapper_moves_the_scale_as_dynamic_scaler_state_does(steps, patience, adjust_factor, bounds):
    wrapper, wrapper_step, scaler_step = _steppers(patience, adjust_factor, *bounds)
    state = wrapper.init({"w": jnp.ones(3)})
    scaler = jaxamp.DynamicScalerState(
        scaler=8.0, patience=patience, adjust_factor=adjust_factor, min_scaler=bounds[0], max_scaler=bounds[1]
    )
    assert _bits(state.scaler_state) == _bits(scaler)
    for bad in steps:
        state, scaler = wrapper_step(state, bad), scaler_step(scaler, bad)
        assert _scaler_fields(state.scaler_state) == _scaler_fields(scaler)
        assert bool(state.last_finite) is (not bad)
        assert bounds[0] <= float(state.scale) <= bounds[1]


@pytest.mark.newest_only
def test_a_non_finite_step_is_skipped_the_inner_state_kept_bit_for_bit_and_the_scale_halved():
    optimizer = jaxamp.loss_scaling(optax.adam(0.1), scaler=2.0**10)
    params = _params()
    state = optimizer.init(params)
    _, state = optimizer.update(_grads(), state, params)
    before = _bits(state.inner_state)
    updates, state = optimizer.update(_grads(bad=True), state, params)
    assert _bits(state.inner_state) == before
    assert all(not np.any(np.asarray(leaf)) for leaf in jax.tree_util.tree_leaves(updates))
    assert not bool(state.last_finite)
    assert float(state.scale) == 2.0**9 and state.scale.dtype == jnp.float32
    assert int(state.scaler_state.total_resets) == 1 and int(state.scaler_state.count) == 0


@pytest.mark.newest_only
def test_finite_steps_give_the_inner_optimizers_updates_bit_for_bit():
    plain, wrapped = optax.adam(0.1), jaxamp.loss_scaling(optax.adam(0.1))
    params = _params()
    plain_state, state = plain.init(params), wrapped.init(params)
    for _ in range(3):
        expected, plain_state = plain.update(_grads(), plain_state, params)
        updates, state = wrapped.update(_grads(), state, params)
        assert _bits(updates) == _bits(expected)
    assert _bits(state.inner_state) == _bits(plain_state)
    assert int(state.scaler_state.count) == 3


@pytest.mark.newest_only
def test_the_scale_stays_within_its_bounds_never_zero_nor_inf():
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1), scaler=4.0, min_scaler=1.0, patience=0, max_scaler=2.0**127)
    params = _params()
    state = optimizer.init(params)
    step = jax.jit(lambda s, bad: optimizer.update(_grads(bad), s, params)[1], static_argnums=1)
    for _ in range(200):
        state = step(state, True)
    assert float(state.scale) == 1.0
    for _ in range(200):
        state = step(state, False)
    assert float(state.scale) == 2.0**127 and np.isfinite(float(state.scale))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"scaler": 0.0}, ValueError, "scaler must be finite and > 0"),
        ({"scaler": 4.0, "min_scaler": 8.0}, ValueError, "scaler must be >= min_scaler"),
        ({"patience": 1.5}, TypeError, "patience must be an int"),
        ({"adjust_factor": 0.5}, ValueError, "adjust_factor must be finite and >= 1"),
        ({"scaler": True}, TypeError, "scaler must be a float or int scalar"),
        ({"axis_name": ["batch"]}, TypeError, "axis_name must be a mesh or pmap axis name"),
    ],
)
def test_bad_settings_are_errors_naming_them(kwargs, error, match):
    with pytest.raises(error, match=match):
        jaxamp.loss_scaling(optax.sgd(0.1), **kwargs)


def test_a_non_optimizer_is_a_type_error():
    with pytest.raises(TypeError, match="jaxamp.loss_scaling expects an optax GradientTransformation"):
        jaxamp.loss_scaling(lambda g: g)


def test_update_with_another_state_is_a_type_error_naming_it():
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1))
    with pytest.raises(TypeError, match="expects the LossScaleState its init made, got tuple"):
        optimizer.update(_grads(), optax.adam(0.1).init(_params()), _params())


# --- composition ------------------------------------------------------------------


@pytest.mark.newest_only
def test_inside_a_chain_the_clip_before_it_sees_the_nan_and_the_step_is_skipped():
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), jaxamp.loss_scaling(optax.adam(0.1)))
    params = _params()
    state = optimizer.init(params)
    updates, state = optimizer.update(_grads(bad=True), state, params)
    assert all(not np.any(np.asarray(leaf)) for leaf in jax.tree_util.tree_leaves(updates))
    assert float(find_scaler_state(state).scaler) == 2.0**14


def test_around_multisteps_one_decision_per_real_step():
    # Outside MultiSteps: one decision per real step, as PyTorch's GradScaler
    # around accumulated gradients. A real step with a non-finite micro-batch
    # is skipped whole (zero updates, the inner optimizer's state and the step
    # count as they were) and the scale halves once; the next real step, all
    # finite, is the mean of its micro-batches.
    every = 3
    optimizer = jaxamp.loss_scaling(
        optax.MultiSteps(optax.adam(1.0), every_k_schedule=every), scaler=2.0**10, patience=1
    )
    params = _params()
    state = optimizer.init(params)
    inner_before = _bits(state.inner_state.inner_opt_state)
    step = jax.jit(lambda s, g: optimizer.update(g, s, params))
    scales, all_updates = [], []
    for grads in [_grads(), _grads(bad=True), _grads(), _grads(), _grads(), _grads()]:
        updates, state = step(state, grads)
        scales.append(float(state.scale))
        all_updates.append(updates)
    # The first real step (micro-batches 0-2) held a NaN: skipped, halved once, at its end.
    assert scales[:3] == [2.0**10, 2.0**10, 2.0**9]
    assert all(not np.any(np.asarray(u["w"])) for u in all_updates[:3])
    assert int(state.scaler_state.total_resets) == 1
    # The second (3-5) is finite: adam's first step, counted once toward growth.
    assert scales[3:] == [2.0**9] * 3 and int(state.scaler_state.count) == 1
    assert int(state.inner_state.gradient_step) == 1
    assert _bits(state.inner_state.inner_opt_state) != inner_before
    np.testing.assert_allclose(np.asarray(all_updates[5]["w"]), -np.sign([0.5, 1.0, -1.0]), rtol=1e-4)
    # Its accumulator stayed finite: nothing of the NaN micro-batch remains.
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(state.inner_state.acc_grads))


@pytest.mark.newest_only
def test_outside_multisteps_a_skipped_real_step_keeps_the_inner_state_bit_for_bit():
    optimizer = jaxamp.loss_scaling(optax.MultiSteps(optax.adam(0.1), every_k_schedule=2))
    params = _params()
    state = optimizer.init(params)
    step = jax.jit(lambda s, g: optimizer.update(g, s, params))
    _, state = step(state, _grads())
    _, state = step(state, _grads())  # a real step taken
    before = (_bits(state.inner_state.inner_opt_state), int(state.inner_state.gradient_step))
    _, state = step(state, _grads(bad=True))
    assert not bool(state.last_finite) and not bool(state.step_finite)
    updates, state = step(state, _grads())  # the end of a real step with a NaN in it
    assert (_bits(state.inner_state.inner_opt_state), int(state.inner_state.gradient_step)) == before
    assert not np.any(np.asarray(updates["w"])) and bool(state.step_finite)


@pytest.mark.newest_only
def test_inside_multisteps_one_decision_per_real_step_on_finite_steps():
    # Inside MultiSteps the wrapper's state only moves when a real step is
    # taken (MultiSteps keeps the inner state between them).
    optimizer = optax.MultiSteps(jaxamp.loss_scaling(optax.sgd(0.1), patience=0, scaler=4.0), every_k_schedule=3)
    params = _params()
    state = optimizer.init(params)
    step = jax.jit(lambda s: optimizer.update(_grads(), s, params)[1])
    scales = []
    for _ in range(6):
        state = step(state)
        scales.append(float(find_scaler_state(state).scaler))
    assert scales == [4.0, 4.0, 8.0, 8.0, 8.0, 16.0]


@pytest.mark.newest_only
def test_inject_hyperparams_inside_and_outside():
    params = _params()
    inner = jaxamp.loss_scaling(optax.inject_hyperparams(optax.adam)(learning_rate=0.1))
    outer = optax.inject_hyperparams(lambda learning_rate: jaxamp.loss_scaling(optax.adam(learning_rate)))(
        learning_rate=0.1
    )
    for optimizer in (inner, outer):
        state = optimizer.init(params)
        _, state = jax.jit(optimizer.update)(_grads(bad=True), state, params)
        assert float(find_scaler_state(state).scaler) == 2.0**14
        updates, state = jax.jit(optimizer.update)(_grads(), state, params)
        np.testing.assert_allclose(np.asarray(updates["b"]), -0.1, rtol=1e-5)  # adam's first step


@pytest.mark.newest_only
def test_an_orbax_round_trip_restores_the_state_and_its_behaviour(tmp_path):
    optimizer = jaxamp.loss_scaling(optax.adam(0.1), scaler=2.0**12, patience=1)
    params = _params()
    state = optimizer.init(params)
    for bad in (False, True, False):
        _, state = optimizer.update(_grads(bad), state, params)
    path = tmp_path / "checkpoint"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, state)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(path, optimizer.init(params))
    assert isinstance(restored, jaxamp.LossScaleState)
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(state)
    assert _bits(restored) == _bits(state)
    expected = optimizer.update(_grads(), state, params)
    got = optimizer.update(_grads(), restored, params)
    assert _bits(got) == _bits(expected)
    assert float(got[1].scale) == 2.0**12  # patience 1: the second clean step in a row grows it


# --- finding the scale in an optimizer state ---------------------------------------


@pytest.mark.newest_only
def test_find_scaler_state_errors_name_what_is_wrong():
    with pytest.raises(ValueError, match="holds no LossScaleState. Wrap the optimizer in jaxamp.loss_scaling"):
        find_scaler_state(optax.adam(0.1).init(_params()))
    two = optax.chain(jaxamp.loss_scaling(optax.sgd(0.1)), jaxamp.loss_scaling(optax.sgd(0.1)))
    with pytest.raises(ValueError, match="holds 2 loss scales"):
        find_scaler_state(two.init(_params()))


# --- every device takes the same decision -------------------------------------------

N = 4


@pytest.mark.newest_only
def test_under_pmap_a_nan_on_one_replica_skips_the_step_on_every_replica():
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1), axis_name="batch")
    params = _params()
    state = optimizer.init(params)

    def replicate(tree):
        return jax.tree_util.tree_map(lambda x: jnp.stack([x] * N), tree)

    grads = replicate(_grads())
    grads["b"] = grads["b"].at[2].set(jnp.nan)  # replica 2 alone overflowed

    @functools.partial(jax.pmap, axis_name="batch")
    def step(grads, state, params):
        return optimizer.update(grads, state, params)

    updates, new = step(grads, replicate(state), replicate(params))
    np.testing.assert_array_equal(np.asarray(new.scale), [2.0**14] * N)
    np.testing.assert_array_equal(np.asarray(new.last_finite), [False] * N)
    assert not np.any(np.asarray(updates["w"]))


def test_under_pmap_without_axis_name_the_update_asks_for_it():
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1))
    params = _params()

    def replicate(tree):
        return jax.tree_util.tree_map(lambda x: jnp.stack([x] * N), tree)

    step = jax.pmap(lambda g, s, p: optimizer.update(g, s, p), axis_name="batch")
    with pytest.raises(ValueError, match=r"jaxamp.loss_scaling runs per device.*pass axis_name='batch'"):
        step(replicate(_grads()), replicate(optimizer.init(params)), replicate(params))


# A driver that wraps a framework's optimizer (or its factory) at import, before
# the framework calls jax.distributed.initialize (MaxText does, in train.main).
_BUILT_BEFORE_INITIALIZE = """
import socket
import jax, optax
import jaxamp
tx = jaxamp.loss_scaling(optax.adam(1e-3), scaler=2.0**12)
factory = jaxamp.scaling.loss_scaling_factory(lambda: optax.adam(1e-3))
with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
jax.distributed.initialize(f"localhost:{port}", num_processes=1, process_id=0)
print(float(tx.init({"w": jax.numpy.ones(2)}).scale), float(factory().init({"w": jax.numpy.ones(2)}).scale))
"""


def test_building_loss_scaling_starts_no_jax_backend():
    done = subprocess.run([sys.executable, "-c", _BUILT_BEFORE_INITIALIZE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["4096.0", "32768.0"]


def test_a_bad_setting_is_still_refused_before_any_array_is_made():
    with pytest.raises(ValueError, match="scaler must be >= min_scaler"):
        jaxamp.loss_scaling(optax.sgd(0.1), scaler=0.5, min_scaler=1.0)
    with pytest.raises(TypeError, match="patience must be an int"):
        jaxamp.loss_scaling(optax.sgd(0.1), patience=2.5)
