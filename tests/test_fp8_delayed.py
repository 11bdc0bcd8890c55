"""fp8's delayed recipe (Transformer Engine's ``DelayedScaling``): scales from amax histories.

The state is made by `jaxamp.fp8.init_fp8_state`, passed as ``fp8_state=``, and
updated from its gradient. Checked: the first step (empty histories) equals
current scaling bit for bit; the gradient holds the step's amaxes; later steps
scale by the history (values above a stale amax saturate, `margin` makes
room, `amax_compute_algo` picks max or most recent); one history per layer
under `lax.scan`; the same gradients under `jax.checkpoint`; micro-batches
combined by max; on Auto and Explicit meshes the state and gradients equal
one device's; Orbax round trip; every matmul in float8, forward and backward;
and the errors and once-only warnings.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_fp8_sharding import _conv_net, _conv_problem

import jaxamp

from jaxpr_walk import matmul_operand_dtypes

# These tests' matmuls are small: all of them in float8, the size rule off.
FP8 = jaxamp.fp8.Fp8Recipe(keep_small_bf16=None)

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals

E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
LENGTH = 4


def _recipe(**kw):
    return jaxamp.fp8.Fp8Recipe(
        keep_small_bf16=None, scaling="delayed", amax_history_length=LENGTH, keep_last_matmul_bf16=False, **kw
    )


def _mlp(params, x, c):
    h = jnp.tanh(x @ params["w1"])
    with jax.named_scope("head"):
        y = h @ params["w2"]
    # The cotangent of ``y`` is exactly ``c`` (powers of two, so bf16 holds it).
    return jnp.sum(y.astype(jnp.float32) * c)


def _problem(seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    params = {"w1": jax.random.normal(k[0], (64, 128)) * 0.1, "w2": jax.random.normal(k[1], (128, 32)) * 0.1}
    x = jax.random.normal(k[2], (16, 64))
    c = jnp.full((16, 32), 2.0**-4).at[0, 0].set(2.0**-2)
    return params, x, c


def _step(loss):
    @jax.jit
    def step(params, state, x, c):
        return jax.value_and_grad(lambda p, s: loss(p, x, c, fp8_state=s), argnums=(0, 1))(params, state)

    return step


def _bf16(x):
    return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))


@pytest.mark.newest_only
def test_init_finds_every_float8_matmul_with_its_scopes():
    loss = jaxamp.amp(_mlp, compute_dtype=_recipe())
    state = jaxamp.fp8.init_fp8_state(loss, *_problem())
    assert {n: h.shape for n, h in state.histories.items()} == {
        "dot_general": (3, LENGTH), "head/dot_general": (3, LENGTH),
    }  # fmt: skip
    assert all(not np.asarray(h).any() for h in state.histories.values())
    # The last matmul stays bf16 by default: one site.
    default = jaxamp.amp(_mlp, compute_dtype=jaxamp.fp8.Fp8Recipe(keep_small_bf16=None, scaling="delayed"))
    assert list(jaxamp.fp8.init_fp8_state(default, *_problem()).histories) == ["dot_general"]


@pytest.mark.newest_only
def test_first_step_equals_current_scaling_and_its_gradient_holds_the_amaxes():
    params, x, c = _problem()
    loss = jaxamp.amp(_mlp, compute_dtype=_recipe())
    state = jaxamp.fp8.init_fp8_state(loss, params, x, c)
    value, (grads, observed) = _step(loss)(params, state, x, c)
    current = jaxamp.amp(_mlp, compute_dtype=jaxamp.fp8.Fp8Recipe(keep_small_bf16=None, keep_last_matmul_bf16=False))
    want_value, want = jax.jit(jax.value_and_grad(current))(params, x, c)
    assert value == want_value
    for name in params:
        np.testing.assert_array_equal(grads[name], want[name])
        assert grads[name].dtype == jnp.float32
    h = np.tanh(_bf16(x) @ _bf16(params["w1"]))
    first, head = (np.asarray(observed.histories[n]) for n in ("dot_general", "head/dot_general"))
    # Column 0: [lhs, rhs, cotangent] amaxes; the rest zeros. Within bf16's
    # rounding (2**-8): XLA may take an amax of a value it has not rounded
    # to bf16 yet (excess precision).
    np.testing.assert_allclose(first[:2, 0], [np.abs(_bf16(x)).max(), np.abs(_bf16(params["w1"])).max()], rtol=4e-3)
    np.testing.assert_allclose(head[:, 0], [np.abs(h).max(), np.abs(_bf16(params["w2"])).max(), 0.25], rtol=1e-2)
    assert head[2, 0] == 0.25  # the cotangent, exactly
    assert not first[:, 1:].any() and not head[:, 1:].any()


def test_update_rolls_the_newest_amaxes_in():
    params, x, c = _problem()
    loss = jaxamp.amp(_mlp, compute_dtype=_recipe())
    state = jaxamp.fp8.init_fp8_state(loss, params, x, c)
    step = _step(loss)
    seen = []
    for scale in (1.0, 4.0, 2.0, 0.5, 1.0):
        _, (_, observed) = step(params, state, x * scale, c)
        state = state.update(observed)
        seen.append(float(observed.histories["dot_general"][0, 0]))
    np.testing.assert_array_equal(state.histories["dot_general"][0], seen[::-1][:LENGTH])
    np.testing.assert_array_equal(state.amax("dot_general")[0], max(seen[1:]))
    np.testing.assert_array_equal(state.amax("dot_general", "most_recent")[0], seen[-1])


def _first_layer_output(recipe, lhs_amax, x, w):
    def f(x, w):
        return x @ w

    loss = jaxamp.amp(f, compute_dtype=recipe)
    state = jaxamp.fp8.init_fp8_state(loss, x, w)
    (name,) = state.histories
    history = np.zeros((3, LENGTH), np.float32)
    history[0, 1] = lhs_amax  # an older step's amax: "max" takes it, "most_recent" does not
    history[1, 0] = float(np.abs(w).max())
    return np.asarray(jax.jit(lambda x, w, s: loss(x, w, fp8_state=s))(x, w, jaxamp.fp8.Fp8State({name: history})))


def test_scales_come_from_the_history():
    x = jnp.linspace(-1.0, 1.0, 16 * 64).reshape(16, 64)
    w = jnp.eye(64)[:, :32]  # picks x's first 32 columns exactly
    # A stale amax of 0.5: entries beyond it saturate to 0.5.
    # e4m3 keeps 3 mantissa bits: 6.25% relative error, at most.
    close = dict(rtol=0.0625, atol=1e-3)
    got = _first_layer_output(_recipe(), 0.5, x, w)
    np.testing.assert_allclose(got, np.clip(x[:, :32], -0.5, 0.5), **close)
    assert np.abs(got).max() == 0.5
    # A margin of 1 leaves room for twice the amax: nothing saturates.
    got = _first_layer_output(_recipe(margin=1), 0.5, x, w)
    np.testing.assert_allclose(got, x[:, :32], **close)
    assert np.abs(got).max() == 1.0
    # "most_recent" reads column 0, empty here: the live amax, no saturation.
    got = _first_layer_output(_recipe(amax_compute_algo="most_recent"), 0.5, x, w)
    np.testing.assert_allclose(got, x[:, :32], **close)


@pytest.mark.newest_only
def test_non_finite_values_pass_through_and_stay_out_of_the_history():
    params, x, c = _problem()
    loss = jaxamp.amp(_mlp, compute_dtype=_recipe())
    state = jaxamp.fp8.init_fp8_state(loss, params, x, c)
    step = _step(loss)
    state = state.update(step(params, state, x, c)[1][1])
    bad = x.at[3, 5].set(jnp.inf)
    value, (grads, observed) = step(params, state, bad, c)
    assert not np.isfinite(value)  # a loss scaler or skip_nonfinite_updates sees the step as bad
    for history in observed.histories.values():
        assert np.isfinite(np.asarray(history)).all()


def _layers(ws, x):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
    return jnp.mean(h.astype(jnp.float32) ** 2)


def _layers_remat(ws, x):
    h, _ = jax.lax.scan(jax.checkpoint(lambda h, w: (jnp.tanh(h @ w), None)), x, ws)
    return jnp.mean(h.astype(jnp.float32) ** 2)


def _unrolled(ws, x):
    h = x
    for i in range(ws.shape[0]):
        h = jnp.tanh(h @ ws[i])
    return jnp.mean(h.astype(jnp.float32) ** 2)


def _scan_problem():
    k = jax.random.split(jax.random.key(1), 2)
    magnitudes = jnp.array([0.1, 1.0, 10.0])[:, None, None]
    return jax.random.normal(k[0], (3, 64, 64)) * magnitudes, jax.random.normal(k[1], (16, 64))


def _run_steps(fn, ws, x, steps=3):
    loss = jaxamp.amp(fn, compute_dtype=_recipe())
    state = jaxamp.fp8.init_fp8_state(loss, ws, x)
    step = jax.jit(lambda ws, s, x: jax.value_and_grad(lambda w, s: loss(w, x, fp8_state=s), argnums=(0, 1))(ws, s))
    for _ in range(steps):
        value, (grads, observed) = step(ws, state, x)
        state = state.update(observed)
    return state, grads


@pytest.mark.newest_only
def test_one_history_per_layer_under_scan_as_unrolled_layers():
    ws, x = _scan_problem()
    state, grads = _run_steps(_layers, ws, x)
    (history,) = state.histories.values()
    assert history.shape == (3, 3, LENGTH)
    # Each layer's weight amax, in its own history.
    np.testing.assert_allclose(history[:, 1, 0], np.abs(_bf16(ws)).max(axis=(1, 2)), rtol=4e-3)
    # As the same layers unrolled, one history each: the forward amaxes
    # within bf16's rounding. (The cotangents' differ more: the scan and the
    # unrolled program round differently, in current scaling too: 0.026
    # against 0.016 for the middle layer, measured.)
    unrolled_state, _ = _run_steps(_unrolled, ws, x)
    assert list(unrolled_state.histories) == ["dot_general", "dot_general#2", "dot_general#3"]
    stacked = np.stack([np.asarray(h) for h in unrolled_state.histories.values()])
    np.testing.assert_allclose(history[:, :2], stacked[:, :2], rtol=4e-3)
    assert (history[:, 2, :3] > 0).all() and not history[..., 3].any()


@pytest.mark.newest_only
def test_remat_recomputes_with_the_same_scales():
    ws, x = _scan_problem()
    state, grads = _run_steps(_layers, ws, x)
    remat_state, remat_grads = _run_steps(_layers_remat, ws, x)
    np.testing.assert_array_equal(grads, remat_grads)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(remat_state)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.newest_only
def test_micro_batches_combine_by_max():
    params, x, c = _problem()
    loss = jaxamp.amp(_mlp, compute_dtype=_recipe())
    state = jaxamp.fp8.init_fp8_state(loss, params, x[:8], c[:8])
    grad = jax.grad(lambda p, s, x, c: loss(p, x, c, fp8_state=s), argnums=(0, 1))

    @jax.jit
    def accumulated(params, state, xs, cs):
        def micro(carry, batch):
            grads, observed = carry
            g, o = grad(params, state, *batch)
            return (jax.tree.map(jnp.add, grads, g), observed.combine(o)), None

        zeros = (jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, state))
        return jax.lax.scan(micro, zeros, (xs, cs))[0]

    xs = jnp.stack([x[:8], 3.0 * x[8:]])
    _, observed = accumulated(params, state, xs, jnp.stack([c[:8], c[8:]]))
    separate = [jax.jit(grad)(params, state, xs[i], c[i * 8 : i * 8 + 8])[1] for i in range(2)]
    for name, history in observed.histories.items():
        np.testing.assert_array_equal(history, np.maximum(separate[0].histories[name], separate[1].histories[name]))
    assert observed.histories["dot_general"][0, 0] == separate[1].histories["dot_general"][0, 0]


@pytest.mark.newest_only
@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_data_parallel_mesh_matches_one_device(kind):
    if len(jax.devices()) < 4:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=4")
    params, x, c = _problem()
    loss = jaxamp.amp(_mlp, compute_dtype=_recipe())
    state = jaxamp.fp8.init_fp8_state(loss, params, x, c)
    step = _step(loss)
    one = [state]
    for _ in range(2):
        one.append(one[-1].update(step(params, one[-1], x, c)[1][1]))
    _, (want, want_observed) = step(params, one[-1], x, c)
    mesh = jax.make_mesh((4,), ("data",), axis_types=(kind,))
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback: every matmul takes its history
        xs, cs = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, c))
        params = jax.device_put(params, NamedSharding(mesh, P()))
        sharded = [state]
        for _ in range(2):
            sharded.append(sharded[-1].update(step(params, sharded[-1], xs, cs)[1][1]))
        _, (grads, observed) = step(params, sharded[-1], xs, cs)
        jaxpr = jax.make_jaxpr(step)(params, sharded[-1], xs, cs)
    # XLA may skip a bfloat16 rounding in one partitioned program and not the
    # other (excess precision): amaxes within bf16's rounding, gradients close.
    for a, b in zip(jax.tree.leaves((sharded[-1], observed)), jax.tree.leaves((one[-1], want_observed))):
        assert a.sharding.is_fully_replicated
        np.testing.assert_allclose(a, b, rtol=1e-2)
    for name in params:
        np.testing.assert_allclose(grads[name], want[name], rtol=0.05, atol=0.05 * float(np.abs(want[name]).max()))
    matmuls = matmul_operand_dtypes(jaxpr)
    assert len(matmuls) == 5, matmuls  # 2 forward, 3 gradients (none for the data)
    assert all(d in (E4M3, E5M2) for _, dtypes in matmuls for d in dtypes), matmuls


def _conv(w, x):
    y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.mean(y.astype(jnp.float32) ** 2)


@pytest.mark.newest_only
def test_a_batch_the_jit_closes_over_on_an_explicit_mesh():
    # The batch a constant of the trace, split over an Explicit mesh, reaches
    # the first convolution as it is: the amax helper's zeros must be split
    # like it (they were not: JAX's "select cases must have the same shardings").
    params, x = _conv_problem()
    loss = jaxamp.amp(_conv_net, compute_dtype=_recipe())
    state = jaxamp.fp8.init_fp8_state(loss, params, x)
    want = jax.jit(jax.grad(lambda p, s: loss(p, x, fp8_state=s), argnums=(0, 1)))(params, state)
    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        step = jax.jit(jax.grad(lambda p, s: loss(p, xs, fp8_state=s), argnums=(0, 1)))
        got = step(jax.device_put(params, NamedSharding(mesh, P())), state)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=0.05, atol=0.05 * float(np.abs(b).max()))


def _per_device_observations(how, loss, params, state, x, c, mesh):
    """The observed amaxes each of 4 devices returns, amp'd `loss` differentiated inside the body."""

    def observe(p, s, x, c):
        observed = jax.grad(lambda p, s: loss(p, x, c, fp8_state=s), argnums=(0, 1))(p, s)[1]
        return jax.tree.map(lambda o: o[None], observed)

    if how == "pmap":
        split = [a.reshape(4, -1, *a.shape[1:]) for a in (x, c)]

        def one_device(p, s, x, c):
            return jax.tree.map(lambda o: o[0], observe(p, s, x, c))

        return jax.pmap(one_device, "data", in_axes=(None, None, 0, 0))(params, state, *split)
    run = jax.shard_map(
        observe, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")), out_specs=P("data"), check_vma=how == "check_vma"
    )
    with jax.set_mesh(mesh):
        xs, cs = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, c))
        return jax.jit(run)(params, state, xs, cs)


