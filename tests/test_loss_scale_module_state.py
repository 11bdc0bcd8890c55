"""A step skipped by loss scaling commits no module state, on the ``amp(loss_scale=...)`` path.

flax nnx modules passed to the amp'd loss: amp keeps the state the loss
changed (BatchNorm statistics, RNG counts) as it was when the forward pass is
not finite, and so is state the loss takes and returns: an ``eqx.nn.State``,
a dict of arrays with the signature of one it took (haiku's state, Linen
statistics), a flax ``TrainState``'s ``batch_stats``. What amp cannot tell is
state is kept by one line after the update:
``select_tree(opt_state.last_finite, new, old)``.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxamp

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals

D = 6


def _batch(bad=False, shift=0.0):
    x = jax.random.normal(jax.random.PRNGKey(1), (16, D)) + shift
    if bad:
        x = x.at[3, 2].set(jnp.nan)
    return x, jax.random.normal(jax.random.PRNGKey(2), (16, 1))


class _Net(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(D, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.head = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.head(self.drop(jax.nn.relu(self.norm(self.linear(x)))))


def _nnx_loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def _stats(model):
    return [np.asarray(model.norm.mean[...]), np.asarray(model.norm.var[...])]


def _rng_count(model):
    return int(model.drop.rngs.count[...])


@pytest.mark.newest_only
def test_nnx_a_nan_batch_keeps_batchnorm_statistics_and_rng_counts_and_the_next_clean_step_moves_them():
    model = _Net(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, jaxamp.loss_scaling(optax.adam(1e-2)), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        loss = jaxamp.amp(_nnx_loss, compute_dtype="f16", loss_scale=optimizer.opt_state)
        value, grads = nnx.value_and_grad(loss)(model, x, y)
        optimizer.update(model, grads)
        return value

    step(model, optimizer, *_batch())
    stats, count = _stats(model), _rng_count(model)
    params = [np.asarray(p) for p in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))]
    value = step(model, optimizer, *_batch(bad=True))
    assert not np.isfinite(float(value))
    assert not bool(optimizer.opt_state.last_finite[...])
    for before, after in zip(stats, _stats(model)):
        np.testing.assert_array_equal(after, before)
        assert np.isfinite(after).all()
    assert _rng_count(model) == count
    for before, after in zip(params, jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(after), before)
    step(model, optimizer, *_batch(shift=1.0))
    assert bool(optimizer.opt_state.last_finite[...])
    assert not np.array_equal(_stats(model)[0], stats[0]) and np.isfinite(_stats(model)[0]).all()
    assert _rng_count(model) == count + 1


@pytest.mark.newest_only
def test_nnx_without_loss_scale_amp_commits_the_nan_statistics_as_nnx_does():
    # What the keeping above protects against: the plain path writes them.
    model = _Net(nnx.Rngs(0, dropout=1))
    nnx.value_and_grad(jaxamp.amp(_nnx_loss, compute_dtype="f16"))(model, *_batch(bad=True))
    assert not np.isfinite(_stats(model)[0]).all()


@pytest.mark.newest_only
def test_equinox_state_is_kept_by_select_tree_on_last_finite():
    model, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(D, axis_name="batch", mode="ema")
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1))
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

    def loss_fn(model, state, x, y):
        out, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
        return jnp.mean((out[:, :1] - y) ** 2), state

    @eqx.filter_jit
    def step(model, state, opt_state, x, y):
        loss = jaxamp.amp(loss_fn, compute_dtype="f16", loss_scale=opt_state)
        (_, new_state), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model, state, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        state = jaxamp.select_tree(opt_state.last_finite, new_state, state)  # the one line
        return model, state, opt_state

    model, state, opt_state = step(model, state, opt_state, *_batch())
    before = [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]
    model, state, opt_state = step(model, state, opt_state, *_batch(bad=True))
    assert not bool(opt_state.last_finite)
    for b, a in zip(before, jax.tree_util.tree_leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), b)
        assert np.isfinite(np.asarray(a)).all()
    model, state, opt_state = step(model, state, opt_state, *_batch(shift=1.0))
    assert any(not np.array_equal(np.asarray(a), b) for b, a in zip(before, jax.tree_util.tree_leaves(state)))


@pytest.mark.newest_only
def test_equinox_state_taken_and_returned_is_kept_automatically_on_a_nan_batch():
    model, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(D, axis_name="batch", mode="ema")
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1))
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

    def loss_fn(model, state, x, y):
        out, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
        return jnp.mean((out[:, :1] - y) ** 2), state

    @eqx.filter_jit
    def step(model, state, opt_state, x, y):  # the bf16 step with two lines changed
        loss = jaxamp.amp(loss_fn, compute_dtype="f16", loss_scale=opt_state)
        (_, state), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model, state, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, opt_state

    model, state, opt_state = step(model, state, opt_state, *_batch())
    before = [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]
    model, state, opt_state = step(model, state, opt_state, *_batch(bad=True))
    assert not bool(opt_state.last_finite)
    for b, a in zip(before, jax.tree_util.tree_leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), b)
    model, state, opt_state = step(model, state, opt_state, *_batch(shift=1.0))
    assert bool(opt_state.last_finite)
    after = [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]
    assert any(not np.array_equal(a, b) for b, a in zip(before, after)) and all(np.isfinite(a).all() for a in after)


class _RunningMean(eqx.Module):
    """The batch's mean, kept in an `eqx.nn.State` as BatchNorm keeps its statistics."""

    index: eqx.nn.StateIndex

    def __init__(self):
        self.index = eqx.nn.StateIndex(jnp.zeros(D))

    def __call__(self, x, state):
        return x, state.set(self.index, 0.9 * state.get(self.index) + 0.1 * jnp.mean(x, axis=0))


