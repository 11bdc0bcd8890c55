"""Tunix owns the loop: amp through its GRPO learner and its SFT PeftTrainer.

Tunix's rollout sampler keeps ``nnx.graphdef(model)`` and merges it inside its
own jitted prefill and decode steps, and scores the reference model in another
jitted function; `jaxamp.amp_module` must reach all of them, and
``trainer.with_loss_fn(jaxamp.amp(trainer.loss_fn, ...))`` must train. In
float16, the two lines of docs/porting.md: the `jaxamp.loss_scaling`
optimizer handed to Tunix, and ``amp_module(..., loss_scale=optimizer)``
(or the amp'd loss given it), whose amp reads its live scale inside Tunix's
jitted step. An overflow injected into one step (a loss multiplied by 1e9 on
that step alone) must skip it, parameters and Tunix's optimizer state bit for
bit, halve the scale, and leave the steps after it training, also where Tunix
wraps the optimizer in ``optax.MultiSteps`` for micro-batches; Tunix's Orbax
checkpoint must restore the scale. The models are Tunix's own test
ToyTransformer, one layer, on its MockVocab: the file runs in about a minute on
two CPU cores, most of it compiling Tunix's steps.

Tolerances: the ToyTransformer's logits are O(1) and each matmul sums K <= 32
terms; measured in bfloat16 against float32, greedy sampled-token
log-probabilities differ by at most 0.0036 and SFT losses (about 3.0) by at
most 0.0013. Bounds: 0.1 and 0.02, loose because sampling and training
amplify differences over steps; the lower bound 1e-5 tells bfloat16 from float32.
"""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

pytest.importorskip("tunix")
ocp = pytest.importorskip("orbax.checkpoint")
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
# Multiplies the loss of the step meant to overflow: at the scales the tests
# reach (2**14, 2**15) any logit gradient above 2e-9 then passes float16's 65504.
OVERFLOW = 1e9


# Tunix calls gc.collect() as it builds an RL cluster, reshards a model or makes a learner.
pytestmark = pytest.mark.usefixtures("earlier_objects_frozen")


def toy() -> nnx.Module:
    return tc.ToyTransformer(CONFIG, rngs=nnx.Rngs(0))


def params(model) -> list:
    return [jnp.copy(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def grpo(actor, reference, optimizer=None, steps: int = 2, on_reward=None) -> tuple:
    """A GRPO learner on `actor` (sampled and trained) and `reference`, `steps` steps of two prompts.

    `on_reward` runs at each step's reward, after the previous step trained and
    before this one does (the rollout and the trainer share a mesh: Tunix runs
    them in turn).
    """
    roles = (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT)
    # One device: Tunix reshards the models onto it (nnx.merge of their graph definitions).
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=auto, devices=jax.devices()[:1])
    config = rl_cluster_lib.ClusterConfig(
        role_to_mesh=dict.fromkeys(roles, mesh),
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optimizer or optax.sgd(1e-2), eval_every_n_steps=100, max_steps=steps
        ),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=NEW_TOKENS, max_prompt_length=8, kv_cache_size=CACHE
        ),
    )
    cluster = rl_cluster_lib.RLCluster(actor=actor, reference=reference, tokenizer=VOCAB, cluster_config=config)

    def reward(prompts, completions, **kwargs):
        if on_reward is not None:
            on_reward()
        return [float(len(c)) for c in completions]

    learner = grpo_lib.GRPOLearner(
        rl_cluster=cluster, reward_fns=reward, algo_config=grpo_lib.GRPOConfig(num_generations=2, num_iterations=1)
    )
    return cluster, learner


def train_grpo(learner, steps: int = 2) -> None:
    learner.train([{"prompts": PROMPTS, "answer": PROMPTS}] * steps)


def assert_trained(cluster, before: list, steps: int = 2) -> None:
    assert cluster.actor_trainer.train_steps == steps
    losses = cluster.actor_trainer.metrics_logger.get_metric_history("actor", "loss", "train")
    assert len(losses) == steps and np.all(np.isfinite(losses))
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


