"""jaxamp's DynamicScalerState and dynamic_scale_grad / dynamic_scale_value_and_grad."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp import DynamicScalerState, dynamic_scale_grad, dynamic_scale_value_and_grad

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals


@pytest.mark.newest_only
def test_dynamic_scaler():
    """The original jaxamp package's test, unchanged but for formatting."""

    def func(x):
        return x**3

    def aux_func(x):
        return x**3, 1.0

    for aux in [True, False]:
        for filter in [True, False]:
            f = aux_func if aux else func
            scaler_state = DynamicScalerState(scaler=2**15, patience=10)
            x = jnp.array(2.0, dtype=jnp.float16)
            value_and_grad_fn = jax.jit(dynamic_scale_value_and_grad(f, filter=filter, has_aux=aux, redo_on_nan=100))
            scaler_state, (value, grad) = value_and_grad_fn(x, dynamic_scaler_state=scaler_state)
            if aux:
                value, aux_v = value
                assert aux_v == 1.0
            assert scaler_state.scaler == 2**12 and scaler_state.count == 1
            assert grad == 12.0 and value == 8.0
            for _ in range(8):
                scaler_state, _ = value_and_grad_fn(x, dynamic_scaler_state=scaler_state)
            assert scaler_state.scaler == 2**12 and scaler_state.count == 9
            scaler_state, _ = value_and_grad_fn(x, dynamic_scaler_state=scaler_state)
            assert scaler_state.count == 10
            scaler_state, _ = value_and_grad_fn(x, dynamic_scaler_state=scaler_state)
            assert scaler_state.scaler == 2**13 and scaler_state.count == 0
            scaler_state, _ = value_and_grad_fn(x, dynamic_scaler_state=scaler_state)
            assert scaler_state.scaler == 2**12 and scaler_state.count == 1


@pytest.mark.parametrize("filter", [True, False])
@pytest.mark.newest_only
def test_without_redo_each_overflow_costs_one_step(filter):
    state = DynamicScalerState(scaler=2**15, patience=10)
    fn = jax.jit(dynamic_scale_value_and_grad(lambda x: x**3, filter=filter, redo_on_nan=0))
    x = jnp.array(2.0, dtype=jnp.float16)
    seen = []
    for _ in range(4):
        state, (value, grad) = fn(x, dynamic_scaler_state=state)
        seen.append((float(state.scaler), int(state.count), int(state.total_resets)))
    assert seen == [(2**14, 0, 1), (2**13, 0, 2), (2**12, 0, 3), (2**12, 1, 3)]
    assert float(value) == 8.0 and float(grad) == 12.0


def _flagged(x, bad):
    """x**2, or NaN where `bad` (a traced flag, to inject failures)."""
    return jnp.where(bad, jnp.nan, 1.0) * jnp.sum(x**2)


@pytest.fixture(scope="module")
def flagged_grad():
    return jax.jit(dynamic_scale_grad(_flagged, filter=False))


def _step(fn, state, bad):
    state, grads = fn(jnp.array([1.0, 2.0]), jnp.bool_(bad), dynamic_scaler_state=state)
    return state, grads


@pytest.mark.newest_only
def test_finite_step_below_patience_counts_up(flagged_grad):
    state, grads = _step(flagged_grad, DynamicScalerState(patience=3, scaler=8.0, count=1), False)
    assert (float(state.scaler), int(state.count), int(state.total_resets)) == (8.0, 2, 0)
    np.testing.assert_array_equal(grads, [2.0, 4.0])


@pytest.mark.newest_only
def test_finite_step_at_patience_grows_and_restarts(flagged_grad):
    state, _ = _step(flagged_grad, DynamicScalerState(patience=3, scaler=8.0, count=3), False)
    assert (float(state.scaler), int(state.count), int(state.total_resets)) == (16.0, 0, 0)


@pytest.mark.newest_only
def test_count_above_patience_also_grows(flagged_grad):
    state, _ = _step(flagged_grad, DynamicScalerState(patience=3, scaler=8.0, count=7), False)
    assert (float(state.scaler), int(state.count)) == (16.0, 0)


