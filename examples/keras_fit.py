"""keras.io's "Customizing what happens in `fit()` with JAX", ported to jaxamp as docs/porting.md says.

The guide (https://keras.io/guides/custom_train_step_in_jax/, by fchollet, source
``guides/custom_train_step_in_jax.py`` in keras-team/keras-io, Apache 2.0) overrides
a Keras 3 model's ``train_step`` on the JAX backend: a stateless
``compute_loss_and_updates`` (``self.stateless_call`` and
``self.stateless_compute_loss``) differentiated with ``jax.value_and_grad``, and
the update by ``self.optimizer.stateless_apply``; Keras's ``model.fit`` owns the
loop and jits the step. `GUIDE` below is the code of its first example, as the
guide writes it; `edited_source` makes the port, so what runs is the guide's
program plus exactly these lines (``--show_diff`` prints them):

    bf16:  import jaxamp
           grad_fn = jax.value_and_grad(jaxamp.amp(self.compute_loss_and_updates, compute_dtype="bf16"), has_aux=True)

    f16 (``--scaler=jaxamp``, the default): docs/porting.md's "No optax optimizer".
    Keras's optimizer is not optax, so the model keeps a `jaxamp.DynamicScalerState`
    as seven non-trainable ``keras.Variable``s (its own variables, which Keras lists
    first in ``non_trainable_variables``, so the step finds them at ``[:7]``), amp
    scales by it, `jaxamp.scaling.update_scale` moves it, and ``jax.lax.cond`` skips
    Keras's update on an overflow (the weights and Adam's state keep their bits).
    The last line writes the scaler back and keeps the model's other non-trainable
    variables (a BatchNormalization's moving statistics) as they were on a skipped
    step: amp does not recognise Keras's list of them as module state.

    f16 (``--scaler=keras``): Keras's own ``LossScaleOptimizer`` holds and moves the
    scale; amp only casts (no ``loss_scale=``), and the loss is scaled as Keras's own
    ``train_step`` scales it (``self.optimizer.scale_loss`` in a ``StatelessScope``).
    Without that scaling ``LossScaleOptimizer`` would divide unscaled gradients by
    the scale; given amp's ``loss_scale=`` as well, it would divide them twice.

The data is the guide's (uniform random, 1,000 x 32 features, one target), drawn
after ``keras.utils.set_random_seed(0)``; the model (one ``Dense(1)``), Adam, MSE
and ``model.fit(x, y, epochs=3)`` (batch 32: 32 steps an epoch) are the guide's.
``--initial_scale=2.0**24`` starts f16 at a scale whose backward pass overflows
float16: the first steps are skipped and the scale halves until it fits.

Usage:

    python examples/keras_fit.py --amp={none,bf16,f16} [--scaler={jaxamp,keras}] [--initial_scale=2.0**24] [--show_diff]
    python examples/keras_fit.py --table     # every run above, one line each
    python examples/keras_fit.py --lso_alone # float32 with LossScaleOptimizer swapped in alone (a trap)
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import os
import sys
import types

# The guide's own first lines set this: the port runs on the JAX backend only.
os.environ["KERAS_BACKEND"] = "jax"

# keras-team/keras-io, guides/custom_train_step_in_jax.py (commit 1152d883930e8ab91a8c16366d5a21c67d771e82):
# the "Setup" and "A first simple example" code cells, unchanged.
GUIDE = """\
import os

# This guide can only be run with the JAX backend.
os.environ["KERAS_BACKEND"] = "jax"

import jax
import keras
import numpy as np


