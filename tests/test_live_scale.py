"""``amp(loss, loss_scale=tx)``: the transformation's live scale, for loops a framework owns.

The optimizer state never reaches the loss (Tunix's and MaxText's steps keep
it inside): amp reads the scale from the `jaxamp.loss_scaling` transformation
itself, and its update writes the next one. A backward pass that overflowed
hands back zeros and tells the update, which skips the step, also from inside
``optax.MultiSteps`` (Tunix's order), where a NaN would stay in the
accumulator. References: the ``loss_scale=opt_state`` path (bit for bit) and
float32's gradients (float16 tolerance).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp

# Runs on the oldest supported JAX too (.ci/run): jax.Ref and custom_vjp effects.
pytestmark = pytest.mark.jax_internals

D = 8
# float16 matmuls against float32's: relative error of the gradient's norm.
F16_RTOL = 2e-2
# Multiplies the targets of a batch meant to overflow float16's backward pass.
OVERFLOW = 1e6


def _params():
    return jax.random.normal(jax.random.PRNGKey(0), (D, D)) * 0.3


def _batch(overflow=False):
    x = jax.random.normal(jax.random.PRNGKey(1), (16, D))
    return x, jnp.ones((16, D)) * (OVERFLOW if overflow else 1.0)


def _loss(w, x, y):
    return jnp.mean((jnp.tanh(x @ w) - y) ** 2)


def _stepper(tx, loss_scale):
    loss = jaxamp.amp(_loss, compute_dtype="f16", loss_scale=loss_scale)

    @jax.jit
    def step(w, opt_state, x, y):
        grads = jax.grad(loss)(w, x, y)
        updates, opt_state = tx.update(grads, opt_state, w)
        return optax.apply_updates(w, updates), opt_state, grads

    return step


def _scale(opt_state):
    return float(jaxamp.scaling.scale_metrics(opt_state)["loss_scale"])


def _skipped(opt_state):
    return int(jaxamp.scaling.scale_metrics(opt_state)["skipped_steps"])


@pytest.mark.newest_only
def test_gradients_match_the_state_path_bit_for_bit_and_float32_within_tolerance():
    w, (x, y) = _params(), _batch()
    by_state = jaxamp.loss_scaling(optax.sgd(0.1))
    by_tx = jaxamp.loss_scaling(optax.sgd(0.1))
    state = by_state.init(w)
    g_state = jax.jit(lambda w, s: jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=s))(w, x, y))(w, state)
    _, _, g_live = _stepper(by_tx, by_tx)(w, by_tx.init(w), x, y)
    np.testing.assert_array_equal(g_live, g_state)
    g32 = jax.grad(_loss)(w, x, y)
    assert np.linalg.norm(g_live - g32) <= F16_RTOL * np.linalg.norm(g32)


def test_the_live_scale_follows_the_state_it_moves():
    tx = jaxamp.loss_scaling(optax.sgd(0.1), scaler=2.0**10, patience=2)
    w = _params()
    opt_state = tx.init(w)
    step = _stepper(tx, tx)
    read, moved = [], []
    for _ in range(6):
        read.append(float(tx.update._jaxamp_live_scale.cells()["scale"][...]))
        w, opt_state, _ = step(w, opt_state, *_batch())
        moved.append(_scale(opt_state))
    # Each step reads the scale the state held after the step before it.
    assert read == [2.0**10, *moved[:-1]]
    assert moved[-1] == 2.0**12


@pytest.mark.newest_only
@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "inside_apply_if_finite"])
def test_an_overflow_skips_the_step_with_the_state_kept(wrapped):
    tx = jaxamp.loss_scaling(optax.adam(1e-2))
    w = _params()
    # apply_if_finite cannot take a NaN (it would revert the scale): its init
    # tells the transformation, whose overflows then leave zeros and a flag.
    opt_state = optax.apply_if_finite(tx, 5).init(w).inner_state if wrapped else tx.init(w)
    step = _stepper(tx, tx)
    w, opt_state, _ = step(w, opt_state, *_batch())
    new_w, new_state, grads = step(w, opt_state, *_batch(overflow=True))
    # The overflow travels in the gradient (NaN, as from the state), or as zeros and the flag.
    np.testing.assert_array_equal(grads, np.zeros_like(grads) if wrapped else np.full_like(grads, np.nan))
    np.testing.assert_array_equal(new_w, w)
    for before, after in zip(jax.tree.leaves(opt_state.inner_state), jax.tree.leaves(new_state.inner_state)):
        np.testing.assert_array_equal(after, before)
    assert _scale(new_state) == _scale(opt_state) / 2
    assert _skipped(new_state) == 1 and not bool(new_state.last_finite)


@pytest.mark.parametrize("other_attached", [False, True], ids=["other_never_given", "other_given_before"])
def test_gradients_scaled_by_another_transformations_live_scale_are_said_at_the_update(other_attached):
    scaled_by, applied_by = jaxamp.loss_scaling(optax.adam(1e-2)), jaxamp.loss_scaling(optax.adam(1e-2))
    w = _params()
    if other_attached:  # applied_by's update already reads its own cells
        _stepper(applied_by, applied_by)(w, applied_by.init(w), *_batch())
    # The loss given one transformation, its gradients handed to the other's update.
    with pytest.warns(UserWarning, match="another loss_scaling transformation's live scale"):
        _, state, _ = _stepper(applied_by, scaled_by)(w, applied_by.init(w), *_batch(overflow=True))
    # The overflow travelled in the gradient: skipped all the same.
    assert not bool(state.last_finite)


def test_two_losses_each_given_its_own_transformation_are_not_warned_about():
    tx_a, tx_b = jaxamp.loss_scaling(optax.adam(1e-2)), jaxamp.loss_scaling(optax.adam(1e-2))
    loss_a = jaxamp.amp(_loss, compute_dtype="f16", loss_scale=tx_a)
    loss_b = jaxamp.amp(lambda w, x, y: _loss(w.T, x, y), compute_dtype="f16", loss_scale=tx_b)

    @jax.jit
    def step(w_a, w_b, state_a, state_b, x, y):  # a GAN's shape: both gradients, then both updates
        g_a, g_b = jax.grad(loss_a)(w_a, x, y), jax.grad(loss_b)(w_b, x, y)
        u_a, state_a = tx_a.update(g_a, state_a, w_a)
        u_b, state_b = tx_b.update(g_b, state_b, w_b)
        return optax.apply_updates(w_a, u_a), optax.apply_updates(w_b, u_b), state_a, state_b

    w = _params()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(w, w, tx_a.init(w), tx_b.init(w), *_batch())


def test_an_elementwise_clip_before_the_update_does_not_hide_the_overflow():
    tx = jaxamp.loss_scaling(optax.sgd(0.1))
    loss = jaxamp.amp(_loss, compute_dtype="f16", loss_scale=tx)

    @jax.jit
    def step(w, opt_state, x, y):
        grads = jnp.clip(jax.grad(loss)(w, x, y) + 1.0, -0.3, 0.3)  # finite whatever came back
        updates, opt_state = tx.update(grads, opt_state, w)
        return optax.apply_updates(w, updates), opt_state

    w = _params()
    new_w, opt_state = step(w, tx.init(w), *_batch(overflow=True))
    np.testing.assert_array_equal(new_w, w)
    assert _skipped(opt_state) == 1


def _micro_batch_run(placement, k, overflows, steps):
    """Parameters, scale and skipped real steps after `steps` micro-batches, the `overflows` ones overflowing."""
    base = optax.sgd(0.1)
    if placement == "inside MultiSteps (live)":
        scaling = jaxamp.loss_scaling(base, patience=10**6)
        tx, loss_scale = optax.MultiSteps(scaling, k).gradient_transformation(), scaling
    elif placement == "around MultiSteps (live)":
        tx = jaxamp.loss_scaling(optax.MultiSteps(base, k), patience=10**6)
        loss_scale = tx
    else:  # the state path, around MultiSteps
        tx, loss_scale = jaxamp.loss_scaling(optax.MultiSteps(base, k), patience=10**6), None
    w = _params()
    opt_state = tx.init(w)
    loss = None if loss_scale is None else jaxamp.amp(_loss, compute_dtype="f16", loss_scale=loss_scale)

    @jax.jit
    def step(w, opt_state, x, y):
        fn = loss or jaxamp.amp(_loss, compute_dtype="f16", loss_scale=opt_state)
        updates, opt_state = tx.update(jax.grad(fn)(w, x, y), opt_state, w)
        return optax.apply_updates(w, updates), opt_state

    for i in range(steps):
        w, opt_state = step(w, opt_state, *_batch(overflow=i in overflows))
    return w, _scale(opt_state), _skipped(opt_state)


@settings(deadline=None, max_examples=6)
@given(k=st.integers(1, 3), overflows=st.sets(st.integers(0, 5), max_size=3))
def test_inside_multisteps_a_real_step_is_skipped_iff_a_micro_batch_of_it_overflowed(k, overflows):
    steps = 6
    windows = {i // k for i in overflows if i // k < steps // k}
    want_w, want_scale, want_skipped = _micro_batch_run("state path", k, overflows, steps)
    assert want_skipped == len(windows)
    for placement in ("inside MultiSteps (live)", "around MultiSteps (live)"):
        w, scale, skipped = _micro_batch_run(placement, k, overflows, steps)
        assert (skipped, scale) == (want_skipped, want_scale), placement
        np.testing.assert_array_equal(w, want_w, err_msg=placement)


# Micro-batches of models A (0) and B (1), each with MultiSteps of 2: (model, overflows).
MICRO_BATCHES = {
    "one_after_the_other": [(0, False), (0, True), (1, False), (1, False), (1, False), (1, False)],
    "interleaved": [(0, True), (1, False), (0, False), (1, False), (1, False), (1, False)],
}


def _two_models_in_multisteps(shared, second_params, micro_batches):
    """Each model's parameters, scale and skipped real steps after `micro_batches`: A's first real step overflows.

    One `loss_scaling` transformation for both (`shared`), or one each, inside
    ``MultiSteps`` of 2 (Tunix's order: amp hands back zeros and flags).
    """
    scalings = [jaxamp.loss_scaling(optax.sgd(0.1))]
    scalings.append(scalings[0] if shared else jaxamp.loss_scaling(optax.sgd(0.1)))
    txs = [optax.MultiSteps(scaling, 2) for scaling in scalings]
    params = [_params(), second_params]
    states = [tx.init(w) for tx, w in zip(txs, params)]

    def loss(params, x, y):  # B's parameters may sit in a dict: another structure
        return _loss(params["w"] if isinstance(params, dict) else params, x, y)

    def stepper(tx, scaling):
        grad = jax.grad(jaxamp.amp(loss, compute_dtype="f16", loss_scale=scaling))

        @jax.jit
        def step(w, opt_state, x, y):
            updates, opt_state = tx.update(grad(w, x, y), opt_state, w)
            return optax.apply_updates(w, updates), opt_state

        return step

    steps = [stepper(tx, scaling) for tx, scaling in zip(txs, scalings)]
    for model, overflow in micro_batches:
        params[model], states[model] = steps[model](params[model], states[model], *_batch(overflow=overflow))
    return [(w, _scale(s.inner_opt_state), _skipped(s.inner_opt_state)) for w, s in zip(params, states)]


@pytest.mark.parametrize("order", list(MICRO_BATCHES))
@pytest.mark.parametrize("second", ["same_structure", "other_structure"])
def test_inside_multisteps_one_transformation_for_two_models_keeps_each_models_overflows_apart(second, order):
    # Model A's overflowing real step must not skip model B's clean ones, and
    # B's micro-batches between A's must not make A forget its overflow: each
    # flag is its model's. Models of one structure differ by their parameters.
    second_params = _params() * 0.5 if second == "same_structure" else {"w": _params() * 0.5}
    want = _two_models_in_multisteps(False, second_params, MICRO_BATCHES[order])
    assert [(scale, skipped) for _, scale, skipped in want] == [(2.0**14, 1), (2.0**15, 0)]
    with pytest.warns(UserWarning, match="serves more than one optimizer state"):
        got = _two_models_in_multisteps(True, second_params, MICRO_BATCHES[order])
        jax.effects_barrier()
    for (w, scale, skipped), (want_w, want_scale, want_skipped) in zip(got, want):
        assert (scale, skipped) == (want_scale, want_skipped)
        # B's backward pass ran at A's scale (2^14, not its 2^15): float16 may round otherwise.
        for a, b in zip(jax.tree_util.tree_leaves(w), jax.tree_util.tree_leaves(want_w)):
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6)


def test_inside_multisteps_a_discarded_overflow_flags_the_next_real_step():
    # Inside MultiSteps the overflow is a flag in the cells, not in the
    # gradient (docs/loss_scaling.md): a probe's overflowing gradient, never
    # applied, still skips the next real step. It errs towards a skipped step,
    # never an applied overflow.
    scaling = jaxamp.loss_scaling(optax.sgd(0.1))
    tx = optax.MultiSteps(scaling, 2)
    step = _stepper(tx, scaling)
    w = _params()
    opt_state = tx.init(w)
    jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=scaling))(w, *_batch(overflow=True))
    for _ in range(2):
        new_w, opt_state, _ = step(w, opt_state, *_batch())
    np.testing.assert_array_equal(new_w, w)
    assert _skipped(opt_state.inner_opt_state) == 1
    for _ in range(2):  # the next real step is taken
        new_w, opt_state, _ = step(new_w, opt_state, *_batch())
    assert _skipped(opt_state.inner_opt_state) == 1 and not np.array_equal(new_w, w)


@pytest.mark.parametrize("jit_init", [False, True], ids=["eager_init", "jitted_init"])
def test_multisteps_around_the_live_scale_gets_zeros_and_an_unwrapped_one_nan(jit_init):
    # MultiSteps resets its accumulator by multiplying it by 0, which keeps a
    # NaN: its init tells the transformation (also when the init is traced),
    # and amp then hands back zeros and flags the overflow instead.
    w = _params()
    grads = {}
    for wrapped in (False, True):
        tx = jaxamp.loss_scaling(optax.adam(1e-2))
        init = optax.MultiSteps(tx, 2).init if wrapped else tx.init
        (jax.jit(init) if jit_init else init)(w)
        loss = jaxamp.amp(_loss, compute_dtype="f16", loss_scale=tx)
        grads[wrapped] = np.asarray(jax.jit(jax.grad(loss))(w, *_batch(overflow=True)))
    assert np.all(grads[True] == 0)
    assert np.all(np.isnan(grads[False]))


class _Model(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(D, 16, rngs=rngs)
        self.out = nnx.Linear(16, D, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.hidden(x)))


@pytest.mark.parametrize("given_as", ["transformation", "nnx.Optimizer"])
@pytest.mark.newest_only
def test_nnx_jit_step_with_the_optimizer_inside_multisteps(given_as):
    # Tunix's shape: nnx.jit over (model, optimizer), MultiSteps around the user's optimizer.
    model = _Model(nnx.Rngs(0))
    scaling = jaxamp.loss_scaling(optax.adam(1e-2))
    optimizer = nnx.Optimizer(model, optax.MultiSteps(scaling, 2), wrt=nnx.Param)
    loss = jaxamp.amp(
        lambda m, x, y: jnp.mean((m(x) - y) ** 2),
        compute_dtype="f16",
        loss_scale=scaling if given_as == "transformation" else optimizer,
    )

    @nnx.jit(donate_argnames=("optimizer",))
    def step(model, optimizer, x, y):
        grads = nnx.grad(loss)(model, x, y)
        optimizer.update(model, grads)

    def params():
        return [np.asarray(v) for v in jax.tree.leaves(nnx.state(model, nnx.Param))]

    step(model, optimizer, *_batch())
    step(model, optimizer, *_batch())
    after_first = params()
    step(model, optimizer, *_batch(overflow=True))
    step(model, optimizer, *_batch())  # the real step: skipped
    for got, want in zip(params(), after_first):
        np.testing.assert_array_equal(got, want)
    metrics = jaxamp.scaling.scale_metrics(optimizer.opt_state)
    assert (float(metrics["loss_scale"]), int(metrics["skipped_steps"])) == (2.0**14, 1)
    step(model, optimizer, *_batch())
    step(model, optimizer, *_batch())
    assert any(np.any(a != b) for a, b in zip(params(), after_first))


@pytest.mark.newest_only
def test_the_first_step_after_a_restore_overflowing_at_the_initial_scale_keeps_the_restored_scale():
    w = _params()
    restored = jaxamp.loss_scaling(optax.sgd(0.1), scaler=2.0**3).init(w)
    tx = jaxamp.loss_scaling(optax.sgd(0.1), scaler=2.0**24)  # a new process: its cells hold the initial scale
    tx.init(w)
    step = _stepper(tx, tx)
    x, y = _batch()
    y = y * 300.0  # overflows float16 at 2**24, not at 2**3
    new_w, opt_state, _ = step(w, restored, x, y)
    np.testing.assert_array_equal(new_w, w)
    assert (_scale(opt_state), _skipped(opt_state)) == (2.0**3, 1)
    new_w, opt_state, _ = step(w, opt_state, x, y)
    assert np.any(new_w != w) and _scale(opt_state) == 2.0**3


@pytest.mark.newest_only
@pytest.mark.parametrize("wrapped", [False, True])
def test_restored_through_restore_across_loss_scaling_the_first_step_runs_at_the_restored_scale(wrapped):
    w = _params()
    inner = (lambda tx: optax.MultiSteps(tx, 1)) if wrapped else (lambda tx: tx)
    written = inner(jaxamp.loss_scaling(optax.sgd(0.1), scaler=2.0**3)).init(w)
    tx = inner(jaxamp.loss_scaling(optax.sgd(0.1), scaler=2.0**24))  # a new process: the initial scale
    target = {"opt_state": jax.eval_shape(tx.init, w)}
    restore = jaxamp.scaling.restore_across_loss_scaling(lambda target: {"opt_state": written}, tx)
    restored = restore(target)["opt_state"]
    step = _stepper(tx, tx)
    x, y = _batch()
    new_w, opt_state, _ = step(w, restored, x, y * 300.0)  # overflows float16 at 2**24, not at 2**3
    assert np.any(new_w != w), "the first step after the restore was skipped"
    assert (_scale(opt_state), _skipped(opt_state)) == (2.0**3, 0)
    # An overflow after the restore is skipped, and leaves nothing behind (no NaN in MultiSteps' accumulator).
    after_w, opt_state, _ = step(new_w, opt_state, *_batch(overflow=True))
    np.testing.assert_array_equal(after_w, new_w)
    after_w, opt_state, _ = step(after_w, opt_state, x, y)
    assert np.all(np.isfinite(after_w)) and np.any(after_w != new_w)
    assert (_scale(opt_state), _skipped(opt_state)) == (2.0**2, 1)
    # A fresh init starts at the initial scale again.
    fresh = tx.init(w)
    new_w, opt_state, _ = step(w, fresh, x, y * 300.0)
    np.testing.assert_array_equal(new_w, w)
    assert (_scale(opt_state), _skipped(opt_state)) == (2.0**23, 1)


def test_inside_multisteps_a_stale_overflow_after_a_restore_skips_its_real_step():
    w = _params()
    restored = optax.MultiSteps(jaxamp.loss_scaling(optax.sgd(0.1), scaler=2.0**3), 2).init(w)
    tx = optax.MultiSteps(jaxamp.loss_scaling(optax.sgd(0.1), scaler=2.0**24), 2)  # a new process
    tx.init(w)
    step = _stepper(tx, tx)
    x, y = _batch()
    # The first micro-batch overflows at the cells' initial 2**24, the second is finite at 2**3.
    w1, state, _ = step(w, restored, x, y * 300.0)
    w2, state, _ = step(w1, state, x, y)
    # Its zeros do not dilute the real step: the step is skipped, the restored scale kept.
    np.testing.assert_array_equal(w2, w)
    assert (_scale(state), _skipped(state)) == (2.0**3, 1)
    w3, state, _ = step(w2, state, x, y)
    w4, state, _ = step(w3, state, x, y)
    assert np.any(w4 != w) and (_scale(state), _skipped(state)) == (2.0**3, 1)


def test_sharded_parameters_on_an_explicit_mesh():
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:4])
    w = jax.device_put(_params(), NamedSharding(mesh, P(None, "data")))
    tx = jaxamp.loss_scaling(optax.sgd(0.1))
    opt_state = tx.init(w)
    step = _stepper(tx, tx)
    with jax.set_mesh(mesh):
        new_w, opt_state, grads = step(w, opt_state, *_batch())
        assert new_w.sharding == w.sharding
        same_w, opt_state, _ = step(new_w, opt_state, *_batch(overflow=True))
    np.testing.assert_array_equal(same_w, new_w)
    assert _skipped(opt_state) == 1
    g32 = jax.grad(_loss)(_params(), *_batch())
    assert np.linalg.norm(np.asarray(grads) - g32) <= F16_RTOL * np.linalg.norm(g32)


def test_a_transformation_without_loss_scaling_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"holds no jaxamp.loss_scaling.*tx = jaxamp.loss_scaling"):
        jaxamp.amp(_loss, compute_dtype="f16", loss_scale=optax.adam(1e-3))


def test_two_loss_scalings_are_refused():
    tx = optax.chain(jaxamp.loss_scaling(optax.sgd(0.1)), jaxamp.loss_scaling(optax.sgd(0.1)))
    with pytest.raises(ValueError, match="holds 2 jaxamp.loss_scaling transformations"):
        jaxamp.amp(_loss, compute_dtype="f16", loss_scale=tx)


def test_a_transformation_built_inside_jit_is_refused_with_the_fix():
    @jax.jit
    def step(w):
        tx = jaxamp.loss_scaling(optax.sgd(0.1))
        return jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=tx))(w, *_batch())

    with pytest.raises(ValueError, match="made inside a traced function"):
        step(_params())


def test_inside_shard_map_the_state_is_asked_for():
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    tx = jaxamp.loss_scaling(optax.sgd(0.1))
    loss = jaxamp.amp(_loss, compute_dtype="f16", loss_scale=tx)
    body = jax.shard_map(lambda w, x, y: jax.grad(loss)(w, x, y), mesh=mesh, in_specs=(P(), P(), P()), out_specs=P())
    with pytest.raises(ValueError, match="inside a shard_map or pmap body.*loss_scale=opt_state"):
        jax.jit(body)(_params(), *_batch())


def test_an_optimizer_factory_shares_its_live_scale_with_what_it_builds():
    # MaxText builds its optimizer itself (optimizers.get_optimizer): the driver
    # wraps the factory, and amp is given it before any optimizer exists.
    def get_optimizer(learning_rate):
        return optax.sgd(learning_rate)

    get_optimizer = jaxamp.scaling.loss_scaling_factory(get_optimizer)
    assert get_optimizer.__name__ == "get_optimizer"
    loss = jaxamp.amp(_loss, compute_dtype="f16", loss_scale=get_optimizer)
    tx = get_optimizer(0.1)  # built later, by the framework
    w = _params()
    opt_state = tx.init(w)

    @jax.jit
    def step(w, opt_state, x, y):
        updates, opt_state = tx.update(jax.grad(loss)(w, x, y), opt_state, w)
        return optax.apply_updates(w, updates), opt_state

    w, opt_state = step(w, opt_state, *_batch())
    same_w, opt_state = step(w, opt_state, *_batch(overflow=True))
    np.testing.assert_array_equal(same_w, w)
    assert (_scale(opt_state), _skipped(opt_state)) == (2.0**14, 1)
    with pytest.raises(
        TypeError, match=r"jaxamp.loss_scaling of .*<lambda> expects an optax GradientTransformation.*got str"
    ):
        jaxamp.scaling.loss_scaling_factory(lambda: "not an optimizer")()


@pytest.mark.filterwarnings("ignore:.*context manager has been deprecated:DeprecationWarning")
@pytest.mark.parametrize("context", ["set_mesh", "with mesh"])
def test_an_init_under_jit_leaves_the_cells_to_follow_the_steps_mesh(context):
    # MaxText initialises its state under jit: the cells stay where they were
    # made (one device) until the first step over the mesh traces them.
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    w = jax.device_put(_params(), NamedSharding(mesh, P(None, "data")))
    tx = jaxamp.loss_scaling(optax.sgd(0.1))
    opt_state = jax.jit(tx.init)(w)
    step = _stepper(tx, tx)
    with jax.set_mesh(mesh) if context == "set_mesh" else mesh:
        new_w, opt_state, _ = step(w, opt_state, *_batch())
        same_w, opt_state, _ = step(new_w, opt_state, *_batch(overflow=True))
    np.testing.assert_array_equal(same_w, new_w)
    assert (_scale(opt_state), _skipped(opt_state)) == (2.0**14, 1)
    assert tx.update._jaxamp_live_scale.cells()["scale"].sharding.device_set == set(jax.devices()[:4])


def test_cells_a_compiled_step_holds_do_not_move_to_another_mesh():
    tx = jaxamp.loss_scaling(optax.sgd(0.1))
    w = _params()
    opt_state = jax.jit(tx.init)(w)
    step = _stepper(tx, tx)
    step(w, opt_state, *_batch())  # traced on one device: the cells stay there
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="compiled step already holds it there.*mesh of 2"):
        _stepper(tx, tx)(w, opt_state, *_batch())
