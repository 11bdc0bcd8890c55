"""Eager amp calls reuse their rewritten program (jaxamp/_eager_cache.py)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._options import AmpOptions

from jaxpr_walk import assert_all_matmuls_in

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals


def _mlp(params, x, scale=1.0):
    for w in params:
        x = jnp.tanh(x @ w)
    return scale * jnp.mean(x)


def _params(width=16, layers=3):
    keys = jax.random.split(jax.random.key(0), layers)
    return [jax.random.normal(k, (width, width)) / width**0.5 for k in keys]


X = jax.random.normal(jax.random.key(1), (4, 16))


@pytest.mark.newest_only
def test_repeated_call_hits_and_matches_the_traced_program():
    g = jaxamp.amp(_mlp, compute_dtype="bf16")
    first = g(_params(), X)
    second = g(_params(), X)
    assert (g.eager_cache.misses, g.eager_cache.hits, len(g.eager_cache)) == (1, 1, 1)
    assert first.dtype == second.dtype == jnp.float32
    assert float(first) == float(second)
    # The cached program computes exactly what amp's uncached eager evaluation does.
    uncached = AmpOptions.resolve(compute_dtype="bf16").run(_mlp, (_params(), X), {})
    assert float(second) == float(uncached)
    assert_all_matmuls_in(jax.make_jaxpr(g)(_params(), X), jnp.bfloat16, at_least=3)
    np.testing.assert_allclose(float(second), float(_mlp(_params(), X)), rtol=2e-2)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda p, x: (p, x[:2]), id="shape"),
        pytest.param(lambda p, x: (p, x.astype(jnp.bfloat16)), id="dtype"),
        pytest.param(lambda p, x: (p[:2], x), id="structure"),
    ],
)
@pytest.mark.newest_only
def test_changed_arguments_miss(change):
    g = jaxamp.amp(_mlp, compute_dtype="bf16")
    g(_params(), X)
    params, x = change(_params(), X)
    out = g(params, x)
    assert (g.eager_cache.misses, g.eager_cache.hits) == (2, 0)
    np.testing.assert_allclose(float(out), float(_mlp(params, x.astype(jnp.float32))), rtol=3e-2)


@pytest.mark.newest_only
def test_changed_static_argument_is_not_a_stale_result():
    g = jaxamp.amp(_mlp, compute_dtype="bf16")
    one = g(_params(), X, scale=1.0)
    three = g(_params(), X, scale=3.0)
    assert g.eager_cache.misses == 2
    np.testing.assert_allclose(float(three), 3 * float(one), rtol=1e-2)
    # 1 and True hash alike; they are different static arguments.
    assert g(_params(), X, scale=1) is not None and g.eager_cache.misses == 3


class _Scaled(eqx.Module):
    weights: list
    scale: float  # a non-array leaf: static for the cache, by value
    activation: str = eqx.field(static=True)  # part of the tree's structure

    def __call__(self, x):
        act = getattr(jnp, self.activation)
        for w in self.weights:
            x = act(x @ w)
        return self.scale * jnp.mean(x)


@pytest.mark.newest_only
def test_module_fields_and_argument_positions_are_part_of_the_key():
    g = jaxamp.amp(lambda model, x: model(x), compute_dtype="bf16")
    base = _Scaled(_params(), 1.0, "tanh")
    variants = [
        base,
        _Scaled(_params(), 2.0, "tanh"),  # a changed non-array leaf
        _Scaled(_params(), 1.0, "sin"),  # a changed static field
    ]
    outs = [g(model, X) for model in variants]
    assert (g.eager_cache.misses, g.eager_cache.hits) == (3, 0)
    for model, out in zip(variants, outs):
        np.testing.assert_allclose(float(out), float(model(X)), rtol=3e-2)
    assert float(g(_Scaled(_params(), 2.0, "tanh"), X)) == float(outs[1])
    assert g.eager_cache.hits == 1
    # The same values passed by keyword are another signature, as for jax.jit.
    assert float(g(model=base, x=X)) == float(outs[0])
    assert (g.eager_cache.misses, g.eager_cache.hits) == (4, 1)


@pytest.mark.newest_only
def test_table_changed_between_calls_is_seen():
    table = dict(jaxamp.default_amp_policy)
    g = jaxamp.amp(_mlp, compute_dtype="bf16", amp_policy=table)
    g(_params(), X)
    table[jax.lax.dot_general_p] = jaxamp.use_original_precision
    g(_params(), X)
    assert g.eager_cache.misses == 2
    assert_all_matmuls_in(jax.make_jaxpr(g)(_params(), X), jnp.float32, at_least=3)


@pytest.mark.newest_only
def test_scopes_and_jax_config_are_part_of_the_key():
    g = jaxamp.amp(_mlp, compute_dtype="bf16")
    g(_params(), X)
    with jax.named_scope("outer"):
        g(_params(), X)
    with jax.default_matmul_precision("highest"):
        g(_params(), X)
    assert (g.eager_cache.misses, g.eager_cache.hits) == (3, 0)


@pytest.mark.newest_only
def test_calls_under_a_transformation_are_not_cached():
    g = jaxamp.amp(_mlp, compute_dtype="bf16")
    jax.jit(g)(_params(), X)
    jax.grad(g)(_params(), X)
    jax.vmap(g, in_axes=(None, 0))(_params(), X[:, None])
    assert len(g.eager_cache) == 0 and g.eager_cache.hits == 0


def test_unhashable_static_argument_is_traced_afresh():
    class Unhashable:
        __hash__ = None

        def __init__(self, value):
            self.value = value

    def f(x, factor):
        return x * factor.value

    g = jaxamp.amp(f, compute_dtype="bf16")
    assert float(g(jnp.float32(2), Unhashable(3.0))) == 6.0
    assert float(g(jnp.float32(2), Unhashable(5.0))) == 10.0
    assert len(g.eager_cache) == 0 and g.eager_cache.misses == 2


def test_cache_is_bounded_least_recently_used_first_out():
    g = jaxamp.amp(lambda x: jnp.sum(x @ x.T), compute_dtype="bf16")
    g.eager_cache.maxsize = 4
    for n in range(1, 7):
        g(jnp.ones((n, 3)))
    assert len(g.eager_cache) == 4
    g(jnp.ones((6, 3)))  # most recent: still cached
    g(jnp.ones((1, 3)))  # evicted first
    assert (g.eager_cache.hits, g.eager_cache.misses) == (1, 7)
    g.eager_cache.clear()
    assert len(g.eager_cache) == 0


def test_output_dtype_and_pytree_outputs_are_rebuilt():
    def f(params, x):
        y = x @ params[0]
        return {"y": y, "n": 3, "mean": jnp.mean(y)}

    g = jaxamp.amp(f, policy="p=f32,c=bf16,o=bf16")
    for _ in range(2):
        out = g(_params(), X)
        assert out["n"] == 3
        assert out["y"].dtype == out["mean"].dtype == jnp.bfloat16
    assert g.eager_cache.hits == 1


@pytest.mark.newest_only
def test_prng_key_and_numpy_arguments():
    def f(key, x):
        return jnp.sum(jax.random.normal(key, x.shape) @ x)

    g = jaxamp.amp(f, compute_dtype="bf16")
    key, x = jax.random.key(0), np.ones((3, 3), np.float32)
    a, b = g(key, x), g(key, x)
    assert float(a) == float(b) and g.eager_cache.hits == 1


@pytest.mark.newest_only
def test_flax_nnx_calls_with_state_are_not_reused_and_others_are():
    nnx = pytest.importorskip("flax.nnx")

    class Counter(nnx.Module):
        def __init__(self):
            self.count = nnx.BatchStat(jnp.zeros(()))
            self.w = nnx.Param(jnp.eye(16))

        def __call__(self, x):
            self.count[...] = self.count[...] + 1
            return jnp.sum(x @ self.w[...])

    model = Counter()
    g = jaxamp.amp(lambda m, x: m(x), compute_dtype="bf16")
    for _ in range(3):
        g(model, X)
    # Each call wrote its state back: a cached program would have replayed the first.
    assert float(model.count[...]) == 3.0 and len(g.eager_cache) == 0
    # With flax.nnx imported, a call without nnx objects is still cached.
    h = jaxamp.amp(_mlp, compute_dtype="bf16")
    h(_params(), X)
    h(_params(), X)
    assert h.eager_cache.hits == 1
