"""Every loss-scaling decision is taken once for all devices, in shard_map and pmap.

Inside `shard_map` and `jax.pmap` each device sees only its own values. The
scalers reduce their finite flag over the mesh axes the values vary over (JAX's
varying-axes typing knows them under ``check_vma=True``) or over ``axis_name``,
and ask for ``axis_name`` where nothing tells them (``check_vma=False``, pmap).
Each test returns per-device results (``out_specs=P("dp")``, or pmap's stacked
outputs) to show that every device decided the same, or uses ``out_specs=P()``
under ``check_vma=True``, which JAX accepts only for values it can prove equal.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxamp

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals

N = 4  # devices
D, H = 8, 16


def _params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w1": jax.random.normal(k1, (D, H)) / 4, "w2": jax.random.normal(k2, (H, 4)) / 4}


def _batch(bad_device=None, value=jnp.inf):
    x = jax.random.normal(jax.random.PRNGKey(1), (4 * N, D))
    if bad_device is not None:
        x = x.at[4 * bad_device + 1, 0].set(value)
    return x


def _loss(params, x):
    h = jnp.tanh(x @ params["w1"])
    return jnp.mean((h @ params["w2"]) ** 2)


def _f16_loss(params, x):
    # Overflows float16 in the backward pass when a row of x is large and the
    # scale is too: a scale-fixable overflow, unlike an inf in the data.
    h = x.astype(jnp.float16) @ params["w1"].astype(jnp.float16)
    return jnp.mean(h.astype(jnp.float32) ** 2)


def _mesh(shape=(N,), names=("dp",)):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def _per_device(tree):
    """Each device's copy of a replicated value, stacked (out_specs P("dp"))."""
    return jax.tree_util.tree_map(lambda leaf: jnp.asarray(leaf)[None], tree)


def _shard_map(body, in_specs, out_specs, check_vma=True, mesh=None):
    mesh = mesh or _mesh()
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma))


# --- shard_map with check_vma=True: the axes come from JAX's types ----------


@pytest.mark.parametrize("redo_on_nan", [0, 10])
@pytest.mark.parametrize("entry_point", ["value_and_grad", "grad"])
@pytest.mark.newest_only
def test_dynamic_scaler_in_shard_map_decides_once_for_all_devices(entry_point, redo_on_nan):
    make = {
        "value_and_grad": jaxamp.dynamic_scale_value_and_grad,
        "grad": jaxamp.dynamic_scale_grad,
    }[entry_point]
    grad_fn = make(jaxamp.amp(_loss, compute_dtype="f16"), filter=False, redo_on_nan=redo_on_nan)

    def step(params, x, state):
        state, results = grad_fn(params, x, dynamic_scaler_state=state)
        grads = results[1] if entry_point == "value_and_grad" else results
        return state, jax.lax.pmean(grads, "dp")

    # out_specs=P() for the state: JAX accepts it only if it is provably the
    # same on every device (before, JAX failed here with a carry type error).
    fn = _shard_map(step, (P(), P("dp"), P()), (P(), P()))
    start = jaxamp.DynamicScalerState(scaler=2.0**15)
    state, grads = fn(_params(), _batch(), start)
    assert float(state.scaler) == 2.0**15 and int(state.count) == 1
    assert bool(jaxamp.all_finite(grads))
    # A NaN in one device's data: every device skips; the value is not
    # finite, so no redo can help and the scale shrinks once.
    state, grads = fn(_params(), _batch(bad_device=2, value=jnp.nan), start)
    assert float(state.scaler) == 2.0**14 and int(state.total_resets) == 1
    assert not bool(jaxamp.all_finite(grads))


@pytest.mark.newest_only
def test_redo_in_shard_map_runs_the_same_attempts_on_every_device():
    # One device's rows overflow float16 in the backward pass at scales above
    # 2**8: the redo loop, with a collective after the loss, must run as many
    # times on every device, and end at the same scale.
    grad_fn = jaxamp.dynamic_scale_value_and_grad(_f16_loss, filter=False, redo_on_nan=10)

    def step(params, x, state):
        state, (loss, grads) = grad_fn(params, x, dynamic_scaler_state=state)
        return state, jax.lax.pmean(grads, "dp"), _per_device(state.total_resets)

    fn = _shard_map(step, (P(), P("dp"), P()), (P(), P(), P("dp")))
    x = _batch().at[5].set(30.0)
    state, grads, resets = fn(_params(), x, jaxamp.DynamicScalerState(scaler=2.0**15))
    assert bool(jaxamp.all_finite(grads))
    assert float(state.scaler) < 2.0**15
    np.testing.assert_array_equal(resets, [int(state.total_resets)] * N)


