"""Models that more than one test module builds."""

import equinox as eqx
import jax
import jax.numpy as jnp


class SmallCNN(eqx.Module):
    """Conv, ReLU, grouped conv, GroupNorm, ReLU, linear head: 10 classes of 8x8 images.

    The second convolution has 2 groups and `stride`; the head takes its
    flattened output.
    """

    convs: list
    norm: eqx.nn.GroupNorm
    head: eqx.nn.Linear

    def __init__(self, in_channels: int, width: int, *, stride: int = 1, key):
        k = jax.random.split(key, 3)
        self.convs = [
            eqx.nn.Conv2d(in_channels, width, 3, padding=1, key=k[0]),
            eqx.nn.Conv2d(width, width, 3, stride=stride, padding=1, groups=2, key=k[1]),
        ]
        self.norm = eqx.nn.GroupNorm(2, width)
        self.head = eqx.nn.Linear(width * (8 // stride) ** 2, 10, key=k[2])

    def __call__(self, x):
        x = jax.nn.relu(self.convs[0](x))
        x = jax.nn.relu(self.norm(self.convs[1](x)))
        return self.head(x.reshape(-1))


def cross_entropy(model, images, labels):
    """Mean softmax cross-entropy of `model` over a batch of `images`."""
    logits = jax.vmap(model)(images)
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(labels)), labels])
