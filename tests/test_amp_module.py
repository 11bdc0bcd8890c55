"""`jaxamp.amp_module`: an nnx model that runs under amp in every copy nnx.merge makes.

A framework's sampler keeps ``nnx.graphdef(model)`` and calls
``nnx.merge(graphdef, params)(...)`` inside its own jax.jit; the copies must
compute in the compute dtype as the model itself does, mutate state (BatchNorm
statistics, an attention KV cache) as the float32 model does, and keep the
model's state paths and dtypes so checkpoints restore.

Tolerances, measured against the same model in float32 (inputs of unit scale,
K <= 32 terms per matmul): outputs within 0.34% (bf16) and 0.06% (f16) of the
largest output, decode steps within 1% and 0.12%, running means within 1.5% and
0.08% of the largest mean, gradients within 0.5% and 0.05% of the largest
gradient. Tolerances: 4% (bf16) and 0.5% (f16) of the largest value, a margin
of 2.5x or more.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

nnx = pytest.importorskip("flax.nnx")

import jaxamp  # noqa: E402

from jaxpr_walk import assert_all_matmuls_in  # noqa: E402

TOLERANCE = {"bf16": 4e-2, "f16": 5e-3}
DTYPE = {"bf16": jnp.bfloat16, "f16": jnp.float16}
X = jax.random.normal(jax.random.key(1), (4, 6, 16))


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, decode: bool = False):
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=16, qkv_features=16, decode=decode, rngs=rngs)
        self.linear1 = nnx.Linear(16, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, use_running_average=False, rngs=rngs)
        self.linear2 = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        h = x + self.attn(x)
        return self.linear2(nnx.relu(self.bn(self.linear1(h))))


class NoCall(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(2, 2, rngs=rngs)


def pair(dtype: str, **kwargs) -> tuple[Net, Net]:
    """The same Net twice: one amp_module'd in `dtype`, one float32."""
    return jaxamp.amp_module(Net(nnx.Rngs(0), **kwargs), compute_dtype=dtype), Net(nnx.Rngs(0), **kwargs)


def assert_close(got, want, dtype: str, what: str = ""):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert [g.dtype for g in got] == [w.dtype for w in want], what
    scale = max(float(jnp.max(jnp.abs(w))) for w in want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=TOLERANCE[dtype] * scale, err_msg=what)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_every_matmul_of_a_merged_copy_runs_in_the_compute_dtype(dtype):
    model, _ = pair(dtype)
    graphdef, state = nnx.split(model)
    # A sampler's step: it keeps the graph definition and merges inside its jit.
    jaxpr = jax.make_jaxpr(lambda state, x: nnx.merge(graphdef, state)(x))(state, X)
    assert_all_matmuls_in(jaxpr, DTYPE[dtype], at_least=6)  # q, k, v, attention (2), out, linear1, linear2
    assert jaxpr.out_avals[0].dtype == jnp.float32


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_outputs_and_state_updates_match_float32(dtype):
    model, plain = pair(dtype)
    assert_close(model(X), plain(X), dtype, "outputs")
    # BatchNorm's running statistics: written back into the caller's module, in float32.
    assert_close(nnx.state(model, nnx.BatchStat), nnx.state(plain, nnx.BatchStat), dtype, "statistics")


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_jitted_steps_and_merged_copies_agree_with_the_module(dtype):
    model, plain = pair(dtype)
    graphdef, state = nnx.split(model)
    merged = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))(state, X)
    jitted = nnx.jit(lambda m, x: m(x))(model, X)
    np.testing.assert_allclose(merged, jitted, rtol=1e-6, atol=1e-6)
    assert_close(jitted, plain(X), dtype)
    assert type(nnx.merge(graphdef, state)) is type(model)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_gradients_are_float32_and_match(dtype):
    model, plain = pair(dtype)

    def loss(m):
        return jnp.mean(m(X) ** 2)

    grads = nnx.jit(nnx.grad(loss))(model)
    assert_close(nnx.state(grads, nnx.Param), nnx.state(nnx.grad(loss)(plain), nnx.Param), dtype, "gradients")


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_kv_cache_decoding_inside_nnx_jit(dtype):
    model, plain = pair(dtype, decode=True)
    for m in (model, plain):
        m.attn.init_cache(X.shape)
    step = nnx.jit(lambda m, x: m(x))
    for t in range(X.shape[1]):
        assert_close(step(model, X[:, t : t + 1]), step(plain, X[:, t : t + 1]), dtype, f"step {t}")
    assert int(model.attn.cache_index[...]) == X.shape[1]
    assert_close(nnx.state(model, nnx.Cache), nnx.state(plain, nnx.Cache), dtype, "cache")


