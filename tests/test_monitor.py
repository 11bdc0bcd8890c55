"""`jaxamp.monitoring.monitor`: statistics inside jit equal a direct computation on the same values."""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp.monitoring import FIELDS

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals

BF16 = jnp.bfloat16


def reference(x, headroom_bits=4.0):
    """The `FIELDS` of one value, computed with numpy."""
    info = jnp.finfo(x.dtype)
    a = np.abs(np.asarray(x, np.float64))
    finite = np.isfinite(a)
    nonzero = finite & (a > 0)
    fields = dict(
        amax=a[finite].max(initial=0.0), source_amax=0.0, scale=0.0, values=a.size,
        nonzero=nonzero.sum(), underflow=(nonzero & (a < float(info.smallest_normal))).sum(),
        above=(finite & (a > float(info.max) / 2**headroom_bits)).sum(), nonfinite=(~finite).sum(),
    )  # fmt: skip
    for e in (0, 6, 12, 18):
        fields[f"below_2^-{14 + e}"] = (nonzero & (a < 2.0 ** (-14 - e))).sum()
    return np.array([fields[f] for f in FIELDS], np.float64)


def combined(vectors):
    vectors = np.stack(vectors)
    return np.concatenate([vectors[:, :3].max(0), vectors[:, 3:].sum(0)])


def by_site(stats):
    return {(s.direction, s.scope, s.name): np.asarray(v, np.float64) for s, v in zip(stats.sites, stats.vectors)}


def dense(w, x, scope):
    with jax.named_scope(scope):
        return jnp.tanh(x.astype(BF16) @ w.astype(BF16))


def two_layers(params, x):
    h = dense(params[0], x, "layer1")
    y = dense(params[1], h, "layer2")
    return jnp.sum(y.astype(jnp.float32) ** 2)


def params_and_batch(seed=0, width=8):
    k = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(k[0], (width, width)), jax.random.normal(k[1], (width, width))], jax.random.normal(
        k[2], (4, width)
    )


@pytest.mark.newest_only
def test_forward_and_backward_statistics_equal_a_direct_computation_under_jit():
    params, x = params_and_batch()
    step = jax.jit(jaxamp.monitoring.monitor(jax.value_and_grad(two_layers)))
    (loss, grads), stats = step(params, x)
    found = by_site(stats)
    w1, w2 = (w.astype(BF16) for w in params)
    xb = x.astype(BF16)
    z1 = xb @ w1
    h = jnp.tanh(z1)
    z2 = h @ w2
    expected_forward = {
        ("forward", "layer1", "dot_general[0].lhs"): reference(xb),
        ("forward", "layer1", "dot_general[0].rhs"): reference(w1),
        ("forward", "layer1", "dot_general[0].out"): reference(z1),
        ("forward", "layer1", "output[0]"): reference(h),
        ("forward", "layer2", "dot_general[0].out"): reference(z2),
    }
    for key, want in expected_forward.items():
        np.testing.assert_array_equal(found[key], want, err_msg=str(key))
    # Cotangents: of layer2's matmul result, and the two gradient matmuls' results.
    ct_z2 = jax.grad(lambda z: jnp.sum(jnp.tanh(z).astype(jnp.float32) ** 2))(z2)
    ct_h = jax.grad(lambda h: jnp.sum(jnp.tanh(h @ w2).astype(jnp.float32) ** 2))(h)
    grad_w2 = jax.grad(lambda w: jnp.sum(jnp.tanh(h @ w).astype(jnp.float32) ** 2))(w2)
    backward = {k[2]: v for k, v in found.items() if k[:2] == ("backward", "layer2")}
    operands = [v for name, v in backward.items() if name.endswith((".lhs", ".rhs"))]
    assert any(np.array_equal(v, reference(ct_z2)) for v in operands)
    outs = sorted((v for name, v in backward.items() if name.endswith(".out")), key=lambda v: v[0])
    want = sorted([reference(ct_h), reference(grad_w2)], key=lambda v: v[0])
    np.testing.assert_allclose(outs, want, rtol=0, atol=0)
    assert {s.direction for s in stats.sites} == {"forward", "backward"}


@pytest.mark.newest_only
def test_monitored_outputs_equal_the_unmonitored_and_the_lowered_program_is_untouched():
    params, x = params_and_batch()
    plain = jax.jit(jax.value_and_grad(jaxamp.amp(two_layers, compute_dtype="bf16")))
    before = plain.lower(params, x).as_text()
    unmonitored = plain(params, x)
    monitored, _ = jax.jit(jaxamp.monitoring.monitor(jax.value_and_grad(jaxamp.amp(two_layers, compute_dtype="bf16"))))(
        params, x
    )
    for a, b in zip(jax.tree.leaves(unmonitored), jax.tree.leaves(monitored)):
        np.testing.assert_array_equal(a, b)
    assert plain.lower(params, x).as_text() == before


