"""GRPO in Tunix under amp: the sampler/trainer mismatch, and training, in float32, bf16 and f16.

RL fine-tuning samples with one program (Tunix's jitted prefill and KV-cache
decode) and trains on another (a full forward pass in the trainer's loss). In
low precision the two round differently, so the trainer's log-probabilities
of the sampled tokens drift from the sampler's, and more so in bfloat16 than
in float16 (arXiv 2510.26788). Amp'ing only the trainer's loss adds a
mismatch of its own, the sampler staying in float32: `jaxamp.amp_module` puts
the model itself, in every copy Tunix makes, under the same policy.

A tiny Qwen2 (Tunix's own model class, two layers, width 32) learns single
digit sums ("3 + 4 =" -> "7") by a few supervised steps, then:

(a) at that checkpoint, for each precision setting, the mean absolute
    difference per sampled token between the sampler's log-probability and
    the trainer's (same tokens: the ones this sampler drew), and the fraction
    of completions identical to float32's under the same seed;
(b) GRPO through Tunix's learner from that checkpoint in float32, amp bf16
    and amp f16 (with `jaxamp.loss_scaling`), reward = correct sum: mean
    reward per step and wall time per step.

    python examples/tunix_grpo.py            # a few minutes on a laptop CPU
    python examples/tunix_grpo.py --quick    # seconds: the smoke test's run

Needs google-tunix (``pip install google-tunix``).
"""

from __future__ import annotations

import argparse
import random
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tunix.generate import sampler as sampler_lib
from tunix.models.qwen2 import model as qwen2
from tunix.rl import common
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout
from tunix.tests.test_common import MockVocab

import jaxamp

WORDS = ["<pad>", "<s>", "</s>", *map(str, range(10)), "+", "="]
VOCAB = MockVocab({word: i for i, word in enumerate(WORDS)})
PAD, EOS = 0, 2
CONFIG = qwen2.ModelConfig(
    num_layers=2,
    vocab_size=len(WORDS),
    embed_dim=32,
    hidden_dim=64,
    num_heads=2,
    head_dim=16,
    num_kv_heads=2,
    rope_theta=10_000,
    norm_eps=1e-6,
)
NEW_TOKENS = 4  # the answer, then </s>; an untrained model rambles up to here
PROMPT_LENGTH = 8  # "<s> a + b =" is 5 tokens, left-padded to 8
CACHE = 16
LEARNING_RATE = 2e-3
PAIRS = [(a, b) for a in range(10) for b in range(10) if a + b <= 9]  # one-digit answers


def new_model(state=None) -> nnx.Module:
    model = qwen2.Qwen2(CONFIG, rngs=nnx.Rngs(0))
    if state is not None:
        nnx.update(model, state)
    return model


def prompt(a: int, b: int) -> str:
    return f"{a} + {b} ="


def supervised_warmup(steps: int) -> nnx.State:
    """A few float32 steps on "<s> a + b = c </s>": the checkpoint both parts start from."""
    model = new_model()
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    rows = [[1, 3 + a, 13, 3 + b, 14, 3 + a + b, EOS] for a, b in PAIRS]
    tokens = jnp.array(rows)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    causal = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))[None].repeat(len(rows), 0)

    @nnx.jit
    def step(model, optimizer):
        def loss(model):
            logits, _ = model(tokens, positions, None, causal)
            logp = jax.nn.log_softmax(logits[:, 4:6])  # predicting the answer and </s>
            return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 5:7, None], -1))

        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    for _ in range(steps):
        step(model, optimizer)
    return nnx.state(model)


# --- (a) the mismatch table --------------------------------------------------------------


def trainer_logps(model, prompt_tokens, completion_tokens):
    """Log-probabilities of the completions as the GRPO loss computes them: one full forward pass."""
    graphdef, state = nnx.split(model)
    return common.compute_per_token_logps(graphdef, state, prompt_tokens, completion_tokens, pad_id=PAD, eos_id=EOS)