def test_reduce_scattered_gradients_skip_everywhere():
    # ZeRO / FSDP: each device holds one shard of the gradients; an inf that
    # reaches one shard must skip the step on all of them.
    optimizer = jaxamp.scaling.skip_nonfinite_updates(optax.sgd(0.1))
    scaler = jaxamp.GradScaler(init_scale=2.0**10)

    def step(w, x):
        local = jax.grad(lambda w: jnp.sum(x @ w))(w)
        shard = jax.lax.psum_scatter(local, "dp", scatter_dimension=0, tiled=True)
        finite = jaxamp.all_finite(shard)
        _, opt_state = optimizer.update(shard, optimizer.init(shard), shard)
        _, unscaled = scaler.unscale(shard)
        return finite, opt_state.last_finite, unscaled.found_inf

    fn = _shard_map(step, (P(), P("dp")), (P(), P(), P()))
    w = jnp.ones((D, N))
    x = _batch()
    assert [bool(v) for v in fn(w, x)] == [True, True, False]
    x = x.at[3, 0].set(jnp.inf)  # device 0's rows; after the scatter, one shard
    assert [bool(v) for v in fn(w, x)] == [False, False, True]


def test_values_already_reduced_need_no_collective():
    def step(x):
        grads = jax.lax.pmean(x, "dp")  # the same on every device
        return jaxamp.all_finite(grads)

    fn = _shard_map(step, P("dp"), P())
    hlo = fn.lower(_batch()).compile().as_text()
    assert hlo.count("all-reduce(") == 1  # the pmean's only


def test_axis_name_that_misses_a_varying_axis_is_an_error_naming_it():
    mesh = _mesh((2, 2), ("dp", "tp"))

    def step(x):
        return jaxamp.all_finite(x, axis_name="dp")

    fn = _shard_map(step, P("dp", "tp"), P(), mesh=mesh)
    with pytest.raises(ValueError, match=r"also differ.*\('tp',\).*axis_name='dp'"):
        fn(jnp.ones((4, 4)))


# --- without varying-axes typing: axis_name, or a clear error ----------------


def _apis(axis_name):
    """Each deciding API, called on per-device gradients, as a function of them."""
    kwargs = {} if axis_name is None else {"axis_name": axis_name}

    def dynamic_scaler(x):
        fn = jaxamp.dynamic_scale_grad(lambda w: jnp.sum(w * x), filter=False, **kwargs)
        state, _ = fn(jnp.ones_like(x), dynamic_scaler_state=jaxamp.DynamicScalerState(scaler=8.0))
        return state.scaler == 8.0

    def grad_scaler(x):
        _, scaler = jaxamp.GradScaler(init_scale=8.0, **kwargs).unscale(x)
        return ~scaler.found_inf

    def jmp_scale(x):
        scale = jaxamp.DynamicLossScale(jnp.float32(8.0))
        return scale.adjust(jaxamp.all_finite(x, axis_name=()), **kwargs).loss_scale == 8.0

    def skip(x):
        optimizer = jaxamp.scaling.skip_nonfinite_updates(optax.sgd(1.0), **kwargs)
        return optimizer.update(x, optimizer.init(x), x)[1].last_finite

    return {
        "all_finite": lambda x: jaxamp.all_finite(x, **kwargs),
        "dynamic_scale_grad": dynamic_scaler,
        "GradScaler": grad_scaler,
        "DynamicLossScale.adjust": jmp_scale,
        "skip_nonfinite_updates": skip,
    }


API_NAMES = list(_apis(None))


@pytest.mark.parametrize("api", API_NAMES)
def test_shard_map_without_vma_decides_over_axis_name(api):
    decide = _apis("dp")[api]
    fn = _shard_map(lambda x: _per_device(decide(x)), P("dp"), P("dp"), check_vma=False)
    assert fn(_batch()).tolist() == [True] * N
    assert fn(_batch(bad_device=1)).tolist() == [False] * N


@pytest.mark.parametrize("api", API_NAMES)
def test_shard_map_without_vma_and_without_axis_name_asks_for_it(api):
    decide = _apis(None)[api]
    fn = _shard_map(lambda x: _per_device(decide(x)), P("dp"), P("dp"), check_vma=False)
    with pytest.raises(ValueError, match=r"check_vma=False.*pass axis_name='dp'.*an ensemble.*axis_name=\(\)"):
        fn(_batch())


@pytest.mark.parametrize("api", API_NAMES)
@pytest.mark.newest_only
def test_pmap_decides_over_its_axis_name(api):
    decide = _apis("batch")[api]
    fn = jax.pmap(decide, axis_name="batch")
    assert fn(_batch().reshape(N, 4, D)).tolist() == [True] * N
    assert fn(_batch(bad_device=3).reshape(N, 4, D)).tolist() == [False] * N


@pytest.mark.parametrize("api", API_NAMES)
@pytest.mark.newest_only
def test_pmap_without_axis_name_raises_before_running(api):
    decide = _apis(None)[api]
    with pytest.raises(ValueError, match=r"jax.pmap.*pass axis_name='batch'"):
        jax.pmap(decide, axis_name="batch")(_batch().reshape(N, 4, D))


