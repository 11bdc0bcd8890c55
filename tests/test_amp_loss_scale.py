"""``amp(loss, loss_scale=...)``: loss scaling inside `jax.grad`.

The output's cotangent is multiplied by the scale and the inputs' cotangents
divided by it, so any transform that differentiates the amp'd loss returns the
unscaled value and true-scale gradients from a scaled float16 backward pass:
the same bits as `dynamic_scale_value_and_grad` on finite steps, non-finite
where the scaled pass overflows.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxamp

# These tests' matmuls are small: all of them in float8, the size rule off.
FP8 = jaxamp.fp8.Fp8Recipe(keep_small_bf16=None)

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals

D, H = 8, 16


def _params(dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {
        "w1": (jax.random.normal(k1, (D, H)) / 4).astype(dtype),
        "w2": (jax.random.normal(k2, (H, 2)) / 4).astype(dtype),
    }


def _batch(n=16, big=1.0):
    x = jax.random.normal(jax.random.PRNGKey(1), (n, D)) * big
    y = jax.random.normal(jax.random.PRNGKey(2), (n, 2))
    return x, y


def _loss(params, x, y):
    h = jnp.tanh(x @ params["w1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def _linear_loss(params, x, y):
    # No saturating activation: a large batch overflows the scaled float16
    # backward pass (the weight gradients' matmuls), not the forward.
    return jnp.mean((x @ params["w1"] @ params["w2"] - y) ** 2)


def _loss_aux(params, x, y):
    loss = _loss(params, x, y)
    return loss, {"loss": loss, "n": x.shape[0]}


def _bits(tree):
    return [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree)]


def _finite(tree):
    return all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree_util.tree_leaves(tree))


# --- the same gradients as the explicit-state path ---------------------------------


@pytest.mark.parametrize("scale", [1.0, 2.0**7, 2.0**15])
@pytest.mark.newest_only
def test_gradients_are_those_of_dynamic_scale_value_and_grad_bit_for_bit(scale):
    params, (x, y) = _params(), _batch()
    state = jaxamp.loss_scaling(optax.sgd(0.1), scaler=scale).init(params)

    @jax.jit
    def value_and_grad(params, state, x, y):
        return jax.value_and_grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=state))(params, x, y)

    got = value_and_grad(params, state, x, y)
    explicit = jaxamp.dynamic_scale_value_and_grad(jaxamp.amp(_loss, compute_dtype="f16"))
    _, expected = jax.jit(explicit)(params, x, y, dynamic_scaler_state=jaxamp.DynamicScalerState(scaler=scale))
    assert _finite(got)
    assert _bits(got) == _bits(expected)
    assert got[1]["w1"].dtype == jnp.float32


@pytest.mark.newest_only
def test_where_the_scaled_backward_overflows_both_paths_give_non_finite_gradients():
    params, (x, y) = _params(), _batch(big=30.0)
    scale = 2.0**15
    loss = jaxamp.amp(_linear_loss, compute_dtype="f16", loss_scale=scale)
    value, grads = jax.jit(jax.value_and_grad(loss))(params, x, y)
    explicit = jaxamp.dynamic_scale_value_and_grad(jaxamp.amp(_linear_loss, compute_dtype="f16"))
    state, (_, expected) = jax.jit(explicit)(params, x, y, dynamic_scaler_state=jaxamp.DynamicScalerState(scaler=scale))
    assert np.isfinite(float(value))  # the forward pass was fine: only the scaled backward overflowed
    assert not _finite(grads) and not _finite(expected)
    assert int(state.total_resets) == 1
    # With a scale of 1 the same backward pass stays finite.
    _, unscaled = jax.jit(jax.value_and_grad(jaxamp.amp(_linear_loss, compute_dtype="f16", loss_scale=1.0)))(
        params, x, y
    )
    assert _finite(unscaled)


@pytest.mark.newest_only
def test_value_and_aux_come_back_unscaled():
    params, (x, y) = _params(), _batch()
    (value, aux), grads = jax.value_and_grad(
        jaxamp.amp(_loss_aux, compute_dtype="f16", loss_scale=2.0**10), has_aux=True
    )(params, x, y)
    (plain_value, plain_aux), plain_grads = jax.value_and_grad(
        jaxamp.amp(_loss_aux, compute_dtype="f16"), has_aux=True
    )(params, x, y)
    assert float(value) == float(plain_value) and float(aux["loss"]) == float(plain_aux["loss"])
    assert aux["n"] == 16
    for g, p in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(plain_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(p), rtol=2e-2, atol=1e-4)


@pytest.mark.newest_only
def test_gradients_keep_the_parameters_dtype():
    params, (x, y) = _params(jnp.bfloat16), _batch()
    grads = jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=2.0**8))(params, x, y)
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(grads)} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.newest_only
def test_every_form_of_loss_scale_gives_the_same_gradients():
    params, (x, y) = _params(), _batch()
    optimizer = optax.chain(optax.clip(1.0), jaxamp.loss_scaling(optax.adam(0.1), scaler=2.0**9))
    tree = optimizer.init(params)
    forms = [
        tree,
        tree[1],
        tree[1].scaler_state,
        2.0**9,
        jnp.float32(2.0**9),
        jnp.bfloat16(2.0**9),
        jaxamp.loss_scaling(optax.MultiSteps(optax.sgd(0.1), 2), scaler=2.0**9).init(params),
        optax.inject_hyperparams(lambda learning_rate: jaxamp.loss_scaling(optax.sgd(learning_rate), scaler=2.0**9))(
            learning_rate=0.1
        ).init(params),
    ]
    results = [jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=f))(params, x, y) for f in forms]
    for result in results[1:]:
        assert _bits(result) == _bits(results[0])


def test_the_decorator_form_takes_loss_scale():
    params, (x, y) = _params(), _batch()
    loss = jaxamp.amp(compute_dtype="f16", loss_scale=4.0)(_loss)
    assert _bits(jax.grad(loss)(params, x, y)) == _bits(
        jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=4.0))(params, x, y)
    )


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (True, TypeError, "amp's loss_scale must be .* got the bool True"),
        (0.0, ValueError, "amp's loss_scale must be finite and > 0.0, got 0.0"),
        (-4.0, ValueError, "amp's loss_scale must be finite and > 0.0, got -4.0"),
        (float("inf"), ValueError, "amp's loss_scale must be finite and > 0.0, got inf"),
        (jnp.int32(4), TypeError, "must be a floating scalar .* got an array of dtype int32"),
        (jnp.ones(3), TypeError, "must be a scalar .* got an array of shape \\(3,\\)"),
        ({"adam": optax.adam(0.1).init({"w": jnp.ones(2)})}, ValueError, "holds no LossScaleState"),
        ("2**15", ValueError, "got a str that holds no LossScaleState"),
    ],
)
def test_bad_loss_scale_is_an_error_naming_the_value(bad, error, match):
    with pytest.raises(error, match=match):
        jaxamp.amp(_loss, compute_dtype="f16", loss_scale=bad)


def test_a_state_the_jitted_step_closes_over_is_an_error():
    # Its scale would be a constant of the compiled step: later steps would
    # not see the scale the wrapper moves. Taken as an argument, it is live.
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1))
    params, (x, y) = _params(), _batch()
    opt_state = optimizer.init(params)

    @jax.jit
    def closes_over(params, x, y):
        return jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=opt_state))(params, x, y)

    with pytest.raises(ValueError, match="does not take as an argument.*Pass the optimizer state into the jitted"):
        closes_over(params, x, y)
    wrapped_outside = jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=opt_state))
    with pytest.raises(ValueError, match="does not take as an argument"):
        jax.jit(wrapped_outside)(params, x, y)

    @jax.jit
    def takes_it(params, opt_state, x, y):
        return jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=opt_state))(params, x, y)

    want = takes_it(params, opt_state, x, y)
    # A Python float is a fixed scale by intent; eagerly, the state is read on each call.
    fixed = jax.jit(jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=float(opt_state.scale))))
    assert _bits(fixed(params, x, y)) == _bits(want)
    for eager, jitted in zip(jax.tree_util.tree_leaves(wrapped_outside(params, x, y)), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(eager, jitted, rtol=1e-3, atol=1e-6)  # op by op: float16 rounding apart


def _tiny_loss(params, x, y):
    # Gradients near 1e-9: float16 flushes them to zero unless the backward pass is scaled.
    return _linear_loss(params, x, y) * 1e-7


_GRADIENTS_OF_THE_AMPD_FUNCTION = {
    "value_and_grad(amp(loss))": lambda amped: jax.value_and_grad(amped)(*_STEP_ARGS)[1],
    "grad(jit(amp(loss)))": lambda amped: jax.grad(jax.jit(amped))(*_STEP_ARGS),
    "grad of a scan over amp(loss)": lambda amped: jax.grad(
        lambda p: jax.lax.scan(lambda c, _: (c + amped(p, *_STEP_ARGS[1:]), None), 0.0, None, length=2)[0]
    )(_STEP_ARGS[0]),
    "grad(checkpoint(amp(loss)))": lambda amped: jax.grad(jax.checkpoint(amped))(*_STEP_ARGS),
    "eqx.filter_value_and_grad(amp(loss))": lambda amped: eqx.filter_value_and_grad(amped)(*_STEP_ARGS)[1],
}
_STEP_ARGS = (_params(), *_batch())


# Eagerly, a jit, scan or checkpoint inside the step would close over the
# concrete state: the frozen-scale error (test above), not this case.
_FORMS = [(form, True) for form in _GRADIENTS_OF_THE_AMPD_FUNCTION] + [
    ("value_and_grad(amp(loss))", False),
    ("eqx.filter_value_and_grad(amp(loss))", False),
]


@pytest.mark.parametrize(("form", "jit"), _FORMS, ids=[f"{f}-{'jit' if j else 'eager'}" for f, j in _FORMS])
@pytest.mark.newest_only
def test_a_gradient_taken_of_the_amped_function_in_any_form_reaches_the_update_silently(form, jit, recwarn):
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1))

    def step(opt_state):
        amped = jaxamp.amp(_tiny_loss, compute_dtype="f16", loss_scale=opt_state)
        grads = _GRADIENTS_OF_THE_AMPD_FUNCTION[form](amped)
        return grads, optimizer.update(grads, opt_state, _STEP_ARGS[0])

    grads, _ = (jax.jit(step) if jit else step)(optimizer.init(_STEP_ARGS[0]))
    assert not [w for w in recwarn if "no gradient was taken" in str(w.message)]
    assert all(bool(jnp.any(g != 0)) for g in jax.tree_util.tree_leaves(grads))  # scaled: no flush to zero


@pytest.mark.parametrize(
    "inner_grad",
    [jax.grad, eqx.filter_grad, lambda f: lambda *a: jax.value_and_grad(f)(*a)[1]],
    ids=["jax.grad", "eqx.filter_grad", "value_and_grad"],
)
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.newest_only
def test_amp_around_a_function_that_takes_its_own_gradient_is_said_at_the_update(inner_grad, jit):
    # amp(grad(loss)): no gradient is taken of what amp made, so its scale
    # reaches no backward pass, and the inner one runs unscaled in float16.
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1))

    def step(opt_state):
        grads = jaxamp.amp(inner_grad(_tiny_loss), compute_dtype="f16", loss_scale=opt_state)(*_STEP_ARGS)
        return grads, optimizer.update(grads, opt_state, _STEP_ARGS[0])

    with pytest.warns(UserWarning, match=r"no gradient was taken of the function amp made.*Put amp inside"):
        grads, _ = (jax.jit(step) if jit else step)(optimizer.init(_STEP_ARGS[0]))
    assert any(bool(jnp.all(g == 0)) for g in jax.tree_util.tree_leaves(grads))  # what the message warns of


def test_two_scales_in_the_state_are_an_error():
    two = optax.chain(jaxamp.loss_scaling(optax.sgd(0.1)), jaxamp.loss_scaling(optax.sgd(0.1))).init(_params())
    with pytest.raises(ValueError, match="holds 2 loss scales"):
        jaxamp.amp(_loss, compute_dtype="f16", loss_scale=two)


# --- a whole step: overflow, skip, shrink, recover ------------------------------------


def _train_step(optimizer):
    @jax.jit
    def step(params, opt_state, x, y):
        loss = jaxamp.amp(_loss, compute_dtype="f16", loss_scale=opt_state)
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


@pytest.mark.newest_only
def test_a_step_that_overflows_is_skipped_and_the_next_one_trains():
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1), scaler=2.0**24, max_scaler=2.0**24)
    params, (x, y) = _params(), _batch(big=30.0)
    opt_state = optimizer.init(params)
    step = _train_step(optimizer)
    scales, finite = [], []
    for _ in range(12):
        new_params, opt_state, _ = step(params, opt_state, x, y)
        if not bool(opt_state.last_finite):
            assert _bits(new_params) == _bits(params)
        params = new_params
        scales.append(float(opt_state.scale))
        finite.append(bool(opt_state.last_finite))
    assert not finite[0] and finite[-1]
    assert scales[0] == 2.0**23 and scales[-1] < 2.0**23
    assert _finite(params)


@pytest.mark.newest_only
def test_inside_a_lax_scan_training_loop():
    optimizer = jaxamp.loss_scaling(optax.adam(1e-2), scaler=2.0**20)
    params, (x, y) = _params(), _batch(big=30.0)

    def body(carry, _):
        params, opt_state = carry
        loss = jaxamp.amp(_loss, compute_dtype="f16", loss_scale=opt_state)
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), (value, opt_state.last_finite)

    (params, opt_state), (values, finite) = jax.jit(lambda c: jax.lax.scan(body, c, None, length=20))(
        (params, optimizer.init(params))
    )
    assert not bool(finite[0]) and bool(finite[-1])
    assert int(opt_state.scaler_state.total_resets) >= 1
    assert float(values[-1]) < float(values[0]) and _finite(params)


@pytest.mark.newest_only
def test_under_vmap_per_example_gradients_are_unscaled():
    params, (x, y) = _params(), _batch()
    per_example = jax.vmap(jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=2.0**6)), in_axes=(None, 0, 0))(
        params, x[:, None], y[:, None]
    )
    plain = jax.vmap(jax.grad(jaxamp.amp(_loss, compute_dtype="f16")), in_axes=(None, 0, 0))(
        params, x[:, None], y[:, None]
    )
    assert per_example["w1"].shape == (16, D, H)
    np.testing.assert_allclose(np.asarray(per_example["w1"]), np.asarray(plain["w1"]), rtol=2e-2, atol=1e-4)


@pytest.mark.newest_only
def test_with_an_equinox_module_and_filter_value_and_grad():
    model = eqx.nn.MLP(D, 2, width_size=H, depth=1, key=jax.random.PRNGKey(0))
    x, y = _batch()
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1), scaler=2.0**8)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

    def loss_fn(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    _, grads = eqx.filter_value_and_grad(jaxamp.amp(loss_fn, compute_dtype="f16", loss_scale=opt_state))(model, x, y)
    _, (_, expected) = jaxamp.dynamic_scale_value_and_grad(jaxamp.amp(loss_fn, compute_dtype="f16"))(
        model, x, y, dynamic_scaler_state=jaxamp.DynamicScalerState(scaler=2.0**8)
    )
    assert _bits(grads) == _bits(expected)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    model = eqx.apply_updates(model, updates)
    assert bool(opt_state.last_finite)


@pytest.mark.newest_only
def test_with_an_nnx_module_and_nnx_value_and_grad():
    from flax import nnx

    model = nnx.Linear(D, 2, rngs=nnx.Rngs(0))
    x, y = _batch()

    def loss_fn(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    grads = nnx.grad(jaxamp.amp(loss_fn, compute_dtype="f16", loss_scale=2.0**12))(model, x, y)
    plain = nnx.grad(jaxamp.amp(loss_fn, compute_dtype="f16"))(model, x, y)
    got, want = nnx.to_pure_dict(grads), nnx.to_pure_dict(plain)
    assert got["kernel"].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got["kernel"]), np.asarray(want["kernel"]), rtol=2e-2, atol=1e-4)


@pytest.mark.newest_only
def test_in_fp8_mode_gradients_match_the_explicit_path():
    params, (x, y) = _params(), _batch()
    got = jax.jit(jax.grad(jaxamp.amp(_loss, compute_dtype=FP8, loss_scale=2.0**4)))(params, x, y)
    explicit = jaxamp.dynamic_scale_grad(jaxamp.amp(_loss, compute_dtype=FP8))
    _, expected = jax.jit(explicit)(params, x, y, dynamic_scaler_state=jaxamp.DynamicScalerState(scaler=2.0**4))
    assert _finite(got)
    assert _bits(got) == _bits(expected)


# --- across devices -------------------------------------------------------------------

N = 4


@pytest.mark.newest_only
def test_under_pmap_an_overflow_on_one_replica_leaves_every_replica_with_the_same_scale():
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1), scaler=2.0**15, axis_name="batch")
    params = _params()
    x, y = _batch(n=4 * N)
    x = x.at[4 * 2].multiply(300.0)  # replica 2's batch overflows the scaled float16 backward

    def replicate(tree):
        return jax.tree_util.tree_map(lambda v: jnp.stack([v] * N), tree)

    @functools.partial(jax.pmap, axis_name="batch")
    def step(params, opt_state, x, y):
        grads = jax.grad(jaxamp.amp(_linear_loss, compute_dtype="f16", loss_scale=opt_state))(params, x, y)
        grads = jax.lax.pmean(grads, "batch")
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params_r, state_r = replicate(params), replicate(optimizer.init(params))
    # Without replica 2's batch the step is finite.
    assert bool(step(params_r, state_r, _batch(n=4 * N)[0].reshape(N, 4, D), y.reshape(N, 4, 2))[1].last_finite.all())
    new_params, new_state = step(params_r, state_r, x.reshape(N, 4, D), y.reshape(N, 4, 2))
    np.testing.assert_array_equal(np.asarray(new_state.scale), [2.0**14] * N)
    np.testing.assert_array_equal(np.asarray(new_state.last_finite), [False] * N)
    assert _bits(new_params) == _bits(params_r)
    # A NaN in one replica's batch, without a pmean in between: still one decision.

    @functools.partial(jax.pmap, axis_name="batch")
    def local_step(params, opt_state, x, y):
        grads = jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=opt_state))(params, x, y)
        return optimizer.update(grads, opt_state, params)[1]

    x, y = _batch(n=4 * N)
    x = x.at[4 * 1, 0].set(jnp.nan)
    new_state = local_step(params_r, state_r, x.reshape(N, 4, D), y.reshape(N, 4, 2))
    np.testing.assert_array_equal(np.asarray(new_state.scale), [2.0**14] * N)


@pytest.mark.newest_only
def test_in_shard_map_with_check_vma_no_axis_name_is_needed():
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1), scaler=2.0**15)
    mesh = jax.make_mesh((N,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    params = _params()
    x, y = _batch(n=4 * N)
    x = x.at[4 * 3, 0].set(jnp.inf)

    def body(params, opt_state, x, y):
        grads = jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=opt_state))(params, x, y)
        _, opt_state = optimizer.update(grads, opt_state, params)
        return opt_state.scale[None], opt_state.last_finite[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("dp"), P("dp")), out_specs=(P("dp"), P("dp"))))
    scales, finite = fn(params, optimizer.init(params), x, y)
    np.testing.assert_array_equal(np.asarray(scales), [2.0**14] * N)
    np.testing.assert_array_equal(np.asarray(finite), [False] * N)


def test_with_fp8_delayed_the_observed_amaxes_are_those_of_the_explicit_path():
    params, (x, y) = _params(), _batch()
    recipe = jaxamp.fp8.Fp8Recipe(
        scaling="delayed", amax_history_length=4, min_contraction=1, keep_last_matmul_bf16=False
    )
    plain = jaxamp.amp(_loss, compute_dtype=recipe)
    state = jaxamp.fp8.init_fp8_state(plain, params, x, y)
    scaled = jaxamp.amp(_loss, compute_dtype=recipe, loss_scale=2.0**6)
    got = jax.jit(jax.grad(lambda p, s: scaled(p, x, y, fp8_state=s), argnums=(0, 1)))(params, state)
    explicit = jaxamp.dynamic_scale_grad(lambda p, s: plain(p, x, y, fp8_state=s), filter=False, argnums=(0, 1))
    _, expected = jax.jit(explicit)(params, state, dynamic_scaler_state=jaxamp.DynamicScalerState(scaler=2.0**6))
    assert _finite(got)
    assert _bits(got) == _bits(expected)


@pytest.mark.newest_only
def test_under_jit_on_an_explicit_mesh_a_nan_in_one_shard_skips_the_step():
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1), scaler=2.0**15)
    mesh = jax.make_mesh((N,), ("dp",), axis_types=(jax.sharding.AxisType.Explicit,))
    x, y = _batch(n=4 * N)
    x = x.at[4 * 3, 0].set(jnp.nan)
    with jax.set_mesh(mesh):
        params = jax.device_put(_params(), jax.sharding.NamedSharding(mesh, P()))
        x, y = (jax.device_put(a, jax.sharding.NamedSharding(mesh, P("dp"))) for a in (x, y))

        @jax.jit
        def step(params, opt_state, x, y):
            grads = jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=opt_state))(params, x, y)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        new_params, state = step(params, optimizer.init(params), x, y)
    assert float(state.scale) == 2.0**14 and not bool(state.last_finite)
    assert _bits(new_params) == _bits(params)


@pytest.mark.newest_only
def test_in_shard_map_without_check_vma_the_wrapper_decides_over_its_axis_name():
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1), scaler=2.0**15, axis_name="dp")
    mesh = jax.make_mesh((N,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    params = _params()
    x, y = _batch(n=4 * N)
    x = x.at[4 * 1, 0].set(jnp.inf)

    def body(params, opt_state, x, y):
        grads = jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=opt_state))(params, x, y)
        _, opt_state = optimizer.update(grads, opt_state, params)
        return opt_state.scale[None], opt_state.last_finite[None]

    fn = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P(), P(), P("dp"), P("dp")), out_specs=(P("dp"), P("dp")), check_vma=False
        )
    )
    scales, finite = fn(params, optimizer.init(params), x, y)
    np.testing.assert_array_equal(np.asarray(scales), [2.0**14] * N)
    np.testing.assert_array_equal(np.asarray(finite), [False] * N)


def test_under_nnx_optimizer_the_update_says_so_too(recwarn):
    # nnx.Optimizer holds the scale in a Variable, and hands its update the value.
    from flax import nnx

    model = nnx.Linear(D, 2, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, jaxamp.loss_scaling(optax.sgd(0.1)), wrt=nnx.Param)
    x = _batch()[0]

    def loss(model, x):
        return jnp.mean(model(x) ** 2) * 1e-7

    @nnx.jit
    def inside(model, optimizer, x):
        optimizer.update(
            model, nnx.grad(jaxamp.amp(loss, compute_dtype="f16", loss_scale=optimizer.opt_state))(model, x)
        )

    @nnx.jit
    def around(model, optimizer, x):
        optimizer.update(
            model, jaxamp.amp(nnx.grad(loss), compute_dtype="f16", loss_scale=optimizer.opt_state)(model, x)
        )

    inside(model, optimizer, x)
    assert not [w for w in recwarn if "no gradient was taken" in str(w.message)]
    with pytest.warns(UserWarning, match="no gradient was taken of the function amp made"):
        around(model, optimizer, x)