def mismatch(state: nnx.State, prompts: list[str], seed: int) -> tuple[dict, dict]:
    """Per setting: mean |log p_sampler - log p_trainer| per sampled token, and the completions drawn.

    The sampler's log-probabilities are those it drew each token with (prefill,
    then KV-cache decode steps); the trainer's, of the same tokens, come from one
    forward pass over prompt and completion, as in the GRPO loss.
    """
    settings = {
        "float32 everywhere": (None, None),
        "amp bf16 trainer only": (None, "bf16"),
        "amp bf16 both sides": ("bf16", "bf16"),
        "amp f16 trainer only": (None, "f16"),
        "amp f16 both sides": ("f16", "f16"),
    }
    cache = sampler_lib.CacheConfig(cache_size=CACHE, num_layers=CONFIG.num_layers, num_kv_heads=2, head_dim=16)
    samples = {}  # sampler dtype -> (model, prompt tokens, completion tokens, their log-probabilities)
    for dtype in dict.fromkeys(sampler for sampler, _ in settings.values()):
        model = new_model(state)
        if dtype is not None:
            jaxamp.amp_module(model, compute_dtype=dtype)  # the rollout line: the model Tunix samples
        out = sampler_lib.Sampler(model, VOCAB, cache)(
            prompts,
            NEW_TOKENS,
            max_prompt_length=PROMPT_LENGTH,
            temperature=1.0,
            top_p=1.0,
            seed=seed,
            return_logprobs=True,
            eos_tokens=[len(WORDS)],  # no token stops a completion early: NEW_TOKENS tokens each
        )
        completion = np.full((len(prompts), NEW_TOKENS), PAD, np.int32)
        sampled = np.zeros(completion.shape, np.float32)
        for i, (tokens, logps) in enumerate(zip(out.tokens, out.logprobs)):
            completion[i, : len(tokens)] = tokens
            sampled[i, : len(tokens)] = logps
        samples[dtype] = (model, np.asarray(out.padded_prompt_tokens), completion, sampled)
    gaps, completions = {}, {}
    for name, (sampler_dtype, trainer_dtype) in settings.items():
        model, prompt_tokens, completion, sampled = samples[sampler_dtype]
        logps_fn = trainer_logps if trainer_dtype is None else jaxamp.amp(trainer_logps, compute_dtype=trainer_dtype)
        trained = np.asarray(jax.jit(logps_fn)(model, jnp.asarray(prompt_tokens), jnp.asarray(completion)))
        # Tokens up to a sampled <pad>: the trainer's pass takes that for padding (other
        # positions, a masked token), as Tunix's GRPO loss does.
        mask = np.cumprod(completion != PAD, axis=1).astype(bool)
        gaps[name] = float(np.abs(sampled - trained)[mask].mean())
        completions[name] = [tuple(row) for row in completion.tolist()]
    reference = completions["float32 everywhere"]
    agreement = {name: float(np.mean([a == b for a, b in zip(c, reference)])) for name, c in completions.items()}
    return gaps, agreement


# --- (b) GRPO through Tunix --------------------------------------------------------------