@pytest.mark.newest_only
def test_non_finite_step_shrinks_resets_and_counts(flagged_grad):
    start = DynamicScalerState(patience=3, adjust_factor=4.0, scaler=8.0, count=2, total_resets=5)
    state, grads = _step(flagged_grad, start, True)
    assert (float(state.scaler), int(state.count), int(state.total_resets)) == (2.0, 0, 6)
    assert not bool(jaxamp.all_finite(grads))
    assert int(state.patience) == 3 and float(state.adjust_factor) == 4.0


@pytest.mark.newest_only
def test_full_growth_cycle_with_patience_two(flagged_grad):
    state = DynamicScalerState(patience=2, scaler=1.0)
    seen = []
    for bad in [False, False, False, False, True, False]:
        state, _ = _step(flagged_grad, state, bad)
        seen.append((float(state.scaler), int(state.count)))
    assert seen == [(1, 1), (1, 2), (2, 0), (2, 1), (1, 0), (1, 1)]


@pytest.mark.newest_only
def test_shrinking_stops_at_min_scaler(flagged_grad):
    state = DynamicScalerState(scaler=4.0)
    seen = []
    for _ in range(5):
        state, _ = _step(flagged_grad, state, True)
        seen.append((float(state.scaler), int(state.total_resets)))
    # Unbounded, this went on 0.5, 0.25, ... and 2**-150 rounds to 0.0.
    assert seen == [(2.0, 1), (1.0, 2), (1.0, 3), (1.0, 4), (1.0, 5)]
    state, grads = _step(flagged_grad, state, False)
    assert (float(state.scaler), int(state.count)) == (1.0, 1)
    np.testing.assert_array_equal(grads, [2.0, 4.0])


@pytest.mark.newest_only
def test_custom_min_scaler_and_factor(flagged_grad):
    start = DynamicScalerState(scaler=1.0, adjust_factor=3.0, min_scaler=0.25)
    state, _ = _step(flagged_grad, start, True)
    assert float(state.scaler) == np.float32(1.0) / np.float32(3.0)
    state, _ = _step(flagged_grad, state, True)
    assert float(state.scaler) == 0.25 and float(state.min_scaler) == 0.25


@pytest.mark.newest_only
def test_growth_stops_at_max_scaler(flagged_grad):
    state = DynamicScalerState(scaler=2.0**22, patience=0)
    seen = []
    for _ in range(4):
        state, _ = _step(flagged_grad, state, False)
        seen.append((float(state.scaler), int(state.count)))
    assert seen == [(2.0**23, 0), (2.0**24, 0), (2.0**24, 0), (2.0**24, 0)]
    # A scale between max / adjust_factor and max is capped, not left behind.
    state, _ = _step(flagged_grad, DynamicScalerState(scaler=3 * 2.0**22, patience=0), False)
    assert float(state.scaler) == 2.0**24


def test_growth_that_would_overflow_is_refused():
    big = float(np.finfo(np.float32).max) * 0.75
    f32_max = float(np.finfo(np.float32).max)
    fn = jax.jit(dynamic_scale_grad(lambda x: x * 1e-30, redo_on_nan=3))
    state = DynamicScalerState(scaler=big, patience=0, max_scaler=f32_max)
    for _ in range(3):
        state, grad = fn(jnp.float32(1.0), dynamic_scaler_state=state)
        assert float(state.scaler) == np.float32(big) and int(state.count) == 0
        assert float(grad) == pytest.approx(1e-30)


def _finite_value_nan_grad(x):
    # The value is 1; the unselected branch's gradient is 0 * nan = nan. A
    # smaller scale never helps, but the value says a redo might.
    return jnp.where(x > 0, 1.0, x * jnp.nan)


@pytest.mark.newest_only
def test_redo_gives_up_at_min_scaler():
    fn = jax.jit(dynamic_scale_value_and_grad(_finite_value_nan_grad, redo_on_nan=10))
    state, (value, grad) = fn(jnp.float32(1.0), dynamic_scaler_state=DynamicScalerState(scaler=4.0))
    # Attempts at 4, 2 and 1; a fourth at 1 would fail the same way.
    assert float(state.scaler) == 1.0 and int(state.total_resets) == 3
    assert float(value) == 1.0 and np.isnan(grad)
    state, (value, grad) = fn(jnp.float32(1.0), dynamic_scaler_state=state)
    assert float(state.scaler) == 1.0 and int(state.total_resets) == 4
    assert np.isnan(grad)


