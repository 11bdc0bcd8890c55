"""The shared finiteness check and select used by every loss-scaling API."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp.scaling._finite import checked_scalar, first_finite, is_inexact_leaf


class _Net(eqx.Module):
    weight: jax.Array
    activation: object
    steps: int


@pytest.mark.parametrize("tree", [None, {}, (), [None, {}], {"n": jnp.arange(3)}, "text"])
def test_all_finite_is_true_without_inexact_leaves(tree):
    result = jaxamp.all_finite(tree)
    assert result.shape == () and result.dtype == jnp.bool_
    assert bool(result)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32, jnp.complex64])
@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
def test_all_finite_detects_non_finite_in_every_inexact_dtype(dtype, bad):
    clean = {"a": jnp.ones(3, dtype), "b": [jnp.zeros((2, 2), dtype)]}
    assert bool(jaxamp.all_finite(clean))
    dirty = {"a": jnp.ones(3, dtype).at[1].set(bad), "b": [jnp.zeros((2, 2), dtype)]}
    assert not bool(jaxamp.all_finite(dirty))


def test_all_finite_checks_numpy_arrays_and_python_floats():
    assert not bool(jaxamp.all_finite([np.array([1.0, np.nan])]))
    assert not bool(jaxamp.all_finite({"x": float("inf")}))
    assert bool(jaxamp.all_finite({"x": 3.0, "n": 7}))


def test_all_finite_ignores_non_array_leaves_of_an_equinox_module():
    net = _Net(jnp.ones(2), jax.nn.relu, 3)
    assert bool(jaxamp.all_finite(net))
    assert not bool(jaxamp.all_finite(eqx.tree_at(lambda n: n.weight, net, jnp.full(2, jnp.nan))))


def test_all_finite_ignores_float0_gradients():
    grads = jax.grad(lambda x, n: x * 2.0, argnums=(0, 1), allow_int=True)(1.0, 3)
    assert grads[1].dtype == jax.dtypes.float0
    assert bool(jaxamp.all_finite(grads))


def test_all_finite_under_jit():
    f = jax.jit(jaxamp.all_finite)
    assert bool(f({"a": jnp.ones(4)}))
    assert not bool(f({"a": jnp.ones(4) / 0.0}))


def test_is_inexact_leaf():
    assert is_inexact_leaf(jnp.ones(2, jnp.bfloat16)) and is_inexact_leaf(1.5)
    assert is_inexact_leaf(np.float32(2.0))
    assert not is_inexact_leaf(jnp.ones(2, jnp.int32))
    assert not is_inexact_leaf(True) and not is_inexact_leaf(3) and not is_inexact_leaf(None)


def test_select_tree_picks_a_or_b():
    a = {"x": jnp.ones(2), "y": jnp.array(1, jnp.int32)}
    b = {"x": jnp.zeros(2), "y": jnp.array(2, jnp.int32)}
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(jnp.array_equal, jaxamp.select_tree(jnp.bool_(True), a, b), a))
    picked = jax.jit(jaxamp.select_tree)(jnp.bool_(False), a, b)
    np.testing.assert_array_equal(picked["x"], b["x"])
    assert int(picked["y"]) == 2


def test_select_tree_returns_exact_bits():
    # -0.0 and a NaN payload would not survive arithmetic such as `p + 0 * u`.
    old = jnp.array([-0.0, jnp.nan, 1.0], jnp.float32)
    new = jnp.array([5.0, 6.0, 7.0], jnp.float32)
    kept = jaxamp.select_tree(jnp.bool_(False), new, old)
    assert np.asarray(kept).tobytes() == np.asarray(old).tobytes()


def test_select_tree_accepts_python_bool_and_none_trees():
    assert jaxamp.select_tree(True, None, None) is None
    assert float(jaxamp.select_tree(False, jnp.float32(1), jnp.float32(2))) == 2.0


@pytest.mark.parametrize("pred", [jnp.ones([1], bool), jnp.float32(1.0), jnp.int32(1)])
def test_select_tree_rejects_anything_but_a_boolean_scalar(pred):
    with pytest.raises(AssertionError, match="expected boolean scalar"):
        jaxamp.select_tree(pred, jnp.ones(1), jnp.zeros(1))


def test_first_finite():
    assert float(first_finite(jnp.float32(4.0), jnp.float32(2.0))) == 4.0
    big = jnp.float32(3e38)
    assert float(first_finite(big * 2, big)) == float(big)


def test_checked_scalar_normalises_python_numbers():
    out = checked_scalar("scale", 2**15, jnp.float32, lower=0.0, inclusive=False)
    assert out.dtype == jnp.float32 and float(out) == 2**15
    assert checked_scalar("n", np.int64(5), jnp.int32, lower=0).dtype == jnp.int32


@pytest.mark.parametrize(
    "value, dtype, error, match",
    [
        (True, jnp.int32, TypeError, "got True"),
        (2.5, jnp.int32, TypeError, "2.5"),
        (jnp.array(3), jnp.float32, TypeError, "int32"),
        ("7", jnp.float32, TypeError, "str"),
        (jnp.ones(2), jnp.float32, ValueError, "shape"),
        (-1, jnp.int32, ValueError, "-1"),
        (float("nan"), jnp.float32, ValueError, "nan"),
    ],
)
def test_checked_scalar_rejects_bad_values(value, dtype, error, match):
    with pytest.raises(error, match=match):
        checked_scalar("thing", value, dtype, lower=0)


def test_checked_scalar_accepts_traced_values_without_range_check():
    out = jax.jit(lambda v: checked_scalar("s", v, jnp.float32, lower=0.0))(jnp.float32(-1.0))
    assert float(out) == -1.0
