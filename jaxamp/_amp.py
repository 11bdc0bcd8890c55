"""`amp`: trace a function to a jaxpr and re-run it in mixed precision."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from ._eager_cache import EagerCache
from ._options import UNSET, AmpOptions
from .fp8._state import Fp8State
from .scaling._backward_scale import backward_scale
from .scaling._in_grad import LossScaling

__all__ = ["amp"]


def amp(
    fn: Callable | None = None,
    *,
    compute_dtype: Any = UNSET,
    amp_policy: Mapping[Any, Callable] | None = None,
    policy: Any = None,
    float32_gradient_reductions: bool = False,
    loss_scale: Any = None,
) -> Callable:
    """Make `fn` run in mixed precision.

    `fn` is traced to a jaxpr and every equation, including those inside jit'd
    functions, scans, while loops, conds, remat blocks, custom_jvp/custom_vjp
    rules and shard_map bodies, is re-run with its operands cast by the rule
    `amp_policy` picks for it. Array outputs come back in the dtypes `fn` itself
    returns.

    Usable as ``amp(f)``, ``amp(f, compute_dtype="bf16")``, ``@amp`` and
    ``@amp(compute_dtype=jnp.bfloat16)``.

    Called eagerly (outside ``jit``, ``grad``...), the mixed-precision function
    keeps its rewritten program per call signature, as `jax.jit` keeps its
    traces: the array arguments' shapes and dtypes, the other arguments by
    value, the policy table's contents, the named scopes and JAX's
    configuration. It runs equation by equation as eager JAX does; Python
    state `fn` reads without taking it as an argument is fixed at the first
    call of a signature, as under `jax.jit`. The cache (32 signatures, least
    recently used first out) is the function's ``eager_cache`` attribute
    (``hits``, ``misses``, ``maxsize``, ``clear()``).

    Args:
        fn: the function. Array leaves of its arguments are traced; everything
            else (Python scalars, strings, callables, Equinox static fields) is
            static, as `equinox.filter_make_jaxpr` treats them.
        compute_dtype: the low-precision dtype (``jnp.float16`` by default,
            ``jnp.bfloat16``, or a name: ``"bf16"``, ``"f16"``, ``"half"``...),
            or fp8 mode: ``"fp8"`` (``"float8"``) or a `jaxamp.fp8.Fp8Recipe`,
            which computes in bfloat16 with float8 matmuls (docs/float8.md).
        amp_policy: the rule table, keyed by primitive (``jax.lax.add_p``) or by
            `jax.named_scope` name; `default_amp_policy` when omitted.
        policy: a `jaxamp.Policy` or policy string (``"p=f32,c=bf16,o=f32"``):
            compute in its compute dtype and cast floating outputs to its
            output dtype. Cannot be combined with `compute_dtype`.
        float32_gradient_reductions: matmuls (`dot_general`) that run in the
            compute dtype accumulate in float32 and hand their result on in the
            compute dtype, so that in a data-parallel step the cross-device sum
            of their weight gradients runs in float32, not in float16/bfloat16
            (it doubles those all-reduces' bytes; see docs/distributed.md).
            Convolutions and grouped matmuls keep accumulating in the compute
            dtype; amp warns once when it meets one.
        loss_scale: dynamic loss scaling inside the gradient, for float16:
            the state of an optimizer wrapped in `jaxamp.loss_scaling` (the
            whole state tree, or a flax ``TrainState`` holding it; its one
            `LossScaleState` is found by type), a
            `DynamicScalerState`, or a scale (a positive float or float
            scalar array). Where a framework's step owns the state (Tunix,
            MaxText): the `jaxamp.loss_scaling` transformation itself (or an
            optax wrapper, an ``nnx.Optimizer`` or a trainer holding it),
            whose live scale amp reads in whatever traces the function (an
            overflow then hands back zeros, not NaN, and flags the update;
            docs/porting.md). The function's value is unchanged; a transform
            that differentiates it (`jax.grad`, `equinox.filter_grad`,
            `nnx.grad`...) multiplies the output's cotangent by the scale,
            runs the half-precision backward pass on the scaled values, and
            divides the cotangent of everything the function differentiates
            (its arguments, the values it closes over, the arrays of a module
            passed as `fn`) by the scale in float32: the gradients come back
            in their true scale and their own dtype, all NaN where the scaled
            backward overflowed anywhere (the wrapper's update then skips the
            step and shrinks the scale). custom_vjp rules inside see
            true-scale cotangents; an amp inside this one scales nothing
            more. Module state the function changes or returns is kept as
            it was given when the forward pass (the loss, or that state) was
            not finite: flax nnx modules among its arguments, ``eqx.nn.State``,
            dicts of arrays by module (haiku's state, Linen statistics) of an
            argument's signature, a ``TrainState``'s ``batch_stats``; one
            decision for all devices. docs/loss_scaling.md lists what is
            covered, the optimizer placements amp refuses, and the one
            ``jaxamp.select_tree`` line for state it does not recognise.
            The eager cache is not used.

    Returns:
        The mixed-precision function (or a decorator when `fn` is omitted).
        With ``Fp8Recipe(scaling="delayed")`` it takes one more keyword
        argument, ``fp8_state=`` (a `jaxamp.fp8.Fp8State`, see `jaxamp.fp8.init_fp8_state`),
        and is never cached eagerly.

    Raises:
        TypeError: `fn` is not callable, `compute_dtype` is not a float16,
            bfloat16 or float32 dtype (nor fp8 mode), or `amp_policy` is malformed.
        ValueError: an unknown dtype name or policy string, a `policy`
            whose compute dtype disagrees with `compute_dtype`, a
            `loss_scale` state whose `loss_scaling` sits where a skipped
            step would still commit state (a chain with transformations
            after it, one partition of ``multi_transform``, inside
            ``MultiSteps``), or (when called) a `loss_scale` optimizer state
            that a jitted function closes over instead of taking it as an
            argument: its scale would be a constant of the compiled function.
        TypeError: (when called) forward-mode differentiation (`jax.jvp`,
            `jax.jacfwd`, `jax.hessian`) of a function made with `loss_scale`.
    """
    settings = dict(
        compute_dtype=compute_dtype,
        amp_policy=amp_policy,
        policy=policy,
        float32_gradient_reductions=float32_gradient_reductions,
    )
    options = AmpOptions.resolve(**settings)
    # Validated here, before the function: a bad scale is named at once.
    scaling = None if loss_scale is None else LossScaling(loss_scale)
    if fn is None:
        return functools.partial(amp, **settings, loss_scale=loss_scale)
    if not callable(fn):
        raise TypeError(
            f"amp expects a callable (a function, or an Equinox module with a "
            f"__call__ method), got {type(fn).__name__}: {fn!r:.100}."
        )

    cache = EagerCache()
    delayed = options.fp8 is not None and options.fp8.scaling == "delayed"

    @functools.wraps(fn)
    def amp_fn(*args, **kwargs):
        if delayed:
            state = _delayed_state(kwargs.pop("fp8_state", None))

            # Not cached eagerly: the histories are inputs of this call only.
            def run(**hooks: Any) -> Any:
                # Read inside `scaling.run`, which sets this call's own scale
                # (on top of an enclosing scaler's): the histories keep
                # true-scale cotangent amaxes (`jaxamp.scaling._backward_scale`).
                scale = backward_scale()
                return options.run(fn, args, kwargs, site_state=state.site_state(), cotangent_scale=scale, **hooks)

            return run() if scaling is None else scaling.run(run, (args, kwargs))
        if "fp8_state" in kwargs and not _takes_keyword(fn, "fp8_state"):
            raise TypeError(
                "fp8_state= is the amax histories of Fp8Recipe(scaling='delayed'); this function was made by "
                f"jaxamp.amp with {options.fp8 or options.compute_dtype.name!r}, which keeps no state. Pass "
                "compute_dtype=jaxamp.fp8.Fp8Recipe(scaling='delayed') to amp, or drop fp8_state."
            )
        if scaling is not None:
            # Not cached: the scale is an input of this call, often a tracer.
            return scaling.run(functools.partial(options.run, fn, args, kwargs), (args, kwargs))
        return cache.call(options, fn, args, kwargs)

    amp_fn.eager_cache = cache  # type: ignore[attr-defined]
    amp_fn._jaxamp_amp = (options, fn)  # type: ignore[attr-defined]  # for `jaxamp.fp8.init_fp8_state`
    return amp_fn


def _takes_keyword(fn: Callable, name: str) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read: let the call decide
        return True
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _delayed_state(state: Any) -> Fp8State:
    if state is None:
        raise TypeError(
            "this function was made by jaxamp.amp with Fp8Recipe(scaling='delayed'), whose scales come "
            "from amax histories: pass them as fp8_state=..., made once by "
            "jaxamp.fp8.init_fp8_state(fn, *args) and updated each step from their gradient "
            "(state.update(observed)); docs/float8.md shows the step."
        )
    if not isinstance(state, Fp8State):
        raise TypeError(
            f"fp8_state must be a jaxamp.fp8.Fp8State (from jaxamp.fp8.init_fp8_state), got {type(state).__name__}."
        )
    return state