@pytest.mark.newest_only
def test_redo_gives_up_after_redo_on_nan_retries():
    fn = jax.jit(dynamic_scale_value_and_grad(_finite_value_nan_grad, redo_on_nan=3))
    start = DynamicScalerState(scaler=2.0**10)
    state, (value, grad) = fn(jnp.float32(1.0), dynamic_scaler_state=start)
    # One attempt plus three retries, each halving the scale.
    assert float(state.scaler) == 2.0**6 and int(state.total_resets) == 4
    assert float(value) == 1.0 and np.isnan(grad)


@pytest.mark.parametrize("entry_point", [dynamic_scale_value_and_grad, dynamic_scale_grad])
@pytest.mark.newest_only
def test_a_nonfinite_value_is_not_redone(entry_point):
    # A NaN in the data: no scale fixes it, so the step is skipped with one
    # shrink, not eleven (2**15 -> 2**14, not -> 16).
    def loss(w, x):
        return jnp.mean((x @ w) ** 2)

    fn = jax.jit(entry_point(loss, redo_on_nan=10))
    x = jnp.ones((4, 3)).at[0, 0].set(jnp.nan)
    state, _ = fn(jnp.ones((3, 2)), x, dynamic_scaler_state=DynamicScalerState())
    assert float(state.scaler) == 2.0**14 and int(state.total_resets) == 1


@pytest.mark.newest_only
def test_a_half_precision_value_is_scaled_in_float32():
    # 60000 * 2 overflows float16; the value must not look like bad data.
    def loss(x):
        return (x.astype(jnp.float16) * 60000).sum()

    fn = jax.jit(dynamic_scale_value_and_grad(loss, redo_on_nan=10))
    state, (value, grad) = fn(jnp.ones(1), dynamic_scaler_state=DynamicScalerState(scaler=2.0))
    assert float(value) == 60000.0 and value.dtype == jnp.float32
    # The gradient 60000 * 2 in float16 overflows; one redo at scale 1 fixes it.
    assert float(state.scaler) == 1.0 and float(grad[0]) == 60000.0


@pytest.mark.newest_only
def test_redo_stops_at_the_first_finite_attempt():
    fn = jax.jit(dynamic_scale_grad(lambda x: x**3, redo_on_nan=50))
    state, grad = fn(jnp.float16(2.0), dynamic_scaler_state=DynamicScalerState(scaler=2.0**20))
    # 12 * scale must fit in float16 (max 65504): the first scale that does is 2**12.
    assert float(state.scaler) == 2.0**12 and int(state.total_resets) == 8
    assert float(grad) == 12.0


@pytest.mark.newest_only
def test_redo_works_without_jit():
    fn = dynamic_scale_grad(lambda x: x**3, redo_on_nan=5)
    state, grad = fn(jnp.float16(2.0), dynamic_scaler_state=DynamicScalerState(scaler=2.0**14))
    assert float(state.scaler) == 2.0**12 and float(grad) == 12.0


@pytest.mark.newest_only
def test_value_and_grads_come_back_unscaled_in_float32():
    fn = dynamic_scale_value_and_grad(lambda p: jnp.sum(p["w"] * p["b"]), redo_on_nan=0)
    params = {"w": jnp.full(3, 2.0, jnp.float16), "b": jnp.full(3, 0.5, jnp.bfloat16)}
    _, (value, grads) = fn(params, dynamic_scaler_state=DynamicScalerState(scaler=2.0**8))
    assert value.dtype == jnp.float32 and float(value) == 3.0
    assert grads["w"].dtype == jnp.float32 and grads["b"].dtype == jnp.float32
    np.testing.assert_array_equal(grads["w"], [0.5] * 3)
    np.testing.assert_array_equal(grads["b"], [2.0] * 3)


def test_nan_in_aux_does_not_touch_the_scale():
    def loss(x):
        return x**2, {"ratio": jnp.float32(0.0) / 0.0}

    fn = jax.jit(dynamic_scale_value_and_grad(loss, has_aux=True, redo_on_nan=5))
    start = DynamicScalerState(scaler=4.0)
    state, ((value, aux), grad) = fn(jnp.float32(3.0), dynamic_scaler_state=start)
    assert (float(state.scaler), int(state.count), int(state.total_resets)) == (4.0, 1, 0)
    assert float(value) == 9.0 and float(grad) == 6.0 and np.isnan(aux["ratio"])


