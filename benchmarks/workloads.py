"""What the benchmarks measure: a model, its loss and the shape of one batch.

Three families, each in a ``"full"`` size (the figures of RESULTS.md) and a
``"tiny"`` one (toy shapes that test the suite itself in seconds):

* `workloads`: the training workloads of the per-variant tables, a
  GPT-2-small-shaped language model and a ResNet-style CNN;
* `trace_workloads`: the models of the trace-overhead figure, GPT-2 small
  written three ways (unrolled, under `lax.scan`, unrolled at twice the depth),
  since how long tracing takes depends on how much program text there is;
* `eager_workload`: the MLP of the eager-overhead figure;
* `llama_workload`: a Llama-style decoder at d=4096 (`benchmarks.gpu`), where
  float8 matmuls are large enough to pay.

They are built by name from the size alone, so that a worker process
(`benchmarks.worker`) can rebuild the same workload from a JSON spec.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from benchmarks.models import (
    GPT,
    GPT2_SMALL,
    LLAMA_BLOCK,
    MLP,
    GPTConfig,
    Llama,
    LlamaConfig,
    MLPConfig,
    ResNet,
    ResNetConfig,
    classifier_loss,
    lm_loss,
    mean_square_loss,
)

__all__ = [
    "SIZES",
    "Workload",
    "eager_workload",
    "llama_workload",
    "trace_workloads",
    "workloads",
]

SIZES = ("full", "tiny")
"""``"full"``: the shapes the targets are stated for; ``"tiny"``: for testing."""


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model, its loss and the shape of one batch.

    Attributes:
        key: identifier (``"gpt"``, ``"resnet"``, ...), used in the results.
        title: a human description of the shape.
        make_model: ``make_model(key) -> model``.
        loss_fn: ``loss_fn(model, *batch) -> scalar``.
        batch: `jax.ShapeDtypeStruct` per batch argument.
        unit: what throughput counts (``"tokens"``, ``"images"``, ...).
        items_per_step: how many of them one step processes.
        int_high: integer batch inputs (tokens, labels) are drawn from
            ``[0, int_high)``.
        make_flat_model: the same model without loops (layers unrolled), so
            that each residual can be traced to the line producing it; None
            when `make_model` has no loops.
    """

    key: str
    title: str
    make_model: Callable[[Any], Any]
    loss_fn: Callable
    batch: tuple[jax.ShapeDtypeStruct, ...]
    unit: str
    items_per_step: int
    int_high: int = 0
    make_flat_model: Callable[[Any], Any] | None = None

    def abstract_args(self) -> tuple:
        """``(model, *batch)`` as shapes only: nothing is allocated."""
        return (eqx.filter_eval_shape(self.make_model, jax.random.key(0)), *self.batch)

    def concrete_args(self) -> tuple:
        """``(model, *batch)`` as arrays on the default device.

        Float inputs are standard normal, integer inputs uniform (`int_high`).
        """
        # One compiled initialiser instead of an eager op (and a compilation)
        # per parameter.
        model = eqx.filter_jit(self.make_model)(jax.random.key(0))
        keys = jax.random.split(jax.random.key(1), len(self.batch))
        batch = [
            jax.random.normal(k, s.shape, s.dtype)
            if jnp.issubdtype(s.dtype, jnp.floating)
            else jax.random.randint(k, s.shape, 0, self.int_high, s.dtype)
            for k, s in zip(keys, self.batch, strict=True)
        ]
        return (model, *batch)


def _gpt_workload(key: str, config: GPTConfig, batch: int) -> Workload:
    c = config
    tokens = jax.ShapeDtypeStruct((batch, c.seq_len), jnp.int32)
    layout = "layers under lax.scan" if c.scan_layers else "layers unrolled"
    return Workload(
        key=key,
        title=(
            f"GPT ({c.n_layers} layers, d={c.d_model}, {c.n_heads} heads, seq {c.seq_len}, "
            f"vocab {c.vocab_size}, batch {batch}, {layout})"
        ),
        make_model=lambda k: GPT(c, key=k),
        make_flat_model=((lambda k: GPT(dataclasses.replace(c, scan_layers=False), key=k)) if c.scan_layers else None),
        loss_fn=lm_loss,
        batch=(tokens, tokens),
        unit="tokens",
        items_per_step=batch * c.seq_len,
        int_high=c.vocab_size,
    )


def _resnet_workload(config: ResNetConfig, image_size: int, batch: int) -> Workload:
    c = config
    return Workload(
        key="resnet",
        title=(
            f"ResNet ({len(c.widths)} stages of {c.blocks_per_stage} blocks, widths "
            f"{'/'.join(map(str, c.widths))}, GroupNorm, {image_size}x{image_size} images, "
            f"batch {batch})"
        ),
        make_model=lambda k: ResNet(c, key=k),
        loss_fn=classifier_loss,
        batch=(
            jax.ShapeDtypeStruct((batch, c.in_channels, image_size, image_size), jnp.float32),
            jax.ShapeDtypeStruct((batch,), jnp.int32),
        ),
        unit="images",
        items_per_step=batch,
        int_high=c.num_classes,
    )