def test_under_pmap_a_nan_on_one_device_keeps_the_equinox_state_on_every_device():
    # The keep decision is one for all devices, as loss_scaling's skip is: a
    # device whose batch was finite does not commit the state of a step that
    # every device skips.
    n = 4
    if jax.device_count() < n:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=4")
    running_mean, state = eqx.nn.make_with_state(_RunningMean)()
    params = {"w": jnp.ones((D, 1)) / D}
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1), scaler=8.0, axis_name="devices")

    def loss_fn(params, state, x, y):
        x, state = running_mean(x, state)
        return jnp.mean((x @ params["w"] - y) ** 2), state

    @functools.partial(jax.pmap, axis_name="devices")
    def step(params, state, opt_state, x, y):
        loss = jaxamp.amp(loss_fn, compute_dtype="f16", loss_scale=opt_state)
        grads, state = jax.grad(loss, has_aux=True)(params, state, x, y)
        return state, optimizer.update(grads, opt_state, params)[1]

    def replicate(tree):
        return jax.tree_util.tree_map(lambda v: jnp.stack([v] * n), tree)

    def batches(bad_device):
        xs, ys = zip(*[_batch(bad=device == bad_device, shift=float(device)) for device in range(n)])
        return jnp.stack(xs), jnp.stack(ys)

    args = replicate(params), replicate(state), replicate(optimizer.init(params))
    new_state, opt_state = step(*args, *batches(bad_device=1))
    assert not np.asarray(opt_state.last_finite).any()
    for old, new in zip(jax.tree_util.tree_leaves(args[1]), jax.tree_util.tree_leaves(new_state)):
        np.testing.assert_array_equal(np.asarray(new), np.asarray(old))
    # Without the NaN every device commits its own batch's mean.
    new_state, opt_state = step(*args, *batches(bad_device=None))
    assert np.asarray(opt_state.last_finite).all()
    (means,) = jax.tree_util.tree_leaves(new_state)
    assert np.isfinite(means).all() and len({np.asarray(m).tobytes() for m in means}) == n