@pytest.mark.parametrize("how", ["check_vma", "no check_vma", "pmap"])
@pytest.mark.newest_only
def test_inside_shard_map_or_pmap_every_device_observes_the_global_amaxes(how):
    """amp'd inside a per-device body: each device's observation is the maximum over all of them, so the
    replicated state stays one state (and the first step, from live amaxes, traces under check_vma)."""
    if len(jax.devices()) < 4:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=4")
    params, x, c = _problem()
    x = x * jnp.arange(1, 17, dtype=jnp.float32)[:, None]  # a different amax on each device
    c = c * jnp.arange(1, 17, dtype=jnp.float32)[:, None]
    loss = jaxamp.amp(_mlp, compute_dtype=_recipe())
    state = jaxamp.fp8.init_fp8_state(loss, params, x, c)
    want = jax.jit(jax.grad(lambda p, s: loss(p, x, c, fp8_state=s), argnums=(0, 1)))(params, state)[1]
    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Explicit,))
    later = state.update(want)  # the second step scales from the history, not live amaxes
    for s in (state, later):
        observed = _per_device_observations(how, loss, params, s, x, c, mesh)
        for name, history in observed.histories.items():
            for device in range(4):
                # Each device's cotangent is its rows of the whole batch's: the same maxima, exactly.
                np.testing.assert_array_equal(np.asarray(history)[device], want.histories[name], err_msg=name)