def test_amp_of_the_loss_around_the_module():
    # The trainer's loss amp'd too (jaxamp.amp(trainer.loss_fn)): the module's amp nests inside it.
    model, plain = pair("bf16")

    def loss(m, x):
        return jnp.mean(m(x) ** 2)

    grad_fn = nnx.grad(jaxamp.amp(loss, compute_dtype="bf16"))
    assert_all_matmuls_in(jax.make_jaxpr(lambda m: grad_fn(m, X))(model), jnp.bfloat16, at_least=12)
    grads = nnx.jit(grad_fn)(model, X)
    assert_close(nnx.state(grads, nnx.Param), nnx.state(nnx.grad(loss)(plain, X), nnx.Param), "bf16")


def test_state_paths_dtypes_and_checkpoints_unchanged():
    plain = Net(nnx.Rngs(0))
    before = nnx.to_flat_state(nnx.state(plain))
    model = jaxamp.amp_module(plain, compute_dtype="bf16")
    assert model is plain and type(model).__name__ == "AmpNet" and isinstance(model, Net)
    after = nnx.to_flat_state(nnx.state(model))
    assert [(p, v.dtype) for p, v in after] == [(p, v.dtype) for p, v in before]
    # A float32 model's state restores into the amp'd one, and back.
    other = Net(nnx.Rngs(5))
    nnx.update(model, nnx.state(other))
    np.testing.assert_array_equal(model.linear1.kernel[...], other.linear1.kernel[...])
    nnx.update(other, nnx.state(jaxamp.amp_module(Net(nnx.Rngs(7)), compute_dtype="bf16")))
    np.testing.assert_array_equal(other.linear1.kernel[...], Net(nnx.Rngs(7)).linear1.kernel[...])


def test_one_class_per_settings_and_wrapping_again():
    a, b = jaxamp.amp_module(Net(nnx.Rngs(0)), Net(nnx.Rngs(1)), compute_dtype="bf16")
    # Spellings amp resolves alike give the same class, so graph definitions compare equal.
    c = jaxamp.amp_module(Net(nnx.Rngs(0)), compute_dtype=jnp.bfloat16)
    assert type(a) is type(b) is type(c)
    assert nnx.graphdef(a) == nnx.graphdef(c)
    assert jaxamp.amp_module(a, compute_dtype="bf16") is a and type(a) is type(c)
    f16 = jaxamp.amp_module(Net(nnx.Rngs(0)), compute_dtype="f16")
    assert type(f16) is not type(a) and type(f16).__mro__[1] is Net
    with pytest.raises(ValueError, match=r"already runs under jaxamp.amp_module\(compute_dtype='bf16'\); got "):
        jaxamp.amp_module(a, compute_dtype="f16")
    assert type(a) is type(c)


@pytest.mark.parametrize(
    "value, match",
    [
        (lambda x: x, "expects flax nnx Modules, got function"),
        (3, "expects flax nnx Modules, got int: 3"),
        (NoCall(nnx.Rngs(0)), "and NoCall has none.*amp\\(module.method\\)"),
    ],
)
def test_not_an_nnx_module_with_a_call(value, match):
    with pytest.raises(TypeError, match=match):
        jaxamp.amp_module(value, compute_dtype="bf16")


def test_bad_settings_swap_nothing():
    model = Net(nnx.Rngs(0))
    with pytest.raises(TypeError, match="int32"):
        jaxamp.amp_module(model, compute_dtype=jnp.int32)
    state = jaxamp.loss_scaling(optax.sgd(0.1)).init(nnx.state(model, nnx.Param))
    with pytest.raises(TypeError, match="loss_scale must be the jaxamp.loss_scaling transformation.*LossScaleState"):
        jaxamp.amp_module(model, compute_dtype="f16", loss_scale=state)
    with pytest.raises(TypeError, match="expects flax nnx Modules, got str"):
        jaxamp.amp_module(model, "second", compute_dtype="bf16")
    assert type(model) is Net


class Mlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(16, 32, rngs=rngs)
        self.linear2 = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.relu(self.linear1(x)))


