"""skip_nonfinite_updates and apply_if_finite_updates (optax helpers)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp


def _bits(tree):
    return [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree)]


def _params():
    return {"w": jnp.array([1.0, -0.0, -2.0]), "b": jnp.array(0.25)}


def _grads(bad=False):
    grads = {"w": jnp.array([0.5, 1.0, -1.0]), "b": jnp.array(2.0)}
    if bad:
        grads["b"] = jnp.array(jnp.nan)
    return grads


def test_finite_steps_match_the_plain_optimizer():
    plain, wrapped = optax.adam(0.1), jaxamp.scaling.skip_nonfinite_updates(optax.adam(0.1))
    params = _params()
    plain_state, wrapped_state = plain.init(params), wrapped.init(params)
    for _ in range(3):
        expected, plain_state = plain.update(_grads(), plain_state, params)
        updates, wrapped_state = wrapped.update(_grads(), wrapped_state, params)
        assert _bits(updates) == _bits(expected)
    assert _bits(wrapped_state.inner_state) == _bits(plain_state)
    assert bool(wrapped_state.last_finite) and int(wrapped_state.total_notfinite) == 0


def test_non_finite_step_is_skipped_and_counted():
    optimizer = jaxamp.scaling.skip_nonfinite_updates(optax.adam(0.1))
    params = _params()
    state = optimizer.init(params)
    _, state = optimizer.update(_grads(), state, params)
    before = _bits(state.inner_state)
    updates, state = optimizer.update(_grads(bad=True), state, params)
    assert _bits(state.inner_state) == before
    assert all(not np.any(leaf) for leaf in jax.tree_util.tree_leaves(updates))
    assert not bool(state.last_finite)
    assert (int(state.notfinite_count), int(state.total_notfinite)) == (1, 1)
    _, state = optimizer.update(_grads(bad=True), state, params)
    assert (int(state.notfinite_count), int(state.total_notfinite)) == (2, 2)
    _, state = optimizer.update(_grads(), state, params)
    assert (int(state.notfinite_count), int(state.total_notfinite)) == (0, 2)
    assert bool(state.last_finite)


def test_apply_if_finite_updates_keeps_exact_bits_where_apply_updates_does_not():
    optimizer = jaxamp.scaling.skip_nonfinite_updates(optax.sgd(0.1))
    params = _params()
    updates, state = optimizer.update(_grads(bad=True), optimizer.init(params), params)
    kept = jaxamp.scaling.apply_if_finite_updates(params, updates, state.last_finite)
    assert _bits(kept) == _bits(params)
    # Adding the zero updates turns -0.0 into +0.0: that is what the helper avoids.
    assert _bits(optax.apply_updates(params, updates)) != _bits(params)
    updates, state = optimizer.update(_grads(), state, params)
    stepped = jaxamp.scaling.apply_if_finite_updates(params, updates, state.last_finite)
    np.testing.assert_allclose(stepped["w"], [0.95, -0.1, -1.9])


def test_never_gives_up_unlike_optax_apply_if_finite():
    params = _params()
    ours = jaxamp.scaling.skip_nonfinite_updates(optax.sgd(0.1))
    theirs = optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=2)
    our_state, their_state = ours.init(params), theirs.init(params)
    for _ in range(4):
        our_updates, our_state = ours.update(_grads(bad=True), our_state, params)
        their_updates, their_state = theirs.update(_grads(bad=True), their_state, params)
    assert bool(jaxamp.all_finite(our_updates))
    assert not bool(jaxamp.all_finite(their_updates))
    assert int(our_state.total_notfinite) == 4


def test_wraps_chains_under_jit():
    optimizer = jaxamp.scaling.skip_nonfinite_updates(
        optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(), optax.scale(-0.1))
    )

    @jax.jit
    def step(params, state, bad):
        grads = jax.tree_util.tree_map(lambda g: g * jnp.where(bad, jnp.inf, 1.0), _grads())
        updates, state = optimizer.update(grads, state, params)
        return jaxamp.scaling.apply_if_finite_updates(params, updates, state.last_finite), state

    params = _params()
    state = optimizer.init(params)
    params, state = step(params, state, jnp.bool_(False))
    before = _bits((params, state.inner_state))
    skipped_params, skipped_state = step(params, state, jnp.bool_(True))
    assert _bits((skipped_params, skipped_state.inner_state)) == before
    assert int(skipped_state.total_notfinite) == 1


def test_extra_args_are_passed_on():
    seen = {}

    def update(updates, state, params=None, *, value):
        seen["value"] = value
        return updates, state

    inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
    optimizer = jaxamp.scaling.skip_nonfinite_updates(inner)
    optimizer.update(_grads(), optimizer.init(_params()), _params(), value=3.0)
    assert seen["value"] == 3.0


def test_integer_leaves_and_none_are_not_checked():
    optimizer = jaxamp.scaling.skip_nonfinite_updates(optax.identity())
    grads = {"g": jnp.ones(2), "n": jnp.arange(2), "none": None}
    _, state = optimizer.update(grads, optimizer.init(grads))
    assert bool(state.last_finite)


def test_rejects_a_non_optimizer():
    with pytest.raises(TypeError, match="GradientTransformation.*'adam'"):
        jaxamp.scaling.skip_nonfinite_updates("adam")


def test_apply_if_finite_updates_rejects_a_non_boolean_flag():
    with pytest.raises(AssertionError, match="expected boolean scalar"):
        jaxamp.scaling.apply_if_finite_updates(_params(), _params(), jnp.float32(1.0))


def test_state_can_be_donated():
    import jax
    import jax.numpy as jnp
    import optax

    from jaxamp import skip_nonfinite_updates

    params = {"w": jnp.ones(3)}
    opt = skip_nonfinite_updates(optax.sgd(0.1))
    step = jax.jit(lambda g, s: opt.update(g, s, params), donate_argnums=1)
    updates, _ = step(params, opt.init(params))
    assert updates["w"].shape == (3,)