def test_scan_combines_iterations_and_remat_is_not_measured_twice():
    k = jax.random.split(jax.random.key(1), 2)
    ws = jax.random.normal(k[0], (3, 8, 8))
    x = jax.random.normal(k[1], (4, 8))

    def loss(ws, x):
        def layer(h, w):
            with jax.named_scope("cell"):
                return jax.checkpoint(lambda h: jnp.tanh(h.astype(BF16) @ w.astype(BF16)))(h), None

        h, _ = jax.lax.scan(layer, x.astype(BF16), ws)
        return jnp.sum(h.astype(jnp.float32))

    _, stats = jax.jit(jaxamp.monitoring.monitor(jax.value_and_grad(loss)))(ws, x)
    found = by_site(stats)
    hs, per_iteration = [x.astype(BF16)], []
    for w in ws:
        lhs = hs[-1].astype(BF16)
        per_iteration.append(reference(lhs @ w.astype(BF16)))
        hs.append(jnp.tanh(lhs @ w.astype(BF16)))
    np.testing.assert_array_equal(found[("forward", "cell", "dot_general[0].out")], combined(per_iteration))
    # The backward pass recomputes each layer under remat: not measured again.
    assert not any(s.direction == "backward" and s.name.endswith("[2].out") for s in stats.sites)
    # Backward, layer by layer from the last: the gradient matmuls' results
    # (of the layer's input and of its weight), combined over iterations.
    layer = jax.jit(jax.vjp, static_argnums=0)
    ct, grads_h, grads_w = jnp.ones((4, 8), BF16), [], []
    for h, w in reversed(list(zip(hs[:-1], ws))):
        _, pullback = layer(lambda h, w: jnp.tanh(h @ w), h, w.astype(BF16))
        ct, grad_w = pullback(ct)
        grads_h.append(reference(ct))
        grads_w.append(reference(grad_w))
    backward = sorted(tuple(v) for (d, scope, name), v in found.items() if d == "backward" and name.endswith(".out"))
    assert backward == sorted([tuple(combined(grads_h)), tuple(combined(grads_w))])


def test_cond_and_while_measure_what_ran():
    params, x = params_and_batch()

    def fn(w, x, flag):
        y = jax.lax.cond(flag, lambda x: x.astype(BF16) @ w.astype(BF16), lambda x: x.astype(BF16), x)

        def body(carry):
            i, h = carry
            return i + 1, (h @ w.astype(BF16)) / 4

        return jax.lax.while_loop(lambda c: c[0] < 3, body, (0, y))[1]

    w = params[0]
    values = FIELDS.index("values")
    for flag, want in ((True, [x.size, 3 * x.size]), (False, [0, 3 * x.size])):
        _, stats = jax.jit(jaxamp.monitoring.monitor(fn))(w, x, flag)
        lhs = [v[values] for s, v in zip(stats.sites, np.asarray(stats.vectors)) if s.name.endswith(".lhs")]
        assert sorted(lhs) == want  # the cond's matmul once (not at all when untaken), the loop's three times


def test_shard_map_stacks_devices_and_counts_replicated_values_once():
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs several devices (XLA_FLAGS=--xla_force_host_platform_device_count=4)")
    mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    params, x = params_and_batch(width=8)
    x = jnp.tile(x, (len(devices), 1))

    def loss(w, x):
        def local(w, x):
            with jax.named_scope("layer"):
                y = x.astype(BF16) @ w.astype(BF16)
            return jax.lax.psum(jnp.sum(y.astype(jnp.float32)), "data")

        return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())(w, x)

    with jax.set_mesh(mesh):
        xs = jax.device_put(x, jax.NamedSharding(mesh, P("data")))
        _, stats = jax.jit(jaxamp.monitoring.monitor(loss))(params[0], xs)
    found = by_site(stats)
    np.testing.assert_array_equal(found[("forward", "layer", "dot_general[0].lhs")], reference(x.astype(BF16)))
    np.testing.assert_array_equal(found[("forward", "layer", "dot_general[0].rhs")], reference(params[0].astype(BF16)))

    # Backward: the sum's cotangent is ones; per device, the weight's gradient
    # matmul is that device's x^T @ ones, its result combined over devices.
    with jax.set_mesh(mesh):
        _, stats = jax.jit(jaxamp.monitoring.monitor(jax.grad(loss)))(params[0], xs)
    backward = [v for (d, scope, name), v in by_site(stats).items() if d == "backward" and name.endswith(".out")]
    shards = np.split(np.asarray(x.astype(BF16)), len(devices))
    ones = jnp.ones((shards[0].shape[0], params[0].shape[1]), BF16)
    per_device = [reference(ones.T @ jnp.asarray(shard)) for shard in shards]  # as JAX transposes it
    assert len(backward) == 1
    np.testing.assert_array_equal(backward[0], combined(per_device))


