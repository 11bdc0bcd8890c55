"""A GPT-style character model trained in float32 and under `jaxamp.amp` bf16, side by side.

    python examples/char_lm.py [--steps 300] [--print-every 20] [--modes float32,"amp bf16"]
    python examples/char_lm.py --modes "amp bf16,bf16 stochastic,bf16 kahan,bf16 nearest" \
        --plot curves.png

The corpus is the Python standard library's own source (the ``*.py`` files next
to `os`), so every machine has it and nothing is downloaded; characters are
bytes (a vocabulary of 256). The model is `benchmarks.models.GPT`: pre-norm
blocks with causal attention and layer norm, stacked and run under
`jax.lax.scan` with each block in `jax.checkpoint`.

By default two runs start from the same weights and see the same batches; the
only difference is ``jaxamp.amp(loss, compute_dtype="bf16")``. ``--modes`` picks
other runs: ``amp f16`` computes in float16 with dynamic loss scaling (the
optimizer in `jaxamp.loss_scaling`, whose state ``amp(..., loss_scale=opt_state)``
reads), ``amp fp8`` runs the matmuls in float8 (`jaxamp.fp8.Fp8Recipe`'s
current scaling, at every size: ``keep_small_bf16=None``; float8 is emulated on CPU, so it is slower there), ``amp fp8
rowwise``, ``amp fp8 mxfp8``, ``amp fp8 blockwise`` and ``amp fp8 delayed``
with those scaling recipes (the delayed one threads its `jaxamp.fp8.Fp8State`
of amax histories through the steps, the evaluations and the sampling); the
``bf16 ...`` modes also store the parameters and AdamW's state in bfloat16
with `jaxamp.optim` (see `benchmarks.optimizer_memory.PRECISIONS`), rounding
stochastically, with a Kahan buffer, or to nearest. Every
``--print-every`` steps the training and validation losses are printed next to
each other, and at the end each model continues a few prompts.

``--monitor DIR`` runs the amp modes' steps under `jaxamp.monitoring.monitor` and records
their numerics every ``--monitor-every`` steps (`jaxamp.monitoring.MonitorRecorder`):
at the end each run's report (``DIR/<mode>.html`` and ``.png``: headroom and
underflow of every scope over the steps, worst first; ``<mode>-as-float16.png``
against float16's range) is written and the policy `jaxamp.monitoring.suggest_policy`
reads off the records is printed.
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
from benchmarks.optimizer_memory import PRECISIONS, clipped_adamw  # noqa: E402

MODES = {
    "float32": (None, "float32"),
    "amp bf16": ("bf16", "float32"),
    "amp f16": ("f16", "float32"),
    # Every size: this model's matmuls are all below the default's size rule
    # (keep_small_bf16), which would leave the fp8 modes as amp bf16.
    "amp fp8": (jaxamp.fp8.Fp8Recipe(keep_small_bf16=None), "float32"),
    "amp fp8 rowwise": (jaxamp.fp8.Fp8Recipe(scaling="rowwise", keep_small_bf16=None), "float32"),
    "amp fp8 mxfp8": (jaxamp.fp8.Fp8Recipe(scaling="mxfp8", keep_small_bf16=None), "float32"),
    "amp fp8 blockwise": (jaxamp.fp8.Fp8Recipe(scaling="blockwise", keep_small_bf16=None), "float32"),
    "amp fp8 delayed": (jaxamp.fp8.Fp8Recipe(scaling="delayed", keep_small_bf16=None), "float32"),
    "bf16 stochastic": ("bf16", "bf16 stochastic"),
    "bf16 kahan": ("bf16", "bf16 kahan"),
    "bf16 nearest": ("bf16", "bf16 nearest"),
}
"""Run name -> (amp compute dtype or None for no amp, storage: a `PRECISIONS` key)."""

DEFAULT_MODES = ("float32", "amp bf16")
REFERENCE = "amp bf16"
"""The run the bf16-storage runs are compared with: float32 storage, same compute."""

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


def is_delayed(compute_dtype) -> bool:
    """Whether `compute_dtype` is fp8's delayed recipe, whose amax histories the steps thread."""
    return isinstance(compute_dtype, jaxamp.fp8.Fp8Recipe) and compute_dtype.scaling == "delayed"


