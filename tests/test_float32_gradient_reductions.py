"""amp(..., float32_gradient_reductions=True): cross-device gradient sums in float32.

Without the option a data-parallel float16 step all-reduces the scaled float16
partial gradients (as hand-cast code does); with it every matmul accumulates
in float32 and hands on in float16, so XLA's all-reduce of the weight
gradients is float32. Checked in the compiled HLO of a 4-device step, in the
jaxpr (every matmul's operands and accumulation dtype), and in the numbers.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp

from jaxpr_walk import MATMUL_PRIMITIVES, iter_eqns

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals

D, H, BATCH = 32, 64, 64


def _params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w1": jax.random.normal(k1, (D, H)) / np.sqrt(D), "w2": jax.random.normal(k2, (H, 8)) / np.sqrt(H)}


def _loss(params, x):
    h = jax.nn.relu(x @ params["w1"])
    return jnp.mean((h @ params["w2"]) ** 2)


def _batch():
    return jax.random.normal(jax.random.PRNGKey(1), (BATCH, D))


def _all_reduce_dtypes(hlo):
    return sorted(set(re.findall(r"= \(?(\w+)\[[^\]]*\][^=]*all-reduce\(", hlo)))


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.newest_only
def test_data_parallel_gradient_all_reduces_run_in_float32(axis_type):
    # float16: XLA's CPU backend keeps float16 dots (it upcasts bfloat16 ones,
    # so a bfloat16 step all-reduces float32 on CPU either way; on a GPU it
    # is the same picture as float16's).
    mesh = jax.make_mesh((4,), ("dp",), axis_types=(axis_type,))
    with jax.set_mesh(mesh):
        params = jax.device_put(_params(), NamedSharding(mesh, P()))
        x = jax.device_put(_batch(), NamedSharding(mesh, P("dp")))
        for option, expected in ((False, ["f16"]), (True, ["f32"])):
            loss = jaxamp.amp(_loss, compute_dtype="f16", float32_gradient_reductions=option)
            hlo = jax.jit(jax.grad(loss)).lower(params, x).compile().as_text()
            assert _all_reduce_dtypes(hlo) == expected
            grads = jax.jit(jax.grad(loss))(params, x)
            # amp never changes a sharding: the gradients' are the plain program's.
            plain = jax.jit(jax.grad(_loss))(params, x)
            for name in plain:
                assert jax.typeof(grads[name]) == jax.typeof(plain[name])


@pytest.mark.newest_only
def test_every_matmul_runs_half_operands_with_float32_accumulation():
    loss = jaxamp.amp(_loss, compute_dtype="f16", float32_gradient_reductions=True)
    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(_params(), _batch())
    matmuls = [e for e in iter_eqns(jaxpr) if e.primitive.name in MATMUL_PRIMITIVES]
    # Two forward, four backward: the custom_vjp also forms x's gradient,
    # which XLA drops as unused.
    assert len(matmuls) == 6
    for eqn in matmuls:
        assert [v.aval.dtype for v in eqn.invars] == [jnp.float16] * 2
        assert eqn.params["preferred_element_type"] == jnp.float32
    grads = jax.grad(loss)(_params(), _batch())
    assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(grads))


def test_gradients_match_float32_as_closely_as_without_the_option():
    reference = jax.grad(_loss)(_params(), _batch())
    for option in (False, True):
        loss = jaxamp.amp(_loss, compute_dtype="bf16", float32_gradient_reductions=option)
        grads = jax.grad(loss)(_params(), _batch())
        for name in reference:
            error = np.linalg.norm(grads[name] - reference[name]) / np.linalg.norm(reference[name])
            assert error < 1.5e-2, (option, name, error)


@pytest.mark.newest_only
def test_a_matmul_the_table_keeps_in_float32_is_left_alone():
    table = jaxamp.default_amp_policy | {jax.lax.dot_general_p: jaxamp.use_original_precision}
    loss = jaxamp.amp(_loss, compute_dtype="f16", amp_policy=table, float32_gradient_reductions=True)
    jaxpr = jax.make_jaxpr(loss)(_params(), _batch())
    for eqn in iter_eqns(jaxpr):
        if eqn.primitive.name == "dot_general":
            assert [v.aval.dtype for v in eqn.invars] == [jnp.float32] * 2


def test_option_must_be_a_bool():
    with pytest.raises(TypeError, match="float32_gradient_reductions must be a bool, got 'yes'"):
        jaxamp.amp(_loss, float32_gradient_reductions="yes")


def test_explain_names_the_float32_accumulation():
    report = jaxamp.explain(_loss, compute_dtype="f16", float32_gradient_reductions=True)(_params(), _batch())
    assert "accumulates in float32" in str(report)


def test_a_convolution_is_not_moved_and_amp_says_so_once(fresh_warnings):
    def conv_loss(w, x):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME")
        return jnp.mean(y**2)

    w, x = jnp.ones((4, 3, 3, 3)) / 9, jnp.ones((2, 3, 8, 8))
    loss = jaxamp.amp(conv_loss, compute_dtype="f16", float32_gradient_reductions=True)
    with pytest.warns(UserWarning, match="conv_general_dilated still accumulates in float16"):
        jax.make_jaxpr(loss)(w, x)
    convs = [e for e in iter_eqns(jax.make_jaxpr(loss)(w, x)) if e.primitive.name == "conv_general_dilated"]
    assert [v.aval.dtype for v in convs[0].invars] == [jnp.float16] * 2
    assert convs[0].outvars[0].aval.dtype == jnp.float16  # accumulated in float16
