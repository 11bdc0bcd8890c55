"""The lowered shape of fp8 mode's matmuls: what XLA's GPU float8 GEMM rewriter takes.

XLA's GemmRewriter (xla/service/gpu/transforms/gemm_rewriter_fp8_test.cc)
makes a ``__cublas$lt$matmul$f8`` call of a ``dot`` whose operands are float8
(or float8 converted up, times a broadcast scalar), and folds a following
``multiply(dot, broadcast(scalar))`` into the call's scale operand; a
dequantisation before the dot, or a transpose between the dot and its scale,
leaves work outside the GEMM. Each recipe's amp'd matmul and its two gradient
matmuls are lowered here (StableHLO, on this CPU) and their shape checked,
beside flax's ``Fp8DirectDotGeneralOp`` on the same matmul.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import pytest

import jaxamp
from jaxamp.fp8 import Fp8Recipe

X, W = jnp.ones((4, 64, 128)), jnp.ones((128, 256))
_LINE = re.compile(r"^\s*(%[\w#:]+) = stablehlo\.(\w+) (.*)$")


def _loss(x, w):
    return jnp.sum(jnp.tanh(x @ w))


def _program(recipe: Fp8Recipe) -> str:
    loss = jaxamp.amp(_loss, compute_dtype=recipe)
    if recipe.scaling == "delayed":
        state = jaxamp.fp8.init_fp8_state(loss, X, W)
        grad = jax.grad(lambda x, w, s: loss(x, w, fp8_state=s), argnums=(0, 1, 2))
        return jax.jit(grad).lower(X, W, state).as_text()
    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(X, W).as_text()


def _flax_program() -> str:
    import flax.linen as nn

    dense = nn.Dense(256, use_bias=False, dot_general_cls=nn.Fp8DirectDotGeneralOp)
    variables = dense.init(jax.random.PRNGKey(0), X)

    def loss(variables, x):
        return jnp.sum(jnp.tanh(dense.apply(variables, x)))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(variables, X).as_text()


def _ops(text: str) -> dict[str, tuple[str, str]]:
    """``{result name: (op, rest of the line)}`` of a StableHLO module's lines."""
    found = {}
    for line in text.splitlines():
        if match := _LINE.match(line):
            found[match.group(1).split(":")[0]] = (match.group(2), match.group(3))
    return found


def _float8_dots(text: str) -> list[dict]:
    """Each ``dot_general`` with a float8 operand: its name, operand types and dims, result type, users."""
    ops = _ops(text)
    dots = []
    for name, (op, rest) in ops.items():
        if op != "dot_general" or "xf8" not in rest:
            continue
        operands = re.findall(r"tensor<([\dx]*)x(f8\w+|f32|bf16)>", rest.split(" : ")[-1])
        users = [(n, o, r) for n, (o, r) in ops.items() if re.search(rf"{re.escape(name)}\b(?!#)", r)]
        dots.append(
            {
                "name": name,
                "types": tuple(t for _, t in operands),
                "dims": re.search(r"contracting_dims = (\[[\d, ]*\] x \[[\d, ]*\])", rest).group(1),
                "batch": "batching_dims" in rest,
                "users": users,
            }
        )
    return dots


def _scale_of(ops: dict, multiply_rest: str, dot: str) -> str:
    """The shape of the scale a ``multiply`` of `dot` takes: its other operand, through ``broadcast_in_dim``."""
    (other,) = [n for n in re.findall(r"(%[\w#]+)", multiply_rest.split(" : ")[0]) if n != dot]
    op, rest = ops[other]
    assert op == "broadcast_in_dim", (op, rest)
    return re.search(r"\(tensor<([^>]*)>\)", rest).group(1)


def _signature(dots: list[dict]) -> list[tuple]:
    return sorted((d["types"], d["dims"]) for d in dots)


