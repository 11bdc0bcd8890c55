"""amp on flax nnx models: matmuls in bf16, and the module's state updates kept.

nnx's idiom is a function that mutates the module it is given (BatchNorm running
statistics, Dropout's RNG counter); `amp` must leave the caller's module exactly
as calling the function itself would, also inside nnx.jit, nnx.value_and_grad
and a jax.jit'd split/merge step.

Tolerances: bfloat16 keeps 8 significant bits (relative rounding error up to
2**-9 ~ 0.2% per operand), and every matmul here rounds both operands (K <= 16
terms). Measured against float32: the loss within 0.1%, gradients within 0.5%
of the largest gradient, running variances (99% of them the initial 1) within
0.01%, running means within 0.4% of the largest mean (single means near zero
differ by up to 3% of themselves, so means are compared on their own scale).
Hence rtol 3%, and an atol of 1% of the largest statistic (3% of the largest
gradient): a margin of 2.5x or more.
"""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

import jaxamp  # noqa: E402

from jaxpr_walk import assert_all_matmuls_in  # noqa: E402

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals

RTOL = 3e-2
BF16 = dict(compute_dtype="bf16")


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(8, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.dropout = nnx.Dropout(0.25, rngs=rngs)
        self.linear2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x, rngs=None):
        h = nnx.relu(self.bn(self.linear1(x)))
        return self.linear2(self.dropout(h, rngs=rngs))


def make_model() -> Model:
    return Model(nnx.Rngs(params=0, dropout=1))


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


X = jax.random.normal(jax.random.PRNGKey(2), (32, 8))
Y = jax.random.normal(jax.random.PRNGKey(3), (32, 4))


def _stats(model):
    return {"mean": model.bn.mean[...], "var": model.bn.var[...]}


def _count(model):
    return int(model.dropout.rngs.count[...])


def assert_close_stats(amp_model, f32_model):
    for name, got in _stats(amp_model).items():
        want = _stats(f32_model)[name]
        assert got.dtype == jnp.float32, (name, got.dtype)
        atol = 1e-2 * float(jnp.max(jnp.abs(want)))
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=atol, err_msg=name)


def assert_same_state_as_plain(amp_model, plain_model):
    assert_close_stats(amp_model, plain_model)
    assert _count(amp_model) == _count(plain_model)


# --- flax stays optional ------------------------------------------------------


def test_import_and_amp_do_not_import_flax():
    code = (
        "import sys, jax.numpy as jnp, jaxamp\n"
        "jaxamp.amp(lambda w, x: x @ w)(jnp.eye(2), jnp.ones((1, 2)))\n"
        "assert 'flax' not in sys.modules, sorted(m for m in sys.modules if 'flax' in m)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


# --- the module-argument style ------------------------------------------------


@pytest.mark.newest_only
def test_amp_keeps_the_modules_state_updates():
    # amp traced a copy of the module and dropped what the function did to it:
    # the running statistics stayed zero and the dropout counter did not move.
    model, plain = make_model(), make_model()
    loss = jaxamp.amp(loss_fn, **BF16)(model, X, Y)
    plain_loss = loss_fn(plain, X, Y)

    assert loss.dtype == jnp.float32
    np.testing.assert_allclose(loss, plain_loss, rtol=RTOL)
    assert float(jnp.max(jnp.abs(model.bn.mean[...]))) > 0
    assert _count(model) == _count(plain) == 1
    assert_same_state_as_plain(model, plain)


@pytest.mark.newest_only
def test_forward_matmuls_are_bf16():
    model = make_model()
    jaxpr = jax.make_jaxpr(lambda m, x, y: jaxamp.amp(loss_fn, **BF16)(m, x, y))(model, X, Y)
    assert_all_matmuls_in(jaxpr, jnp.bfloat16, at_least=2)


def _train_step(model, x, y, lr=0.1):
    loss, grads = nnx.value_and_grad(jaxamp.amp(loss_fn, **BF16))(model, x, y)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - lr * g, params, grads))
    return loss, grads


def _plain_train_step(model, x, y, lr=0.1):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - lr * g, params, grads))
    return loss, grads


@pytest.mark.newest_only
def test_value_and_grad_inside_nnx_jit_matches_float32():
    model, plain = make_model(), make_model()
    loss, grads = nnx.jit(_train_step)(model, X, Y)
    plain_loss, plain_grads = nnx.jit(_plain_train_step)(plain, X, Y)

    np.testing.assert_allclose(loss, plain_loss, rtol=RTOL)
    # Gradients are differences of bf16-rounded terms: compare them on the scale
    # of the largest one (linear1's bias gradient is zero in exact arithmetic,
    # BatchNorm subtracting the mean, and only rounding noise in either dtype).
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(plain_grads))
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(plain_grads)):
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * scale)
    assert_same_state_as_plain(model, plain)
    np.testing.assert_allclose(model.linear1.kernel[...], plain.linear1.kernel[...], rtol=RTOL, atol=1e-3)