@pytest.mark.newest_only
def test_redo_keeps_non_array_aux():
    def loss(x):
        return x**3, {"name": "cube", "n": 3, "ints": jnp.arange(2), "weak": jnp.asarray(1.0)}

    fn = dynamic_scale_value_and_grad(loss, has_aux=True, redo_on_nan=4)
    start = DynamicScalerState(scaler=2.0**14)
    state, ((value, aux), grad) = fn(jnp.float16(2.0), dynamic_scaler_state=start)
    assert float(state.scaler) == 2.0**12 and float(value) == 8.0 and float(grad) == 12.0
    assert aux["name"] == "cube" and aux["n"] == 3
    np.testing.assert_array_equal(aux["ints"], [0, 1])
    assert aux["ints"].dtype == jnp.int32 and float(aux["weak"]) == 1.0


def test_grad_with_aux_returns_grads_and_aux():
    fn = dynamic_scale_grad(lambda x: (3.0 * x, "label"), has_aux=True)
    state, (grad, aux) = fn(jnp.float32(1.0), dynamic_scaler_state=DynamicScalerState())
    assert float(grad) == 3.0 and aux == "label" and int(state.count) == 1


class _MLP(eqx.Module):
    weight: jax.Array
    bias: jax.Array
    activation: Callable
    depth: int

    def __call__(self, x):
        return self.activation(self.weight * x + self.bias)


class _StaticMLP(eqx.Module):
    weight: jax.Array
    bias: jax.Array
    activation: Callable = eqx.field(static=True)
    depth: int = eqx.field(static=True)

    __call__ = _MLP.__call__


def _mlp_loss(model, x):
    return jnp.sum(model(x) ** 2)


@pytest.mark.newest_only
def test_filter_true_differentiates_arrays_and_skips_other_fields():
    model = _MLP(jnp.array([1.0, 2.0]), jnp.array([0.5, -0.5]), jax.nn.relu, 2)
    fn = eqx.filter_jit(dynamic_scale_grad(_mlp_loss, filter=True))
    state, grads = fn(model, jnp.float32(1.0), dynamic_scaler_state=DynamicScalerState())
    expected = jax.grad(lambda w, b: jnp.sum(jax.nn.relu(w + b) ** 2), argnums=(0, 1))(model.weight, model.bias)
    np.testing.assert_allclose(grads.weight, expected[0])
    np.testing.assert_allclose(grads.bias, expected[1])
    assert grads.activation is None and grads.depth is None
    assert int(state.count) == 1


def test_filter_false_uses_jax_grad():
    model = _StaticMLP(jnp.array([1.0, 2.0]), jnp.array([0.5, -0.5]), jax.nn.relu, 2)
    fn = jax.jit(dynamic_scale_grad(_mlp_loss, filter=False))
    _, grads = fn(model, jnp.float32(1.0), dynamic_scaler_state=DynamicScalerState())
    np.testing.assert_allclose(grads.weight, [3.0, 3.0])
    assert grads.activation is jax.nn.relu
    # jax.grad refuses the non-array leaves that filter=True skips.
    loose = _MLP(model.weight, model.bias, jax.nn.relu, 2)
    with pytest.raises(TypeError):
        dynamic_scale_grad(_mlp_loss, filter=False)(loose, jnp.float32(1.0), dynamic_scaler_state=DynamicScalerState())


@pytest.mark.newest_only
def test_kwargs_are_forwarded_to_the_grad_transform():
    fn = dynamic_scale_grad(lambda a, b: a * b**2, filter=False, argnums=1)
    _, grad = fn(jnp.float32(3.0), jnp.float32(2.0), dynamic_scaler_state=DynamicScalerState())
    assert float(grad) == 12.0


@pytest.mark.newest_only
def test_dynamic_scale_tx_with_a_custom_transform():
    tx = jaxamp.scaling.dynamic_scale_tx(jax.grad)
    state, grad = tx(lambda x: x**2)(jnp.float32(3.0), dynamic_scaler_state=DynamicScalerState())
    assert float(grad) == 6.0 and int(state.count) == 1