def _data_parallel_step(loss, params, state, x, c, mesh):
    """``step(params, state)``'s value and gradients, `x` and `c` split over `mesh`'s "data" axis."""
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback: every matmul takes its history
        xs, cs = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, c))
        params = jax.device_put(params, NamedSharding(mesh, P()))
        step = jax.jit(jax.value_and_grad(lambda p, s: loss(p, xs, cs, fp8_state=s), argnums=(0, 1)))
        return step(params, state), jax.make_jaxpr(step)(params, state)


@pytest.mark.parametrize("check_vma", [True, False])
# On the oldest JAX, one axis type: the body is traced alike on both.
@pytest.mark.parametrize("kind", [AxisType.Auto, pytest.param(AxisType.Explicit, marks=pytest.mark.newest_only)])
def test_a_shard_map_body_takes_its_histories_as_one_device_does(kind, check_vma):
    """amp around a shard_map: the body takes the histories as replicated inputs; each device's observation
    is the maximum over all of them, counted once although every device holds the state (with check_vma off,
    JAX's transpose sums a replicated input's cotangent over the devices)."""
    if len(jax.devices()) < 4:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=4")
    mesh = jax.make_mesh((4,), ("data",), axis_types=(kind,))

    def per_device(params, x, c):
        body = jax.shard_map(
            lambda p, x, c: jax.lax.psum(_mlp(p, x, c), "data"),
            mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P(), check_vma=check_vma,
        )  # fmt: skip
        return body(params, x, c)

    params, x, c = _problem()
    x = x * jnp.arange(1, 17, dtype=jnp.float32)[:, None]  # a different amax on each device
    one_device, sharded = (jaxamp.amp(f, compute_dtype=_recipe()) for f in (_mlp, per_device))
    step = _step(one_device)
    state = jaxamp.fp8.init_fp8_state(one_device, params, x, c)
    with jax.set_mesh(mesh):
        xs, cs = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, c))
        assert jaxamp.fp8.init_fp8_state(sharded, params, xs, cs).histories.keys() == state.histories.keys()
    ones, shardeds = [state], [state]
    for _ in range(3):
        ones.append(ones[-1].update(step(params, ones[-1], x, c)[1][1]))
        (_, (_, observed)), _ = _data_parallel_step(sharded, params, shardeds[-1], x, c, mesh)
        shardeds.append(shardeds[-1].update(observed))
    for name in state.histories:
        got, want = np.asarray(shardeds[-1].histories[name]), np.asarray(ones[-1].histories[name])
        # The first step's live scales are each device's own: amaxes after it within bf16's rounding.
        np.testing.assert_allclose(got, want, rtol=1e-2, err_msg=name)
        if name == "dot_general":
            np.testing.assert_array_equal(got[0], want[0])  # the input's amaxes, exactly
        assert got[2, 0] > 0, name  # the cotangent was observed
    # From one state, the same scales: the same gradients and observations.
    _, (want, want_observed) = step(params, ones[-1], x, c)
    (_, (grads, observed)), jaxpr = _data_parallel_step(sharded, params, ones[-1], x, c, mesh)
    for a, b in zip(jax.tree.leaves(observed), jax.tree.leaves(want_observed)):
        np.testing.assert_allclose(a, b, rtol=1e-2)
    for name in params:
        np.testing.assert_allclose(grads[name], want[name], rtol=0.05, atol=0.05 * float(np.abs(want[name]).max()))
    matmuls = matmul_operand_dtypes(jaxpr)
    assert len(matmuls) == 5 and all(d in (E4M3, E5M2) for _, dtypes in matmuls for d in dtypes), matmuls


