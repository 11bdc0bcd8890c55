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
    and amp f16, reward = correct sum: mean reward per step and wall time per
    step. Each is docs/porting.md's port: bf16 is one line,
    ``jaxamp.amp_module(actor, reference, compute_dtype="bf16")``; f16 is two,
    the optimizer handed to Tunix wrapped in `jaxamp.loss_scaling` and
    ``amp_module(..., compute_dtype="f16", loss_scale=optimizer)``.

    python examples/tunix_grpo.py            # a few minutes on a laptop CPU
    python examples/tunix_grpo.py --quick    # the smoke test's run: f16 only, one layer, untrained

Needs google-tunix (``pip install google-tunix``).
"""

from __future__ import annotations

import argparse
import dataclasses
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
CONFIG = qwen2.ModelConfig(  # --layers replaces num_layers
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


def new_model(config: qwen2.ModelConfig, state=None) -> nnx.Module:
    model = qwen2.Qwen2(config, rngs=nnx.Rngs(0))
    if state is not None:
        nnx.update(model, state)
    return model


def prompt(a: int, b: int) -> str:
    return f"{a} + {b} ="


def supervised_warmup(config: qwen2.ModelConfig, steps: int) -> nnx.State:
    """A few float32 steps on "<s> a + b = c </s>": the checkpoint both parts start from."""
    model = new_model(config)
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


def mismatch(
    config: qwen2.ModelConfig, state: nnx.State, prompts: list[str], seed: int, dtypes: tuple[str, ...]
) -> tuple[dict, dict]:
    """Per setting: mean |log p_sampler - log p_trainer| per sampled token, and the completions drawn.

    The settings: float32, and for each of `dtypes` amp on the trainer's side
    only and on both. The sampler's log-probabilities are those it drew each
    token with (prefill, then KV-cache decode steps); the trainer's, of the
    same tokens, come from one forward pass over prompt and completion, as in
    the GRPO loss.
    """
    settings = {"float32 everywhere": (None, None)}
    for dtype in dtypes:
        settings[f"amp {dtype} trainer only"] = (None, dtype)
        settings[f"amp {dtype} both sides"] = (dtype, dtype)
    cache = sampler_lib.CacheConfig(cache_size=CACHE, num_layers=config.num_layers, num_kv_heads=2, head_dim=16)
    samples = {}  # sampler dtype -> (model, prompt tokens, completion tokens, their log-probabilities)
    for dtype in dict.fromkeys(sampler for sampler, _ in settings.values()):
        model = new_model(config, state)
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


def grpo(config: qwen2.ModelConfig, state: nnx.State, precision: str, steps: int, batch: int, seed: int) -> dict:
    """Tunix's GRPO learner from `state`; rewards and seconds per step."""
    actor, reference = new_model(config, state), new_model(config, state)
    optimizer = optax.adam(LEARNING_RATE)
    if precision == "f16":
        optimizer = jaxamp.loss_scaling(optimizer)  # the optimizer line: Tunix gets the scaled optimizer
    if precision != "float32":
        # The rollout line: Tunix's sampler, its reference scoring and its trainer all call
        # these modules (copies of them). In float16 their amp scales the backward pass by
        # the optimizer's live scale, read inside Tunix's jitted train step.
        scale = {"loss_scale": optimizer} if precision == "f16" else {}
        jaxamp.amp_module(actor, reference, compute_dtype=precision, **scale)
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
    parser.add_argument("--quick", action="store_true", help="f16 only, one layer, two steps (the smoke test)")
    parser.add_argument("--layers", type=int, default=CONFIG.num_layers, help="the Qwen2's decoder layers")
    parser.add_argument("--warmup-steps", type=int, default=60)
    parser.add_argument("--grpo-steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16, help="prompts per GRPO step (4 completions each)")
    parser.add_argument(
        "--precisions", default="float32,bf16,f16", help="GRPO runs, and the table's amp rows, comma-separated"
    )
    parser.add_argument("--table-prompts", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        # Compiling is nearly all of the time: one layer, no warm-up (its step would compile),
        # the table's f16 rows only and one GRPO run, f16, the one with the most parts.
        args.warmup_steps, args.grpo_steps, args.batch, args.table_prompts = 0, 2, 2, 8
        args.layers, args.precisions = 1, "f16"
    args.precisions = tuple(args.precisions.split(","))
    if set(args.precisions) - {"float32", "bf16", "f16"}:
        parser.error(f"--precisions takes float32, bf16 and f16, got {args.precisions}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    config = dataclasses.replace(CONFIG, num_layers=args.layers)
    state = supervised_warmup(config, args.warmup_steps)

    rng = random.Random(args.seed)
    prompts = [prompt(*rng.choice(PAIRS)) for _ in range(args.table_prompts)]
    amp_dtypes = tuple(p for p in args.precisions if p != "float32")
    gaps, agreement = mismatch(config, state, prompts, args.seed, amp_dtypes)
    print(
        f"(a) sampler/trainer mismatch after {args.warmup_steps} supervised steps, {len(prompts)} prompts, "
        "temperature 1"
    )
    print(f"    {'setting':<24}{'mean |dlogp| per token':>24}{'same completions as f32':>26}")
    for name in gaps:
        print(f"    {name:<24}{gaps[name]:>24.3e}{agreement[name]:>26.1%}")
    ratios = {}  # of the f16 both-sides gap, to float32's and to bf16's
    if "amp f16 both sides" in gaps:
        ratios["f16_over_f32"] = gaps["amp f16 both sides"] / gaps["float32 everywhere"]
        line = f"    f16 both sides / float32: {ratios['f16_over_f32']:.2f}x"
        if "amp bf16 both sides" in gaps:
            ratios["f16_over_bf16"] = gaps["amp f16 both sides"] / gaps["amp bf16 both sides"]
            line += f"; f16 both sides / bf16 both sides: {ratios['f16_over_bf16']:.3f}"
        print(line)

    runs = {p: grpo(config, state, p, args.grpo_steps, args.batch, args.seed) for p in args.precisions}
    print(f"(b) GRPO, {args.grpo_steps} steps of {args.batch} prompts x 4 completions: mean reward per step")
    for precision, run in runs.items():
        curve = " ".join(f"{r:.2f}" for r in run["rewards"])
        extra = ""
        if "loss_scale" in run:
            extra = f", loss scale {run['loss_scale']:g}, {run['skipped_steps']} skipped"
        tenth = max(1, len(run["rewards"]) // 10)
        first, last = np.mean(run["rewards"][:tenth]), np.mean(run["rewards"][-tenth:])
        timing = f"{run['seconds_per_step']:.3f} s/step (median), {run['seconds_total']:.1f} s in all"
        print(f"    {precision:<8} {timing}{extra}")
        print(f"             first/last tenth {first:.2f} -> {last:.2f}: {curve}")
    return {"gaps": gaps, "agreement": agreement, "runs": runs, **ratios}


if __name__ == "__main__":
    main()