@pytest.mark.newest_only
def test_state_normalises_python_numbers():
    state = DynamicScalerState(patience=10, adjust_factor=3, scaler=2**15, count=np.int64(2))
    dtypes = [leaf.dtype for leaf in state]
    assert dtypes == [jnp.int32, jnp.float32, jnp.float32, jnp.int32, jnp.int32] + [jnp.float32] * 2
    assert all(leaf.shape == () for leaf in state)
    assert float(state.scaler) == 2**15 and int(state.count) == 2
    default = DynamicScalerState()
    assert int(default.patience) == 2000 and float(default.adjust_factor) == 2.0
    assert float(default.scaler) == 2**15 and int(default.total_resets) == 0
    assert float(default.min_scaler) == 1.0 and float(default.max_scaler) == 2.0**24
    assert jaxamp.DynamicLossScaler is DynamicScalerState


@pytest.mark.newest_only
def test_seed_fields_keep_their_positions_and_defaults():
    # The original jaxamp's four fields, in order, positionally; bounds trail.
    state = DynamicScalerState(7, 4.0, 2.0**10, 3)
    assert state._fields[:4] == ("patience", "adjust_factor", "scaler", "count")
    assert state._fields[4:] == ("total_resets", "min_scaler", "max_scaler")
    assert (int(state.patience), float(state.adjust_factor)) == (7, 4.0)
    assert (float(state.scaler), int(state.count)) == (2.0**10, 3)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(patience=True), TypeError, "patience.*True"),
        (dict(patience=10.0), TypeError, "patience.*10.0"),
        (dict(count=jnp.float32(1)), TypeError, "count.*float32"),
        (dict(scaler=jnp.array(2**15)), TypeError, "scaler.*int32"),
        (dict(scaler="big"), TypeError, "scaler.*str"),
        (dict(scaler=0.0), ValueError, "scaler.*> 0.0"),
        (dict(adjust_factor=0.5), ValueError, "adjust_factor.*0.5"),
        (dict(patience=-1), ValueError, "patience.*-1"),
        (dict(scaler=jnp.ones(2)), ValueError, "scaler.*shape"),
        (dict(min_scaler=0.0), ValueError, "min_scaler must be finite and > 0.0, got 0.0"),
        (dict(min_scaler=jnp.int32(1)), TypeError, "min_scaler.*int32"),
        (dict(max_scaler=True), TypeError, "max_scaler.*True"),
        (dict(max_scaler=float("inf")), ValueError, "max_scaler must be finite.*inf"),
        (
            dict(scaler=2.0, min_scaler=4.0, max_scaler=2.0),
            ValueError,
            "min_scaler must be <= max_scaler, got min_scaler=4.0 and max_scaler=2.0",
        ),
        (
            dict(scaler=2.0**25),
            ValueError,
            "scaler must be <= max_scaler=16777216.0, got 33554432.0",
        ),
        (dict(scaler=0.5), ValueError, "scaler must be >= min_scaler=1.0, got 0.5"),
    ],
)
def test_state_rejects_bad_fields(kwargs, error, match):
    with pytest.raises(error, match=match):
        DynamicScalerState(**kwargs)


@pytest.mark.newest_only
def test_custom_bounds_admit_scales_outside_the_defaults():
    state = DynamicScalerState(scaler=2.0**-4, min_scaler=2.0**-8, max_scaler=2.0**30)
    assert float(state.scaler) == 2.0**-4 and float(state.max_scaler) == 2.0**30
    # Traced values cannot be compared, so only their dtypes and shapes are checked.
    traced = jax.jit(lambda s: DynamicScalerState(scaler=s).scaler)(jnp.float32(2.0**30))
    assert float(traced) == 2.0**30


@pytest.mark.newest_only
def test_a_state_edited_out_of_its_bounds_is_rejected_when_used():
    fn = dynamic_scale_grad(lambda x: x**2)
    state = DynamicScalerState()._replace(scaler=jnp.float32(0.5))
    with pytest.raises(ValueError, match="scaler must be >= min_scaler=1.0, got 0.5"):
        fn(jnp.float32(1.0), dynamic_scaler_state=state)


