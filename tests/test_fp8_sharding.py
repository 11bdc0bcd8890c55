"""fp8 mode on a mesh: Explicit and Auto `jit`, and `shard_map` bodies.

The problem and layouts are those of `test_sharding_matrix` (a 2 x 2 mesh;
data parallel, FSDP and tensor parallel), which also checks fp8 gradients
against float32 and their shardings against `jax.grad`'s. Here: under `jit`
an operand split along a dimension the matmul does not contract gets a scale
per shard (on an Explicit mesh while tracing, a convolution's products each a
`shard_map`; on an Auto mesh when XLA partitions the program, each product a
`custom_partitioning` op, gathering an FSDP weight in float8), with
gradients exact where float8 is exact and no more all-reduces than the
bfloat16 step; every matmul, forward and backward,
runs in float8 on every mode; the gradient matmuls are JAX's own transposes at
the operands' types, so no trace made for one mesh is reused on another; and
inside `shard_map` the scales are per device, with no collective beyond the
user's own.

Tolerance against one-device fp8: XLA may skip a bfloat16 rounding
(``xla_allow_excess_precision``, on by default) in one partitioned program and
not in the other, and a changed bf16 bit moves a float8 rounding; measured
relative-norm differences: 0 on these shapes (1.9% max-abs on a 64x32x128
MLP). Hence 5e-2.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp._compat import saved_residuals

from jaxpr_walk import float_operand_dtypes, iter_eqns, matmul_operand_dtypes
from test_sharding_matrix import LAYOUTS, _loss_for, _mesh, _problem, _shardings

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals

FP8 = jaxamp.fp8.Fp8Recipe(keep_small_bf16=None, min_contraction=1, gemm_multiple=1, keep_last_matmul_bf16=False)
E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
TOLERANCE = 5e-2


def _sharded_args(mesh, layout):
    params, x, y = _problem()
    param_shardings, batch = _shardings(mesh, layout)
    return jax.device_put(params, param_shardings), jax.device_put(x, batch), jax.device_put(y, batch)


def _relative_error(got, want):
    return float(np.linalg.norm(np.asarray(got) - want) / np.linalg.norm(want))


@pytest.mark.newest_only
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("mode", ["auto", "explicit"])
def test_jit_on_a_mesh_matches_one_device_fp8_with_every_matmul_in_float8(mode, layout):
    loss = _loss_for(mode, layout)
    grad_fn = jax.grad(jaxamp.amp(loss, compute_dtype=FP8))
    one_device = jax.jit(jax.grad(jaxamp.amp(_loss_for("jit", layout), compute_dtype=FP8)))(*_problem())
    mesh = _mesh(mode)
    with jax.set_mesh(mesh):
        args = _sharded_args(mesh, layout)
        grads = jax.jit(grad_fn)(*args)
        jaxpr = jax.make_jaxpr(grad_fn)(*args)
    for name in one_device:
        # Per-shard scales (see test_per_shard_scales_*): the float32
        # tolerance of the shard_map test, which scales per device too.
        want = jax.grad(_loss_for("jit", layout))(*_problem())[name]
        assert _relative_error(grads[name], want) < 0.25, name
    if mode == "auto":  # every product scales per device: each of the 5 matmuls below in its own
        assert sum(e.primitive.name == "custom_partitioning" for e in iter_eqns(jaxpr)) == 5
    matmuls = matmul_operand_dtypes(jaxpr)
    # Two forward matmuls, each with two gradient matmuls but for the data's,
    # which nothing asks for.
    assert len(matmuls) == 5, matmuls
    assert all(d in (E4M3, E5M2) for _, dtypes in matmuls for d in dtypes), matmuls


def test_a_mesh_after_another_with_the_same_shapes():
    # The gradient matmuls used to be traced once per shape, without sharding:
    # after an Auto mesh the same shapes on an Explicit mesh failed.
    results = {}
    for mode in ("auto", "explicit", "auto"):
        mesh = _mesh(mode)
        with jax.set_mesh(mesh):
            grads = jax.jit(jax.grad(jaxamp.amp(_loss_for(mode, "fsdp"), compute_dtype=FP8)))(
                *_sharded_args(mesh, "fsdp")
            )
        results.setdefault(mode, []).append(grads)
    want = jax.grad(_loss_for("jit", "fsdp"))(*_problem())
    for name in results["auto"][0]:
        np.testing.assert_array_equal(results["auto"][0][name], results["auto"][1][name])
        # The Explicit mesh scales per shard (the Auto one globally): the
        # float32 tolerance of the other per-shard tests.
        assert _relative_error(results["explicit"][0][name], want[name]) < 0.25


def _collectives(jaxpr):
    names = ("psum", "psum2", "pmax", "pmin", "all_gather", "reduce_scatter", "psum_scatter", "all_to_all", "ppermute")
    return sorted(eqn.primitive.name for eqn in iter_eqns(jaxpr) if eqn.primitive.name in names)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_shard_map_scales_per_device_with_no_collective_of_its_own(layout):
    loss = _loss_for("shard_map", layout)
    mesh = _mesh("shard_map")
    specs = (LAYOUTS[layout], P("data"), P("data"))

    def step(compute_dtype):
        def body(params, x, y):
            value, grads = jax.value_and_grad(jaxamp.amp(loss, compute_dtype=compute_dtype))(params, x, y)
            return jax.lax.psum(value, "data"), grads

        return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(), LAYOUTS[layout]))

    with jax.set_mesh(mesh):
        args = _sharded_args(mesh, layout)
        fp8_jaxpr, bf16_jaxpr = (jax.make_jaxpr(step(c))(*args) for c in (FP8, "bf16"))
        value, grads = jax.jit(step(FP8))(*args)
    # The user's collectives (the FSDP all-gathers and their transposes, the
    # tensor-parallel psum) and nothing more: each device scales its own shards.
    assert _collectives(fp8_jaxpr) == _collectives(bf16_jaxpr)
    assert not float_operand_dtypes(fp8_jaxpr, ("pmax",))
    dtypes = matmul_operand_dtypes(fp8_jaxpr)
    assert len(dtypes) == 5 and all(d in (E4M3, E5M2) for _, ds in dtypes for d in ds), dtypes
    params, x, y = _problem()
    want_value, want = jax.value_and_grad(_loss_for("jit", layout))(params, x, y)
    assert abs(float(value) - float(want_value)) < 0.1 * abs(float(want_value))
    for name in want:
        assert grads[name].dtype == jnp.float32
        # Per-device scales: the float32 tolerance of the matrix test.
        assert _relative_error(grads[name], want[name]) < 0.25, name


# --- per-shard scales on Explicit meshes ---------------------------------------

EXACT = jaxamp.fp8.Fp8Recipe(
    keep_small_bf16=None,
    min_contraction=1,
    gemm_multiple=1,
    keep_last_matmul_bf16=False,
    attention=True,
    power_of_two_scales=True,
)


def _powers_of_two(rng, *shape):
    # Exact in e4m3 and e5m2 once divided by a power-of-two scale: float8
    # matmuls then equal float32 ones, whatever scale each block gets. The
    # second half of every dimension is 8x the first, so the blocks' scales
    # differ and a scale applied to the wrong block shows.
    exponents = rng.integers(-3, 3, shape)
    for dim, size in enumerate(shape):
        exponents = exponents + 3 * (np.arange(size) >= size // 2).reshape((-1,) + (1,) * (len(shape) - dim - 1))
    return (rng.choice([-1, 1], shape) * 2.0**exponents).astype(np.float32)


PER_SHARD_CASES = {
    # name: (function, [(shape, spec) of x, w, c]); the loss is sum(f(x, w) * c).
    "data parallel": ("bd,dh->bh", [((8, 16), P("data")), ((16, 32), P()), ((8, 32), P("data"))]),
    "batch and sequence": (
        "bsd,dh->bsh",
        [((4, 8, 16), P("data", "model")), ((16, 32), P()), ((4, 8, 32), P("data", "model"))],
    ),
    "column parallel": (
        "bd,dh->bh",
        [((8, 16), P("data")), ((16, 32), P(None, "model")), ((8, 32), P("data", "model"))],
    ),
    "transposed weight": ("bd,hd->bh", [((8, 16), P("data")), ((32, 16), P("model")), ((8, 32), P("data", "model"))]),
    "row parallel": ("bd,dh->bh", [((8, 16), P("data", "model")), ((16, 32), P("model")), ((8, 32), P("data"))]),
    "fsdp weight": ("bd,dh->bh", [((8, 16), P("data")), ((16, 32), P("data")), ((8, 32), P("data"))]),
}


@pytest.mark.newest_only
@pytest.mark.parametrize("mode", ["auto", "explicit"])
@pytest.mark.parametrize("case", sorted(PER_SHARD_CASES))
def test_per_shard_scales_give_exact_gradients_and_keep_shardings(case, mode):
    subscripts, layout = PER_SHARD_CASES[case]
    rng = np.random.default_rng(0)
    values = [_powers_of_two(rng, *shape) for shape, _ in layout]

    def loss(x, w, c, out_sharding=None):
        return jnp.sum(jnp.einsum(subscripts, x, w, out_sharding=out_sharding) * c)

    want = jax.grad(loss, argnums=(0, 1))(*values)
    if case == "row parallel" and mode == "explicit":  # the user says where the sum over "model" goes
        loss = functools.partial(loss, out_sharding=layout[2][1])
    mesh = _mesh(mode)
    with jax.set_mesh(mesh):
        args = [jax.device_put(v, spec) for v, (_, spec) in zip(values, layout)]
        grad_fn = jax.grad(jaxamp.amp(loss, compute_dtype=EXACT), argnums=(0, 1))
        got = jax.jit(grad_fn)(*args)
        plain = jax.jit(jax.grad(loss, argnums=(0, 1)))(*args)
        jaxpr = jax.make_jaxpr(grad_fn)(*args)
    for g, w, p in zip(got, want, plain):
        np.testing.assert_array_equal(np.asarray(g), w)
        assert jax.typeof(g) == jax.typeof(p)
    dtypes = matmul_operand_dtypes(jaxpr)
    assert len(dtypes) == 3 and all(d in (E4M3, E5M2) for _, ds in dtypes for d in ds), dtypes


def _all_reduces(compiled_text):
    return len(re.findall(r" all-reduce(?:-start)?\(", compiled_text))


@pytest.mark.parametrize(
    "mode, layout, extra", [("explicit", "dp", 0), ("explicit", "tp", 1), ("auto", "dp", 0), ("auto", "tp", 0)]
)
def test_per_shard_scales_need_no_all_reduce_beyond_bf16(mode, layout, extra):
    # Data parallel: every amax is of a batch-sharded activation or cotangent,
    # or of a replicated weight, so fp8 adds no all-reduce. Tensor parallel on
    # an Explicit mesh: the row-parallel matmul's operands are split along its
    # contraction, and their scales agree across the "model" group (one
    # all-reduce, as Transformer Engine reduces amaxes over the tensor-parallel
    # group); on an Auto mesh each device scales its own partial product
    # before the sum bf16 mode makes too.
    mesh = _mesh(mode)
    counts = {}
    with jax.set_mesh(mesh):
        args = _sharded_args(mesh, layout)
        for compute_dtype in ("bf16", FP8):
            step = jax.jit(jax.grad(jaxamp.amp(_loss_for(mode, layout), compute_dtype=compute_dtype)))
            counts[str(compute_dtype)] = _all_reduces(step.lower(*args).compile().as_text())
    assert counts[str(FP8)] == counts["bf16"] + extra, counts


@pytest.mark.newest_only
def test_auto_mesh_fsdp_gathers_float8_weights_after_one_agreed_scale():
    # Each device scales its own activation and cotangent shards; an FSDP
    # weight's shards agree on one scale (XLA combines the weights' amaxes
    # into one all-reduce) and each device all-gathers the float8 copy, as on
    # an Explicit mesh and torchao's float8 all-gather. XLA's CPU backend moves
    # a float8 all-gather as f16 (nothing else in the step is f16); before,
    # XLA gathered the float32 weights. Measured, JAX 0.10 and 0.12: fp8 2
    # all-reduces and 3 all-gathers, against bf16's 3 all-reduces, 1-2
    # float32 all-gathers and 3 collective-permutes.
    mesh = _mesh("auto")
    counts = {}
    with jax.set_mesh(mesh):
        args = _sharded_args(mesh, "fsdp")
        for compute_dtype in ("bf16", FP8):
            step = jax.jit(jax.grad(jaxamp.amp(_loss_for("auto", "fsdp"), compute_dtype=compute_dtype)))
            hlo = step.lower(*args).compile().as_text()
            gathered = re.findall(r"= (\w+)\[[\d,]*\]\S* all-gather(?:-start)?\(", hlo)
            counts[str(compute_dtype)] = (_all_reduces(hlo), gathered)
    (fp8_all_reduces, fp8_gathered), (bf16_all_reduces, _) = counts[str(FP8)], counts["bf16"]
    assert fp8_all_reduces == 2 < bf16_all_reduces, counts
    assert len(fp8_gathered) == 3 and set(fp8_gathered) <= {"f8e4m3fn", "f16"}, counts


def test_auto_mesh_scales_each_device_apart():
    # Rows of about 1 on the first "data" shard and of 2**-16 on the second:
    # one scale for the whole tensor puts the small rows among e4m3's
    # subnormals (2 bits of precision or fewer), a scale per shard keeps
    # their 3 mantissa bits.
    x = np.ones((8, 16), np.float32) * (1.0 + np.arange(16) / 16)
    x[4:] *= 2.0**-16
    w = np.eye(16, dtype=np.float32)
    matmul = jax.jit(jaxamp.amp(lambda x, w: x @ w, compute_dtype=FP8))
    one_device = np.asarray(matmul(x, w), np.float32)
    mesh = _mesh("auto")
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))
        sharded = np.asarray(matmul(xs, w), np.float32)
        report = str(jaxamp.explain(lambda x, w: x @ w, compute_dtype=FP8)(xs, w))
    assert "a scale per device's shard as XLA splits the operands (an Auto mesh; saved in bf16)" in report, report

    def error(got):
        return np.abs(got[4:] - x[4:]).max() / np.abs(x[4:]).max()

    assert error(sharded) <= 2.0**-4 < error(one_device), (error(sharded), error(one_device))
    np.testing.assert_array_equal(sharded[:4], one_device[:4])  # the first shard's amax is the global one


def test_an_exported_auto_mesh_step_takes_one_scale_per_tensor_and_says_so(fresh_warnings):
    # jax.export cannot serialize a custom partitioner: the exported program
    # computes what one device does (tensorwise), with one warning.
    x = jax.random.normal(jax.random.key(0), (16, 32))
    w = jax.random.normal(jax.random.key(1), (32, 32)) / 6

    def loss(w, x):
        return jnp.sum((x @ w @ w).astype(jnp.float32) ** 2)

    step = jax.jit(jax.grad(jaxamp.amp(loss, compute_dtype=FP8)))
    mesh = _mesh("auto")
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))
        with pytest.warns(UserWarning, match="exported program .* one scale per tensor") as caught:
            exported = jax.export.export(step)(w, xs)
        got = exported.call(w, xs)
    assert sum("exported program" in str(w.message) for w in caught) == 1
    assert "CustomSPMDPartitioning" not in exported.mlir_module()
    assert _relative_error(got, jax.grad(loss)(w, x)) < 0.25  # fp8's tolerance against float32 here


def test_vmap_on_an_auto_mesh_scales_each_example_as_one_device_does():
    # Per-example gradients: each example gets its own scales (vmap's
    # semantics, as on one device), and each device scales its own examples.
    def loss(w, x):
        return jnp.sum((x @ w).astype(jnp.float32) ** 2)

    w = jax.random.normal(jax.random.key(0), (32, 32)) / 6
    x = jax.random.normal(jax.random.key(1), (8, 16, 32)) * (2.0 ** jnp.arange(-4, 4))[:, None, None]
    grad = jax.jit(jax.grad(jaxamp.amp(loss, compute_dtype=FP8)))
    per_example = jax.jit(jax.vmap(grad, in_axes=(None, 0)))
    want = per_example(w, x)
    mesh = _mesh("auto")
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))
        got = per_example(w, xs)
        one_at_a_time = [grad(w, xs[i]) for i in range(len(x))]
        jaxpr = jax.make_jaxpr(per_example)(w, xs)
    for i, g in enumerate(one_at_a_time):
        assert _relative_error(got[i], g) < 1e-5, i  # what vmap means
        assert _relative_error(got[i], want[i]) < TOLERANCE, i
    assert sum(e.primitive.name == "custom_partitioning" for e in iter_eqns(jaxpr)) == 2


def _conv_net(params, x):
    dims = ("NHWC", "HWIO", "NHWC")
    h = jax.nn.relu(jax.lax.conv_general_dilated(x, params["k1"], (1, 1), "SAME", dimension_numbers=dims))
    h = jax.lax.conv_general_dilated(h, params["k2"], (1, 1), "SAME", dimension_numbers=dims)
    return jnp.mean(h.astype(jnp.float32) ** 2)


def _conv_problem():
    k = jax.random.split(jax.random.key(0), 3)
    params = {"k1": jax.random.normal(k[0], (3, 3, 16, 32)) / 12, "k2": jax.random.normal(k[1], (3, 3, 32, 32)) / 17}
    x = jax.random.normal(k[2], (16, 8, 8, 16)) * jnp.arange(1, 17, dtype=jnp.float32)[:, None, None, None]
    return params, x


def test_auto_mesh_convolutions_scale_per_device_with_no_all_reduce_beyond_bf16():
    # A data-parallel two-convolution step: 5 all-reduces with one scale per
    # tensor (before), 1 (the kernels' gradients) with a scale per device.
    params, x = _conv_problem()
    want = jax.grad(_conv_net)(params, x)
    mesh = _mesh("auto")
    counts = {}
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))
        for compute_dtype in ("bf16", FP8):
            step = jax.jit(jax.grad(jaxamp.amp(_conv_net, compute_dtype=compute_dtype)))
            counts[str(compute_dtype)] = _all_reduces(step.lower(params, xs).compile().as_text())
        grads = step(params, xs)
        jaxpr = jax.make_jaxpr(step)(params, xs)
        per_example = jax.jit(jax.vmap(jax.grad(jaxamp.amp(_conv_net, compute_dtype=FP8)), in_axes=(None, 0)))
        examples = per_example(params, xs[:, None])
        one = step(params, xs[3:4])
        # Forward mode, the batch a constant of the jit (XLA then proposes
        # shardings no mesh names, all replicated).
        loss = jaxamp.amp(_conv_net, compute_dtype=FP8)
        value, tangent = jax.jit(lambda p: jax.jvp(lambda p: loss(p, xs), (p,), (p,)))(params)
    want_value, want_tangent = jax.jvp(lambda p: _conv_net(p, x), (params,), (params,))
    assert abs(float(tangent) - float(want_tangent)) < 0.1 * abs(float(want_tangent))
    assert counts[str(FP8)] == counts["bf16"], counts
    for name in want:  # the float32 tolerance of the other per-shard tests
        assert _relative_error(grads[name], want[name]) < 0.25, name
    convs = float_operand_dtypes(jaxpr, ("conv_general_dilated",))
    assert len(convs) == 5 and all(d in (E4M3, E5M2) for _, ds in convs for d in ds), convs
    assert sum(e.primitive.name == "custom_partitioning" for e in iter_eqns(jaxpr)) == 5
    # vmap: each example scaled apart, as one example alone on the mesh.
    for name in want:
        assert _relative_error(examples[name][3], one[name]) < 1e-5, name


@pytest.mark.newest_only
def test_an_fsdp_weight_is_gathered_in_float8_after_one_agreed_scale():
    # The FSDP layout of the sharding matrix on an Explicit mesh: each weight's
    # amax is reduced once (XLA combines the three scalars into one
    # all-reduce), its float8 copy all-gathered, and the activations and
    # cotangents scaled per shard. bf16 mode: 3 all-reduces, 1 all-gather and
    # 4 collective-permutes. (XLA's CPU backend moves a float8 all-gather as
    # 16-bit values: the gathered operands below are f16 there.)
    mesh = _mesh("explicit")
    with jax.set_mesh(mesh):
        args = _sharded_args(mesh, "fsdp")
        fp8 = jax.jit(jax.grad(jaxamp.amp(_loss_for("explicit", "fsdp"), compute_dtype=FP8)))
        jaxpr = jax.make_jaxpr(jax.grad(jaxamp.amp(_loss_for("explicit", "fsdp"), compute_dtype=FP8)))(*args)
        hlo = fp8.lower(*args).compile().as_text()
    gathered = [
        eqn for eqn in iter_eqns(jaxpr)
        if eqn.primitive.name == "reshard" and eqn.invars[0].aval.dtype == E4M3
    ]  # fmt: skip
    assert len(gathered) >= 2, [e.primitive.name for e in iter_eqns(jaxpr)]
    assert _all_reduces(hlo) == 2, hlo


def _replicated(mesh, tree):
    return jax.device_put(tree, jax.sharding.NamedSharding(mesh, P()))


@pytest.mark.newest_only
def test_explicit_mesh_convolutions_scale_per_device_with_float8_residuals():
    # The data-parallel two-convolution step on an Explicit mesh: 5
    # all-reduces with one scale per tensor (before), 1 (the kernels'
    # gradients) as in bf16 with each product a shard_map over the devices.
    # Residuals stay float8, a scale per device's block.
    params, x = _conv_problem()
    want = jax.grad(_conv_net)(params, x)
    want_value, want_tangent = jax.jvp(lambda p: _conv_net(p, x), (params,), (params,))
    mesh = _mesh("explicit")
    loss = jaxamp.amp(_conv_net, compute_dtype=FP8)
    counts = {}
    with jax.set_mesh(mesh):
        # JAX needs the kernels placed: its convolution transpose cannot type an
        # unplaced kernel's gradient beside a split batch (in any precision).
        ps, xs = _replicated(mesh, params), jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))
        for compute_dtype in ("bf16", FP8):
            step = jax.jit(jax.grad(jaxamp.amp(_conv_net, compute_dtype=compute_dtype)))
            counts[str(compute_dtype)] = _all_reduces(step.lower(ps, xs).compile().as_text())
            grads = step(ps, xs)
            shardings = {k: jax.typeof(v).sharding.spec for k, v in grads.items()}
            counts[str(compute_dtype) + " shardings"] = shardings
        jaxpr = jax.make_jaxpr(step)(ps, xs)
        residuals = saved_residuals(loss, ps, xs)
        value, tangent = jax.jit(lambda p: jax.jvp(lambda p: loss(p, xs), (p,), (p,)))(ps)
        report = str(jaxamp.explain(_conv_net, compute_dtype=FP8)(ps, xs))
    assert counts[str(FP8)] == counts["bf16"] == 1, counts
    assert counts[str(FP8) + " shardings"] == counts["bf16 shardings"], counts  # amp keeps JAX's shardings
    for name in want:  # the float32 tolerance of the other per-shard tests
        assert _relative_error(grads[name], want[name]) < 0.25, name
    assert abs(float(tangent) - float(want_tangent)) < 0.1 * abs(float(want_tangent))
    convs = float_operand_dtypes(jaxpr, ("conv_general_dilated",))
    assert len(convs) == 5 and all(d in (E4M3, E5M2) for _, ds in convs for d in ds), convs
    assert sum(e.primitive.name == "shard_map" for e in iter_eqns(jaxpr)) >= 5
    saved = [(a.shape, a.dtype) for a, _ in residuals]
    assert ((16, 8, 8, 16), E4M3) in saved and ((16, 8, 8, 32), E4M3) in saved, saved
    assert ((2,), jnp.float32) in saved, saved  # a scale per device along "data"
    assert report.count("a scale per device's shard along data") == 2, report


@pytest.mark.parametrize("mode", ["auto", "explicit"])
def test_a_convolution_scales_each_device_apart(mode):
    # A 1x1 convolution with the identity kernel: examples of about 1 on the
    # first shard and of 2**-16 on the others. One scale for the tensor puts
    # the small ones among e4m3's subnormals; a scale per device keeps their 3
    # mantissa bits.
    x = np.ones((8, 2, 2, 16), np.float32) * (1.0 + np.arange(16) / 16)
    x[2:] *= 2.0**-16
    kernel = np.eye(16, dtype=np.float32)[None, None]

    def conv(x, kernel):
        return jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    amp_conv = jax.jit(jaxamp.amp(conv, compute_dtype=FP8))
    one_device = np.asarray(amp_conv(x, kernel), np.float32)
    mesh = jax.make_mesh((4,), ("data",), axis_types=(_mesh(mode).axis_types[0],), devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))
        sharded = np.asarray(amp_conv(xs, _replicated(mesh, kernel)), np.float32)

    def error(got):
        return np.abs(got[2:] - x[2:]).max() / np.abs(x[2:]).max()

    assert error(sharded) <= 2.0**-4 < error(one_device), (error(sharded), error(one_device))
    np.testing.assert_array_equal(sharded[:2], one_device[:2])  # the first shard's amax is the global one


def _grouped_conv_net(params, x):
    dims = ("NHWC", "HWIO", "NHWC")
    h = jax.nn.relu(jax.lax.conv_general_dilated(x, params["k1"], (1, 1), "SAME", dimension_numbers=dims))
    h = jax.lax.conv_general_dilated(h, params["k2"], (1, 1), "SAME", dimension_numbers=dims, feature_group_count=2)
    return jnp.mean(h.astype(jnp.float32) ** 2)


@pytest.mark.parametrize("mode", ["auto", "explicit"])
def test_grouped_convolutions_scale_per_device_with_their_features_whole(mode):
    # Feature groups: the batch is split, each group's features stay whole.
    # On this 2x2 mesh (batch over "data", "model" unused) XLA's own
    # partitioning of the grouped kernel gradient is wrong on JAX 0.10-0.12's
    # CPU backend (relative error 1.0 in float32 and bf16; measured, not
    # asserted); the per-device products compute it themselves.
    params, x = _conv_problem()
    params = dict(params, k2=jax.random.normal(jax.random.key(3), (3, 3, 16, 32)) / 12)
    want = jax.grad(_grouped_conv_net)(params, x)
    mesh = _mesh(mode)
    with jax.set_mesh(mesh):
        ps, xs = _replicated(mesh, params), jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))
        step = jax.jit(jax.grad(jaxamp.amp(_grouped_conv_net, compute_dtype=FP8)))
        grads = step(ps, xs)
        jaxpr = jax.make_jaxpr(step)(ps, xs)
        all_reduces = _all_reduces(step.lower(ps, xs).compile().as_text())
    for name in want:
        assert _relative_error(grads[name], want[name]) < 0.25, name
    per_device = {"auto": "custom_partitioning", "explicit": "shard_map"}[mode]
    assert sum(e.primitive.name == per_device for e in iter_eqns(jaxpr)) >= 5
    assert all_reduces == 1  # the kernels' gradients