def test_a_shard_map_inside_a_scan_keeps_a_history_per_iteration():
    """The scan's iteration index enters the shard_map body with the histories, so each layer keeps its own."""
    if len(jax.devices()) < 4:
        pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=4")
    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Explicit,))

    def layers(ws, x, c, sharded):
        def layer(h, w):
            return h + jnp.tanh(h @ w), None

        if sharded:
            layer = jax.shard_map(layer, mesh=mesh, in_specs=(P("data"), P()), out_specs=(P("data"), P()))
        h, _ = jax.lax.scan(layer, x, ws)
        return jnp.sum(h.astype(jnp.float32) * c)

    ws = jax.random.normal(jax.random.key(1), (2, 64, 64)) * jnp.array([0.05, 0.5])[:, None, None]
    x = jax.random.normal(jax.random.key(2), (16, 64))
    c = jnp.full((16, 64), 2.0**-4)
    one = jaxamp.amp(lambda w, x, c: layers(w, x, c, False), compute_dtype=_recipe())
    sharded = jaxamp.amp(lambda w, x, c: layers(w, x, c, True), compute_dtype=_recipe())
    state = jaxamp.fp8.init_fp8_state(one, ws, x, c)
    assert [np.shape(h) for h in state.histories.values()] == [(2, 3, LENGTH)]
    grad = jax.jit(jax.grad(lambda w, s: one(w, x, c, fp8_state=s), argnums=(0, 1)))
    state = state.update(grad(ws, state)[1])  # past the first step's live (per-device) amaxes
    want = grad(ws, state)[1]
    (_, (_, observed)), _ = _data_parallel_step(sharded, ws, state, x, c, mesh)
    got, want = np.asarray(observed.histories["dot_general"]), np.asarray(want.histories["dot_general"])
    np.testing.assert_array_equal(got[:, 1], want[:, 1])  # each layer's own weight amax
    assert got[0, 1, 0] < got[1, 1, 0]
    np.testing.assert_allclose(got, want, rtol=1e-2)