class CustomModel(keras.Model):
    def compute_loss_and_updates(
        self,
        trainable_variables,
        non_trainable_variables,
        metrics_variables,
        x,
        y,
        sample_weight,
        training=False,
    ):
        y_pred, non_trainable_variables = self.stateless_call(
            trainable_variables,
            non_trainable_variables,
            x,
            training=training,
        )
        loss, (
            trainable_variables,
            non_trainable_variables,
            metrics_variables,
        ) = self.stateless_compute_loss(
            trainable_variables,
            non_trainable_variables,
            metrics_variables,
            x=x,
            y=y,
            y_pred=y_pred,
            sample_weight=sample_weight,
            training=training,
        )
        return loss, (y_pred, non_trainable_variables, metrics_variables)

    def train_step(self, state, data):
        (
            trainable_variables,
            non_trainable_variables,
            optimizer_variables,
            metrics_variables,
        ) = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)

        # Get the gradient function.
        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)

        # Compute the gradients.
        (loss, (y_pred, non_trainable_variables, metrics_variables)), grads = grad_fn(
            trainable_variables,
            non_trainable_variables,
            metrics_variables,
            x,
            y,
            sample_weight,
            training=True,
        )

        # Update trainable variables and optimizer variables.
        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(
            optimizer_variables, grads, trainable_variables
        )

        # Update metrics.
        new_metrics_vars = []
        logs = {}
        for metric in self.metrics:
            this_metric_vars = metrics_variables[
                len(new_metrics_vars) : len(new_metrics_vars) + len(metric.variables)
            ]
            if metric.name == "loss":
                this_metric_vars = metric.stateless_update_state(
                    this_metric_vars, loss, sample_weight=sample_weight
                )
            else:
                this_metric_vars = metric.stateless_update_state(
                    this_metric_vars, y, y_pred, sample_weight=sample_weight
                )
            logs[metric.name] = metric.stateless_result(this_metric_vars)
            new_metrics_vars += this_metric_vars

        # Return metric logs and updated state variables.
        state = (
            trainable_variables,
            non_trainable_variables,
            optimizer_variables,
            new_metrics_vars,
        )
        return logs, state


# Construct and compile an instance of CustomModel
inputs = keras.Input(shape=(32,))
outputs = keras.layers.Dense(1)(inputs)
model = CustomModel(inputs, outputs)
model.compile(optimizer="adam", loss="mse", metrics=["mae"])

