"""A float16 training loop survives NaN/inf gradients injected on random steps.

Dynamic loss scaling with `redo_on_nan` absorbs ordinary float16 overflow inside
the step, so the only steps that come back non-finite are the injected ones; on
exactly those, `skip_nonfinite_updates` + `apply_if_finite_updates` must leave
parameters and optimizer state bit for bit unchanged, and training must still
converge. The same loop is run with a `GradScaler`.

Then bursts: a long run of poisoned (NaN) batches must not take any of the three
scalers to 0 (from which no scale recovers: ``0 * loss`` and ``0 / 0``), and the
first clean batch after it must train again; long runs of finite steps must not
take a scale past its maximum or to inf. The update rule the scalers share is
checked against a pure-Python model on random finite/non-finite sequences.
"""

import math

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import example, given, settings

import jaxamp
from jaxamp.scaling._scale_schedule import next_scale

STEPS = 240
POISON_RATE = 0.08


def _mlp(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return (h @ params["w2"] + params["b2"])[:, 0]


def _loss(params, x, y, poison):
    loss = jnp.mean((_mlp(params, x) - y) ** 2)
    # A traced flag, so the same compiled step can be poisoned or not.
    return loss * jnp.where(poison, jnp.inf, 1.0)


def _manual_f16_loss(params, x, y, poison):
    params, x = jaxamp.policies.cast_floating((params, x), jnp.float16)
    return _loss(params, x, y.astype(jnp.float16), poison)


LOSSES = {"amp": jaxamp.amp(_loss, compute_dtype=jnp.float16), "manual_cast": _manual_f16_loss}


def _problem():
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(keys[0], (128, 4))
    y = jnp.sin(x @ jnp.array([1.0, -2.0, 0.5, 1.5]))
    params = {
        "w1": jax.random.normal(keys[1], (4, 32)) * 0.5,
        "b1": jnp.zeros(32),
        "w2": jax.random.normal(keys[2], (32, 1)) * 0.2,
        "b2": jnp.zeros(1),
    }
    poison = np.random.default_rng(0).random(STEPS) < POISON_RATE
    poison[:3] = False  # a clean start gives a clean reference loss
    return params, x, y, poison


def _bits(tree):
    return [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree)]


def _clean_loss(params, x, y):
    return float(_loss(params, x, y, False))


@pytest.mark.parametrize("cast", sorted(LOSSES))
def test_dynamic_scaler_skips_exactly_the_poisoned_steps(cast):
    params, x, y, poison = _problem()
    optimizer = jaxamp.scaling.skip_nonfinite_updates(optax.adam(3e-2))
    grad_fn = jaxamp.dynamic_scale_value_and_grad(LOSSES[cast], filter=False, redo_on_nan=3)

    @jax.jit
    def train_step(params, opt_state, scaler_state, poison):
        scaler_state, (_, grads) = grad_fn(params, x, y, poison, dynamic_scaler_state=scaler_state)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = jaxamp.scaling.apply_if_finite_updates(params, updates, opt_state.last_finite)
        return params, opt_state, scaler_state

    opt_state = optimizer.init(params)
    scaler_state = jaxamp.DynamicScalerState(scaler=2**15, patience=4)
    start = _clean_loss(params, x, y)
    skipped = []
    for step in range(STEPS):
        before = _bits((params, opt_state.inner_state))
        resets, scale = int(scaler_state.total_resets), float(scaler_state.scaler)
        params, opt_state, scaler_state = train_step(params, opt_state, scaler_state, poison[step])
        unchanged = _bits((params, opt_state.inner_state)) == before
        skipped.append(not bool(opt_state.last_finite))
        assert unchanged == skipped[-1], f"step {step}"
        assert bool(jaxamp.all_finite(params)), f"step {step}"
        if poison[step]:
            # The poison makes the loss itself inf: no smaller scale fixes it,
            # so the step is skipped with one shrink and no retry.
            assert int(scaler_state.total_resets) - resets == 1
            assert float(scaler_state.scaler) == max(scale / 2, 1.0)
    np.testing.assert_array_equal(skipped, poison)
    assert int(opt_state.total_notfinite) == poison.sum()
    assert _clean_loss(params, x, y) < 0.2 * start


