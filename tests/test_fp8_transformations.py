"""fp8 mode under every JAX transformation of a derivative.

The float8 matmul is a `jax.custom_jvp` whose tangent products are
`linear_call`s transposed into float8 gradient matmuls (see
`jaxamp.fp8._differentiable`): forward mode (`jax.jvp`, `jax.linearize`,
`jax.jacfwd`), reverse mode and `vmap` of either work, and so do
`jax.custom_jvp` rules with matmuls; where amp sees a derivative of a
derivative (its operands differentiated twice) the matmul runs in bf16 with a
warning, and where it cannot (a derivative of a traced derivative) it raises
`Fp8HigherOrderError` rather than returning one without the terms the float8
residuals cannot carry.

Exactness: on a network of scaled signed permutation matrices with power-of-two
entries, every product moves single powers of two, which e4m3, e5m2 and
bfloat16 hold exactly under power-of-two scales, so each figure must equal
float32's bit for bit: a wrong derivative cannot hide in float8's rounding.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp import _compat

from jaxpr_walk import matmul_operand_dtypes

# These tests' matmuls are small: all of them in float8, the size rule off.
FP8 = jaxamp.fp8.Fp8Recipe(keep_small_bf16=None)

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals

E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
RECIPES = {
    scaling: jaxamp.fp8.Fp8Recipe(
        keep_small_bf16=None,
        scaling=scaling,
        min_contraction=1,
        gemm_multiple=1,
        keep_last_matmul_bf16=False,
        power_of_two_scales=True,
    )
    for scaling in ("tensorwise", "rowwise", "rowwise_with_gw_hp")
}


def _signed_permutation(rng, n):
    p = np.zeros((n, n), np.float32)
    p[np.arange(n), rng.permutation(n)] = rng.choice([-1, 1], n) * 2.0 ** rng.integers(-2, 2, n)
    return p


def _problem(seed=0, n=16):
    rng = np.random.default_rng(seed)
    x, w1, w2, v1, v2 = (_signed_permutation(rng, n) for _ in range(5))
    c = (rng.choice([-1, 1], (n, n)) * 2.0 ** rng.integers(-2, 2, (n, n))).astype(np.float32)

    def loss(w1, w2):
        h = x @ w1
        return jnp.sum(((h * h) @ w2) * c)

    return loss, (w1, w2), (v1, v2)


TRANSFORMATIONS = {
    "grad": lambda f, w, v: jax.grad(f, (0, 1))(*w),
    "jvp": lambda f, w, v: jax.jvp(f, w, v)[1],
    "linearize": lambda f, w, v: jax.linearize(f, *w)[1](*v),
    "jacfwd": lambda f, w, v: jax.jacfwd(f, (0, 1))(*w),
    "jit(jacfwd)": lambda f, w, v: jax.jit(jax.jacfwd(f, (0, 1)))(*w),
    "vmap(grad)": lambda f, w, v: jax.vmap(jax.grad(f), (0, None))(jnp.stack([w[0], 2 * w[0]]), w[1]),
    "jacrev": lambda f, w, v: jax.jacrev(f, (0, 1))(*w),
    "vjp": lambda f, w, v: jax.vjp(f, *w)[1](jnp.float32(2.0)),
}


def _assert_equal(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("transformation", sorted(TRANSFORMATIONS))
@pytest.mark.parametrize(
    "scaling",
    # On the oldest JAX, every transformation with one recipe: the others take the same paths through JAX.
    [pytest.param(s, marks=() if s == "tensorwise" else pytest.mark.newest_only) for s in sorted(RECIPES)],
)
@pytest.mark.newest_only
def test_first_order_and_forward_mode_equal_float32_where_float8_is_exact(scaling, transformation):
    loss, w, v = _problem()
    run = TRANSFORMATIONS[transformation]
    _assert_equal(run(jaxamp.amp(loss, compute_dtype=RECIPES[scaling]), w, v), run(loss, w, v))


@pytest.mark.parametrize("transformation", ["jvp", "linearize", "jacfwd"])
@pytest.mark.newest_only
def test_forward_mode_runs_the_forward_matmuls_in_float8(transformation):
    loss, w, v = _problem()
    fp8 = jaxamp.amp(loss, compute_dtype=RECIPES["tensorwise"])
    jaxpr = jax.make_jaxpr(lambda *w: TRANSFORMATIONS[transformation](fp8, w, v))(*w)
    dtypes = matmul_operand_dtypes(jaxpr)
    # The primal matmuls run e4m3 x e4m3; each tangent product multiplies the
    # tangent, in the compute dtype, by the other operand as float8 holds it.
    assert sum(ds == (E4M3, E4M3) for _, ds in dtypes) == 2, dtypes
    assert all(d in (E4M3, jnp.dtype(jnp.bfloat16)) for _, ds in dtypes for d in ds), dtypes


@pytest.mark.newest_only
def test_reverse_mode_keeps_float8_residuals_and_e5m2_cotangents():
    loss, w, v = _problem()
    saved = {}
    for name, mode in (("fp8", RECIPES["tensorwise"]), ("bf16", "bf16")):
        residuals = _compat.saved_residuals(jaxamp.amp(loss, compute_dtype=mode), *w)
        saved[name] = [aval for aval, source in residuals if not source.startswith("from the argument")]
    # x (a constant) for w1's gradient, (h * h) for w2's and w2 for (h * h)'s:
    # three float8 operands with float32 scalar scales, where bf16 mode saves
    # them in bfloat16.
    assert sum(a.dtype == E4M3 for a in saved["fp8"]) == 3, saved["fp8"]
    nbytes = {name: sum(a.size * a.dtype.itemsize for a in avals) for name, avals in saved.items()}
    assert nbytes["fp8"] == nbytes["bf16"] - 3 * 16 * 16 + 3 * 4, nbytes
    fp8 = jaxamp.amp(loss, compute_dtype=RECIPES["tensorwise"])
    backward = matmul_operand_dtypes(jax.make_jaxpr(jax.grad(fp8, (0, 1)))(*w))
    gradient_matmuls = [ds for _, ds in backward if E5M2 in ds]
    assert len(gradient_matmuls) == 3 and all(ds in ((E5M2, E4M3), (E4M3, E5M2)) for ds in gradient_matmuls)


HIGHER_ORDER = {
    "hessian": lambda f, w, v: jax.hessian(f, (0, 1))(*w),
    "jvp(grad)": lambda f, w, v: jax.jvp(jax.grad(f, (0, 1)), w, v)[1],
    "grad(grad)": lambda f, w, v: jax.grad(lambda *u: jnp.sum(jax.grad(f, (0, 1))(*u)[1]), (0, 1))(*w),
    "jvp(jit(grad))": lambda f, w, v: jax.jvp(jax.jit(jax.grad(f, (0, 1))), w, v)[1],
}


@pytest.mark.parametrize("transformation", sorted(set(HIGHER_ORDER) - {"jvp(jit(grad))"}))
@pytest.mark.newest_only
def test_a_derivative_of_a_derivative_runs_its_matmuls_in_bf16_with_a_warning(transformation, fresh_warnings):
    # Once fp8 mode returned -inf (forward over reverse) or half the value
    # (grad of grad) without a word, then raised. amp sees the operands
    # differentiated twice and runs those matmuls as bf16 mode does, whose
    # answer here is float32's.
    loss, w, v = _problem()
    run = HIGHER_ORDER[transformation]
    with pytest.warns(UserWarning, match="run in bfloat16 where their operands are differentiated twice"):
        got = run(jaxamp.amp(loss, compute_dtype=RECIPES["tensorwise"]), w, v)
    _assert_equal(got, run(loss, w, v))


@pytest.mark.newest_only
def test_a_hessian_in_fp8_mode_is_bf16_modes_on_random_values(fresh_warnings):
    k = jax.random.split(jax.random.key(0), 3)
    x, w1, w2 = (jax.random.normal(ki, (32, 32)) for ki in k)

    def loss(w1, w2):
        return jnp.sum(jnp.tanh(x @ w1) @ w2) ** 2

    # Both matmuls in float8 (they share jnp.matmul's body, the last matmul's).
    recipe = jaxamp.fp8.Fp8Recipe(keep_small_bf16=None, keep_last_matmul_bf16=False)
    with pytest.warns(UserWarning, match="differentiated twice"):
        fp8 = jax.jit(jax.hessian(jaxamp.amp(loss, compute_dtype=recipe), (0, 1)))(w1, w2)
    bf16 = jax.jit(jax.hessian(jaxamp.amp(loss, compute_dtype="bf16"), (0, 1)))(w1, w2)
    _assert_equal(fp8, bf16)
    # While the first derivative stays float8.
    matmuls = matmul_operand_dtypes(jax.make_jaxpr(jax.grad(jaxamp.amp(loss, compute_dtype=recipe), (0, 1)))(w1, w2))
    assert sum(E5M2 in dtypes for _, dtypes in matmuls) == 3, matmuls


def test_a_derivative_taken_of_a_traced_derivative_raises_a_clear_error():
    # jax.jvp of a jax.jit'd gradient differentiates the traced program, which
    # amp never sees differentiated twice: the float8 residual's guard says so.
    loss, w, v = _problem()
    run = HIGHER_ORDER["jvp(jit(grad))"]
    _assert_equal(run(jaxamp.amp(loss, compute_dtype="bf16"), w, v), run(loss, w, v))
    with pytest.raises(jaxamp.fp8.Fp8HigherOrderError, match="differentiated again.*compute_dtype='bf16'"):
        run(jaxamp.amp(loss, compute_dtype=RECIPES["tensorwise"]), w, v)


def test_differentiating_a_derivative_through_no_float8_residual_is_exact():
    # w1's gradient reads the constant x's float8 copy and w2's, which the
    # outer derivative (with respect to w1 alone) does not move: nothing is lost.
    loss, w, v = _problem()

    def second(f):
        return jax.grad(lambda w1: jnp.sum(jax.grad(f)(w1, w[1])))(w[0])

    _assert_equal(second(jaxamp.amp(loss, compute_dtype=RECIPES["tensorwise"])), second(loss))


@jax.custom_jvp
def _linear_layer(x, w):
    return x @ w


@_linear_layer.defjvp
def _linear_layer_jvp(primals, tangents):
    x, w = primals
    tx, tw = tangents
    return x @ w, tx @ w + x @ tw


def test_custom_jvp_rules_with_matmuls_run_their_tangent_products_in_float8():
    loss, w, v = _problem()

    def custom(w1, w2):
        x = jnp.asarray(_problem()[1][0])  # any exact matrix
        h = _linear_layer(x, w1)
        return loss(h, w2)

    fp8 = jaxamp.amp(custom, compute_dtype=RECIPES["tensorwise"])
    for name in ("grad", "jvp", "jacfwd", "vmap(grad)"):
        _assert_equal(TRANSFORMATIONS[name](fp8, w, v), TRANSFORMATIONS[name](custom, w, v))
    # Every matmul of the program JAX lowers runs in float8. (The traced
    # jaxpr also holds a dead tangent product of the constant's zero tangent,
    # which JAX instantiates for a rule without symbolic zeros; lowering drops it.)
    lowered = jax.jit(jax.grad(fp8, (0, 1))).lower(*w).as_text()
    operands = re.findall(r"stablehlo.dot_general.*: \((tensor<[^)]*)\) ->", lowered)
    assert len(operands) >= 5, operands
    assert all(re.fullmatch(r"tensor<16x16xf8E(4M3FN|5M2)>, tensor<16x16xf8E4M3FN>", o) for o in operands), operands


def test_a_matmul_in_a_jit_nested_in_a_custom_jvp_rule_runs_in_bf16_with_a_warning():
    @jax.custom_jvp
    def layer(x, w):
        return x @ w

    @layer.defjvp
    def layer_jvp(primals, tangents):
        x, w = primals
        tx, tw = tangents
        return x @ w, jax.jit(lambda a, b: a @ b)(tx, w) + x @ tw

    loss, w, v = _problem()
    x = _problem(1)[1][0]

    def custom(w1, w2):
        return loss(layer(x, w1), w2)

    with pytest.warns(UserWarning, match="nested in a custom_jvp rule"):
        grads = jax.grad(jaxamp.amp(custom, compute_dtype=RECIPES["tensorwise"]), (0, 1))(*w)
    _assert_equal(grads, jax.grad(custom, (0, 1))(*w))


@pytest.mark.newest_only
def test_random_values_forward_mode_agrees_with_reverse_mode_within_float8_rounding():
    # <grad f(w), v> and jvp(f)(w; v) are the same straight-through derivative,
    # the first with e5m2 cotangents, the second with bf16 tangent products.
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (32, 64))
    w1, w2 = jax.random.normal(k[1], (64, 64)) / 8, jax.random.normal(k[2], (64, 32)) / 8
    v = jax.random.normal(k[3], w1.shape) / 8

    def loss(w1):
        return jnp.sum(jnp.tanh(jnp.tanh(x @ w1) @ w2) ** 2)

    fp8 = jaxamp.amp(loss, compute_dtype=FP8)
    reverse = float(jnp.vdot(jax.grad(fp8)(w1), v))
    forward = float(jax.jvp(fp8, (w1,), (v,))[1])
    exact = float(jax.jvp(loss, (w1,), (v,))[1])
    # Measured: forward 8.0% and reverse 10.6% from float32 (e4m3 operands,
    # e5m2 cotangents on 64-wide contractions); bf16 mode 1.8% and 0.4%.
    assert abs(forward - exact) < 0.15 * abs(exact) and abs(reverse - exact) < 0.15 * abs(exact)
