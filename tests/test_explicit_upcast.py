"""A matmul whose operands the program widened from half precision runs widened.

MaxText's ``float32_qk_product`` and ``float32_logits`` write
``q.astype(jnp.float32)`` before an einsum in a bfloat16 program; a flax layer
built with ``dtype=jnp.float32`` casts the bfloat16 activations it is fed to
float32. That is a request the user wrote (see `jaxamp.analyses._upcasts`):
amp runs the matmul by the table's ``"amp_requested"`` entry (float32, as
written), below the user's own table entries and ``amp_stop``. A float32
program, and a float32 model that casts a bfloat16 batch up before its first
layer, are unchanged: their matmuls run in the compute dtype.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxamp

from jaxpr_walk import iter_eqns

# Runs on the oldest supported JAX too (.ci/run): it reads jaxprs amp rewrites.
pytestmark = pytest.mark.jax_internals

BF16, F16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)
KEYS = jax.random.split(jax.random.PRNGKey(0), 6)
MATMULS = (lax.dot_general_p, lax.conv_general_dilated_p)
REQUEST = "the program asks for float32 operands widened from bfloat16"


def _matmuls(fn, *args, **amp_kwargs):
    """``(operand dtypes, result dtype)`` of every matmul amp's program for `fn` runs, in order."""
    jaxpr = jax.make_jaxpr(jaxamp.amp(fn, **amp_kwargs))(*args)
    return [
        (tuple(jnp.dtype(v.aval.dtype) for v in e.invars), jnp.dtype(e.outvars[0].aval.dtype))
        for e in iter_eqns(jaxpr)
        if e.primitive in MATMULS
    ]


def _rows(fn, *args, **amp_kwargs):
    return [
        r
        for r in jaxamp.explain(fn, **amp_kwargs)(*args).rows
        if r.primitive in ("dot_general", "conv_general_dilated")
    ]


def _qk(q, k):
    # MaxText's float32_qk_product: cast, then einsum.
    s = jnp.einsum("bqd,bkd->bqk", q.astype(jnp.float32), k.astype(jnp.float32))
    return jax.nn.softmax(s).sum()


Q = jax.random.normal(KEYS[0], (2, 4, 8)).astype(jnp.bfloat16)
K = jax.random.normal(KEYS[1], (2, 4, 8)).astype(jnp.bfloat16)


@pytest.mark.parametrize("compute_dtype", ["bf16", "f16"])
@pytest.mark.newest_only
def test_both_operands_widened_run_in_float32(compute_dtype):
    assert _matmuls(_qk, Q, K, compute_dtype=compute_dtype) == [((F32, F32), F32)]
    (row,) = _rows(_qk, Q, K, compute_dtype=compute_dtype)
    assert (row.decided_by, row.dtypes_after, row.detail) == ("requested", ("f32", "f32"), REQUEST)


def test_a_reshape_between_the_cast_and_the_einsum():
    # MaxText reshapes the widened query into its grouped-query layout.
    def attention(q, k):
        q32, k32 = q.astype(jnp.float32), k.astype(jnp.float32)
        q32 = jnp.reshape(q32, (2, 4, 2, 4)).transpose(0, 2, 1, 3)  # b g q d
        k32 = jnp.reshape(k32, (2, 4, 2, 4)).transpose(0, 2, 1, 3)
        return jnp.einsum("bgqd,bgkd->bgqk", q32, k32).sum()

    assert _matmuls(attention, Q, K, compute_dtype="bf16") == [((F32, F32), F32)]


def _bf16_model(x, w1, w2):
    # A bfloat16 model (MaxText's dtype=bf16) whose last layer is a flax
    # Dense(dtype=float32, param_dtype=float32): bf16 activations cast up,
    # a float32 kernel.
    h = jnp.tanh(x @ w1)
    return (h.astype(jnp.float32) @ w2).sum()


X = jax.random.normal(KEYS[2], (4, 16)).astype(jnp.bfloat16)
W1 = jax.random.normal(KEYS[3], (16, 16)).astype(jnp.bfloat16) / 4
W2 = jax.random.normal(KEYS[4], (16, 8)) / 4  # float32


