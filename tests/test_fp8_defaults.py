"""fp8 mode's defaults match Transformer Engine's, torchao's and torchtitan's float8 setups.

Kept in bf16 unless the `Fp8Recipe` asks: the program's last matmul (the
logits), batched matmuls (attention's scores and values), grouped matmuls
(`lax.ragged_dot`), and matmuls whose sizes a float8 GEMM cannot take (not
multiples of 16). Each decision is in `explain`; opting in takes the matmul,
grouped ones with a scale per group.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxamp
from jaxamp import Fp8Recipe

from jaxpr_walk import matmul_operand_dtypes

# These tests' matmuls are small: all of them in float8, the size rule off.
FP8 = jaxamp.fp8.Fp8Recipe(keep_small_bf16=None)

E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
BF16 = np.dtype(jnp.bfloat16)
KEYS = jax.random.split(jax.random.key(0), 8)
needs_ragged_dot = pytest.mark.skipif(not hasattr(lax, "ragged_dot"), reason="no lax.ragged_dot on this JAX")


def _model(x, w_in, w_out):
    h = x @ w_in  # (32, 64) @ (64, 128): taken
    q = h.reshape(32, 4, 32).transpose(1, 0, 2)
    scores = jnp.einsum("htd,hsd->hts", q, q)  # batched: attention's scores
    att = jnp.einsum("hts,hsd->htd", jax.nn.softmax(scores), q).transpose(1, 0, 2).reshape(32, 128)
    odd = att[:, :24] @ w_out[:24, :24]  # contraction and output features 24: not multiples of 16
    return jnp.sum((att + jnp.mean(odd)) @ w_out)  # the last matmul: the logits


ARGS = (
    jax.random.normal(KEYS[0], (32, 64)),
    jax.random.normal(KEYS[1], (64, 128)) / 8,
    jax.random.normal(KEYS[2], (128, 48)) / 11,
)


def _details(recipe):
    report = jaxamp.explain(_model, compute_dtype=recipe)(*ARGS)
    return [(r.source.split(":")[-1].split(" ")[0], r.detail) for r in report.rows if r.primitive == "dot_general"]


def test_the_defaults_keep_attention_odd_sizes_and_the_logits_in_bf16_and_say_why():
    details = [detail for _, detail in _details(FP8)]
    assert details[0].startswith("float8 e4m3 x e4m3")
    kept = details[1:]
    assert kept == [
        "kept bf16: a batched matmul: attention's scores and values (Fp8Recipe(attention=True) takes it)",
        "kept bf16: a batched matmul: attention's scores and values (Fp8Recipe(attention=True) takes it)",
        "kept bf16: contraction size 24 is not a multiple of 16 (float8 GEMMs need it; gemm_multiple)",
        "kept bf16: the program's last matmul (keep_last_matmul_bf16)",
    ], kept
    forward = [dts for _, dts in matmul_operand_dtypes(jax.make_jaxpr(jaxamp.amp(_model, compute_dtype=FP8))(*ARGS))]
    assert forward == [(E4M3, E4M3)] + [(BF16, BF16)] * 4


def test_each_default_can_be_turned_off():
    every = Fp8Recipe(keep_small_bf16=None, attention=True, keep_last_matmul_bf16=False, gemm_multiple=8)
    assert all(detail.startswith("float8 e4m3 x e4m3") for _, detail in _details(every))
    # Output features alone, with an aligned contraction.
    report = jaxamp.explain(lambda x, w: jnp.sum((x @ w) @ (x.T @ x)[:24]), compute_dtype=FP8)(
        jnp.ones((32, 64)), jnp.ones((64, 24))
    )
    assert report.kept_out_of_fp8[0].detail == (
        "kept bf16: output features 24 is not a multiple of 16 (float8 GEMMs need it; gemm_multiple)"
    )


def test_gradients_with_the_defaults_stay_close_to_float32():
    grads = jax.grad(jaxamp.amp(_model, compute_dtype=FP8), (1, 2))(*ARGS)
    want = jax.grad(_model, (1, 2))(*ARGS)
    for got, ref in zip(grads, want):
        assert got.dtype == jnp.float32
        assert float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)) < 0.1


def _experts(rows=(32, 96)):
    lhs = jax.random.normal(KEYS[3], (sum(rows), 64))
    rhs = jax.random.normal(KEYS[4], (len(rows), 64, 32)) / 8
    return lhs, rhs, jnp.array(rows, jnp.int32)


@needs_ragged_dot
def test_grouped_matmuls_stay_bf16_unless_asked():
    lhs, rhs, sizes = _experts()
    f = lambda lhs, rhs: jnp.sum(lax.ragged_dot(lhs, rhs, sizes) @ jnp.ones((32, 16)))  # noqa: E731
    report = jaxamp.explain(f, compute_dtype=FP8)(lhs, rhs)
    grouped = next(r for r in report.rows if r.primitive == "ragged_dot_general")
    assert grouped.detail == "kept bf16: a grouped matmul (Fp8Recipe(grouped=True) takes it, with a scale per group)"
    report = jaxamp.explain(f, compute_dtype=Fp8Recipe(keep_small_bf16=None, grouped=True))(lhs, rhs)
    grouped = next(r for r in report.rows if r.primitive == "ragged_dot_general")
    assert grouped.detail.endswith("scaling: current, per group")
    jaxpr = jax.make_jaxpr(
        jax.grad(jaxamp.amp(f, compute_dtype=Fp8Recipe(keep_small_bf16=None, grouped=True)), (0, 1))
    )(lhs, rhs)
    ragged = [dts for name, dts in matmul_operand_dtypes(jaxpr) if name == "ragged_dot_general"]
    assert sorted(tuple(sorted(np.dtype(d).name for d in dts[:2])) for dts in ragged) == sorted(
        [("float8_e4m3fn", "float8_e4m3fn")] + [("float8_e4m3fn", "float8_e5m2")] * 2
    )


def _relative(got, want):
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


@needs_ragged_dot
def test_an_expert_with_small_values_keeps_its_precision():
    # Expert 1's rows and weights are 1e-5 of expert 0's: with one scale for
    # the tensor they land among e4m3's subnormals (spacing 2**-9 of the
    # scaled maximum 448) or below them; with a scale per group each expert
    # keeps e4m3's 3 mantissa bits.
    lhs, rhs, sizes = _experts()
    lhs = lhs.at[32:].multiply(1e-5)
    rhs = rhs.at[1].multiply(1e-5)
    want = lax.ragged_dot(lhs, rhs, sizes)
    per_group = jaxamp.amp(
        lambda a, b: lax.ragged_dot(a, b, sizes), compute_dtype=Fp8Recipe(keep_small_bf16=None, grouped=True)
    )(lhs, rhs)
    assert _relative(per_group[32:].astype(jnp.float32), want[32:]) < 0.1
    assert _relative(per_group[:32].astype(jnp.float32), want[:32]) < 0.1
    # The same product with one scale per tensor (the other matmuls' recipe).
    from jaxamp.fp8._matmul import quantize

    q_lhs, s_lhs = quantize(lhs, jnp.float8_e4m3fn)
    q_rhs, s_rhs = quantize(rhs, jnp.float8_e4m3fn)
    tensorwise = lax.ragged_dot(q_lhs, q_rhs, sizes, preferred_element_type=jnp.float32) * s_lhs * s_rhs
    assert _relative(tensorwise[32:], want[32:]) > 0.5


@needs_ragged_dot
def test_grouped_gradients_equal_float32_on_exact_values():
    # Powers of two within each group's range quantise exactly under their
    # own group's scale, so the float8 gradients equal float32's.
    def powers(key, shape, low):
        k1, k2 = jax.random.split(key)
        signs = jnp.where(jax.random.bernoulli(k1, 0.5, shape), 1.0, -1.0)
        return signs * 2.0 ** jax.random.randint(k2, shape, low, low + 4).astype(jnp.float32)

    sizes = jnp.array([16, 16], jnp.int32)
    lhs = jnp.concatenate([powers(KEYS[5], (16, 32), -2), powers(KEYS[6], (16, 32), -20)])
    rhs = jnp.stack([powers(KEYS[7], (32, 16), -2), powers(KEYS[0], (32, 16), -20)])
    weights = powers(KEYS[1], (32, 16), -2)

    def loss(lhs, rhs):
        return jnp.sum(lax.ragged_dot(lhs, rhs, sizes) * weights)

    recipe = Fp8Recipe(keep_small_bf16=None, grouped=True, keep_last_matmul_bf16=False)
    for got, want in zip(
        jax.jit(jax.grad(jaxamp.amp(loss, compute_dtype=recipe), (0, 1)))(lhs, rhs), jax.grad(loss, (0, 1))(lhs, rhs)
    ):
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "fields, error, match",
    [
        ({"gemm_multiple": 0}, ValueError, r"Fp8Recipe.gemm_multiple must be at least 1, got 0"),
        ({"attention": 1}, TypeError, r"Fp8Recipe.attention must be a bool, got 1 \(int\)"),
        ({"grouped": "yes"}, TypeError, r"Fp8Recipe.grouped must be a bool, got 'yes' \(str\)"),
        ({"keep_small_bf16": [4096, 1024]}, TypeError, r"keep_small_bf16 must be None or a tuple of two ints"),
        ({"keep_small_bf16": (4096,)}, TypeError, r"keep_small_bf16 must be None or a tuple of two ints"),
        ({"keep_small_bf16": (4096.0, 1024)}, TypeError, r"keep_small_bf16 must be None or a tuple of two ints"),
        ({"keep_small_bf16": (-1, 1024)}, ValueError, r"keep_small_bf16 sizes must be at least 0, got \(-1, 1024\)"),
    ],
)
def test_bad_recipe_fields(fields, error, match):
    with pytest.raises(error, match=match):
        Fp8Recipe(**fields)


def test_the_default_recipe():
    assert dataclasses.asdict(Fp8Recipe()) == {
        "scaling": "tensorwise", "power_of_two_scales": None, "min_flops": 0, "keep_small_bf16": (1024, 4096), "min_contraction": 16, "gemm_multiple": 16,
        "keep_last_matmul_bf16": True, "attention": False, "grouped": False, "gradient_format": None,
        "fast_accumulation": "forward", "amax_history_length": 1024, "amax_compute_algo": "max", "margin": 0,
    }  # fmt: skip


def test_matmuls_too_small_to_gain_stay_bf16_by_default_and_can_be_let_in():
    # torchao's tensorwise filter as it runs: kept when the contraction is at
    # most 1024 and the output features at most 4096 (both bounds included).
    def chain(x, w1, w2, w3, w4):
        return jnp.sum(((x @ w1) @ w2) @ w3 @ w4)

    shapes = [(8, 1024), (1024, 4096), (4096, 16), (16, 4112), (4112, 16)]
    args = [jnp.ones(s) / 64 for s in shapes]
    details = [r.detail for r in jaxamp.explain(chain, compute_dtype="fp8")(*args).rows if r.primitive == "dot_general"]
    assert details[0] == (
        "kept bf16: too small to gain: contraction size 1024 <= 1024 and output features 4096 <= 4096 "
        "(keep_small_bf16; quantising costs more than float8 saves)"
    )
    assert details[1].startswith("float8") and details[2].startswith("float8"), details  # K 4096; N 4112
    assert details[3] == "kept bf16: the program's last matmul (keep_last_matmul_bf16)"
    every_size = jaxamp.explain(chain, compute_dtype=Fp8Recipe(keep_small_bf16=None))(*args)
    assert [r.detail.startswith("float8") for r in every_size.rows if r.primitive == "dot_general"] == [1, 1, 1, 0]
