"""A precision the program asks for is kept (`jaxamp.transform._rules.requested_precision`).

A ``dot_general`` or convolution on half-precision operands whose
``preferred_element_type`` is wider is an accumulation the program made
explicit: amp never narrows it. ``jax.nn.dot_product_attention`` asks for
float32 scores on bf16 operands, so its softmax runs in float32 under amp as
without it. On float32 operands a float32 result is JAX's default, which
amp moves to the compute dtype as before; ``precision=HIGHEST`` (or ``HIGH``,
or a float32-input dot algorithm preset) on them is a request, which amp
keeps in float32 in every mode (``explain``: ``requested``).
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
    assert (
        row.decided_by == "requested"
        and row.detail == "the program asks for a float32 result of bfloat16 x bfloat16 operands"
    )


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


@pytest.mark.newest_only
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


@pytest.mark.parametrize("compute_dtype", ["f16", "bf16"])
@pytest.mark.newest_only
def test_dot_product_attention_on_bf16_runs_as_written(compute_dtype):
    # Its scores ask for float32 from bf16 operands with BF16_BF16_F32: a
    # request amp keeps under f16 too (operands, preset and result as written).
    q, k, v = _qkv(BF16)
    fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v)  # noqa: E731
    jaxpr = jax.make_jaxpr(jaxamp.amp(fn, compute_dtype=compute_dtype))(q, k, v)
    scores = next(e for e in iter_eqns(jaxpr) if e.primitive is lax.dot_general_p)
    assert scores.params["precision"] == lax.DotAlgorithmPreset.BF16_BF16_F32
    assert [v.aval.dtype for v in (*scores.invars, *scores.outvars)] == [BF16, BF16, F32]


def test_a_dot_algorithm_the_operands_no_longer_fit_gives_way_to_the_default():
    # BF16_BF16_F32 on float32 operands asks for no more than bf16 products:
    # no request. Under f16 amp the operands are float16, which it does not take.
    a, b = jax.random.normal(KEYS[0], (4, 16)), jax.random.normal(KEYS[1], (16, 8))
    preset = lax.DotAlgorithmPreset.BF16_BF16_F32
    fn = lambda a, b: jnp.dot(a, b, precision=preset)  # noqa: E731
    for compute_dtype, kept in (("bf16", preset), ("f16", None)):
        half = BF16 if compute_dtype == "bf16" else F16
        jaxpr = jax.make_jaxpr(jaxamp.amp(fn, compute_dtype=compute_dtype))(a, b)
        (dot,) = [e for e in iter_eqns(jaxpr) if e.primitive is lax.dot_general_p]
        assert dot.params["precision"] == kept
        assert dot.invars[0].aval.dtype == half
    out = jaxamp.amp(fn, compute_dtype="f16")(a, b)
    np.testing.assert_allclose(out, a @ b, rtol=2e-2, atol=5e-2)


# --- precision=HIGHEST and its relatives on float32 operands ---------------------------------------------

MODES = [
    "bf16",
    "f16",
    "fp8",
    *(jaxamp.fp8.Fp8Recipe(scaling=s, keep_last_matmul_bf16=False, gemm_multiple=1) for s in ("rowwise", "mxfp8")),
]
MODE_IDS = ["bf16", "f16", "fp8", "fp8-rowwise", "fp8-mxfp8"]


def _rotary(positions, inverse_timescale):
    # Gemma's rotary embedding (Tunix): the angles of every position, in float32.
    angles = jnp.einsum("BT,k->BTk", positions, inverse_timescale, precision=lax.Precision.HIGHEST)
    return jnp.sin(angles)


POSITIONS = jnp.arange(1024, dtype=F32)[None, :]
INVERSE_TIMESCALE = 1.0 / 10_000.0 ** (jnp.arange(0, 64, 2, dtype=F32) / 64)


@pytest.mark.parametrize("compute_dtype", MODES, ids=MODE_IDS)
@pytest.mark.newest_only
def test_rotary_angles_asked_for_at_highest_precision_stay_float32(compute_dtype):
    # In bf16 position 257 rounds to 256: sin(257) == sin(256), an error of
    # 0.76 at position 1023 (1.68 over all frequencies). Asked for at
    # HIGHEST, the angles are float32 in every mode: exactly the program's.
    fn = jaxamp.amp(_rotary, compute_dtype=compute_dtype)
    np.testing.assert_array_equal(fn(POSITIONS, INVERSE_TIMESCALE), _rotary(POSITIONS, INVERSE_TIMESCALE))
    (row,) = [
        r
        for r in jaxamp.explain(_rotary, compute_dtype=compute_dtype)(POSITIONS, INVERSE_TIMESCALE).rows
        if r.primitive == "dot_general"
    ]
    assert (row.decided_by, row.dtypes_after, row.detail) == (
        "requested",
        ("f32", "f32"),
        "the program asks for precision HIGHEST",
    )


def _matmul(precision):
    return lambda a, b: jnp.dot(a, b, precision=precision)


def _conv(precision):
    return lambda x, k: lax.conv_general_dilated(x, k, (1,), "SAME", precision=precision)


REQUESTS = {
    "HIGH": (_matmul(lax.Precision.HIGH), (16, 32), (32, 16)),
    "HIGHEST, one side": (_matmul((lax.Precision.DEFAULT, lax.Precision.HIGHEST)), (16, 32), (32, 16)),
    "F32_F32_F32": (_matmul(lax.DotAlgorithmPreset.F32_F32_F32), (16, 32), (32, 16)),
    "BF16_BF16_F32_X3": (_matmul(lax.DotAlgorithmPreset.BF16_BF16_F32_X3), (16, 32), (32, 16)),
    "convolution, HIGHEST": (_conv(lax.Precision.HIGHEST), (2, 16, 8), (16, 16, 3)),
}


@pytest.mark.parametrize("compute_dtype", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("request_", sorted(REQUESTS))
def test_a_float32_precision_request_runs_in_float32(request_, compute_dtype):
    fn, *shapes = REQUESTS[request_]
    args = [jax.random.normal(k, s) for k, s in zip(KEYS, shapes)]
    jaxpr = jax.make_jaxpr(jaxamp.amp(fn, compute_dtype=compute_dtype))(*args)
    (eqn,) = [e for e in iter_eqns(jaxpr) if e.primitive in (lax.dot_general_p, lax.conv_general_dilated_p)]
    assert [v.aval.dtype for v in (*eqn.invars, *eqn.outvars)] == [F32, F32, F32]


@pytest.mark.parametrize("precision", [None, lax.Precision.DEFAULT, lax.DotAlgorithmPreset.BF16_BF16_F32])
def test_no_request_for_float32_is_moved(precision):
    a, b = jax.random.normal(KEYS[0], (16, 32)), jax.random.normal(KEYS[1], (32, 16))
    (row,) = [
        r for r in jaxamp.explain(_matmul(precision), compute_dtype="bf16")(a, b).rows if r.primitive == "dot_general"
    ]
    assert (row.decided_by, row.dtypes_after) == ("primitive", ("bf16", "bf16"))


@pytest.mark.newest_only
def test_a_users_dot_general_entry_comes_before_the_request():
    # The table's word on every dot_general is the user's; the program's on
    # one matmul is amp's inference, as the tail is (docs/precision.md). The
    # user's rule gets the request in its parameters.
    seen = []

    def rule(compute_dtype, original_dtypes, *invars, **params):
        seen.append(params["precision"])
        return jaxamp.use_compute_precision(compute_dtype, original_dtypes, *invars, **params)

    table = jaxamp.default_amp_policy | {lax.dot_general_p: rule}
    rows = jaxamp.explain(_rotary, compute_dtype="bf16", amp_policy=table)(POSITIONS, INVERSE_TIMESCALE).rows
    (row,) = [r for r in rows if r.primitive == "dot_general"]
    assert (row.decided_by, row.dtypes_after) == ("user", ("bf16", "bf16"))
    assert seen == [(lax.Precision.HIGHEST, lax.Precision.HIGHEST)]
    # Without the "amp_requested" entry the table's matmul entry decides.
    table = {k: v for k, v in jaxamp.default_amp_policy.items() if k != "amp_requested"}
    rows = jaxamp.explain(_rotary, compute_dtype="bf16", amp_policy=table)(POSITIONS, INVERSE_TIMESCALE).rows
    (row,) = [r for r in rows if r.primitive == "dot_general"]
    assert (row.decided_by, row.dtypes_after) == ("primitive", ("bf16", "bf16"))
