"""The loss-scaling transformations keep optax's contract, and the live scale its promises.

optax's protocol lets a caller name the update's arguments (``update(updates=,
state=, params=)``) and wrap a transformation in optax's own wrappers; the live
scale (``amp(loss, loss_scale=tx)``) must follow its state through a re-``init``,
say nothing about a forward-only call, stay out of a ``pmap`` body and name
the order that works where it cannot read a scale. References: the state path,
float32 and bit-identical parameters.
"""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

# Runs on the oldest supported JAX too: jax.Ref cells and custom_vjp rules.
pytestmark = pytest.mark.jax_internals

D = 8


def _params():
    return jax.random.normal(jax.random.PRNGKey(0), (D, D)) * 0.3


def _batch(overflow=False):
    x = jax.random.normal(jax.random.PRNGKey(1), (16, D))
    return x, jnp.ones((16, D)) * (1e6 if overflow else 1.0)


def _loss(w, x, y):
    return jnp.mean((jnp.tanh(x @ w) - y) ** 2)


def _leaves_equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


_KEYWORD_FORMS = {
    "loss_scaling": lambda: jaxamp.loss_scaling(optax.adam(1e-2)),
    "skip_nonfinite_updates": lambda: jaxamp.scaling.skip_nonfinite_updates(optax.adam(1e-2)),
    "low_precision_params": lambda: jaxamp.optim.low_precision_params(optax.adam(1e-2), rounding="kahan"),
    "chain of loss_scaling": lambda: optax.chain(optax.clip_by_global_norm(1.0), jaxamp.loss_scaling(optax.sgd(0.1))),
    "MultiSteps of loss_scaling": lambda: optax.MultiSteps(jaxamp.loss_scaling(optax.sgd(0.1)), 2),
    "loss_scaling of inject_hyperparams": lambda: jaxamp.loss_scaling(
        optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    ),
    "inject_hyperparams of loss_scaling": lambda: optax.inject_hyperparams(
        lambda learning_rate: jaxamp.loss_scaling(optax.adam(learning_rate))
    )(learning_rate=1e-2),
}


@pytest.mark.filterwarnings("ignore:jaxamp.loss_scaling.s update reads a loss scale that no jaxamp.amp call")
@pytest.mark.parametrize("name", sorted(_KEYWORD_FORMS))
def test_update_takes_every_call_form_optax_allows(name):
    tx = _KEYWORD_FORMS[name]()
    params = _params() if name != "low_precision_params" else _params().astype(jnp.bfloat16)
    grads = jax.grad(_loss)(params.astype(jnp.float32), *_batch()).astype(params.dtype)
    state = tx.init(params)
    positional = tx.update(grads, state, params)
    forms = [
        tx.update(updates=grads, state=state, params=params),
        tx.update(grads, state=state, params=params),
        tx.update(grads, state, params=params),
        # Extra keyword arguments (optax.GradientTransformationExtraArgs): passed on or dropped.
        tx.update(grads, state, params, value=jnp.float32(1.0)),
    ]
    for updates, new_state in forms:
        assert _leaves_equal(updates, positional[0]) and _leaves_equal(new_state, positional[1])


def _live_step(tx):
    loss = jaxamp.amp(_loss, compute_dtype="f16", loss_scale=tx)
    grad = jax.jit(jax.grad(loss))
    return lambda w, s, batch: tx.update(grad(w, *batch), s, w)


def test_a_second_init_after_the_gradient_was_traced_still_skips_an_overflow():
    # A reset or a second run in the process: the gradient function traced
    # before the init must tell the update the new init made about its overflow.
    tx = jaxamp.loss_scaling(optax.adam(1e-2))
    w = _params()
    loss = jaxamp.amp(_loss, compute_dtype="f16", loss_scale=tx)
    grad = jax.jit(jax.grad(loss))
    state = tx.init(w)
    jax.jit(tx.update)(grad(w, *_batch()), state, w)
    state = tx.init(w)
    # The update traced after the init (a new step function, or eagerly).
    updates, new_state = jax.jit(lambda g, s, w: tx.update(g, s, w))(grad(w, *_batch(overflow=True)), state, w)
    assert not bool(new_state.last_finite)
    assert float(new_state.scale) == float(state.scale) / 2
    assert _leaves_equal(new_state.inner_state, state.inner_state)