def test_every_matmul_runs_in_float8_forward_and_backward():
    params, x, c = _problem()
    loss = jaxamp.amp(_mlp, compute_dtype=_recipe())
    state = jaxamp.fp8.init_fp8_state(loss, params, x, c)
    grad_fn = jax.grad(lambda p, s: loss(p, x, c, fp8_state=s), argnums=(0, 1))
    matmuls = matmul_operand_dtypes(jax.make_jaxpr(grad_fn)(params, state))
    forward = [d for _, d in matmuls if d == (E4M3, E4M3)]
    backward = [d for _, d in matmuls if E5M2 in d]
    assert len(forward) == 2 and len(backward) == 3, matmuls


@pytest.mark.newest_only
def test_orbax_round_trip(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    params, x, c = _problem()
    loss = jaxamp.amp(_mlp, compute_dtype=_recipe())
    state = jaxamp.fp8.init_fp8_state(loss, params, x, c)
    state = state.update(_step(loss)(params, state, x, c)[1][1])
    train_state = {"params": params, "fp8": state}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", train_state)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(tmp_path / "ckpt", jax.tree.map(jnp.zeros_like, train_state))
    assert isinstance(restored["fp8"], jaxamp.fp8.Fp8State)
    assert list(restored["fp8"].histories) == list(state.histories)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(train_state)):
        np.testing.assert_array_equal(a, b)
    # The restored state continues the run as the saved one would.
    np.testing.assert_array_equal(
        _step(loss)(params, restored["fp8"], x, c)[1][0]["w1"], _step(loss)(params, state, x, c)[1][0]["w1"]
    )


