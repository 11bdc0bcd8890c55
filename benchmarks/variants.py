"""The six precision variants the benchmarks compare, applied to any loss function.

===================  =======================================================
``f32``              the loss as written (float32 everywhere)
``hand_bf16``        jmp style: parameters and inputs cast to bfloat16 at the
                     top with a `jaxamp.Policy`, the loss upcast to float32 by
                     the model code (`benchmarks.models.cross_entropy`)
``amp_bf16``         ``jaxamp.amp(loss, compute_dtype="bf16")``
``hand_f16_scaled``  ``hand_bf16`` with float16 (policy ``p=f32,c=f16,o=f32``),
                     with the same dynamic loss scaling as ``amp_f16_scaled``
``amp_f16_scaled``   ``jaxamp.amp(loss, compute_dtype="f16")`` differentiated by
                     `jaxamp.dynamic_scale_value_and_grad`, skipping the
                     optimizer step when the gradients are not finite
``amp_fp8``          ``jaxamp.amp(loss, compute_dtype=Fp8Recipe(keep_small_bf16=None))``:
                     amp bf16 with float8 matmuls (current scaling) at every
                     size, so that the figures of every model size (tiny
                     included) measure float8; ``compute_dtype="fp8"`` keeps
                     the matmuls too small to gain in bf16, which the GPU
                     preset (`benchmarks.gpu`) times beside it (docs/float8.md)
===================  =======================================================

Each amp variant is compared with the hand-cast variant of its compute dtype
(`Variant.compare_with`): what amp should match is what a careful user writes
by hand.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import optax

import jaxamp

__all__ = ["VARIANTS", "Variant", "hand_cast"]

_HAND_CAST_POLICY = jaxamp.get_policy("p=f32,c=bf16,o=f32")
_HAND_CAST_F16_POLICY = jaxamp.get_policy("p=f32,c=f16,o=f32")


# fp8 at every size: the static figures measure float8 at every model size (see the table above).
FP8_EVERY_SIZE = jaxamp.fp8.Fp8Recipe(keep_small_bf16=None)


def hand_cast(loss_fn: Callable, policy: jaxamp.Policy = _HAND_CAST_POLICY) -> Callable:
    """Wrap ``loss_fn(params, *batch)`` the way jmp users write mixed precision.

    Floating parameters and inputs are cast to ``policy.compute_dtype`` on the way
    in and the loss to ``policy.output_dtype`` on the way out; everything in
    between runs in whatever dtype its operands have.
    """

    def loss(params, *batch):
        params, batch = policy.cast_to_compute((params, batch))
        return policy.cast_to_output(loss_fn(params, *batch))

    return loss


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of running a loss in (mixed) precision.

    Attributes:
        key: short identifier, used in file names and on the command line.
        label: what tables and plots call it.
        wrap: ``wrap(loss_fn) -> loss_fn`` applying the precision choice.
        scaled: differentiate with dynamic loss scaling.
        scale_in_optimizer: the scale lives in the optimizer state
            (`jaxamp.loss_scaling`) and ``amp(..., loss_scale=opt_state)``
            scales inside the gradient, instead of the explicit
            `DynamicScalerState` threaded beside it.
        compare_with: key of the hand-cast variant the tables set this one
            against (the same compute dtype; bf16 for float32 and fp8).
    """

    key: str
    label: str
    wrap: Callable[[Callable], Callable]
    scaled: bool = False
    scale_in_optimizer: bool = False
    compare_with: str = "hand_bf16"

    def init_scaler(self) -> jaxamp.DynamicScalerState | None:
        """The loss-scaler state the gradient function starts from (None if unscaled)."""
        return jaxamp.DynamicScalerState() if self.scaled else None

    def value_and_grad(self, loss_fn: Callable) -> Callable:
        """``grad_fn(scaler, params, *batch) -> (loss, grads, scaler)`` for this variant.

        Unscaled variants pass ``scaler`` (None) through untouched, so that all
        variants are called, lowered and timed the same way.
        """
        if self.scale_in_optimizer:
            # One step's gradients at the scaler's scale (the optimizer's
            # update, which would move it, is `train_step`'s).
            def in_grad_fn(scaler, params, *batch):
                value, grads = jax.value_and_grad(self.wrap(loss_fn, loss_scale=scaler))(params, *batch)
                return value, grads, scaler

            return in_grad_fn
        loss = self.wrap(loss_fn)
        if not self.scaled:
            plain = jax.value_and_grad(loss)

            def grad_fn(scaler, params, *batch):
                value, grads = plain(params, *batch)
                return value, grads, scaler

            return grad_fn
        # redo_on_nan=0: a non-finite step is skipped by the optimizer (below)
        # rather than recomputed in a while loop, as PyTorch's GradScaler does.
        scaled = jaxamp.dynamic_scale_value_and_grad(loss, redo_on_nan=0)

        def scaled_grad_fn(scaler, params, *batch):
            scaler, (value, grads) = scaled(params, *batch, dynamic_scaler_state=scaler)
            return value, grads, scaler

        return scaled_grad_fn

    def train_step(
        self, loss_fn: Callable, optimizer: optax.GradientTransformation
    ) -> tuple[Callable, optax.GradientTransformation]:
        """One optimizer step: ``step(params, opt_state, scaler, *batch)``.

        Returns:
            ``(step, optimizer)``; initialise the optimizer state with the
            returned optimizer (for scaled variants it is wrapped in
            `jaxamp.scaling.skip_nonfinite_updates`, or in `jaxamp.loss_scaling`
            when the scale lives there). ``step`` returns
            ``(params, opt_state, scaler, loss)``; with the scale in the
            optimizer state, ``scaler`` is that state's `DynamicScalerState`
            (the input ``scaler`` is not read).
        """
        if self.scale_in_optimizer:
            optimizer = jaxamp.loss_scaling(optimizer)

            def in_grad_step(params: Any, opt_state: Any, scaler: Any, *batch: Any):
                loss = self.wrap(loss_fn, loss_scale=opt_state)
                value, grads = jax.value_and_grad(loss)(params, *batch)
                updates, opt_state = optimizer.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state, opt_state.scaler_state, value

            return in_grad_step, optimizer
        grad_fn = self.value_and_grad(loss_fn)
        if self.scaled:
            optimizer = jaxamp.scaling.skip_nonfinite_updates(optimizer)

        def step(params: Any, opt_state: Any, scaler: Any, *batch: Any):
            value, grads, scaler = grad_fn(scaler, params, *batch)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            if self.scaled:
                params = jaxamp.scaling.apply_if_finite_updates(params, updates, opt_state.last_finite)
            else:
                params = optax.apply_updates(params, updates)
            return params, opt_state, scaler, value

        return step, optimizer


