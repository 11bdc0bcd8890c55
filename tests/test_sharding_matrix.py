"""Every API in every sharding mode and the layouts it sees, on 4 CPU devices (a 2 x 2 mesh).

Modes: `jax.jit` on an Explicit mesh (`jax.make_mesh`'s default), on an Auto
mesh, and a `shard_map` body (Auto mesh, ``check_vma=True``). Layouts: data
parallel (parameters replicated), FSDP (parameters sharded along "data" on
their first axis) and tensor parallel (the first weight's columns and the
second's rows along "model"). The batch is always split along "data".

Each API computes a (value, gradients) pair of the same small MLP loss. The
test checks it against the one-device float32 result (the tolerance of the
API's compute dtype), and, under `jit`, that every gradient has exactly the
sharding (`jax.typeof`) that `jax.grad` of the plain loss gives it: amp and
the scalers never change a sharding.

Every API runs in every mode on the FSDP layout. The other two layouts take the
APIs whose own code sees the layout: amp's casts, float8's per-tensor scales
and float32 reductions, and the redo loop, whose condition must be one verdict
across the shards. The rest only scale, select or cast the gradients those
compute, elementwise, and a layout changes nothing of that.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals

D, H, OUT, BATCH = 8, 16, 4, 8
MODES = ["explicit", "auto", "shard_map"]
LAYOUTS = {
    "dp": {"w1": P(), "w2": P()},
    "fsdp": {"w1": P("data"), "w2": P("data")},
    "tp": {"w1": P(None, "model"), "w2": P("model", None)},
}


def _mesh(mode):
    axis_type = AxisType.Explicit if mode == "explicit" else AxisType.Auto
    return jax.make_mesh((2, 2), ("data", "model"), axis_types=(axis_type,) * 2, devices=jax.devices()[:4])


def _problem():
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {"w1": jax.random.normal(k1, (D, H)) / np.sqrt(D), "w2": jax.random.normal(k2, (H, OUT)) / np.sqrt(H)}
    return params, jax.random.normal(k3, (BATCH, D)), jax.random.normal(k4, (BATCH, OUT))


def _loss_for(mode, layout):
    """The loss as each mode writes it: global arrays, or one device's shard."""
    manual = mode == "shard_map"

    def loss(params, x, y):
        w1, w2 = params["w1"], params["w2"]
        if manual and layout == "fsdp":
            w1, w2 = (jax.lax.all_gather(w, "data", tiled=True) for w in (w1, w2))
        h = jax.nn.relu(x @ w1)
        if mode == "explicit" and layout == "tp":
            # A row-parallel matmul on an Explicit mesh: the user says where
            # the sum over "model" goes (amp must keep it).
            out = jnp.matmul(h, w2, out_sharding=P("data", None))
        else:
            out = h @ w2
        if manual and layout == "tp":
            out = jax.lax.psum(out, "model")
        # A sum over the global batch size: the devices' shares add up to the mean.
        return jnp.sum((out - y) ** 2) / (BATCH * OUT)

    return loss


# --- the APIs: (loss) -> f(params, x, y) -> (value, grads) -------------------


def _amp(loss, **options):
    return jax.value_and_grad(jaxamp.amp(loss, **options))


def _dynamic_scaler(loss, redo_on_nan):
    grad_fn = jaxamp.dynamic_scale_value_and_grad(
        jaxamp.amp(loss, compute_dtype="f16"), filter=False, redo_on_nan=redo_on_nan
    )

    def run(params, x, y):
        state, (value, grads) = grad_fn(params, x, y, dynamic_scaler_state=jaxamp.DynamicScalerState())
        return value, grads

    return run


def _dynamic_scale_grad(loss):
    grad_fn = jaxamp.dynamic_scale_grad(jaxamp.amp(loss, compute_dtype="f16"), filter=False, redo_on_nan=3)

    def run(params, x, y):
        _, grads = grad_fn(params, x, y, dynamic_scaler_state=jaxamp.DynamicScalerState())
        return loss(params, x, y), grads

    return run


def _grad_scaler(loss):
    amp_loss = jaxamp.amp(loss, compute_dtype="f16")

    def run(params, x, y):
        scaler = jaxamp.GradScaler(init_scale=2.0**10)
        value, grads = jax.value_and_grad(lambda p: scaler.scale(amp_loss(p, x, y)))(params)
        grads, scaler = scaler.unscale(grads)
        return value / 2.0**10, jax.tree_util.tree_map(lambda g: jnp.where(scaler.found_inf, jnp.nan, g), grads)

    return run