def make_train_step(compute_dtype, optimizer: optax.GradientTransformation, monitor: bool = False):
    """A jitted ``step(model, opt_state, fp8_state, tokens, targets) -> (model, opt_state, fp8_state, loss)``,
    and ``loss(model, tokens, targets, fp8_state)``.

    `fp8_state` is the delayed fp8 recipe's `jaxamp.fp8.Fp8State` (`init_state`),
    None in the other modes. With `monitor`, the step is `jaxamp.monitoring.monitor`'d:
    it returns ``((model, opt_state, fp8_state, loss), stats)``.
    """
    loss = lm_loss if compute_dtype is None else jaxamp.amp(lm_loss, compute_dtype=compute_dtype)

    def step(model, opt_state, fp8_state, tokens, targets):
        if compute_dtype == "f16":
            # The optimizer is wrapped in jaxamp.loss_scaling: its state holds
            # the loss scale, by which amp scales the float16 backward pass.
            scaled = jaxamp.amp(lm_loss, compute_dtype="f16", loss_scale=opt_state)
            value, grads = eqx.filter_value_and_grad(scaled)(model, tokens, targets)
        elif fp8_state is None:
            value, grads = eqx.filter_value_and_grad(loss)(model, tokens, targets)
        else:
            # The gradient with respect to the state is the step's amaxes.
            value, (grads, observed) = jax.value_and_grad(
                lambda m, s: loss(m, tokens, targets, fp8_state=s), argnums=(0, 1)
            )(model, fp8_state)
            fp8_state = fp8_state.update(observed)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        # optax's apply_updates casts back to each parameter's dtype (bf16 ones
        # stay bf16); equinox's would return float32. Every leaf of GPT is an array.
        return optax.apply_updates(model, updates), opt_state, fp8_state, value

    def evaluate(model, tokens, targets, fp8_state):
        return loss(model, tokens, targets) if fp8_state is None else loss(model, tokens, targets, fp8_state=fp8_state)

    return eqx.filter_jit(jaxamp.monitoring.monitor(step) if monitor else step), eqx.filter_jit(evaluate)


def init_state(compute_dtype, model: GPT, tokens, targets):
    """The delayed fp8 recipe's empty amax histories for `model`'s loss (None in other modes)."""
    if not is_delayed(compute_dtype):
        return None
    return jaxamp.fp8.init_fp8_state(jaxamp.amp(lm_loss, compute_dtype=compute_dtype), model, tokens, targets)


def generate(model: GPT, compute_dtype, prompts: tuple[str, ...], n_chars: int, key, fp8_state=None) -> list[str]:
    """Continue each prompt by `n_chars` bytes sampled at temperature 0.8.

    The model always sees a window of its full context length; positions after
    the last real byte are padding that, attention being causal, cannot affect
    the prediction. So one compiled function serves every position and prompt.
    """
    seq_len = model.pos.shape[0]

    @eqx.filter_jit
    def next_byte(model, window, position, key, fp8_state):
        forward = model if compute_dtype is None else jaxamp.amp(model, compute_dtype=compute_dtype)
        # The delayed recipe scales by the training's histories: the model's
        # matmuls are the loss's, in the same order.
        logits = forward(window[None]) if fp8_state is None else forward(window[None], fp8_state=fp8_state)
        logits = logits[0, position]
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
            out.append(int(next_byte(model, window, position, k, fp8_state)))
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
    ("--val-size", 64, "validation sequences (the same ones every evaluation)"),
    ("--seed", 0, "seed of initialisation, batches, sampling and stochastic rounding"),
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a small GPT-style byte-level language model on the Python "
        "standard library's source, in float32 and under jaxamp.amp bf16, and compare.",
    )
    for flag, default, meaning in _OPTIONS:
        parser.add_argument(flag, type=type(default), default=default, help=f"{meaning} (default: {default:g})")
    parser.add_argument(
        "--modes",
        type=_modes,
        default=DEFAULT_MODES,
        help=f"comma-separated runs, of: {', '.join(MODES)} (default: {','.join(DEFAULT_MODES)})",
    )
    parser.add_argument("--plot", type=Path, default=None, help="save the loss curves to this PNG")
    parser.add_argument(
        "--monitor",
        type=Path,
        default=None,
        help="monitor the amp runs' numerics (jaxamp.monitoring.monitor) and write each run's records "
        "(<mode>.jsonl), report (<mode>.html, <mode>.png) and suggested policy to this directory",
    )
    parser.add_argument(
        "--monitor-every", type=int, default=10, help="record the statistics every this many steps (default: 10)"
    )
    return parser.parse_args(argv)