def test_explain_names_the_recipe():
    params, x, c = _problem()
    report = jaxamp.explain(_mlp, compute_dtype=_recipe())(params, x, c)
    text = str(report)
    assert "delayed, from the max of 4 steps' amaxes" in text


def test_errors_name_the_fix():
    params, x, c = _problem()
    loss = jaxamp.amp(_mlp, compute_dtype=_recipe())
    with pytest.raises(TypeError, match=r"fp8_state=.*init_fp8_state"):
        loss(params, x, c)
    with pytest.raises(TypeError, match=r"fp8_state must be a jaxamp\.fp8\.Fp8State"):
        loss(params, x, c, fp8_state={"dot_general": jnp.zeros((3, LENGTH))})
    with pytest.raises(TypeError, match=r"fp8_state= is the amax histories .* which keeps no state"):
        jaxamp.amp(_mlp, compute_dtype=FP8)(params, x, c, fp8_state=jaxamp.fp8.init_fp8_state(loss, params, x, c))
    with pytest.raises(TypeError, match="init_fp8_state takes a function made by jaxamp.amp"):
        jaxamp.fp8.init_fp8_state(_mlp, params, x, c)
    with pytest.raises(TypeError, match="whose fp8 recipe is"):
        jaxamp.fp8.init_fp8_state(jaxamp.amp(_mlp, compute_dtype=FP8), params, x, c)
    # A state made for another program (another batch of layers).
    ws, xl = _scan_problem()
    other = jaxamp.fp8.init_fp8_state(jaxamp.amp(_layers, compute_dtype=_recipe()), ws, xl)
    with pytest.raises(ValueError, match="does not fit this program"):
        loss(params, x, c, fp8_state=other)
    state = jaxamp.fp8.init_fp8_state(loss, params, x, c)
    with pytest.raises(ValueError, match="different sites or shapes"):
        state.update(other)
    with pytest.raises(TypeError, match="takes an Fp8State"):
        state.combine({"dot_general": 1.0})
    for bad, kind in (
        (dict(amax_history_length=0), ValueError),
        (dict(margin=-1), ValueError),
        (dict(amax_compute_algo="mean"), ValueError),
        (dict(amax_history_length=2.0), TypeError),
    ):
        with pytest.raises(kind, match="Fp8Recipe"):
            jaxamp.fp8.Fp8Recipe(keep_small_bf16=None, scaling="delayed", **bad)