def _jmp_loss_scale(loss):
    amp_loss = jaxamp.amp(loss, compute_dtype="f16")

    def run(params, x, y):
        scale = jaxamp.DynamicLossScale(jnp.float32(2.0**10))
        value, grads = jax.value_and_grad(lambda p: scale.scale(amp_loss(p, x, y)))(params)
        grads = scale.unscale(grads)
        scale = scale.adjust(jaxamp.all_finite(grads))
        return scale.unscale(value), jax.tree_util.tree_map(lambda g: g * (scale.loss_scale / 2.0**10), grads)

    return run


def _optimizer(loss, wrap):
    # The update of SGD with learning rate 1 is minus the gradient: the
    # wrappers must hand it on with its sharding.
    optimizer = wrap(optax.sgd(1.0))
    value_and_grad = jax.value_and_grad(jaxamp.amp(loss, compute_dtype="bf16"))

    def run(params, x, y):
        value, grads = value_and_grad(params, x, y)
        updates, _ = optimizer.update(grads, optimizer.init(params), params)
        new = jaxamp.scaling.apply_if_finite_updates(params, updates, jaxamp.all_finite(grads))
        return value, jax.tree_util.tree_map(jnp.subtract, params, new)

    return run


def _policy(loss):
    policy = jaxamp.get_policy("p=f32,c=bf16,o=f32")

    def cast_loss(params, x, y):
        return policy.cast_to_output(loss(policy.cast_to_compute(params), policy.cast_to_compute(x), y))

    return jax.value_and_grad(cast_loss)


# Every matmul of the small MLP in float8, its last and sizes no float8 GEMM
# takes included (the defaults keep those in bf16).
_EVERY_FP8 = jaxamp.fp8.Fp8Recipe(keep_small_bf16=None, min_contraction=1, gemm_multiple=1, keep_last_matmul_bf16=False)

APIS = {
    "amp bf16": (functools.partial(_amp, compute_dtype="bf16"), 3e-2),
    "amp f16": (functools.partial(_amp, compute_dtype="f16"), 5e-3),
    # Every matmul in float8 (these are small: see _EVERY_FP8). On this
    # 8-16-4 MLP one-device fp8 itself is 16.5% (w1) and 5.4% (w2) from float32
    # (relative norm: 3 mantissa bits in e4m3, 2 in the e5m2 cotangents, 8 terms
    # per sum); the jit modes equal it (tests/test_fp8_sharding.py), shard_map's
    # per-device scales measured 8.1%.
    "amp fp8": (functools.partial(_amp, compute_dtype=_EVERY_FP8), 0.25),
    "amp f16 float32 reductions": (
        functools.partial(_amp, compute_dtype="f16", float32_gradient_reductions=True),
        5e-3,
    ),
    "dynamic_scale_value_and_grad": (functools.partial(_dynamic_scaler, redo_on_nan=0), 5e-3),
    "dynamic_scale_value_and_grad redo": (functools.partial(_dynamic_scaler, redo_on_nan=10), 5e-3),
    "dynamic_scale_grad": (_dynamic_scale_grad, 5e-3),
    "GradScaler": (_grad_scaler, 5e-3),
    "DynamicLossScale": (_jmp_loss_scale, 5e-3),
    "skip_nonfinite_updates": (functools.partial(_optimizer, wrap=jaxamp.scaling.skip_nonfinite_updates), 3e-2),
    "optim.cast_state": (functools.partial(_optimizer, wrap=jaxamp.optim.cast_state), 3e-2),
    "Policy": (_policy, 3e-2),
}


def _shardings(mesh, layout):
    params = {k: NamedSharding(mesh, spec) for k, spec in LAYOUTS[layout].items()}
    return params, NamedSharding(mesh, P("data"))


def _run(api, mode, layout):
    make, _ = APIS[api]
    params, x, y = _problem()
    mesh = _mesh(mode)
    loss = _loss_for(mode, layout)
    with jax.set_mesh(mesh):
        param_shardings, batch = _shardings(mesh, layout)
        args = (jax.device_put(params, param_shardings), jax.device_put(x, batch), jax.device_put(y, batch))
        if mode != "shard_map":
            return jax.jit(make(loss))(*args), jax.jit(jax.grad(loss))(*args)
        specs = (LAYOUTS[layout], P("data"), P("data"))

        def body(params, x, y):
            value, grads = make(loss)(params, x, y)
            return jax.lax.psum(value, "data"), grads

        fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(), LAYOUTS[layout]))
        return jax.jit(fn)(*args), None


# The APIs whose own code sees the layout (the module's docstring): these take every layout.
EVERY_LAYOUT = {"amp bf16", "amp fp8", "amp f16 float32 reductions", "dynamic_scale_value_and_grad redo"}


def _layouts(on_oldest_jax):
    """Every layout; the oldest-JAX leg of .ci/run takes only `on_oldest_jax` (the code paths are the same)."""
    return [
        pytest.param(name, marks=() if name == on_oldest_jax else pytest.mark.newest_only) for name in sorted(LAYOUTS)
    ]