# Just use `fit` as usual
x = np.random.random((1000, 32))
y = np.random.random((1000, 1))
model.fit(x, y, epochs=3)
"""

# The port: (the guide's lines, what they become), each guide excerpt there once.
# Lines longer than this file's 120 columns are split into adjacent strings.
GRAD_FN = "        grad_fn = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)\n"
IMPORT = ("import jax\n", "import jax\nimport jaxamp\n")
BF16 = [
    IMPORT,
    (
        GRAD_FN,
        '        grad_fn = jax.value_and_grad(jaxamp.amp(self.compute_loss_and_updates, compute_dtype="bf16"), '
        "has_aux=True)\n",
    ),
]
# f16, jaxamp's scale: docs/porting.md's "No optax optimizer", the scaler state kept
# as the model's own non-trainable variables. {init} is the DynamicScalerState's arguments.
F16_JAXAMP = [
    IMPORT,
    (
        "class CustomModel(keras.Model):\n",
        "class CustomModel(keras.Model):\n"
        "    def __init__(self, *args, **kwargs):\n"
        "        super().__init__(*args, **kwargs)\n"
        "        self.loss_scale = [keras.Variable(v, trainable=False) for v in jaxamp.DynamicScalerState({init})]\n"
        "\n",
    ),
    (
        "        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)\n",
        "        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)\n"
        "        scaler = jaxamp.DynamicScalerState(*non_trainable_variables[:7])  # the model's own come first\n",
    ),
    (
        GRAD_FN,
        '        grad_fn = jax.value_and_grad(jaxamp.amp(self.compute_loss_and_updates, compute_dtype="f16", '
        "loss_scale=scaler), has_aux=True)\n",
    ),
    (
        "        trainable_variables, optimizer_variables = self.optimizer.stateless_apply(\n"
        "            optimizer_variables, grads, trainable_variables\n"
        "        )\n",
        "        scaler, finite = jaxamp.scaling.update_scale(scaler, grads)\n"
        "        trainable_variables, optimizer_variables = jax.lax.cond(\n"
        "            finite, self.optimizer.stateless_apply, lambda o, g, t: (t, o),\n"
        "            optimizer_variables, grads, trainable_variables\n"
        "        )\n"
        "        non_trainable_variables = [*scaler, *jaxamp.select_tree(finite, non_trainable_variables[7:], "
        "state[1][7:])]\n",
    ),
]
# f16, Keras's scale: its LossScaleOptimizer, the loss scaled as Keras's own
# train_step scales it; amp only casts. {init} is LossScaleOptimizer's extra arguments.
F16_KERAS = [
    IMPORT,
    (
        "        training=False,\n    ):\n",
        "        training=False,\n        optimizer_variables=None,\n    ):\n",
    ),
    (
        "        return loss, (y_pred, non_trainable_variables, metrics_variables)\n",
        "        with keras.StatelessScope(state_mapping=zip(self.optimizer.variables, optimizer_variables)):\n"
        "            scaled_loss = self.optimizer.scale_loss(loss)  # as Keras's own train_step\n"
        "        return scaled_loss, (loss, y_pred, non_trainable_variables, metrics_variables)\n",
    ),
    (
        GRAD_FN,
        '        grad_fn = jax.value_and_grad(jaxamp.amp(self.compute_loss_and_updates, compute_dtype="f16"), '
        "has_aux=True)\n",
    ),
    (
        "        (loss, (y_pred, non_trainable_variables, metrics_variables)), grads = grad_fn(\n",
        "        (_, (loss, y_pred, non_trainable_variables, metrics_variables)), grads = grad_fn(\n",
    ),
    (
        "            training=True,\n        )\n",
        "            training=True,\n            optimizer_variables=optimizer_variables,\n        )\n",
    ),
    (
        'model.compile(optimizer="adam", loss="mse", metrics=["mae"])\n',
        "model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(){init}), "
        'loss="mse", metrics=["mae"])\n',
    ),
]


def edited_source(amp: str = "none", scaler: str = "jaxamp", initial_scale: float | None = None) -> str:
    """The guide's program with porting.md's lines for `amp` ("none": unedited).

    `scaler` picks f16's loss scale, "jaxamp" or "keras"; `initial_scale` its
    first value (2**15 by default in both).
    """
    if amp not in ("none", "bf16", "f16"):
        raise ValueError(f"--amp must be none, bf16 or f16, got {amp!r}")
    if scaler not in ("jaxamp", "keras"):
        raise ValueError(f"--scaler must be jaxamp or keras, got {scaler!r}")
    edits = {"none": [], "bf16": BF16, "f16": F16_JAXAMP if scaler == "jaxamp" else F16_KERAS}[amp]
    init = ""
    if initial_scale is not None:  # not a line of the port: the overflow run's first scale
        init = f"scaler={initial_scale!r}" if scaler == "jaxamp" else f", initial_scale={initial_scale!r}"
    source = GUIDE
    for old, new in edits:
        if source.count(old) != 1:
            raise RuntimeError(f"the guide's code changed: {old.strip()!r} is not there once")
        source = source.replace(old, new.replace("{init}", init))
    return source


def scale_figures(model, steps: int) -> dict:
    """f16's loss scale and skipped steps after `steps` training steps, for either scaler."""
    import jaxamp

    if hasattr(model, "loss_scale"):  # --scaler=jaxamp: the DynamicScalerState's variables
        state = jaxamp.DynamicScalerState(*[v.value for v in model.loss_scale])
        metrics = jaxamp.scaling.scale_metrics(state)
        return {"loss_scale": float(metrics["loss_scale"]), "skipped_steps": int(metrics["skipped_steps"])}
    # Keras's LossScaleOptimizer keeps no count of skipped steps: its inner optimizer's
    # `iterations` counts the applied ones.
    optimizer = model.optimizer
    return {
        "loss_scale": float(optimizer.dynamic_scale.value),
        "skipped_steps": steps - int(optimizer.inner_optimizer.iterations.value),
    }


def execute(source: str, label: str, quiet: bool = False) -> types.ModuleType:
    """Run `source` (the guide's program, edited) as a module of its own, Keras seeded with 0; the module.

    `label` names the module (Keras looks a model's class up by its module) and
    the code; `quiet` hides fit's progress bars.
    """
    import keras

    keras.utils.set_random_seed(0)  # not the guide's: the same weights and data every run
    module = types.ModuleType(f"keras_fit_guide_{label}")
    module.__file__ = __file__
    sys.modules[module.__name__] = module
    code = compile(source, f"<custom_train_step_in_jax, {label}>", "exec", dont_inherit=True)
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
        exec(code, module.__dict__)
    return module