def _modes(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(","))
    unknown = [name for name in names if name not in MODES]
    if unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"modes must be distinct names among {', '.join(MODES)}; got {text!r}")
    return names


def main(argv: list[str] | None = None) -> dict:
    """Train the runs of ``--modes``, print the comparison and samples; return the results.

    Returns:
        ``{"train_loss": {mode: [per step]}, "val_loss": {mode: [per print]},
        "val_steps": [step of each val_loss entry], "samples": {mode: [text per
        prompt]}, "step_seconds": {mode: mean}}``.
    """
    args = parse_args(argv)
    modes = {name: MODES[name] for name in args.modes}
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
    optimizer = clipped_adamw(schedule)
    runs = {}
    for name, (dtype, storage) in modes.items():
        precision = PRECISIONS[storage]
        # Every mode draws its stochastic rounding from the same seed.
        wrapped = precision.wrap(optimizer, jax.random.key(args.seed))
        if dtype == "f16":
            # float16's loss scale lives in the optimizer state (amp reads it).
            wrapped = jaxamp.loss_scaling(wrapped)
        model = jaxamp.policies.cast_floating(init, precision.param_dtype)
        monitored = args.monitor is not None and dtype is not None
        step, loss = make_train_step(dtype, wrapped, monitor=monitored)
        example = sample_batch(train_data, np.random.default_rng(0), args.batch_size, args.seq_len)
        runs[name] = {
            "model": model, "opt_state": wrapped.init(model), "step": step, "loss": loss,
            "fp8_state": init_state(dtype, model, *example),
        }  # fmt: skip
        if monitored:
            args.monitor.mkdir(parents=True, exist_ok=True)
            path = args.monitor / f"{_slug(name)}.jsonl"
            path.unlink(missing_ok=True)
            runs[name]["recorder"] = jaxamp.monitoring.MonitorRecorder(every=args.monitor_every, path=path)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(init))
    print(
        f"JAX {jax.__version__} on {jax.devices()[0].device_kind}; corpus {len(data):,} bytes of "
        f"stdlib source; model {n_params:,} parameters ({args.layers} layers, d={args.d_model})"
    )
    val_rng = np.random.default_rng(args.seed + 1)
    # Batches of 64 sequences (the first one is the whole default set).
    val_batches = [
        sample_batch(val_data, val_rng, min(64, args.val_size - start), args.seq_len)
        for start in range(0, args.val_size, 64)
    ]
    rng = np.random.default_rng(args.seed)
    train_loss = {name: [] for name in modes}
    val_loss = {name: [] for name in modes}
    seconds = {name: [] for name in modes}
    val_steps = []
    width = max(24, 2 + max(len(name) for name in modes) + len(" train/val"))
    header = "".join(f"{name + ' train/val':>{width}}" for name in modes)
    print(f"{'step':>6}{header}")
    for i in range(args.steps):
        tokens, targets = sample_batch(train_data, rng, args.batch_size, args.seq_len)
        for name, run in runs.items():
            start = time.perf_counter()
            out = jax.block_until_ready(run["step"](run["model"], run["opt_state"], run["fp8_state"], tokens, targets))
            if "recorder" in run:
                out, stats = out
                run["recorder"].record(i, stats)  # kept on device; read in batches
            run["model"], run["opt_state"], run["fp8_state"], loss = out
            if i:  # step 0 includes compilation
                seconds[name].append(time.perf_counter() - start)
            train_loss[name].append(float(loss))
        if (i + 1) % args.print_every == 0 or i + 1 == args.steps:
            val_steps.append(i + 1)
            cells = []
            for name, run in runs.items():
                losses = [float(run["loss"](run["model"], *batch, run["fp8_state"])) for batch in val_batches]
                weights = [len(batch[0]) for batch in val_batches]
                val_loss[name].append(float(np.average(losses, weights=weights)))
                recent = np.mean(train_loss[name][-args.print_every :])
                cells.append(f"{recent:>12.3f} / {val_loss[name][-1]:<8.3f}")
            print(f"{i + 1:>6}" + "".join(f"{c:>{width}}" for c in cells), flush=True)

    print("\nmean step time: " + ", ".join(f"{name} {1e3 * np.mean(s):.1f} ms" for name, s in seconds.items() if s))
    print(
        f"final validation loss after {args.steps} steps: "
        + ", ".join(
            f"{name} {losses[-1]:.4f}" + _gap(losses[-1], val_loss.get(REFERENCE), name)
            for name, losses in val_loss.items()
        )
    )
    if args.plot is not None:
        plot(train_loss, val_loss, val_steps, args.plot)
        print(f"loss curves saved to {args.plot}")
    monitored = {name: _report(name, run["recorder"], args.monitor) for name, run in runs.items() if "recorder" in run}
    samples = {}
    for name, (dtype, _) in modes.items():
        key = jax.random.key(args.seed)
        samples[name] = generate(runs[name]["model"], dtype, PROMPTS, args.sample_chars, key, runs[name]["fp8_state"])
        print(f"\n--- samples from {name} ---")
        for text in samples[name]:
            print(repr(text))
    return {
        "train_loss": train_loss,
        "val_loss": val_loss,
        "val_steps": val_steps,
        "samples": samples,
        "step_seconds": {name: float(np.mean(s)) if s else float("nan") for name, s in seconds.items()},
        "monitor": monitored,
    }