def test_an_unnamed_pmap_is_answered_with_how_to_name_its_axis_not_jaxs_own_name():
    decide = _apis(None)[API_NAMES[0]]
    with pytest.raises(ValueError, match=r"name the pmap's axis \(jax.pmap\(step, axis_name='batch'\)\)") as raised:
        jax.pmap(decide)(_batch().reshape(N, 4, D))
    assert "_internal" not in str(raised.value).split("Where the devices")[1]


@pytest.mark.newest_only
def test_axis_name_empty_tuple_decides_per_device_on_purpose():
    fn = jax.pmap(lambda x: jaxamp.all_finite(x, axis_name=()), axis_name="batch")
    assert fn(_batch(bad_device=1).reshape(N, 4, D)).tolist() == [True, False, True, True]


@pytest.mark.parametrize("bad", [["dp"], ("dp", ["tp"]), {"dp"}])
def test_axis_name_of_the_wrong_type_is_a_type_error(bad):
    with pytest.raises(TypeError, match="axis_name must be a mesh or pmap axis name"):
        jaxamp.all_finite(jnp.ones(2), axis_name=bad)
    with pytest.raises(TypeError, match="axis_name"):
        jaxamp.GradScaler(axis_name=bad)


def test_unbound_axis_name_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="axis_name='model' names an axis that is not bound"):
        jax.pmap(lambda x: jaxamp.all_finite(x, axis_name="model"), axis_name="batch")(jnp.ones((N, 2)))


# --- pmap training: collectives in the loss, one replica in trouble ---------


@pytest.mark.parametrize("trouble", ["overflow", "nan"])
@pytest.mark.parametrize("redo_on_nan", [0, 10])
@pytest.mark.newest_only
def test_pmap_with_a_collective_in_the_loss_returns_with_one_scale(trouble, redo_on_nan):
    # The loss pmeans over the replicas (as Hugging Face's Flax scripts and
    # cross-replica BatchNorm do). A redo loop that ran more often on one
    # replica than on the others would hang in that collective.
    def loss(params, x):
        return jax.lax.pmean(_f16_loss(params, x), "batch")

    grad_fn = jaxamp.dynamic_scale_value_and_grad(loss, filter=False, redo_on_nan=redo_on_nan, axis_name="batch")

    @functools.partial(jax.pmap, axis_name="batch", in_axes=(None, 0, None))
    def step(params, x, state):
        state, (value, grads) = grad_fn(params, x, dynamic_scaler_state=state)
        return state, jax.lax.pmean(grads, "batch")

    x = _batch().at[5].set(30.0) if trouble == "overflow" else _batch(bad_device=1, value=jnp.nan)
    state, grads = step(_params(), x.reshape(N, 4, D), jaxamp.DynamicScalerState(scaler=2.0**15))
    for field in ("scaler", "count", "total_resets"):
        values = np.asarray(getattr(state, field))
        assert (values == values[0]).all(), (field, values)
    resets = int(state.total_resets[0])
    if trouble == "nan" or redo_on_nan == 0:
        assert resets == 1  # skipped, one shrink
    else:
        assert resets > 1 and bool(jaxamp.all_finite(grads))  # redone to a finite step


@pytest.mark.parametrize("mode", ["pmap", "shard_map"])
@pytest.mark.newest_only
def test_a_psummed_normaliser_in_the_loss_with_redo(mode):
    # The loss divides by a token count summed over the devices, as LM
    # scripts with padding do; one device overflows; redo must neither hang
    # nor split the devices' decisions.
    axis = "batch" if mode == "pmap" else "dp"

    def loss(params, x):
        count = jax.lax.psum(jnp.float32(x.shape[0]), axis)
        h = x.astype(jnp.float16) @ params["w1"].astype(jnp.float16)
        return jnp.sum(h.astype(jnp.float32) ** 2) / count

    kwargs = {"axis_name": axis} if mode == "pmap" else {}
    grad_fn = jaxamp.dynamic_scale_value_and_grad(loss, filter=False, redo_on_nan=10, **kwargs)

    def step(params, x, state):
        state, (value, grads) = grad_fn(params, x, dynamic_scaler_state=state)
        return state, _per_device(state.total_resets)

    x = _batch().at[5].set(30.0)
    start = jaxamp.DynamicScalerState(scaler=2.0**15)
    if mode == "pmap":
        state, resets = jax.pmap(step, axis_name="batch", in_axes=(None, 0, None))(_params(), x.reshape(N, 4, D), start)
        scales = np.asarray(state.scaler)
    else:
        fn = _shard_map(step, (P(), P("dp"), P()), (P(), P("dp")))
        state, resets = fn(_params(), x, start)
        scales = np.asarray(state.scaler)[None]
    assert (scales == scales.ravel()[0]).all() and scales.ravel()[0] < 2.0**15
    assert len(set(np.asarray(resets).ravel().tolist())) == 1
