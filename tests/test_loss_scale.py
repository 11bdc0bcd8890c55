"""jmp-style loss scales beyond jmp's own tests (those are in test_jmp_loss_scale.py)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp


def _sequence(seed, n=60, p_bad=0.15):
    return np.random.default_rng(seed).random(n) >= p_bad


def _jmp_reference(scale, counter, finite, period, factor, min_loss_scale):
    """jmp's DynamicLossScale.adjust, transcribed in plain numpy (float32)."""
    if finite:
        grown = np.float32(scale * factor)
        new_scale = grown if counter == period - 1 and np.isfinite(grown) else scale
        return np.float32(new_scale), (counter + 1) % period
    return np.float32(max(min_loss_scale, scale / factor)), 0


@pytest.mark.parametrize("period, factor, min_loss_scale", [(3, 2, 1.0), (5, 3, 0.25), (2, 2.0, 0.0)])
def test_dynamic_loss_scale_matches_jmp_semantics(period, factor, min_loss_scale):
    kwargs = dict(period=period, factor=factor, min_loss_scale=jnp.float32(min_loss_scale))
    ours = jaxamp.DynamicLossScale(jnp.float32(2**4), jnp.int32(0), **kwargs)
    scale, counter = np.float32(2**4), 0
    tree = {"g": jnp.array([1.0, -3.0], jnp.float16)}
    for finite in _sequence(period):
        ours = ours.adjust(jnp.bool_(finite))
        scale, counter = _jmp_reference(scale, counter, finite, period, factor, min_loss_scale)
        assert float(ours.loss_scale) == float(scale)
        assert int(ours.counter) == counter
        # jmp multiplies by the float32 scale (or its inverse): float16 leaves promote.
        np.testing.assert_array_equal(ours.scale(tree)["g"], tree["g"] * jnp.float32(scale))
        np.testing.assert_array_equal(ours.unscale(tree)["g"], tree["g"] * (1 / jnp.float32(scale)))


def test_dynamic_loss_scale_counter_and_scale_sequence():
    scale = jaxamp.DynamicLossScale(jnp.float32(8), period=2, factor=2)
    seen = []
    for finite in [True, True, True, False, True, True]:
        scale = scale.adjust(jnp.bool_(finite))
        seen.append((float(scale.loss_scale), int(scale.counter)))
    assert seen == [(8, 1), (16, 0), (16, 1), (8, 0), (8, 1), (16, 0)]


def test_dynamic_loss_scale_does_not_grow_into_inf():
    big = jnp.float32(np.finfo(np.float32).max / 2 * 1.5)
    scale = jaxamp.DynamicLossScale(big, period=1).adjust(jnp.bool_(True))
    assert float(scale.loss_scale) == float(big)


def test_dynamic_loss_scale_bounds_apply_only_when_the_scale_moves():
    # As in jmp: a scale below min_loss_scale is kept while steps are finite,
    # and a non-finite step lifts it to the minimum.
    scale = jaxamp.DynamicLossScale(jnp.float32(0.5), period=3)
    scale = scale.adjust(jnp.bool_(True))
    assert (float(scale.loss_scale), int(scale.counter)) == (0.5, 1)
    scale = scale.adjust(jnp.bool_(False))
    assert (float(scale.loss_scale), int(scale.counter)) == (1.0, 0)


def test_dynamic_loss_scale_counter_keeps_its_dtype():
    # jmp's `counter % period * finite` made a float32 counter out of a float
    # period; an int32 counter can be carried through `lax.scan` unchanged.
    scale = jaxamp.DynamicLossScale(jnp.float32(4), period=2.0)
    for finite, expected in [(True, 1), (True, 0), (False, 0), (True, 1)]:
        scale = scale.adjust(jnp.bool_(finite))
        assert scale.counter.dtype == jnp.int32 and int(scale.counter) == expected
    assert float(scale.loss_scale) == 4.0


def test_dynamic_loss_scale_adjust_rejects_a_non_boolean_flag():
    with pytest.raises(TypeError, match="boolean scalar.*float32"):
        jaxamp.DynamicLossScale(jnp.float32(2)).adjust(jnp.float32(1.0))


def test_dynamic_loss_scale_adjust_requires_a_scalar():
    with pytest.raises(AssertionError, match="Expected boolean scalar"):
        jaxamp.DynamicLossScale(jnp.float32(2)).adjust(jnp.array([True]))


def test_dynamic_loss_scale_through_jit_keeps_custom_min_loss_scale():
    # jmp resets min_loss_scale to 1 here; we keep it.
    scale = jaxamp.DynamicLossScale(jnp.float32(1), min_loss_scale=jnp.float32(2.0**-3))
    step = jax.jit(lambda s: s.adjust(jnp.bool_(False)))
    for expected in [0.5, 0.25, 0.125, 0.125]:
        scale = step(scale)
        assert float(scale.loss_scale) == expected
    assert scale.min_loss_scale.dtype == np.float32 and float(scale.min_loss_scale) == 0.125


def test_dynamic_loss_scale_jit_matches_eager():
    eager = jit_scale = jaxamp.DynamicLossScale(jnp.float32(4), period=3)
    step = jax.jit(lambda s, f: s.adjust(f))
    for finite in _sequence(7, n=20, p_bad=0.3):
        eager = eager.adjust(jnp.bool_(finite))
        jit_scale = step(jit_scale, jnp.bool_(finite))
        assert float(eager.loss_scale) == float(jit_scale.loss_scale)
        assert int(eager.counter) == int(jit_scale.counter)


def test_rebuilding_from_leaves_does_not_warn():
    scale = jaxamp.DynamicLossScale(jnp.float32(4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flags = jax.tree_util.tree_map(lambda _: True, scale)
    assert flags.loss_scale is True and flags.counter is True


def test_warn_if_not_floating():
    with pytest.warns(UserWarning, match="Expected floating type for x, got int32"):
        jaxamp.scaling.warn_if_not_floating(jnp.int32(1), "x")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxamp.scaling.warn_if_not_floating(jnp.float16(1), "x")
        jaxamp.scaling.warn_if_not_floating(2.0, "x")
        jaxamp.scaling.warn_if_not_floating(object(), "x")


def test_static_and_noop_scales_are_static_pytree_data():
    scale = jaxamp.StaticLossScale(128.0)
    assert jax.tree_util.tree_leaves(scale) == []
    out = jax.jit(lambda s, g: s.unscale(s.scale(g)), static_argnums=0)(scale, jnp.ones(2))
    np.testing.assert_array_equal(out, jnp.ones(2))
    assert scale.adjust(jnp.bool_(False)) is scale
    noop = jaxamp.NoOpLossScale()
    assert noop.loss_scale == 1 and noop.adjust(jnp.bool_(False)) is noop


def test_scaling_a_float16_loss_can_overflow():
    loss = jnp.float16(8.0)
    assert bool(jnp.isfinite(jaxamp.StaticLossScale(jnp.float16(2**12)).scale(loss)))
    assert not bool(jnp.isfinite(jaxamp.StaticLossScale(jnp.float16(2**14)).scale(loss)))


def test_register_empty_pytree():
    class Marker:
        pass

    jaxamp.scaling.register_empty_pytree(Marker)
    marker = Marker()
    leaves, treedef = jax.tree_util.tree_flatten(marker)
    assert leaves == [] and jax.tree_util.tree_unflatten(treedef, []) is marker


def test_loss_scale_union_covers_the_three_classes():
    assert set(jaxamp.LossScale.__args__) == {
        jaxamp.NoOpLossScale,
        jaxamp.StaticLossScale,
        jaxamp.DynamicLossScale,
    }
