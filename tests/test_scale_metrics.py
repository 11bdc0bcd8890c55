"""`jaxamp.scaling.scale_metrics` and `record_scale_metrics`: the loss scale where the framework logs.

The metrics are read from every state amp's ``loss_scale=`` takes (found by
type: inside optax combinators, a flax ``TrainState``, an ``nnx.Optimizer``),
inside `jax.jit` and out, and reach `jax.monitoring`'s listeners on the host.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import jaxamp
from jaxamp.scaling import record_scale_metrics, scale_metrics

# Gradients are made by hand here, not by an amp given the scale.
pytestmark = pytest.mark.filterwarnings("ignore:jaxamp.loss_scaling's update reads a loss scale")

PARAMS = {"w": jnp.array([1.0, -2.0])}
GOOD = {"w": jnp.array([0.5, 0.5])}
BAD = {"w": jnp.array([jnp.nan, 0.5])}


def _values(metrics):
    return {name: np.asarray(value).item() for name, value in metrics.items()}


def test_a_fresh_state_then_a_skipped_step():
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1))
    opt_state = optimizer.init(PARAMS)
    metrics = scale_metrics(opt_state)
    assert _values(metrics) == {"loss_scale": 32768.0, "skipped_steps": 0, "last_step_finite": True}
    assert [m.dtype for m in metrics.values()] == [jnp.float32, jnp.int32, jnp.bool_]
    _, opt_state = optimizer.update(BAD, opt_state, PARAMS)
    _, opt_state = optimizer.update(BAD, opt_state, PARAMS)
    assert _values(scale_metrics(opt_state)) == {"loss_scale": 8192.0, "skipped_steps": 2, "last_step_finite": False}
    _, opt_state = optimizer.update(GOOD, opt_state, PARAMS)
    assert _values(scale_metrics(opt_state)) == {"loss_scale": 8192.0, "skipped_steps": 2, "last_step_finite": True}


def test_inside_jit_the_values_are_arrays_of_the_step():
    optimizer = jaxamp.loss_scaling(optax.adam(1e-3), scaler=2.0**10)

    @jax.jit
    def step(opt_state, grads):
        _, opt_state = optimizer.update(grads, opt_state, PARAMS)
        return opt_state, {"train_loss": jnp.float32(0.5)} | scale_metrics(opt_state)

    opt_state, metrics = step(optimizer.init(PARAMS), BAD)
    assert all(isinstance(v, jax.Array) for v in metrics.values())
    assert _values(metrics) == {"train_loss": 0.5, "loss_scale": 512.0, "skipped_steps": 1, "last_step_finite": False}


@pytest.mark.parametrize(
    "wrap",
    [
        lambda tx: jaxamp.loss_scaling(optax.chain(optax.clip_by_global_norm(1.0), tx)),
        lambda tx: jaxamp.loss_scaling(optax.MultiSteps(tx, 2)),
        lambda tx: optax.chain(optax.clip_by_global_norm(1.0), jaxamp.loss_scaling(tx)),
        lambda tx: optax.inject_hyperparams(lambda learning_rate: jaxamp.loss_scaling(optax.sgd(learning_rate)))(
            learning_rate=0.1
        ),
    ],
    ids=["chain_inside", "multisteps", "chain_outside", "inject_hyperparams"],
)
def test_found_by_type_in_optax_states(wrap):
    optimizer = wrap(optax.sgd(0.1))
    opt_state = optimizer.init(PARAMS)
    _, opt_state = optimizer.update(BAD, opt_state, PARAMS)
    metrics = _values(scale_metrics(opt_state))
    assert metrics["last_step_finite"] is False
    # MultiSteps decides at the real step (every 2nd micro-batch): the scale has not moved yet.
    multisteps = isinstance(jaxamp.scaling._loss_scaling.find_scale_state(opt_state).inner_state, optax.MultiStepsState)
    assert metrics["loss_scale"] == (32768.0 if multisteps else 16384.0)
    assert metrics["skipped_steps"] == (0 if multisteps else 1)


def test_a_flax_train_state_and_an_nnx_optimizer():
    state = train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=jaxamp.loss_scaling(optax.sgd(0.1)))
    state = jax.jit(lambda s: s.apply_gradients(grads=BAD))(state)
    assert _values(scale_metrics(state)) == {"loss_scale": 16384.0, "skipped_steps": 1, "last_step_finite": False}

    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, jaxamp.loss_scaling(optax.sgd(0.1), scaler=64.0), wrt=nnx.Param)
    grads = jax.tree.map(lambda p: jnp.full_like(p, jnp.inf), nnx.state(model, nnx.Param))

    @nnx.jit
    def step(model, optimizer, grads):
        optimizer.update(model, grads)
        return scale_metrics(optimizer.opt_state)

    assert _values(step(model, optimizer, grads)) == {"loss_scale": 32.0, "skipped_steps": 1, "last_step_finite": False}
    assert _values(scale_metrics(optimizer.opt_state))["loss_scale"] == 32.0  # outside jit too


def test_a_bare_scaler_state_says_finite_only_when_told():
    state = jaxamp.DynamicScalerState(scaler=4.0, total_resets=3)
    assert _values(scale_metrics(state)) == {"loss_scale": 4.0, "skipped_steps": 3}
    assert _values(scale_metrics(state, jnp.array(False)))["last_step_finite"] is False


def test_a_state_without_a_scale_is_refused():
    with pytest.raises(ValueError, match="scale_metrics's state must be an optimizer state holding exactly one"):
        scale_metrics(optax.sgd(0.1).init(PARAMS))


@pytest.fixture
def heard():
    scalars, events = [], []

    def on_scalar(event, value, **tags):
        scalars.append((event, value, tags))

    def on_event(event, **tags):
        events.append((event, tags))

    jax.monitoring.register_scalar_listener(on_scalar)
    jax.monitoring.register_event_listener(on_event)
    yield scalars, events
    jax.monitoring.unregister_scalar_listener(on_scalar)
    jax.monitoring.unregister_event_listener(on_event)


def _ours(records):
    return [r for r in records if r[0].startswith("/jaxamp/")]


def test_listeners_hear_the_metrics_and_each_skipped_step(heard):
    scalars, events = heard
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1))
    opt_state = optimizer.init(PARAMS)
    assert record_scale_metrics(opt_state, step=0) == {
        "loss_scale": 32768.0,
        "skipped_steps": 0,
        "last_step_finite": True,
    }
    assert _ours(events) == []
    _, opt_state = optimizer.update(BAD, opt_state, PARAMS)
    step = jax.jit(lambda s: scale_metrics(s))  # the dict a jitted step returns, fetched
    record_scale_metrics(step(opt_state), step=1)
    assert _ours(scalars)[3:] == [
        ("/jaxamp/loss_scaling/loss_scale", 16384.0, {"step": 1}),
        ("/jaxamp/loss_scaling/skipped_steps", 1, {"step": 1}),
        ("/jaxamp/loss_scaling/last_step_finite", 0, {"step": 1}),
    ]
    assert _ours(events) == [("/jaxamp/loss_scaling/skipped_step", {"step": 1})]


def test_recording_under_jit_is_a_type_error():
    state = jaxamp.DynamicScalerState()
    with pytest.raises(TypeError, match="record_scale_metrics reads the loss scale on the host"):
        jax.jit(record_scale_metrics)(state)


def test_replicas_give_one_value():
    state = jax.tree.map(lambda a: jnp.stack([a, a]), jaxamp.DynamicScalerState(scaler=8.0))
    assert record_scale_metrics(state) == {"loss_scale": 8.0, "skipped_steps": 0}