@pytest.mark.newest_only
def test_one_operand_widened_beside_a_float32_parameter():
    assert _matmuls(_bf16_model, X, W1, W2, compute_dtype="bf16") == [((BF16, BF16), BF16), ((F32, F32), F32)]
    first, second = _rows(_bf16_model, X, W1, W2, compute_dtype="bf16")
    assert first.decided_by == "primitive"
    assert (second.decided_by, second.detail) == (
        "requested",
        "the program asks for a float32 lhs widened from bfloat16",
    )


@pytest.mark.newest_only
def test_flax_dense_with_float32_dtype_fed_bfloat16_activations():
    nn = pytest.importorskip("flax.linen")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(16, dtype=jnp.bfloat16)(x)
            return nn.Dense(8, dtype=jnp.float32)(jax.nn.relu(h))  # logits_dot_in_fp32

    model = Model()
    params = model.init(KEYS[5], X)
    found = _matmuls(lambda p, x: model.apply(p, x).sum(), params, X, compute_dtype="bf16")
    assert found == [((BF16, BF16), BF16), ((F32, F32), F32)]


def _f32_model(x, w1, w2):
    return (jnp.tanh(x @ w1) @ w2).sum()


@pytest.mark.parametrize("compute_dtype", ["bf16", "f16"])
@pytest.mark.newest_only
def test_a_float32_program_is_unchanged(compute_dtype):
    # Nothing is widened from half precision: amp runs every matmul in the compute dtype.
    x, w1 = X.astype(jnp.float32), W1.astype(jnp.float32)
    half = {"bf16": BF16, "f16": F16}[compute_dtype]
    assert _matmuls(_f32_model, x, w1, W2, compute_dtype=compute_dtype) == [((half, half), half)] * 2
    assert all(r.decided_by == "primitive" for r in _rows(_f32_model, x, w1, W2, compute_dtype=compute_dtype))


@pytest.mark.newest_only
def test_a_float32_model_casting_its_bfloat16_batch_up_is_unchanged():
    # The cast adopts the input into a float32 model (JAX's promotion records
    # x_bf16 @ w1 the same way): not a request (docs/porting.md).
    def model(x, w1, w2):
        return _f32_model(x.astype(jnp.float32), w1, w2)

    w1 = W1.astype(jnp.float32)
    assert _matmuls(model, X, w1, W2, compute_dtype="bf16") == [((BF16, BF16), BF16)] * 2


@pytest.mark.newest_only
def test_a_cast_of_a_value_amp_moved_is_not_a_request():
    # The analysis reads the user's jaxpr: in a float32 program the matmul's
    # operands are float32 from the start; amp's own casts to bfloat16 and
    # back never make them widened.
    def two_layers(x, w):
        h = x @ w
        return (h.astype(jnp.float32) @ w).sum()

    x, w = X.astype(jnp.float32), W1.astype(jnp.float32)
    assert _matmuls(two_layers, x, w, compute_dtype="bf16") == [((BF16, BF16), BF16)] * 2


@pytest.mark.newest_only
def test_a_users_table_entry_comes_first():
    def in_compute_dtype(compute_dtype, original_dtypes, *invars, **params):
        return jaxamp.use_compute_precision(compute_dtype, original_dtypes, *invars, **params)

    table = jaxamp.default_amp_policy | {lax.dot_general_p: in_compute_dtype}
    assert _matmuls(_qk, Q, K, compute_dtype="bf16", amp_policy=table) == [((BF16, BF16), BF16)]
    (row,) = _rows(_qk, Q, K, compute_dtype="bf16", amp_policy=table)
    assert row.decided_by == "user"

    # A scope's entry too; and without the "amp_requested" entry the table decides.
    def scoped(q, k):
        with jax.named_scope("scores"):
            return _qk(q, k)

    table = jaxamp.default_amp_policy | {"scores": jaxamp.use_compute_precision}
    assert _matmuls(scoped, Q, K, compute_dtype="bf16", amp_policy=table) == [((BF16, BF16), BF16)]
    table = {k: v for k, v in jaxamp.default_amp_policy.items() if k != "amp_requested"}
    assert _matmuls(_qk, Q, K, compute_dtype="bf16", amp_policy=table) == [((BF16, BF16), BF16)]


