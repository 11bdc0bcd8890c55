"""jaxamp.optim.cast_state: any optimizer's state stored in bfloat16 (or float16)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxamp.optim import CastStateState, cast_state

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w": jax.random.normal(k1, (8, 4)), "b": jax.random.normal(k2, (4,)), "s": jnp.array(0.5)}


def _grads(i):
    return jax.tree.map(lambda p: jnp.cos(p * (i + 1.0)), _params())


@functools.cache
def _runner(optimizer, steps=6):
    """Jitted: `steps` updates inside `lax.scan`, which fails if a state leaf changes dtype."""

    def run(params, state):
        def body(carry, i):
            params, state = carry
            updates, state = optimizer.update(_grads(i), state, params)
            return (optax.apply_updates(params, updates), state), None

        return jax.lax.scan(body, (params, state), jnp.arange(steps))[0]

    return jax.jit(run)


def _run(optimizer, state=None):
    params = _params()
    return _runner(optimizer)(params, jax.jit(optimizer.init)(params) if state is None else state)


OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "lion": lambda: optax.lion(1e-3),
    "clip + adamw": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
    "MultiSteps(adamw)": lambda: optax.MultiSteps(optax.adamw(1e-2), every_k_schedule=2),
    "sgd + momentum": lambda: optax.sgd(1e-2, momentum=0.9),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_is_stored_in_bfloat16_and_training_matches_float32(name):
    optimizer = cast_state(OPTIMIZERS[name](), rounding="stochastic", key=jax.random.key(1))
    params, state = _run(optimizer)
    reference_optimizer = OPTIMIZERS[name]()
    reference, reference_state = _run(reference_optimizer)
    assert isinstance(state, CastStateState)
    stored = 0
    for path, leaf, original in zip(
        *zip(*jax.tree_util.tree_leaves_with_path(state.inner_state)), jax.tree.leaves(reference_state)
    ):
        if jnp.issubdtype(original.dtype, jnp.floating) and original.ndim:
            assert leaf.dtype == BF16, jax.tree_util.keystr(path)
            stored += 1
        else:  # step counts and float32 scalars: untouched
            assert leaf.dtype == original.dtype, jax.tree_util.keystr(path)
    assert stored >= 2  # two parameters' worth, at least
    for p, r in zip(jax.tree.leaves(params), jax.tree.leaves(reference)):
        assert p.dtype == F32
        np.testing.assert_allclose(p, r, rtol=0.02, atol=2e-3)


def test_multisteps_outside_cast_state_keeps_its_accumulator_in_float32():
    optimizer = optax.MultiSteps(cast_state(optax.adamw(1e-2)), every_k_schedule=2)
    _, state = _run(optimizer)
    assert all(leaf.dtype == F32 for leaf in jax.tree.leaves(state.acc_grads))
    assert state.inner_opt_state.inner_state[0].mu["w"].dtype == BF16


def test_float32_storage_is_the_optimizer_itself():
    params, state = _run(cast_state(optax.adamw(1e-2), jnp.float32))
    reference, reference_state = _run(optax.adamw(1e-2))
    for a, b in zip(jax.tree.leaves((params, state.inner_state)), jax.tree.leaves((reference, reference_state))):
        np.testing.assert_array_equal(a, b)


def test_float16_storage_and_names():
    _, state = _run(cast_state(optax.adam(1e-2), "f16"))
    assert state.inner_state[0].nu["w"].dtype == F16


def test_hyperparameters_in_the_state_are_not_rounded():
    optimizer = cast_state(optax.inject_hyperparams(optax.adam)(learning_rate=3e-3))
    _, state = _run(optimizer)
    assert state.inner_state.hyperparams["learning_rate"].dtype == F32
    assert float(state.inner_state.hyperparams["learning_rate"]) == np.float32(3e-3)


def test_adam_nu_decays_only_with_stochastic_rounding():
    # With b2 = 0.999 each step shrinks nu by 0.1%, under half of bfloat16's
    # spacing: rounded to nearest it never decays; rounded stochastically it
    # follows float32 on average.
    steps = 300
    grads = jnp.concatenate([jnp.ones((1, 4096)), jnp.zeros((steps - 1, 4096))])

    def final_nu(optimizer):
        def body(state, g):
            return optimizer.update(g, state)[1], None

        state, _ = jax.lax.scan(body, optimizer.init(jnp.zeros(4096)), grads)
        inner = state.inner_state if isinstance(state, CastStateState) else state
        return np.asarray(inner.nu, np.float64)

    adam = optax.scale_by_adam(b2=0.999)
    exact = final_nu(adam)  # 0.001 * 0.999**299 = 7.4e-4
    nearest = final_nu(cast_state(adam))
    stochastic = final_nu(cast_state(adam, rounding="stochastic", key=jax.random.key(0)))
    assert np.all(nearest == np.float64(jnp.bfloat16(1e-3)))  # stuck at its first value
    # 4096 independent roundings: the mean is within 1% of float32 (measured 0.1%).
    assert abs(stochastic.mean() / exact.mean() - 1) < 0.01


def test_stochastic_rounding_key_advances_and_is_reproducible():
    optimizer = cast_state(optax.adam(1e-2), rounding="stochastic", key=jax.random.key(3))
    start = optimizer.init(_params())
    (p1, s1), (p2, s2) = _run(optimizer, start), _run(optimizer, start)
    p3, _ = _run(optimizer, start._replace(key=jax.random.key(4)))
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_array_equal(a, b)
    assert np.array_equal(jax.random.key_data(s1.key), jax.random.key_data(s2.key))
    assert not np.array_equal(jax.random.key_data(s1.key), jax.random.key_data(start.key))
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p3)))


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        ((jnp.int8,), {}, TypeError, "dtype must be one of bfloat16, float16, float32"),
        ((np.float64,), {}, TypeError, "got <class 'numpy.float64'>"),
        (("f17",), {}, TypeError, "got 'f17'"),
        ((None,), {}, TypeError, "got None"),
        ((), {"rounding": "kahan"}, ValueError, "rounding must be one of 'nearest', 'stochastic', got 'kahan'"),
        ((), {"rounding": "stochastic"}, ValueError, "needs a PRNG key"),
        ((), {"key": jax.random.key(0)}, ValueError, "key is only used by rounding='stochastic'"),
    ],
)  # fmt: skip
def test_bad_options_fail_at_construction(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        cast_state(optax.adam(1e-3), *args, **kwargs)


def test_not_an_optimizer():
    with pytest.raises(TypeError, match="cast_state expects an optax GradientTransformation"):
        cast_state(optax.adam)


def test_an_optimizer_that_changes_a_stored_leaf_kind_is_named():
    def init(params):
        return {"m": jnp.zeros(3)}

    def update(grads, state, params=None):
        return grads, {"m": jnp.zeros(3, jnp.int32)}

    optimizer = cast_state(optax.GradientTransformation(init, update))
    state = optimizer.init(jnp.zeros(3))
    with pytest.raises(TypeError, match=r"state at \['m'\] was stored in bfloat16, but its update returned"):
        optimizer.update(jnp.ones(3), state)