def test_the_rewriter_s_pattern_is_flax_s_too():
    # The reference: flax's float8 ops multiply float8 operands and scale after.
    dots = _float8_dots(_flax_program())
    assert _signature(dots) == [
        (("f8E4M3FN", "f8E4M3FN", "f32"), "[2] x [0]"),
        (("f8E5M2", "f8E4M3FN", "f32"), "[0, 1] x [0, 1]"),
        (("f8E5M2", "f8E4M3FN", "f32"), "[2] x [1]"),
    ]


@pytest.mark.parametrize("scaling", ["tensorwise", "delayed"])
def test_per_tensor_recipes_lower_to_the_rewriter_s_pattern(scaling):
    text = _program(Fp8Recipe(scaling=scaling, keep_last_matmul_bf16=False, keep_small_bf16=None))
    ops, dots = _ops(text), _float8_dots(text)
    # The same three float8 GEMMs as flax's, operands in the same formats and layouts.
    assert _signature(dots) == _signature(_float8_dots(_flax_program()))
    for dot in dots:
        # Each operand is a quantisation (a convert to float8), not a dequantised copy.
        names = re.findall(r"%[\w#]+", ops[dot["name"]][1])[:2]
        assert all(ops[n][0] == "convert" and "xf8" in ops[n][1].split("->")[-1] for n in names), names
        # The only user multiplies it by a broadcast scalar: the scale the rewriter folds.
        ((_, op, rest),) = dot["users"]
        assert op == "multiply", (op, rest)
        assert re.fullmatch(r"f32", _scale_of(ops, rest, dot["name"])), rest
    # No float8 value is converted back up anywhere: nothing is dequantised.
    assert not re.search(r"stablehlo\.convert %\S+ : \(tensor<[\dx]*f8", text)


@pytest.mark.parametrize("scaling", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_recipes_multiply_float8_operands_and_scale_rows_after(scaling):
    text = _program(Fp8Recipe(scaling=scaling, keep_last_matmul_bf16=False, keep_small_bf16=None))
    ops, dots = _ops(text), _float8_dots(text)
    assert len(dots) == (3 if scaling == "rowwise" else 2)
    assert not re.search(r"stablehlo\.convert %\S+ : \(tensor<[\dx]*f8", text)
    # The row scales are vectors: cuBLAS's float8 GEMM takes one scale per operand,
    # so they stay an elementwise pass after it (explain says so).
    forward = next(d for d in dots if d["types"][0] == "f8E4M3FN")
    ((_, op, rest),) = forward["users"]
    assert op == "multiply" and _scale_of(ops, rest, forward["name"]) == "4x64xf32"


@pytest.mark.parametrize("scaling", ["mxfp8", "blockwise"])
def test_block_recipes_are_not_one_float8_gemm(scaling):
    # Emulated: the float8 product runs per block of the contraction (a batch
    # dimension of the dot), float32 partials blocks x the result's size.
    dots = _float8_dots(_program(Fp8Recipe(scaling=scaling, keep_last_matmul_bf16=False, keep_small_bf16=None)))
    assert len(dots) == 3 and all(d["batch"] for d in dots)
    detail = jaxamp.explain(
        _loss, compute_dtype=Fp8Recipe(scaling=scaling, keep_last_matmul_bf16=False, keep_small_bf16=None)
    )(X, W)
    assert "not one float8 GEMM on a GPU" in detail.rows[0].detail


def test_the_checks_see_a_dequantised_matmul():
    # The checks can fail: flax's older Fp8DotGeneralOp dequantises before a
    # higher-precision dot (the other shape the rewriter takes), so no dot has
    # float8 operands and converts of float8 values appear.
    import flax.linen as nn

    dense = nn.Dense(256, use_bias=False, dot_general_cls=nn.Fp8DotGeneralOp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        variables = dense.init(jax.random.PRNGKey(0), X)
        text = jax.jit(lambda v, x: dense.apply(v, x)).lower(variables, X).as_text()
    assert _float8_dots(text) == []
    assert re.search(r"stablehlo\.convert %\S+ : \(tensor<[\dx]*f8", text)
