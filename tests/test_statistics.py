"""Normalisation statistics run in float32 whatever library wrote the norm layer.

A norm layer after a matmul receives a bfloat16 activation under amp. Its
statistics (mean, variance), the centred and the normalised values must be
computed in float32, as Equinox's norms are (by scope) and as the layers'
authors intended with their ``x.astype(float32)`` (a no-op when amp traces).
The strongest check: the layer's output under amp equals the float32 layer
applied to the bfloat16 activation, to float32 accuracy; computing any of those
steps in bfloat16 errs by ~1e-2.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp import amp, default_amp_policy, use_current_precision

from jaxpr_walk import iter_eqns

linen = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

KEY = jax.random.PRNGKey(0)
X = jax.random.normal(KEY, (8, 4, 16))
W = jax.random.normal(jax.random.PRNGKey(1), (16, 16)) / 4 + jnp.eye(16)
# Above bfloat16's rounding of the inputs, which every variant sees alike, the
# only error left is float32's own: 1e-5 relative is ~100 float32 ulps of
# slack, and 200x below one bfloat16 rounding.
FLOAT32_RTOL = 1e-5


def _linen(module, *, mutable=False):
    variables = module.init(jax.random.PRNGKey(2), X @ W)

    def apply(h):
        if mutable:
            return module.apply(variables, h, mutable=["batch_stats"])[0]
        return module.apply(variables, h)

    return apply


def _nnx(cls, *args, **kwargs):
    module = cls(*args, **kwargs, rngs=nnx.Rngs(3))
    graphdef, state = nnx.split(module)

    def apply(h):
        return nnx.merge(graphdef, state)(h)

    return apply


def _haiku_style_layer_norm(h):
    # haiku.LayerNorm's arithmetic (haiku itself is not a dependency).
    mean = jnp.mean(h, axis=-1, keepdims=True)
    variance = jnp.var(h, axis=-1, keepdims=True)
    inv = 1.5 * jax.lax.rsqrt(variance + 1e-5)
    return inv * (h - mean) + 0.25


def _hf_style_rms_norm(h):
    # Hugging Face Flax's T5/Llama RMSNorm: variance from squares, x * rsqrt.
    variance = jnp.power(h.astype(jnp.float32), 2).mean(-1, keepdims=True)
    return 2.0 * (h / jnp.sqrt(variance + 1e-6))


NORMS = {
    "linen.LayerNorm": lambda: _linen(linen.LayerNorm()),
    "linen.LayerNorm_exact_variance": lambda: _linen(linen.LayerNorm(use_fast_variance=False)),
    "linen.RMSNorm": lambda: _linen(linen.RMSNorm()),
    "linen.GroupNorm": lambda: _linen(linen.GroupNorm(num_groups=4)),
    "linen.BatchNorm_train": lambda: _linen(linen.BatchNorm(use_running_average=False), mutable=True),
    "nnx.LayerNorm": lambda: _nnx(nnx.LayerNorm, 16),
    "nnx.RMSNorm": lambda: _nnx(nnx.RMSNorm, 16),
    "nnx.GroupNorm": lambda: _nnx(nnx.GroupNorm, 16, num_groups=4),
    "haiku_style_LayerNorm": lambda: _haiku_style_layer_norm,
    "hf_style_RMSNorm": lambda: _hf_style_rms_norm,
    "jax.nn.standardize": lambda: lambda h: jax.nn.standardize(h, axis=-1),
}


def _bf16_matmul(w, x):
    return (x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32)


@pytest.mark.parametrize("name", NORMS)
def test_norm_after_a_bf16_matmul_computes_in_float32(name):
    norm = NORMS[name]()
    mixed = amp(lambda w, x: norm(x @ w), compute_dtype="bf16")(W, X)
    reference = norm(_bf16_matmul(W, X))
    assert mixed.dtype == jnp.float32
    np.testing.assert_allclose(mixed, reference, rtol=FLOAT32_RTOL, atol=FLOAT32_RTOL)


@pytest.mark.parametrize("name", ["linen.LayerNorm", "nnx.RMSNorm", "haiku_style_LayerNorm"])
def test_explain_names_the_statistics_rule(name):
    norm = NORMS[name]()
    # The norm feeds a matmul, as inside a model (after the last matmul, the
    # program's tail runs in float32 by its own rule).
    report = jaxamp.explain(lambda w, x: (norm(x @ w) @ w).sum(), compute_dtype="bf16")(W, X)
    stats = [r for r in report.rows if r.decided_by == "statistics"]
    assert stats, report
    assert all(set(r.dtypes_after) == {"f32"} for r in stats), stats


def test_the_statistics_entry_can_be_switched_off():
    # A user who wants the norms in bfloat16 says so in the table.
    norm = NORMS["linen.LayerNorm"]()
    # (Without the tail entry too: this norm ends the program.)
    table = {k: v for k, v in default_amp_policy.items() if k != "amp_tail"}
    table |= {"amp_statistics": use_current_precision}
    mixed = amp(lambda w, x: norm(x @ w), compute_dtype="bf16", amp_policy=table)(W, X)
    reference = norm(_bf16_matmul(W, X))
    assert np.max(np.abs(mixed - reference)) > 100 * FLOAT32_RTOL


def _attention(w, x):
    h = x @ w
    scores = jnp.einsum("btd,bsd->bts", h, h) / 4.0
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bts,bsd->btd", probs, h)


def test_softmax_stays_in_the_compute_dtype():
    # Its sum of exp is a moment, but neither `x - max(x)` nor `e / sum(e)` is
    # a statistic: the probabilities attention saves for backward stay bf16.
    jaxpr = jax.make_jaxpr(jax.grad(lambda w, x: amp(_attention, compute_dtype="bf16")(w, x).sum()))(W, X)
    for prim in ("exp", "div"):
        found = [e for e in iter_eqns(jaxpr) if e.primitive.name == prim and e.outvars[0].aval.ndim == 3]
        assert found and all(e.outvars[0].aval.dtype == jnp.bfloat16 for e in found), (prim, found)


def test_log_softmax_and_losses_are_not_statistics():
    def loss(w, x):
        logits = x @ w
        return -jnp.mean(jax.nn.log_softmax(logits, axis=-1)[..., 0])

    report = jaxamp.explain(loss, compute_dtype="bf16")(W, X)
    assert not [r for r in report.rows if r.decided_by == "statistics"], report


def test_statistics_inside_a_scan_body_and_a_jit():
    norm = NORMS["linen.LayerNorm"]()

    def layers(w, x):
        def step(h, _):
            return jax.jit(norm)(h @ w), None

        return jax.lax.scan(step, x, None, length=2)[0]

    mixed = amp(layers, compute_dtype="bf16")(W, X)
    reference = norm(_bf16_matmul(W, norm(_bf16_matmul(W, X)).astype(jnp.bfloat16).astype(jnp.float32)))
    assert mixed.dtype == jnp.float32
    # The scan carries the norm's float32 output into a bf16 matmul, as the
    # reference does: only float32 accumulation-order differences remain.
    np.testing.assert_allclose(mixed, reference, rtol=1e-3, atol=1e-3)


def test_scaling_by_a_constant_rsqrt_is_not_a_statistic():
    # Attention's q * rsqrt(head_dim) must not pull q up to float32.
    def scaled(w, x):
        return (x @ w) * jax.lax.rsqrt(jnp.float32(16.0))

    report = jaxamp.explain(lambda w, x: scaled(w, x).sum(), compute_dtype="bf16")(W, X)
    assert not [r for r in report.rows if r.decided_by == "statistics"], report
    assert amp(scaled, compute_dtype="bf16")(W, X).dtype == jnp.float32


def test_inference_batch_norm_normalises_in_float32():
    bn = linen.BatchNorm(use_running_average=True)
    variables = bn.init(jax.random.PRNGKey(2), X @ W)
    variables = jax.tree.map(lambda v: v + 0.5, variables)  # non-trivial running stats
    norm = lambda h: bn.apply(variables, h)  # noqa: E731
    # The norm feeds a matmul, as inside a model (after the last matmul, the
    # program's tail runs in float32 by its own rule).
    report = jaxamp.explain(lambda w, x: (norm(x @ w) @ w).sum(), compute_dtype="bf16")(W, X)
    assert [r for r in report.rows if r.decided_by == "statistics" and r.primitive == "mul"], report