@pytest.mark.newest_only
def test_amp_stop_comes_first():
    stopped = jaxamp.amp_stop(_qk)
    assert _matmuls(stopped, Q, K, compute_dtype="bf16") == [((F32, F32), F32)]
    (row,) = _rows(stopped, Q, K, compute_dtype="bf16")
    assert row.decided_by == "amp_stop"


def test_fp8_mode_keeps_the_widened_matmul_out_of_float8():
    def model(x, w1, w2, w3):
        h = jnp.tanh(x @ w1)  # float32 program matmul: float8 in fp8 mode
        h = (h @ w2).astype(jnp.bfloat16)
        return (h.astype(jnp.float32) @ w3).sum()  # widened: float32

    x = jax.random.normal(KEYS[0], (16, 32))
    w1 = jax.random.normal(KEYS[1], (32, 32)) / 6
    w2 = jax.random.normal(KEYS[2], (32, 32)) / 6
    w3 = jax.random.normal(KEYS[3], (32, 16)) / 6
    # Small matmuls in float8, and the last one not kept in bf16 for being last.
    fp8 = jaxamp.fp8.Fp8Recipe(keep_small_bf16=None, min_contraction=1, gemm_multiple=1, keep_last_matmul_bf16=False)
    rows = _rows(model, x, w1, w2, w3, compute_dtype=fp8)
    assert rows[0].float8 and rows[1].float8
    assert (rows[-1].decided_by, rows[-1].dtypes_after) == ("requested", ("f32", "f32"))
    assert rows[-1].detail == "the program asks for a float32 lhs widened from bfloat16"
    found = _matmuls(model, x, w1, w2, w3, compute_dtype=fp8)
    assert found[-1] == ((F32, F32), F32)
    # Without "amp_requested" fp8's own rule keeps it out of float8 all the same, saying why.
    table = {k: v for k, v in jaxamp.default_amp_policy.items() if k != "amp_requested"}
    rows = _rows(model, x, w1, w2, w3, compute_dtype=fp8, amp_policy=table)
    assert not rows[-1].float8
    assert "the program asks for a float32 lhs widened from bfloat16" in rows[-1].detail


def test_through_a_jit_a_scan_and_a_shared_body():
    # The cast outside a jit'd function, the matmul inside; the same jit'd
    # function fed a float32 value computed by the program runs in bf16.
    dot = jax.jit(lambda a, b: a @ b)

    def fn(x, w1, w2):
        h = jnp.tanh(x @ w1)  # bf16, computed
        widened = dot(h.astype(jnp.float32), w2)  # a request
        plain = dot(jnp.tanh(widened), w2.T)  # float32, not widened: compute dtype
        return plain.sum()

    assert _matmuls(fn, X, W1, W2, compute_dtype="bf16") == [
        ((BF16, BF16), BF16),
        ((F32, F32), F32),
        ((BF16, BF16), BF16),
    ]

    # Layers scanned (MaxText's scan_layers): the bf16 carry is computed by
    # the loop, so its widened copy is a request even where it enters as an input.
    def layers(x, ws, head):
        def layer(h, w):
            scores = h.astype(jnp.float32) @ head  # widened carry, float32 head
            return jnp.tanh(h @ w), scores.sum()

        h, sums = jax.lax.scan(layer, x, ws)
        return sums.sum() + h.astype(jnp.float32).sum()

    ws = jnp.stack([W1, W1])
    head = jnp.ones((16, 8), jnp.float32)
    found = _matmuls(layers, X, ws, head, compute_dtype="bf16")
    assert sorted(found, key=str) == sorted([((F32, F32), F32), ((BF16, BF16), BF16)], key=str)


