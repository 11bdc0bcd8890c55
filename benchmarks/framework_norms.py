"""Residual bytes of flax and haiku transformers, whose norms amp finds by their statistics.

    python -m benchmarks.framework_norms [--size full|tiny]   # from the repository root

The benchmark models (`benchmarks.models`) use Equinox's norm layers, which
amp's default table names. Flax's and haiku's ``LayerNorm`` carry no such
scope: amp's statistics pass finds them by what they compute, and amp
recomputes them in the backward pass from their half-precision input, as it
does for Equinox's (issue 26). This prints, for a pre-norm GPT block stack
written with `flax.linen` and one written with haiku, the bytes the forward
pass saves for the backward pass (abstract: nothing is allocated, so the
figure is the same on every backend) under amp bf16 and f16, over the
hand-cast model of the same dtype (jmp style: parameters and inputs cast,
loss returned in float32) and over float32, against the targets of the
benchmark models (at most 1.00 of hand-cast, 0.51 of float32).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import jax
import jax.numpy as jnp

import jaxamp
from benchmarks.measure import residuals
from benchmarks.variants import hand_cast

__all__ = ["TARGETS", "measure", "main"]

TARGETS = {"hand_cast": 1.00, "float32": 0.51}
SIZES = {
    # layers, width, heads, sequence, vocabulary, batch
    "full": (12, 768, 12, 1024, 50257, 8),
    "tiny": (2, 64, 4, 32, 256, 2),
}


def _linen_model(layers: int, width: int, heads: int, vocab: int) -> tuple[Callable, Callable]:
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm()(x)
            x = x + nn.SelfAttention(num_heads=heads, qkv_features=width)(h, mask=nn.make_causal_mask(x[..., 0]))
            h = nn.LayerNorm()(x)
            return x + nn.Dense(width)(nn.gelu(nn.Dense(4 * width)(h)))

    class GPT(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(vocab, width)(tokens)
            for _ in range(layers):
                x = Block()(x)
            return nn.Dense(vocab)(nn.LayerNorm()(x))

    model = GPT()
    return model.init, model.apply


def _haiku_model(layers: int, width: int, heads: int, vocab: int) -> tuple[Callable, Callable]:
    import haiku as hk

    def norm(x):
        return hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)

    def forward(tokens):
        x = hk.Embed(vocab, width)(tokens)
        causal = jnp.tril(jnp.ones((1, 1) + (tokens.shape[-1],) * 2, bool))
        for _ in range(layers):
            h = norm(x)
            attention = hk.MultiHeadAttention(heads, width // heads, w_init=hk.initializers.VarianceScaling())
            x = x + attention(h, h, h, mask=causal)
            h = norm(x)
            x = x + hk.Linear(width)(jax.nn.gelu(hk.Linear(4 * width)(h)))
        return hk.Linear(vocab)(norm(x))

    model = hk.without_apply_rng(hk.transform(forward))
    return model.init, model.apply


MODELS = {"flax.linen": _linen_model, "haiku": _haiku_model}


def measure(size: str = "full") -> dict[str, dict[str, float]]:
    """Residual ratios per model: ``{model: {"bf16 / hand-cast": ..., ...}}``."""
    layers, width, heads, seq, vocab, batch = SIZES[size]
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    results = {}
    for name, make in MODELS.items():
        init, apply = make(layers, width, heads, vocab)
        params = jax.eval_shape(init, jax.random.key(0), tokens)

        def loss(params, tokens, apply=apply):
            logits = apply(params, tokens)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], -1))

        float32 = residuals(loss, params, tokens).saved_bytes
        row = {}
        for dtype in ("bf16", "f16"):
            amp = residuals(jaxamp.amp(loss, compute_dtype=dtype), params, tokens).saved_bytes
            hand = hand_cast(loss, jaxamp.get_policy(f"p=f32,c={dtype},o=f32"))
            row[f"{dtype} / hand-cast"] = amp / residuals(hand, params, tokens).saved_bytes
            row[f"{dtype} / float32"] = amp / float32
        results[name] = row
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    args = parser.parse_args(argv)
    print(
        f"Residual bytes, amp over hand-cast (target <= {TARGETS['hand_cast']:.2f}) "
        f"and over float32 (target <= {TARGETS['float32']:.2f}); JAX {jax.__version__}"
    )
    for name, row in measure(args.size).items():
        cells = []
        for key, ratio in row.items():
            target = TARGETS["hand_cast" if "hand" in key else "float32"]
            cells.append(f"{key} {ratio:.3f} ({'met' if ratio <= target else 'NOT met'})")
        print(f"  {name}: " + ", ".join(cells))


if __name__ == "__main__":
    main()