def test_apply_if_finite_around_the_live_scale_shrinks_the_scale_on_the_first_overflow():
    # The live scale's overflow reaches its update as a flag: apply_if_finite
    # sees finite zeros and keeps the wrapper's moved state.
    tx = optax.apply_if_finite(jaxamp.loss_scaling(optax.adam(1e-2)), 5)
    w = _params()
    state = tx.init(w)
    before = float(state.inner_state.scale)
    updates, state = _live_step(tx)(w, state, _batch(overflow=True))
    assert float(state.inner_state.scale) == before / 2
    assert int(jaxamp.scaling.scale_metrics(state)["skipped_steps"]) == 1
    assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))


def test_apply_if_finite_around_the_wrapper_given_as_state_is_refused_naming_what_works():
    state = optax.apply_if_finite(jaxamp.loss_scaling(optax.adam(1e-2)), 5).init(_params())
    with pytest.raises(ValueError, match=r"inside optax.apply_if_finite.*would not shrink.*drop apply_if_finite"):
        jaxamp.amp(_loss, compute_dtype="f16", loss_scale=state)


def test_a_forward_only_live_call_leaves_a_later_state_path_step_unwarned():
    evaluated_by = jaxamp.loss_scaling(optax.adam(1e-2))
    evaluated_by.init(_params())
    jax.jit(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=evaluated_by))(_params(), *_batch())
    assert bool(_state_step_jitted_apart_unwarned().last_finite)


def _state_step_jitted_apart_unwarned():
    """A state-path step, the gradient jitted apart from the update, warnings as errors: the new state."""
    tx = jaxamp.loss_scaling(optax.adam(1e-2))
    state = tx.init(_params())
    grad = jax.jit(lambda w, s: jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=s))(w, *_batch()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return jax.jit(tx.update)(grad(_params(), state), state, _params())[1]


def test_a_pmap_step_given_the_state_after_a_live_eval_of_the_same_transformation():
    n = 2
    tx = jaxamp.loss_scaling(optax.sgd(0.1), axis_name="d")
    w = _params()
    state = tx.init(w)
    jax.jit(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=tx))(w, *_batch())  # the eval: tx is attached

    def step(w, s, x, y):
        grads = jax.lax.pmean(jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=s))(w, x, y), "d")
        updates, s = tx.update(grads, s, w)
        return optax.apply_updates(w, updates), s

    def replicate(tree):
        return jax.tree.map(lambda a: jnp.stack([a] * n), tree)

    x, y = _batch()
    new_w, _ = jax.pmap(step, axis_name="d", devices=jax.devices()[:n])(
        replicate(w), replicate(state), x.reshape(n, -1, D), y.reshape(n, -1, D)
    )
    # Each device's mean gradient is the whole batch's: the float32 step within float16 tolerance.
    want = w - 0.1 * jax.grad(_loss)(w, x, y)
    np.testing.assert_allclose(new_w[0], want, atol=2e-3)
    np.testing.assert_array_equal(new_w[0], new_w[1])


def test_inject_hyperparams_around_the_wrapper_is_refused_naming_the_order_that_works():
    tx = optax.inject_hyperparams(lambda learning_rate: jaxamp.loss_scaling(optax.adam(learning_rate)))(
        learning_rate=1e-2
    )
    with pytest.raises(ValueError, match=r"inject_hyperparams.*jaxamp.loss_scaling\(optax.inject_hyperparams"):
        jaxamp.amp(_loss, compute_dtype="f16", loss_scale=tx)
    # The order it names trains, its learning rate a hyperparameter in the state.
    works = jaxamp.loss_scaling(optax.inject_hyperparams(optax.adam)(learning_rate=1e-2))
    state = works.init(_params())
    _, state = _live_step(works)(_params(), state, _batch(overflow=True))
    assert int(jaxamp.scaling.scale_metrics(state)["skipped_steps"]) == 1
    _, state = _live_step(works)(_params(), state, _batch())
    assert bool(state.last_finite)
    assert float(state.inner_state.hyperparams["learning_rate"]) == pytest.approx(1e-2)


@pytest.mark.parametrize(
    "inner_grad",
    [jax.grad, lambda f: jax.jit(jax.grad(f)), lambda f: eqx.filter_value_and_grad(f)],
    ids=["grad", "jit_of_grad", "eqx_filter_value_and_grad"],
)
def test_amp_of_a_function_taking_its_own_gradient_warns_when_jitted_apart_from_the_update(inner_grad):
    # The loss scale reaches no backward pass there: float16 gradients flush.
    tx = jaxamp.loss_scaling(optax.adam(1e-2))
    state = tx.init(_params())
    grad = jax.jit(lambda w, s: jaxamp.amp(inner_grad(_loss), compute_dtype="f16", loss_scale=s)(w, *_batch()))
    with pytest.warns(UserWarning, match=r"takes a gradient itself.*Put amp inside the gradient"):
        grad(_params(), state)