@pytest.mark.newest_only
def test_not_differentiating_the_state_warns_once(fresh_warnings):
    params, x, c = _problem()
    loss = jaxamp.amp(_mlp, compute_dtype=_recipe())
    state = jaxamp.fp8.init_fp8_state(loss, params, x, c)
    with pytest.warns(UserWarning, match="not with respect to its fp8_state"):
        jax.grad(lambda p: loss(p, x, c, fp8_state=state))(params)


def test_a_custom_vjp_body_runs_from_live_values_and_says_why(fresh_warnings):
    @jax.custom_vjp
    def inner(x, w):
        return x @ w

    inner.defvjp(lambda x, w: (x @ w, (x, w)), lambda r, g: (g @ r[1].T, r[0].T @ g))

    def f(params, x, c):
        y = inner(x, params["w1"]) @ params["w2"]
        return jnp.sum(y.astype(jnp.float32) * c[:, :32])

    params, x, c = _problem()
    loss = jaxamp.amp(f, compute_dtype=_recipe())
    with pytest.warns(UserWarning, match="inside a jax.custom_vjp function"):
        state = jaxamp.fp8.init_fp8_state(loss, params, x, c)
    assert list(state.histories) == ["dot_general"]  # the matmul outside the custom_vjp
    grads, observed = _step(loss)(params, state, x, c)[1]
    assert np.isfinite(np.asarray(grads["w1"])).all() and observed.histories["dot_general"][2, 0] > 0


def test_each_branch_of_a_cond_has_its_own_history():
    def f(params, x, c, which):
        y = jax.lax.cond(which, lambda h: h @ params["w1"], lambda h: (2.0 * h) @ params["w1"], x)
        return jnp.sum(y.astype(jnp.float32))

    params, x, c = _problem()
    loss = jaxamp.amp(f, compute_dtype=_recipe())
    state = jaxamp.fp8.init_fp8_state(loss, params, x, c, True)
    assert list(state.histories) == ["dot_general", "dot_general#2"]
    grad = jax.jit(jax.grad(lambda p, s, which: loss(p, x, c, which, fp8_state=s), argnums=(0, 1)))
    # In the order of the cond's branches: lax.cond's false branch is its first.
    for which, taken, other in ((False, "dot_general", "dot_general#2"), (True, "dot_general#2", "dot_general")):
        observed = grad(params, state, which)[1].histories
        assert (observed[taken][:, 0] > 0).all() and not observed[other].any()
    # The false branch doubles x: its lhs amax is twice the true branch's.
    np.testing.assert_allclose(
        grad(params, state, False)[1].histories["dot_general"][0, 0],
        2 * grad(params, state, True)[1].histories["dot_general#2"][0, 0],
        rtol=1e-6,
    )