def host(tree) -> list:
    """`tree`'s leaves copied to the host: Tunix donates the optimizer state to its step."""
    return [np.array(x) for x in jax.tree.leaves(tree)]


def same(a: list, b: list) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def scale(trainer) -> tuple[float, int]:
    metrics = jaxamp.scaling.scale_metrics(trainer.optimizer.opt_state)
    return float(metrics["loss_scale"]), int(metrics["skipped_steps"])


@pytest.mark.parametrize("form", ["amp_module", "amp_loss"])
def test_grpo_float16_an_overflowing_step_is_skipped_and_the_scale_halved(form):
    # docs/porting.md's float16 lines. "amp_module": the module's amp reads the
    # live scale (the two-line form); "amp_loss": the trainer line's amp'd loss does.
    optimizer = jaxamp.loss_scaling(optax.sgd(1e-2))
    module_scale = {"loss_scale": optimizer} if form == "amp_module" else {}
    actor, reference = jaxamp.amp_module(toy(), toy(), compute_dtype="f16", **module_scale)
    snapshots = []  # before each step, and after the last: parameters, (scale, skipped steps)

    def snapshot():
        snapshots.append((params(trainer.model), scale(trainer)))

    cluster, learner = grpo(actor, reference, optimizer, steps=3, on_reward=snapshot)
    trainer = cluster.actor_trainer

    # The injection: the second call of Tunix's jitted train step multiplies its
    # loss by OVERFLOW. A counter in a jax.Ref the step closes over, advanced
    # where the step builds the loss's inputs (outside the differentiated loss).
    calls = jax.new_ref(jnp.int32(0))
    tunix_inputs, tunix_loss = trainer.gen_model_input_fn, trainer.loss_fn

    def inputs(example):
        call = calls[...]
        calls[...] = call + 1
        return {**tunix_inputs(example), "factor": jnp.where(call == 1, OVERFLOW, 1.0).astype(jnp.float32)}

    def loss(model, train_example, algo_config, factor):
        value, aux = tunix_loss(model, train_example, algo_config)
        return factor * value, aux

    if form == "amp_loss":
        loss = jaxamp.amp(loss, compute_dtype="f16", loss_scale=optimizer)
    trainer.with_loss_fn(loss, has_aux=True)
    trainer.with_gen_model_input_fn(inputs)

    train_grpo(learner, steps=3)
    snapshots.append((params(trainer.model), scale(trainer)))
    assert int(calls[...]) == 3 and trainer.train_steps == 3
    (before, _), (skipped_before, _), (skipped_after, _), (after, _) = snapshots
    assert [s for _, s in snapshots] == [(2.0**15, 0), (2.0**15, 0), (2.0**14, 1), (2.0**14, 1)]
    for a, b in zip(skipped_before, skipped_after, strict=True):
        np.testing.assert_array_equal(a, b)  # the overflowing step: parameters bit for bit
    assert not same(before, skipped_before) and not same(skipped_after, after)  # the others train
    losses = trainer.metrics_logger.get_metric_history("actor", "loss", "train")
    assert len(losses) == 3 and np.all(np.isfinite(losses))