@pytest.mark.newest_only
def test_value_and_grad_matmuls_are_bf16_forward_and_backward():
    model = make_model()

    def grad_fn(model, x, y):
        return nnx.value_and_grad(jaxamp.amp(loss_fn, **BF16))(model, x, y)

    jaxpr = jax.make_jaxpr(grad_fn)(model, X, Y)
    # Forward: two matmuls; backward: both kernels' gradients and linear2's input.
    assert_all_matmuls_in(jaxpr, jnp.bfloat16, at_least=5)


@pytest.mark.newest_only
def test_rngs_and_modules_as_keyword_and_nested_arguments():
    def loss_with_rngs(models, *, batch, rngs):
        model = models["model"]
        return jnp.mean((model(batch[0], rngs=rngs) - batch[1]) ** 2)

    model, plain = make_model(), make_model()
    rngs, plain_rngs = nnx.Rngs(dropout=7), nnx.Rngs(dropout=7)
    loss = jaxamp.amp(loss_with_rngs, **BF16)({"model": model}, batch=(X, Y), rngs=rngs)
    plain_loss = loss_with_rngs({"model": plain}, batch=(X, Y), rngs=plain_rngs)

    np.testing.assert_allclose(loss, plain_loss, rtol=RTOL)
    assert int(rngs.dropout.count[...]) == int(plain_rngs.dropout.count[...]) == 1
    assert _count(model) == _count(plain) == 0  # the Rngs argument was used instead
    assert_close_stats(model, plain)


def test_module_as_the_function_and_bound_method():
    model, plain = make_model(), make_model()
    out = jaxamp.amp(model, **BF16)(X)
    np.testing.assert_allclose(out, plain(X), rtol=RTOL, atol=0.05)
    assert_same_state_as_plain(model, plain)

    class WithLoss(Model):
        def loss(self, x, y):
            return loss_fn(self, x, y)

    model, plain = WithLoss(nnx.Rngs(params=0, dropout=1)), WithLoss(nnx.Rngs(params=0, dropout=1))
    np.testing.assert_allclose(jaxamp.amp(model.loss, **BF16)(X, Y), plain.loss(X, Y), rtol=RTOL)
    assert_same_state_as_plain(model, plain)


@pytest.mark.newest_only
def test_state_keeps_its_dtype_under_a_bf16_output_policy():
    model, plain = make_model(), make_model()
    loss = jaxamp.amp(loss_fn, policy="p=f32,c=bf16,o=bf16")(model, X, Y)
    assert loss.dtype == jnp.bfloat16
    loss_fn(plain, X, Y)
    assert_same_state_as_plain(model, plain)


def test_returned_module_is_the_callers():
    model = make_model()

    def fn(model, x):
        return model(x).sum(), model, model.bn

    _, returned, bn = jaxamp.amp(fn, **BF16)(model, X)
    assert returned is model and bn is model.bn
    assert _count(model) == 1


@pytest.mark.newest_only
def test_shared_variables_stay_shared():
    class Tied(nnx.Module):
        def __init__(self, linear):
            self.linear = linear

    model = make_model()
    tied = Tied(model.linear1)

    def fn(model, tied, x):
        tied.linear.bias[...] = tied.linear.bias[...] + 1.0
        return model(x).sum()

    jaxamp.amp(fn, **BF16)(model, tied, X)
    assert tied.linear is model.linear1
    np.testing.assert_array_equal(model.linear1.bias[...], jnp.ones(16))


@pytest.mark.newest_only
def test_non_pytree_module():
    class Counter(nnx.Module, pytree=False):
        def __init__(self):
            self.linear = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
            self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

        def __call__(self, x):
            self.calls[...] += 1
            return self.linear(x)

    model = Counter()
    out = jaxamp.amp(lambda m, x: m(x), **BF16)(model, X)
    assert out.dtype == jnp.float32
    assert int(model.calls[...]) == 1


@pytest.mark.newest_only
def test_new_nnx_objects_can_be_returned():
    def make(model, x):
        head = nnx.Linear(16, 2, rngs=nnx.Rngs(5))
        return head(model.linear1(x)).sum(), head

    _, head = jaxamp.amp(make, **BF16)(make_model(), X)
    assert isinstance(head, nnx.Linear) and head.kernel[...].dtype == jnp.float32
    np.testing.assert_array_equal(head.kernel[...], nnx.Linear(16, 2, rngs=nnx.Rngs(5)).kernel[...])


