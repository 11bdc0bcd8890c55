"""Tunix owns the loop: amp through its GRPO learner and its SFT PeftTrainer.

Tunix's rollout sampler keeps ``nnx.graphdef(model)`` and merges it inside its
own jitted prefill and decode steps, and scores the reference model in another
jitted function; `jaxamp.amp_module` must reach all of them, and
``trainer.with_loss_fn(jaxamp.amp(trainer.loss_fn, ...))`` must train, in
float16 too, its loss scale read live from the `jaxamp.loss_scaling`
optimizer handed to Tunix. The
models are Tunix's own test ToyTransformer, one layer, on its MockVocab.

Tolerances: the ToyTransformer's logits are O(1) and each matmul sums K <= 32
terms; measured in bfloat16 against float32, greedy sampled-token
log-probabilities differ by at most 0.0036 and SFT losses (about 3.0) by at
most 0.0013. Bounds: 0.1 and 0.02, loose because sampling and training
amplify differences over steps; the lower bound 1e-5 tells bfloat16 from float32.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("tunix")
nnx = pytest.importorskip("flax.nnx")

import jaxamp  # noqa: E402

from jaxpr_walk import assert_all_matmuls_in  # noqa: E402

tc = pytest.importorskip("tunix.tests.test_common")
from tunix.generate import sampler as sampler_lib  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner as grpo_lib  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402
from tunix.sft import peft_trainer  # noqa: E402

VOCAB = tc.MockVocab()
CONFIG = tc.ModelConfig(num_layers=1, vocab_size=VOCAB.GetPieceSize())
PROMPTS = np.array(["hello world", "My name"])
NEW_TOKENS = 4
CACHE = 16


def toy() -> nnx.Module:
    return tc.ToyTransformer(CONFIG, rngs=nnx.Rngs(0))


def params(model) -> list:
    return [jnp.copy(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def grpo(actor, reference, optimizer=None) -> tuple:
    """A GRPO learner on `actor` (sampled and trained) and `reference`, two steps of two prompts."""
    roles = (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT)
    # One device: Tunix reshards the models onto it (nnx.merge of their graph definitions).
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=auto, devices=jax.devices()[:1])
    config = rl_cluster_lib.ClusterConfig(
        role_to_mesh=dict.fromkeys(roles, mesh),
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optimizer or optax.sgd(1e-2), eval_every_n_steps=100, max_steps=2
        ),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=NEW_TOKENS, max_prompt_length=8, kv_cache_size=CACHE
        ),
    )
    cluster = rl_cluster_lib.RLCluster(actor=actor, reference=reference, tokenizer=VOCAB, cluster_config=config)

    def reward(prompts, completions, **kwargs):
        return [float(len(c)) for c in completions]

    learner = grpo_lib.GRPOLearner(
        rl_cluster=cluster, reward_fns=reward, algo_config=grpo_lib.GRPOConfig(num_generations=2, num_iterations=1)
    )
    return cluster, learner


def train_grpo(learner) -> None:
    learner.train([{"prompts": PROMPTS, "answer": PROMPTS}] * 2)


def assert_trained(cluster, before: list) -> None:
    assert cluster.actor_trainer.train_steps == 2
    losses = cluster.actor_trainer.metrics_logger.get_metric_history("actor", "loss", "train")
    assert len(losses) == 2 and np.all(np.isfinite(losses))
    after = params(cluster.actor_trainer.model)
    assert any(bool(jnp.any(a != b)) for a, b in zip(before, after))


def test_grpo_rollout_reference_and_trainer_under_amp_module():
    actor, reference = jaxamp.amp_module(toy(), toy(), compute_dtype="bf16")
    cluster, learner = grpo(actor, reference)
    # Tunix keeps and merges copies of the graph definition: each is the amp class.
    amp_class = type(actor)
    assert type(cluster.rollout.model()) is amp_class
    assert type(cluster.inference_worker.get_model("reference")) is amp_class
    assert type(cluster.actor_trainer.model) is amp_class

    # The rollout's and the reference's jitted scoring of sampled tokens: bf16 matmuls.
    prompt = jnp.array([[1, 5, 6], [1, 10, 11]])
    completion = jnp.array([[3, 4, 2, 0], [7, 8, 9, 2]])
    assert_all_matmuls_in(
        jax.make_jaxpr(lambda p, c: cluster.rollout.get_per_token_logps(p, c))(prompt, completion), jnp.bfloat16
    )
    reference_logps = cluster.inference_worker.get_ref_per_token_logps
    ref_jaxpr = jax.make_jaxpr(lambda p, c: reference_logps(p, c, pad_id=0, eos_id=2))
    assert_all_matmuls_in(ref_jaxpr(prompt, completion), jnp.bfloat16)

    before = params(actor)
    train_grpo(learner)
    assert_trained(cluster, before)


def test_sampler_decodes_under_amp_module():
    # The sampler's own jitted prefill/decode: its log-probabilities move off float32's by bf16 rounding.
    cache = sampler_lib.CacheConfig(cache_size=CACHE, num_layers=1, num_kv_heads=4, head_dim=16)

    def sample(model):
        out = sampler_lib.Sampler(model, VOCAB, cache)(list(PROMPTS), NEW_TOKENS, return_logprobs=True)
        return out.tokens, np.concatenate([np.asarray(lp) for lp in out.logprobs])

    tokens, logprobs = sample(jaxamp.amp_module(toy(), compute_dtype="bf16"))
    plain_tokens, plain_logprobs = sample(toy())
    assert [t.tolist() for t in tokens] == [t.tolist() for t in plain_tokens]  # greedy: same choices
    difference = np.max(np.abs(logprobs - plain_logprobs))
    assert 1e-5 < difference < 0.1, difference


def test_grpo_trainer_loss_under_amp():
    # The one line of docs/porting.md for the trainer alone; rollout and reference stay float32.
    actor = toy()
    cluster, learner = grpo(actor, toy())
    trainer = cluster.actor_trainer
    trainer.with_loss_fn(jaxamp.amp(trainer.loss_fn, compute_dtype="bf16"), has_aux=True)
    before = params(actor)
    train_grpo(learner)
    assert_trained(cluster, before)


def test_grpo_float16_with_the_live_loss_scale():
    # docs/porting.md's float16 lines: the scaled optimizer handed to Tunix, amp of its loss reading its scale.
    actor, reference = jaxamp.amp_module(toy(), toy(), compute_dtype="f16")
    tx = jaxamp.loss_scaling(optax.sgd(1e-2))
    cluster, learner = grpo(actor, reference, tx)
    trainer = cluster.actor_trainer
    trainer.with_loss_fn(jaxamp.amp(trainer.loss_fn, compute_dtype="f16", loss_scale=tx), has_aux=True)
    before = params(actor)
    train_grpo(learner)
    assert_trained(cluster, before)
    metrics = jaxamp.scaling.scale_metrics(trainer.optimizer.opt_state)
    assert float(metrics["loss_scale"]) == 2.0**15 and int(metrics["skipped_steps"]) == 0


def sft_batches(steps: int) -> list[dict]:
    tokens = jnp.array([[1, 7, 8, 9, 10, 11, 12, 2], [1, 5, 6, 9, 14, 15, 2, 0]])
    mask = tokens != 0
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    attention = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))[None] & mask[:, None, :]
    batch = dict(input_tokens=tokens, input_mask=mask, positions=positions, attention_mask=attention)
    return [batch] * steps


def sft_losses(model, amp_loss: bool = False) -> list:
    config = peft_trainer.TrainingConfig(eval_every_n_steps=100, max_steps=3)
    trainer = peft_trainer.PeftTrainer(model, optax.sgd(1e-1), config)
    if amp_loss:
        trainer.with_loss_fn(jaxamp.amp(trainer.loss_fn, compute_dtype="bf16"))
    trainer.train(sft_batches(3))
    return trainer.metrics_logger.get_metric_history("", "loss", "train")


def test_sft_peft_trainer_under_amp_module_and_amp_loss():
    plain = sft_losses(toy())
    assert len(plain) == 3 and plain[-1] < plain[0]
    for losses in (sft_losses(jaxamp.amp_module(toy(), compute_dtype="bf16")), sft_losses(toy(), amp_loss=True)):
        np.testing.assert_allclose(losses, plain, rtol=0, atol=0.02)