@pytest.mark.newest_only
def test_fp8_operands_report_their_scale_and_the_amax_quantised():
    k = jax.random.split(jax.random.key(2), 4)
    w1, w2, w3 = (jax.random.normal(k[i], (32, 32)) for i in range(3))
    x = jax.random.normal(k[3], (32, 32)) * 3

    def loss(params, x):
        with jax.named_scope("first"):
            h = jax.nn.relu(x @ params[0])
        with jax.named_scope("middle"):
            h = jax.nn.relu(h @ params[1])
        with jax.named_scope("last"):
            return jnp.sum(h @ params[2])

    amp_loss = jaxamp.amp(loss, compute_dtype=jaxamp.fp8.Fp8Recipe(keep_small_bf16=None, keep_last_matmul_bf16=False))
    _, stats = jax.jit(jaxamp.monitoring.monitor(jax.value_and_grad(amp_loss)))((w1, w2, w3), x)
    rows = {(r["direction"], r["scope"], r["name"]): r for r in stats.rows()}
    lhs = rows[("forward", "middle", "dot_general[0].lhs")]
    assert lhs["fp8"] and lhs["dtype"] == "float8_e4m3fn"
    amax = rows[("forward", "first", "output[0]")]["amax"]  # what "first" hands "middle"
    assert lhs["source_amax"] == amax
    np.testing.assert_allclose(lhs["scale"], amax / 448.0, rtol=1e-6)
    assert 0 < lhs["amax"] <= 448
    assert any(r["fp8"] and r["dtype"] == "float8_e5m2" for r in rows.values() if r["direction"] == "backward")


@pytest.mark.newest_only
def test_fp8_on_an_auto_mesh_reports_each_products_operands():
    # On an Auto mesh each float8 product quantises per device inside a
    # custom_partitioning op: its sites are its compute-dtype operands and its
    # result, forward and backward, with no warning that a body went unseen.
    if len(jax.devices()) < 4:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=4")
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    w = jax.random.normal(jax.random.key(0), (32, 32)) / 6
    x = jax.random.normal(jax.random.key(1), (16, 32))

    def loss(w, x):
        with jax.named_scope("layer"):
            h = jnp.tanh(x @ w)
        return jnp.sum((h @ w).astype(jnp.float32) ** 2)

    amp_loss = jaxamp.amp(loss, compute_dtype=jaxamp.fp8.Fp8Recipe(keep_small_bf16=None, keep_last_matmul_bf16=False))
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("error")
        xs = jax.device_put(x, jax.NamedSharding(mesh, P("data")))
        _, stats = jax.jit(jaxamp.monitoring.monitor(jax.value_and_grad(amp_loss)))(w, xs)
    rows = {(r["direction"], r["scope"], r["name"]): r for r in stats.rows()}
    lhs = rows[("forward", "layer", "dot_general[0].lhs")]
    assert lhs["dtype"] == "bfloat16" and not lhs["fp8"]
    np.testing.assert_array_equal(by_site(stats)[("forward", "layer", "dot_general[0].lhs")], reference(x.astype(BF16)))
    matmuls = [d for d, _, name in rows if name.startswith("dot_general")]
    assert matmuls.count("forward") == 6 and matmuls.count("backward") == 9, sorted(rows)  # 2 and 3 products


@pytest.mark.newest_only
@settings(max_examples=20, deadline=None)
@given(
    exponent=st.integers(-30, 15),
    dtype=st.sampled_from([jnp.float16, jnp.bfloat16]),
    special=st.sampled_from([None, np.inf, np.nan, 0.0]),
)
def test_statistics_of_any_magnitude_match_numpy(exponent, dtype, special):
    values = np.random.default_rng(exponent + 40).standard_normal((6, 8)) * 2.0**exponent
    if special is not None:
        values[0, :3] = special
    w = jnp.asarray(values, dtype)

    def fn(w):
        with jax.named_scope("s"):
            return jnp.ones((2, 6), dtype) @ w

    _, stats = jax.jit(jaxamp.monitoring.monitor(fn, headroom_bits=2))(w)
    found = by_site(stats)
    np.testing.assert_array_equal(found[("forward", "s", "dot_general[0].rhs")], reference(w, headroom_bits=2))
    # A broadcast constant is measured from its scalar, counts multiplied.
    ones = jnp.ones((2, 6), dtype)
    np.testing.assert_array_equal(found[("forward", "s", "dot_general[0].lhs")], reference(ones, headroom_bits=2))


