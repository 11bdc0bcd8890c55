"""amp(fn) returns what fn returns: the same tree, leaf types, dtypes and weak types.

A constant output (``jnp.array(False)``: `eqx.nn.BatchNorm`'s "first call"
flag in its State) is a literal in the traced program; amp hands it back as an
Array, as fn and `jax.jit(fn)` do, so an `eqx.filter_jit` step over it does
not retrace when the State's leaf types would otherwise change.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxamp

CONSTANTS = {
    "bool array": lambda x: jnp.array(False),
    "float32 scalar": lambda x: jnp.float32(3.0),
    "weak float": lambda x: jnp.asarray(2.0),
    "int array": lambda x: jnp.arange(3),
    "computed": lambda x: x * 2,
    "computed half": lambda x: (x @ x.T).astype(jnp.float16),
    "python int": lambda x: 5,
    "python str": lambda x: "label",
}


def _describe(leaf):
    if isinstance(leaf, jax.Array):
        return ("Array", leaf.dtype, leaf.shape, jax.typeof(leaf).weak_type)
    return (type(leaf), leaf)


@settings(max_examples=30, deadline=None)
@given(
    names=st.lists(st.sampled_from(sorted(CONSTANTS)), min_size=1, max_size=5),
    compute_dtype=st.sampled_from(["bf16", "f16"]),
    jit=st.booleans(),
)
def test_outputs_keep_their_leaf_types(names, compute_dtype, jit):
    def fn(x):
        return {f"{i}:{name}": CONSTANTS[name](x) for i, name in enumerate(names)}

    x = jnp.ones((2, 2))
    expected = jax.tree_util.tree_map(_describe, fn(x))
    amp_fn = jaxamp.amp(fn, compute_dtype=compute_dtype)
    if jit:
        amp_fn, expected = eqx.filter_jit(amp_fn), jax.tree_util.tree_map(_describe, eqx.filter_jit(fn)(x))
    for _ in range(2):  # the first eager call traces, the second hits the cache
        got = jax.tree_util.tree_map(_describe, amp_fn(x))
        assert got == expected


def test_filter_jit_over_an_amped_batchnorm_traces_once():
    model, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, axis_name="batch")
    traces = []

    @eqx.filter_jit
    def step(model, state, x):
        traces.append(None)
        out, state = jax.vmap(
            jaxamp.amp(model, compute_dtype="bf16"), axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )(x, state)
        return out, state

    x = jax.random.normal(jax.random.PRNGKey(0), (8, 4))
    leaf_types = None
    for _ in range(3):
        out, state = step(model, state, x)
        types = [type(leaf) for leaf in jax.tree_util.tree_leaves(state)]
        assert leaf_types is None or types == leaf_types
        leaf_types = types
    assert len(traces) == 1
    assert np.isfinite(np.asarray(out, np.float32)).all()


@pytest.mark.parametrize("compute_dtype", ["bf16", "f16"])
def test_eager_batchnorm_state_keeps_array_leaves(compute_dtype):
    model, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, axis_name="batch")
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 4))
    plain = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)[1]
    amped = jax.vmap(
        jaxamp.amp(model, compute_dtype=compute_dtype), axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )(x, state)[1]
    assert [type(leaf) for leaf in jax.tree_util.tree_leaves(amped)] == [
        type(leaf) for leaf in jax.tree_util.tree_leaves(plain)
    ]
