"""flax's ensembling guide (examples/flax_ensemble.py) in float16: each member decides alone.

The guide trains one model per device under `jax.pmap` with one optimizer
definition; its float16 port wraps that definition in `loss_scaling(...,
axis_name=())` and gives amp each member's state. A member whose batch
overflows skips its step and halves its own scale; the other members' steps are
bit for bit those of a run where nothing overflowed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import jax_utils

import jaxamp

from example_scripts import load_example
from jaxpr_walk import assert_all_matmuls_in

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MEMBERS = 4


def _example(amp):
    """The example imported afresh (its pmapped functions traced anew) with `amp`."""
    module = load_example("flax_ensemble", f"example_flax_ensemble_{amp}")
    module.AMP = amp
    return module


def _train(example, steps, poison_member=None):
    train_ds, _ = example.get_datasets()
    state = example.create_train_state(jax.random.split(jax.random.key(0), MEMBERS), 0.1, 0.9)
    first = None
    for step in range(steps):
        images = jax_utils.replicate(train_ds["image"][step * 32 : (step + 1) * 32], jax.devices()[:MEMBERS])
        labels = jax_utils.replicate(train_ds["label"][step * 32 : (step + 1) * 32], jax.devices()[:MEMBERS])
        if poison_member is not None and step == 0:
            images = images.at[poison_member].multiply(1e4)
        grads, _, _ = example.apply_model(state, images, labels)
        before = state
        state = example.update_model(state, grads)
        if step == 0:
            first = (before, grads)
    return state, first


def _member(tree, k):
    return jax.tree.map(lambda x: np.asarray(x)[k], tree)


def test_an_overflowing_member_skips_alone_and_the_others_train_as_if_nothing_happened():
    example = _example("f16")
    clean, _ = _train(example, steps=3)
    poisoned, (before, grads) = _train(example, steps=3, poison_member=2)
    # The poisoned member's gradients are NaN (the overflow travels with them); the others' finite.
    finite = [bool(all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(_member(grads, k)))) for k in range(MEMBERS)]
    assert finite == [True, True, False, True]
    metrics = jaxamp.scaling.scale_metrics(poisoned.opt_state)
    assert metrics["skipped_steps"].tolist() == [0, 0, 1, 0]
    assert metrics["loss_scale"].tolist() == [2.0**15, 2.0**15, 2.0**14, 2.0**15]
    for k in (0, 1, 3):
        for a, b in zip(jax.tree.leaves(_member(poisoned.params, k)), jax.tree.leaves(_member(clean.params, k))):
            np.testing.assert_array_equal(a, b)
    # Member 2 trained two steps from where it was: not where the clean run's two steps from init lead.
    assert not np.array_equal(
        _member(poisoned.params, 2)["Dense_1"]["kernel"], _member(clean.params, 2)["Dense_1"]["kernel"]
    )


def test_every_matmul_and_convolution_runs_in_float16_and_the_loss_matches_float32():
    f16, f32 = _example("f16"), _example("f32")
    state = f16.create_train_state(jax.random.split(jax.random.key(0), MEMBERS), 0.1, 0.9)
    train_ds, _ = f16.get_datasets()
    images = jax_utils.replicate(train_ds["image"][:32], jax.devices()[:MEMBERS])
    labels = jax_utils.replicate(train_ds["label"][:32], jax.devices()[:MEMBERS])
    # 2 convolutions and 2 dense layers, each with its weight's gradient and but for the first its input's.
    assert assert_all_matmuls_in(jax.make_jaxpr(f16.apply_model)(state, images, labels), jnp.float16) == 11
    state32 = f32.create_train_state(jax.random.split(jax.random.key(0), MEMBERS), 0.1, 0.9)
    _, loss16, _ = f16.apply_model(state, images, labels)
    _, loss32, _ = f32.apply_model(state32, images, labels)
    # float16 rounds to 11 bits: the mean cross-entropy within 0.5% (seen: 2e-4).
    np.testing.assert_allclose(np.asarray(loss16), np.asarray(loss32), rtol=5e-3)
