"""`amp_module`: a flax nnx model that runs under amp wherever it is called.

Frameworks that own the training loop (Tunix, say) call a model in places the
user does not write: a sampler that keeps ``nnx.graphdef(model)`` and calls
``nnx.merge(graphdef, params)(...)`` inside its own `jax.jit`, a reference
model scored in another jitted function. Wrapping one call site with `amp`
leaves the others in float32, which is itself a mismatch between the sampler
and the trainer. `amp_module` changes the model's class instead: the graph
definition records it, so every copy ``nnx.merge`` makes runs amp too.
"""

from __future__ import annotations

import functools
import sys
import threading
import types
from typing import Any

from ._amp import amp
from ._options import UNSET, AmpOptions
from .scaling._live_scale import find_live_scale

__all__ = ["amp_module"]

_CLASSES: dict[tuple, type] = {}  # (base class, options key) -> its amp subclass
_CLASSES_LOCK = threading.Lock()
_MARK = "_jaxamp_amp_module"  # class attribute of the subclasses: (base class, options key, settings)


def amp_module(module: Any, *more_modules: Any, **amp_kwargs: Any) -> Any:
    """Make flax nnx modules run their ``__call__`` under `amp`, in every copy of them.

    Each module's class is swapped, in place, for a subclass (``AmpQwen2`` for a
    ``Qwen2``; one per class and settings) whose ``__call__`` is
    ``amp(Base.__call__, **amp_kwargs)(self, ...)``. Its other methods,
    attributes and the signature of ``__call__`` are the base class's, and its
    state is unchanged: `nnx.state` has the same paths and dtypes, so
    checkpoints restore either way. `nnx.graphdef` records the subclass, so
    modules rebuilt with `nnx.merge` (inside `nnx.jit`, a sampler's
    `jax.jit`'d decode step, a reference model's scoring) run amp as well.
    State the call mutates (BatchNorm statistics, `nnx.Rngs` counters, caches
    held in Variables) is written back, in its own dtype, as amp does for nnx
    modules among its arguments. Calling the module outside a trace re-traces
    it on every call: jit the caller.

    Args:
        module: a flax nnx Module with a ``__call__``.
        *more_modules: more of them (a reference model beside the policy, say),
            under the same settings.
        **amp_kwargs: `amp`'s settings (``compute_dtype``, ``amp_policy``,
            ``policy``, ``float32_gradient_reductions``) and, for float16,
            ``loss_scale``: the `jaxamp.loss_scaling` transformation handed to
            the framework (or a fixed float scale). Each call's backward pass
            then runs scaled by its live scale, from the module's outputs (the
            logits: what the loss does with them runs as the user wrote it) to
            its parameters, which get true-scale gradients; an overflow skips
            the step. An optimizer state is refused: the module outlives any
            one step's state. Inside an amp'd loss given a scale, the module
            scales nothing more.

    Returns:
        `module` (one argument) or the tuple of modules, each the same object,
        its class swapped.

    Raises:
        TypeError: an argument is not a flax nnx Module with a ``__call__``,
            ``loss_scale`` is an optimizer state, or `amp` refuses the settings.
        ValueError: a module already runs under `amp_module` with other
            settings (calling it again with the same settings changes nothing).
    """
    modules = (module, *more_modules)
    for candidate in modules:
        _check_module(candidate)
    loss_scale = amp_kwargs.get("loss_scale")
    if loss_scale is not None and not isinstance(loss_scale, (int, float)) and find_live_scale(loss_scale) is None:
        raise TypeError(
            "amp_module's loss_scale must be the jaxamp.loss_scaling transformation handed to the "
            f"framework (its scale is read live at each call), or a float; got {type(loss_scale).__name__}. "
            "A module outlives any one step's optimizer state: tx = jaxamp.loss_scaling(optax.adamw(...)), "
            "then jaxamp.amp_module(model, compute_dtype='f16', loss_scale=tx)."
        )
    settings = dict(amp_kwargs)
    amp(**settings)  # amp's own TypeError / ValueError for bad settings, before any class is swapped
    options = AmpOptions.resolve(**{k: v for k, v in settings.items() if k != "loss_scale"})
    key = _options_key(options, settings)
    swapped = []
    for candidate in modules:
        cls = type(candidate)
        mark = cls.__dict__.get(_MARK)
        if mark is not None:
            if mark[1] != key:
                raise ValueError(
                    f"this {cls.__name__} already runs under "
                    f"jaxamp.amp_module({_format(mark[2])}); got ({_format(settings)}). Wrap a module once: "
                    "samplers and jitted steps keep copies of its graph definition, which would keep the "
                    "old settings."
                )
            swapped.append(cls)
            continue
        swapped.append(_amp_class(cls, key, settings))
    for candidate, cls in zip(modules, swapped):
        # object's own setter: nnx's __setattr__ would record an attribute.
        object.__setattr__(candidate, "__class__", cls)
    return module if not more_modules else modules


def _check_module(candidate: Any) -> None:
    # No flax.nnx imported: nothing can be an nnx Module, and flax stays unimported.
    nnx = sys.modules.get("flax.nnx")
    if nnx is None or not isinstance(candidate, nnx.Module):
        raise TypeError(
            f"amp_module expects flax nnx Modules, got {type(candidate).__name__}: {_short_repr(candidate)}. "
            "For a function, or a module of another library, use jaxamp.amp(fn)."
        )
    if not callable(candidate):
        raise TypeError(
            f"amp_module wraps a module's __call__, and {type(candidate).__name__} has none. "
            "Wrap the method you call instead: "
            "jaxamp.amp(module.method)(...)."
        )


def _options_key(options: AmpOptions, settings: dict) -> tuple:
    # Spellings that amp resolves alike ("bf16", jnp.bfloat16) share a class; a
    # user's policy table by identity (amp reads it afresh at each call).
    table = settings.get("amp_policy")
    scale = settings.get("loss_scale")
    return (
        options.compute_dtype,
        options.output_dtype,
        options.fp8,
        options.float32_accumulation,
        None if table is None else id(table),
        # A transformation by identity: its cells are the scale.
        scale if scale is None or isinstance(scale, (int, float)) else id(scale),
    )


def _amp_class(base: type, key: tuple, settings: dict) -> type:
    with _CLASSES_LOCK:
        cls = _CLASSES.get((base, key))
        if cls is not None:
            return cls
        # Made once per class and settings: graph definitions compare their
        # node types, so every wrap of a Qwen2 in bf16 must give the same class.
        amp_call = amp(base.__call__, **settings)

        @functools.wraps(base.__call__)  # keeps the signature samplers inspect
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            return amp_call(self, *args, **kwargs)

        def body(namespace: dict) -> None:
            namespace.update(
                __call__=__call__,
                __module__=base.__module__,
                __qualname__=f"Amp{base.__qualname__}",
                __doc__=f"{base.__name__} whose __call__ runs under jaxamp.amp({_format(settings)}).",
                **{_MARK: (base, key, settings)},
            )

        # flax >= 0.12 records per class whether its instances are JAX pytrees;
        # the subclass must say what the base says.
        keywords = {"pytree": base._pytree__is_pytree} if hasattr(base, "_pytree__is_pytree") else {}
        cls = types.new_class(f"Amp{base.__name__}", (base,), keywords, body)
        _CLASSES[(base, key)] = cls
        return cls


def _format(settings: dict) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in settings.items() if value is not UNSET)


def _short_repr(value: Any) -> str:
    lines = repr(value).splitlines()  # an nnx module's repr spans many lines
    text = lines[0] if lines else ""
    return text if len(text) <= 80 else text[:77] + "..."