def grpo(state: nnx.State, precision: str, steps: int, batch: int, seed: int) -> dict:
    """Tunix's GRPO learner from `state`; rewards and seconds per step."""
    actor, reference = new_model(state), new_model(state)
    optimizer = optax.adam(LEARNING_RATE)
    if precision != "float32":
        jaxamp.amp_module(actor, reference, compute_dtype=precision)  # rollout, reference and trainer's model
    if precision == "f16":
        optimizer = jaxamp.loss_scaling(optimizer)
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    roles = (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT)
    cluster = rl_cluster_lib.RLCluster(
        actor=actor,
        reference=reference,
        tokenizer=VOCAB,
        cluster_config=rl_cluster_lib.ClusterConfig(
            role_to_mesh=dict.fromkeys(roles, mesh),
            rollout_engine="vanilla",
            offload_to_cpu=False,
            training_config=rl_cluster_lib.RLTrainingConfig(
                actor_optimizer=optimizer, eval_every_n_steps=10**6, max_steps=steps
            ),
            rollout_config=base_rollout.RolloutConfig(
                max_tokens_to_generate=NEW_TOKENS,
                max_prompt_length=PROMPT_LENGTH,
                kv_cache_size=CACHE,
                temperature=1.0,
            ),
        ),
    )
    rewards, stamps = [], []

    def reward(prompts, completions, answer, **kwargs):
        stamps.append(time.perf_counter())
        scores = [float(c.strip() == a) for c, a in zip(completions, answer)]
        rewards.append(float(np.mean(scores)))
        return scores

    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, reward_fns=reward, algo_config=grpo_learner.GRPOConfig(num_generations=4)
    )
    trainer = cluster.actor_trainer
    if precision == "bf16":
        trainer.with_loss_fn(jaxamp.amp(trainer.loss_fn, compute_dtype="bf16"), has_aux=True)
    elif precision == "f16":
        trainer.with_loss_fn(jaxamp.amp(trainer.loss_fn, compute_dtype="f16", loss_scale=optimizer), has_aux=True)
    rng = random.Random(seed)
    data = []
    for _ in range(steps):
        pairs = rng.sample(PAIRS, batch)
        data.append(
            {
                "prompts": np.array([prompt(a, b) for a, b in pairs]),
                "answer": np.array([str(a + b) for a, b in pairs]),
            }
        )
    start = time.perf_counter()
    learner.train(data)
    total = time.perf_counter() - start
    # Between two reward calls lies one whole step (Tunix's loop samples, then trains, in
    # turn); the median leaves out the first steps, which compile.
    intervals = np.diff(stamps)
    run = {"rewards": rewards, "seconds_total": total}
    run["seconds_per_step"] = float(np.median(intervals)) if len(intervals) else float("nan")
    if precision == "f16":
        metrics = jaxamp.scaling.scale_metrics(trainer.optimizer.opt_state)
        run["loss_scale"] = float(metrics["loss_scale"])
        run["skipped_steps"] = int(metrics["skipped_steps"])
    cluster.close()
    return run


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps of everything (the smoke test)")
    parser.add_argument("--warmup-steps", type=int, default=60)
    parser.add_argument("--grpo-steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16, help="prompts per GRPO step (4 completions each)")
    parser.add_argument("--precisions", default="float32,bf16,f16", help="GRPO runs, comma-separated")
    parser.add_argument("--table-prompts", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup_steps, args.grpo_steps, args.batch, args.table_prompts = 5, 2, 2, 8
        args.precisions = "f16"  # the run with the most parts (loss scaling); compiling is most of the time
    args.precisions = tuple(args.precisions.split(","))
    if set(args.precisions) - {"float32", "bf16", "f16"}:
        parser.error(f"--precisions takes float32, bf16 and f16, got {args.precisions}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    state = supervised_warmup(args.warmup_steps)

    rng = random.Random(args.seed)
    prompts = [prompt(*rng.choice(PAIRS)) for _ in range(args.table_prompts)]
    gaps, agreement = mismatch(state, prompts, args.seed)
    print(f"(a) sampler/trainer mismatch at the warm-up checkpoint, {len(prompts)} prompts, temperature 1")
    print(f"    {'setting':<24}{'mean |dlogp| per token':>24}{'same completions as f32':>26}")
    for name in gaps:
        print(f"    {name:<24}{gaps[name]:>24.3e}{agreement[name]:>26.1%}")
    f16, bf16, f32 = gaps["amp f16 both sides"], gaps["amp bf16 both sides"], gaps["float32 everywhere"]
    print(f"    f16 both sides / float32: {f16 / f32:.2f}x; f16 both sides / bf16 both sides: {f16 / bf16:.3f}")

    runs = {p: grpo(state, p, args.grpo_steps, args.batch, args.seed) for p in args.precisions}
    print(f"(b) GRPO, {args.grpo_steps} steps of {args.batch} prompts x 4 completions: mean reward per step")
    for precision, run in runs.items():
        curve = " ".join(f"{r:.2f}" for r in run["rewards"])
        extra = ""
        if "loss_scale" in run:
            extra = f", loss scale {run['loss_scale']:g}, {run['skipped_steps']} skipped"
        tenth = max(1, len(run["rewards"]) // 10)
        first, last = np.mean(run["rewards"][:tenth]), np.mean(run["rewards"][-tenth:])
        print(f"    {precision:<8} {run['seconds_per_step']:.3f} s/step (median){extra}")
        print(f"             first/last tenth {first:.2f} -> {last:.2f}: {curve}")
    return {"gaps": gaps, "agreement": agreement, "runs": runs, "f16_over_f32": f16 / f32, "f16_over_bf16": f16 / bf16}


if __name__ == "__main__":
    main()
