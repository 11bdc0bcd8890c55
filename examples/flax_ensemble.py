"""flax's "Ensembling on multiple devices" guide, ported to jaxamp as docs/porting.md says.

The guide (flax docs/guides/parallel_training/ensembling.rst) trains an
ensemble of CNNs, one per device, with `jax.pmap`: one optimizer definition,
one `TrainState` per member, the gradients taken in one pmapped function
(``apply_model``) and applied in another (``update_model``). Its functions are
here as the guide writes them, but for the lines marked ``# jaxamp``:

    bf16:  loss_fn = jaxamp.amp(loss_fn, compute_dtype="bf16")
    f16:   tx = jaxamp.loss_scaling(optax.sgd(learning_rate, momentum), axis_name=())
           loss_fn = jaxamp.amp(loss_fn, compute_dtype="f16", loss_scale=state.opt_state)

``axis_name=()``: each device trains a model of its own, so each member decides
alone which of its steps to skip and keeps its own scale (inside `pmap`
`loss_scaling` asks, rather than guess between that and one decision for all).

The guide's data is MNIST (a download); this machine has no network, so the
data is scikit-learn's 8x8 digits (1,797 images, 1,500 to train), and the CNN is
the guide's. ``--poison_member=K`` multiplies member K's images by 1e4 at the
first step of the first epoch (float16 overflows there): that member skips the
step and halves its scale, and the others go on as they were.

Usage:

    python examples/flax_ensemble.py --amp=f16 [--epochs=3] [--poison_member=2]
"""

from __future__ import annotations

import argparse
import functools
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # The guide's ensemble is one member per device: four on the CPU.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import jax_utils
from flax import linen as nn
from flax.training import train_state

import jaxamp

AMP = "f32"  # set from --amp before anything is traced (one mode a process)
learning_rate = 0.1
momentum = 0.9
batch_size = 32


class CNN(nn.Module):
    """A simple CNN model (the guide's, from flax's MNIST example)."""

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(features=32, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=64, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))  # flatten
        x = nn.Dense(features=256)(x)
        x = nn.relu(x)
        x = nn.Dense(features=10)(x)
        return x


def get_datasets():
    """scikit-learn's digits as the guide's MNIST dicts: images (N, 8, 8, 1) in [0, 1], int labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int32)
    return (
        {"image": jnp.asarray(images[:1500]), "label": jnp.asarray(labels[:1500])},
        {"image": jnp.asarray(images[1500:]), "label": jnp.asarray(labels[1500:])},
    )


@functools.partial(jax.pmap, static_broadcasted_argnums=(1, 2))
def create_train_state(rng, learning_rate, momentum):
    cnn = CNN()
    params = cnn.init(rng, jnp.ones([1, 8, 8, 1]))["params"]
    tx = optax.sgd(learning_rate, momentum)
    if AMP == "f16":
        tx = jaxamp.loss_scaling(optax.sgd(learning_rate, momentum), axis_name=())  # jaxamp
    return train_state.TrainState.create(apply_fn=cnn.apply, params=params, tx=tx)


@functools.partial(jax.pmap, axis_name="ensemble")
def apply_model(state, images, labels):
    def loss_fn(params):
        logits = CNN().apply({"params": params}, images)
        one_hot = jax.nn.one_hot(labels, 10)
        loss = optax.softmax_cross_entropy(logits=logits, labels=one_hot).mean()
        return loss, logits

    if AMP == "bf16":
        loss_fn = jaxamp.amp(loss_fn, compute_dtype="bf16")  # jaxamp
    elif AMP == "f16":
        loss_fn = jaxamp.amp(loss_fn, compute_dtype="f16", loss_scale=state.opt_state)  # jaxamp
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(state.params)
    loss = jax.lax.pmean(loss, axis_name="ensemble")
    probs = jax.lax.pmean(jax.nn.softmax(logits), axis_name="ensemble")
    accuracy = jnp.mean(jnp.argmax(probs, -1) == labels)
    return grads, loss, accuracy


@jax.pmap
def update_model(state, grads):
    return state.apply_gradients(grads=grads)


def train_epoch(state, train_ds, batch_size, rng, poison_member=None):
    train_ds_size = len(train_ds["image"])
    steps_per_epoch = train_ds_size // batch_size

    perms = jax.random.permutation(rng, len(train_ds["image"]))
    perms = perms[: steps_per_epoch * batch_size]
    perms = perms.reshape((steps_per_epoch, batch_size))

    epoch_loss = []
    epoch_accuracy = []

    for step, perm in enumerate(perms):
        batch_images = jax_utils.replicate(train_ds["image"][perm, ...])
        batch_labels = jax_utils.replicate(train_ds["label"][perm, ...])
        if poison_member is not None and step == 0:  # not the guide's: one member's batch overflows float16
            batch_images = batch_images.at[poison_member].multiply(1e4)
        grads, loss, accuracy = apply_model(state, batch_images, batch_labels)
        state = update_model(state, grads)
        epoch_loss.append(jax_utils.unreplicate(loss))
        epoch_accuracy.append(jax_utils.unreplicate(accuracy))
    train_loss = np.mean(epoch_loss)
    train_accuracy = np.mean(epoch_accuracy)
    return state, train_loss, train_accuracy


def main(argv: list[str] | None = None) -> list[dict]:
    """The guide's training loop; returns each epoch's figures (and prints them)."""
    global AMP
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--amp", choices=("f32", "bf16", "f16"), default="f16")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--poison_member", type=int, default=None)
    args = parser.parse_args(argv)
    AMP = args.amp  # read where the pmapped functions are traced: one mode a process

    train_ds, test_ds = get_datasets()
    test_ds = jax_utils.replicate(test_ds)
    rng = jax.random.key(0)

    rng, init_rng = jax.random.split(rng)
    state = create_train_state(jax.random.split(init_rng, jax.device_count()), learning_rate, momentum)

    history = []
    for epoch in range(1, args.epochs + 1):
        rng, input_rng = jax.random.split(rng)
        poison = args.poison_member if epoch == 1 else None
        state, train_loss, train_accuracy = train_epoch(state, train_ds, batch_size, input_rng, poison)

        _, test_loss, test_accuracy = jax_utils.unreplicate(apply_model(state, test_ds["image"], test_ds["label"]))
        figures = {
            "epoch": epoch,
            "train_loss": float(train_loss),
            "train_accuracy": float(train_accuracy),
            "test_loss": float(test_loss),
            "test_accuracy": float(test_accuracy),
        }
        line = (
            f"[{AMP}] epoch:{epoch:3d}, train_loss: {train_loss:.4f}, train_accuracy: {train_accuracy * 100:.2f}, "
            f"test_loss: {test_loss:.4f}, test_accuracy: {test_accuracy * 100:.2f}"
        )
        if AMP == "f16":
            metrics = jaxamp.scaling.scale_metrics(state.opt_state)  # one value per member
            figures["loss_scale"] = [float(s) for s in metrics["loss_scale"]]
            figures["skipped_steps"] = [int(s) for s in metrics["skipped_steps"]]
            line += f", scales: {figures['loss_scale']}, skipped: {figures['skipped_steps']}"
        print(line, flush=True)
        history.append(figures)
    return history


if __name__ == "__main__":
    main()
