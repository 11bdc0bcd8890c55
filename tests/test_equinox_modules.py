"""Equinox modules, non-array fields and all, go into every tree API as they are.

An `eqx.nn.MLP` keeps its activation function among its leaves (and
`eqx.nn.Dropout` a Python float); `equinox.filter_grad` gives those leaves
``None`` gradients. Every jaxamp function that takes parameters, updates or a
tree accepts such a module and leaves those leaves untouched.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp


class Model(eqx.Module):
    mlp: eqx.nn.MLP
    dropout: eqx.nn.Dropout
    name: str = "model"

    def __call__(self, x, key=None):
        return self.dropout(self.mlp(x), inference=key is None, key=key)


def _model():
    return Model(eqx.nn.MLP(4, 2, 8, 2, key=jax.random.PRNGKey(0)), eqx.nn.Dropout(0.1))


def loss_fn(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2)


def _grads(model, nan=False):
    x = jnp.ones((3, 4)).at[0, 0].set(jnp.nan if nan else 1.0)
    return eqx.filter_grad(loss_fn)(model, x)


def _non_arrays(tree):
    return [leaf for leaf in jax.tree_util.tree_leaves(tree) if not eqx.is_array(leaf)]


def _arrays_bits(tree):
    return [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree) if eqx.is_array(leaf)]


def test_all_finite_and_select_tree():
    model = _model()
    assert bool(jaxamp.all_finite(model))
    other = jax.tree_util.tree_map(lambda x: x + 1 if eqx.is_array(x) else x, model)
    chosen = jaxamp.select_tree(jnp.array(False), model, other)
    assert _non_arrays(chosen) == _non_arrays(model)
    assert _arrays_bits(chosen) == _arrays_bits(other)


def test_select_tree_refuses_different_non_array_leaves():
    a, b = _model(), eqx.tree_at(lambda m: m.name, _model(), "other")
    with pytest.raises(ValueError, match="differ in a non-array leaf"):
        jaxamp.select_tree(jnp.array(True), a, b)


@pytest.mark.parametrize(
    "wrap",
    [
        lambda opt: jaxamp.scaling.skip_nonfinite_updates(opt),
        lambda opt: jaxamp.optim.cast_state(opt),
        lambda opt: jaxamp.scaling.skip_nonfinite_updates(jaxamp.optim.cast_state(opt)),
    ],
    ids=["skip_nonfinite_updates", "cast_state", "both"],
)
def test_optimizer_wrappers_take_the_module_as_params(wrap):
    model = _model()
    optimizer = wrap(optax.adam(1e-2))
    state = optimizer.init(model)  # no eqx.filter needed
    updates, state = optimizer.update(_grads(model), state, model)
    new = jaxamp.scaling.apply_if_finite_updates(model, updates, jaxamp.all_finite(updates))
    assert _non_arrays(new) == _non_arrays(model)
    assert _arrays_bits(new) != _arrays_bits(model)


def test_a_nonfinite_step_keeps_the_module_bit_for_bit():
    model = _model()
    optimizer = jaxamp.scaling.skip_nonfinite_updates(optax.adam(1e-2))
    state = optimizer.init(model)
    updates, state = optimizer.update(_grads(model, nan=True), state, model)
    assert not bool(state.last_finite)
    new = jaxamp.scaling.apply_if_finite_updates(model, updates, state.last_finite)
    assert _arrays_bits(new) == _arrays_bits(model) and _non_arrays(new) == _non_arrays(model)


def test_low_precision_params_take_a_bfloat16_module():
    model = jaxamp.policies.cast_floating(_model(), jnp.bfloat16)
    assert _non_arrays(model) == _non_arrays(_model())  # cast_floating leaves them too
    optimizer = jaxamp.optim.low_precision_params(optax.adam(1e-2), key=jax.random.key(0))
    state = optimizer.init(model)
    updates, state = optimizer.update(_grads(model), state, model)
    new = optax.apply_updates(eqx.filter(model, eqx.is_array), updates)
    new = eqx.combine(new, model)
    assert jax.tree_util.tree_leaves(new.mlp)[0].dtype == jnp.bfloat16
    assert _non_arrays(new) == _non_arrays(model)


def test_dynamic_scaler_and_grad_scaler_train_a_module_under_filter_jit():
    model = _model()
    optimizer = jaxamp.scaling.skip_nonfinite_updates(optax.adam(1e-2))
    grad_fn = jaxamp.dynamic_scale_value_and_grad(jaxamp.amp(loss_fn, compute_dtype="f16"))

    @eqx.filter_jit
    def step(model, opt_state, scaler, x):
        scaler, (loss, grads) = grad_fn(model, x, dynamic_scaler_state=scaler)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return jaxamp.scaling.apply_if_finite_updates(model, updates, opt_state.last_finite), opt_state, scaler

    opt_state, scaler = optimizer.init(model), jaxamp.DynamicScalerState()
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 4))
    for _ in range(3):
        model, opt_state, scaler = step(model, opt_state, scaler, x)
    assert int(scaler.count) == 3 and _non_arrays(model) == _non_arrays(_model())

    grad_scaler = jaxamp.GradScaler()
    grads = eqx.filter_grad(lambda m: grad_scaler.scale(loss_fn(m, x)))(model)
    plain = optax.adam(1e-2)
    new, _, _ = grad_scaler.step(plain, grads, plain.init(eqx.filter(model, eqx.is_array)), model)
    assert _non_arrays(new) == _non_arrays(model)
