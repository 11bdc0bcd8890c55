"""The functional PyTorch-style GradScaler."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp import GradScaler

SGD = optax.sgd(0.1)


def _params():
    return {"w": jnp.array([1.0, -0.0, 3.0]), "b": jnp.array(0.5)}


def _grads(scale, bad=False):
    grads = {"w": jnp.array([1.0, 2.0, 3.0]) * scale, "b": jnp.array(1.0) * scale}
    if bad:
        grads["w"] = grads["w"].at[1].set(jnp.inf)
    return grads


def _iteration(scaler, params, opt_state, bad=False):
    grads = _grads(scaler._scale, bad)
    params, opt_state, scaler = scaler.step(SGD, grads, opt_state, params)
    return params, opt_state, scaler.update()


def _bits(tree):
    return [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(tree)]


def test_growth_interval_table_matches_torch():
    # torch grows on the growth_interval-th consecutive unskipped step.
    scaler = GradScaler(init_scale=4.0, growth_interval=3)
    params, opt_state = _params(), SGD.init(_params())
    seen = []
    for _ in range(7):
        params, opt_state, scaler = _iteration(scaler, params, opt_state)
        seen.append((scaler.get_scale(), scaler.state_dict()["_growth_tracker"]))
    assert seen == [(4, 1), (4, 2), (8, 0), (8, 1), (8, 2), (16, 0), (16, 1)]


def test_backoff_skips_the_step_and_resets_the_tracker():
    scaler = GradScaler(init_scale=8.0, growth_interval=3)
    params, opt_state = _params(), SGD.init(_params())
    params, opt_state, scaler = _iteration(scaler, params, opt_state)
    params, opt_state, scaler = _iteration(scaler, params, opt_state)
    before = _bits((params, opt_state))
    grads = _grads(scaler._scale, bad=True)
    new_params, new_opt_state, stepped = scaler.step(SGD, grads, opt_state, params)
    assert bool(stepped.found_inf)
    assert _bits((new_params, new_opt_state)) == before
    scaler = stepped.update()
    assert scaler.get_scale() == 4.0 and scaler.state_dict()["_growth_tracker"] == 0
    assert not bool(scaler.found_inf)
    # The tracker starts over: growth needs three more finite steps.
    for expected in [4.0, 4.0, 8.0]:
        params, opt_state, scaler = _iteration(scaler, params, opt_state)
        assert scaler.get_scale() == expected


def test_finite_step_applies_the_unscaled_update():
    scaler = GradScaler(init_scale=1024.0)
    params = _params()
    new_params, _, _ = scaler.step(SGD, _grads(1024.0), SGD.init(params), params)
    np.testing.assert_allclose(new_params["w"], [0.9, -0.2, 2.7])
    np.testing.assert_allclose(new_params["b"], 0.4)


def test_step_after_explicit_unscale_does_not_unscale_again():
    scaler = GradScaler(init_scale=1024.0)
    params = _params()
    grads, scaler = scaler.unscale(_grads(1024.0))
    clipped = optax.clip_by_global_norm(1e-3).update(grads, optax.EmptyState())[0]
    new_params, _, _ = scaler.step(SGD, clipped, SGD.init(params), params)
    np.testing.assert_allclose(new_params["w"], params["w"] - 0.1 * clipped["w"], rtol=1e-7)
    # Unscaling the clipped gradients a second time would have shrunk the step 1024x.
    assert float(jnp.abs(new_params["b"] - params["b"])) > 1e-5


def test_growth_never_overflows_the_scale():
    f32_max = float(np.finfo(np.float32).max)
    big = f32_max * 0.75
    scaler = GradScaler(init_scale=big, growth_interval=1, max_scale=f32_max)
    params, opt_state = _params(), SGD.init(_params())
    grads = jax.tree_util.tree_map(jnp.zeros_like, params)
    params, opt_state, scaler = scaler.step(SGD, grads, opt_state, params)
    scaler = scaler.update()
    assert scaler.get_scale() == pytest.approx(big) and scaler.state_dict()["_growth_tracker"] == 0


@pytest.mark.parametrize("new_scale", [256.0, 256, jnp.float32(256.0)])
def test_update_with_new_scale_sets_it_and_keeps_the_tracker(new_scale):
    scaler = GradScaler(init_scale=8.0, growth_interval=5)
    params, opt_state = _params(), SGD.init(_params())
    params, opt_state, scaler = _iteration(scaler, params, opt_state)
    _, _, stepped = scaler.step(SGD, _grads(scaler._scale), opt_state, params)
    scaler = stepped.update(new_scale)
    assert scaler.get_scale() == 256.0 and scaler.state_dict()["_growth_tracker"] == 1


@pytest.mark.parametrize("new_scale, error", [(-1.0, ValueError), (True, TypeError), (jnp.array([2.0]), ValueError)])
def test_update_rejects_a_bad_new_scale(new_scale, error):
    with pytest.raises(error, match="new_scale"):
        GradScaler().update(new_scale)


def test_stage_errors_match_torch():
    scaler = GradScaler()
    with pytest.raises(RuntimeError, match="No inf checks"):
        scaler.update()
    _, unscaled = scaler.unscale(_grads(1.0))
    with pytest.raises(RuntimeError, match="already been called"):
        unscaled.unscale(_grads(1.0))
    params = _params()
    _, _, stepped = unscaled.step(SGD, _grads(1.0), SGD.init(params), params)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        stepped.step(SGD, _grads(1.0), SGD.init(params), params)
    with pytest.raises(RuntimeError, match="after step"):
        stepped.unscale(_grads(1.0))
    assert stepped.update().get_scale() == 65536.0


def test_scale_keeps_each_leaf_dtype():
    scaler = GradScaler(init_scale=2.0**14)
    assert scaler.scale(jnp.float16(2.0)).dtype == jnp.float16
    assert float(scaler.scale(jnp.float16(2.0))) == 2.0**15
    assert not bool(jnp.isfinite(scaler.scale(jnp.float16(8.0))))
    out = scaler.scale({"a": jnp.float32(1.0), "b": jnp.bfloat16(1.0)})
    assert out["a"].dtype == jnp.float32 and out["b"].dtype == jnp.bfloat16
    with pytest.raises(TypeError, match="floating-point"):
        scaler.scale(jnp.int32(3))


def test_unscale_keeps_dtypes_and_passes_none_through():
    scaler = GradScaler(init_scale=2.0**10)
    grads = {"h": jnp.full(2, 2.0**10, jnp.float16), "f": jnp.float32(2.0**11), "none": None}
    unscaled, scaler = scaler.unscale(grads)
    assert unscaled["h"].dtype == jnp.float16 and unscaled["none"] is None
    np.testing.assert_array_equal(unscaled["h"], [1.0, 1.0])
    assert float(unscaled["f"]) == 2.0 and not bool(scaler.found_inf)


def test_state_dict_round_trip():
    scaler = GradScaler(init_scale=32.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=4)
    params, opt_state = _params(), SGD.init(_params())
    params, opt_state, scaler = _iteration(scaler, params, opt_state)
    state = scaler.state_dict()
    assert state == {
        "scale": 32.0,
        "growth_factor": 3.0,
        "backoff_factor": 0.25,
        "growth_interval": 4,
        "_growth_tracker": 1,
        "min_scale": 1.0,
        "max_scale": 2.0**24,
    }
    assert type(state["scale"]) is float and type(state["_growth_tracker"]) is int
    restored = GradScaler().load_state_dict(state)
    assert restored.state_dict() == state
    assert restored.get_growth_factor() == 3.0 and restored.get_growth_interval() == 4
    with pytest.raises(RuntimeError, match="empty"):
        GradScaler().load_state_dict({})
    with pytest.raises(KeyError, match="_growth_tracker"):
        GradScaler().load_state_dict({k: v for k, v in state.items() if k != "_growth_tracker"})
    with pytest.raises(ValueError, match="growth_factor"):
        GradScaler().load_state_dict({**state, "growth_factor": 0.5})


def test_backoff_stops_at_min_scale():
    scaler = GradScaler(init_scale=4.0)
    params, opt_state = _params(), SGD.init(_params())
    seen = []
    for _ in range(4):
        params, opt_state, scaler = _iteration(scaler, params, opt_state, bad=True)
        seen.append(scaler.get_scale())
    # torch would go on to 0.5, 0.25, ... and, 150 steps later, 0.0 for good.
    assert seen == [2.0, 1.0, 1.0, 1.0]
    before = _bits(params)
    params, opt_state, scaler = _iteration(scaler, params, opt_state)
    assert _bits(params) != before and scaler.state_dict()["_growth_tracker"] == 1


def test_growth_stops_at_max_scale():
    scaler = GradScaler(init_scale=2.0**22, growth_interval=1)
    params, opt_state = _params(), SGD.init(_params())
    seen = []
    for _ in range(4):
        params, opt_state, scaler = _iteration(scaler, params, opt_state)
        seen.append(scaler.get_scale())
    assert seen == [2.0**23, 2.0**24, 2.0**24, 2.0**24]


def test_custom_bounds_and_non_power_of_two_factors():
    scaler = GradScaler(
        init_scale=10.0,
        growth_factor=3.0,
        backoff_factor=0.3,
        growth_interval=1,
        min_scale=2.0,
        max_scale=50.0,
    )
    params, opt_state = _params(), SGD.init(_params())
    seen = []
    for bad in [False, False, True, True, True]:
        params, opt_state, scaler = _iteration(scaler, params, opt_state, bad=bad)
        seen.append(scaler.get_scale())
    # Growth capped at 50; backoff multiplies in float32, as torch, down to 2.
    once = np.float32(50.0) * np.float32(0.3)
    assert seen == [30.0, 50.0, float(once), float(once * np.float32(0.3)), 2.0]


def test_load_state_dict_takes_a_torch_dict_and_keeps_own_bounds():
    torch_state = {
        "scale": 1024.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 100,
        "_growth_tracker": 7,
    }
    restored = GradScaler(min_scale=4.0, max_scale=2.0**20).load_state_dict(torch_state)
    assert restored.state_dict() == {**torch_state, "min_scale": 4.0, "max_scale": 2.0**20}
    ours = GradScaler(init_scale=8.0, min_scale=8.0, max_scale=64.0).state_dict()
    assert GradScaler().load_state_dict(ours).state_dict() == ours
    with pytest.raises(ValueError, match="scale must be <= max_scale=1048576.0, got 2097152.0"):
        GradScaler(max_scale=2.0**20).load_state_dict({**torch_state, "scale": 2.0**21})
    with pytest.raises(ValueError, match="min_scale must be <= max_scale"):
        GradScaler().load_state_dict({**ours, "min_scale": 128.0})


def test_update_rejects_a_new_scale_outside_the_bounds():
    scaler = GradScaler(init_scale=4.0, min_scale=2.0, max_scale=2.0**10)
    with pytest.raises(ValueError, match="new_scale must be >= min_scale=2.0, got 1.0"):
        scaler.update(1.0)
    with pytest.raises(ValueError, match="new_scale must be <= max_scale=1024.0, got 2048.0"):
        scaler.update(2048.0)
    assert scaler.update(2.0).get_scale() == 2.0


def test_disabled_scaler_is_a_pass_through():
    scaler = GradScaler(enabled=False)
    loss = jnp.float16(3.0)
    assert scaler.scale(loss) is loss
    grads = _grads(1.0, bad=True)
    unscaled, same = scaler.unscale(grads)
    assert unscaled is grads and same is scaler
    params = _params()
    new_params, _, same = scaler.step(SGD, _grads(1.0), SGD.init(params), params)
    np.testing.assert_allclose(new_params["b"], 0.4)
    assert same.update() is same and same.update(5.0) is same
    assert scaler.get_scale() == 1.0 and not scaler.is_enabled()
    assert scaler.state_dict() == {} and scaler.load_state_dict({"scale": 2.0}) is scaler


def test_setters_return_new_scalers_and_validate():
    scaler = GradScaler()
    faster = scaler.set_growth_factor(4.0).set_backoff_factor(0.125).set_growth_interval(10)
    assert faster.get_growth_factor() == 4.0 and faster.get_backoff_factor() == 0.125
    assert faster.get_growth_interval() == 10
    assert scaler.get_growth_factor() == 2.0 and scaler.get_growth_interval() == 2000
    with pytest.raises(ValueError, match="growth_factor.*1.0"):
        scaler.set_growth_factor(1.0)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(growth_factor=1.0), ValueError, "growth_factor must be > 1.0, got 1.0"),
        (dict(growth_factor="2"), TypeError, "growth_factor.*'2'"),
        (dict(growth_factor=float("inf")), ValueError, "growth_factor must be finite"),
        (dict(backoff_factor=1.5), ValueError, "backoff_factor.*1.5"),
        (dict(backoff_factor=0.0), ValueError, "backoff_factor.*0.0"),
        (dict(growth_interval=0), ValueError, "growth_interval.*0"),
        (dict(growth_interval=2.5), TypeError, "growth_interval.*2.5"),
        (dict(growth_interval=True), TypeError, "growth_interval.*True"),
        (dict(init_scale=-1.0), ValueError, "init_scale.*-1.0"),
        (dict(init_scale=float("inf")), ValueError, "init_scale.*inf"),
        (dict(enabled="yes"), TypeError, "enabled.*yes"),
        (dict(min_scale=0.0), ValueError, "min_scale must be > 0.0, got 0.0"),
        (dict(min_scale="1"), TypeError, "min_scale.*'1'"),
        (dict(max_scale=float("inf")), ValueError, "max_scale must be finite, got inf"),
        (
            dict(init_scale=8.0, min_scale=16.0, max_scale=4.0),
            ValueError,
            "min_scale must be <= max_scale, got min_scale=16.0 and max_scale=4.0",
        ),
        (dict(init_scale=2.0**25), ValueError, "init_scale must be <= max_scale=16777216.0"),
        (dict(init_scale=0.5), ValueError, "init_scale must be >= min_scale=1.0, got 0.5"),
    ],
)
def test_constructor_validates_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        GradScaler(**kwargs)


def test_train_step_under_jit_matches_eager():
    optimizer = optax.adam(1e-2)

    def train_step(scaler, params, opt_state, bad):
        def loss_fn(p):
            loss = jnp.sum((p["w"] - 1.0) ** 2) + p["b"] ** 2
            return scaler.scale(loss * jnp.where(bad, jnp.inf, 1.0))

        grads = jax.grad(loss_fn)(params)
        params, opt_state, scaler = scaler.step(optimizer, grads, opt_state, params)
        return scaler.update(), params, opt_state

    jitted = jax.jit(train_step)
    scaler = GradScaler(init_scale=16.0, growth_interval=2)
    eager_state = jit_state = (scaler, _params(), optimizer.init(_params()))
    for bad in [False, True, False, False, False]:
        eager_state = train_step(*eager_state, jnp.bool_(bad))
        jit_state = jitted(*jit_state, jnp.bool_(bad))
        assert eager_state[0].state_dict() == jit_state[0].state_dict()
        leaves = map(jax.tree_util.tree_leaves, (eager_state[1:], jit_state[1:]))
        for a, b in zip(*leaves):
            np.testing.assert_allclose(a, b, rtol=1e-6)
    # 16, backed off to 8 by the injected inf, grown back to 16 after two finite steps.
    assert jit_state[0].get_scale() == 16.0
    assert jaxamp.all_finite(jit_state[1:])
