"""Each loss-scale mapping docs/porting.md gives runs here against the original rule.

The table "Loss-scale settings from other libraries" in docs/porting.md maps
flax's ``DynamicScale``, jmp's ``DynamicLossScale``, PyTorch's ``GradScaler``
and Keras' ``LossScaleOptimizer`` onto ``jaxamp.loss_scaling`` and
``jaxamp.GradScaler``. The ``*_to_*`` functions below are that table, and
each test drives the original (flax's own class; for the others a line-by-line
re-implementation of their update, citing its source) and jaxamp's scaler
through the same sequence of finite and non-finite steps and asserts the same
float32 scale after every step. Where the docs say a mapping is exact only
within bounds (PyTorch and Keras 3 have no floor), the trajectories are
compared up to the first step at which the original leaves them, where jaxamp
must sit at the bound. The corners the docs call inexact are pinned too.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxamp

FMAX = float(np.finfo(np.float32).max)
TINY = float(np.finfo(np.float32).tiny)

STEPS = st.lists(st.booleans(), min_size=1, max_size=20)  # True: a finite step
SCALES = st.sampled_from([1.0, 8.0, 2.0**20, 2.0**127])

# --- the documented mappings (docs/porting.md) -------------------------------


def flax_to_loss_scaling(growth_factor, backoff_factor, growth_interval, scale, minimum_scale):
    # Exact only for backoff_factor == 1 / growth_factor, growth_factor a power of two.
    assert backoff_factor == 1 / growth_factor
    return dict(
        scaler=scale, patience=growth_interval, adjust_factor=growth_factor, min_scaler=minimum_scale, max_scaler=FMAX
    )


def flax_to_grad_scaler(growth_factor, backoff_factor, growth_interval, scale, minimum_scale):
    return dict(
        init_scale=scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval + 1,
        min_scale=minimum_scale,
        max_scale=FMAX,
    )


def jmp_to_loss_scaling(loss_scale, period, factor, min_loss_scale):
    return dict(
        scaler=loss_scale, patience=period - 1, adjust_factor=factor, min_scaler=min_loss_scale, max_scaler=FMAX
    )


def torch_to_grad_scaler(init_scale, growth_factor, backoff_factor, growth_interval, floor):
    return dict(
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        min_scale=floor,
        max_scale=FMAX,
    )


def torch_to_loss_scaling(init_scale, growth_factor, backoff_factor, growth_interval, floor):
    assert backoff_factor == 1 / growth_factor
    return dict(
        scaler=init_scale, patience=growth_interval - 1, adjust_factor=growth_factor, min_scaler=floor, max_scaler=FMAX
    )


def keras_to_loss_scaling(initial_scale, dynamic_growth_steps, floor):
    return dict(scaler=initial_scale, patience=dynamic_growth_steps - 1, min_scaler=floor, max_scaler=FMAX)


# --- the originals ------------------------------------------------------------


def flax_scales(steps, **settings):
    """flax's own `DynamicScale` (flax/training/dynamic_scale.py), driven by a
    gradient that is 1 or inf."""
    from flax.training.dynamic_scale import DynamicScale

    state, scales = DynamicScale(**settings), []
    for finite in steps:
        state = _flax_step(state, jnp.float32(1.0 if finite else np.inf))
        scales.append(np.float32(state.scale))
    return scales


@jax.jit
def _flax_step(state, x):
    return state.value_and_grad(lambda p, x: p * x)(jnp.float32(1.0), x).dynamic_scale


def jmp_scales(steps, loss_scale, period, factor, min_loss_scale):
    """jmp's `DynamicLossScale.adjust` (google-deepmind/jmp, jmp/_src/loss_scale.py,
    lines 130-151 at b3b588d), in float32 as jmp computes it."""
    scale, counter, scales = np.float32(loss_scale), 0, []
    for finite in steps:
        if finite:
            if counter == period - 1:
                with np.errstate(over="ignore"):
                    grown = scale * np.float32(factor)
                scale = grown if np.isfinite(grown) else scale  # first_finite
        else:
            scale = max(np.float32(min_loss_scale), scale / np.float32(factor))
        counter = ((counter + 1) % period) * finite
        scales.append(scale)
    return scales


def torch_scales(steps, init_scale, growth_factor, backoff_factor, growth_interval):
    """PyTorch's `_amp_update_scale_` (aten/src/ATen/native/cpu/AmpGradScalerKernels.cpp,
    `_amp_update_scale_cpu_kernel`; the same in native/cuda/AmpKernels.cu,
    `amp_update_scale_cuda_kernel`): the float32 scale times a C++ double
    factor, rounded back to float32; no floor, growth to inf refused."""
    scale, tracker, scales = np.float32(init_scale), 0, []
    for finite in steps:
        with np.errstate(over="ignore"):
            if not finite:
                scale, tracker = np.float32(np.float64(scale) * backoff_factor), 0
            else:
                successful = tracker + 1
                if successful == growth_interval:
                    grown = np.float32(np.float64(scale) * growth_factor)
                    scale, tracker = (grown if np.isfinite(grown) else scale), 0
                else:
                    tracker = successful
        scales.append(scale)
    return scales


def keras3_scales(steps, initial_scale, dynamic_growth_steps):
    """Keras 3's `LossScaleOptimizer` (keras/src/optimizers/loss_scale_optimizer.py,
    `_stateful_handle_finite_grads` / `_stateful_handle_non_finite_grads`): a
    float32 variable doubled or halved, with no floor and no overflow check."""
    scale, counter, scales = np.float32(initial_scale), 0, []
    for finite in steps:
        with np.errstate(over="ignore"):
            if finite and counter == dynamic_growth_steps - 1:
                scale, counter = scale * np.float32(2.0), 0
            elif finite:
                counter += 1
            else:
                scale, counter = scale / np.float32(2.0), 0
        scales.append(scale)
    return scales


def tf_keras2_scales(steps, initial_scale, dynamic_growth_steps):
    """tf.keras 2's `_DynamicLossScaleState.update` (keras/mixed_precision/
    loss_scale_optimizer.py, also tensorflow/python/keras/mixed_precision/):
    grows when ``counter + 1 >= growth_steps`` unless that overflows, shrinks
    to ``max(scale / 2, 1)``."""
    scale, counter, scales = np.float32(initial_scale), 0, []
    for finite in steps:
        with np.errstate(over="ignore"):
            if finite and counter + 1 >= dynamic_growth_steps:
                grown = scale * np.float32(2.0)
                scale, counter = (grown if np.isfinite(grown) else scale), 0
            elif finite:
                counter += 1
            else:
                scale, counter = max(scale / np.float32(2.0), np.float32(1.0)), 0
        scales.append(scale)
    return scales


# --- jaxamp's scalers ------------------------------------------------------------

_GRADS = {True: {"w": jnp.zeros(())}, False: {"w": jnp.array(jnp.inf)}}


def loss_scaling_scales(steps, **kwargs):
    optimizer = jaxamp.loss_scaling(optax.sgd(0.0), **kwargs)
    state, scales = optimizer.init({"w": jnp.zeros(())}), []
    for finite in steps:
        _, state = optimizer.update(_GRADS[finite], state)
        scales.append(np.float32(state.scale))
    return scales


def grad_scaler_scales(steps, **kwargs):
    scaler, scales = jaxamp.GradScaler(**kwargs), []
    for finite in steps:
        _, scaler = scaler.unscale(_GRADS[finite])
        scaler = scaler.update()
        scales.append(np.float32(scaler._scale))
    return scales


def assert_same(original, ours, low=0.0):
    """The same scale after every step, up to the first step at which the original
    leaves ``[low, FMAX]``: there jaxamp's scale stops at `low`, or stays finite."""
    for step, (theirs, mine) in enumerate(zip(original, ours, strict=True)):
        if theirs < low:
            assert mine == np.float32(low), (step, original, ours)
            return
        if not theirs <= FMAX:
            assert np.isfinite(mine), (step, original, ours)
            return
        assert theirs.tobytes() == mine.tobytes(), (step, original, ours)


