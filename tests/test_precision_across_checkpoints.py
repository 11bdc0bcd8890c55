"""A flax nnx run changes precision across an Orbax checkpoint: float32 -> float16 -> float32.

The float32 run saves the model's and the optimizer's state as nnx's pure
dicts; a float16 run resumes from it under `jaxamp.loss_scaling`
(`with_loss_scaling_state`: one public call), trains and saves; a float32
run resumes from that (`without_loss_scaling_state`). Each leg's losses are
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
from jaxamp.scaling import with_loss_scaling_state, without_loss_scaling_state

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


def _restore_into(checkpointer, path, model, target):
    restored = checkpointer.restore(path, target)
    _load(model, restored["model"])
    return restored


def test_float32_to_float16_and_back_across_orbax_checkpoints(tmp_path):
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

        # float32 -> float16: the checkpoint restored as written, the scale put around its optimizer state.
        model, optimizer = _fresh(tx)
        target = without_loss_scaling_state(
            {"model": nnx.to_pure_dict(nnx.state(model)), "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}
        )
        restored = _restore_into(checkpointer, tmp_path / "f32", model, target)
        _load(optimizer, with_loss_scaling_state(restored, tx)["optimizer"])
        assert int(optimizer.step[...]) == STEPS
        second = _train(_step16, model, optimizer, STEPS)
        assert int(jaxamp.scaling.scale_metrics(optimizer.opt_state)["skipped_steps"]) == 0
        _save(checkpointer, tmp_path / "f16", model, optimizer)

        # float16 -> float32: the loss-scaled checkpoint restored as written, the scale taken out.
        model, optimizer = _fresh(adam)
        scaled_model, scaled_optimizer = _fresh(tx)
        target = {
            "model": nnx.to_pure_dict(nnx.state(scaled_model)),
            "optimizer": nnx.to_pure_dict(nnx.state(scaled_optimizer)),
        }
        restored = _restore_into(checkpointer, tmp_path / "f16", model, target)
        _load(optimizer, without_loss_scaling_state(restored)["optimizer"])
        assert int(optimizer.step[...]) == 2 * STEPS
        third = _train(_step32, model, optimizer, 2 * STEPS)

    np.testing.assert_array_equal(first, uninterrupted[:STEPS])  # the same program, the same numbers
    np.testing.assert_allclose(second, uninterrupted[STEPS : 2 * STEPS], rtol=F16_RTOL)
    np.testing.assert_allclose(third, uninterrupted[2 * STEPS :], rtol=F16_RTOL)
    # Training went on across both changes: each leg's loss falls as the uninterrupted run's does.
    assert second[-1] < first[0] and third[-1] < second[0]