def run(amp: str = "none", scaler: str = "jaxamp", initial_scale: float | None = None, quiet: bool = False) -> dict:
    """Run the edited guide (seed 0); returns its module namespace, epoch losses and f16's scale."""
    module = execute(edited_source(amp, scaler, initial_scale), f"{amp}_{scaler}", quiet)
    model = module.model
    out = {"module": module, "model": model, "loss": [float(v) for v in model.history.history["loss"]]}
    if amp == "f16":
        steps = len(out["loss"]) * -(-len(module.x) // 32)  # fit's default batch size: 32
        out.update(scale_figures(model, steps))
    return out


def lso_alone(optimizer: str) -> dict[str, list[float]]:
    """The guide in float32 with `optimizer`, plain and inside Keras's LossScaleOptimizer with nothing else changed.

    The trap porting.md warns of: the guide's ``train_step`` never scales the
    loss, so the wrapper only divides true-scale gradients by its scale.
    """
    compiled = {
        "plain": f'"{optimizer}"',
        "LossScaleOptimizer alone": f'keras.optimizers.LossScaleOptimizer(keras.optimizers.get("{optimizer}"))',
    }
    losses = {}
    for i, (name, optimizer_code) in enumerate(compiled.items()):
        source = GUIDE.replace('model.compile(optimizer="adam"', f"model.compile(optimizer={optimizer_code}")
        model = execute(source, f"lso_alone_{optimizer}_{i}", quiet=True).model
        losses[name] = [float(v) for v in model.history.history["loss"]]
    return losses


def _line(name: str, result: dict, reference: list[float] | None) -> str:
    losses = " ".join(f"{v:.5f}" for v in result["loss"])
    line = f"{name:34s} loss per epoch: {losses}"
    if reference is not None:
        line += f"  ({(result['loss'][-1] / reference[-1] - 1) * 100:+.3f}% vs float32 at epoch 3)"
    if "loss_scale" in result:
        line += f", loss scale {result['loss_scale']:g}, {result['skipped_steps']} skipped"
    return line


def _number(text: str) -> float:
    """A number, or a power as Python writes one: ``16777216``, ``2.0**24``."""
    base, _, power = text.partition("**")
    return float(base) ** float(power or 1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--amp", choices=("none", "bf16", "f16"), default="f16")
    parser.add_argument("--scaler", choices=("jaxamp", "keras"), default="jaxamp")
    parser.add_argument("--initial_scale", type=_number, default=None, help="f16's first scale, e.g. 2.0**24")
    parser.add_argument("--show_diff", action="store_true", help="print the port's diff against the guide")
    parser.add_argument("--table", action="store_true", help="run every configuration, one line each")
    parser.add_argument(
        "--lso_alone", action="store_true", help="float32, SGD and Adam, with LossScaleOptimizer swapped in alone"
    )
    args = parser.parse_args(argv)
    if args.lso_alone:
        results = {}
        for optimizer in ("sgd", "adam"):
            results[optimizer] = lso_alone(optimizer)
            for name, losses in results[optimizer].items():
                print(f"{optimizer:5s} {name:25s} loss per epoch: {' '.join(f'{v:.5f}' for v in losses)}", flush=True)
        return results
    if args.table:
        runs = {
            "float32 (the guide, unedited)": ("none", "jaxamp", None),
            "amp bf16": ("bf16", "jaxamp", None),
            "amp f16, jaxamp scaler": ("f16", "jaxamp", None),
            "amp f16, Keras LossScaleOptimizer": ("f16", "keras", None),
            "amp f16, jaxamp scaler, 2^24": ("f16", "jaxamp", 2.0**24),
            "amp f16, LossScaleOptimizer, 2^24": ("f16", "keras", 2.0**24),
        }
        results, reference = {}, None
        for name, (amp, scaler, initial_scale) in runs.items():
            results[name] = run(amp, scaler, initial_scale, quiet=True)
            print(_line(name, results[name], reference), flush=True)
            reference = reference or results[name]["loss"]
        return results
    if args.show_diff:
        source = edited_source(args.amp, args.scaler, args.initial_scale)
        sys.stdout.writelines(
            difflib.unified_diff(
                GUIDE.splitlines(keepends=True),
                source.splitlines(keepends=True),
                "custom_train_step_in_jax.py",
                f"custom_train_step_in_jax.py (amp={args.amp})",
            )
        )
    result = run(args.amp, args.scaler, args.initial_scale)
    print(_line(f"[{args.amp}]", result, None), flush=True)
    return result


if __name__ == "__main__":
    main()
