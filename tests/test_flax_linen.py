"""amp on a flax linen model: nn.Dense, nn.BatchNorm, nn.scan over layers, nn.remat.

linen is functional (``apply(..., mutable=["batch_stats"])`` returns the updated
statistics), so amp needs nothing linen-specific; these tests pin that down,
scan and remat bodies included.

Tolerances: bfloat16 keeps 8 significant bits (relative rounding error up to
2**-9 ~ 0.2% per operand), and the five matmuls here (K <= 16) each round both
operands. Measured against float32: the loss within 0.03% and batch statistics
within 0.2% of the largest one (running means are near zero, so each is
compared on its leaf's scale): rtol 3% and an atol of 3% of that scale leave a
10x margin. Gradients are looser: their error grows with every BatchNorm
backward pass they cross (it subtracts means of bf16 values, which cancels
digits), from 1.2% of the gradient's L2 norm with one scanned layer to about 5%
with three; a 15% bound checks that they are right without pinning rounding noise.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nn = pytest.importorskip("flax.linen")

import jaxamp  # noqa: E402

from jaxpr_walk import assert_all_matmuls_in, iter_eqns  # noqa: E402

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals

RTOL = 3e-2
LAYERS = 3


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        h = nn.BatchNorm(use_running_average=False)(nn.Dense(16)(h))
        return nn.relu(h), None


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16)(x)
        blocks = nn.scan(
            nn.remat(Block),
            variable_axes={"params": 0, "batch_stats": 0},
            split_rngs={"params": True},
            length=LAYERS,
        )
        h, _ = blocks()(h, None)
        return nn.Dense(4)(h)


MODEL = Net()
X = jax.random.normal(jax.random.PRNGKey(1), (32, 8))
Y = jax.random.normal(jax.random.PRNGKey(2), (32, 4))


@pytest.fixture(scope="module")
def args():
    # jit: initialising the scan eagerly dispatches (and compiles) op by op.
    variables = jax.jit(MODEL.init)(jax.random.PRNGKey(0), X)
    return variables["params"], variables["batch_stats"], X, Y


def loss_fn(params, batch_stats, x, y):
    out, updates = MODEL.apply({"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"])
    return jnp.mean((out - y) ** 2), updates["batch_stats"]


def grad_fn(loss):
    return jax.value_and_grad(loss, has_aux=True)


def assert_close_on_scale(got, want):
    # Each leaf against the largest magnitude of its float32 counterpart.
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype == jnp.float32
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=RTOL * float(jnp.max(jnp.abs(w))))


def test_matmuls_in_bf16_forward_and_backward_inside_scan_and_remat(args):
    forward = jax.make_jaxpr(jaxamp.amp(loss_fn, compute_dtype="bf16"))(*args)
    names = {eqn.primitive.name for eqn in iter_eqns(forward)}
    assert "scan" in names and any("remat" in n or "checkpoint" in n for n in names), names
    assert_all_matmuls_in(forward, jnp.bfloat16, at_least=3)  # two Dense + the scanned one
    backward = jax.make_jaxpr(grad_fn(jaxamp.amp(loss_fn, compute_dtype="bf16")))(*args)
    # Forward 3, the kernels' gradients 3, the inputs' 2 (not x's), and remat
    # recomputing the scanned forward matmul.
    assert_all_matmuls_in(backward, jnp.bfloat16, at_least=9)


@pytest.mark.newest_only
def test_train_step_matches_float32(args):
    (loss, stats), grads = jax.jit(grad_fn(jaxamp.amp(loss_fn, compute_dtype="bf16")))(*args)
    (want_loss, want_stats), want_grads = jax.jit(grad_fn(loss_fn))(*args)

    assert loss.dtype == jnp.float32
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL)
    assert jax.tree.structure(stats) == jax.tree.structure(want_stats)
    assert_close_on_scale(stats, want_stats)
    initial = jax.tree.leaves(args[1])
    assert all(not np.allclose(new, old) for new, old in zip(jax.tree.leaves(stats), initial))
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
    flat, want = (jnp.concatenate([g.ravel() for g in jax.tree.leaves(t)]) for t in (grads, want_grads))
    assert float(jnp.linalg.norm(flat - want) / jnp.linalg.norm(want)) < 0.15
