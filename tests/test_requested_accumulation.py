"""A wider result the program asks for is kept (`jaxamp.transform._rules.requested_accumulation`).

A ``dot_general`` or convolution on half-precision operands whose
``preferred_element_type`` is wider is an accumulation the program made
explicit: amp never narrows it. ``jax.nn.dot_product_attention`` asks for
float32 scores on bf16 operands, so its softmax runs in float32 under amp as
without it. On float32 operands a float32 result is JAX's default, which
amp moves to the compute dtype as before.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxamp

from jaxpr_walk import iter_eqns

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
KEYS = jax.random.split(jax.random.PRNGKey(0), 4)


def _einsum(a, b):
    return jnp.einsum("td,sd->ts", a, b, preferred_element_type=jnp.float32)


@pytest.mark.parametrize("compute_dtype", ["bf16", "f16", "fp8"])
def test_an_explicit_float32_result_of_bf16_operands_is_kept(compute_dtype):
    a = jnp.array([[1, 2**-8]], BF16)
    b = jnp.array([[1, 1]], BF16)
    plain = _einsum(a, b)
    assert float(plain[0, 0]) == 1.0 + 2**-8  # bf16 cannot hold it: the accumulation is float32
    got = jaxamp.amp(_einsum, compute_dtype=compute_dtype)(a, b)
    np.testing.assert_array_equal(got, plain)
    dots = [
        e
        for e in iter_eqns(jax.make_jaxpr(jaxamp.amp(_einsum, compute_dtype=compute_dtype))(a, b))
        if e.primitive is lax.dot_general_p
    ]
    assert [e.outvars[0].aval.dtype for e in dots] == [F32]
    (row,) = [
        r for r in jaxamp.explain(_einsum, compute_dtype=compute_dtype)(a, b).rows if r.primitive == "dot_general"
    ]
    assert row.output_dtypes == ("f32",)
    if compute_dtype == "fp8":
        assert "asks for a f32 result" in row.detail


@pytest.mark.newest_only
def test_a_float32_result_of_float32_operands_is_moved():
    a, b = jax.random.normal(KEYS[0], (4, 8)), jax.random.normal(KEYS[1], (4, 8))
    jaxpr = jax.make_jaxpr(jaxamp.amp(_einsum, compute_dtype="bf16"))(a, b)
    dots = [e for e in iter_eqns(jaxpr) if e.primitive is lax.dot_general_p]
    assert [(tuple(v.aval.dtype for v in e.invars), e.outvars[0].aval.dtype) for e in dots] == [((BF16, BF16), BF16)]


@pytest.mark.newest_only
def test_a_convolution_keeps_its_requested_result():
    x = jax.random.normal(KEYS[0], (2, 3, 16)).astype(BF16)
    k = jax.random.normal(KEYS[1], (4, 3, 3)).astype(BF16)

    def conv(x, k):
        return lax.conv_general_dilated(x, k, (1,), "SAME", preferred_element_type=F32)

    jaxpr = jax.make_jaxpr(jaxamp.amp(conv, compute_dtype="f16"))(x, k)
    (eqn,) = [e for e in iter_eqns(jaxpr) if e.primitive is lax.conv_general_dilated_p]
    assert eqn.outvars[0].aval.dtype == F32


@pytest.mark.newest_only
def test_a_narrower_request_is_not_kept():
    # float32 operands asked for a bfloat16 result: not a wider accumulation.
    a, b = jax.random.normal(KEYS[0], (4, 8)), jax.random.normal(KEYS[1], (4, 8))
    fn = lambda a, b: jnp.einsum("td,sd->ts", a, b, preferred_element_type=BF16)  # noqa: E731
    jaxpr = jax.make_jaxpr(jaxamp.amp(fn, compute_dtype="f16"))(a, b)
    (eqn,) = [e for e in iter_eqns(jaxpr) if e.primitive is lax.dot_general_p]
    assert eqn.outvars[0].aval.dtype == F16


def _qkv(dtype):
    return [jax.random.normal(k, (2, 8, 2, 16)).astype(dtype) for k in KEYS[:3]]


@pytest.mark.newest_only
def test_dot_product_attention_on_bf16_runs_its_softmax_in_float32():
    q, k, v = _qkv(BF16)
    fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v)  # noqa: E731
    rows = jaxamp.explain(fn, compute_dtype="bf16")(q, k, v).rows
    exps = [r for r in rows if r.primitive == "exp"]
    assert exps and all(r.dtypes_after == ("f32",) for r in exps)
    # Bit for bit the program without amp: amp changes nothing it asked for.
    np.testing.assert_array_equal(jaxamp.amp(fn, compute_dtype="bf16")(q, k, v), fn(q, k, v))


@pytest.mark.parametrize("compute_dtype", ["f16", "bf16"])
@pytest.mark.newest_only
def test_dot_product_attention_softmax_is_proven_bounded(compute_dtype):
    # Its scores are transposed between their row maximum and the subtraction:
    # the range facts follow the transpose, as for a hand-written softmax.
    q, k, v = _qkv(F32)

    def library(q, k, v):
        return jax.nn.dot_product_attention(q, k, v)

    def by_hand(q, k, v):
        s = jnp.einsum("btnh,bsnh->bnts", q, k) / 4.0
        p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
        return jnp.einsum("bnts,bsnh->btnh", p / p.sum(-1, keepdims=True), v)

    for fn in (library, by_hand):
        exps = [r for r in jaxamp.explain(fn, compute_dtype=compute_dtype)(q, k, v).rows if r.primitive == "exp"]
        assert exps and all(r.decided_by == "range" and r.dtypes_after == (compute_dtype,) for r in exps)
        np.testing.assert_allclose(jaxamp.amp(fn, compute_dtype=compute_dtype)(q, k, v), fn(q, k, v), atol=3e-2)


@pytest.mark.newest_only
def test_a_transpose_of_another_value_proves_nothing():
    # exp(transpose(x) - max(y)): the maximum is of another value.
    def fn(x, y):
        s, t = x @ x.T, y @ y.T
        return jnp.exp(s.T - jnp.max(t, axis=-1, keepdims=True)) @ x

    x, y = jax.random.normal(KEYS[0], (4, 4)), jax.random.normal(KEYS[1], (4, 4))
    (exp,) = [r for r in jaxamp.explain(fn, compute_dtype="f16")(x, y).rows if r.primitive == "exp"]
    assert exp.decided_by == "primitive" and exp.dtypes_after == ("f32",)


def test_a_transposed_row_maximum_against_untransposed_scores_proves_nothing():
    # exp(s - max(s, axis=0).T): the maximum runs over the other axis.
    def fn(x):
        s = x @ x.T
        return jnp.exp(s - jnp.max(s, axis=0, keepdims=True).T) @ x

    x = jax.random.normal(KEYS[0], (4, 4))
    (exp,) = [r for r in jaxamp.explain(fn, compute_dtype="f16")(x).rows if r.primitive == "exp"]
    assert exp.decided_by == "primitive"


@pytest.mark.newest_only
def test_the_cookbook_step_keeps_its_loss_bit_for_bit():
    # JAX's training cookbook keeps bf16 parameters and asks each matmul for
    # float32 results; amp bf16 then runs that program exactly as written.
    w1, w2 = (jax.random.normal(k, (16, 16)).astype(BF16) / 4 for k in KEYS[:2])
    x = jax.random.normal(KEYS[2], (8, 16)).astype(BF16)

    def loss(w1, w2, x):
        h = jnp.einsum("bd,df->bf", x, w1, preferred_element_type=F32)
        h = jax.nn.gelu(h).astype(BF16)
        out = jnp.einsum("bf,fd->bd", h, w2, preferred_element_type=F32)
        return jnp.mean(jax.nn.log_softmax(out) ** 2)

    assert float(jaxamp.amp(loss, compute_dtype="bf16")(w1, w2, x)) == float(loss(w1, w2, x))


@pytest.mark.newest_only
def test_flax_nnx_multi_head_attention_softmax_is_proven_bounded_under_f16():
    # flax NNX's MultiHeadAttention calls jax.nn.dot_product_attention's XLA path.
    from flax import nnx

    layer = nnx.MultiHeadAttention(num_heads=2, in_features=16, qkv_features=16, decode=False, rngs=nnx.Rngs(0))
    x = jax.random.normal(KEYS[0], (2, 8, 16))

    def forward(layer, x):
        return jnp.sum(layer(x) @ jnp.ones((16, 4)))

    rows = jaxamp.explain(forward, compute_dtype="f16")(layer, x).rows
    exps = [r for r in rows if r.primitive == "exp"]
    assert exps and all(r.decided_by == "range" and r.dtypes_after == ("f16",) for r in exps), exps


def test_a_dot_algorithm_the_operands_no_longer_fit_gives_way_to_the_default():
    # dot_product_attention names BF16_BF16_F32 for bf16 operands; under f16
    # amp the operands are float16, which that preset does not take.
    q, k, v = _qkv(BF16)
    fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v)  # noqa: E731
    for compute_dtype, preset in (("bf16", lax.DotAlgorithmPreset.BF16_BF16_F32), ("f16", None)):
        jaxpr = jax.make_jaxpr(jaxamp.amp(fn, compute_dtype=compute_dtype))(q, k, v)
        scores = next(e for e in iter_eqns(jaxpr) if e.primitive is lax.dot_general_p)
        assert scores.params["precision"] == preset
        assert scores.outvars[0].aval.dtype == F32  # the accumulation the program asked for
    out = jaxamp.amp(fn, compute_dtype="f16")(q, k, v)
    assert out.dtype == BF16
    np.testing.assert_allclose(out.astype(F32), fn(q, k, v).astype(F32), atol=3e-2)