def ppo_critic_losses(steps: int, precision: str) -> tuple[list, object]:
    """A PPO learner's critic losses over `steps` steps; actor, reference and critic in `precision`.

    The critic (a score head on the transformer, which sows and pops its hidden
    states) is wrapped whole; in float16 each optimizer has its own scale,
    given to the modules it trains.
    """
    from tunix.rl.ppo import ppo_learner as ppo_lib

    actor, reference = toy(), toy()
    critic = tc.ToyTransformerWithScoreHead(tc.ToyTransformer(CONFIG, rngs=nnx.Rngs(2)), rngs=nnx.Rngs(1))
    actor_optimizer, critic_optimizer = optax.sgd(1e-3), optax.sgd(1e-3)
    if precision == "f16":
        actor_optimizer, critic_optimizer = jaxamp.loss_scaling(actor_optimizer), jaxamp.loss_scaling(critic_optimizer)
        jaxamp.amp_module(actor, reference, compute_dtype="f16", loss_scale=actor_optimizer)
        jaxamp.amp_module(critic, compute_dtype="f16", loss_scale=critic_optimizer)
    roles = [rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT]
    mesh = jax.make_mesh(
        (1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=jax.devices()[:1]
    )
    config = rl_cluster_lib.ClusterConfig(
        role_to_mesh=dict.fromkeys([*roles, rl_cluster_lib.Role.CRITIC], mesh),
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=actor_optimizer, critic_optimizer=critic_optimizer, eval_every_n_steps=100, max_steps=steps
        ),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=NEW_TOKENS, max_prompt_length=8, kv_cache_size=CACHE
        ),
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=actor, reference=reference, critic=critic, tokenizer=VOCAB, cluster_config=config
    )
    learner = ppo_lib.PPOLearner(
        rl_cluster=cluster,
        reward_fns=lambda prompts, completions, **kwargs: [float(len(c)) for c in completions],
        ppo_config=ppo_lib.PPOConfig(),
    )
    train_grpo(learner, steps=steps)
    trainer = cluster.critic_trainer
    return trainer.metrics_logger.get_metric_history("critic", "loss", "train"), trainer


def test_ppo_float16_actor_and_critic_each_with_its_own_scale():
    plain, _ = ppo_critic_losses(2, "f32")
    losses, critic = ppo_critic_losses(5, "f16")
    assert type(critic.model).__name__ == "AmpToyTransformerWithScoreHead"
    # The critic's value loss (about 340) times 2**15 overflows float16: its
    # first steps are skipped, the scale halving each time, then it trains as
    # float32 did, late by the skipped steps.
    loss_scale, skipped = scale(critic)
    print("critic losses: float32", plain, "float16", losses, "scale", loss_scale, "skipped", skipped)
    assert 1 <= skipped <= 3 and loss_scale == 2.0 ** (15 - skipped)  # seen: 3
    # The critic stands still while skipped (its loss moves only with the rollouts the actor samples).
    np.testing.assert_allclose(losses[: skipped + 1], losses[0], rtol=1e-5)
    np.testing.assert_allclose(losses[skipped : skipped + 2], plain, rtol=1e-3)


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


def sft_trainer(directory, max_steps: int, optimizer, f16: bool = False) -> peft_trainer.PeftTrainer:
    """A PeftTrainer on a fresh ToyTransformer, two micro-batches a step, checkpointing each step in `directory`.

    `f16`: docs/porting.md's two lines, `optimizer` a `jaxamp.loss_scaling`.
    `directory` None: no checkpoints, for a run nothing restores (an Orbax save
    is about 0.3 s of CPU, and the checkpointing does not enter the step Tunix compiles).
    """
    model = toy()
    if f16:
        jaxamp.amp_module(model, compute_dtype="f16", loss_scale=optimizer)
    checkpointing = {}
    if directory is not None:
        checkpointing = dict(
            checkpoint_root_directory=str(directory),
            checkpointing_options=ocp.CheckpointManagerOptions(
                save_interval_steps=1, max_to_keep=1, enable_async_checkpointing=False
            ),
        )
    config = peft_trainer.TrainingConfig(
        eval_every_n_steps=100, max_steps=max_steps, gradient_accumulation_steps=2, **checkpointing
    )
    return peft_trainer.PeftTrainer(model, optimizer, config)


def f16_sft_trainer(directory, max_steps: int, **scaling):
    """`sft_trainer` in float16 (the optimizer handed to Tunix wrapped, which Tunix wraps in ``optax.MultiSteps``).

    The loss is Tunix's default times the batch's ``factor``; `scaling`, the
    `jaxamp.loss_scaling` arguments (its initial ``scaler``: a value in its
    cells, not in the program, so every such trainer runs the one program,
    compiled once for all of them through the session's compilation cache).
    """
    trainer = sft_trainer(directory, max_steps, jaxamp.loss_scaling(optax.adam(1e-2), **scaling), f16=True)
    tunix_loss = trainer.loss_fn

    def loss(model, input_tokens, input_mask, positions, attention_mask, factor):
        return factor * tunix_loss(model, input_tokens, input_mask, positions, attention_mask)

    return trainer.with_loss_fn(loss)