def test_grad_scaler_skips_exactly_the_poisoned_steps():
    params, x, y, poison = _problem()
    optimizer = optax.adam(3e-2)
    amp_loss = LOSSES["amp"]

    @jax.jit
    def train_step(params, opt_state, scaler, poison):
        grads = jax.grad(lambda p: scaler.scale(amp_loss(p, x, y, poison)))(params)
        params, opt_state, scaler = scaler.step(optimizer, grads, opt_state, params)
        return params, opt_state, scaler.found_inf, scaler.update()

    opt_state = optimizer.init(params)
    # A small initial scale: torch's GradScaler has no redo, so float16 overflow
    # from a too-large scale would skip extra steps.
    scaler = jaxamp.GradScaler(init_scale=2.0**8, growth_interval=1000)
    start = _clean_loss(params, x, y)
    for step in range(STEPS):
        before = _bits((params, opt_state))
        params, opt_state, found_inf, scaler = train_step(params, opt_state, scaler, poison[step])
        assert bool(found_inf) == poison[step], f"step {step}"
        assert (_bits((params, opt_state)) == before) == poison[step], f"step {step}"
        assert bool(jaxamp.all_finite(params))
    # 21 poisoned steps would take 2**8 to 2**-13; min_scale stops it at 1.
    assert poison.sum() > 8 and scaler.get_scale() == 1.0
    assert _clean_loss(params, x, y) < 0.2 * start


# --- Bursts of non-finite steps, and long runs of finite ones -------------------

F32_MAX = float(np.finfo(np.float32).max)
CLEAN_STEPS = 5


def _data_loss(params, x, y):
    return jnp.mean((_mlp(params, x) - y) ** 2)


AMP_LOSS = jaxamp.amp(_data_loss, compute_dtype=jnp.float16)


def _jaxamp_trainer(loss_fn, scaler_state):
    optimizer = jaxamp.scaling.skip_nonfinite_updates(optax.adam(1e-2))
    grad_fn = jaxamp.dynamic_scale_value_and_grad(loss_fn, filter=False, redo_on_nan=10)

    @jax.jit
    def train_step(params, opt_state, scaler_state, x, y):
        scaler_state, (loss, grads) = grad_fn(params, x, y, dynamic_scaler_state=scaler_state)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = jaxamp.scaling.apply_if_finite_updates(params, updates, opt_state.last_finite)
        return params, opt_state, scaler_state, loss

    return optimizer, train_step, lambda state: float(state.scaler)


def _scaled_value_and_grad(scaler, loss_fn, params, x, y):
    def scaled_loss(p):
        loss = loss_fn(p, x, y)
        return scaler.scale(loss), loss

    (_, loss), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)
    return loss, grads


def _grad_scaler_trainer(loss_fn, scaler):
    optimizer = optax.adam(1e-2)

    @jax.jit
    def train_step(params, opt_state, scaler, x, y):
        loss, grads = _scaled_value_and_grad(scaler, loss_fn, params, x, y)
        params, opt_state, scaler = scaler.step(optimizer, grads, opt_state, params)
        return params, opt_state, scaler.update(), loss

    return optimizer, train_step, lambda scaler: scaler.get_scale()


def _jmp_trainer(loss_fn, loss_scale):
    optimizer = optax.adam(1e-2)

    @jax.jit
    def train_step(params, opt_state, loss_scale, x, y):
        loss, grads = _scaled_value_and_grad(loss_scale, loss_fn, params, x, y)
        grads = loss_scale.unscale(grads)
        finite = jaxamp.all_finite(grads)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        params = jaxamp.scaling.apply_if_finite_updates(params, updates, finite)
        opt_state = jaxamp.select_tree(finite, new_opt_state, opt_state)
        return params, opt_state, loss_scale.adjust(finite), loss

    return optimizer, train_step, lambda loss_scale: float(loss_scale.loss_scale)


def _train(trainer, loss_fn, scaler, batches):
    """Run `batches` ((x, y) pairs); per step: scale after it, loss, params changed."""
    params, *_ = _problem()
    optimizer, train_step, scale_of = trainer(loss_fn, scaler)
    opt_state = optimizer.init(params)
    scales, losses, changed = [], [], []
    for x, y in batches:
        before = _bits(params)
        params, opt_state, scaler, loss = train_step(params, opt_state, scaler, x, y)
        scales.append(scale_of(scaler))
        losses.append(float(loss))
        changed.append(_bits(params) != before)
    return scales, losses, changed


# Each case: trainer, scaler factory, its minimum, and the burst length. The
# jaxamp scaler halves up to 11 times a step (`redo_on_nan=10`), so 30 poisoned
# steps take an unbounded 2**15 to 0.0 (within 15 steps); the others halve once a
# step, so their burst is long enough to take an unbounded 2**16 there too
# (2**16 * 2**-166 == 0).
BURSTS = {
    "DynamicScalerState": (_jaxamp_trainer, lambda: jaxamp.DynamicScalerState(), 1.0, 30),
    "DynamicScalerState-custom-min": (
        _jaxamp_trainer,
        lambda: jaxamp.DynamicScalerState(scaler=2.0**4, min_scaler=2.0**-6),
        2.0**-6,
        30,
    ),
    "GradScaler": (_grad_scaler_trainer, lambda: jaxamp.GradScaler(), 1.0, 200),
    "DynamicLossScale": (_jmp_trainer, lambda: jaxamp.DynamicLossScale(jnp.float32(2**15)), 1.0, 200),
}