@pytest.mark.newest_only
def test_state_is_a_namedtuple_pytree():
    state = DynamicScalerState(patience=4)
    assert isinstance(state, tuple) and state._fields[-1] == "max_scaler"
    assert type(state._replace(count=jnp.int32(1))) is DynamicScalerState
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
    assert paths == [
        ".patience",
        ".adjust_factor",
        ".scaler",
        ".count",
        ".total_resets",
        ".min_scaler",
        ".max_scaler",
    ]
    # Rebuilding with non-numeric leaves (filter specs, vmap axes) must not validate.
    assert jax.tree_util.tree_map(lambda _: True, state).count is True
    assert jax.tree_util.tree_map(lambda _: 0, state).scaler == 0


@pytest.mark.newest_only
def test_state_carried_through_jit_without_retracing():
    traces = []

    def loss(x):
        traces.append(None)
        return x**2

    fn = jax.jit(dynamic_scale_grad(loss, redo_on_nan=2))
    state = DynamicScalerState(scaler=2**4, patience=1)
    for _ in range(3):
        state, _ = fn(jnp.float32(1.0), dynamic_scaler_state=state)
    assert float(state.scaler) == 2**5 and int(state.count) == 1
    # One trace (the redo loop's body evaluates its jaxpr), then cache hits.
    assert len(traces) == 1


@pytest.mark.parametrize("redo_on_nan", [0, 3])
@pytest.mark.parametrize("entry_point", [dynamic_scale_value_and_grad, dynamic_scale_grad])
@pytest.mark.newest_only
def test_the_loss_is_traced_once_per_call(entry_point, redo_on_nan):
    # Hugging Face's compute_loss pops the labels from the batch: a second
    # trace of the loss would raise KeyError.
    traces = []

    def loss(w, batch):
        traces.append(None)
        labels = batch.pop("labels")
        return jnp.mean((batch["x"] @ w - labels) ** 2)

    fn = entry_point(loss, redo_on_nan=redo_on_nan)
    batch = {"x": jnp.ones((4, 3)), "labels": jnp.zeros((4, 2))}
    state, _ = fn(jnp.ones((3, 2)), dict(batch), dynamic_scaler_state=DynamicScalerState())
    assert len(traces) == 1 and int(state.count) == 1
    state, _ = jax.jit(fn)(jnp.ones((3, 2)), dict(batch), dynamic_scaler_state=state)
    assert len(traces) == 2 and int(state.count) == 2


@pytest.mark.newest_only
def test_redo_on_nan_defaults_to_zero_everywhere():
    import inspect

    for entry_point in (dynamic_scale_value_and_grad, dynamic_scale_grad, jaxamp.scaling.dynamic_scale_tx):
        assert inspect.signature(entry_point).parameters["redo_on_nan"].default == 0


def test_wrong_state_type_is_a_type_error_naming_it():
    fn = dynamic_scale_grad(lambda x: x**2)
    with pytest.raises(TypeError, match="DynamicLossScale"):
        fn(jnp.float32(1.0), dynamic_scaler_state=jaxamp.DynamicLossScale(jnp.float32(2.0)))
    with pytest.raises(TypeError, match="tuple"):
        fn(jnp.float32(1.0), dynamic_scaler_state=tuple(DynamicScalerState()))
    with pytest.raises(TypeError, match="dynamic_scaler_state"):
        fn(jnp.float32(1.0))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(redo_on_nan=-1), ValueError, "redo_on_nan.*-1"),
        (dict(redo_on_nan=1.5), TypeError, "redo_on_nan.*1.5"),
        (dict(redo_on_nan=True), TypeError, "redo_on_nan.*True"),
        (dict(has_aux="yes"), TypeError, "has_aux.*yes"),
        (dict(filter=None), TypeError, "filter.*None"),
    ],
)
def test_bad_arguments_fail_before_tracing(kwargs, error, match):
    with pytest.raises(error, match=match):
        dynamic_scale_value_and_grad(lambda x: x, **kwargs)


def test_non_callable_fun_is_rejected():
    with pytest.raises(TypeError, match="function to differentiate"):
        dynamic_scale_grad(3.0)
