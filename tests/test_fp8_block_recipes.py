"""fp8 mode's block recipes: ``Fp8Recipe(scaling="mxfp8")`` and ``"blockwise"``.

The quantisers equal independent references bit for bit: MXFP8 equals
`jax.nn.scaled_dot_general`'s own quantiser (JAX's code, which the GPU path
runs) and a numpy transcription of the OCP MX rule with rounding up; the
blockwise quantiser a numpy transcription of Transformer Engine's
power-of-two block scaling. The emulated block-scaled product equals a numpy
sum of dequantised per-block products, and on power-of-two operands (exact in
e4m3 under power-of-two scales) every gradient equals float32's.
"""

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxamp
from jaxamp.fp8._quantize import quantize_blocks
from jaxamp.fp8._schemes import blocked_dot

from jaxpr_walk import matmul_operand_dtypes

E4M3 = jnp.dtype(jnp.float8_e4m3fn)


def _edge_cases(rows=6, width=128):
    """Known values, block edges, all-zero blocks, values beyond e4m3, inf, NaN, subnormal amaxes."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((rows, width)) * 2.0 ** rng.integers(-30, 30, (rows, width))).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block (amax 0)
    x[0, 32:64] = 448.0 * 2.0 ** np.arange(32, dtype=np.float32) / 2.0**31  # powers of two up to 448
    x[1, 31], x[1, 32] = 1e30, -1e-30  # a block's last entry huge, the next block's first tiny
    x[2, 5] = np.inf
    x[2, 70] = np.nan
    x[3, :32] = 1e6  # beyond e4m3's range before scaling
    x[3, 32:64] = 2.0**-140  # subnormal float32 amax
    x[4] = np.float32(448.0) * (1 + 2.0 ** -np.arange(1, width + 1, dtype=np.float32) % 1)
    return x


def _reference_mxfp8(x, block=32):
    """The OCP MX rule as `jax.nn.scaled_dot_general` applies it, in numpy."""
    blocks = x.reshape(x.shape[0], -1, block).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        ratio = (np.max(np.abs(blocks), axis=-1, keepdims=True) / np.float32(448)).astype(np.float32)
    bits = ratio.view(np.uint32)
    exponent, mantissa = bits >> 23, bits & 0x7FFFFF
    up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    exponent = ((exponent + up) & 0xFF).astype(np.uint32)
    scale = (exponent << 23).view(np.float32)
    scale = np.where(scale == 0, np.float32(2.0**-127), scale)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        q = np.clip(blocks / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q.reshape(x.shape), scale[..., 0]


def _reference_blockwise(x, block, free_block=1):
    """Power-of-two block scales over finite amaxes, non-finite entries kept, in numpy."""
    r, c = x.shape
    blocks = x.reshape(r // free_block, free_block, c // block, block).astype(np.float32)
    finite = np.where(np.isfinite(blocks), np.abs(blocks), 0)
    amax = finite.max(axis=(1, 3), keepdims=True)
    scale = (amax / np.float32(448)).astype(np.float32)
    scale = np.where(scale > 0, scale, np.float32(1))
    exponent = np.ceil(np.log2(scale.astype(np.float64)))
    scale = np.ldexp(np.float32(1), exponent.astype(np.int32)).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.where(np.isfinite(blocks), np.clip(blocks / scale, -448, 448), blocks)
    return q.astype(ml_dtypes.float8_e4m3fn).reshape(x.shape), scale[:, 0, :, 0]


def _bits(q):
    return np.asarray(q).view(np.uint8)


def test_mxfp8_quantiser_equals_jax_scaled_dot_general_and_the_ocp_rule_bit_for_bit():
    from jax._src.cudnn.scaled_matmul_stablehlo import e8m0_to_dtype
    from jax._src.cudnn.scaled_matmul_stablehlo import quantize as jax_quantize

    x = _edge_cases()
    q, scales = quantize_blocks(jnp.asarray(x), 1, 32, "mxfp8")
    q_jax, scales_jax = jax_quantize(jnp.asarray(x), jax.nn.get_scaled_dot_general_config("mxfp8"))
    # JAX divides by the scale, which for an all-zero block (or one of
    # float32 subnormals) is 2^-127, a float32 subnormal that XLA's CPU flushes
    # to zero (0 / 0 = NaN there, 0 on the GPU and here). Everywhere else,
    # bit for bit; those blocks are checked against the numpy rule below.
    with np.errstate(invalid="ignore"):
        amax = np.abs(x.reshape(x.shape[0], -1, 32)).max(-1)
    normal_block = np.repeat(~(amax < np.finfo(np.float32).tiny), 32, axis=1)
    np.testing.assert_array_equal(_bits(q)[normal_block], _bits(q_jax)[normal_block])
    assert not np.any(np.asarray(q, np.float32)[~normal_block])
    jax_scales = e8m0_to_dtype(scales_jax.view(jnp.uint8), np.float32)
    np.testing.assert_array_equal(np.asarray(scales), np.asarray(jax_scales))
    q_ref, scales_ref = _reference_mxfp8(x)
    np.testing.assert_array_equal(_bits(q), _bits(q_ref))
    np.testing.assert_array_equal(np.asarray(scales), scales_ref)
    # Scales are rounded up: no finite block saturates (the OCP spec's floor could).
    finite = np.isfinite(x).reshape(x.shape[0], -1, 32).all(-1)
    blocks = np.asarray(q, np.float32).reshape(x.shape[0], -1, 32)
    assert np.all(np.abs(blocks[finite]).max(-1) <= 448)


@pytest.mark.parametrize("free_block", [1, 2])
def test_blockwise_quantiser_equals_a_reference_bit_for_bit(free_block):
    x = _edge_cases(rows=6, width=256)
    q, scales = quantize_blocks(jnp.asarray(x), 1, 128, "blockwise", 0 if free_block > 1 else None, free_block)
    q_ref, scales_ref = _reference_blockwise(x, 128, free_block)
    np.testing.assert_array_equal(_bits(q), _bits(q_ref))
    np.testing.assert_array_equal(np.asarray(scales), scales_ref)
    # An inf stays inf-or-NaN in its own entry; the rest of its block keeps its scale.
    assert np.isnan(np.asarray(q, np.float32)[2, 5]) and np.isfinite(np.asarray(q, np.float32)[2, 6])


@pytest.mark.parametrize("mode, block, free_block", [("mxfp8", 32, 1), ("blockwise", 128, 1), ("blockwise", 128, 128)])
def test_blocked_product_is_the_sum_of_dequantised_block_products(mode, block, free_block):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((2, 8, 256)).astype(np.float32)
    b = rng.standard_normal((256, 128)).astype(np.float32) * 2.0 ** rng.integers(-8, 8, (256, 128))
    dims = (((2,), (0,)), ((), ()))
    got = np.asarray(blocked_dot(jnp.asarray(a), jnp.asarray(b), dims, block, mode, free_block))
    q_a, s_a = quantize_blocks(jnp.asarray(a.reshape(16, 256)), 1, block, mode)
    q_b, s_b = quantize_blocks(jnp.asarray(b.T), 1, block, mode, 0 if free_block > 1 else None, free_block)
    a_deq = np.asarray(q_a, np.float32) * np.repeat(np.asarray(s_a), block, axis=1)
    s_b = np.repeat(np.repeat(np.asarray(s_b), block, axis=1), free_block, axis=0)
    b_deq = (np.asarray(q_b, np.float32) * s_b).T
    want = np.stack([a_deq[:, k : k + block] @ b_deq[k : k + block] for k in range(0, 256, block)]).sum(0)
    np.testing.assert_allclose(got, want.reshape(2, 8, 128), rtol=1e-6, atol=1e-6 * np.abs(want).max())


def _signed_permutation(rng, n):
    p = np.zeros((n, n), np.float32)
    p[np.arange(n), rng.permutation(n)] = rng.choice([-1, 1], n) * 2.0 ** rng.integers(-3, 3, n)
    return p


@pytest.mark.parametrize("scaling", ["mxfp8", "blockwise"])
def test_gradients_and_forward_mode_equal_float32_where_float8_is_exact(scaling):
    rng = np.random.default_rng(0)
    n = 128
    x, w1, w2, v = (_signed_permutation(rng, n) for _ in range(4))
    c = (rng.choice([-1, 1], (n, n)) * 2.0 ** rng.integers(-2, 2, (n, n))).astype(np.float32)

    def loss(w1, w2):
        h = x @ w1
        return jnp.sum(((h * h) @ w2) * c)

    recipe = jaxamp.fp8.Fp8Recipe(keep_small_bf16=None, scaling=scaling, keep_last_matmul_bf16=False)
    fp8 = jaxamp.amp(loss, compute_dtype=recipe)
    for got, want in zip(jax.grad(fp8, (0, 1))(w1, w2), jax.grad(loss, (0, 1))(w1, w2)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(jax.jvp(fp8, (w1, w2), (v, v))[1], jax.jvp(loss, (w1, w2), (v, v))[1])
    dtypes = matmul_operand_dtypes(jax.make_jaxpr(jax.grad(fp8, (0, 1)))(w1, w2))
    # Two forward and three gradient matmuls (x is a constant), all e4m3.
    assert len(dtypes) == 5 and all(ds == (E4M3, E4M3) for _, ds in dtypes), dtypes
    notes = str(jaxamp.explain(loss, compute_dtype=recipe)(w1, w2))
    assert ("blocks of 32, e8m0 scales" if scaling == "mxfp8" else "1x128 tiles") in notes


def test_an_outlier_spoils_only_its_own_block():
    # Rows of small values, each with one large entry in its first block: a
    # scale per tensor or per row flushes the small values below e4m3's
    # subnormals; a scale per block keeps every other block's precision.
    from jaxamp.fp8._quantize import quantize, quantize_along

    rng = np.random.default_rng(2)
    x = rng.standard_normal((16, 256)).astype(np.float32) * 1e-3
    x[:, 0] = 1e3
    quantised = {
        "tensorwise": quantize(jnp.asarray(x), E4M3),
        "rowwise": quantize_along(jnp.asarray(x), E4M3, [1], power_of_two=True),
        "mxfp8": quantize_blocks(jnp.asarray(x), 1, 32, "mxfp8"),
        "blockwise": quantize_blocks(jnp.asarray(x), 1, 128, "blockwise"),
    }
    errors = {}
    for name, (q, s) in quantised.items():
        s = np.asarray(s)
        s = s if s.ndim == 0 else np.repeat(s.reshape(16, -1), 256 // s.reshape(16, -1).shape[1], axis=1)
        deq = np.asarray(q, np.float32) * s
        errors[name] = float(np.linalg.norm(deq[:, 128:] - x[:, 128:]) / np.linalg.norm(x[:, 128:]))
    # Measured: tensorwise and rowwise 1.0 (every small value flushed to 0),
    # mxfp8 and blockwise 0.021 on the blocks without the outlier.
    assert errors["tensorwise"] > 0.9 and errors["rowwise"] > 0.9, errors
    assert errors["mxfp8"] < 0.05 and errors["blockwise"] < 0.05, errors


def test_sizes_the_block_does_not_divide_run_tensorwise_and_say_why():
    x, w = jnp.ones((8, 48)), jnp.ones((48, 64))
    notes = str(
        jaxamp.explain(
            lambda a, b: a @ b,
            compute_dtype=jaxamp.fp8.Fp8Recipe(
                keep_small_bf16=None, scaling="mxfp8", keep_last_matmul_bf16=False, gemm_multiple=1
            ),
        )(x, w)
    )
    assert "(mxfp8: rows 8 is not a multiple of the block size 32)" in notes or "contraction 48" in notes, notes


def test_a_matmul_a_recipe_cannot_take_warns_once_and_says_why(monkeypatch):
    from jaxamp.transform import _interpreter

    monkeypatch.setattr(_interpreter, "_warned", set())
    recipe = jaxamp.fp8.Fp8Recipe(keep_small_bf16=None, scaling="mxfp8", keep_last_matmul_bf16=False, gemm_multiple=1)
    x, w = jnp.ones((8, 48)), jnp.ones((48, 64))
    with pytest.warns(
        UserWarning,
        match=r"scaling='mxfp8'\) runs a dot_general with per-tensor scales instead: "
        r"\w+ \d+ is not a multiple of the block size 32",
    ):
        jax.grad(lambda w: jnp.sum(jaxamp.amp(lambda a, b: a @ b, compute_dtype=recipe)(x, w)))(w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        jax.grad(lambda w: jnp.sum(jaxamp.amp(lambda a, b: a @ b, compute_dtype=recipe)(x, w)))(w)

    rowwise = jaxamp.fp8.Fp8Recipe(
        keep_small_bf16=None, scaling="rowwise", keep_last_matmul_bf16=False, gemm_multiple=1
    )
    image, kernel = jnp.ones((2, 32, 8, 8)), jnp.ones((32, 32, 3, 3))

    def conv(image, kernel):
        return jax.lax.conv_general_dilated(image, kernel, (1, 1), "SAME")

    with pytest.warns(UserWarning, match="scaling='rowwise'.*conv_general_dilated.*a convolution"):
        jaxamp.amp(conv, compute_dtype=rowwise)(image, kernel)
    assert "(rowwise: a convolution" in str(jaxamp.explain(conv, compute_dtype=rowwise)(image, kernel))


def test_block_recipes_reject_power_of_two_scales_off():
    with pytest.raises(ValueError, match="scales by powers of two"):
        jaxamp.fp8.Fp8Recipe(keep_small_bf16=None, scaling="mxfp8", power_of_two_scales=False)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "mxfp8", "blockwise"])
@pytest.mark.parametrize("gradient_format", [None, "e4m3", "e5m2"])
def test_gradient_format_chooses_the_cotangent_dtype_of_every_gradient_matmul(scaling, gradient_format):
    rng = np.random.default_rng(0)
    n = 128
    x, w1, w2 = (_signed_permutation(rng, n) for _ in range(3))

    def loss(w1, w2):
        return jnp.sum(((x @ w1) ** 2) @ w2)

    recipe = jaxamp.fp8.Fp8Recipe(
        keep_small_bf16=None,
        scaling=scaling,
        keep_last_matmul_bf16=False,
        gradient_format=gradient_format,
        power_of_two_scales=True,
    )
    fp8 = jaxamp.amp(loss, compute_dtype=recipe)
    default = "e4m3" if scaling in ("mxfp8", "blockwise") else "e5m2"
    want = jnp.dtype(jnp.float8_e4m3fn if (gradient_format or default) == "e4m3" else jnp.float8_e5m2)
    dtypes = matmul_operand_dtypes(jax.make_jaxpr(jax.grad(fp8, (0, 1)))(w1, w2))
    gradients = [ds for _, ds in dtypes[2:]]  # after the two forward matmuls
    assert len(gradients) == 3 and all(want in ds for ds in gradients), dtypes
    # Exact either way on powers of two, where a scale per row or block holds
    # the cotangent's range (one scale per tensor flushes its smallest entries).
    for got, ref in zip(jax.grad(fp8, (0, 1))(w1, w2), jax.grad(loss, (0, 1))(w1, w2)):
        if scaling == "tensorwise":
            assert np.linalg.norm(np.asarray(got) - ref) < 0.05 * np.linalg.norm(ref)
        else:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    notes = str(jaxamp.explain(loss, compute_dtype=recipe)(w1, w2))
    assert f"backward {'e4m3' if want == E4M3 else 'e5m2'} x e4m3" in notes


def test_gradient_format_rejects_other_names():
    with pytest.raises(ValueError, match=r"gradient_format must be None, 'e4m3' or 'e5m2', got 'e6m1'"):
        jaxamp.fp8.Fp8Recipe(keep_small_bf16=None, gradient_format="e6m1")