# --- the tests ---------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    steps=STEPS,
    growth_interval=st.integers(0, 3),
    factors=st.sampled_from([(2.0, 0.5), (4.0, 0.25)]),
    scale=st.sampled_from([1.0, 8.0, 2.0**20]),
    minimum_scale=st.sampled_from([TINY, 1.0, 4.0]),
)
def test_flax_dynamic_scale_as_loss_scaling(steps, growth_interval, factors, scale, minimum_scale):
    flax = dict(
        growth_factor=factors[0],
        backoff_factor=factors[1],
        growth_interval=growth_interval,
        scale=scale,
        minimum_scale=minimum_scale,
    )
    if scale < minimum_scale:
        return
    assert_same(flax_scales(steps, **flax), loss_scaling_scales(steps, **flax_to_loss_scaling(**flax)))


@settings(max_examples=30, deadline=None)
@given(
    steps=STEPS,
    growth_interval=st.integers(0, 3),
    factors=st.sampled_from([(2.0, 0.5), (1.1, 0.3), (3.0, 0.75)]),
    scale=st.sampled_from([1.0, 8.0, 2.0**20]),
    minimum_scale=st.sampled_from([TINY, 1.0]),
)
def test_flax_dynamic_scale_as_grad_scaler(steps, growth_interval, factors, scale, minimum_scale):
    # flax multiplies its float32 scale by float32 factors, as jaxamp's GradScaler
    # does: exact for factors that are not float32 values too.
    flax = dict(
        growth_factor=factors[0],
        backoff_factor=factors[1],
        growth_interval=growth_interval,
        scale=scale,
        minimum_scale=minimum_scale,
    )
    assert_same(flax_scales(steps, **flax), grad_scaler_scales(steps, **flax_to_grad_scaler(**flax)))