def test_linen_batch_stats_of_a_train_state_given_as_loss_scale_are_kept_automatically():
    # flax's own pattern (examples/imagenet): the TrainState holds batch_stats,
    # the loss closes over it and returns the new ones in its aux. Given the
    # TrainState, amp finds the scale in it and keeps the statistics.
    from flax import linen as nn
    from flax.training import train_state

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(nn.BatchNorm(use_running_average=False)(nn.Dense(8)(x)))

    class TrainState(train_state.TrainState):
        batch_stats: dict

    net = Net()
    variables = net.init(jax.random.PRNGKey(0), jnp.ones((4, D)))
    state = TrainState.create(
        apply_fn=net.apply,
        params=variables["params"],
        tx=jaxamp.loss_scaling(optax.adam(1e-2)),
        batch_stats=variables["batch_stats"],
    )

    @jax.jit
    def step(state, x, y):  # the bf16 step with its two lines changed
        def loss_fn(params):
            out, updates = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats}, x, mutable=["batch_stats"]
            )
            return jnp.mean((out - y) ** 2), (updates, out)

        loss = jaxamp.amp(loss_fn, compute_dtype="f16", loss_scale=state)
        (_, (updates, out)), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"]), out

    state, _ = step(state, *_batch())
    before = [np.asarray(x) for x in jax.tree_util.tree_leaves(state.batch_stats)]
    state, out = step(state, *_batch(bad=True))
    assert not bool(state.opt_state.last_finite)
    assert not np.isfinite(np.asarray(out)).all()  # other outputs are as the loss computed them
    for b, a in zip(before, jax.tree_util.tree_leaves(state.batch_stats)):
        np.testing.assert_array_equal(np.asarray(a), b)
    state, _ = step(state, *_batch(shift=1.0))
    assert bool(state.opt_state.last_finite)
    after = [np.asarray(x) for x in jax.tree_util.tree_leaves(state.batch_stats)]
    assert any(not np.array_equal(a, b) for b, a in zip(before, after)) and all(np.isfinite(a).all() for a in after)


def test_nnx_statistics_of_a_clean_step_are_those_amp_computes_without_loss_scale():
    # The keep-or-commit select runs inside amp's program: the committed
    # statistics must not be rounded through float16 on the way.
    x = jax.random.normal(jax.random.PRNGKey(1), (16, D)) * 3
    scaled, plain = _Net(nnx.Rngs(0, dropout=1)), _Net(nnx.Rngs(0, dropout=1))
    nnx.grad(jaxamp.amp(lambda m, x: jnp.mean(m(x) ** 2), compute_dtype="f16", loss_scale=4.0))(scaled, x)
    nnx.grad(jaxamp.amp(lambda m, x: jnp.mean(m(x) ** 2), compute_dtype="f16"))(plain, x)
    for a, b in zip(_stats(scaled), _stats(plain)):
        assert a.dtype == np.float32
        np.testing.assert_array_equal(a, b)


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def _check_kept_then_moved(step, carry, stats_of):
    """A clean step, a NaN batch (skipped, statistics as they were), a clean step (they move)."""
    carry = step(*carry, *_batch())
    before = _leaves(stats_of(carry))
    carry = step(*carry, *_batch(bad=True))
    assert not bool(carry[-1].last_finite)
    for b, a in zip(before, _leaves(stats_of(carry)), strict=True):
        np.testing.assert_array_equal(a, b)
    carry = step(*carry, *_batch(shift=1.0))
    assert bool(carry[-1].last_finite)
    after = _leaves(stats_of(carry))
    assert any(not np.array_equal(a, b) for b, a in zip(before, after)) and all(np.isfinite(a).all() for a in after)


def _linen_net():
    from flax import linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(nn.BatchNorm(use_running_average=False)(nn.Dense(8)(x)))

    return Net()


