"""flax nnx modules through jaxamp's loss scalers: their state is carried, never dropped.

`dynamic_scale_value_and_grad(amp(loss))` on an `nnx.Module` updates what the
loss mutates (Dropout's RNG count, BatchNorm's running statistics, any
`nnx.Variable`) as `nnx.value_and_grad` does, under `nnx.jit` and eagerly,
with and without redo; a redone step advances the RNG once; a skipped step
(a NaN batch) commits no state.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxamp


class Net(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(8, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)
        self.calls = nnx.Variable(jnp.zeros((), jnp.int32))  # a custom Variable

    def __call__(self, x):
        self.calls[...] += 1
        return self.out(self.dropout(nnx.relu(self.bn(self.linear(x)))))


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def _batch(nan=False):
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 8))
    return (x.at[0, 0].set(jnp.nan) if nan else x), jnp.zeros((8, 1))


def _state(model):
    return (
        int(model.dropout.rngs.count[...]),
        int(model.calls[...]),
        np.asarray(model.bn.mean[...]),
        np.asarray(model.bn.var[...]),
    )


def _scaled_step(entry_point, redo_on_nan):
    grad_fn = entry_point(jaxamp.amp(loss_fn, compute_dtype="f16"), redo_on_nan=redo_on_nan)

    @nnx.jit
    def step(model, scaler, x, y):
        scaler, results = grad_fn(model, x, y, dynamic_scaler_state=scaler)
        return scaler, results

    return step


@nnx.jit
def _reference_step(model, x, y):
    return nnx.value_and_grad(jaxamp.amp(loss_fn, compute_dtype="f16"))(model, x, y)


@pytest.mark.parametrize("redo_on_nan", [0, 3])
@pytest.mark.parametrize("entry_point", [jaxamp.dynamic_scale_value_and_grad, jaxamp.dynamic_scale_grad])
def test_module_state_advances_as_under_nnx_value_and_grad(entry_point, redo_on_nan):
    model, reference = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
    step = _scaled_step(entry_point, redo_on_nan)
    scaler = jaxamp.DynamicScalerState()
    x, y = _batch()
    for _ in range(2):
        scaler, results = step(model, scaler, x, y)
        _, ref_grads = _reference_step(reference, x, y)
    grads = results[1] if entry_point is jaxamp.dynamic_scale_value_and_grad else results
    assert isinstance(grads, nnx.State)  # as nnx.value_and_grad returns them
    (count, calls, mean, var), (ref_count, ref_calls, ref_mean, ref_var) = _state(model), _state(reference)
    assert (count, calls) == (ref_count, ref_calls) == (2, 2)
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(var, ref_var, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(grads["out"]["kernel"][...], ref_grads["out"]["kernel"][...], rtol=1e-2, atol=1e-4)


def test_two_steps_draw_two_dropout_masks():
    model = Net(nnx.Rngs(0))
    step = _scaled_step(jaxamp.dynamic_scale_value_and_grad, 0)
    scaler = jaxamp.DynamicScalerState()
    losses = []
    for _ in range(2):
        scaler, (loss, _) = step(model, scaler, *_batch())
        losses.append(float(loss))
    assert losses[0] != losses[1]


def test_a_redone_step_advances_the_rng_once():
    # Scale 2**24 overflows this float16 backward pass; the redo loop tries
    # again at smaller scales, each attempt from the state before the step.
    model = Net(nnx.Rngs(0))
    step = _scaled_step(jaxamp.dynamic_scale_value_and_grad, 20)
    scaler = jaxamp.DynamicScalerState(scaler=2.0**24)
    scaler, (loss, _) = step(model, scaler, *_batch())
    assert int(scaler.total_resets) > 0 and np.isfinite(float(loss))
    assert _state(model)[:2] == (1, 1)


@pytest.mark.parametrize("redo_on_nan", [0, 3])
def test_a_skipped_step_commits_no_module_state(redo_on_nan):
    model = Net(nnx.Rngs(0))
    step = _scaled_step(jaxamp.dynamic_scale_value_and_grad, redo_on_nan)
    scaler = jaxamp.DynamicScalerState()
    scaler, _ = step(model, scaler, *_batch())
    before = _state(model)
    scaler, (loss, _) = step(model, scaler, *_batch(nan=True))
    assert np.isnan(float(loss)) and int(scaler.total_resets) == 1
    after = _state(model)
    assert after[:2] == before[:2]
    np.testing.assert_array_equal(after[2], before[2])
    assert np.isfinite(after[2]).all() and np.isfinite(after[3]).all()
    scaler, _ = step(model, scaler, *_batch())  # training goes on
    assert _state(model)[:2] == (2, 2) and not np.array_equal(_state(model)[2], before[2])


def test_eager_call_carries_state_too():
    model = Net(nnx.Rngs(0))
    grad_fn = jaxamp.dynamic_scale_value_and_grad(jaxamp.amp(loss_fn, compute_dtype="f16"))
    grad_fn(model, *_batch(), dynamic_scaler_state=jaxamp.DynamicScalerState())
    assert _state(model)[:2] == (1, 1)


def test_filter_false_with_nnx_modules_is_a_type_error_naming_filter():
    grad_fn = jaxamp.dynamic_scale_value_and_grad(loss_fn, filter=False)
    with pytest.raises(TypeError, match="filter=True"):
        grad_fn(Net(nnx.Rngs(0)), *_batch(), dynamic_scaler_state=jaxamp.DynamicScalerState())


def test_a_loss_that_adds_a_module_attribute_is_an_error_naming_the_scaler():
    class Sowing(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, x):
            out = self.linear(x)
            self.sow(nnx.Intermediate, "out", out)
            return out

    grad_fn = jaxamp.dynamic_scale_value_and_grad(lambda m, x, y: jnp.mean((m(x) - y) ** 2))
    with pytest.raises(ValueError, match="jaxamp's loss scaler: fn changed the structure"):
        grad_fn(Sowing(nnx.Rngs(0)), *_batch(), dynamic_scaler_state=jaxamp.DynamicScalerState())