def _identity(loss_fn: Callable) -> Callable:
    return loss_fn


VARIANTS: dict[str, Variant] = {
    v.key: v
    for v in (
        Variant("f32", "float32", _identity),
        Variant("hand_bf16", "hand-cast bf16", hand_cast),
        Variant("amp_bf16", "amp bf16", functools.partial(jaxamp.amp, compute_dtype="bf16")),
        Variant(
            "hand_f16_scaled",
            "hand-cast f16 + dynamic scaling",
            functools.partial(hand_cast, policy=_HAND_CAST_F16_POLICY),
            scaled=True,
            compare_with="hand_f16_scaled",
        ),
        Variant(
            "amp_f16_scaled",
            "amp f16 + dynamic scaling",
            functools.partial(jaxamp.amp, compute_dtype="f16"),
            scaled=True,
            compare_with="hand_f16_scaled",
        ),
        Variant(
            "amp_f16_in_grad",
            "amp f16 + scale in the optimizer state",
            functools.partial(jaxamp.amp, compute_dtype="f16"),
            scaled=True,
            scale_in_optimizer=True,
            compare_with="hand_f16_scaled",
        ),
        Variant("amp_fp8", "amp fp8", functools.partial(jaxamp.amp, compute_dtype=FP8_EVERY_SIZE)),
    )
}
"""The variants by key, in the order tables list them."""
