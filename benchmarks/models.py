"""The models of the benchmarks and of ``examples/char_lm.py``.

`GPT` is a GPT-2-style decoder-only transformer, `Llama` a Llama-style one
(RMSNorm, a SwiGLU MLP, no biases), `ResNet` a small residual CNN and
`MLP` a stack of dense layers (the eager-overhead benchmark calls it outside any
jit). All are `equinox.Module`s whose leaves are all arrays (hyperparameters are
static fields), so a model *is* its parameter pytree: it can go straight into
`jax.value_and_grad`, `jax.jit`, `jaxamp.amp` or `jaxamp.policies.cast_floating`, and
`equinox.filter_eval_shape` gives its abstract shape without allocating it.

All are written as plain float32 code. What the benchmarks vary is only how the
loss is wrapped (nothing, a hand-written cast, `jaxamp.amp`), so every variant
runs the same program text.
"""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray

__all__ = [
    "GPT",
    "GPT2_SMALL",
    "MLP",
    "GPTConfig",
    "LLAMA_BLOCK",
    "Llama",
    "LlamaConfig",
    "MLPConfig",
    "ResNet",
    "ResNetConfig",
    "causal_attention",
    "classifier_loss",
    "cross_entropy",
    "lm_loss",
    "mean_square_loss",
]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The shape of a `GPT`.

    Attributes:
        vocab_size: number of token ids.
        seq_len: the longest sequence (the size of the position table).
        d_model: width of the residual stream; a multiple of `n_heads`.
        n_heads: attention heads per layer.
        n_layers: transformer blocks.
        scan_layers: run the blocks with `jax.lax.scan` over stacked weights
            (one traced body) rather than as an unrolled Python loop.
        remat: wrap each block in `jax.checkpoint`, so the backward pass saves
            only the block inputs and recomputes the rest.
    """

    vocab_size: int
    seq_len: int
    d_model: int
    n_heads: int
    n_layers: int
    scan_layers: bool = True
    remat: bool = False


GPT2_SMALL = GPTConfig(vocab_size=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12)
"""GPT-2 small: 124M parameters (the embedding tied to the output layer)."""


MATMUL: list = []
"""A stack: while it holds ``f(x, weight)``, `Dense` and the Llama layers multiply with it
(`benchmarks.gpu`'s flax fp8 variant); read when the model is traced."""


def _matmul(x: Array, weight: Array) -> Array:
    return MATMUL[-1](x, weight) if MATMUL else x @ weight


class Dense(eqx.Module):
    """``x @ weight + bias`` over the last axis of an array of any rank."""

    weight: Float[Array, "d_in d_out"]
    bias: Float[Array, " d_out"]

    def __init__(self, d_in: int, d_out: int, *, key: PRNGKeyArray, std: float = 0.02):
        self.weight = std * jax.random.normal(key, (d_in, d_out))
        self.bias = jnp.zeros((d_out,))

    def __call__(self, x: Float[Array, "... d_in"]) -> Float[Array, "... d_out"]:
        return _matmul(x, self.weight) + self.bias


def _per_token(layer_norm: eqx.nn.LayerNorm, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
    # Equinox layers act on one example; vmap over the leading axes keeps the
    # layer's "eqx.nn.LayerNorm" named scope, which amp's default policy keeps
    # in float32.
    for _ in range(x.ndim - 1):
        layer_norm = jax.vmap(layer_norm)
    return layer_norm(x)


def causal_attention(
    q: Float[Array, "b t h dh"], k: Float[Array, "b t h dh"], v: Float[Array, "b t h dh"]
) -> Float[Array, "b t h dh"]:
    """Softmax attention in which position ``i`` sees positions ``<= i``."""
    q = q / math.sqrt(q.shape[-1])
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    t = q.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    # The dtype's own minimum rather than -inf: exp of it is exactly 0 without
    # an inf - inf = NaN when a whole row is masked.
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


class Block(eqx.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP."""

    ln1: eqx.nn.LayerNorm
    qkv: Dense
    proj: Dense
    ln2: eqx.nn.LayerNorm
    fc: Dense
    out: Dense
    n_heads: int = eqx.field(static=True)

    def __init__(self, config: GPTConfig, *, key: PRNGKeyArray):
        d = config.d_model
        keys = jax.random.split(key, 4)
        # GPT-2 shrinks the layers that write into the residual stream, so its
        # variance does not grow with depth.
        residual_std = 0.02 / math.sqrt(2 * config.n_layers)
        self.ln1 = eqx.nn.LayerNorm(d)
        self.qkv = Dense(d, 3 * d, key=keys[0])
        self.proj = Dense(d, d, key=keys[1], std=residual_std)
        self.ln2 = eqx.nn.LayerNorm(d)
        self.fc = Dense(d, 4 * d, key=keys[2])
        self.out = Dense(4 * d, d, key=keys[3], std=residual_std)
        self.n_heads = config.n_heads

    def __call__(self, x: Float[Array, "b t d"]) -> Float[Array, "b t d"]:
        b, t, d = x.shape
        # Named scopes: what `jaxamp.monitoring.monitor` and `jaxamp.compare` report by.
        with jax.named_scope("attention"):
            q, k, v = jnp.split(self.qkv(_per_token(self.ln1, x)), 3, axis=-1)
            split_heads = lambda y: y.reshape(b, t, self.n_heads, d // self.n_heads)  # noqa: E731
            attended = causal_attention(split_heads(q), split_heads(k), split_heads(v))
            x = x + self.proj(attended.reshape(b, t, d))
        with jax.named_scope("mlp"):
            return x + self.out(jax.nn.gelu(self.fc(_per_token(self.ln2, x))))


class GPT(eqx.Module):
    """A GPT-2-style language model with its output layer tied to the embedding.

    The blocks' weights are stacked along a leading layer axis whichever way
    they run (see `GPTConfig.scan_layers`), so the scanned and the unrolled
    model have the same parameters.
    """

    embed: Float[Array, "vocab d"]
    pos: Float[Array, "seq d"]
    blocks: Block
    ln_f: eqx.nn.LayerNorm
    scan_layers: bool = eqx.field(static=True)
    remat: bool = eqx.field(static=True)

    def __init__(self, config: GPTConfig, *, key: PRNGKeyArray):
        if config.d_model % config.n_heads:
            raise ValueError(f"d_model={config.d_model} is not a multiple of n_heads={config.n_heads}.")
        k_embed, k_pos, k_blocks = jax.random.split(key, 3)
        d = config.d_model
        self.embed = 0.02 * jax.random.normal(k_embed, (config.vocab_size, d))
        self.pos = 0.01 * jax.random.normal(k_pos, (config.seq_len, d))
        make_block = lambda k: Block(config, key=k)  # noqa: E731
        self.blocks = eqx.filter_vmap(make_block)(jax.random.split(k_blocks, config.n_layers))
        self.ln_f = eqx.nn.LayerNorm(d)
        self.scan_layers = config.scan_layers
        self.remat = config.remat

    def __call__(self, tokens: Int[Array, "b t"]) -> Float[Array, "b t vocab"]:
        """Next-token logits for every position of `tokens`."""
        x = self.embed[tokens] + self.pos[: tokens.shape[1]]

        def layer(x, block):
            return block(x), None

        if self.remat:
            layer = jax.checkpoint(layer)
        if self.scan_layers:
            x, _ = jax.lax.scan(layer, x, self.blocks)
        else:
            n_layers = jax.tree_util.tree_leaves(self.blocks)[0].shape[0]
            for i in range(n_layers):
                x, _ = layer(x, jax.tree_util.tree_map(lambda w: w[i], self.blocks))  # noqa: B023 (called here)
        with jax.named_scope("lm_head"):
            return _per_token(self.ln_f, x) @ self.embed.T


def cross_entropy(logits: Float[Array, "... n"], labels: Int[Array, "..."]) -> Float[Array, ""]:  # noqa: UP037
    """Mean cross-entropy, computed in float32 whatever dtype `logits` arrive in.

    The upcast is what jmp-style hand-cast code writes by hand; in float32 code
    (and hence under `jaxamp.amp`) it is a no-op that leaves the choice to amp.
    """
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def lm_loss(model: GPT, tokens: Int[Array, "b t"], targets: Int[Array, "b t"]) -> Float[Array, ""]:
    """Next-token cross-entropy of `model` (``targets`` is `tokens` shifted by one)."""
    return cross_entropy(model(tokens), targets)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The shape of a `Llama`: `GPTConfig`'s fields, and the SwiGLU MLP's width."""

    vocab_size: int
    seq_len: int
    d_model: int
    n_heads: int
    n_layers: int
    d_mlp: int


LLAMA_BLOCK = LlamaConfig(vocab_size=32000, seq_len=2048, d_model=4096, n_heads=32, n_layers=4, d_mlp=14336)
"""Llama-3-8B's decoder block (d=4096, MLP 14336, 32 heads, seq 2048), 4 layers: float32 AdamW state
(16 bytes per parameter, 3.9 GB a layer) fits an 80 GB GPU beside the activations."""


class _Linear(eqx.Module):
    weight: Float[Array, "d_in d_out"]

    def __init__(self, d_in: int, d_out: int, *, key: PRNGKeyArray):
        self.weight = jax.random.normal(key, (d_in, d_out)) / math.sqrt(d_in)

    def __call__(self, x: Float[Array, "... d_in"]) -> Float[Array, "... d_out"]:
        return _matmul(x, self.weight)


class LlamaBlock(eqx.Module):
    """Pre-norm block: causal self-attention (no rotary embedding: it adds no matmul), then a SwiGLU MLP."""

    norm1: eqx.nn.RMSNorm
    qkv: _Linear
    proj: _Linear
    norm2: eqx.nn.RMSNorm
    gate: _Linear
    up: _Linear
    down: _Linear
    n_heads: int = eqx.field(static=True)

    def __init__(self, config: LlamaConfig, *, key: PRNGKeyArray):
        d, keys = config.d_model, jax.random.split(key, 5)
        self.norm1, self.norm2 = eqx.nn.RMSNorm(d), eqx.nn.RMSNorm(d)
        self.qkv, self.proj = _Linear(d, 3 * d, key=keys[0]), _Linear(d, d, key=keys[1])
        self.gate, self.up = _Linear(d, config.d_mlp, key=keys[2]), _Linear(d, config.d_mlp, key=keys[3])
        self.down = _Linear(config.d_mlp, d, key=keys[4])
        self.n_heads = config.n_heads

    def __call__(self, x: Float[Array, "b t d"]) -> Float[Array, "b t d"]:
        b, t, d = x.shape
        with jax.named_scope("attention"):
            q, k, v = jnp.split(self.qkv(_per_token(self.norm1, x)), 3, axis=-1)
            split_heads = lambda y: y.reshape(b, t, self.n_heads, d // self.n_heads)  # noqa: E731
            x = x + self.proj(causal_attention(split_heads(q), split_heads(k), split_heads(v)).reshape(b, t, d))
        with jax.named_scope("mlp"):
            h = _per_token(self.norm2, x)
            return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class Llama(eqx.Module):
    """A Llama-style language model: `LlamaBlock`s under `lax.scan`, an untied output layer."""

    embed: Float[Array, "vocab d"]
    blocks: LlamaBlock
    norm: eqx.nn.RMSNorm
    head: _Linear

    def __init__(self, config: LlamaConfig, *, key: PRNGKeyArray):
        k_embed, k_blocks, k_head = jax.random.split(key, 3)
        self.embed = 0.02 * jax.random.normal(k_embed, (config.vocab_size, config.d_model))
        make_block = lambda k: LlamaBlock(config, key=k)  # noqa: E731
        self.blocks = eqx.filter_vmap(make_block)(jax.random.split(k_blocks, config.n_layers))
        self.norm = eqx.nn.RMSNorm(config.d_model)
        self.head = _Linear(config.d_model, config.vocab_size, key=k_head)

    def __call__(self, tokens: Int[Array, "b t"]) -> Float[Array, "b t vocab"]:
        """Next-token logits for every position of `tokens`."""
        x, _ = jax.lax.scan(lambda x, block: (block(x), None), self.embed[tokens], self.blocks)
        with jax.named_scope("lm_head"):
            return self.head(_per_token(self.norm, x))


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    """The shape of a `ResNet`.

    Attributes:
        in_channels: channels of the input images.
        widths: channels of each stage; every stage after the first halves the
            resolution with a stride-2 block.
        blocks_per_stage: residual blocks per stage.
        num_classes: outputs of the classifier.
        norm_groups: groups of the GroupNorm layers (stateless, unlike BatchNorm,
            so the loss is a pure function of parameters and batch).
    """

    in_channels: int = 3
    widths: tuple[int, ...] = (64, 128, 256)
    blocks_per_stage: int = 2
    num_classes: int = 10
    norm_groups: int = 8


class ResBlock(eqx.Module):
    """Two 3x3 convolutions with GroupNorm and a (projected if needed) skip."""

    conv1: eqx.nn.Conv2d
    norm1: eqx.nn.GroupNorm
    conv2: eqx.nn.Conv2d
    norm2: eqx.nn.GroupNorm
    shortcut: eqx.nn.Conv2d | None

    def __init__(self, c_in: int, c_out: int, stride: int, groups: int, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(c_in, c_out, 3, stride, padding=1, use_bias=False, key=k1)
        self.norm1 = eqx.nn.GroupNorm(groups, c_out)
        self.conv2 = eqx.nn.Conv2d(c_out, c_out, 3, padding=1, use_bias=False, key=k2)
        self.norm2 = eqx.nn.GroupNorm(groups, c_out)
        needs_projection = stride != 1 or c_in != c_out
        self.shortcut = eqx.nn.Conv2d(c_in, c_out, 1, stride, use_bias=False, key=k3) if needs_projection else None

    def __call__(self, x: Float[Array, "c h w"]) -> Float[Array, "c2 h2 w2"]:
        h = jax.nn.relu(self.norm1(self.conv1(x)))
        h = self.norm2(self.conv2(h))
        skip = x if self.shortcut is None else self.shortcut(x)
        return jax.nn.relu(h + skip)


class ResNet(eqx.Module):
    """A ResNet-style image classifier: stem, residual stages, global average pool."""

    stem: eqx.nn.Conv2d
    stem_norm: eqx.nn.GroupNorm
    blocks: tuple[ResBlock, ...]
    head: eqx.nn.Linear

    def __init__(self, config: ResNetConfig, *, key: PRNGKeyArray):
        n_blocks = len(config.widths) * config.blocks_per_stage
        k_stem, k_head, *k_blocks = jax.random.split(key, 2 + n_blocks)
        first = config.widths[0]
        self.stem = eqx.nn.Conv2d(config.in_channels, first, 3, padding=1, use_bias=False, key=k_stem)
        self.stem_norm = eqx.nn.GroupNorm(config.norm_groups, first)
        blocks, c_in = [], first
        for stage, width in enumerate(config.widths):
            for i in range(config.blocks_per_stage):
                stride = 2 if stage > 0 and i == 0 else 1
                key = k_blocks[len(blocks)]
                blocks.append(ResBlock(c_in, width, stride, config.norm_groups, key=key))
                c_in = width
        self.blocks = tuple(blocks)
        self.head = eqx.nn.Linear(c_in, config.num_classes, key=k_head)

    def __call__(self, images: Float[Array, "b c h w"]) -> Float[Array, "b classes"]:
        """Class logits for a batch of images."""

        def one(x):
            x = jax.nn.relu(self.stem_norm(self.stem(x)))
            for block in self.blocks:
                x = block(x)
            return self.head(x.mean(axis=(1, 2)))

        return jax.vmap(one)(images)


def classifier_loss(model: ResNet, images: Float[Array, "b c h w"], labels: Int[Array, " b"]) -> Float[Array, ""]:
    """Cross-entropy of `model` on a labelled batch of images."""
    return cross_entropy(model(images), labels)


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """The shape of an `MLP`.

    Attributes:
        width: features of the input and of every layer.
        n_layers: dense layers, with a tanh after each but the last.
    """

    width: int
    n_layers: int


class MLP(eqx.Module):
    """``n_layers`` square `Dense` layers with tanh in between."""

    layers: tuple[Dense, ...]

    def __init__(self, config: MLPConfig, *, key: PRNGKeyArray):
        std = 1.0 / math.sqrt(config.width)
        keys = jax.random.split(key, config.n_layers)
        self.layers = tuple(Dense(config.width, config.width, key=k, std=std) for k in keys)

    def __call__(self, x: Float[Array, "... width"]) -> Float[Array, "... width"]:
        for layer in self.layers[:-1]:
            x = jnp.tanh(layer(x))
        return self.layers[-1](x)


def mean_square_loss(model: MLP, x: Float[Array, "b width"]) -> Float[Array, ""]:
    """The mean of the squares of `model`'s outputs: a scalar to differentiate."""
    return jnp.mean(model(x) ** 2)
