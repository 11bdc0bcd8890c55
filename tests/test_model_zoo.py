"""A zoo of real model shapes: every matmul/conv, forward and backward, in compute dtype.

For each model: every `dot_general`/`conv_general_dilated` in the jaxpr of the
amp'd loss and of its gradient has compute-dtype operands; the loss is within
bf16 tolerance of float32; all gradients are float32.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxamp import amp

from jaxpr_walk import assert_all_matmuls_in
from small_models import SmallCNN, cross_entropy

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals

D, T, HEADS, LAYERS = 32, 8, 4, 3
KEYS = jax.random.split(jax.random.PRNGKey(0), 8)

# bf16 keeps 8 mantissa bits (relative step 2**-8 = 0.4%); a few layers deep,
# a scalar loss stays within ~3%. Near-zero losses are compared absolutely: a
# logit of magnitude ~10 is only resolved to ~0.04 in bf16.
LOSS_RTOL, LOSS_ATOL = 3e-2, 1e-2


def _dense(key, n_in, n_out):
    return jax.random.normal(key, (n_in, n_out)) / np.sqrt(n_in)


def _layer_norm(x):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5)


@jax.custom_vjp
def _attention(q, k, v):
    return _attention_fwd(q, k, v)[0]


def _attention_fwd(q, k, v):
    scores = jnp.einsum("htd,hsd->hts", q, k) / np.sqrt(q.shape[-1])
    mask = jnp.tril(jnp.ones(scores.shape[-2:], bool))
    probs = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
    return jnp.einsum("hts,hsd->htd", probs, v), (q, k, v, probs)


def _attention_bwd(res, g):
    q, k, v, probs = res
    dv = jnp.einsum("hts,htd->hsd", probs, g)
    dprobs = jnp.einsum("htd,hsd->hts", g, v)
    dscores = probs * (dprobs - (dprobs * probs).sum(-1, keepdims=True)) / np.sqrt(q.shape[-1])
    return jnp.einsum("hts,hsd->htd", dscores, k), jnp.einsum("hts,htd->hsd", dscores, q), dv


_attention.defvjp(_attention_fwd, _attention_bwd)


@jax.custom_jvp
def _gelu(x):
    return 0.5 * x * (1 + jnp.tanh(0.7978845608 * (x + 0.044715 * x**3)))


@_gelu.defjvp
def _gelu_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return _gelu(x), jax.grad(lambda x: _gelu.fun(x).sum())(x) * t


def _init_block(key):
    k = jax.random.split(key, 4)
    return {
        "qkv": _dense(k[0], D, 3 * D),
        "proj": _dense(k[1], D, D),
        "up": _dense(k[2], D, 4 * D),
        "down": _dense(k[3], 4 * D, D),
    }


@jax.jit  # a jit'd sub-layer
def _block(p, x):
    q, k, v = jnp.split(_layer_norm(x) @ p["qkv"], 3, axis=-1)
    heads = lambda a: a.reshape(T, HEADS, D // HEADS).transpose(1, 0, 2)  # noqa: E731
    att = _attention(heads(q), heads(k), heads(v)).transpose(1, 0, 2).reshape(T, D)
    x = x + att @ p["proj"]
    return x + _gelu(_layer_norm(x) @ p["up"]) @ p["down"]


def transformer_scan_remat():
    blocks = jax.vmap(_init_block)(jax.random.split(KEYS[0], LAYERS))
    params = {"blocks": blocks, "embed": jax.random.normal(KEYS[1], (16, D))}
    tokens = jax.random.randint(KEYS[2], (T,), 0, 16)

    def loss(params, tokens):
        x = params["embed"][tokens]
        step = jax.checkpoint(lambda x, p: (_block(p, x), None))
        x, _ = jax.lax.scan(step, x, params["blocks"])
        logits = x @ params["embed"].T
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(T), tokens])

    return loss, (params, tokens)


def cond_and_while_bodies():
    params = {"a": _dense(KEYS[3], D, D), "b": _dense(KEYS[4], D, D)}
    x = jax.random.normal(KEYS[5], (4, D))

    def loss(params, x):
        def body(i, h):
            return jax.lax.cond(i % 2 == 0, lambda h: jnp.tanh(h @ params["a"]), lambda h: jnp.tanh(h @ params["b"]), h)

        h = jax.lax.fori_loop(0, 4, body, x)  # static bounds: a scan
        # while_loop is forward-only: keep it off the differentiated path.
        frozen = jax.lax.stop_gradient(params["a"])
        _, r = jax.lax.while_loop(lambda s: s[0] < 2, lambda s: (s[0] + 1, jnp.sin(s[1] @ frozen)), (0, h))
        return jnp.mean(h**2) + jnp.mean(jax.lax.stop_gradient(r))

    return loss, (params, x)


def equinox_cnn():
    model = SmallCNN(1, 8, key=KEYS[6])
    images = jax.random.normal(KEYS[7], (4, 1, 8, 8))
    labels = jnp.arange(4)

    def loss(model, batch):
        return cross_entropy(model, *batch)

    return loss, (model, (images, labels))


def equinox_attention():
    k = jax.random.split(KEYS[0], 3)
    model = {
        "mha": eqx.nn.MultiheadAttention(HEADS, D, key=k[0]),
        "ln": eqx.nn.LayerNorm(D),
        "out": eqx.nn.Linear(D, 1, key=k[1]),
    }
    x = jax.random.normal(k[2], (T, D))

    def loss(model, x):
        h = jax.vmap(model["ln"])(x)
        h = model["mha"](h, h, h)
        return jnp.mean(jax.vmap(model["out"])(h) ** 2)

    return loss, (model, x)


MODELS = [transformer_scan_remat, cond_and_while_bodies, equinox_cnn, equinox_attention]


@pytest.mark.parametrize("make", MODELS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_every_matmul_in_compute_dtype_forward_and_backward(make, dtype):
    loss, args = make()
    mixed = amp(loss, compute_dtype=dtype)
    params_only = lambda p: mixed(p, *args[1:])  # noqa: E731
    n_forward = assert_all_matmuls_in(eqx.filter_make_jaxpr(params_only)(args[0])[0], dtype)
    grad_jaxpr = eqx.filter_make_jaxpr(eqx.filter_grad(params_only))(args[0])[0]
    assert assert_all_matmuls_in(grad_jaxpr, dtype) > n_forward


@pytest.mark.newest_only
@pytest.mark.parametrize("make", MODELS, ids=lambda m: m.__name__)
def test_loss_close_to_float32_and_gradients_float32(make):
    loss, args = make()
    mixed = eqx.filter_jit(eqx.filter_value_and_grad(amp(loss, compute_dtype="bf16")))
    value, grads = mixed(*args)
    value32, grads32 = eqx.filter_jit(eqx.filter_value_and_grad(loss))(*args)
    assert value.dtype == jnp.float32
    np.testing.assert_allclose(value, value32, rtol=LOSS_RTOL, atol=LOSS_ATOL)
    leaves = jax.tree.leaves(eqx.filter(grads, eqx.is_inexact_array))
    leaves32 = jax.tree.leaves(eqx.filter(grads32, eqx.is_inexact_array))
    assert leaves and all(g.dtype == jnp.float32 for g in leaves)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    # Gradient direction survives bf16: cosine similarity with float32's.
    flat = jnp.concatenate([g.ravel() for g in leaves])
    flat32 = jnp.concatenate([g.ravel() for g in leaves32])
    cosine = flat @ flat32 / (jnp.linalg.norm(flat) * jnp.linalg.norm(flat32))
    assert cosine > 0.98


def _leaf_kind(leaf):
    if isinstance(leaf, jax.Array):
        return ("Array", leaf.dtype, leaf.shape, jax.typeof(leaf).weak_type)
    return type(leaf)


@pytest.mark.newest_only
@pytest.mark.parametrize("make", MODELS, ids=lambda m: m.__name__)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_outputs_are_what_the_model_returns(make, dtype):
    # The same tree, leaf types, dtypes and weak types, eagerly and under jit.
    loss, args = make()
    expected = jax.tree.map(_leaf_kind, loss(*args))
    assert jax.tree.map(_leaf_kind, amp(loss, compute_dtype=dtype)(*args)) == expected
    assert jax.tree.map(_leaf_kind, eqx.filter_jit(amp(loss, compute_dtype=dtype))(*args)) == expected