@pytest.mark.parametrize("name", sorted(BURSTS))
def test_nan_burst_then_clean_data(name):
    trainer, make_scaler, min_scale, burst = BURSTS[name]
    _, x, y, _ = _problem()
    poisoned = x.at[0].set(jnp.nan)  # one corrupt sample poisons the mean loss
    batches = [(poisoned, y)] * burst + [(x, y)] * CLEAN_STEPS
    scales, losses, changed = _train(trainer, AMP_LOSS, make_scaler(), batches)

    assert all(math.isfinite(s) and s >= min_scale > 0 for s in scales), scales
    assert scales[burst - 1] == min_scale  # the burst did push it all the way down
    assert all(math.isnan(loss) for loss in losses[:burst])
    assert not any(changed[:burst])  # every poisoned update was skipped
    # The first clean step trains again, and so does every one after it.
    assert all(math.isfinite(loss) for loss in losses[burst:]), losses[burst:]
    assert all(changed[burst:])


def _tiny_loss(params, x, y):
    # Scaled by up to 2**127 and still finite in float32, gradients included.
    del x, y
    return 1e-30 * sum(jnp.sum(leaf**2) for leaf in jax.tree_util.tree_leaves(params))


GROWTHS = {
    "DynamicScalerState": (_jaxamp_trainer, lambda: jaxamp.DynamicScalerState(scaler=2.0**20, patience=0), 2.0**24),
    "DynamicScalerState-max-f32": (
        _jaxamp_trainer,
        lambda: jaxamp.DynamicScalerState(scaler=2.0**120, patience=1, max_scaler=F32_MAX),
        2.0**127,
    ),
    "GradScaler": (
        _grad_scaler_trainer,
        lambda: jaxamp.GradScaler(init_scale=2.0**20, growth_interval=1),
        2.0**24,
    ),
    "GradScaler-max-f32": (
        _grad_scaler_trainer,
        lambda: jaxamp.GradScaler(init_scale=2.0**120, growth_interval=2, max_scale=F32_MAX),
        2.0**127,
    ),
    "DynamicLossScale": (_jmp_trainer, lambda: jaxamp.DynamicLossScale(jnp.float32(2.0**120), period=1), 2.0**127),
}


@pytest.mark.parametrize("name", sorted(GROWTHS))
def test_growth_stops_at_the_maximum_and_never_reaches_inf(name):
    trainer, make_scaler, top = GROWTHS[name]
    _, x, y, _ = _problem()
    scales, losses, _ = _train(trainer, _tiny_loss, make_scaler(), [(x, y)] * 20)
    assert all(math.isfinite(s) and s <= top for s in scales), scales
    assert scales == sorted(scales) and scales[-1] == top
    assert all(math.isfinite(loss) for loss in losses)


# --- The shared update rule against a pure-Python model -------------------------


def _model_step(scale, counter, finite, rule):
    """One step of the rule `next_scale` implements, in numpy float32 scalars."""
    f32 = np.float32
    if not finite:
        kind, backoff = rule["backoff"]
        shrunk = f32(scale) * f32(backoff) if kind == "factor" else f32(scale) / f32(backoff)
        return max(f32(rule["min"]), shrunk), 0
    if counter < rule["patience"]:
        return f32(scale), counter + 1
    with np.errstate(over="ignore"):
        grown = f32(scale) * f32(rule["growth"])
    if not np.isfinite(grown):
        grown = f32(scale)
    return min(grown, f32(rule["max"])), 0


@st.composite
def _rules(draw):
    low = draw(st.floats(2.0**-100, 2.0**100, width=32))
    high = draw(
        st.one_of(
            st.floats(low, low * 64, width=32),  # tight: clamping at both ends
            st.floats(low, F32_MAX, width=32),
            st.just(F32_MAX),  # only the overflow check stops growth
        )
    )
    backoff = draw(
        st.one_of(
            st.tuples(st.just("factor"), st.floats(2.0**-4, 1.0, width=32, exclude_max=True)),
            st.tuples(st.just("divisor"), st.floats(1.0, 16.0, width=32)),
        )
    )
    return {
        "min": low,
        "max": high,
        "patience": draw(st.integers(0, 3)),
        "growth": draw(st.floats(1.0, 16.0, width=32)),
        "backoff": backoff,
        "scale": draw(st.floats(low, high, width=32)),
        "counter": draw(st.integers(0, 5)),
    }