@pytest.mark.parametrize("select_line", [False, True], ids=["automatic", "with_the_select_tree_line"])
@pytest.mark.newest_only
def test_linen_batch_stats_taken_as_an_argument_and_returned_are_kept(select_line):
    # The documented select_tree line (for a backward-only overflow) agrees with what amp keeps.
    net = _linen_net()
    variables = net.init(jax.random.PRNGKey(0), jnp.ones((4, D)))
    optimizer = jaxamp.loss_scaling(optax.adam(1e-2))

    def loss_fn(params, batch_stats, x, y):
        out, updates = net.apply({"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"])
        return jnp.mean((out - y) ** 2), updates["batch_stats"]

    @jax.jit
    def step(params, batch_stats, opt_state, x, y):  # the bf16 step with two lines changed
        loss = jaxamp.amp(loss_fn, compute_dtype="f16", loss_scale=opt_state)
        (_, new_stats), grads = jax.value_and_grad(loss, has_aux=True)(params, batch_stats, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        if select_line:
            new_stats = jaxamp.select_tree(opt_state.last_finite, new_stats, batch_stats)
        return optax.apply_updates(params, updates), new_stats, opt_state

    params = variables["params"]
    _check_kept_then_moved(step, (params, variables["batch_stats"], optimizer.init(params)), lambda c: c[1])


def test_linen_statistics_returned_from_the_variables_dict_are_kept_one_level_inside():
    net = _linen_net()
    variables = net.init(jax.random.PRNGKey(0), jnp.ones((4, D)))
    optimizer = jaxamp.loss_scaling(optax.adam(1e-2))

    def loss_fn(params, variables, x, y):
        out, updates = net.apply({**variables, "params": params}, x, mutable=["batch_stats"])
        return jnp.mean((out - y) ** 2), (updates, out)

    @jax.jit
    def step(variables, opt_state, x, y):
        loss = jaxamp.amp(loss_fn, compute_dtype="f16", loss_scale=opt_state)
        (_, (updates, _)), grads = jax.value_and_grad(loss, has_aux=True)(variables["params"], variables, x, y)
        updates_p, opt_state = optimizer.update(grads, opt_state, variables["params"])
        return {"params": optax.apply_updates(variables["params"], updates_p), **updates}, opt_state

    _check_kept_then_moved(step, (variables, optimizer.init(variables["params"])), lambda c: c[0]["batch_stats"])


def test_haiku_state_taken_and_returned_is_kept_automatically_and_other_outputs_come_back_as_computed():
    hk = pytest.importorskip("haiku")

    def forward(x):
        return hk.Linear(1)(hk.BatchNorm(True, True, decay_rate=0.9)(hk.Linear(8)(x), is_training=True))

    model = hk.without_apply_rng(hk.transform_with_state(forward))
    params, state = model.init(jax.random.PRNGKey(0), jnp.ones((4, D)))
    # haiku's moving averages count their updates in int32 beside the float statistics.
    assert {np.dtype(x.dtype) for x in jax.tree_util.tree_leaves(state)} >= {np.dtype("int32"), np.dtype("float32")}
    optimizer = jaxamp.loss_scaling(optax.adam(1e-2))
    outs = []

    def loss_fn(params, state, x, y):
        out, state = model.apply(params, state, x)
        return jnp.mean((out - y) ** 2), (state, {"out": out})

    @jax.jit
    def step(params, state, opt_state, x, y):  # the bf16 step with two lines changed
        loss = jaxamp.amp(loss_fn, compute_dtype="f16", loss_scale=opt_state)
        (_, (state, aux)), grads = jax.value_and_grad(loss, has_aux=True)(params, state, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), state, opt_state, aux["out"]

    def tracked(*args):
        *carry, out = step(*args)
        outs.append(np.asarray(out))
        return tuple(carry)

    _check_kept_then_moved(tracked, (params, state, optimizer.init(params)), lambda c: c[1])
    assert np.isfinite(outs[0]).all() and not np.isfinite(outs[1]).all()  # the NaN batch's output, as computed


def test_a_returned_dict_matching_two_different_arguments_is_not_guessed():
    # Two statistics dicts of one signature: amp cannot tell which one the
    # returned dict continues, so it hands back what the loss computed.
    stats = {"bn": {"mean": jnp.zeros(D)}}

    def loss_fn(w, a, b, x):
        new = {"bn": {"mean": 0.9 * a["bn"]["mean"] + 0.1 * jnp.mean(x, axis=0)}}
        return jnp.mean((x @ w) ** 2) + 0.0 * jnp.sum(b["bn"]["mean"]), new

    x = _batch(bad=True)[0]
    loss = jaxamp.amp(loss_fn, compute_dtype="f16", loss_scale=8.0)
    _, new = jax.grad(loss, has_aux=True)(jnp.ones((D, 1)), stats, {"bn": {"mean": jnp.ones(D)}}, x)
    assert not np.isfinite(np.asarray(new["bn"]["mean"])).all()
    _, kept = jax.grad(loss, has_aux=True)(jnp.ones((D, 1)), stats, stats, x)  # the same dict twice: no doubt
    np.testing.assert_array_equal(np.asarray(kept["bn"]["mean"]), np.zeros(D))


@pytest.mark.newest_only
@settings(max_examples=12, deadline=None)
@given(row=st.integers(0, 15), col=st.integers(0, D - 1), value=st.sampled_from([np.nan, np.inf, -np.inf, 2.5]))
def test_returned_dict_state_is_kept_exactly_when_the_forward_pass_is_not_finite(row, col, value):
    def loss_fn(w, stats, x):
        new = {"bn": {"mean": 0.9 * stats["bn"]["mean"] + 0.1 * jnp.mean(x, axis=0)}}
        return jnp.mean(jnp.tanh(x @ w)), new

    stats = {"bn": {"mean": jnp.arange(D, dtype=jnp.float32)}}
    x = _batch()[0].at[row, col].set(value)
    _, new = jax.value_and_grad(jaxamp.amp(loss_fn, compute_dtype="f16", loss_scale=1024.0), has_aux=True)(
        jnp.ones((D, 2)) / D, stats, x
    )[0]
    # An inf reaches the statistics (not the loss: tanh saturates); either makes the forward pass not finite.
    finite = bool(np.isfinite(np.asarray(x)).all())
    expected = (0.9 * np.arange(D) + 0.1 * np.mean(np.asarray(x), axis=0)) if finite else np.arange(D)
    np.testing.assert_allclose(np.asarray(new["bn"]["mean"]), expected, rtol=1e-6)


def test_an_inf_the_loss_returns_by_design_beside_it_does_not_hold_the_state_back():
    # Masked logits returned through has_aux hold -inf on every step; the loss
    # is finite and the step is not skipped, so the statistics move.
    model = _Net(nnx.Rngs(0, dropout=1))
    stats = {"bn": {"mean": jnp.zeros(D)}}

    def loss_fn(model, stats, x, y):
        out = model(x)
        masked = jnp.where(jnp.arange(16)[:, None] < 2, -jnp.inf, out)
        new = {"bn": {"mean": 0.9 * stats["bn"]["mean"] + 0.1 * jnp.mean(x, axis=0)}}
        return jnp.mean((out - y) ** 2), (masked, new)

    before = _stats(model)
    loss = jaxamp.amp(loss_fn, compute_dtype="f16", loss_scale=64.0)
    (value, (masked, new)), _ = nnx.value_and_grad(loss, has_aux=True)(model, stats, *_batch())
    assert np.isfinite(float(value)) and np.isneginf(np.asarray(masked)).any()
    assert not np.array_equal(np.asarray(new["bn"]["mean"]), np.zeros(D))
    assert all(not np.array_equal(a, b) for a, b in zip(_stats(model), before))


class _NormedLinear(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm

    def __init__(self, n_in, n_out, key):
        self.linear = eqx.nn.Linear(n_in, n_out, key=key)
        self.norm = eqx.nn.BatchNorm(n_out, axis_name="batch", mode="ema")

    def __call__(self, x, state):
        return self.norm(self.linear(x), state)


def _vmapped(model, x, state):
    return jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)


@pytest.mark.parametrize("same_shapes", [False, True], ids=["gan_like", "two_alike"])
@pytest.mark.newest_only
def test_two_equinox_states_are_each_kept_where_amp_can_tell_them_apart(same_shapes):
    # A GAN's step runs the generator and the discriminator, each with its own
    # eqx.nn.State: each returned state is matched to the given one by its
    # structure, shapes and dtypes. Two states alike in all three cannot be
    # told apart: both come back as computed (the select_tree line keeps them).
    width = D if same_shapes else 4
    first, first_state = eqx.nn.make_with_state(_NormedLinear)(D, width, jax.random.PRNGKey(0))
    second, second_state = eqx.nn.make_with_state(_NormedLinear)(width, D, jax.random.PRNGKey(1))
    if same_shapes:
        second, second_state = eqx.nn.make_with_state(_NormedLinear)(D, D, jax.random.PRNGKey(1))

    def loss_fn(first, second, first_state, second_state, x):
        h, first_state = _vmapped(first, x, first_state)
        out, second_state = _vmapped(second, h, second_state)
        return jnp.mean(out**2), (first_state, second_state)

    loss = jaxamp.amp(loss_fn, compute_dtype="f16", loss_scale=16.0)
    x = _batch(bad=True)[0]
    (_, (new_first, new_second)), _ = eqx.filter_value_and_grad(loss, has_aux=True)(
        first, second, first_state, second_state, x
    )
    for new, old in ((new_first, first_state), (new_second, second_state)):
        kept = all(np.array_equal(a, b) for a, b in zip(_leaves(new), _leaves(old), strict=True))
        assert kept is not same_shapes