def _slug(name: str) -> str:
    return name.replace(" ", "_")


def _report(name: str, recorder: jaxamp.monitoring.MonitorRecorder, directory: Path) -> dict:
    """Write one monitored run's report; print its worst scopes and the suggested policy."""
    recorder.close()
    html = jaxamp.monitoring.monitor_report(recorder, directory / f"{_slug(name)}.html")
    png = jaxamp.monitoring.monitor_report(recorder, directory / f"{_slug(name)}.png")
    # bfloat16 and float8 have float32's range: what float16 would meet is the question.
    as_f16 = jaxamp.monitoring.monitor_report(recorder, directory / f"{_slug(name)}-as-float16.png", against="float16")
    _, scopes, _, _ = jaxamp.monitoring.summarize(recorder)
    suggestion = jaxamp.monitoring.suggest_policy(recorder)
    print(f"\n--- numerics of {name} (report: {html}, {png}, {as_f16}) ---")
    for s in scopes[:5]:
        print(
            f"{s.direction:>8} {s.scope:<28} least headroom {s.headroom_bits:6.2f} bits, "
            f"most underflow {100 * s.underflow:5.2f}%, inf/NaN {s.nonfinite:.0f} ({', '.join(s.dtypes)})"
        )
    print(suggestion)
    worst = [(s.direction, s.scope) for s in scopes[:5]]
    return {"html": html, "png": png, "as_float16": as_f16, "worst": worst, "suggestion": suggestion}


def _gap(value: float, reference: list[float] | None, name: str) -> str:
    if reference is None or name == REFERENCE:
        return ""
    return f" ({100 * (value / reference[-1] - 1):+.2f}% vs {REFERENCE})"


def plot(train_loss: dict, val_loss: dict, val_steps: list[int], path: Path) -> None:
    """Training (smoothed) and validation loss of every run, and the validation gap
    to the reference run when it ran, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reference = val_loss.get(REFERENCE)
    n_panels = 3 if reference is not None and len(val_loss) > 1 else 2
    fig, axes = plt.subplots(1, n_panels, figsize=(5.5 * n_panels, 4))
    ax_train, ax_val = axes[:2]
    for name, losses in train_loss.items():
        window = max(1, len(losses) // 30)
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        ax_train.plot(np.arange(window, len(losses) + 1), smooth, label=name)
        ax_val.plot(val_steps, val_loss[name], marker=".", label=name)
        if n_panels == 3:
            gap = 100 * (np.array(val_loss[name]) / np.array(reference) - 1)
            axes[2].plot(val_steps, gap, marker=".", label=name)
    ax_train.set(title=f"training loss (mean of {window} steps)", xlabel="step", ylabel="loss")
    ax_val.set(title="validation loss", xlabel="step", ylabel="loss")
    # The interesting part is the end; the first steps fall from ln 256 = 5.5.
    for ax, curves in ((ax_train, train_loss), (ax_val, val_loss)):
        tail = [v for losses in curves.values() for v in losses[len(losses) // 4 :]]
        if tail:
            ax.set_ylim(min(tail) - 0.05, max(tail) + 0.1)
    if n_panels == 3:
        axes[2].set(title=f"validation loss vs {REFERENCE}", xlabel="step", ylabel="difference (%)")
        axes[2].axhline(0, color="gray", lw=0.8)
    for ax in axes:
        ax.grid(alpha=0.3)
    ax_val.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