def adam_state(trainer) -> list:
    # Tunix's MultiSteps, around jaxamp's loss_scaling, around adam: its moments and count.
    return host(trainer.optimizer.opt_state.inner_opt_state.inner_state)


def test_sft_float16_with_micro_batches_skips_the_overflowing_step_and_orbax_restores_the_scale(tmp_path):
    trainer = f16_sft_trainer(tmp_path, max_steps=4)
    snapshots = []  # at each real step's start, and after the last: parameters, adam's state, scale

    def snapshot():
        snapshots.append((host(nnx.state(trainer.model, nnx.Param)), adam_state(trainer), scale(trainer)))

    def batches():
        # Eight micro-batches, four real steps; the first micro-batch of the
        # second step overflows (its update is MultiSteps' to discard, the real
        # step's is the second's, which is finite: the step must still be skipped).
        for index in range(8):
            if index % 2 == 0:
                snapshot()  # Tunix asks for the next batch when the steps before it were dispatched
            yield dict(sft_batches(1)[0], factor=jnp.float32(OVERFLOW if index == 2 else 1.0))

    trainer.train(batches())
    snapshot()
    assert trainer.train_steps == 4
    assert [s for *_, s in snapshots] == [(2.0**15, 0), (2.0**15, 0), (2.0**14, 1), (2.0**14, 1), (2.0**14, 1)]
    for step in range(4):
        (params_before, adam_before, _), (params_after, adam_after, _) = snapshots[step : step + 2]
        skipped = step == 1
        assert same(params_before, params_after) == skipped, step
        assert same(adam_before, adam_after) == skipped, step  # the moments and count, bit for bit
    losses = trainer.metrics_logger.get_metric_history("", "loss", "train")
    assert len(losses) == 4 and losses[1] > 1e6 and losses[3] < losses[0]

    # A new process: a fresh model and optimizer (its live scale at the initial
    # 2**15); Tunix restores the last checkpoint, optimizer state included.
    restored = f16_sft_trainer(tmp_path, max_steps=5)
    assert restored.train_steps == 4 and scale(restored) == (2.0**14, 1)
    final_params, final_adam, _ = snapshots[-1]
    assert same(host(nnx.state(restored.model, nnx.Param)), final_params)
    assert same(adam_state(restored), final_adam)
    # One more step: its update steers by the restored scale, not the cells' initial one.
    restored.train([dict(sft_batches(1)[0], factor=jnp.float32(1.0))] * 10)  # Tunix skips the 8 trained
    assert restored.train_steps == 5 and scale(restored) == (2.0**14, 1)
    assert not same(host(nnx.state(restored.model, nnx.Param)), final_params)