@pytest.mark.newest_only
def test_a_convolution_on_widened_operands():
    x = jax.random.normal(KEYS[0], (2, 3, 16)).astype(jnp.bfloat16)
    k = jax.random.normal(KEYS[1], (4, 3, 3)).astype(jnp.bfloat16)

    def conv(x, k):
        return lax.conv_general_dilated(x.astype(jnp.float32), k.astype(jnp.float32), (1,), "SAME").sum()

    assert _matmuls(conv, x, k, compute_dtype="bf16") == [((F32, F32), F32)]


def _dots(fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args)
    found = [
        (tuple(jnp.dtype(v.aval.dtype) for v in e.invars), jnp.dtype(e.outvars[0].aval.dtype))
        for e in iter_eqns(jaxpr)
        if e.primitive is lax.dot_general_p
    ]
    return sorted(found, key=str)


@pytest.mark.newest_only
def test_gradients_of_a_widened_matmul_run_in_float32():
    # As for precision=HIGHEST: jax.grad of the amp'd function transposes a
    # float32 matmul, so both backward matmuls run in float32 too.
    grad = jax.grad(jaxamp.amp(_qk, compute_dtype="bf16"), argnums=(0, 1))
    assert _dots(grad, Q, K) == [((F32, F32), F32)] * 3
    # One operand widened beside a float32 weight: forward, kernel gradient
    # and input gradient in float32; the bf16 layer before it in bf16.
    grad = jax.grad(jaxamp.amp(_bf16_model, compute_dtype="bf16"), argnums=(0, 1, 2))
    assert _dots(grad, X, W1, W2) == sorted([((BF16, BF16), BF16)] * 3 + [((F32, F32), F32)] * 3, key=str)


@pytest.mark.newest_only
def test_amp_of_a_gradient_keeps_the_backward_matmuls_that_take_a_widened_operand():
    # amp of jax.grad reads the differentiated program: each backward matmul
    # of MaxText's float32 scores takes a widened query or key (computed by
    # the bf16 projections), so runs in float32 as the forward one does.
    def scores(x, wq, wk):
        q, k = x @ wq, x @ wk  # bf16 projections
        return _qk(q[None], k[None])

    grad = jaxamp.amp(jax.grad(scores, argnums=(0, 1, 2)), compute_dtype="bf16")
    found = _dots(grad, X, W1, W1)
    assert found.count(((F32, F32), F32)) == 3
    assert all(dtypes in (((F32, F32), F32), ((BF16, BF16), BF16)) for dtypes in found)


@pytest.mark.newest_only
def test_numerics_match_the_float32_program():
    # Scores of bf16 queries and keys, computed in float32 as the program
    # asks: amp's result is the program's own to float32 rounding (1e-6),
    # where bf16 operands and a bf16 result would be ~1e-3 off.
    q = jax.random.normal(KEYS[0], (2, 64, 32)).astype(jnp.bfloat16)
    k = jax.random.normal(KEYS[1], (2, 64, 32)).astype(jnp.bfloat16)

    def scores(q, k):
        return jnp.einsum("bqd,bkd->bqk", q.astype(jnp.float32), k.astype(jnp.float32))

    reference = np.asarray(scores(q, k))
    got = np.asarray(jaxamp.amp(scores, compute_dtype="bf16")(q, k))
    np.testing.assert_allclose(got, reference, rtol=1e-6, atol=1e-6)
    in_bf16 = np.asarray(jnp.einsum("bqd,bkd->bqk", q, k, preferred_element_type=jnp.bfloat16), np.float32)
    assert np.max(np.abs(in_bf16 - reference)) > 1e-3  # what the bug cost
    grads = jax.grad(lambda q, k: jaxamp.amp(_qk, compute_dtype="bf16")(q, k), (0, 1))(Q, K)
    expected = jax.grad(_qk, (0, 1))(Q, K)
    for g, e in zip(grads, expected):
        assert g.dtype == BF16
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(e, np.float32), rtol=1e-2, atol=1e-3)