class Block(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(8, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)

    def __call__(self, x):
        return nnx.relu(self.bn(self.linear(x)))


def scanned_loss(blocks, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    @nnx.remat
    def layer(block, h):
        return block(h)

    return jnp.mean(layer(blocks, x) ** 2)


@pytest.mark.newest_only
def test_nnx_scan_and_remat_inside_amp():
    @nnx.vmap(in_axes=0, out_axes=0)
    def make_blocks(key):
        return Block(nnx.Rngs(key))

    blocks = make_blocks(jax.random.split(jax.random.PRNGKey(0), 3))
    plain = nnx.clone(blocks)
    np.testing.assert_allclose(jaxamp.amp(scanned_loss, **BF16)(blocks, X), scanned_loss(plain, X), rtol=RTOL)
    assert blocks.bn.mean[...].shape == (3, 8)
    assert_close_stats(blocks, plain)
    jaxpr = jax.make_jaxpr(nnx.grad(jaxamp.amp(scanned_loss, **BF16)))(blocks, X)
    # The scanned matmul, its kernel's and input's gradients, and remat's recompute.
    assert_all_matmuls_in(jaxpr, jnp.bfloat16, at_least=4)


# --- the split/merge style under jax.jit ---------------------------------------


@pytest.mark.newest_only
def test_split_merge_step_under_jax_jit_matches_float32():
    def make_step(loss):
        @jax.jit
        def step(graphdef, state, x, y):
            params, rest = state

            def objective(params):
                # copy=True: fresh Variables at this trace level. Without it merge
                # reuses rest's jit-level Variables, which not even the plain
                # function may mutate under jax.grad.
                model = nnx.merge(graphdef, params, rest, copy=True)
                value = loss(model, x, y)
                _, _, new_rest = nnx.split(model, nnx.Param, ...)
                return value, new_rest

            (value, rest), grads = jax.value_and_grad(objective, has_aux=True)(params)
            params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
            return value, grads, (params, rest)

        return step

    graphdef, *state = nnx.split(make_model(), nnx.Param, ...)
    amp_step, plain_step = make_step(jaxamp.amp(loss_fn, **BF16)), make_step(loss_fn)

    loss, grads, (params, rest) = amp_step(graphdef, state, X, Y)
    plain_loss, _, (plain_params, plain_rest) = plain_step(graphdef, state, X, Y)
    np.testing.assert_allclose(loss, plain_loss, rtol=RTOL)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))

    model = nnx.merge(graphdef, params, rest)
    plain = nnx.merge(graphdef, plain_params, plain_rest)
    assert_same_state_as_plain(model, plain)
    assert _count(model) == 1

    jaxpr = jax.make_jaxpr(amp_step)(graphdef, state, X, Y)
    assert_all_matmuls_in(jaxpr, jnp.bfloat16, at_least=5)


# --- what cannot be propagated raises ------------------------------------------


def test_structural_change_raises_and_names_the_fix():
    model = make_model()

    def adds_attribute(model, x):
        h = model.linear1(x)
        model.hidden = nnx.Intermediate(h)
        return h.sum()

    with pytest.raises(ValueError, match=r"added model\.hidden.*before calling the amp'd"):
        jaxamp.amp(adds_attribute, **BF16)(model, X)
    assert not hasattr(model, "hidden")


def test_new_object_sharing_parts_with_an_argument_raises():
    class Wrapper(nnx.Module):
        def __init__(self, inner):
            self.inner = inner

    with pytest.raises(ValueError, match=r"holding model\.linear1 of its arguments"):
        jaxamp.amp(lambda model, x: Wrapper(model.linear1), **BF16)(make_model(), X)


def test_closed_over_module_mutation_says_pass_it_as_an_argument():
    model = make_model()
    with pytest.raises(Exception, match="as an argument") as info:
        jaxamp.amp(lambda x, y: loss_fn(model, x, y), **BF16)(X, Y)
    assert "TraceContextError" in type(info.value).__name__


def test_variables_of_an_outer_trace_are_not_overwritten():
    # Inside jax.jit, a module from outside cannot take the jit's tracers: the
    # plain function raises there, and amp must raise too (not leak tracers).
    model = make_model()
    with pytest.raises(Exception, match="different trace level"):
        jax.jit(lambda x, y: loss_fn(model, x, y))(X, Y)
    with pytest.raises(Exception, match="different trace level"):
        jax.jit(lambda x, y: jaxamp.amp(loss_fn, **BF16)(model, x, y))(X, Y)
    assert _count(model) == 0
