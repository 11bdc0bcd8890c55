"""Tunix's DPO demo under amp: float32, bf16 and f16, and a step that overflows float16 once.

Tunix's DPO notebook (``examples/dpo_gemma.ipynb``) fine-tunes Gemma 3 with
qwix LoRA through Tunix's `DPOTrainer`: the policy is the LoRA model, the
reference the base model it was made from, the optimizer AdamW after gradient
clipping, on a ("fsdp", "tp") mesh. This is that script on a CPU: a tiny
random Gemma 3 of Tunix's own class (two layers, width 64, float32
parameters; its weights redrawn N(0, 1/fan-in), since Tunix's own
initialization, a placeholder for a checkpoint, zeroes the MLP), the
notebook's qwix LoRA on the same modules (rank 8, alpha 16), its beta,
clipping and AdamW betas and weight decay, and synthetic preference pairs
drawn from a fixed seed in place of its dataset: the chosen completion of a
prompt is the prompt's words reversed, the rejected one as many random
words. 80 steps of 8 pairs at a constant learning rate of 1e-3.
The precisions are docs/porting.md's port, each a line or two on the
float32 script:

* float32: Tunix's script, unedited;
* bf16: one line, ``jaxamp.amp_module(policy, reference, compute_dtype="bf16")``;
* f16: the optimizer handed to Tunix wrapped, ``optimizer =
  jaxamp.loss_scaling(optimizer)``, and the line with
  ``compute_dtype="f16", loss_scale=optimizer``.

At ``--spike_step`` the loss is multiplied by 1e4, that step alone (in every
precision): float16's scaled gradients overflow, so its update skips the step,
the LoRA parameters bit for bit unchanged and the scale halved, and training
goes on; float32 and bf16 apply it. Each precision prints its final DPO loss,
Tunix's reward accuracy (the fraction of pairs whose chosen completion the
policy rewards above the rejected one), whether the spike step moved the
parameters and, for f16, the final loss scale and the skipped steps; the last
line is ``RESULT <json>`` with all of it.

    python examples/tunix_dpo.py            # about 75 s on two CPU cores, most of it compiling
    python examples/tunix_dpo.py --quick    # the smoke test's run: one layer, 20 steps, the spike at step 10

Needs google-tunix and qwix (``pip install google-tunix qwix``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import qwix
from flax import nnx
from tunix.models.gemma3 import model as gemma3_lib
from tunix.sft import hooks
from tunix.sft.dpo.dpo_trainer import DPOTrainer, DPOTrainingConfig

import jaxamp

PAD, BOS, EOS = 0, 1, 2  # the other tokens are the words
CONFIG = gemma3_lib.ModelConfig(  # Gemma 3 1B's shape (4 query heads, 1 key/value head), scaled down
    num_layers=2,  # --layers replaces it
    num_embed=128,
    embed_dim=64,
    hidden_dim=256,
    num_heads=4,
    head_dim=16,
    num_kv_heads=1,
    sliding_window_size=16,  # the first layer's (local attention); no sequence here is longer
    param_dtype=jnp.float32,  # Tunix's default is bfloat16: a float32 baseline loads float32
)
# The notebook's LoRA targets and alpha; its rank, 32, would be half this model's width.
LORA = {"module_path": ".*q_einsum|.*kv_einsum|.*gate_proj|.*down_proj|.*up_proj|.*attn_vec_einsum"}
RANK, ALPHA = 8, 16.0
BETA = 0.1  # the notebook's DPO beta
MAX_GRAD_NORM = 0.1  # the notebook's clipping
SPIKE = 1e4  # multiplies the loss at --spike_step
PRECISIONS = ("float32", "bf16", "f16")


def preference_pairs(count: int, prompt_length: int, seed: int) -> dict[str, np.ndarray]:
    """`count` tokenized pairs: prompts left-padded, completions (then </s>) right-padded.

    A prompt is BOS and 2 to `prompt_length` - 1 random words; its chosen
    completion is those words reversed, its rejected one as many random words.
    """
    rng = np.random.default_rng(seed)
    response_length = prompt_length  # the words and </s>
    arrays = {name: np.zeros((count, length), np.int32) for name, length in (
        ("prompt_ids", prompt_length), ("chosen_ids", response_length), ("rejected_ids", response_length))}  # fmt: skip
    for i in range(count):
        words = rng.integers(EOS + 1, CONFIG.num_embed, rng.integers(2, prompt_length))
        arrays["prompt_ids"][i, prompt_length - len(words) - 1 :] = [BOS, *words]
        arrays["chosen_ids"][i, : len(words) + 1] = [*words[::-1], EOS]
        arrays["rejected_ids"][i, : len(words) + 1] = [*rng.integers(EOS + 1, CONFIG.num_embed, len(words)), EOS]
    for name in ("prompt", "chosen", "rejected"):
        arrays[f"{name}_mask"] = (arrays[f"{name}_ids"] != PAD).astype(np.int32)
    return arrays


def batches(pairs: dict[str, np.ndarray], batch: int, steps: int) -> list[dict[str, np.ndarray]]:
    """`steps` batches of `batch` pairs, going through the pairs in order, again and again."""
    count = len(pairs["prompt_ids"])
    out = []
    for step in range(steps):
        rows = [(step * batch + j) % count for j in range(batch)]
        out.append({name: array[rows] for name, array in pairs.items()})
    return out


class SpikeSnapshots(hooks.TrainingHooks):
    """The LoRA parameters and the loss scale as the spike step starts and as the step after it starts."""

    def __init__(self, spike_step: int, scaled: bool):
        self.spike_step, self.scaled = spike_step, scaled
        self.snapshots: dict[int, tuple[list[np.ndarray], tuple[float, int] | None]] = {}

    def on_train_step_start(self, trainer):
        # Called once the steps before this one were dispatched; reading waits for them.
        step = trainer.train_steps
        if step in (self.spike_step, self.spike_step + 1):
            # Copied to the host: Tunix's step donates the optimizer (with the model in it).
            lora = [np.array(x) for x in jax.tree.leaves(nnx.state(trainer.model, nnx.LoRAParam))]
            scale = None
            if self.scaled:
                metrics = jaxamp.scaling.scale_metrics(trainer.optimizer.opt_state)
                scale = (float(metrics["loss_scale"]), int(metrics["skipped_steps"]))
            self.snapshots[step] = (lora, scale)

    on_train_end = on_train_step_start  # the spike at the last step: its "after" is the end

    def _nothing(self, *args):
        pass

    on_train_start = on_train_step_end = on_eval_step_start = on_eval_step_end = _nothing


def random_gemma3(config: gemma3_lib.ModelConfig, seed: int) -> nnx.Module:
    """Tunix's Gemma 3, its weights redrawn: normal, standard deviation 1/sqrt(fan-in).

    Tunix's own initialization is a placeholder for a checkpoint's weights
    (the MLP's kernels zero, the rest N(0, 0.01)): on it the LoRA of a zero MLP
    gets zero gradients and the logits hardly move. The norms' scales stay 0
    (Gemma's RMSNorm multiplies by 1 + scale).
    """
    model = gemma3_lib.Gemma3(config, rngs=nnx.Rngs(seed))
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    key = jax.random.key(seed)
    redrawn = []
    for index, (path, weight) in enumerate(leaves):
        name = jax.tree_util.keystr(path)
        if weight.ndim >= 2:
            if "down_proj" in name:  # (hidden, embed)
                fan_in = weight.shape[0]
            elif "attn_vec_einsum" in name:  # (heads, head_dim, embed)
                fan_in = weight.shape[0] * weight.shape[1]
            else:  # the embedding table (its rows give unit-variance logits) and the projections from the embedding
                fan_in = config.embed_dim
            weight = jax.random.normal(jax.random.fold_in(key, index), weight.shape, weight.dtype) / np.sqrt(fan_in)
        redrawn.append(weight)
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, redrawn))
    return model


def shard(model: nnx.Module) -> None:
    """The notebook's placement of a model on the mesh in context, by its variables' partition specs."""
    state = nnx.state(model)
    nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))


def dpo(precision: str, data: list[dict], args: argparse.Namespace, config: gemma3_lib.ModelConfig) -> dict:
    """Tunix's DPO demo in `precision` on `data`: its losses, reward accuracy and the spike step's outcome."""
    mesh = jax.make_mesh(
        (1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=jax.devices()[:1]
    )
    with mesh:  # the notebook's form, which JAX now warns about: Tunix reads the mesh it sets
        return _dpo(precision, data, args, config)


def _dpo(precision: str, data: list[dict], args: argparse.Namespace, config: gemma3_lib.ModelConfig) -> dict:
    # The notebook's models: the base Gemma 3 is the reference, its qwix LoRA copy the policy.
    reference = random_gemma3(config, args.seed)
    shard(reference)
    provider = qwix.LoraProvider(**LORA, rank=RANK, alpha=ALPHA)
    policy = qwix.apply_lora_to_model(reference, provider, **reference.get_model_input(), rngs=nnx.Rngs(args.seed))
    shard(policy)
    # The notebook's optimizer at a constant learning rate: clipping, then AdamW.
    optimizer = optax.chain(
        optax.clip_by_global_norm(MAX_GRAD_NORM),
        optax.adamw(args.learning_rate, b1=0.9, b2=0.99, weight_decay=0.1),
    )
    if precision == "f16":
        optimizer = jaxamp.loss_scaling(optimizer)  # the optimizer line: Tunix gets the scaled optimizer
    if precision != "float32":
        # The amp line: the policy's forward and backward passes and the reference's scoring.
        # In float16 the module's amp scales the backward pass by the optimizer's live scale,
        # read inside Tunix's jitted train step.
        scale = {"loss_scale": optimizer} if precision == "f16" else {}
        jaxamp.amp_module(policy, reference, compute_dtype=precision, **scale)
    training_config = DPOTrainingConfig(beta=BETA, eval_every_n_steps=10**6, max_steps=args.steps)
    trainer = DPOTrainer(model=policy, ref_model=reference, optimizer=optimizer, training_config=training_config)

    # The injected overflow: Tunix's jitted step multiplies its loss by SPIKE on its
    # `spike_step`-th call. A counter in a jax.Ref the step closes over, advanced where
    # the step builds the loss's inputs (outside the differentiated loss).
    calls = jax.new_ref(jnp.int32(0))
    tunix_inputs, tunix_loss = trainer.gen_model_input_fn, trainer.loss_fn

    def inputs(example):
        call = calls[...]
        calls[...] = call + 1
        factor = jnp.where(call == args.spike_step, SPIKE, 1.0).astype(jnp.float32)
        return {**tunix_inputs(example), "factor": factor}

    def loss(model, train_example, algorithm, beta, label_smoothing, factor):
        value, aux = tunix_loss(model, train_example, algorithm, beta, label_smoothing=label_smoothing)
        return factor * value, aux

    trainer.with_loss_fn(loss, has_aux=True)
    trainer.with_gen_model_input_fn(inputs)
    snapshots = SpikeSnapshots(args.spike_step, scaled=precision == "f16")
    trainer.with_training_hooks(snapshots)

    start = time.perf_counter()
    with warnings.catch_warnings():
        # Tunix logs exp(loss) as the perplexity: at the spike step that is exp(about 7000).
        warnings.filterwarnings("ignore", "overflow encountered in exp", RuntimeWarning)
        trainer.train(data)
    seconds = time.perf_counter() - start
    assert trainer.train_steps == args.steps, trainer.train_steps

    history = trainer.metrics_logger.get_metric_history
    losses = [float(x) for x in history("", "loss", "train")]
    accuracy = [float(x) for x in history("", "rewards/accuracy", "train")]
    run = {"losses": losses, "final_loss": losses[-1], "reward_accuracy": accuracy[-1], "seconds": seconds}
    run["spike_loss"] = losses[args.spike_step] if args.spike_step < len(losses) else None
    if args.spike_step < args.steps:
        (before, scale_before), (after, scale_after) = (snapshots.snapshots[k] for k in sorted(snapshots.snapshots))
        run["spike_params_unchanged"] = all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
        if scale_before is not None:
            run["spike_scale_before"], run["spike_scale_after"] = scale_before[0], scale_after[0]
            run["spike_skipped"] = scale_after[1] == scale_before[1] + 1 and run["spike_params_unchanged"]
    if precision == "f16":
        metrics = jaxamp.scaling.scale_metrics(trainer.optimizer.opt_state)
        run["loss_scale"] = float(metrics["loss_scale"])
        run["skipped_steps"] = int(metrics["skipped_steps"])
    run["model_class"] = type(trainer.model).__name__
    return run


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="one layer, 20 steps, the spike at step 10 (the smoke test)"
    )
    parser.add_argument("--steps", type=int, default=80, help="DPO steps (the trainer's max_steps)")
    parser.add_argument("--spike_step", type=int, default=40, help="the step whose loss is multiplied by 1e4")
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--layers", type=int, default=CONFIG.num_layers, help="the Gemma 3's decoder layers")
    parser.add_argument("--pairs", type=int, default=64, help="synthetic preference pairs")
    parser.add_argument("--batch", type=int, default=8, help="pairs per step")
    parser.add_argument("--prompt_length", type=int, default=8, help="prompt tokens (padded); completions alike")
    parser.add_argument(
        "--precisions", default=",".join(PRECISIONS), help="comma-separated, of " + ",".join(PRECISIONS)
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        # Compiling is nearly all of the time: one layer (a sliding-window one, Gemma 3's first).
        args.steps, args.spike_step, args.layers = 20, 10, 1
    args.precisions = tuple(args.precisions.split(","))
    if set(args.precisions) - set(PRECISIONS):
        parser.error(f"--precisions takes {', '.join(PRECISIONS)}, got {args.precisions}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    config = dataclasses.replace(CONFIG, num_layers=args.layers)
    pairs = preference_pairs(args.pairs, args.prompt_length, args.seed)
    data = batches(pairs, args.batch, args.steps)
    configuration = {
        "model": (
            f"Gemma3 (tunix.models.gemma3), {config.num_layers} layers, width {CONFIG.embed_dim}, "
            f"MLP {CONFIG.hidden_dim}, {CONFIG.num_heads} heads x {CONFIG.head_dim} ({CONFIG.num_kv_heads} kv), "
            f"vocabulary {CONFIG.num_embed}, float32 parameters drawn N(0, 1/fan-in); qwix LoRA rank {RANK}, "
            f"alpha {ALPHA}"
        ),
        "pairs": args.pairs,
        "batch": args.batch,
        "prompt_length": args.prompt_length,
        "steps": args.steps,
        "learning_rate": args.learning_rate,
        "optimizer": f"clip_by_global_norm({MAX_GRAD_NORM}) + adamw(b1=0.9, b2=0.99, weight_decay=0.1)",
        "beta": BETA,
        "spike_step": args.spike_step,
        "spike_factor": SPIKE,
        "seed": args.seed,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
    }
    print("Tunix DPO (examples/dpo_gemma.ipynb) under amp")
    for key, value in configuration.items():
        print(f"  {key}: {value}")

    runs = {}
    for precision in args.precisions:
        run = runs[precision] = dpo(precision, data, args, config)
        line = (
            f"{precision:<8} final DPO loss {run['final_loss']:.4f} (step 0: {run['losses'][0]:.4f}), "
            f"reward accuracy {run['reward_accuracy']:.2f}"
        )
        if precision == "f16":
            line += f", loss scale {run['loss_scale']:g}, {run['skipped_steps']} skipped steps"
        if "spike_params_unchanged" in run:
            if run.get("spike_skipped"):
                line += (
                    f"; spike step {args.spike_step} skipped (parameters bit-identical across it, "
                    f"scale {run['spike_scale_before']:g} -> {run['spike_scale_after']:g})"
                )
            elif run["spike_params_unchanged"]:
                line += f"; spike step {args.spike_step}: parameters unchanged"
            else:
                line += f"; spike step {args.spike_step} applied (loss {run['spike_loss']:.4g})"
        line += f" [{run['seconds']:.1f} s]"
        print(line, flush=True)
    result = {
        "config": configuration,
        "runs": {p: {k: v for k, v in r.items() if k != "losses"} for p, r in runs.items()},
    }
    print("RESULT " + json.dumps(result))
    return {"config": configuration, "runs": runs}


if __name__ == "__main__":
    main()