def test_the_scale_in_tunix_logs_through_its_training_hooks_and_a_collapse_is_warned():
    # porting.md's hook, run as the docs give it: one LossScaleMonitor(record=True)
    # update a step sends the scale to jax.monitoring, whose listeners Tunix's
    # metrics logger registers (its TensorBoard among them), and warns where
    # the scale collapsed.
    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "porting.md").read_text()
    (block,) = [b for b in re.findall(r"^```python\n(.*?)^```", text, re.S | re.M) if "class LossScaleHooks" in b]
    namespace: dict = {}
    exec(block, namespace)
    LossScaleHooks = namespace["LossScaleHooks"]

    logged = []

    def listener(name, value, **tags):
        if name.startswith("/jaxamp/loss_scaling/"):
            logged.append((tags.get("step"), name.rsplit("/", 1)[-1], value))

    jax.monitoring.register_scalar_listener(listener)
    try:
        trainer = f16_sft_trainer(None, max_steps=3)  # nothing restores it: no checkpoints
        trainer.with_training_hooks(LossScaleHooks())
        factors = [1.0, 1.0, OVERFLOW, OVERFLOW, 1.0, 1.0]  # the second real step overflows
        trainer.train([dict(sft_batches(1)[0], factor=jnp.float32(f)) for f in factors])
    finally:
        jax.monitoring.unregister_scalar_listener(listener)
    by_step = {}
    for step, name, value in logged:
        by_step.setdefault(name, []).append((step, value))
    # One entry a real step, tagged with Tunix's count of updates: the second overflowed.
    assert by_step["loss_scale"] == [(0, 2.0**15), (1, 2.0**15), (2, 2.0**14), (3, 2.0**14)]
    assert by_step["skipped_steps"] == [(0, 0), (1, 0), (2, 1), (3, 1)]

    # At its floor (a scale of 1, every step overflowing) the monitor says so, from the hook alone.
    # The trainer above with its scale starting at 1 (the program it compiled: no compile here),
    # every micro-batch's loss times 1e30, which overflows float16's backward pass at a scale of 1.
    floored = f16_sft_trainer(None, max_steps=2, scaler=1.0)
    floored.with_training_hooks(LossScaleHooks())
    with pytest.warns(UserWarning, match="the loss scale is at its floor"):
        floored.train([dict(sft_batches(1)[0], factor=jnp.float32(1e30))] * 4)
    assert floored.train_steps == 2 and scale(floored) == (1.0, 2)  # both real steps skipped, at the floor


def test_a_checkpoint_changes_precision_through_tunixs_own_restore(tmp_path, monkeypatch, caplog):
    from tunix.sft import checkpoint_manager

    manager = checkpoint_manager.CheckpointManager
    batches = sft_batches(12)  # 6 real steps of 2 micro-batches; a resumed trainer skips those trained
    reference = sft_trainer(None, 6, optax.adam(1e-2))  # uninterrupted: nothing restores it, no checkpoints
    reference.train(batches)
    uninterrupted = reference.metrics_logger.get_metric_history("", "loss", "train")

    first = sft_trainer(tmp_path / "run", 2, optax.adam(1e-2))
    first.train(batches)
    # float32 -> float16: docs/porting.md's line, before the trainer is built (it restores in __init__).
    optimizer = jaxamp.loss_scaling(optax.adam(1e-2), scaler=2.0**14)
    monkeypatch.setattr(
        manager, "maybe_restore", jaxamp.scaling.restore_across_loss_scaling(manager.maybe_restore, optimizer)
    )
    with caplog.at_level("WARNING", logger="jaxamp"):
        second = sft_trainer(tmp_path / "run", 4, optimizer, f16=True)
    assert "written without loss scaling" in caplog.text
    assert second.train_steps == 2 and scale(second) == (2.0**14, 0)
    second.train(batches)
    assert second.train_steps == 4 and scale(second) == (2.0**14, 0)
    # float16 -> float32: the transformation the checkpoint was written with, as Tunix held it.
    written_with = optax.MultiSteps(jaxamp.loss_scaling(optax.adam(1e-2)), 2)
    monkeypatch.undo()
    monkeypatch.setattr(
        manager, "maybe_restore", jaxamp.scaling.restore_across_loss_scaling(manager.maybe_restore, written_with)
    )
    caplog.clear()
    with caplog.at_level("WARNING", logger="jaxamp"):
        third = sft_trainer(tmp_path / "run", 6, optax.adam(1e-2))
    assert "written with loss scaling" in caplog.text
    assert third.train_steps == 4 and not isinstance(third.optimizer.opt_state.inner_opt_state, jaxamp.LossScaleState)
    third.train(batches)
    assert third.train_steps == 6

    losses = [t.metrics_logger.get_metric_history("", "loss", "train") for t in (first, second, third)]
    print("uninterrupted", uninterrupted, "legs", losses)
    np.testing.assert_array_equal(losses[0], uninterrupted[:2])
    np.testing.assert_allclose(np.concatenate(losses[1:]), uninterrupted[2:], rtol=5e-3)