def test_flax_grows_on_the_growth_interval_plus_first_finite_step():
    # The mapping the docs gave before, patience=growth_interval - 1, grew one step early.
    steps = [True] * 4
    flax = flax_scales(steps, growth_interval=3, scale=8.0)
    assert flax == [8.0, 8.0, 8.0, 16.0]
    assert loss_scaling_scales(steps, scaler=8.0, patience=3 - 1) == [8.0, 8.0, 16.0, 16.0]


def test_flax_growth_past_float32_is_where_the_mappings_part():
    # The one documented inexact corner: flax caps an overflowing growth at the
    # float32 maximum, jaxamp refuses it (keeps the scale), as jmp and torch do.
    flax = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=0, scale=2.0**127, minimum_scale=1.0)
    assert flax_scales([True], **flax) == [np.float32(FMAX)]
    assert loss_scaling_scales([True], **flax_to_loss_scaling(**flax)) == [np.float32(2.0**127)]
    assert grad_scaler_scales([True], **flax_to_grad_scaler(**flax)) == [np.float32(2.0**127)]


@settings(max_examples=30, deadline=None)
@given(
    steps=STEPS,
    period=st.integers(1, 4),
    factor=st.sampled_from([2, 2.0, 3.0, 1.1]),
    loss_scale=SCALES,
    min_loss_scale=st.sampled_from([1.0, TINY, 4.0]),
)
def test_jmp_dynamic_loss_scale(steps, period, factor, loss_scale, min_loss_scale):
    if loss_scale < min_loss_scale:
        return
    jmp = dict(loss_scale=loss_scale, period=period, factor=factor, min_loss_scale=min_loss_scale)
    original = jmp_scales(steps, **jmp)
    assert_same(original, loss_scaling_scales(steps, **jmp_to_loss_scaling(**jmp)))
    # jaxamp's jmp-compatible class, with jmp's own arguments.
    ours = jaxamp.DynamicLossScale(jnp.float32(loss_scale), period=period, factor=factor, min_loss_scale=min_loss_scale)
    scales = []
    for finite in steps:
        ours = ours.adjust(jnp.array(finite))
        scales.append(np.float32(ours.loss_scale))
    assert_same(original, scales)


def test_the_jmp_reimplementation_is_jmp():
    jmp = pytest.importorskip("jmp")
    steps = [True, True, False, True, True, True, True, False, False, True, True, True]
    for period, factor, min_loss_scale in [(1, 2, 1.0), (3, 2, 4.0), (2, 3.0, 0.5)]:
        scale = jmp.DynamicLossScale(jnp.float32(8.0), period=period, factor=factor, min_loss_scale=min_loss_scale)
        scales = []
        for finite in steps:
            scale = scale.adjust(jnp.array(finite))  # eager: jmp keeps min_loss_scale
            scales.append(np.float32(scale.loss_scale))
        assert scales == jmp_scales(steps, 8.0, period, factor, min_loss_scale)


@settings(max_examples=30, deadline=None)
@given(
    steps=STEPS,
    growth_interval=st.integers(1, 4),
    factors=st.sampled_from([(2.0, 0.5), (1.5, 0.75), (4.0, 0.125)]),
    init_scale=SCALES,
    floor=st.sampled_from([1.0, TINY]),
)
def test_torch_grad_scaler(steps, growth_interval, factors, init_scale, floor):
    torch = dict(
        init_scale=init_scale, growth_factor=factors[0], backoff_factor=factors[1], growth_interval=growth_interval
    )
    original = torch_scales(steps, **torch)
    assert_same(original, grad_scaler_scales(steps, **torch_to_grad_scaler(**torch, floor=floor)), low=floor)
    if factors[1] == 1 / factors[0] and factors[0] in (2.0, 4.0):
        assert_same(original, loss_scaling_scales(steps, **torch_to_loss_scaling(**torch, floor=floor)), low=floor)


def test_torch_factors_that_are_not_float32_values_round_differently():
    # torch multiplies by the factor as a C++ double; jaxamp by its float32
    # rounding. The docs call the mapping exact only for float32 factors.
    torch = dict(init_scale=8.0, growth_factor=1.001, backoff_factor=0.5, growth_interval=1)
    steps = [True] * 3
    original = torch_scales(steps, **torch)
    ours = grad_scaler_scales(steps, **torch_to_grad_scaler(**torch, floor=1.0))
    assert original[:2] == ours[:2]
    assert original[2] == np.float32(8.024024) and ours[2] == np.nextafter(original[2], np.float32(np.inf))


@settings(max_examples=30, deadline=None)
@given(
    steps=STEPS,
    dynamic_growth_steps=st.integers(1, 4),
    initial_scale=SCALES,
    floor=st.sampled_from([1.0, TINY]),
)
def test_keras_loss_scale_optimizer(steps, dynamic_growth_steps, initial_scale, floor):
    keras = dict(initial_scale=initial_scale, dynamic_growth_steps=dynamic_growth_steps)
    ours = loss_scaling_scales(steps, **keras_to_loss_scaling(**keras, floor=floor))
    assert_same(keras3_scales(steps, **keras), ours, low=floor)
    if floor == 1.0:
        assert_same(tf_keras2_scales(steps, **keras), ours)
