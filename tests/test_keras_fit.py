"""keras.io's "Customizing what happens in `fit()` with JAX" (examples/keras_fit.py) under amp.

Keras 3's ``model.fit`` owns the loop and jits the guide's ``train_step``; the port
is the guide's code plus the lines docs/porting.md gives. bfloat16 wraps the
guide's ``compute_loss_and_updates`` in amp. float16 scales by a
`jaxamp.DynamicScalerState` kept as the model's own non-trainable variables
(porting.md's "No optax optimizer": `update_scale`, and ``jax.lax.cond`` around
Keras's ``stateless_apply``), or by Keras's own ``LossScaleOptimizer``, amp
only casting. Runs where Keras is installed (``pip install keras``), on its JAX backend.
"""

from __future__ import annotations

import difflib
import importlib.util
import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # before Keras is first imported: it would pick TensorFlow

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from example_scripts import load_example
from jaxpr_walk import assert_all_matmuls_in

# Found, not imported: Keras's import (scikit-learn, pandas, scipy) takes 16 s, which
# every pytest process collecting this file would pay; the fixtures import it.
if importlib.util.find_spec("keras") is None:
    pytest.skip("could not import 'keras': No module named 'keras'", allow_module_level=True)

CONFIGS = {
    "none": ("none", "jaxamp"),
    "bf16": ("bf16", "jaxamp"),
    "f16": ("f16", "jaxamp"),
    "f16 keras": ("f16", "keras"),
}


@pytest.fixture(scope="module")
def keras():
    import keras

    if keras.backend.backend() != "jax":
        pytest.skip(f"Keras was imported with the {keras.backend.backend()} backend")
    return keras


@pytest.fixture(scope="module")
def example(keras):
    return load_example("keras_fit")


@pytest.fixture(scope="module")
def runs(example):
    """The guide's program run once in each configuration (seed 0, 3 epochs of 32 steps)."""
    return {name: example.run(amp, scaler, quiet=True) for name, (amp, scaler) in CONFIGS.items()}


