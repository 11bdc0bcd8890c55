"""Train a small CNN on scikit-learn's 8x8 digits four ways: float32, amp bf16, amp f16, amp fp8.

    pip install -e ".[examples]"
    python examples/digits_amp.py [--steps 600] [--out out/] [--seed 0]

The same model, data order and initialisation run

* in float32;
* under ``jaxamp.amp(loss, compute_dtype="bf16")``: matmuls and convolutions in
  bfloat16, the rest in the precision amp's policy picks;
* under ``jaxamp.amp(loss, compute_dtype="f16", loss_scale=opt_state)`` with
  dynamic loss scaling (the optimizer wrapped in `jaxamp.loss_scaling`, whose
  state holds the scale): float16's narrow range makes small
  gradients underflow to zero unless the loss is scaled up first. Steps whose
  gradients overflow are skipped and the scale halved (`DynamicScalerState`'s rules);
* under ``jaxamp.amp(loss, compute_dtype=Fp8Recipe(keep_small_bf16=None))``: bf16
  mode with float8 matmuls and convolutions (e4m3 operands scaled per tensor,
  e5m2 gradients; see docs/float8.md). ``compute_dtype="fp8"`` would keep all of
  this small network's matmuls in bf16, too small to gain on a GPU
  (`jaxamp.fp8.Fp8Recipe.keep_small_bf16`): the demo lets them in to show
  float8's accuracy. The first convolution sums only 1 x 3 x 3 = 9
  products per output and stays bf16 (`jaxamp.fp8.Fp8Recipe.min_contraction`), and
  so does the logits layer, the program's last matmul (as torchao and
  torchtitan keep the output projection; `Fp8Recipe.keep_last_matmul_bf16`).

Parameters and optimizer state stay float32 in every run. At the end it prints a
table (test accuracy, final loss, mean step time, skipped steps, final loss
scale), checks that every amp run is within one accuracy point of float32 with
no non-finite parameter, and saves loss curves and the loss-scale trajectory as a
PNG. The dataset ships with scikit-learn: nothing is downloaded.

On a CPU, half-precision steps are not faster (CPUs have no fast bf16/f16
matmuls) and float8 steps are slower (XLA emulates float8 matmuls there); the
speed-up needs a GPU or TPU (float8: an H100-class GPU). The accuracy
comparison holds anywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import jaxamp

# float8 at every size: this network's matmuls are all below the default's size rule.
FP8_EVERY_SIZE = jaxamp.fp8.Fp8Recipe(keep_small_bf16=None)
MODES = {"float32": None, "amp bf16": "bf16", "amp f16 + loss scaling": "f16", "amp fp8": FP8_EVERY_SIZE}
"""Run name -> amp compute dtype (None: no amp)."""

ACCURACY_TOLERANCE = 1.0  # percentage points an amp run may trail float32 by


class CNN(eqx.Module):
    """Two 3x3 convolutions, 2x2 max-pooling and a two-layer classifier head."""

    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    pool: eqx.nn.MaxPool2d
    hidden: eqx.nn.Linear
    logits: eqx.nn.Linear

    def __init__(self, *, key: PRNGKeyArray):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.conv1 = eqx.nn.Conv2d(1, 32, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(32, 64, 3, padding=1, key=k2)
        self.pool = eqx.nn.MaxPool2d(2, 2)
        self.hidden = eqx.nn.Linear(64 * 4 * 4, 128, key=k3)
        self.logits = eqx.nn.Linear(128, 10, key=k4)

    def __call__(self, image: Float[Array, "1 8 8"]) -> Float[Array, " 10"]:
        x = jax.nn.relu(self.conv1(image))
        x = self.pool(jax.nn.relu(self.conv2(x)))
        return self.logits(jax.nn.relu(self.hidden(x.reshape(-1))))


def loss_fn(model: CNN, images: Float[Array, "b 1 8 8"], labels: Int[Array, " b"]) -> Array:
    """Mean cross-entropy over a batch, written in plain float32 code."""
    logits = jax.vmap(model)(images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def load_data(seed: int):
    """The digits as float32 ``(n, 1, 8, 8)`` images in [0, 1], split 75/25."""
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None]
    return train_test_split(
        images,
        digits.target.astype(np.int32),
        test_size=0.25,
        random_state=seed,
        stratify=digits.target,
    )


def make_train_step(compute_dtype: str | None, optimizer: optax.GradientTransformation):
    """A jitted ``step(model, opt_state, images, labels)`` for one run.

    Returns ``(model, opt_state, loss)``. For float16, `optimizer` is wrapped
    in `jaxamp.loss_scaling` and its state holds the loss scale; the step is
    the bfloat16 one with ``loss_scale=opt_state`` added to `amp`.
    """

    @eqx.filter_jit
    def step(model, opt_state, images, labels):
        if compute_dtype is None:
            loss = loss_fn
        elif compute_dtype == "f16":
            # amp multiplies the loss's cotangent by the scale before the float16
            # backward pass and divides the gradients by it after (in float32),
            # so float16 gradients neither underflow nor, once the scale has
            # adapted, overflow. An overflowing step is skipped by the optimizer
            # wrapper (zero updates, its state as it was) and the scale halved.
            loss = jaxamp.amp(loss_fn, compute_dtype="f16", loss_scale=opt_state)
        else:
            loss = jaxamp.amp(loss_fn, compute_dtype=compute_dtype)
        value, grads = eqx.filter_value_and_grad(loss)(model, images, labels)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, value

    return step


@dataclasses.dataclass
class RunResult:
    """What one training run produced.

    Attributes:
        losses: training loss at every step.
        loss_scales: the loss scale used at every step (float16 run only).
        test_accuracy: percentage of test digits classified correctly.
        step_seconds: mean wall time of a step, compilation excluded.
        skipped_steps: steps skipped because their gradients were not finite.
        skipped_at: the indices of those steps.
        nonfinite_params: parameter values that are inf or NaN after training.
    """

    losses: list[float]
    loss_scales: list[float]
    test_accuracy: float
    step_seconds: float
    skipped_steps: int
    skipped_at: list[int]
    nonfinite_params: int

    @property
    def final_loss(self) -> float:
        """Mean training loss over the last 20 steps (one step alone is noisy)."""
        return float(np.mean(self.losses[-20:]))


def train(name: str, data, *, steps: int, batch_size: int, lr: float, seed: int, patience: int) -> RunResult:
    """Train a fresh `CNN` in one mode of `MODES` and evaluate it on the test set.

    `patience` is the float16 run's number of finite steps before the loss scale
    doubles.
    """
    compute_dtype = MODES[name]
    x_train, x_test, y_train, y_test = data
    model = CNN(key=jax.random.key(seed))
    optimizer = optax.adam(lr)
    scaled = compute_dtype == "f16"
    if scaled:
        optimizer = jaxamp.loss_scaling(optimizer, patience=patience)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    step = make_train_step(compute_dtype, optimizer)

    # Same batches in the same order for every mode: only precision differs.
    batches = np.random.default_rng(seed)
    losses, scales, times, skipped_at = [], [], [], []
    for i in tqdm(range(steps), desc=f"{name:>22}", unit="step", leave=True):
        idx = batches.choice(len(x_train), batch_size, replace=False)
        if scaled:
            scales.append(float(opt_state.scale))
        start = time.perf_counter()
        model, opt_state, loss = jax.block_until_ready(step(model, opt_state, x_train[idx], y_train[idx]))
        if i:  # step 0 includes compilation
            times.append(time.perf_counter() - start)
        losses.append(float(loss))
        if scaled and not bool(opt_state.last_finite):
            skipped_at.append(i)

    forward = jax.vmap(model)
    if compute_dtype is not None:
        # Evaluate the way the model was trained.
        forward = jaxamp.amp(forward, compute_dtype=compute_dtype)
    predictions = jnp.argmax(jax.jit(forward)(x_test), axis=-1)
    params = jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))
    return RunResult(
        losses=losses,
        loss_scales=scales,
        test_accuracy=100.0 * float(jnp.mean(predictions == y_test)),
        step_seconds=float(np.mean(times)) if times else math.nan,
        skipped_steps=int(opt_state.scaler_state.total_resets) if scaled else 0,
        skipped_at=skipped_at,
        nonfinite_params=int(sum(jnp.sum(~jnp.isfinite(p)) for p in params)),
    )


def print_table(results: dict[str, RunResult]) -> None:
    header = f"{'run':<24}{'test acc':>9}{'final loss':>12}{'step (ms)':>11}{'skipped':>9}{'loss scale':>12}"
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        scale = f"{r.loss_scales[-1]:.0f}" if r.loss_scales else "-"
        print(
            f"{name:<24}{r.test_accuracy:>8.2f}%{r.final_loss:>12.4f}"
            f"{1e3 * r.step_seconds:>11.2f}{r.skipped_steps:>9d}{scale:>12}"
        )


def plot(results: dict[str, RunResult], path: Path) -> None:
    """Loss curves of every run and the float16 run's loss scale, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_scale) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        ax_loss.plot(r.losses, label=name, linewidth=1, alpha=0.8)
        if r.loss_scales:
            ax_scale.plot(r.loss_scales, label=name, color="tab:green")
            ax_scale.scatter(
                r.skipped_at,
                [r.loss_scales[i] for i in r.skipped_at],
                color="tab:red",
                marker="x",
                label="skipped (non-finite) step",
                zorder=3,
            )
    ax_loss.set(xlabel="step", ylabel="training loss", yscale="log", title="loss")
    ax_loss.legend()
    ax_scale.set(xlabel="step", ylabel="loss scale", yscale="log", title="dynamic loss scale (f16)")
    ax_scale.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a small CNN on scikit-learn's digits in float32, amp bf16, "
        "amp f16 with dynamic loss scaling and amp fp8, then compare accuracy, loss and speed.",
    )
    add = parser.add_argument
    add("--steps", type=int, default=600, help="training steps per run (default: 600)")
    add("--batch-size", type=int, default=64, help="examples per step (default: 64)")
    add("--lr", type=float, default=1e-3, help="Adam learning rate (default: 1e-3)")
    add("--seed", type=int, default=0, help="seed of the data split, initialisation and batches")
    add(
        "--patience",
        type=int,
        default=100,
        help="finite f16 steps before the loss scale doubles (default: 100, so that a short "
        "run shows the scale adapting; jaxamp's default is 2000)",
    )
    add("--out", type=Path, default=Path("out"), help="directory for the PNG (default: out/)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run every mode of `MODES`; return the results as a dict.

    Returns:
        ``{"runs": {name: RunResult}, "plot": Path, "checks": {name: bool}}``;
        the checks are that each amp run is within `ACCURACY_TOLERANCE` points
        of float32's test accuracy.

    Raises:
        AssertionError: if any run ends with a non-finite parameter.
    """
    args = parse_args(argv)
    data = load_data(args.seed)
    print(
        f"JAX {jax.__version__} on {jax.devices()[0].device_kind}; {len(data[0])} training "
        f"and {len(data[1])} test digits, {args.steps} steps of {args.batch_size}"
    )
    runs = {
        name: train(
            name,
            data,
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            seed=args.seed,
            patience=args.patience,
        )
        for name in MODES
    }
    print()
    print_table(runs)

    for name, r in runs.items():
        if r.nonfinite_params:  # not an `assert`: it must hold under `python -O` too
            raise AssertionError(f"{name}: {r.nonfinite_params} non-finite parameters")
    print("\nnon-finite parameters: 0 in every run")
    reference = runs["float32"].test_accuracy
    checks = {}
    for name, r in runs.items():
        if name != "float32":
            checks[name] = r.test_accuracy >= reference - ACCURACY_TOLERANCE
            verdict = "ok" if checks[name] else "MISSED"
            print(
                f"{name}: test accuracy {r.test_accuracy - reference:+.2f} points vs float32 "
                f"(at most {ACCURACY_TOLERANCE} below: {verdict})"
            )

    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / "digits_amp.png"
    plot(runs, png)
    print(f"\nplot: {png}")
    return {"runs": runs, "plot": png, "checks": checks}


if __name__ == "__main__":
    outcome = main()
    raise SystemExit(0 if all(outcome["checks"].values()) else 1)
