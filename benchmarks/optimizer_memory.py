"""Bytes per parameter held by the parameters and AdamW's state, in each precision.

    python -m benchmarks.optimizer_memory        # from the repository root

For the GPT-2-small-shaped benchmark model (`benchmarks.models.GPT2_SMALL`, 124M
parameters), builds the parameters in each `PRECISIONS` entry and the state of
``optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(...))`` wrapped as
that entry says, and counts the bytes of every leaf of both trees (PRNG keys,
step counts and compensation buffers included; gradients excluded, since they
live only within a step). Shapes come from `jax.eval_shape`, so nothing is
allocated and the figures are the same on every backend.

The same entries drive the bf16 runs of ``examples/char_lm.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import jaxamp
from benchmarks.models import GPT, GPT2_SMALL, GPTConfig
from jaxamp.optim import cast_state, low_precision_params

__all__ = ["PRECISIONS", "Precision", "clipped_adamw", "main", "measure", "tree_bytes"]


@dataclasses.dataclass(frozen=True)
class Precision:
    """How parameters and optimizer state are stored.

    Attributes:
        param_dtype: the parameters' dtype.
        wrap: ``wrap(optimizer, key) -> optimizer`` adds the low-precision
            wrappers (`key` feeds any stochastic rounding).
        description: one line for tables.
    """

    param_dtype: Any
    wrap: Callable[[optax.GradientTransformation, jax.Array], optax.GradientTransformation]
    description: str


def _bf16(params_rounding: str, state_rounding: str) -> Callable:
    def wrap(optimizer, key):
        k_state, k_params = jax.random.split(key)
        state_key = k_state if state_rounding == "stochastic" else None
        params_key = k_params if params_rounding == "stochastic" else None
        optimizer = cast_state(optimizer, jnp.bfloat16, rounding=state_rounding, key=state_key)
        return low_precision_params(optimizer, rounding=params_rounding, key=params_key)

    return wrap


PRECISIONS: dict[str, Precision] = {
    "float32": Precision(jnp.float32, lambda optimizer, key: optimizer, "float32 parameters and state"),
    "bf16 stochastic": Precision(
        jnp.bfloat16,
        _bf16("stochastic", "stochastic"),
        "bf16 parameters and state, both rounded stochastically",
    ),
    "bf16 kahan": Precision(
        jnp.bfloat16,
        _bf16("kahan", "stochastic"),
        "bf16 parameters with a bf16 Kahan buffer; bf16 state rounded stochastically",
    ),
    "bf16 nearest": Precision(
        jnp.bfloat16,
        _bf16("nearest", "nearest"),
        "bf16 parameters and state, rounded to nearest",
    ),
}
"""The configurations compared here and in ``examples/char_lm.py``."""


def clipped_adamw(learning_rate: Any = 3e-4) -> optax.GradientTransformation:
    """The optimizer measured and the one ``examples/char_lm.py`` trains with:
    global-norm clipping, then AdamW."""
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(learning_rate, weight_decay=0.01))


def tree_bytes(tree: Any) -> int:
    """Bytes of every array leaf of `tree` (concrete or `jax.ShapeDtypeStruct`)."""
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def measure(config: GPTConfig = GPT2_SMALL) -> dict[str, dict[str, float]]:
    """Bytes of parameters and of AdamW's state, per parameter, in each precision.

    Args:
        config: the shape of the `GPT` measured.

    Returns:
        ``{precision name: {"parameters": ..., "state": ..., "total": ...}}`` in
        bytes per parameter, plus ``"n_parameters"`` in each entry.
    """
    results = {}
    for name, precision in PRECISIONS.items():
        params = eqx.filter_eval_shape(
            lambda dtype: jaxamp.policies.cast_floating(GPT(config, key=jax.random.key(0)), dtype),
            precision.param_dtype,
        )
        n = sum(leaf.size for leaf in jax.tree.leaves(params))
        optimizer = precision.wrap(clipped_adamw(), jax.random.key(0))
        state = jax.eval_shape(optimizer.init, params)
        p, s = tree_bytes(params) / n, tree_bytes(state) / n
        results[name] = {"parameters": p, "state": s, "total": p + s, "n_parameters": n}
    return results


def main() -> dict[str, dict[str, float]]:
    """Print `measure`'s figures for GPT-2 small as a markdown table; return them."""
    results = measure(GPT2_SMALL)
    n = results["float32"]["n_parameters"]
    print(f"GPT-2 small shape: {n:,} parameters; AdamW; JAX {jax.__version__}")
    print("| precision | parameters (B/param) | AdamW state (B/param) | total (B/param) | vs float32 |")
    print("|---|---|---|---|---|")
    base = results["float32"]["total"]
    for name, r in results.items():
        print(
            f"| {PRECISIONS[name].description} | {r['parameters']:.3f} | {r['state']:.3f} | "
            f"{r['total']:.3f} | {r['total'] / base:.3f}x |"
        )
    return results


if __name__ == "__main__":
    main()
