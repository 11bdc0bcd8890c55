"""MaxText's pre-training entry point under jaxamp: float16, bfloat16 or float32, across checkpoints.

docs/porting.md shows this file as it is (``tests/test_maxtext.py`` checks
that). Run it as MaxText's own ``train.py``, with MaxText's command line and
``dtype=float32``; ``PRECISION`` picks amp's compute dtype for this run. A
checkpoint written at one precision resumes at another, and a run resumes its
own checkpoints as before:

    PRECISION=f32 python examples/maxtext_driver.py <config> run_name=r steps=4 ...
    PRECISION=f16 python examples/maxtext_driver.py <config> run_name=r steps=8 ...
"""

import os

os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")  # MaxText without the Google Cloud clients

import jax
import jax.numpy as jnp
from absl import app
from flax import nnx
from maxtext.common import checkpointing
from maxtext.optimizers import optimizers
from maxtext.trainers.pre_train import train

import jaxamp

precision = os.environ.get("PRECISION", "f16")  # f16, bf16 or f32 (MaxText's own program)
scaled = precision == "f16"
if scaled:  # float16: bfloat16's line plus this one
    optimizers.get_optimizer = jaxamp.scaling.loss_scaling_factory(optimizers.get_optimizer)
if precision != "f32":
    train.loss_fn = jaxamp.amp(
        train.loss_fn, compute_dtype=precision, loss_scale=optimizers.get_optimizer if scaled else None
    )
# A checkpoint written with or without loss scaling resumes either way.
checkpointing.load_state_if_possible = jaxamp.scaling.restore_across_loss_scaling(
    checkpointing.load_state_if_possible, optimizers.get_optimizer if scaled else None
)

_train_step = train.train_step
monitor = jaxamp.scaling.LossScaleMonitor()  # warns where the scale collapses or most steps are skipped


def train_step(model, *args, **kwargs):  # the scale and both kinds of skipped step in MaxText's metrics
    state, metrics = _train_step(model, *args, **kwargs)
    opt_state = nnx.merge(model, state).optimizer.opt_state
    if not isinstance(opt_state, jaxamp.LossScaleState):
        return state, metrics
    scale = jaxamp.scaling.scale_metrics(opt_state)
    jax.debug.callback(monitor.update, scale)
    overflowed = jnp.logical_not(scale["last_step_finite"])
    spiked = jnp.asarray(opt_state.inner_state["is_skipped"]) if "is_skipped" in opt_state.inner_state else False
    scalar = metrics["scalar"]
    scalar.update({f"optim/{k}": v for k, v in scale.items()})  # loss_scale, skipped_steps, last_step_finite
    scalar["optim/step_skipped"] = jnp.logical_or(overflowed, spiked).astype(jnp.float32)
    for norm in ("learning/grad_norm", "learning/raw_grad_norm"):  # an overflowed gradient has no norm
        if norm in scalar:
            scalar[norm] = jnp.where(overflowed, jnp.nan, scalar[norm])
    return state, metrics


train.train_step = train_step

if __name__ == "__main__":
    app.run(train.main)  # MaxText's command line and console output