_TINY_GPT = GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_heads=4, n_layers=2)


def _check(size: str) -> None:
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, not {size!r}.")


def workloads(size: str) -> dict[str, Workload]:
    """The training workloads of the per-variant tables, by key.

    Args:
        size: ``"full"`` (GPT-2 small, batch 8 x 1024 tokens, layers under
            `lax.scan`; a CIFAR-sized ResNet, batch 256) or ``"tiny"``.

    Returns:
        ``{"gpt": ..., "resnet": ...}``.
    """
    _check(size)
    if size == "full":
        gpt = _gpt_workload("gpt", GPT2_SMALL, batch=8)
        resnet = _resnet_workload(ResNetConfig(), image_size=32, batch=256)
    else:
        gpt = _gpt_workload("gpt", _TINY_GPT, batch=2)
        resnet = _resnet_workload(ResNetConfig(widths=(8, 16), blocks_per_stage=1), 8, batch=4)
    return {w.key: w for w in (gpt, resnet)}


def trace_workloads(size: str) -> dict[str, Workload]:
    """The models of the trace-overhead figure, by key.

    Args:
        size: ``"full"``: GPT-2 small (batch 8) with its 12 layers unrolled
            (``"unrolled"``), under `lax.scan` (``"scan"``) and a 24-layer
            unrolled variant (``"unrolled_deep"``); ``"tiny"``: the same three
            layouts of a 2-layer (4-layer deep) toy GPT.

    Returns:
        ``{"unrolled": ..., "scan": ..., "unrolled_deep": ...}``.
    """
    _check(size)
    base, batch = (GPT2_SMALL, 8) if size == "full" else (_TINY_GPT, 2)
    layouts = {
        "unrolled": dataclasses.replace(base, scan_layers=False),
        "scan": dataclasses.replace(base, scan_layers=True),
        "unrolled_deep": dataclasses.replace(base, n_layers=2 * base.n_layers, scan_layers=False),
    }
    return {key: _gpt_workload(key, config, batch) for key, config in layouts.items()}


def eager_workload(size: str) -> Workload:
    """The model of the eager-overhead figure.

    Args:
        size: ``"full"``: an 8-layer MLP of width 128 (float32 parameters) on a
            batch of 16; ``"tiny"``: 2 layers of width 32, batch 4. Small on
            purpose: the figure is what amp adds per call (tracing, rewriting,
            dispatching). At width 512, batch 128 the eager amp bf16 call took
            1.39x plain on the 2-core CPU, with amp's own Python work under 1%
            of the call in a profile: it timed XLA:CPU's op-by-op bfloat16 math.

    Returns:
        A `Workload` whose loss is `benchmarks.models.mean_square_loss`.
    """
    _check(size)
    config, batch = (MLPConfig(128, 8), 16) if size == "full" else (MLPConfig(32, 2), 4)
    return Workload(
        key="mlp",
        title=(f"MLP ({config.n_layers} layers of width {config.width}, tanh, batch {batch}), called eagerly"),
        make_model=lambda k: MLP(config, key=k),
        loss_fn=mean_square_loss,
        batch=(jax.ShapeDtypeStruct((batch, config.width), jnp.float32),),
        unit="examples",
        items_per_step=batch,
    )


def llama_workload(size: str, n_layers: int | None = None) -> Workload:
    """A Llama-style decoder (`benchmarks.models.LLAMA_BLOCK`), by size.

    Args:
        size: ``"full"``: d=4096, MLP 14336, 32 heads, seq 2048, vocab 32000,
            batch 1; ``"tiny"``: d=64, MLP 224, 4 heads, seq 32, vocab 256, 2
            layers, batch 2 (runs on a CPU in seconds).
        n_layers: blocks (default: 4 full, 2 tiny).
    """
    _check(size)
    config, batch = (LLAMA_BLOCK, 1) if size == "full" else (LlamaConfig(256, 32, 64, 4, 2, 224), 2)
    if n_layers is not None:
        config = dataclasses.replace(config, n_layers=n_layers)
    c = config
    tokens = jax.ShapeDtypeStruct((batch, c.seq_len), jnp.int32)
    return Workload(
        key="llama",
        title=(
            f"Llama-style decoder ({c.n_layers} layers, d={c.d_model}, MLP {c.d_mlp}, {c.n_heads} heads, "
            f"seq {c.seq_len}, vocab {c.vocab_size}, batch {batch}, layers under lax.scan)"
        ),
        make_model=lambda k: Llama(c, key=k),
        loss_fn=lm_loss,
        batch=(tokens, tokens),
        unit="tokens",
        items_per_step=batch * c.seq_len,
        int_high=c.vocab_size,
    )