def _api_layouts():
    """The APIs of EVERY_LAYOUT on every layout, the others on FSDP; on the oldest JAX, EVERY_LAYOUT's on FSDP."""
    return [
        pytest.param(
            api,
            *layout.values,
            marks=layout.marks if api in EVERY_LAYOUT else pytest.mark.newest_only,
            id=f"{api}-{layout.values[0]}",
        )
        for api in sorted(APIS)
        for layout in _layouts("fsdp")
        if api in EVERY_LAYOUT or layout.values[0] == "fsdp"
    ]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("api, layout", _api_layouts())
def test_api_on_every_mode_and_layout(api, mode, layout):
    (value, grads), plain_grads = _run(api, mode, layout)
    params, x, y = _problem()
    ref_value, ref_grads = jax.value_and_grad(_loss_for("jit", layout))(params, x, y)
    tolerance = APIS[api][1]
    np.testing.assert_allclose(float(value), float(ref_value), rtol=tolerance)
    for name in ref_grads:
        error = np.linalg.norm(np.asarray(grads[name]) - ref_grads[name]) / np.linalg.norm(ref_grads[name])
        assert error < tolerance, (name, error)
        assert grads[name].dtype == jnp.float32, name
        if plain_grads is not None:
            assert jax.typeof(grads[name]) == jax.typeof(plain_grads[name]), name


# --- eager calls and diagnostics under a mesh (no shard_map: they run eagerly) ---


def _dropout_loss_for(mode, layout):
    row_parallel = mode == "explicit" and layout == "tp"

    def loss(params, x, y, key):
        # flax NNX's dropout: a mask drawn with the activation's sharding.
        h = jax.nn.relu(x @ params["w1"])
        keep = jax.random.bernoulli(key, 0.9, h.shape, out_sharding=jax.typeof(h).sharding)
        h = jnp.where(keep, h / 0.9, 0)
        out = jnp.matmul(h, params["w2"], out_sharding=P("data", None)) if row_parallel else h @ params["w2"]
        return jnp.mean((out - y) ** 2)

    return loss


@pytest.mark.parametrize("layout", _layouts("tp"))
@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_eager_amp_explain_and_find_nonfinite_under_a_mesh(mode, layout):
    params, x, y = _problem()
    mesh = _mesh(mode)
    _dropout_loss = _dropout_loss_for(mode, layout)
    with jax.set_mesh(mesh):
        param_shardings, batch = _shardings(mesh, layout)
        args = (jax.device_put(params, param_shardings), jax.device_put(x, batch), jax.device_put(y, batch))
        key = jax.random.key(1)
        eager = jaxamp.amp(_dropout_loss, compute_dtype="bf16")(*args, key)
        jitted = jax.jit(jaxamp.amp(_dropout_loss, compute_dtype="bf16"))(*args, key)
        np.testing.assert_allclose(float(eager), float(jitted), rtol=1e-2)
        assert jax.typeof(eager) == jax.typeof(jax.jit(_dropout_loss)(*args, key))
        report = jaxamp.explain(_dropout_loss, compute_dtype="bf16")(*args, key)
        assert report.low_precision_flop_fraction == 1.0
        assert jaxamp.find_nonfinite(_dropout_loss, compute_dtype="f16")(*args, key) is None


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_sharding_helpers_place_gather_and_constrain_on_both_modes(mode, layout):
    from jaxamp.sharding import make_shard_and_gather_fns, match_partition_rules, tree_apply, with_sharding_constraint

    params, x, y = _problem()
    mesh = _mesh(mode)
    rules = tuple((f"{name}$", spec) for name, spec in LAYOUTS[layout].items())
    with jax.set_mesh(mesh):
        specs = match_partition_rules(rules, params)
        shard, gather = make_shard_and_gather_fns(specs)
        placed = tree_apply(shard, params)
        for name, spec in LAYOUTS[layout].items():
            assert placed[name].sharding.spec == spec
        gathered = tree_apply(gather, placed)
        for name in params:
            np.testing.assert_array_equal(gathered[name], params[name])

        def loss(params, x, y):
            h = with_sharding_constraint(jax.nn.relu(x @ params["w1"]), P("data", None))
            return jnp.mean((h @ params["w2"] - y) ** 2)

        batch = NamedSharding(mesh, P("data"))
        args = (placed, jax.device_put(x, batch), jax.device_put(y, batch))
        grads = jax.jit(jax.grad(jaxamp.amp(loss, compute_dtype="bf16")))(*args)
        plain = jax.jit(jax.grad(loss))(*args)
        for name in params:
            assert jax.typeof(grads[name]) == jax.typeof(plain[name])
