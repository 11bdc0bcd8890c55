"""``amp(loss_scale=...)``: every value the gradient reaches is unscaled, once.

Whatever the loss differentiates (an argument, a value it closes over, the
arrays of a module passed as the function), the gradient comes back in its
true scale; a custom_vjp rule inside the loss sees the true-scale
cotangent; amp inside amp scales once; a non-finite step's gradients are
NaN throughout, so nothing between amp and the update hides it; and a
placement of `loss_scaling` where a skipped step would still commit state is
refused. References: float32's gradients (float16 tolerance) and amp's own
argument path (bit for bit where both apply).
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

D = 8
# float16 matmuls against float32's: relative error of the gradient's norm.
F16_RTOL = 2e-2


def _params():
    return jax.random.normal(jax.random.PRNGKey(0), (D, D)) * 0.3


def _x():
    return jax.random.normal(jax.random.PRNGKey(1), (4, D))


def _loss(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)


def _state(scale=2.0**15):
    return jaxamp.loss_scaling(optax.sgd(0.1), scaler=scale).init(_params())


def _close(got, want, rtol=F16_RTOL):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.linalg.norm(got - want) <= rtol * np.linalg.norm(want), (np.linalg.norm(got), np.linalg.norm(want))


class _Linear(eqx.Module):
    w: jax.Array

    def __call__(self, x):
        return _loss(self.w, x)

    def loss(self, x):
        return _loss(self.w, x)


def _by_argument(w, state):
    return jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=state))(w, _x())


def _by_closure(w, state):
    return jax.grad(lambda w: jaxamp.amp(lambda x: _loss(w, x), compute_dtype="f16", loss_scale=state)(_x()))(w)


def _by_partial(w, state):
    return jax.grad(lambda w: jaxamp.amp(functools.partial(_loss, w), compute_dtype="f16", loss_scale=state)(_x()))(w)


def _by_module_as_function(w, state):
    grads = jax.grad(lambda m: jaxamp.amp(m, compute_dtype="f16", loss_scale=state)(_x()))(_Linear(w))
    return grads.w


def _by_bound_method(w, state):
    grads = jax.grad(lambda m: jaxamp.amp(m.loss, compute_dtype="f16", loss_scale=state)(_x()))(_Linear(w))
    return grads.w


_WHERE = {
    "argument": _by_argument,
    "closure": _by_closure,
    "partial": _by_partial,
    "module as fn": _by_module_as_function,
    "bound method": _by_bound_method,
}


@settings(max_examples=10, deadline=None)
@given(where=st.sampled_from(sorted(_WHERE)), jit=st.booleans(), log2_scale=st.integers(0, 16))
@pytest.mark.newest_only
def test_wherever_the_parameters_come_from_the_gradient_is_true_scale(where, jit, log2_scale):
    w, state = _params(), _state(2.0**log2_scale)
    grad = (jax.jit(_WHERE[where]) if jit else _WHERE[where])(w, state)
    _close(grad, jax.grad(_loss)(w, _x()))
    # Bit for bit the argument path's: one mechanism.
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(jax.jit(_by_argument)(w, state)))


@pytest.mark.newest_only
def test_an_nnx_module_closed_over_under_nnx_grad_gets_true_scale_gradients():
    model = nnx.Linear(D, D, rngs=nnx.Rngs(0))
    state, x = _state(), _x()

    def loss(model):
        return jaxamp.amp(lambda x: jnp.mean(jnp.tanh(model(x)) ** 2), compute_dtype="f16", loss_scale=state)(x)

    grads = nnx.grad(loss)(model)
    want = nnx.grad(lambda m: jnp.mean(jnp.tanh(m(x)) ** 2))(model)
    _close(grads["kernel"][...], want["kernel"][...])


@jax.custom_vjp
def _clip_gradient(x):
    return x


def _clip_fwd(x):
    return x, None


def _clip_bwd(_, g):
    # JAX's documented clip_gradient: not linear in its cotangent.
    return (jnp.clip(g, -1e-3, 1e-3),)


_clip_gradient.defvjp(_clip_fwd, _clip_bwd)


def _clipped_loss(w, x):
    return jnp.sum(_clip_gradient(x @ w) ** 2)


@pytest.mark.parametrize("inner_jit", [False, True], ids=["top level", "inside an inner jit"])
def test_a_custom_vjp_rule_inside_the_loss_sees_the_true_scale_cotangent(inner_jit):
    w, x = _params(), _x()
    clipped = jax.jit(_clipped_loss) if inner_jit else _clipped_loss
    grad = jax.grad(jaxamp.amp(clipped, compute_dtype="f16", loss_scale=_state()))(w, x)
    want = jax.grad(_clipped_loss)(w, x)
    _close(grad, want)
    # Before, the rule clipped the scaled cotangent: the gradient came out 2**15 times too small.
    assert np.linalg.norm(np.asarray(grad)) > 0.5 * np.linalg.norm(np.asarray(want))


def test_amp_inside_amp_scales_the_cotangent_once():
    w, x, state = _params(), _x(), _state()
    inner = jaxamp.amp(lambda w, x: jnp.tanh(x @ w), compute_dtype="f16", loss_scale=state)
    outer = jaxamp.amp(lambda w, x: jnp.mean(inner(w, x) ** 2), compute_dtype="f16", loss_scale=state)
    _close(jax.grad(outer)(w, x), jax.grad(_loss)(w, x))


def _overflowing(w, x):
    # Finite forward; the scaled float16 backward overflows to inf (not NaN).
    return jnp.sum(x @ w)


@pytest.mark.parametrize("between", [lambda g: jnp.clip(g, -0.3, 0.3), lambda g: g.astype(jnp.bfloat16)])
@pytest.mark.newest_only
def test_an_elementwise_clip_or_cast_between_amp_and_the_update_cannot_hide_an_overflow(between):
    w, x = _params(), _x() * 300.0
    optimizer = jaxamp.loss_scaling(optax.adam(0.1), scaler=2.0**15)
    state = optimizer.init(w)
    value, grad = jax.value_and_grad(jaxamp.amp(_overflowing, compute_dtype="f16", loss_scale=state))(w, x)
    assert np.isfinite(float(value))
    assert bool(jnp.all(jnp.isnan(grad)))  # every entry, not only those that overflowed
    updates, new_state = optimizer.update(between(grad).astype(jnp.float32), state, w)
    assert not bool(new_state.last_finite)
    assert float(new_state.scale) == 2.0**14
    assert bool(jnp.all(updates == 0))


@pytest.mark.newest_only
def test_a_finite_step_is_not_touched_by_the_finiteness_decision():
    w, x = _params(), _x()
    grad = jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=2.0**10))(w, x)
    assert bool(jnp.all(jnp.isfinite(grad)))


_REFUSED = {
    "a chain with a transformation after it": optax.chain(jaxamp.loss_scaling(optax.sgd(0.1)), optax.adamw(0.1)),
    "a chain after a stateful transformation": optax.chain(optax.scale_by_adam(), jaxamp.loss_scaling(optax.sgd(0.1))),
    "one partition of multi_transform": optax.multi_transform(
        {"a": jaxamp.loss_scaling(optax.sgd(0.1)), "b": optax.sgd(0.1)}, {"w": "a", "v": "b"}
    ),
    "inside MultiSteps": optax.MultiSteps(jaxamp.loss_scaling(optax.sgd(0.1)), 2),
    "inside apply_if_finite": optax.apply_if_finite(jaxamp.loss_scaling(optax.sgd(0.1)), 5),
}
# What each refusal names: the placement, then the order that works.
_PLACEMENT_WORDS = {
    "a chain with a transformation after it": "transformations after it",
    "a chain after a stateful transformation": "after a stateful transformation",
    "one partition of multi_transform": "one partition of optax.multi_transform",
    "inside MultiSteps": r"inside optax.MultiSteps.*loss_scaling\(optax.MultiSteps\(opt, k\)\).*loss_scale=tx.*amp_module",
    "inside apply_if_finite": r"inside optax.apply_if_finite.*would not shrink.*drop apply_if_finite",
}
_WHOLE = {"inside MultiSteps": "", "inside apply_if_finite": ""}


@pytest.mark.parametrize("placement", sorted(_REFUSED))
def test_a_placement_where_a_skipped_step_would_not_be_clean_is_refused_naming_what_works(placement):
    params = {"w": _params(), "v": _params()}
    state = _REFUSED[placement].init(params)
    works = _WHOLE.get(placement, ".*Wrap the whole optimizer")
    with pytest.raises(ValueError, match=f"{_PLACEMENT_WORDS[placement]}{works}"):
        jaxamp.amp(lambda p: jnp.sum(p["w"]), compute_dtype="f16", loss_scale=state)


def test_the_placements_that_own_the_whole_update_are_taken():
    params = _params()
    for optimizer in [
        optax.chain(optax.clip_by_global_norm(1.0), jaxamp.loss_scaling(optax.adam(0.1))),
        jaxamp.loss_scaling(optax.chain(optax.clip(0.3), optax.adamw(0.1))),
        jaxamp.loss_scaling(optax.MultiSteps(optax.adam(0.1), 2)),
    ]:
        grad = jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=optimizer.init(params)))(params, _x())
        _close(grad, jax.grad(_loss)(params, _x()))


@pytest.mark.parametrize(
    "forward",
    [
        lambda f, w, x: jax.jvp(lambda w: f(w, x), (w,), (w,)),
        lambda f, w, x: jax.jacfwd(f)(w, x),
        lambda f, w, x: jax.hessian(f)(w, x),
    ],
    ids=["jvp", "jacfwd", "hessian"],
)
def test_forward_mode_is_an_error_naming_amp_and_loss_scale(forward):
    f = jaxamp.amp(_loss, compute_dtype="f16", loss_scale=_state())
    with pytest.raises(TypeError, match=r"jaxamp.amp\(..., loss_scale=...\) is differentiated in forward mode"):
        forward(f, _params()[:2, :2], _x()[:, :2])


@pytest.mark.parametrize(
    "around",
    [
        lambda f: lambda w, x: jax.checkpoint(f)(w, x),
        lambda f: lambda w, x: jax.lax.scan(lambda c, _: (c + f(w, x), None), 0.0, None, length=2)[0] / 2,
    ],
    ids=["checkpoint", "scan"],
)
def test_checkpoint_and_scan_around_the_amped_loss_run_eagerly(around):
    w, x = _params(), _x()
    loss = around(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=_state()))
    _close(jax.grad(loss)(w, x), jax.grad(_loss)(w, x))


def _eager_step(optimizer, amped, state):
    grad = jax.grad(amped)(_params(), _x())
    return optimizer.update(grad, state, _params())[1]


def test_an_amped_function_built_once_and_called_with_an_old_state_is_said_at_the_next_update():
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1))
    state = optimizer.init(_params())
    stale = jaxamp.amp(_loss, compute_dtype="f16", loss_scale=state)
    state = _eager_step(optimizer, stale, state)  # first step: its own scale
    with pytest.warns(UserWarning, match="no amp call was given, while amp was given another scale.*older state"):
        _eager_step(optimizer, stale, state)


@pytest.mark.newest_only
def test_a_loss_given_another_optimizers_state_is_said_at_the_update():
    generator, discriminator = jaxamp.loss_scaling(optax.sgd(0.1)), jaxamp.loss_scaling(optax.sgd(0.1))
    g_state, d_state = generator.init(_params()), discriminator.init(_params())

    @jax.jit
    def step(g_state, d_state):
        grad = jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=d_state))(_params(), _x())
        return generator.update(grad, g_state, _params())

    with pytest.warns(UserWarning, match="another optimizer's state"):
        step(g_state, d_state)


@pytest.mark.newest_only
def test_an_optimizer_whose_gradients_no_amp_call_scaled_is_said_at_the_update(monkeypatch):
    # As in a fresh process: no amp call has been given a scale (the tests before this one's gave some).
    monkeypatch.setattr(jaxamp.scaling._scale_uses, "_scaled_any", False)
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1))

    @jax.jit
    def step(state):
        grad = jax.grad(jaxamp.amp(_loss, compute_dtype="f16"))(_params(), _x())  # loss_scale= forgotten
        return optimizer.update(grad, state, _params())

    with pytest.warns(UserWarning, match="no jaxamp.amp call was given.*not loss-scaled"):
        step(optimizer.init(_params()))


def test_a_gradient_jitted_apart_from_the_update_is_not_warned_of(recwarn):
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1))
    state = optimizer.init(_params())
    grad = jax.jit(lambda s: jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=s))(_params(), _x()))(state)
    jax.jit(lambda g, s: optimizer.update(g, s, _params()))(grad, state)
    assert not [w for w in recwarn if "jaxamp.loss_scaling's update" in str(w.message)]
    _close(grad, jax.grad(_loss)(_params(), _x()))


@pytest.mark.newest_only
def test_tunix_order_multisteps_around_the_wrapper_is_refused_with_the_order_that_works():
    # Tunix wraps the user's optimizer in optax.MultiSteps: one overflowing
    # micro-batch would leave a NaN in MultiSteps' accumulator (reset by
    # multiplying by 0) and skip every later real step.
    model = nnx.Linear(D, D, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.MultiSteps(jaxamp.loss_scaling(optax.adam(1e-3)), 4), wrt=nnx.Param)
    with pytest.raises(ValueError, match=r"inside optax.MultiSteps.*jaxamp.loss_scaling\(optax.MultiSteps\(opt, k\)\)"):
        jaxamp.amp(lambda m, x: jnp.mean(m(x) ** 2), compute_dtype="f16", loss_scale=optimizer.opt_state)


@pytest.mark.newest_only
def test_a_returned_dict_shaped_like_the_batch_comes_back_as_computed():
    # An autoencoder: batch={"image": x} in, {"image": recon} out. Not state.
    w = _params()

    def loss(w, batch):
        recon = jnp.tanh(batch["image"] @ w)
        return jnp.mean((recon - batch["image"]) ** 2), {"image": recon}

    batch = {"image": _x().at[0, 0].set(jnp.nan)}
    (_, out), _ = jax.value_and_grad(jaxamp.amp(loss, compute_dtype="f16", loss_scale=2.0**10), has_aux=True)(w, batch)
    np.testing.assert_array_equal(
        np.isnan(np.asarray(out["image"])), np.isnan(np.asarray(jnp.tanh(batch["image"] @ w)))
    )
    assert not np.array_equal(np.asarray(out["image"]), np.asarray(batch["image"]), equal_nan=True)


def test_a_nan_metric_beside_the_loss_does_not_hold_back_the_statistics_of_an_applied_step():
    stats = {"bn": {"mean": jnp.zeros(D)}}

    def loss(w, stats, x):
        h = x @ w
        new = {"bn": {"mean": 0.9 * stats["bn"]["mean"] + 0.1 * jnp.mean(h, 0)}}
        metric = jnp.mean(h[:0])  # the mean of nothing: NaN, by design of the metric
        return jnp.mean(h**2), (new, metric)

    (_, (new, metric)), _ = jax.value_and_grad(jaxamp.amp(loss, compute_dtype="f16", loss_scale=2.0**10), has_aux=True)(
        _params(), stats, _x()
    )
    assert np.isnan(float(metric))
    assert not np.array_equal(np.asarray(new["bn"]["mean"]), np.asarray(stats["bn"]["mean"]))  # committed


def test_the_states_own_scale_given_as_an_array_is_recognised_by_the_update(recwarn):
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1))

    @jax.jit
    def step(state):
        grad = jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=state.scale))(_params(), _x())
        return grad, optimizer.update(grad, state, _params())

    grad, _ = step(optimizer.init(_params()))
    assert not [w for w in recwarn if "jaxamp.loss_scaling's update" in str(w.message)]
    _close(grad, jax.grad(_loss)(_params(), _x()))


def test_a_custom_vjp_rule_in_a_shard_map_body_is_said_to_see_the_scaled_cotangent():
    mesh = jax.make_mesh((2,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec("dp")

    def loss(w, x):
        per_shard = jax.shard_map(
            lambda w, x: jnp.sum(_clip_gradient(x @ w) ** 2, keepdims=True),
            mesh=mesh,
            in_specs=(jax.sharding.PartitionSpec(), spec),
            out_specs=spec,
        )(w, x)
        return jnp.sum(per_shard)

    w, x = _params(), _x()
    with pytest.warns(UserWarning, match="custom_vjp function inside a shard_map body: its backward rule sees"):
        grad = jax.grad(jaxamp.amp(loss, compute_dtype="f16", loss_scale=2.0**10))(w, x)
    # The rule clipped the scaled cotangent, as the warning says (linear rules are exact).
    assert float(jnp.linalg.norm(grad)) < 0.5 * float(jnp.linalg.norm(jax.grad(_clipped_loss)(w, x)))
