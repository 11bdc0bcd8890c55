"""A flax nnx run changes precision across an Orbax checkpoint: float32 -> float16 -> float32.

The float32 run saves the model's and the optimizer's state as nnx's pure
dicts; a float16 run resumes from it under `jaxamp.loss_scaling`, trains and
saves; a float32 run resumes from that. Every leg restores through one
driver function, Orbax's restore wrapped in
`jaxamp.scaling.restore_across_loss_scaling` (one public line), which also
resumes the float16 run's own checkpoint unchanged. Each leg's losses are
compared with the uninterrupted float32 run's: float16's within its
tolerance, the last float32 leg's too (it starts from float16-trained
weights). The optimizer's step count and adam's moments carry through.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp

ocp = pytest.importorskip("orbax.checkpoint")

STEPS = 4  # per leg
# float16 matmuls against float32's: relative error of a loss after a few adam steps.
F16_RTOL = 5e-3


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(8, 32, rngs=rngs)
        self.out = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.gelu(self.hidden(x)))


def _batch(step):
    x = jax.random.normal(jax.random.PRNGKey(step), (32, 8))
    return x, jnp.sin(x[:, :4])


def _loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def _fresh(tx):
    model = MLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


@nnx.jit
def _step32(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(_loss)(model, x, y)
    optimizer.update(model, grads)
    return loss


@nnx.jit
def _step16(model, optimizer, x, y):
    loss_fn = jaxamp.amp(_loss, compute_dtype="f16", loss_scale=optimizer.opt_state)
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss


def _train(step, model, optimizer, first):
    return [float(step(model, optimizer, *_batch(first + i))) for i in range(STEPS)]


def _save(checkpointer, path, model, optimizer):
    tree = {"model": nnx.to_pure_dict(nnx.state(model)), "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}
    checkpointer.save(path, tree)
    checkpointer.wait_until_finished()


def _load(node, pure_dict):
    state = nnx.state(node)
    nnx.replace_by_pure_dict(state, pure_dict)
    nnx.update(node, state)


def _pure(model, optimizer):
    return {"model": nnx.to_pure_dict(nnx.state(model)), "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}


def _resume(checkpointer, path, model, optimizer, tx):
    """One driver for every leg: its restore takes a checkpoint written with or without loss scaling."""
    restore = jaxamp.scaling.restore_across_loss_scaling(checkpointer.restore, tx)
    restored = restore(path, _pure(model, optimizer))
    _load(model, restored["model"])
    _load(optimizer, restored["optimizer"])


def test_float32_to_float16_and_back_across_orbax_checkpoints(tmp_path, caplog):
    adam = optax.adam(3e-3)
    tx = jaxamp.loss_scaling(adam)

    model, optimizer = _fresh(adam)
    uninterrupted = _train(_step32, model, optimizer, 0)
    uninterrupted += _train(_step32, model, optimizer, STEPS)
    uninterrupted += _train(_step32, model, optimizer, 2 * STEPS)

    with ocp.StandardCheckpointer() as checkpointer:
        model, optimizer = _fresh(adam)
        first = _train(_step32, model, optimizer, 0)
        _save(checkpointer, tmp_path / "f32", model, optimizer)

        # float32 -> float16: the optimizer state wrapped at tx's initial scale.
        model, optimizer = _fresh(tx)
        with caplog.at_level("WARNING", logger="jaxamp"):
            _resume(checkpointer, tmp_path / "f32", model, optimizer, tx)
        assert "written without loss scaling" in caplog.text
        assert int(optimizer.step[...]) == STEPS
        assert float(optimizer.opt_state.scale[...]) == 2.0**15
        second = _train(_step16, model, optimizer, STEPS)
        assert int(jaxamp.scaling.scale_metrics(optimizer.opt_state)["skipped_steps"]) == 0
        _save(checkpointer, tmp_path / "f16", model, optimizer)
        saved = _pure(model, optimizer)

        # The float16 driver resumes its own checkpoint as written, saying nothing.
        caplog.clear()
        model, optimizer = _fresh(tx)
        with caplog.at_level("WARNING", logger="jaxamp"):
            _resume(checkpointer, tmp_path / "f16", model, optimizer, tx)
        assert caplog.text == ""
        for a, b in zip(jax.tree_util.tree_leaves(_pure(model, optimizer)), jax.tree_util.tree_leaves(saved)):
            np.testing.assert_array_equal(a, b)

        # float16 -> float32: the loss scaling taken out.
        model, optimizer = _fresh(adam)
        with caplog.at_level("WARNING", logger="jaxamp"):
            _resume(checkpointer, tmp_path / "f16", model, optimizer, None)
        assert "written with loss scaling" in caplog.text
        assert int(optimizer.step[...]) == 2 * STEPS
        third = _train(_step32, model, optimizer, 2 * STEPS)

    print("losses, uninterrupted float32:", np.round(uninterrupted, 5).tolist())
    print("losses, float32 -> float16 -> float32:", np.round(first + second + third, 5).tolist())
    np.testing.assert_array_equal(first, uninterrupted[:STEPS])  # the same program, the same numbers
    np.testing.assert_allclose(second, uninterrupted[STEPS : 2 * STEPS], rtol=F16_RTOL)
    np.testing.assert_allclose(third, uninterrupted[2 * STEPS :], rtol=F16_RTOL)
    # Training went on across both changes: each leg's loss falls as the uninterrupted run's does.
    assert second[-1] < first[0] and third[-1] < second[0]