def test_amp_inside_the_gradient_jitted_apart_from_the_update_is_not_warned_about():
    assert bool(_state_step_jitted_apart_unwarned().last_finite)


def test_one_overflowing_gradient_handed_to_two_updates_is_skipped_by_both():
    # The state path's NaN gradients are skipped by every update they reach;
    # the live scale's flag stays set for each update until the next backward pass.
    tx = jaxamp.loss_scaling(optax.adam(1e-2))
    w = _params()
    state = tx.init(w)
    grads = jax.jit(jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=tx)))(w, *_batch(overflow=True))
    update = jax.jit(tx.update)
    _, once = update(grads, state, w)
    _, twice = update(grads, once, w)
    assert not bool(once.last_finite) and not bool(twice.last_finite)
    assert float(twice.scale) == float(state.scale) / 4
    assert _leaves_equal(twice.inner_state, state.inner_state)
    # The next backward pass starts the flag anew: a finite step is applied.
    grads = jax.jit(jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=tx)))(w, *_batch())
    _, third = update(grads, twice, w)
    assert bool(third.last_finite)


def _state_step(tx):
    grad = jax.jit(lambda w, s, x, y: jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=s))(w, x, y))
    return lambda w, s, batch: tx.update(grad(w, s, *batch), s, w)


def test_a_discarded_overflowing_gradient_changes_nothing_with_the_live_scale():
    # A probe (a grad-norm diagnostic) whose gradient is never applied: the
    # overflow travels in that gradient, so the next clean step is taken, as
    # on the state path.
    live_tx, state_tx = jaxamp.loss_scaling(optax.adam(1e-2)), jaxamp.loss_scaling(optax.adam(1e-2))
    w = _params()
    live_state, state_state = live_tx.init(w), state_tx.init(w)
    probe = jax.jit(jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=live_tx)))
    assert np.all(np.isnan(probe(w, *_batch(overflow=True))))
    live_updates, live_state = _live_step(live_tx)(w, live_state, _batch())
    state_updates, state_state = _state_step(state_tx)(w, state_state, _batch())
    assert bool(live_state.last_finite)
    assert _leaves_equal(live_updates, state_updates)
    assert float(live_state.scale) == float(state_state.scale)


def test_a_second_state_on_one_transformation_is_said_and_an_overflow_above_its_scale_keeps_it():
    # One transformation, two optimizer states (two models): amp reads the
    # scale of the state updated last. A step that overflowed above its own
    # state's scale says nothing of that scale (kept, the step skipped), and
    # the sharing is said once.
    tx = jaxamp.loss_scaling(optax.adam(1e-2), scaler=2.0**10)
    w = _params()
    step = _live_step(tx)
    first, second = tx.init(w), tx.init(w)
    _, first = step(w, first, _batch(overflow=True))  # halved: the cells now follow it
    assert float(first.scale) == 2.0**9
    with pytest.warns(UserWarning, match="serves more than one optimizer state"):
        _, second = step(w, second, _batch())  # ran at 2^9, below its own 2^10: clean, taken
        jax.effects_barrier()
    assert bool(second.last_finite) and float(second.scale) == 2.0**10
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        _, first = step(w, first, _batch(overflow=True))  # ran at the second's 2^10, above its 2^9
        jax.effects_barrier()
    assert not bool(first.last_finite)
    assert float(first.scale) == 2.0**9
    assert int(jaxamp.scaling.scale_metrics(first)["skipped_steps"]) == 2


def test_a_restored_state_steps_at_once_and_an_overflow_at_the_initial_scale_keeps_its_scale():
    # A new process (a new transformation) restores a state whose scale is
    # below the initial one: the first step reads the initial scale (the cells
    # have followed no state yet); taken where finite, and where it overflowed
    # there the restored scale is kept. Nothing is said: this is no misuse.
    saved = jaxamp.loss_scaling(optax.adam(1e-2), scaler=2.0**10).init(_params())
    saved = saved._replace(scaler_state=saved.scaler_state._replace(scaler=jnp.float32(2.0**6)))
    for overflow in (False, True):
        tx = jaxamp.loss_scaling(optax.adam(1e-2), scaler=2.0**10)
        tx.init(_params())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _, state = _live_step(tx)(_params(), saved, _batch(overflow=overflow))
            jax.effects_barrier()
        assert bool(state.last_finite) is not overflow
        assert float(state.scale) == 2.0**6
        assert float(tx.update._jaxamp_live_scale.cells()["scale"][...]) == 2.0**6
