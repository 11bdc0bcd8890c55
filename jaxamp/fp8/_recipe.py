"""fp8 mode's choices: `Fp8Recipe`, and the `compute_dtype` names that ask for it."""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_dtypes
import numpy as np
from jax import lax

__all__ = [
    "AMAX_ALGORITHMS",
    "BLOCK_SCALINGS",
    "FAST_ACCUMULATION",
    "FP8_NAMES",
    "SCALINGS",
    "Fp8Recipe",
    "as_recipe",
]

FP8_NAMES = ("fp8", "float8")
"""The `compute_dtype` names of fp8 mode (case and surrounding spaces ignored)."""
SCALINGS = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8", "blockwise", "delayed")
"""`Fp8Recipe.scaling` values (torchao's names, NVIDIA's and Transformer Engine's block recipes, and
Transformer Engine's delayed scaling)."""
BLOCK_SCALINGS = ("mxfp8", "blockwise")
"""The scalings with a scale per block of each product's contraction (power-of-two scales)."""
FAST_ACCUMULATION = ("forward", "all", "none")
"""`Fp8Recipe.fast_accumulation` values: which float8 GEMMs may accumulate fast."""
AMAX_ALGORITHMS = ("max", "most_recent")
"""`Fp8Recipe.amax_compute_algo` values (Transformer Engine's names)."""


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """The choices of amp's float8 mode: pass as ``amp(fn, compute_dtype=Fp8Recipe(...))``.

    ``compute_dtype="fp8"`` (or ``"float8"``) is ``Fp8Recipe()``. Scaling is
    "current" (each scale comes from an amax of the live tensor in the same
    step, so there is no scaling state to carry between steps), except with
    ``scaling="delayed"``.

    Attributes:
        scaling: how many scales a matmul's operands get.
            ``"tensorwise"`` (the default; Transformer Engine's
            ``Float8CurrentScaling``, torchao's tensorwise): one per operand
            and per cotangent; the backward pass reuses the float8 operands.
            ``"rowwise"`` (torchao's rowwise): one per row of each operand
            along the contraction (a left operand's row, a right operand's
            column), so a row of small values keeps its precision beside
            large ones; the backward pass saves the operands in bfloat16 (2
            bytes per element, against tensorwise's 1) and quantises them
            again along its own contractions, as torchao does.
            ``"rowwise_with_gw_hp"``: rowwise, with the weight gradient (the
            right operand's) computed in bfloat16 (torchao's recipe of that
            name). ``"mxfp8"`` (NVIDIA's MXFP8 pretraining recipe, the OCP
            MX format): a scale per block of 32 consecutive entries along
            each product's contraction, forward and backward, stored as e8m0
            and rounded up (as `jax.nn.scaled_dot_general` quantises, whose
            quantiser this equals bit for bit; the OCP spec's floor can
            saturate the block's largest entry), every tensor e4m3.
            ``"blockwise"`` (Transformer Engine's ``Float8BlockScaling``, the
            fine-grained recipe Hopper runs): 1x128 tiles along the
            contraction for activations and gradients, 128x128 tiles for the
            right operand (the weight) where its sizes allow, power-of-two
            scales, e4m3. Both save the operands in bfloat16 and quantise
            them again along each gradient matmul's contraction; a matmul
            whose contraction, rows or output features the block size does not
            divide, or whose operand is split over an Explicit mesh, runs
            tensorwise (``explain`` says why). Rowwise and block scaling apply
            to ``dot_general``; convolutions and grouped matmuls keep their
            own scaling. ``"delayed"`` (Transformer Engine's
            ``DelayedScaling``): tensorwise, each scale from the amaxes of
            past steps (`amax_history_length`, `amax_compute_algo`,
            `margin`), kept in a `jaxamp.fp8.Fp8State` that the step passes in
            (``fn(*args, fp8_state=state)``, made by `jaxamp.fp8.init_fp8_state`)
            and updates from its gradient (`Fp8State.update`); docs/float8.md,
            "The delayed recipe", shows the step. A matmul whose state cannot be
            threaded to it (inside a custom derivative rule) and a grouped
            matmul run with current scaling, said once. On a mesh the scales
            need no collective (the amaxes for the next step are reduced off
            the critical path; inside ``shard_map`` and ``pmap``, by a ``pmax``).
        power_of_two_scales: round each scale up to a power of two, so that
            scaling changes no mantissa bit. None (the default) means True
            for the rowwise recipes and False for tensorwise and delayed, as
            torchao and Transformer Engine.
        min_flops: matmuls of fewer FLOPs (``2 * M * N * K`` per call, from the
            shapes) stay in bfloat16. Quantising costs two passes over each
            operand, which only a large enough matmul earns back; where that
            crossover lies depends on the GPU and was not measured here, so the
            default, 0, keeps no matmul out on this ground (see docs/float8.md, "Accuracy, and when it pays").
        keep_small_bf16: ``(K, N)``: a matmul whose contraction size is at
            most K and whose output features (a dot's right-hand free size, a
            convolution's output features) at most N stays in bfloat16, as too
            small to gain; None keeps none out on this ground. The default,
            ``(1024, 4096)``, is torchao's tensorwise filter as it runs
            (``_auto_filter_for_tensorwise``, from H100 measurements): it
            names the pair ``K, N = weight.shape`` and skips a layer when
            ``K <= 4096 and N <= 1024``, but a torch ``Linear`` weight is
            (out, in), so it keeps a layer in bf16 when its input features (the
            contraction) are at most 1024 and its output features at most
            4096. Each float8 matmul adds passes over its operands (an amax
            and a quantisation of each, and of the cotangent) that only a
            large enough GEMM earns back. The rule reads the weight's sizes,
            not the batch, so a step keeps the same matmuls in float8 at any
            batch size.
        min_contraction: matmuls whose contraction (summed-over) size is
            smaller stay in bfloat16. Default 16: below it float8 gains no
            speed (float8 GEMMs take dimensions in multiples of 16) and each
            output sums too few products to average out e4m3's rounding. For
            a convolution the contraction is input features per group times
            the kernel window.
        gemm_multiple: matmuls whose contraction size or output features (a
            dot's right-hand free dimensions; a convolution's input features
            per group and output features) are not multiples of it stay in
            bfloat16. Default 16: float8 GEMMs (cuBLASLt, cuDNN) take
            dimensions in multiples of 16. 1 lets every size through.
        keep_last_matmul_bf16: keep the forward program's last matmuls in
            bfloat16 (the default, as torchao's and torchtitan's float8
            setups keep the output projection): each matmul whose result
            reaches the program's outputs with no matmul after it, usually
            the logits projection, whose errors go straight into the loss.
            It is found by its place in the program, through calls, scans and
            while loops (`jaxamp.analyses._tail`), not by its shape: layers of
            the head's shape, a jit'd layer the head shares, an embedding
            reused as the head stay in float8; a model with several heads
            keeps each. The forward program is the one amp
            traces, so put amp inside `jax.grad`, not around it. Under
            `jax.grad` a function with a custom derivative
            (`jax.custom_vjp`, `jax.custom_jvp`) runs its derivative rule,
            traced apart from the program, so a last matmul inside one is
            not found: pin that function's scope instead,
            ``{"head": jaxamp.use_precision("bf16")}``.
        attention: run batched matmuls (a ``dot_general`` with batch
            dimensions: attention's scores and values, per-head products) in
            float8 too. Default False, as Transformer Engine keeps attention
            out of float8 unless asked: both operands are activations, and
            one scale across all heads costs the heads with small values
            their precision.
        grouped: run grouped matmuls (``lax.ragged_dot``, mixture-of-experts
            layers) in float8, with a scale per group (expert) for each
            operand and cotangent, as Transformer Engine's grouped
            quantisation does. Default False.
        gradient_format: the float8 format of the cotangent in the gradient
            matmuls (the saved operands are e4m3): ``"e5m2"`` (wider range,
            Transformer Engine's HYBRID format) or ``"e4m3"`` (one more
            mantissa bit). None (the default): e5m2 for the tensorwise and
            rowwise recipes, e4m3 for mxfp8 and blockwise (NVIDIA's MXFP8
            recipe). Convolutions take one dtype on both sides, so their
            gradients run e4m3 x e4m3 whatever this says (``explain`` shows
            each matmul's formats).
        fast_accumulation: which float8 GEMMs may accumulate fast (in
            fewer bits, as Hopper's float8 tensor cores do unless told
            otherwise): ``"forward"`` (the default: Transformer Engine's and
            flax's fp8 ops' choice; the gradient GEMMs accumulate fully),
            ``"all"`` or ``"none"``. Recorded as the emitted float8
            ``dot_general``'s ``precision``, as flax's fp8 ops record it:
            ``Precision.DEFAULT`` may accumulate fast, ``Precision.HIGHEST``
            may not (XLA's GPU float8 GEMMs read it; on a CPU both
            accumulate in float32).

        amax_history_length: the delayed recipe's history: how many steps'
            amaxes each matmul keeps (Transformer Engine's default, 1024).
        amax_compute_algo: which amax of the history scales the next step:
            ``"max"`` (the default) or ``"most_recent"``.
        margin: the delayed recipe's scales leave ``2**margin`` of headroom
            (default 0): a value up to that much larger than the history's
            amax still fits without saturating.

    Raises:
        TypeError: a field of the wrong type.
        ValueError: an unknown ``scaling``, ``gradient_format`` or
            ``fast_accumulation`` or ``amax_compute_algo``, a negative
            ``min_flops``, ``margin`` or ``keep_small_bf16`` size, a ``min_contraction``,
            ``gemm_multiple`` or ``amax_history_length`` below 1,
            or ``power_of_two_scales=False`` with a block recipe.
    """

    scaling: str = "tensorwise"
    power_of_two_scales: bool | None = None
    min_flops: int = 0
    keep_small_bf16: tuple[int, int] | None = (1024, 4096)
    min_contraction: int = 16
    gemm_multiple: int = 16
    keep_last_matmul_bf16: bool = True
    attention: bool = False
    grouped: bool = False
    gradient_format: str | None = None
    fast_accumulation: str = "forward"
    amax_history_length: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0

    def __post_init__(self) -> None:
        limits = (
            ("min_flops", 0),
            ("min_contraction", 1),
            ("gemm_multiple", 1),
            ("amax_history_length", 1),
            ("margin", 0),
        )
        for name, least in limits:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"Fp8Recipe.{name} must be an int, got {value!r} ({type(value).__name__}).")
            if value < least:
                raise ValueError(f"Fp8Recipe.{name} must be at least {least}, got {value}.")
        small = self.keep_small_bf16
        if small is not None:
            if not (
                isinstance(small, tuple)
                and len(small) == 2
                and all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in small)
            ):
                raise TypeError(f"Fp8Recipe.keep_small_bf16 must be None or a tuple of two ints (K, N), got {small!r}.")
            if min(small) < 0:
                raise ValueError(f"Fp8Recipe.keep_small_bf16 sizes must be at least 0, got {small}.")
        if self.scaling not in SCALINGS:
            raise ValueError(f"Fp8Recipe.scaling must be one of {SCALINGS}, got {self.scaling!r}.")
        if self.scaling in BLOCK_SCALINGS and self.power_of_two_scales is False:
            raise ValueError(
                f"Fp8Recipe(scaling={self.scaling!r}) scales by powers of two (e8m0 or Transformer Engine's "
                "power-of-two block scales); power_of_two_scales=False does not apply to it."
            )
        if self.power_of_two_scales is not None and not isinstance(self.power_of_two_scales, (bool, np.bool_)):
            raise TypeError(
                "Fp8Recipe.power_of_two_scales must be a bool or None, got "
                f"{self.power_of_two_scales!r} ({type(self.power_of_two_scales).__name__})."
            )
        if self.gradient_format not in (None, "e4m3", "e5m2"):
            raise ValueError(f"Fp8Recipe.gradient_format must be None, 'e4m3' or 'e5m2', got {self.gradient_format!r}.")
        if self.amax_compute_algo not in AMAX_ALGORITHMS:
            raise ValueError(
                f"Fp8Recipe.amax_compute_algo must be one of {AMAX_ALGORITHMS}, got {self.amax_compute_algo!r}."
            )
        if self.fast_accumulation not in FAST_ACCUMULATION:
            raise ValueError(
                f"Fp8Recipe.fast_accumulation must be one of {FAST_ACCUMULATION}, got {self.fast_accumulation!r}."
            )
        for name in ("keep_last_matmul_bf16", "attention", "grouped"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"Fp8Recipe.{name} must be a bool, got {value!r} ({type(value).__name__}).")

    def gradient_dtype(self, primitive_name: str) -> np.dtype:
        """The cotangent's float8 dtype in the gradient matmuls of a `primitive_name` matmul.

        A convolution takes one dtype for both operands, and e4m3 on both
        sides halved the gradient error of e5m2 on both sides on the digits
        CNN's convolutions (figures in docs/float8.md, "float8 matmuls"): with a scale taken
        from the live cotangent, e5m2's extra range is not needed for its
        largest values, and its 2 mantissa bits cost more than e4m3's 3.
        """
        if primitive_name == "conv_general_dilated":
            return np.dtype(ml_dtypes.float8_e4m3fn)
        name = self.gradient_format or ("e4m3" if self.scaling in BLOCK_SCALINGS else "e5m2")
        return np.dtype(ml_dtypes.float8_e4m3fn if name == "e4m3" else ml_dtypes.float8_e5m2)

    def accumulation_precisions(self) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
        """``(forward, gradient)``: the ``precision`` of the float8 GEMMs of each pass (`fast_accumulation`)."""
        fast, full = (lax.Precision.DEFAULT,) * 2, (lax.Precision.HIGHEST,) * 2
        forward = fast if self.fast_accumulation in ("forward", "all") else full
        return forward, fast if self.fast_accumulation == "all" else full

    @property
    def rounds_scales_to_powers_of_two(self) -> bool:
        """`power_of_two_scales` with its default resolved."""
        if self.power_of_two_scales is None:
            return self.scaling not in ("tensorwise", "delayed")
        return bool(self.power_of_two_scales)


def as_recipe(compute_dtype: Any) -> Fp8Recipe | None:
    """The `Fp8Recipe` a `compute_dtype` argument asks for, or None if it names no fp8 mode.

    Args:
        compute_dtype: an `Fp8Recipe`, one of `FP8_NAMES`, or anything else
            (a dtype or dtype name, which the caller validates).

    Returns:
        The recipe (``Fp8Recipe()`` for a name), or None.
    """
    if isinstance(compute_dtype, Fp8Recipe):
        return compute_dtype
    if isinstance(compute_dtype, str) and compute_dtype.strip().lower() in FP8_NAMES:
        return Fp8Recipe()
    return None
