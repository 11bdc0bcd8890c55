"""Hypothesis properties of `jaxamp.amp` on random programs and random pytrees.

A program is a short list of layers drawn by hypothesis (matmuls, biases,
activations, normalisations, softmax, cumulative sums...), each mapping a
``(rows, width)`` activation to one of the same shape, applied to an input whose
shape hypothesis also draws. Weights and inputs come from a drawn seed. For such
programs, under float16 and bfloat16:

* ``amp(f)`` returns what ``f`` returns (dtype, shape) within a tolerance of
  float32 that grows with the program's length;
* ``jax.grad(amp(f))`` gives float32, finite gradients close to float32's (the
  smooth layers only: a kink such as relu's turns a rounding into a jump);
* ``jax.vmap(amp(f))`` equals ``amp(f)`` applied per example and stacked, and
  still runs its matmuls in the compute dtype.

And random pytrees of mixed leaves (dicts, tuples, lists, None; float32, float16,
bfloat16, int32 and bool arrays, jax and numpy; Python scalars and strings) go
through ``amp`` of an identity-like function with their structure, their
non-array leaves (the very same objects) and their array dtypes kept.

Example counts are small so the file runs in well under a minute on two cores;
each example compiles a few primitives for its shapes, so shapes are drawn from
short ranges that let the compilation cache work.
"""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from jax import lax
from test_primitive_sweep import UNIT_ROUNDOFF, assert_matches

import jaxamp

from jaxpr_walk import assert_all_matmuls_in

F32, F16, BF16 = np.dtype(jnp.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16)
COMPUTE_DTYPES = st.sampled_from([F16, BF16])

# Each layer of a program rounds its operands and its result to the compute
# dtype and passes on the error of the layers before it, which its condition
# number (about 1 for these layers and weights of variance 1/width) neither grows
# nor shrinks much. Measured over 300 random programs the error stays under
# 1.5 u per layer; 4 u per layer bounds it with a margin.
ULPS_PER_LAYER = 4
# Gradients run every layer twice (forward and transposed), and the transposes
# multiply by the forward activations' errors: twice the forward budget.
GRAD_ULPS_PER_LAYER = 2 * ULPS_PER_LAYER
# vmap changes only which kernels run: XLA's CPU tanh, for one, can differ by a
# float32 ulp between a (3, 1) and a (2, 3, 1) operand, which may flip one
# rounding to half precision. One u per layer allows one such flip each.
VMAP_ULPS_PER_LAYER = 1

EXAMPLES = settings(max_examples=25, deadline=None)


# --- random programs ----------------------------------------------------------------


def _rms_norm(h):
    # The +1 keeps it well conditioned where an activation row is near zero.
    return h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1)


# name -> layer(h, w, b): h is (rows, width), w (width, width), b (width,).
SMOOTH_LAYERS = {
    "matmul": lambda h, w, b: h @ w,
    "bias": lambda h, w, b: h + b,
    "scale": lambda h, w, b: h * b,
    "residual_matmul_tanh": lambda h, w, b: h + jnp.tanh(h @ w + b),
    "tanh": lambda h, w, b: jnp.tanh(h),
    "sin": lambda h, w, b: jnp.sin(h),
    "gelu": lambda h, w, b: jax.nn.gelu(h),
    "silu": lambda h, w, b: jax.nn.silu(h),
    "gaussian": lambda h, w, b: jnp.exp(-h * h),
    "softmax": lambda h, w, b: jax.nn.softmax(h, axis=-1),
    "log_softmax": lambda h, w, b: jax.nn.log_softmax(h, axis=-1),
    "rms_norm": lambda h, w, b: _rms_norm(h),
    "mix_rows": lambda h, w, b: h + jnp.mean(h, axis=0),
    "cumsum": lambda h, w, b: jnp.cumsum(h, axis=-1) / h.shape[-1],
    "self_attention": lambda h, w, b: jax.nn.softmax(h @ h.T / np.sqrt(h.shape[-1])) @ h,
}
# Continuous but with kinks: fine for values, not for gradients.
LAYERS = {
    **SMOOTH_LAYERS,
    "relu": lambda h, w, b: jax.nn.relu(h),
    "abs": lambda h, w, b: jnp.abs(h),
    "max_rows": lambda h, w, b: h - jnp.max(h, axis=0),
}


@dataclasses.dataclass(frozen=True)
class Program:
    """Layers applied in order; weights, inputs and the loss from `seed`."""

    layers: tuple[str, ...]
    rows: int
    width: int
    seed: int

    def __call__(self, params, x):
        h = x
        for name, (w, b) in zip(self.layers, params):
            h = LAYERS[name](h, w, b)
        return h

    def _rng(self, stream):
        return np.random.default_rng([self.seed, stream])

    def params(self):
        rng = self._rng(0)
        return [
            (
                rng.normal(0, self.width**-0.5, (self.width, self.width)).astype(np.float32),
                rng.uniform(-1, 1, self.width).astype(np.float32),
            )
            for _ in self.layers
        ]

    def inputs(self, *batch):
        return self._rng(1).uniform(-2, 2, (*batch, self.rows, self.width)).astype(np.float32)

    def loss(self, params, x):
        # A fixed random projection, not a plain sum: softmax rows sum to 1,
        # whose gradient is zero up to rounding noise.
        r = self._rng(2).uniform(-1, 1, (self.rows, self.width)).astype(np.float32)
        return jnp.sum(self(params, x) * r)