def _changed(example, amp, scaler):
    source = example.edited_source(amp, scaler)
    diff = difflib.unified_diff(example.GUIDE.splitlines(), source.splitlines(), lineterm="", n=0)
    return [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")]


def test_the_port_is_porting_md_lines(example):
    """What runs is the guide's code plus exactly the lines the docs count."""
    assert _changed(example, "none", "jaxamp") == []
    assert _changed(example, "bf16", "jaxamp") == [  # 1 added, 1 changed
        "+import jaxamp",
        "-        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)",
        '+        grad_fn = jax.value_and_grad(jaxamp.amp(self.compute_loss_and_updates, compute_dtype="bf16"), has_aux=True)',
    ]
    assert _changed(example, "f16", "jaxamp") == [  # 8 added (and a blank line), 2 changed
        "+import jaxamp",
        "+    def __init__(self, *args, **kwargs):",
        "+        super().__init__(*args, **kwargs)",
        "+        self.loss_scale = [keras.Variable(v, trainable=False) for v in jaxamp.DynamicScalerState()]",
        "+",
        "+        scaler = jaxamp.DynamicScalerState(*non_trainable_variables[:7])  # the model's own come first",
        "-        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)",
        '+        grad_fn = jax.value_and_grad(jaxamp.amp(self.compute_loss_and_updates, compute_dtype="f16", loss_scale=scaler), has_aux=True)',
        "-        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(",
        "+        scaler, finite = jaxamp.scaling.update_scale(scaler, grads)",
        "+        trainable_variables, optimizer_variables = jax.lax.cond(",
        "+            finite, self.optimizer.stateless_apply, lambda o, g, t: (t, o),",
        "+        non_trainable_variables = [*scaler, *jaxamp.select_tree(finite, non_trainable_variables[7:], state[1][7:])]",
    ]
    assert _changed(example, "f16", "keras") == [  # 5 added, 4 changed
        "+import jaxamp",
        "+        optimizer_variables=None,",
        "-        return loss, (y_pred, non_trainable_variables, metrics_variables)",
        "+        with keras.StatelessScope(state_mapping=zip(self.optimizer.variables, optimizer_variables)):",
        "+            scaled_loss = self.optimizer.scale_loss(loss)  # as Keras's own train_step",
        "+        return scaled_loss, (loss, y_pred, non_trainable_variables, metrics_variables)",
        "-        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)",
        '+        grad_fn = jax.value_and_grad(jaxamp.amp(self.compute_loss_and_updates, compute_dtype="f16"), has_aux=True)',
        "-        (loss, (y_pred, non_trainable_variables, metrics_variables)), grads = grad_fn(",
        "+        (_, (loss, y_pred, non_trainable_variables, metrics_variables)), grads = grad_fn(",
        "+            optimizer_variables=optimizer_variables,",
        '-model.compile(optimizer="adam", loss="mse", metrics=["mae"])',
        '+model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()), loss="mse", metrics=["mae"])',
    ]


def test_the_losses_follow_float32(runs):
    f32 = np.asarray(runs["none"]["loss"])
    assert len(f32) == 3 and f32[-1] < 0.5 * f32[0]  # the guide's model learns
    # Per-epoch mean MSE; bfloat16 keeps 8 bits (seen: 2.6e-4 at most), float16 11 (seen: 1.2e-4).
    np.testing.assert_allclose(runs["bf16"]["loss"], f32, rtol=2e-3)
    np.testing.assert_allclose(runs["f16"]["loss"], f32, rtol=1e-3)
    # Both float16 scalers scale by 2**15 and skip nothing: the same program, bit for bit.
    assert runs["f16 keras"]["loss"] == runs["f16"]["loss"]
    for name in ("f16", "f16 keras"):
        assert (runs[name]["loss_scale"], runs[name]["skipped_steps"]) == (2.0**15, 0), name


def _state(model):
    values = lambda variables: [v.value for v in variables]  # noqa: E731
    return (
        values(model.trainable_variables),
        values(model.non_trainable_variables),
        values(model.optimizer.variables),
        values(model.metrics_variables),
    )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_matmul_of_the_step_runs_in_the_compute_dtype(runs, name):
    """The step fit jits: the Dense layer's matmul and its weight gradient, in the compute dtype."""
    model, module = runs[name]["model"], runs[name]["module"]
    batch = (jnp.asarray(module.x[:32], jnp.float32), jnp.asarray(module.y[:32], jnp.float32))
    jaxpr = jax.make_jaxpr(model.train_step)(_state(model), batch)
    dtype = {"none": jnp.float32, "bf16": jnp.bfloat16}.get(name, jnp.float16)
    assert assert_all_matmuls_in(jaxpr, dtype) == 2


def _values(variables):
    return [np.asarray(v.value) for v in variables]


@pytest.mark.parametrize("name", ["f16", "f16 keras"])
def test_an_overflowing_step_is_skipped_with_the_weights_bit_for_bit(example, runs, name):
    """One batch scaled by 1e3 overflows float16's backward pass: fit skips it and halves the scale."""
    model, module = runs[name]["model"], runs[name]["module"]
    optimizer = model.optimizer if name == "f16" else model.optimizer.inner_optimizer
    if name == "f16":  # the step finds the scaler at [:7]: Keras lists a model's own variables first
        assert all(a is b for a, b in zip(model.non_trainable_variables[:7], model.loss_scale))
    x, y = module.x[:32], module.y[:32]
    before = _values(model.trainable_variables) + _values(optimizer.variables)
    steps = 96  # the guide's 3 epochs of 32 steps
    model.fit(x * 1e3, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
    after = _values(model.trainable_variables) + _values(optimizer.variables)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(before, after))  # Adam's count and moments too
    assert example.scale_figures(model, steps + 1) == {"loss_scale": 2.0**14, "skipped_steps": 1}
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)  # training goes on
    assert not np.array_equal(_values(model.trainable_variables)[0], before[0])
    assert example.scale_figures(model, steps + 2) == {"loss_scale": 2.0**14, "skipped_steps": 1}


def test_a_too_large_first_scale_is_halved_until_float16_holds_the_backward_pass(example, runs):
    """Started at 2**24 the first steps overflow: each is skipped, the scale halves, then training goes on."""
    result = example.run("f16", "jaxamp", initial_scale=2.0**24, quiet=True)
    assert (result["loss_scale"], result["skipped_steps"]) == (2.0**15, 9)
    assert np.isfinite(result["loss"]).all()
    np.testing.assert_allclose(result["loss"][-1], runs["none"]["loss"][-1], rtol=0.05)  # seen: 1.2%, 9 steps behind


def test_a_nan_batch_leaves_batchnorm_statistics_as_they_were(example):
    """The port's last line keeps the model's other non-trainable variables on a skipped step.

    Not the guide's model: a BatchNormalization and a Dropout before its Dense,
    whose moving statistics a NaN batch would otherwise make NaN for good (amp
    does not recognise Keras's list of non-trainable values as module state).
    """
    source = example.edited_source("f16").replace(
        "outputs = keras.layers.Dense(1)(inputs)",
        "outputs = keras.layers.Dense(1)(keras.layers.Dropout(0.1)(keras.layers.BatchNormalization()(inputs)))",
    )
    source = source.replace("model.fit(x, y, epochs=3)", "model.fit(x, y, epochs=1)")
    module = example.execute(source, "batchnorm", quiet=True)
    model, x, y = module.model, module.x[:32].copy(), module.y[:32]
    assert all(a is b for a, b in zip(model.non_trainable_variables[:7], model.loss_scale))
    others = model.non_trainable_variables[7:]  # moving mean and variance, Dropout's seed
    before, skipped = _values(others), example.scale_figures(model, 32)["skipped_steps"]
    x[0, 0] = np.nan
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert example.scale_figures(model, 33)["skipped_steps"] == skipped + 1
    assert all(a.tobytes() == b.tobytes() for a, b in zip(before, _values(others)))
