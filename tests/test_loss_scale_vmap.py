"""``jax.vmap`` of an amp'd function with ``loss_scale=``: true-scale gradients for every input.

The Equinox per-example idiom puts amp on the model and vmaps it inside the
loss. The values the batch shares (``in_axes=None``, closed over) then get one
cotangent summed over the batch; amp's unscaling identity must leave it that
one sum, not one per example (a 16-example batch gave gradients 16x too large).
Reference: float32's gradients, within float16's tolerance.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxamp

# Runs on the oldest supported JAX too: custom_vjp batching differs between versions.
pytestmark = pytest.mark.jax_internals

# float16 matmuls against float32's: relative error of each gradient's norm.
F16_RTOL = 2e-2
BATCH = 16


def _inputs():
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    w = jax.random.normal(keys[0], (6, 5)) * 0.4
    b = jax.random.normal(keys[1], (5,)) * 0.1
    x = jax.random.normal(keys[2], (BATCH, 6))
    return w, b, x


def _model(w, b, x):
    return jnp.tanh(x @ w + b)


def _rel_err(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _scale(kind):
    if kind == "float":
        return 2.0**10
    tx = jaxamp.loss_scaling(optax.sgd(0.1))
    state = tx.init(jnp.zeros(()))
    # "tx": the live scale, read from the transformation (loops a framework owns).
    return tx if kind == "tx" else state


@settings(max_examples=12, deadline=None)
@given(
    w_axis=st.sampled_from([None, 0, "closed"]),
    b_axis=st.sampled_from([None, 0, "closed"]),
    scale_kind=st.sampled_from(["float", "state", "tx"]),
)
def test_vmap_of_amp_gives_true_scale_gradients_for_batched_and_shared_inputs(w_axis, b_axis, scale_kind):
    """Each parameter mapped (one copy per example), shared (``in_axes=None``) or closed over."""
    w, b, x = _inputs()
    scale = _scale(scale_kind)

    def loss(w, b, mixed):
        params = {"w": (w, w_axis), "b": (b, b_axis)}
        mapped = {k: v for k, v in params.items() if v[1] != "closed"}

        def per_example(args, x):
            full = {k: (args[k] if k in mapped else params[k][0]) for k in params}
            return _model(full["w"], full["b"], x)

        model = jaxamp.amp(per_example, compute_dtype="f16", loss_scale=scale) if mixed else per_example
        args = {k: (jnp.broadcast_to(v, (BATCH, *v.shape)) if axis == 0 else v) for k, (v, axis) in mapped.items()}
        axes = {k: axis for k, (_, axis) in mapped.items()}
        return jnp.mean(jax.vmap(model, in_axes=(axes, 0))(args, x) ** 2)

    g16 = jax.grad(loss, argnums=(0, 1))(w, b, True)
    g32 = jax.grad(loss, argnums=(0, 1))(w, b, False)
    for got, want in zip(g16, g32):
        assert got.dtype == jnp.float32
        assert _rel_err(got, want) < F16_RTOL, (got, want)


def test_vmap_of_amp_matmul_runs_in_float16():
    w, b, x = _inputs()
    model = jaxamp.amp(_model, compute_dtype="f16", loss_scale=2.0**10)
    jaxpr = jax.make_jaxpr(jax.grad(lambda w: jnp.sum(jax.vmap(model, in_axes=(None, None, 0))(w, b, x))))(w)

    def all_dots(j):
        found = [e for e in j.eqns if e.primitive.name == "dot_general"]
        for e in j.eqns:
            for p in e.params.values():
                inner = getattr(p, "jaxpr", None)
                if inner is not None:
                    found += all_dots(getattr(inner, "jaxpr", inner))
        return found

    dots = all_dots(jaxpr.jaxpr)
    assert dots, "no matmul traced"
    assert all(v.aval.dtype == jnp.float16 for e in dots for v in e.invars), [
        [v.aval.dtype for v in e.invars] for e in dots
    ]


def test_vmap_of_amp_overflow_gives_nan_gradients_for_the_shared_parameters():
    w, b, x = _inputs()
    model = jaxamp.amp(_model, compute_dtype="f16", loss_scale=2.0**15)

    def loss(w, b):
        return jnp.sum(jax.vmap(model, in_axes=(None, None, 0))(w, b, x)) * 1e6

    gw, gb = jax.grad(loss, argnums=(0, 1))(w, b)
    assert np.all(np.isnan(gw)) and np.all(np.isnan(gb))


def test_vmap_of_amp_with_the_live_scale_carries_the_overflow_in_the_gradient():
    # One flag cannot hold a decision per example: under vmap the live scale's
    # overflow travels as NaN, as the state's does, and the update skips it.
    w, b, x = _inputs()
    tx = jaxamp.loss_scaling(optax.sgd(0.1))
    state = tx.init(w)
    model = jaxamp.amp(_model, compute_dtype="f16", loss_scale=tx)

    def loss(w, factor):
        return jnp.sum(jax.vmap(model, in_axes=(None, None, 0))(w, b, x)) * factor

    grads = jax.jit(jax.grad(loss))(w, 1e6)
    assert np.all(np.isnan(grads))
    updates, new_state = tx.update(grads, state, w)
    assert not bool(new_state.last_finite) and float(new_state.scale) == float(state.scale) / 2
    assert np.all(np.asarray(updates) == 0)


def _members(w):
    return jnp.stack([w, w * 0.5])


def test_vmap_over_optimizer_states_trains_each_member_at_its_own_scale():
    w, b, x = _inputs()
    tx = jaxamp.loss_scaling(optax.sgd(0.1))
    states = jax.vmap(tx.init)(_members(w))

    def member(w, s, factor):
        loss = jaxamp.amp(lambda w: jnp.mean(_model(w, b, x)) * factor, compute_dtype="f16", loss_scale=s)
        return tx.update(jax.grad(loss)(w), s, w)

    # The second member's loss overflows float16 at its scale; the first's does not.
    _, states = jax.vmap(member)(_members(w), states, jnp.array([1.0, 1e6]))
    np.testing.assert_array_equal(states.scale, [2.0**15, 2.0**14])
    np.testing.assert_array_equal(states.last_finite, [True, False])


def test_vmap_over_optimizer_states_with_the_live_scale_is_refused_naming_the_state_path():
    w, b, x = _inputs()
    tx = jaxamp.loss_scaling(optax.sgd(0.1))
    states = jax.vmap(tx.init)(_members(w))
    model = jaxamp.amp(lambda w: jnp.mean(_model(w, b, x)), compute_dtype="f16", loss_scale=tx)

    def member(w, s):
        return tx.update(jax.grad(model)(w), s, w)

    with pytest.raises(ValueError, match=r"under jax.vmap \(over optimizer states.*loss_scale=opt_state"):
        jax.vmap(member)(_members(w), states)
