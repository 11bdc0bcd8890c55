"""float16 training with loss scaling that survives being killed: Orbax checkpoints and resume.

    pip install -e ".[examples,checkpoint]"
    python examples/resumable_f16.py --checkpoint-dir /tmp/digits-ckpt [--steps 300]
    # killed (Ctrl-C, SIGKILL, a preempted node)? The same command with --resume
    python examples/resumable_f16.py --checkpoint-dir /tmp/digits-ckpt --resume

An MLP learns scikit-learn's 8x8 digits under ``jaxamp.amp(loss,
compute_dtype="f16")`` with jaxamp's dynamic loss scaler and
`jaxamp.scaling.skip_nonfinite_updates`. Every ``--poison-every``-th batch carries a NaN
pixel, so some steps are skipped (parameters, optimizer state and the data
order do not move; the scale shrinks once).

Every ``--checkpoint-every`` steps the whole train state (the model's arrays,
the optimizer state, the scaler state and the step number) is saved with
Orbax's `CheckpointManager` (asynchronously: training goes on while it is
written). ``--resume`` restores the latest complete checkpoint, and the run
continues as if it had never stopped: batches are drawn from the step number,
so the resumed run ends with the very bits an uninterrupted run ends with
(``tests/test_resume.py`` kills this script with SIGKILL and checks that).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import jaxamp


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--checkpoint-every", type=int, default=25)
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("--poison-every", type=int, default=37, help="a NaN pixel in every N-th batch")
    parser.add_argument("--dump", type=Path, default=None, help="save the final state's arrays (.npz)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def loss_fn(model: eqx.nn.MLP, images: jax.Array, labels: jax.Array) -> jax.Array:
    logits = jax.vmap(model)(images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def batch_for(step: int, images: np.ndarray, labels: np.ndarray, args: argparse.Namespace):
    """The batch of `step`, drawn from the step number: the same after a resume."""
    rng = np.random.default_rng([args.seed, step])
    index = rng.integers(0, len(images), args.batch_size)
    x, y = images[index].copy(), labels[index]
    if args.poison_every and step % args.poison_every == args.poison_every - 1:
        x[0, 0] = np.nan
    return jnp.asarray(x), jnp.asarray(y)


def main(argv: list[str] | None = None) -> dict:
    import orbax.checkpoint as ocp  # the `checkpoint` extra

    args = parse_args(argv)
    digits = load_digits()
    images = (digits.data / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int32)

    model = eqx.nn.MLP(64, 10, width_size=128, depth=2, key=jax.random.PRNGKey(args.seed))
    params, static = eqx.partition(model, eqx.is_array)  # Orbax saves the arrays
    optimizer = jaxamp.scaling.skip_nonfinite_updates(optax.adam(3e-3))
    grad_fn = jaxamp.dynamic_scale_value_and_grad(jaxamp.amp(loss_fn, compute_dtype="f16"))

    @jax.jit
    def train_step(state, images, labels):
        params, opt_state, scaler = state["params"], state["opt_state"], state["scaler"]
        model = eqx.combine(params, static)
        scaler, (loss, grads) = grad_fn(model, images, labels, dynamic_scaler_state=scaler)
        grads = eqx.filter(grads, eqx.is_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = jaxamp.scaling.apply_if_finite_updates(params, updates, opt_state.last_finite)
        return {"params": params, "opt_state": opt_state, "scaler": scaler}, loss

    state = {
        "params": params,
        "opt_state": optimizer.init(params),
        "scaler": jaxamp.DynamicScalerState(patience=20),
    }
    manager = ocp.CheckpointManager(
        args.checkpoint_dir.resolve(),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=args.checkpoint_every),
    )
    start = 0
    if args.resume and manager.latest_step() is not None:
        start = manager.latest_step()
        state = manager.restore(start, args=ocp.args.StandardRestore(state))
        print(f"resumed from step {start}", flush=True)

    skipped = 0
    for step in range(start, args.steps):
        state, loss = train_step(state, *batch_for(step, images, labels, args))
        finite = bool(state["opt_state"].last_finite)
        skipped += not finite
        print(
            f"step {step + 1} loss {float(loss):.4f} scale {float(state['scaler'].scaler):g}"
            + ("" if finite else " skipped"),
            flush=True,
        )
        # The checkpoint after step `step + 1` holds the state to start that step from.
        if manager.save(step + 1, args=ocp.args.StandardSave(state)):
            print(f"checkpoint {step + 1} started", flush=True)
    manager.wait_until_finished()
    manager.close()

    model = eqx.combine(state["params"], static)
    accuracy = float((jax.vmap(model)(jnp.asarray(images)).argmax(-1) == labels).mean())
    print(f"train accuracy {100 * accuracy:.2f}% after {args.steps} steps, {skipped} skipped since start", flush=True)
    if args.dump is not None:
        leaves = jax.tree_util.tree_leaves(state)
        np.savez(args.dump, *[np.asarray(leaf) for leaf in leaves])
    return {"state": state, "accuracy": accuracy, "skipped": skipped}


if __name__ == "__main__":
    main()