@pytest.mark.newest_only
def test_rows_derive_headroom_and_fractions():
    w = jnp.asarray([[60000.0, 1e-6], [0.0, 1.0]], jnp.float16)

    def fn(w):
        with jax.named_scope("hot"):
            return jnp.ones((1, 2), jnp.float16) @ w

    _, stats = jaxamp.monitoring.monitor(fn)(w)
    rows = stats.rows()
    np.testing.assert_array_equal(stats.field("amax"), [r["amax"] for r in rows])
    row = next(r for r in rows if r["name"] == "dot_general[0].rhs")
    assert row["headroom_bits"] == pytest.approx(math.log2(65504 / 60000))
    assert row["underflow_fraction"] == pytest.approx(1 / 3)
    assert row["above_fraction"] == pytest.approx(1 / 4)


def test_bad_input_and_differentiating_the_monitor_raise():
    with pytest.raises(TypeError, match="expects a callable"):
        jaxamp.monitoring.monitor(3)
    with pytest.raises(ValueError, match="headroom_bits"):
        jaxamp.monitoring.monitor(lambda x: x, headroom_bits=-1)
    monitored = jaxamp.monitoring.monitor(lambda x: jnp.sum(x.astype(BF16) @ x.astype(BF16)).astype(jnp.float32))
    with pytest.raises(TypeError, match=r"jaxamp\.monitoring\.monitor\(jax\.value_and_grad\(loss\)\)"):
        jax.grad(lambda x: monitored(x)[0])(jnp.ones((2, 2)))


def test_flax_nnx_objects_get_an_error_that_says_what_to_monitor_instead():
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"not flax nnx objects.*nnx.split\(model\)"):
        jaxamp.monitoring.monitor(lambda m, x: m(x))(model, jnp.ones((2, 4)))
    graphdef, state = nnx.split(model)
    forward = jaxamp.amp(lambda s, x: nnx.merge(graphdef, s)(x), compute_dtype="bf16")
    out, stats = jax.jit(jaxamp.monitoring.monitor(forward))(state, jnp.ones((2, 4)))
    names = [s.name for s in stats.sites][:3]
    assert out.shape == (2, 4) and names == [f"dot_general[0].{r}" for r in ("lhs", "rhs", "out")]


def test_pmap_and_vmap_of_a_monitored_step_combine_their_devices_in_rows_and_records():
    devices = jax.local_device_count()
    params, x = params_and_batch()
    step = jaxamp.monitoring.monitor(jax.value_and_grad(two_layers))
    _, single = jax.jit(step)(params, x)
    want = {(r["direction"], r["scope"], r["name"]): r for r in single.rows()}
    stacked = [jnp.stack([p] * devices) for p in params]
    for transform in (jax.pmap, jax.vmap):
        _, stats = transform(step)(stacked, jnp.stack([x] * devices))
        assert stats.vectors.shape == (devices, len(stats.sites), len(FIELDS))
        rows = stats.rows()
        assert len(rows) == len(stats.sites) == len(want)
        for row in rows:
            one = want[(row["direction"], row["scope"], row["name"])]
            assert row["amax"] == one["amax"] and row["values"] == devices * one["values"]
        recorder = jaxamp.monitoring.MonitorRecorder()
        recorder.record(0, stats)
        assert [s["values"] for s in recorder.flush()[0]["sites"]] == [r["values"] for r in rows]


def test_a_kernel_the_monitor_cannot_enter_runs_as_is_and_is_named(monkeypatch):
    from jax.experimental import pallas as pl

    from jaxamp.monitoring import _walk

    monkeypatch.setattr(_walk, "_warned", set())

    def kernel(x_ref, w_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)

    def fn(x, w):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 8), jnp.float32), interpret=True)(x, w)

    x = jnp.ones((8, 8), BF16)
    with pytest.warns(RuntimeWarning, match="does not look inside 'pallas_call' equations"):
        out, stats = jax.jit(jaxamp.monitoring.monitor(fn))(x, x)
    np.testing.assert_array_equal(out, fn(x, x))
    assert stats.sites == ()