@pytest.mark.newest_only
def test_a_convolution_takes_its_history_without_a_warning():
    k = jax.random.split(jax.random.key(2), 2)
    w, x = jax.random.normal(k[0], (3, 3, 16, 32)) * 0.1, jax.random.normal(k[1], (4, 8, 8, 16))
    loss = jaxamp.amp(_conv, compute_dtype=_recipe())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = jaxamp.fp8.init_fp8_state(loss, w, x)
        grads, observed = jax.jit(jax.grad(lambda w, s: loss(w, x, fp8_state=s), argnums=(0, 1)))(w, state)
    assert list(state.histories) == ["conv_general_dilated"]
    np.testing.assert_allclose(observed.histories["conv_general_dilated"][:2, 0], [
        np.abs(_bf16(x)).max(), np.abs(_bf16(w)).max()
    ], rtol=4e-3)  # fmt: skip
    assert observed.histories["conv_general_dilated"][2, 0] > 0
    # The convolution's gradients run e4m3 on both sides (it takes one dtype).
    grad = jax.grad(lambda w, s: loss(w, x, fp8_state=s), argnums=(0, 1))
    matmuls = matmul_operand_dtypes(jax.make_jaxpr(grad)(w, state))
    assert all(dtypes == (E4M3, E4M3) for _, dtypes in matmuls), matmuls


@pytest.mark.newest_only
def test_an_equinox_model_differentiated_with_its_state(fresh_warnings):
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(64, 32, 128, 1, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (16, 64))

    def loss_fn(model, x):
        return jnp.mean(jax.vmap(model)(x) ** 2)

    loss = jaxamp.amp(loss_fn, compute_dtype=_recipe())
    state = jaxamp.fp8.init_fp8_state(loss, model, x)
    assert list(state.histories) == ["eqx.nn.MLP/eqx.nn.Linear/dot_general", "eqx.nn.MLP/eqx.nn.Linear/dot_general#2"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the state is differentiated: no warning
        _, (grads, observed) = eqx.filter_jit(eqx.filter_value_and_grad(lambda ms: loss(ms[0], x, fp8_state=ms[1])))(
            (model, state)
        )
    assert all((np.asarray(h)[:, 0] > 0).all() for h in observed.histories.values())
    assert grads.layers[0].weight.dtype == jnp.float32


@pytest.mark.newest_only
def test_an_eager_call_runs_the_delayed_recipe():
    params, x, c = _problem()
    loss = jaxamp.amp(_mlp, compute_dtype=_recipe())
    state = jaxamp.fp8.init_fp8_state(loss, params, x, c)
    # The first step, eagerly: tensorwise's eager result, bit for bit.
    current = jaxamp.amp(_mlp, compute_dtype=jaxamp.fp8.Fp8Recipe(keep_small_bf16=None, keep_last_matmul_bf16=False))
    assert loss(params, x, c, fp8_state=state) == current(params, x, c)
    state = state.update(_step(loss)(params, state, x, c)[1][1])
    # Eager calls are not cached (the histories are this call's inputs): both run.
    eager = [loss(params, x, c, fp8_state=state) for _ in range(2)]
    assert loss.eager_cache.hits == 0 and eager[0] == eager[1]
    # Against jit: XLA keeps some bf16 values unrounded in a fused program and
    # moves float8 roundings (tensorwise's eager and jitted losses differ by
    # 0.6% here, measured); delayed's by 1.2%.
    jitted = jax.jit(lambda p, s: loss(p, x, c, fp8_state=s))(params, state)
    np.testing.assert_allclose(eager[0], jitted, rtol=2e-2)
