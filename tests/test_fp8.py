"""amp's fp8 mode (`compute_dtype=EVERY`, `jaxamp.fp8.Fp8Recipe`): float8 matmuls with current scaling.

A small zoo (an MLP, a convolutional net, a transformer whose blocks run in a
scan) has every matmul in float8 forward and backward, losses within 10% and
gradients within cosine 0.98 of float32; quantisation stays within e4m3's
rounding bound; the gradient matmuls reproduce JAX's own transposes for every
layout; small matmuls, the last matmul, pinned scopes and `amp_stop` stay out
of float8 and `explain` says why; non-finite inputs make the loss non-finite;
bad input is rejected with a clear error.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxamp
from jaxamp import Fp8Recipe, amp
from jaxamp.fp8._matmul import quantize

from jaxpr_walk import iter_eqns, matmul_operand_dtypes
from small_models import SmallCNN, cross_entropy

# These tests' matmuls are small: all of them in float8, the size rule off.
FP8 = jaxamp.fp8.Fp8Recipe(keep_small_bf16=None)

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals

E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
# Every matmul these small models have in float8: the defaults keep batched,
# grouped and last matmuls and sizes no float8 GEMM takes in bf16
# (test_fp8_defaults.py), which would leave little to test here.
EVERY = Fp8Recipe(keep_small_bf16=None, attention=True, grouped=True, keep_last_matmul_bf16=False, gemm_multiple=1)
FLOAT8 = (E4M3, E5M2)
KEYS = jax.random.split(jax.random.PRNGKey(0), 12)

# e4m3 keeps 3 mantissa bits: rounding to nearest errs by at most 2**-4
# relative, for values in its normal range (scaled magnitude >= 2**-6).
E4M3_RELATIVE_BOUND = 2.0**-4
# fp8 against float32 on the zoo: the acceptance figures.
LOSS_RTOL, GRAD_COSINE = 0.10, 0.98


# --- the zoo: every matmul has a contraction of at least 16 ---------------------


def mlp():
    model = eqx.nn.MLP(32, 10, width_size=64, depth=2, key=KEYS[0])
    x = jax.random.normal(KEYS[1], (16, 32))
    labels = jnp.arange(16) % 10

    def loss(model, x):
        logits = jax.vmap(model)(x)
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(16), labels])

    return loss, (model, x)


def conv_net():
    # 2 input channels x 3x3 = 18 products per output; the grouped
    # convolution sums 8 x 9 = 72.
    model = SmallCNN(2, 16, stride=2, key=KEYS[2])
    images = jax.random.normal(KEYS[3], (4, 2, 8, 8))
    labels = jnp.arange(4)

    def loss(model, images):
        return cross_entropy(model, images, labels)

    return loss, (model, images)


D, T, HEADS, LAYERS, VOCAB = 32, 16, 2, 2, 32


def _layer_norm(x):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) * lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)


@jax.custom_vjp
def _attention(q, k, v):
    return _attention_fwd(q, k, v)[0]


def _attention_fwd(q, k, v):
    scores = jnp.einsum("htd,hsd->hts", q, k) / np.sqrt(q.shape[-1])
    mask = jnp.tril(jnp.ones((T, T), bool))
    probs = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
    return jnp.einsum("hts,hsd->htd", probs, v), (q, k, v, probs)


def _attention_bwd(res, g):
    q, k, v, probs = res
    dv = jnp.einsum("hts,htd->hsd", probs, g)
    dprobs = jnp.einsum("htd,hsd->hts", g, v)
    dscores = probs * (dprobs - (dprobs * probs).sum(-1, keepdims=True)) / np.sqrt(q.shape[-1])
    return jnp.einsum("hts,hsd->htd", dscores, k), jnp.einsum("hts,htd->hsd", dscores, q), dv


_attention.defvjp(_attention_fwd, _attention_bwd)


@jax.jit  # a jit'd block, run by a scan under remat
def _block(p, x):
    q, k, v = jnp.split(_layer_norm(x) @ p["qkv"], 3, axis=-1)
    heads = lambda a: a.reshape(T, HEADS, D // HEADS).transpose(1, 0, 2)  # noqa: E731
    att = _attention(heads(q), heads(k), heads(v)).transpose(1, 0, 2).reshape(T, D)
    x = x + att @ p["proj"]
    return x + jax.nn.gelu(_layer_norm(x) @ p["up"]) @ p["down"]


def transformer_scan():
    def dense(key, n_in, n_out):
        return jax.random.normal(key, (n_in, n_out)) / np.sqrt(n_in)

    def init_block(key):
        k = jax.random.split(key, 4)
        return {
            "qkv": dense(k[0], D, 3 * D),
            "proj": dense(k[1], D, D),
            "up": dense(k[2], D, 4 * D),
            "down": dense(k[3], 4 * D, D),
        }

    params = {
        "blocks": jax.vmap(init_block)(jax.random.split(KEYS[4], LAYERS)),
        "embed": jax.random.normal(KEYS[5], (VOCAB, D)),
    }
    tokens = jax.random.randint(KEYS[6], (T,), 0, VOCAB)

    def loss(params, tokens):
        x = params["embed"][tokens]
        x, _ = lax.scan(jax.checkpoint(lambda x, p: (_block(p, x), None)), x, params["blocks"])
        logits = _layer_norm(x) @ params["embed"].T
        # Next-token prediction of random tokens: a loss near log(VOCAB), not
        # near 0, where a relative tolerance would mean nothing.
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(T - 1), tokens[1:]])

    return loss, (params, tokens)


ZOO = [mlp, conv_net, transformer_scan]


def _is_float(dtype):
    return jnp.issubdtype(dtype, jnp.floating)


@pytest.mark.parametrize("make", ZOO, ids=lambda m: m.__name__)
def test_every_matmul_in_float8_forward_and_backward(make):
    loss, (params, *batch) = make()
    mixed = amp(loss, compute_dtype=EVERY)
    params_only = lambda p: mixed(p, *batch)  # noqa: E731
    forward = matmul_operand_dtypes(eqx.filter_make_jaxpr(params_only)(params)[0])
    assert forward and all(dts == (E4M3, E4M3) for _, dts in forward), forward
    backward = matmul_operand_dtypes(eqx.filter_make_jaxpr(eqx.filter_grad(params_only))(params)[0])
    assert all(d in FLOAT8 for _, dts in backward for d in dts), backward
    # Each forward matmul is recomputed or reused and has two gradient
    # matmuls, but for the gradient of the data, which nothing asks for.
    assert len(backward) >= 3 * len(forward) - 1
    # Dot gradients take the cotangent in e5m2; convolution gradients need one
    # dtype on both sides and run in e4m3 (see jaxamp.fp8.Fp8Recipe.gradient_dtype).
    for name, dts in backward:
        if E5M2 in dts:
            assert name != "conv_general_dilated" and sorted(dts) == sorted((E5M2, E4M3)), (name, dts)
    assert any(E5M2 in dts for name, dts in backward if name == "dot_general")


def _cosine(a, b):
    return float(a @ b / (jnp.linalg.norm(a) * jnp.linalg.norm(b)))


def _flat_grads(grads):
    leaves = jax.tree.leaves(eqx.filter(grads, eqx.is_inexact_array))
    assert leaves and all(g.dtype == jnp.float32 for g in leaves), [g.dtype for g in leaves]
    return jnp.concatenate([g.ravel() for g in leaves])


@pytest.mark.parametrize("make", ZOO, ids=lambda m: m.__name__)
@pytest.mark.newest_only
def test_loss_and_gradients_close_to_float32(make):
    loss, args = make()
    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(amp(loss, compute_dtype=EVERY)))(*args)
    value32, grads32 = eqx.filter_jit(eqx.filter_value_and_grad(loss))(*args)
    assert value.dtype == jnp.float32
    np.testing.assert_allclose(value, value32, rtol=LOSS_RTOL)
    flat, flat32 = _flat_grads(grads), _flat_grads(grads32)
    assert bool(jnp.all(jnp.isfinite(flat)))
    assert _cosine(flat, flat32) > GRAD_COSINE


# --- quantisation ------------------------------------------------------------------


@pytest.mark.newest_only
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantize_round_trip_within_e4m3_bound(dtype):
    # Magnitudes over 12 binades, both signs.
    binades = jax.random.randint(KEYS[8], (4096,), -6, 6)
    x = (jax.random.normal(KEYS[7], (4096,)) * 2.0**binades).astype(dtype)
    q, scale = quantize(x, jnp.float8_e4m3fn)
    assert q.dtype == E4M3 and scale.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == 448.0  # amax maps to e4m3's maximum
    x32 = x.astype(jnp.float32)
    normal = jnp.abs(x32 / scale) >= 2.0**-6
    error = jnp.abs(q.astype(jnp.float32) * scale - x32)
    assert int(normal.sum()) > 3000
    assert bool(jnp.all(jnp.where(normal, error <= E4M3_RELATIVE_BOUND * jnp.abs(x32), True)))


@pytest.mark.newest_only
def test_quantize_edge_cases():
    q, scale = quantize(jnp.zeros((3, 3)), jnp.float8_e4m3fn)
    assert float(scale) == 1.0 and not bool(jnp.any(q.astype(jnp.float32)))
    q, scale = quantize(jnp.array([1e6, -3.0]), jnp.float8_e5m2)  # e5m2's maximum is 57344
    assert float(q.astype(jnp.float32)[0]) == 57344.0 and float(scale) == pytest.approx(1e6 / 57344)
    for bad in (jnp.inf, jnp.nan):
        q, scale = quantize(jnp.array([1.0, bad]), jnp.float8_e4m3fn)
        # Not saturated to a finite value: the matmul's result goes non-finite.
        assert not bool(jnp.all(jnp.isfinite(q.astype(jnp.float32) * scale)))


@pytest.mark.newest_only
@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
def test_a_nonfinite_entry_poisons_only_its_row_as_in_bf16(bad):
    w = jax.random.normal(jax.random.PRNGKey(0), (32, 16))
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 32)).at[3, 5].set(bad)
    q, scale = quantize(x, jnp.float8_e4m3fn)
    assert bool(jnp.isfinite(scale)) and float(scale) == pytest.approx(float(jnp.max(jnp.abs(x.at[3, 5].set(0)))) / 448)
    for compute_dtype in ("bf16", FP8):
        out = amp(lambda x, w: x @ w, compute_dtype=compute_dtype)(x, w)
        rows_hit = np.flatnonzero(~np.all(np.isfinite(np.asarray(out, np.float32)), axis=1))
        assert rows_hit.tolist() == [3], compute_dtype
    # The other rows keep fp8's accuracy (within 15% of float32, relative norm).
    others = np.delete(np.arange(8), 3)
    out = np.asarray(amp(lambda x, w: x @ w, compute_dtype=EVERY)(x, w), np.float32)[others]
    want = np.asarray(x @ w)[others]
    assert np.linalg.norm(out - want) / np.linalg.norm(want) < 0.15


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
@pytest.mark.newest_only
def test_nonfinite_input_makes_loss_and_gradients_nonfinite(bad):
    loss, (model, x) = mlp()
    x = x.at[3, 5].set(bad)
    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(amp(loss, compute_dtype=EVERY)))(model, x)
    assert not bool(jnp.isfinite(value))
    assert not bool(jnp.all(jnp.isfinite(_flat_grads(grads))))


# --- the gradient matmuls are JAX's own transposes ----------------------------------

# Operands and cotangents that are powers of two quantise exactly (7 * 2**k
# after scaling: three significant bits, which e4m3 and e5m2 both hold), so
# fp8 mode must reproduce float32's gradients up to float32 rounding: any
# wrong dimension, padding or group in a transposed matmul shows.


# The forward matmul and the two gradient matmuls, e5m2 cotangent x e4m3 operand.
FORWARD_AND_TWO_GRADIENTS = [("float8_e4m3fn", "float8_e4m3fn")] + [("float8_e4m3fn", "float8_e5m2")] * 2


def _format_pairs(found):
    return sorted(tuple(sorted(np.dtype(d).name for d in dts)) for _, dts in found)


def _powers_of_two(key, shape):
    k1, k2 = jax.random.split(key)
    signs = jnp.where(jax.random.bernoulli(k1, 0.5, shape), 1.0, -1.0)
    return signs * 2.0 ** jax.random.randint(k2, shape, -3, 3).astype(jnp.float32)


DOTS = {
    "matrix": ((6, 32), (32, 5), (((1,), (0,)), ((), ()))),
    "transposed": ((32, 6), (5, 32), (((0,), (1,)), ((), ()))),
    "batched": ((3, 6, 16), (3, 16, 4), (((2,), (1,)), ((0,), (0,)))),
    "two_contractions": ((4, 8, 3), (8, 5, 4), (((0, 1), (2, 0)), ((), ()))),
    "batch_last": ((16, 5, 2), (7, 16, 2), (((0,), (1,)), ((2,), (2,)))),
}


def _assert_float32_gradients_match(fp8_grad, loss, lhs, rhs):
    # Operands that are powers of two quantise exactly: the float8 gradients
    # equal float32's to rounding, and come back in float32.
    for got, want in zip(jax.jit(fp8_grad)(lhs, rhs), jax.grad(loss, (0, 1))(lhs, rhs)):
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.newest_only
@pytest.mark.parametrize("name", sorted(DOTS))
def test_dot_general_gradients_match_float32(name):
    lhs_shape, rhs_shape, dims = DOTS[name]
    lhs, rhs = _powers_of_two(KEYS[9], lhs_shape), _powers_of_two(KEYS[10], rhs_shape)
    out_shape = jax.eval_shape(lambda a, b: lax.dot_general(a, b, dims), lhs, rhs).shape
    weights = _powers_of_two(KEYS[11], out_shape)

    def loss(lhs, rhs):
        return jnp.sum(lax.dot_general(lhs, rhs, dims) * weights)

    fp8_grad = jax.grad(amp(loss, compute_dtype=EVERY), (0, 1))
    found = matmul_operand_dtypes(jax.make_jaxpr(fp8_grad)(lhs, rhs))
    assert _format_pairs(found) == FORWARD_AND_TWO_GRADIENTS
    _assert_float32_gradients_match(fp8_grad, loss, lhs, rhs)


CONVS = {
    "same": dict(window_strides=(1, 1), padding="SAME"),
    "strided_valid": dict(window_strides=(2, 2), padding="VALID"),
    "dilated": dict(window_strides=(1, 1), padding=((2, 1), (0, 2)), rhs_dilation=(2, 1)),
    "lhs_dilated": dict(window_strides=(1, 1), padding=((1, 1), (1, 1)), lhs_dilation=(2, 2)),
    "grouped": dict(window_strides=(1, 1), padding="SAME", feature_group_count=2),
}


@pytest.mark.newest_only
@pytest.mark.parametrize("name", sorted(CONVS))
def test_convolution_gradients_match_float32(name):
    options = CONVS[name]
    groups = options.get("feature_group_count", 1)
    lhs = _powers_of_two(KEYS[9], (2, 4, 7, 6))  # NCHW
    rhs = _powers_of_two(KEYS[10], (6, 4 // groups, 3, 3))  # OIHW
    conv = lambda a, b: lax.conv_general_dilated(a, b, **options)  # noqa: E731
    weights = _powers_of_two(KEYS[11], jax.eval_shape(conv, lhs, rhs).shape)

    def loss(lhs, rhs):
        return jnp.sum(conv(lhs, rhs) * weights)

    fp8_grad = jax.grad(amp(loss, compute_dtype=dataclasses.replace(EVERY, min_contraction=1)), (0, 1))
    backward = matmul_operand_dtypes(jax.make_jaxpr(fp8_grad)(lhs, rhs))
    assert len(backward) == 3 and all(dts == (E4M3, E4M3) for _, dts in backward), backward
    _assert_float32_gradients_match(fp8_grad, loss, lhs, rhs)


@pytest.mark.skipif(not hasattr(lax, "ragged_dot"), reason="no lax.ragged_dot on this JAX")
def test_ragged_dot_in_float8_forward_and_backward():
    lhs, rhs = _powers_of_two(KEYS[9], (6, 16)), _powers_of_two(KEYS[10], (2, 16, 4))
    group_sizes = jnp.array([2, 4], jnp.int32)
    weights = _powers_of_two(KEYS[11], (6, 4))

    def loss(lhs, rhs):
        return jnp.sum(lax.ragged_dot(lhs, rhs, group_sizes) * weights)

    fp8_grad = jax.grad(amp(loss, compute_dtype=EVERY), (0, 1))
    found = matmul_operand_dtypes(jax.make_jaxpr(fp8_grad)(lhs, rhs))
    assert _format_pairs(found) == FORWARD_AND_TWO_GRADIENTS
    _assert_float32_gradients_match(fp8_grad, loss, lhs, rhs)


# --- what stays out of float8, and explain ------------------------------------------


def _two_layers(p, x):
    h = jnp.tanh(x @ p["w"])
    with jax.named_scope("head"):
        return jnp.sum(h @ p["head"])


P = {"w": jax.random.normal(KEYS[0], (32, 32)) / 6, "head": jax.random.normal(KEYS[1], (32, 10)) / 6}
X = jax.random.normal(KEYS[2], (8, 32))


def _formats(fn, *args, **amp_options):
    return [dts for _, dts in matmul_operand_dtypes(jax.make_jaxpr(amp(fn, **amp_options))(*args))]


def test_small_matmuls_stay_bf16_and_explain_says_why():
    def f(p, x):
        small = x[:, :8] @ p["w"][:8]  # contraction 8
        ints = x.astype(jnp.int32) @ p["w"].astype(jnp.int32)  # not a float matmul
        return jnp.sum(small) + jnp.sum(ints) + _two_layers(p, x)

    bf16 = np.dtype(jnp.bfloat16)
    int32 = np.dtype(jnp.int32)
    jaxpr = jax.make_jaxpr(amp(f, compute_dtype=EVERY))(P, X)
    operands = [tuple(v.aval.dtype for v in e.invars) for e in iter_eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert operands == [(bf16, bf16), (int32, int32), (E4M3, E4M3), (E4M3, E4M3)]
    report = jaxamp.explain(f, compute_dtype=EVERY)(P, X)
    kept = {r.detail for r in report.kept_out_of_fp8}
    assert kept == {
        "kept bf16: contraction size 8 < min_contraction 16",
        "kept bf16: int32 x int32 operands (float8 takes float32, bfloat16 or float16)",
    }
    total, fp8 = report.total_matmul_flops, sum(r.flops for r in report.rows if r.float8)
    assert report.fp8_flop_fraction == pytest.approx(fp8 / total) and 0.5 < report.fp8_flop_fraction < 1
    fp8_rows = [r for r in report.rows if r.float8]
    assert [r.detail for r in fp8_rows] == [
        "float8 e4m3 x e4m3 -> f32; backward e5m2 x e4m3 -> f32; scaling: current"
    ] * 2
    text = str(report)
    assert "float8 (current scaling)" in text and "contraction size 8 < min_contraction 16" in text
    assert report.to_dict()["fp8_flop_fraction"] == report.fp8_flop_fraction

    # A FLOP floor of 10k keeps the head (8x32x10: 5120 FLOPs) out, not the 8x32x32 matmul (16k).
    report = jaxamp.explain(_two_layers, compute_dtype=dataclasses.replace(EVERY, min_flops=10_000))(P, X)
    assert [r.detail for r in report.kept_out_of_fp8] == ["kept bf16: 5120 FLOPs < min_flops 10000"]


def test_pallas_kernel_matmuls_are_listed_and_not_taken_for_the_last_matmul():
    pl = pytest.importorskip("jax.experimental.pallas")

    def kernel(x_ref, w_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], w_ref[...])

    def f(p, x):
        loss = _two_layers(p, x)
        out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 32), jnp.float32), interpret=True)
        return loss + jnp.sum(out(x, p["w"]))

    report = jaxamp.explain(f, compute_dtype=dataclasses.replace(EVERY, keep_last_matmul_bf16=True))(P, X)
    assert [(r.primitive, r.detail) for r in report.kept_out_of_fp8] == [
        ("dot_general", "kept bf16: the program's last matmul (keep_last_matmul_bf16)"),
        (
            "pallas_call",
            "not float8: 1 matmul(s) inside a pallas_call body, which amp does not rewrite (it runs as written)",
        ),
    ]


@pytest.mark.newest_only
def test_keep_last_matmul_bf16_inside_a_jitted_function():
    # The head runs inside a jit'd function: the walk for the last matmul
    # goes into bodies.
    def f(p, x):
        return jax.jit(_two_layers)(p, x)

    recipe = dataclasses.replace(EVERY, keep_last_matmul_bf16=True)
    bf16 = np.dtype(jnp.bfloat16)
    assert _formats(f, P, X, compute_dtype=recipe) == [(E4M3, E4M3), (bf16, bf16)]
    assert _formats(f, P, X, compute_dtype=EVERY) == [(E4M3, E4M3), (E4M3, E4M3)]
    report = jaxamp.explain(f, compute_dtype=recipe)(P, X)
    assert [(r.scope, r.detail) for r in report.kept_out_of_fp8] == [
        ("head", "kept bf16: the program's last matmul (keep_last_matmul_bf16)")
    ]
    # The same jit'd function in another program, where a matmul follows it:
    # amp's cache of rewritten bodies does not carry the first program's choice over.
    g = lambda p, x: jnp.sum((x * jax.jit(_two_layers)(p, x)) @ p["w"])  # noqa: E731
    assert _formats(g, P, X, compute_dtype=recipe) == [(E4M3, E4M3), (E4M3, E4M3), (bf16, bf16)]


def test_scope_pins_and_amp_stop_keep_their_precision():
    table = jaxamp.default_amp_policy | {"head": jaxamp.use_precision("bf16")}
    bf16, f32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
    assert _formats(_two_layers, P, X, compute_dtype=EVERY, amp_policy=table) == [(E4M3, E4M3), (bf16, bf16)]
    assert _formats(jaxamp.amp_stop(_two_layers), P, X, compute_dtype=EVERY) == [(f32, f32), (f32, f32)]
    report = jaxamp.explain(_two_layers, compute_dtype=EVERY, amp_policy=table)(P, X)
    assert [r.detail for r in report.kept_out_of_fp8] == ["kept bf16,bf16: decided by scope:head"]


@pytest.mark.newest_only
def test_everything_but_matmuls_follows_bf16_mode():
    def f(p, x):
        return jnp.sum(jnp.exp(jnp.tanh(x @ p["w"])) @ p["head"])

    def dtypes(mode):
        jaxpr = jax.make_jaxpr(amp(f, compute_dtype=mode))(P, X)
        return [
            (e.primitive.name, tuple(v.aval.dtype for v in e.invars))
            for e in iter_eqns(jaxpr)
            if e.primitive.name in ("tanh", "exp", "reduce_sum")
        ]

    assert dtypes(FP8) == dtypes("bf16")


@pytest.mark.newest_only
def test_find_nonfinite_in_fp8_mode():
    x = X.at[0, 0].set(jnp.nan)
    found = jaxamp.find_nonfinite(_two_layers, compute_dtype=EVERY)(P, x)
    assert found.primitive == "dot_general" and found.input_dtypes == ("e4m3", "e4m3")
    assert found.output_dtypes == ("bf16",)
    assert jaxamp.find_nonfinite(_two_layers, compute_dtype=EVERY)(P, X) is None


@pytest.mark.newest_only
def test_fp8_under_jit_vmap_and_with_a_policy():
    assert jax.jit(amp(_two_layers, compute_dtype="float8"))(P, X).dtype == jnp.float32
    value = jax.jit(amp(_two_layers, compute_dtype=EVERY))(P, X)
    # Under vmap each example gets its own scales: two copies of X, two equal results.
    batched_fn = jax.jit(jax.vmap(amp(_two_layers, compute_dtype=EVERY), in_axes=(None, 0)))
    batched = batched_fn(P, X[None].repeat(2, 0))
    np.testing.assert_allclose(batched, [value, value], rtol=1e-6)
    out = amp(lambda p, x: x @ p["w"], compute_dtype=EVERY, policy="p=f32,c=bf16,o=f32")(P, X)
    assert out.dtype == jnp.float32


# --- bad input -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "compute_dtype, error, match",
    [
        ("fp9", ValueError, r"'fp9'.*'fp8'"),
        (jnp.float8_e4m3fn, TypeError, r"float8_e4m3fn.*compute_dtype='fp8'"),
        ("float8_e5m2", TypeError, r"float8_e5m2.*compute_dtype='fp8'"),
    ],
)
def test_bad_compute_dtype_points_at_fp8_mode(compute_dtype, error, match):
    with pytest.raises(error, match=match):
        amp(_two_layers, compute_dtype=compute_dtype)


@pytest.mark.parametrize(
    "fields, error, match",
    [
        ({"min_flops": -1}, ValueError, r"Fp8Recipe.min_flops must be at least 0, got -1"),
        ({"min_contraction": 0}, ValueError, r"Fp8Recipe.min_contraction must be at least 1, got 0"),
        ({"min_flops": 1e6}, TypeError, r"Fp8Recipe.min_flops must be an int, got 1000000.0 \(float\)"),
        ({"min_contraction": "16"}, TypeError, r"Fp8Recipe.min_contraction must be an int, got '16' \(str\)"),
        ({"keep_last_matmul_bf16": "yes"}, TypeError, r"keep_last_matmul_bf16 must be a bool, got 'yes'"),
    ],
)
def test_bad_recipe_fields(fields, error, match):
    with pytest.raises(error, match=match):
        Fp8Recipe(keep_small_bf16=None, **fields)


def test_fp8_with_a_disagreeing_policy():
    with pytest.raises(ValueError, match=r"disagree.*fp8 mode computes in bf16"):
        amp(_two_layers, compute_dtype=FP8, policy="c=f16")


@pytest.mark.newest_only
def test_fp8_mode_sees_a_table_changed_between_calls():
    # fp8 mode's matmul rules join the user's table at each call, so an edit of
    # that table between calls takes effect (as in every other mode).
    def f(w, x):
        return jnp.tanh(x @ w).sum()

    w, x = jnp.full((32, 32), 0.1), jnp.ones((8, 32))
    table = dict(jaxamp.default_amp_policy)
    mixed = jaxamp.amp(f, compute_dtype=EVERY, amp_policy=table)

    def dot_dtypes():
        # A fresh lambda per trace: JAX's own trace cache keys on the function.
        jaxpr = jax.make_jaxpr(lambda w, x: mixed(w, x))(w, x)
        return {v.aval.dtype for e in iter_eqns(jaxpr) if e.primitive.name == "dot_general" for v in e.invars}

    assert dot_dtypes() == {jnp.dtype(jnp.float8_e4m3fn)}
    table[jax.lax.dot_general_p] = jaxamp.use_original_precision
    assert dot_dtypes() == {jnp.dtype(jnp.float32)}