def test_loss_scale_on_the_module_scales_its_backward_and_skips_an_overflow():
    # float16 with the scale on the module: the loss outside runs as written
    # (float32); the framework's nnx.jit step and MultiSteps around the optimizer.
    tx = jaxamp.loss_scaling(optax.adam(1e-2))
    model = jaxamp.amp_module(Mlp(nnx.Rngs(0)), compute_dtype="f16", loss_scale=tx)
    plain = Mlp(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.MultiSteps(tx, 2), wrt=nnx.Param)

    def loss(model, x, boost):
        return jnp.mean(model(x) ** 2) * boost

    grads = nnx.grad(loss)(model, X[0], 1.0)
    want = nnx.grad(loss)(plain, X[0], 1.0)
    assert_close(grads, want, "f16", "true-scale gradients")
    # Gradients near 3e-7, at float16's subnormals: 62% off float32's unscaled, 0.05% scaled.
    small = nnx.grad(loss)(model, X[0], 1e-6)
    assert_close(small, nnx.grad(loss)(plain, X[0], 1e-6), "f16", "small gradients")

    @nnx.jit
    def step(model, optimizer, x, boost):
        optimizer.update(model, nnx.grad(loss)(model, x, boost))

    def weights():
        return [np.asarray(v) for v in jax.tree.leaves(nnx.state(model, nnx.Param))]

    step(model, optimizer, X[0], 1.0)
    step(model, optimizer, X[0], 1.0)
    after_first = weights()
    step(model, optimizer, X[0], 1e9)  # overflows float16's backward at 2**15
    step(model, optimizer, X[0], 1.0)
    for got, kept in zip(weights(), after_first):
        np.testing.assert_array_equal(got, kept)
    metrics = jaxamp.scaling.scale_metrics(optimizer.opt_state)
    assert (float(metrics["loss_scale"]), int(metrics["skipped_steps"])) == (2.0**14, 1)


class Sowing(nnx.Module):
    """Mlp that sows its hidden activations (a critic's or a probe's hidden states)."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(16, 32, rngs=rngs)
        self.linear2 = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.linear1(x))
        self.sow(nnx.Intermediate, "hidden", h)
        return self.linear2(h)


# nnx.capture came with flax 0.12.6; jaxamp supports flax 0.12.3 and later.
needs_capture = pytest.mark.skipif(not hasattr(nnx, "capture"), reason="nnx.capture needs flax >= 0.12.6")


@needs_capture
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
def test_nnx_capture_returns_what_the_module_sowed(dtype, jit):
    # nnx.capture hands Module.sow a dict it fills in place: amp carries it back
    # (it returned an empty State, without a word, before).
    model, plain = jaxamp.amp_module(Sowing(nnx.Rngs(0)), compute_dtype=dtype), Sowing(nnx.Rngs(0))

    def forward(m, x):
        return nnx.capture(m, nnx.Intermediate)(x)

    out, sown = (nnx.jit(forward) if jit else forward)(model, X)
    want_out, want_sown = forward(plain, X)
    assert set(sown) == {"hidden"}
    assert_close((out, sown["hidden"].get_value()), (want_out, want_sown["hidden"].get_value()), dtype)


@needs_capture
def test_nnx_capture_under_a_loss_scale_keeps_the_sown_values_of_a_skipped_step():
    tx = jaxamp.loss_scaling(optax.sgd(1e-2))
    model = jaxamp.amp_module(Sowing(nnx.Rngs(0)), compute_dtype="f16", loss_scale=tx)
    plain = Sowing(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    def loss(model, x, boost):
        out, sown = nnx.capture(model, nnx.Intermediate)(x)
        return jnp.mean(out**2) * boost, sown

    @nnx.jit
    def step(model, optimizer, x, boost):
        (_, sown), grads = nnx.value_and_grad(loss, has_aux=True)(model, x, boost)
        optimizer.update(model, grads)
        return sown, grads

    (_, want_sown), want = nnx.value_and_grad(loss, has_aux=True)(plain, X[0], 1.0)
    sown, grads = step(model, optimizer, X[0], 1.0)
    assert_close((grads, sown["hidden"].get_value()), (want, want_sown["hidden"].get_value()), "f16")
    before = [np.asarray(v) for v in jax.tree.leaves(nnx.state(model, nnx.Param))]
    sown, _ = step(model, optimizer, X[0], 1e9)  # overflows: the step is skipped, the forward's values still sown
    for got, kept in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), before, strict=True):
        np.testing.assert_array_equal(got, kept)
    assert int(jaxamp.scaling.scale_metrics(optimizer.opt_state)["skipped_steps"]) == 1
    assert_close(sown["hidden"].get_value(), want_sown["hidden"].get_value(), "f16")