def _jitted_next_scale(kind):
    @jax.jit
    def step(scale, counter, finite, patience, growth, backoff, low, high):
        return next_scale(
            scale,
            counter,
            finite,
            patience=patience,
            growth_factor=growth,
            min_scale=low,
            max_scale=high,
            **{f"backoff_{kind}": backoff},
        )

    return step


NEXT_SCALE = {kind: _jitted_next_scale(kind) for kind in ("factor", "divisor")}


_EDGE = {"min": 1.0, "max": F32_MAX, "patience": 0, "growth": 2.0, "counter": 0}


@settings(max_examples=150, deadline=None)
@given(rule=_rules(), steps=st.lists(st.booleans(), min_size=1, max_size=40))
@example(  # growth into inf is refused
    rule={**_EDGE, "backoff": ("divisor", 2.0), "scale": 2.0**126}, steps=[True] * 3
)
@example(  # a long burst ends at the minimum, and growth resumes from there
    rule={**_EDGE, "backoff": ("factor", 0.5), "scale": 2.0**16}, steps=[False] * 200 + [True]
)
def test_next_scale_matches_a_pure_python_model(rule, steps):
    kind, backoff = rule["backoff"]
    f32 = np.float32
    hyper = (np.int32(rule["patience"]), f32(rule["growth"]), f32(backoff))
    bounds = (f32(rule["min"]), f32(rule["max"]))
    scale, counter = f32(rule["scale"]), np.int32(rule["counter"])
    expected = (scale, rule["counter"])
    for finite in steps:
        scale, counter = NEXT_SCALE[kind](scale, counter, np.bool_(finite), *hyper, *bounds)
        expected = _model_step(*expected, finite, rule)
        assert scale.dtype == jnp.float32 and counter.dtype == jnp.int32
        assert (float(scale), int(counter)) == (float(expected[0]), expected[1])
        assert math.isfinite(float(scale)) and rule["min"] <= float(scale) <= rule["max"]


# The three APIs on one sequence: each maps its own fields onto the shared rule
# (patience = period - 1 = growth_interval - 1), so all three follow the model.
SHARED = {"patience": 2, "growth": 2.0, "backoff": ("divisor", 2.0), "min": 1.0, "max": 2.0**6}


def _tiny_flagged(w, bad):
    return jnp.where(bad, jnp.nan, 1.0) * jnp.sum(w**2)


@jax.jit
def _jaxamp_update(state, bad):
    state, _ = jaxamp.dynamic_scale_grad(_tiny_flagged, filter=False)(jnp.ones(2), bad, dynamic_scaler_state=state)
    return state


@jax.jit
def _grad_scaler_update(scaler, bad):
    params = jnp.ones(2)
    grads = jax.grad(lambda w: scaler.scale(_tiny_flagged(w, bad)))(params)
    _, _, scaler = scaler.step(optax.identity(), grads, optax.EmptyState(), params)
    return scaler.update()


@jax.jit
def _jmp_update(loss_scale, bad):
    return loss_scale.adjust(~bad)


@settings(max_examples=30, deadline=None)
@given(steps=st.lists(st.booleans(), min_size=1, max_size=30))
@example(steps=[True] * 30)  # up to the maximum and held there
@example(steps=[False] * 6 + [True] * 4)  # down to the minimum and back up
def test_the_three_scalers_follow_the_same_rule(steps):
    jaxamp_state = jaxamp.DynamicScalerState(patience=2, scaler=8.0, min_scaler=SHARED["min"], max_scaler=SHARED["max"])
    grad_scaler = jaxamp.GradScaler(init_scale=8.0, growth_interval=3, min_scale=SHARED["min"], max_scale=SHARED["max"])
    jmp_scale = jaxamp.DynamicLossScale(jnp.float32(8.0), period=3, factor=2)
    bounded = unbounded = (np.float32(8.0), 0)
    for finite in steps:
        bad = jnp.bool_(not finite)
        jaxamp_state = _jaxamp_update(jaxamp_state, bad)
        grad_scaler = _grad_scaler_update(grad_scaler, bad)
        jmp_scale = _jmp_update(jmp_scale, bad)
        bounded = _model_step(*bounded, finite, SHARED)
        unbounded = _model_step(*unbounded, finite, {**SHARED, "max": F32_MAX})
        assert (float(jaxamp_state.scaler), int(jaxamp_state.count)) == bounded
        state_dict = grad_scaler.state_dict()
        assert (state_dict["scale"], state_dict["_growth_tracker"]) == bounded
        # jmp has no upper bound: only float32's range stops it.
        assert (float(jmp_scale.loss_scale), int(jmp_scale.counter)) == unbounded