def programs(layers):
    return st.builds(
        Program,
        layers=st.lists(st.sampled_from(sorted(layers)), min_size=1, max_size=5).map(tuple),
        rows=st.integers(1, 3),
        width=st.sampled_from([1, 2, 4]),
        seed=st.integers(0, 2**16),
    )


def tolerance(dtype, program, ulps_per_layer):
    return UNIT_ROUNDOFF[dtype] * ulps_per_layer * len(program.layers)


def assert_close(actual, expected, dtype, program, ulps_per_layer):
    # Errors are measured against magnitude 1, the scale of the activations
    # (inputs in [-2, 2], weights of variance 1/width, bounded layers) and so of
    # the gradients: a last layer that squashes values (gelu's negative tail, a
    # gaussian far out) shrinks them but not the error they already carry.
    assert_matches(actual, expected, tolerance(dtype, program, ulps_per_layer), magnitude=1.0)


@EXAMPLES
@given(program=programs(LAYERS), dtype=COMPUTE_DTYPES)
def test_random_program_close_to_float32(program, dtype):
    params, x = program.params(), program.inputs()
    expected = program(params, x)
    actual = jaxamp.amp(program, compute_dtype=dtype)(params, x)
    assert_close(actual, expected, dtype, program, ULPS_PER_LAYER)


@EXAMPLES
@given(program=programs(SMOOTH_LAYERS), dtype=COMPUTE_DTYPES)
def test_grad_of_random_program(program, dtype):
    params, x = program.params(), program.inputs()
    expected = jax.grad(program.loss, argnums=(0, 1))(params, x)
    actual = jax.grad(jaxamp.amp(program.loss, compute_dtype=dtype), argnums=(0, 1))(params, x)
    for g in jax.tree.leaves(actual):
        assert g.dtype == F32
        assert np.all(np.isfinite(g))
    assert_close(actual, expected, dtype, program, GRAD_ULPS_PER_LAYER)


@EXAMPLES
@given(program=programs(LAYERS), dtype=COMPUTE_DTYPES, batch=st.integers(1, 3))
def test_vmap_equals_per_example(program, dtype, batch):
    params, xs = program.params(), program.inputs(batch)
    amp_program = jaxamp.amp(program, compute_dtype=dtype)
    batched = jax.vmap(amp_program, in_axes=(None, 0))
    stacked = jnp.stack([amp_program(params, x) for x in xs])
    assert_close(batched(params, xs), stacked, dtype, program, VMAP_ULPS_PER_LAYER)
    # ...and the batched program still computes its matmuls in half.
    if any("matmul" in name or "attention" in name for name in program.layers):
        assert_all_matmuls_in(jax.make_jaxpr(batched)(params, xs), dtype)


# --- random pytrees ----------------------------------------------------------------------

ARRAY_DTYPES = [F32, F16, BF16, np.dtype(np.int32), np.dtype(bool)]


@st.composite
def arrays(draw):
    dtype = draw(st.sampled_from(ARRAY_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    values = rng.uniform(-4, 4, shape)
    if dtype == np.dtype(bool):
        values = values > 0
    x = np.asarray(values, dtype)
    kind = draw(st.sampled_from(["jax", "numpy", "numpy scalar"]))
    if kind == "jax":
        return jnp.asarray(x)
    return x[()] if kind == "numpy scalar" and x.ndim == 0 else x


STATIC_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, width=32)
    | st.text(max_size=4)
)

PYTREES = st.recursive(
    arrays() | STATIC_LEAVES,
    lambda children: (
        st.lists(children, max_size=3)
        | st.tuples(children, children)
        | st.dictionaries(st.text(max_size=3), children, max_size=3)
    ),
    max_leaves=8,
)


def is_array(x):
    # As equinox, and so amp, tells array leaves from static ones.
    return isinstance(x, (np.ndarray, np.generic, jax.Array))


def touch(tree):
    """Identity-like: floats through a matmul (so amp computes them in half),
    ints plus one, bools negated, everything else returned as is."""

    def leaf(x):
        if not is_array(x):
            return x
        if x.dtype == bool:
            return ~x
        if jnp.issubdtype(x.dtype, jnp.integer):
            return x + 1
        return lax.dot_general(x, jnp.ones((), x.dtype), (((), ()), ((), ())))

    return jax.tree.map(leaf, tree)


@settings(max_examples=60, deadline=None)
@given(tree=PYTREES, dtype=COMPUTE_DTYPES)
def test_pytrees_of_mixed_leaves_round_trip(tree, dtype):
    actual = jaxamp.amp(touch, compute_dtype=dtype)(tree)
    assert jax.tree.structure(actual) == jax.tree.structure(tree)
    # The plain function's results, as arrays: numpy turns 0-d results into scalars.
    expected = [np.asarray(e) for e in jax.tree.leaves(touch(tree))]
    for a, x, e in zip(jax.tree.leaves(actual), jax.tree.leaves(tree), expected):
        if is_array(x):
            assert isinstance(a, jax.Array) and (a.dtype, a.shape) == (x.dtype, x.shape)
            # A float16 leaf under bfloat16 (or the reverse) is computed in the
            # coarser of the two: one rounding to it.
            assert_matches(a, e, UNIT_ROUNDOFF[BF16])
        else:
            assert a is x
