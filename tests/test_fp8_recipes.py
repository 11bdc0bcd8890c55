"""fp8 scaling recipes: tensorwise (the default), torchao's rowwise and rowwise_with_gw_hp.

Tolerances: e4m3 keeps 3 mantissa bits (relative rounding up to 2**-4), so a
matmul's relative error is a few percent; operands that are powers of two
quantise exactly under power-of-two scales, so gradients then equal
float32's to rounding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxamp
from jaxamp import Fp8Recipe, _compat
from jaxamp.fp8._matmul import quantize

from jaxpr_walk import iter_eqns, matmul_operand_dtypes

KEYS = jax.random.split(jax.random.key(0), 8)


def _recipe(scaling, **fields):
    return Fp8Recipe(
        keep_small_bf16=None, scaling=scaling, keep_last_matmul_bf16=False, attention=True, gemm_multiple=1, **fields
    )


def _row_errors(got, want):
    return np.asarray(jnp.linalg.norm(got.astype(jnp.float32) - want, axis=1) / jnp.linalg.norm(want, axis=1))


def test_rowwise_keeps_every_row_where_tensorwise_loses_the_small_ones():
    # Rows spanning 2**-23 to 1: one scale for the tensor sends the small rows
    # below e4m3's subnormals; a scale per row keeps each row's 3 bits.
    x = jax.random.normal(KEYS[0], (64, 128)) * (2.0 ** -jnp.linspace(0, 23, 64))[:, None]
    w = jax.random.normal(KEYS[1], (128, 64)) / 11
    want = x @ w
    rowwise = _row_errors(jaxamp.amp(lambda x, w: x @ w, compute_dtype=_recipe("rowwise"))(x, w), want)
    tensorwise = _row_errors(jaxamp.amp(lambda x, w: x @ w, compute_dtype=_recipe("tensorwise"))(x, w), want)
    assert rowwise.max() < 0.1, rowwise.max()
    assert tensorwise.max() > 0.5, tensorwise.max()


DOTS = {
    "matrix": ((6, 32), (32, 5), (((1,), (0,)), ((), ()))),
    "transposed": ((32, 6), (5, 32), (((0,), (1,)), ((), ()))),
    "batched": ((3, 6, 16), (3, 16, 4), (((2,), (1,)), ((0,), (0,)))),
    "two_contractions": ((4, 8, 3), (8, 5, 4), (((0, 1), (2, 0)), ((), ()))),
    "batch_last": ((16, 5, 2), (7, 16, 2), (((0,), (1,)), ((2,), (2,)))),
    "mixed": ((3, 16, 5, 32), (32, 3, 7, 16), (((3, 1), (0, 3)), ((0,), (1,)))),
}


def _powers_of_two(key, shape):
    k1, k2 = jax.random.split(key)
    signs = jnp.where(jax.random.bernoulli(k1, 0.5, shape), 1.0, -1.0)
    return signs * 2.0 ** jax.random.randint(k2, shape, -3, 3).astype(jnp.float32)


@pytest.mark.parametrize("scaling", ["rowwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("name", sorted(DOTS))
def test_rowwise_gradients_equal_float32_on_exact_values(name, scaling):
    lhs_shape, rhs_shape, dims = DOTS[name]
    lhs, rhs = _powers_of_two(KEYS[2], lhs_shape), _powers_of_two(KEYS[3], rhs_shape)
    weights = _powers_of_two(KEYS[4], jax.eval_shape(lambda a, b: lax.dot_general(a, b, dims), lhs, rhs).shape)

    def loss(lhs, rhs):
        return jnp.sum(lax.dot_general(lhs, rhs, dims) * weights)

    grad = jax.grad(jaxamp.amp(loss, compute_dtype=_recipe(scaling)), (0, 1))
    found = [
        tuple(sorted(np.dtype(d).name for d in dts)) for _, dts in matmul_operand_dtypes(jax.make_jaxpr(grad)(lhs, rhs))
    ]
    assert found[0] == ("float8_e4m3fn", "float8_e4m3fn")  # forward
    mixed = ("float8_e4m3fn", "float8_e5m2")
    assert sorted(found[1:]) == ([mixed] * 2 if scaling == "rowwise" else sorted([mixed, ("bfloat16", "bfloat16")]))
    d_lhs, d_rhs = jax.jit(grad)(lhs, rhs)
    want_lhs, want_rhs = jax.grad(loss, (0, 1))(lhs, rhs)
    assert d_lhs.dtype == d_rhs.dtype == jnp.float32
    np.testing.assert_allclose(d_lhs, want_lhs, rtol=1e-5, atol=1e-6)
    if scaling == "rowwise":
        np.testing.assert_allclose(d_rhs, want_rhs, rtol=1e-5, atol=1e-6)
    else:  # computed in bf16, its sums rounded to 8 bits as they go: about 2**-8 of the norm
        assert float(jnp.linalg.norm(d_rhs - want_rhs) / jnp.linalg.norm(want_rhs)) < 2**-6


def test_rowwise_saves_bf16_operands_and_tensorwise_float8():
    x = jax.random.normal(KEYS[5], (32, 64))
    w = jax.random.normal(KEYS[6], (64, 48)) / 8

    def saved(scaling):
        fn = jaxamp.amp(lambda x, w: jnp.sum(x @ w), compute_dtype=_recipe(scaling))
        return sorted((np.dtype(a.dtype).name, a.shape) for a, _ in _compat.saved_residuals(fn, x, w))

    assert ("bfloat16", (32, 64)) in saved("rowwise") and ("bfloat16", (64, 48)) in saved("rowwise")
    assert ("float8_e4m3fn", (32, 64)) in saved("tensorwise")


def test_power_of_two_scales():
    x = jax.random.normal(KEYS[7], (16, 16)) * 3.7
    _, scale = quantize(x, jnp.float8_e4m3fn, power_of_two=True)
    mantissa, _ = np.frexp(float(scale))
    assert mantissa == 0.5 and float(jnp.max(jnp.abs(x))) / float(scale) <= 448
    _, exact = quantize(x, jnp.float8_e4m3fn)
    assert float(exact) <= float(scale) < 2 * float(exact)
    assert Fp8Recipe(keep_small_bf16=None, scaling="rowwise").rounds_scales_to_powers_of_two
    assert not Fp8Recipe(keep_small_bf16=None).rounds_scales_to_powers_of_two
    assert Fp8Recipe(keep_small_bf16=None, power_of_two_scales=True).rounds_scales_to_powers_of_two


def test_explain_names_the_recipe():
    def f(x, w):
        return jnp.sum(x @ w)

    x, w = jnp.ones((32, 64)), jnp.ones((64, 48))
    detail = lambda recipe: jaxamp.explain(f, compute_dtype=recipe)(x, w).rows[0].detail  # noqa: E731
    assert detail(_recipe("tensorwise")).endswith("scaling: current")
    assert detail(_recipe("rowwise")).endswith(
        "scaling: current, rowwise, power-of-two scales; the row scales an elementwise pass after each float8 GEMM"
    )
    assert "(weight gradient bf16); scaling: current, rowwise" in detail(_recipe("rowwise_with_gw_hp"))
    assert detail(_recipe("tensorwise", power_of_two_scales=True)).endswith("scaling: current, power-of-two scales")
    assert detail(_recipe("tensorwise", fast_accumulation="none")).endswith("scaling: current; fast accumulation: none")


@pytest.mark.parametrize(
    "fields, error, match",
    [
        (
            {"scaling": "current"},
            ValueError,
            r"Fp8Recipe.scaling must be one of \('tensorwise', 'rowwise', 'rowwise_with_gw_hp', 'mxfp8', 'blockwise', "
            r"'delayed'\), got 'current'",
        ),
        ({"power_of_two_scales": "yes"}, TypeError, r"power_of_two_scales must be a bool or None, got 'yes' \(str\)"),
    ],
)
def test_bad_recipe_fields(fields, error, match):
    with pytest.raises(error, match=match):
        Fp8Recipe(keep_small_bf16=None, **fields)


def test_rowwise_with_gw_hp_makes_the_weight_gradient_bf16_accurate():
    # A random batched matmul (the "mixed" layout): the weight gradient in
    # bf16 has bf16's error (measured 0.37%); rowwise float8's is e4m3's and
    # e5m2's (measured 5.9%; tensorwise 5.2%); the input gradient is float8 in both.
    lhs_shape, rhs_shape, dims = DOTS["mixed"]
    lhs, rhs = jax.random.normal(KEYS[2], lhs_shape), jax.random.normal(KEYS[3], rhs_shape)
    weights = jax.random.normal(KEYS[4], jax.eval_shape(lambda a, b: lax.dot_general(a, b, dims), lhs, rhs).shape)

    def loss(lhs, rhs):
        return jnp.sum(lax.dot_general(lhs, rhs, dims) * weights)

    want = jax.grad(loss, (0, 1))(lhs, rhs)
    errors = {
        scaling: [float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w))
                  for g, w in zip(jax.grad(jaxamp.amp(loss, compute_dtype=_recipe(scaling)), (0, 1))(lhs, rhs), want)]
        for scaling in ("rowwise", "rowwise_with_gw_hp")
    }  # fmt: skip
    assert errors["rowwise_with_gw_hp"][1] < 0.01 < errors["rowwise"][1] < 0.1, errors
    assert errors["rowwise_with_gw_hp"][0] == errors["rowwise"][0], errors


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise", "mxfp8", "blockwise"])
def test_fast_accumulation_is_recorded_on_each_passs_float8_gemms(scaling):
    """Forward GEMMs may accumulate fast (Precision.DEFAULT), gradient GEMMs not
    (HIGHEST) by default, as Transformer Engine and flax's fp8 ops; on a CPU the
    results are the same whichever is chosen."""
    x, w = jax.random.normal(jax.random.key(0), (128, 128)), jax.random.normal(jax.random.key(1), (128, 128))
    fast, full = (jax.lax.Precision.DEFAULT,) * 2, (jax.lax.Precision.HIGHEST,) * 2
    grads = {}
    for option, forward, gradient in (("forward", fast, full), ("all", fast, fast), ("none", full, full)):
        recipe = jaxamp.fp8.Fp8Recipe(
            keep_small_bf16=None,
            scaling=scaling,
            keep_last_matmul_bf16=False,
            gradient_format="e5m2",
            fast_accumulation=option,
        )
        loss = jaxamp.amp(lambda w, x: jnp.sum(jnp.tanh(x @ w)), compute_dtype=recipe)
        jaxpr = jax.make_jaxpr(jax.grad(loss))(w, x)
        seen = {"forward": set(), "gradient": set()}
        for eqn in iter_eqns(jaxpr):
            dtypes = {str(v.aval.dtype) for v in eqn.invars[:2]}
            if eqn.primitive.name == "dot_general" and all(d.startswith("float8") for d in dtypes):
                seen["gradient" if "float8_e5m2" in dtypes else "forward"].add(tuple(eqn.params["precision"]))
        assert seen == {"forward": {forward}, "gradient": {gradient}}, (option, seen)
        grads[option] = jax.grad(loss)(w, x)
    np.testing.assert_array_equal(grads["forward"], grads["all"])
    np.testing.assert_array_equal(grads["forward"], grads["none"])


def test_fast_accumulation_rejects_other_names():
    with pytest.raises(ValueError, match=r"fast_accumulation must be one of \('forward', 'all', 'none'\), got 'bwd'"):
        jaxamp.fp8.Fp8Recipe(keep_small_bf16=None, fast_accumulation="bwd")
