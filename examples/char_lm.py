"""A GPT-style character model trained in float32 and under `jaxamp.amp` bf16, side by side.

    python examples/char_lm.py [--steps 300] [--print-every 20]

The corpus is the Python standard library's own source (the ``*.py`` files next
to `os`), so every machine has it and nothing is downloaded; characters are
bytes (a vocabulary of 256). The model is `benchmarks.models.GPT`: pre-norm
blocks with causal attention and layer norm, stacked and run under
`jax.lax.scan` with each block in `jax.checkpoint`.

Both runs start from the same weights and see the same batches; the only
difference is ``jaxamp.amp(loss, compute_dtype="bf16")``. Every ``--print-every``
steps the training and validation losses are printed next to each other, and at
the end each model continues a few prompts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for `benchmarks.models`

import jaxamp  # noqa: E402
from benchmarks.models import GPT, GPTConfig, lm_loss  # noqa: E402

MODES = {"float32": None, "amp bf16": "bf16"}
"""Run name -> amp compute dtype (None: no amp)."""

PROMPTS = ("def ", "import ", "class ")


def load_corpus(max_bytes: int) -> np.ndarray:
    """The standard library's top-level ``*.py`` files, concatenated, as uint8 bytes.

    Files are taken in name order until `max_bytes` is reached, so the corpus is
    the same for the same Python version.
    """
    stdlib = Path(os.path.dirname(os.__file__))
    chunks, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return np.frombuffer(b"\n".join(chunks)[:max_bytes], dtype=np.uint8)


def sample_batch(data: np.ndarray, rng: np.random.Generator, batch: int, seq_len: int):
    """Random windows of ``seq_len + 1`` bytes: inputs and the next-byte targets."""
    starts = rng.integers(0, len(data) - seq_len - 1, batch)
    windows = np.stack([data[s : s + seq_len + 1] for s in starts]).astype(np.int32)
    return windows[:, :-1], windows[:, 1:]


def make_train_step(compute_dtype: str | None, optimizer: optax.GradientTransformation):
    """A jitted ``step(model, opt_state, tokens, targets) -> (model, opt_state, loss)``."""
    loss = lm_loss if compute_dtype is None else jaxamp.amp(lm_loss, compute_dtype=compute_dtype)

    @eqx.filter_jit
    def step(model, opt_state, tokens, targets):
        value, grads = eqx.filter_value_and_grad(loss)(model, tokens, targets)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, value

    return step, eqx.filter_jit(loss)


def generate(
    model: GPT, compute_dtype: str | None, prompts: tuple[str, ...], n_chars: int, key
) -> list[str]:
    """Continue each prompt by `n_chars` bytes sampled at temperature 0.8.

    The model always sees a window of its full context length; positions after
    the last real byte are padding that, attention being causal, cannot affect
    the prediction. So one compiled function serves every position and prompt.
    """
    seq_len = model.pos.shape[0]

    @eqx.filter_jit
    def next_byte(model, window, position, key):
        forward = model if compute_dtype is None else jaxamp.amp(model, compute_dtype=compute_dtype)
        logits = forward(window[None])[0, position]
        return jax.random.categorical(key, logits / 0.8)

    texts = []
    for prompt in prompts:
        out = list(prompt.encode())
        for k in jax.random.split(key, n_chars):
            context = out[-seq_len:]
            window = np.zeros(seq_len, np.int32)
            window[: len(context)] = context
            # An array, not a Python int: equinox would make an int static and
            # compile once per position.
            position = np.int32(len(context) - 1)
            out.append(int(next_byte(model, window, position, k)))
        texts.append(bytes(out).decode("utf-8", errors="replace"))
    return texts


# flag, default, meaning: every option is a number.
_OPTIONS = (
    ("--steps", 300, "training steps per run"),
    ("--print-every", 20, "print losses every N steps"),
    ("--batch-size", 32, "sequences per step"),
    ("--seq-len", 64, "context length in bytes"),
    ("--d-model", 128, "width of the model"),
    ("--layers", 4, "transformer blocks"),
    ("--heads", 4, "attention heads"),
    ("--lr", 3e-3, "peak AdamW learning rate"),
    ("--corpus-bytes", 2_000_000, "bytes of standard-library source to train on"),
    ("--sample-chars", 80, "bytes sampled per prompt at the end"),
    ("--seed", 0, "seed of initialisation, batches and sampling"),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a small GPT-style byte-level language model on the Python "
        "standard library's source, in float32 and under jaxamp.amp bf16, and compare.",
    )
    for flag, default, meaning in _OPTIONS:
        parser.add_argument(
            flag, type=type(default), default=default, help=f"{meaning} (default: {default:g})"
        )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Train both runs, print the comparison and samples; return the results.

    Returns:
        ``{"train_loss": {mode: [per step]}, "val_loss": {mode: [per print]},
        "samples": {mode: [text per prompt]}, "step_seconds": {mode: mean}}``.
    """
    args = parse_args(argv)
    data = load_corpus(args.corpus_bytes)
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]
    config = GPTConfig(
        vocab_size=256,
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_heads=args.heads,
        n_layers=args.layers,
        scan_layers=True,
        remat=True,
    )
    init = GPT(config, key=jax.random.key(args.seed))
    warmup = max(args.steps // 10, 1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps)
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01)
    )
    runs = {}
    for name, dtype in MODES.items():
        step, loss = make_train_step(dtype, optimizer)
        runs[name] = {"model": init, "opt_state": optimizer.init(init), "step": step, "loss": loss}
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(init))
    print(
        f"JAX {jax.__version__} on {jax.devices()[0].device_kind}; corpus {len(data):,} bytes of "
        f"stdlib source; model {n_params:,} parameters ({args.layers} layers, d={args.d_model})"
    )
    val_rng = np.random.default_rng(args.seed + 1)
    val_tokens, val_targets = sample_batch(val_data, val_rng, 64, args.seq_len)
    rng = np.random.default_rng(args.seed)
    train_loss = {name: [] for name in MODES}
    val_loss = {name: [] for name in MODES}
    seconds = {name: [] for name in MODES}
    header = "".join(f"{name + ' train/val':>24}" for name in MODES)
    print(f"{'step':>6}{header}")
    for i in range(args.steps):
        tokens, targets = sample_batch(train_data, rng, args.batch_size, args.seq_len)
        for name, run in runs.items():
            start = time.perf_counter()
            run["model"], run["opt_state"], loss = jax.block_until_ready(
                run["step"](run["model"], run["opt_state"], tokens, targets)
            )
            if i:  # step 0 includes compilation
                seconds[name].append(time.perf_counter() - start)
            train_loss[name].append(float(loss))
        if (i + 1) % args.print_every == 0 or i + 1 == args.steps:
            cells = []
            for name, run in runs.items():
                val_loss[name].append(float(run["loss"](run["model"], val_tokens, val_targets)))
                recent = np.mean(train_loss[name][-args.print_every :])
                cells.append(f"{recent:>12.3f} / {val_loss[name][-1]:<8.3f}")
            print(f"{i + 1:>6}" + "".join(f"{c:>24}" for c in cells), flush=True)

    print("\nmean step time: " + ", ".join(
        f"{name} {1e3 * np.mean(s):.1f} ms" for name, s in seconds.items() if s
    ))
    samples = {}
    for name, dtype in MODES.items():
        key = jax.random.key(args.seed)
        samples[name] = generate(runs[name]["model"], dtype, PROMPTS, args.sample_chars, key)
        print(f"\n--- samples from {name} ---")
        for text in samples[name]:
            print(repr(text))
    return {
        "train_loss": train_loss,
        "val_loss": val_loss,
        "samples": samples,
        "step_seconds": {
            name: float(np.mean(s)) if s else float("nan") for name, s in seconds.items()
        },
    }


if __name__ == "__main__":
    main()
