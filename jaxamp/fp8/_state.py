"""The delayed recipe's state: an amax history per float8 matmul, threaded by the train step.

``Fp8Recipe(scaling="delayed")`` is Transformer Engine's ``DelayedScaling``:
each float8 matmul's operands and cotangent are scaled by an amax taken from
the past steps' amaxes (the largest over `Fp8Recipe.amax_history_length`
steps, or the most recent), not from the live tensor. The histories are an
`Fp8State`, which the step passes to the amp'd function
(``fn(*args, fp8_state=state)``) and gets back updated through the gradient,
as flax's fp8 ops return theirs:

* The gradient of the loss with respect to the state holds the step's amaxes
  (forward operands and cotangent; column 0 of each history, zeros
  elsewhere): `Fp8State.update` rolls them into the histories.
* Gradient accumulation: combine the micro-batches' observations with
  `Fp8State.combine` (their maximum, as Transformer Engine reduces amaxes),
  not by summing them as gradients are.
* A matmul inside a scan over layers has one history per layer (the state
  holds it stacked along the scan's length).
* Every value is a global reduction under `jit` on a mesh, and a maximum
  over the devices (``pmax``) where amp runs inside `shard_map` or
  `jax.pmap`, so every device and process holds the same state and takes
  the same scales; the same scales serve a `jax.checkpoint` recompute, since
  they come from the state.

A history that holds no amax yet (the first step, or a matmul the loss does
not reach) takes the live amax instead, as current scaling does, so the first
step does not run with scale 1.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _compat
from ..transform._site_state import SiteState
from ._quantize import finite_amax, scale_for_amax

__all__ = ["ROLES", "Fp8State", "history_scale", "init_fp8_state", "observation"]

ROLES = ("lhs", "rhs", "cotangent")
"""The rows of a matmul's history: its left and right operands, and the cotangent of its result."""


@jax.tree_util.register_pytree_with_keys_class
class Fp8State:
    """The delayed recipe's amax histories: one per float8 matmul of an amp'd program.

    Made by `jaxamp.fp8.init_fp8_state`; a pytree of float32 arrays (checkpoint it
    with the train state; Orbax saves and restores it), keyed by each matmul's
    named scopes and primitive.

    Attributes:
        histories: ``{site name: float32[*scan lengths, 3, history length]}``,
            rows `ROLES`, column 0 the newest step, in the program's order of
            matmuls. A matmul inside a `lax.scan` has one history per
            iteration, stacked along the scan's length (outermost first).
    """

    # Its gradient is the step's observed amaxes, which loss scalers must not
    # unscale (`jaxamp.scaling._finite.NOT_LOSS_SCALED`).
    __jaxamp_not_loss_scaled__ = True

    def __init__(self, histories: Mapping[str, Any]):
        self.histories = dict(histories)

    def tree_flatten_with_keys(self):
        names = tuple(self.histories)
        return [(jax.tree_util.DictKey(n), self.histories[n]) for n in names], names

    @classmethod
    def tree_unflatten(cls, names, leaves):
        return cls(dict(zip(names, leaves)))

    def __repr__(self) -> str:
        sites = ", ".join(f"{n!r}: {getattr(h, 'shape', h)}" for n, h in self.histories.items())
        return f"Fp8State({{{sites}}})"

    @classmethod
    def from_sites(cls, sites: SiteState) -> Fp8State:
        """Empty histories (zeros) for the sites a program's trace found (`SiteState.sites`)."""
        histories: dict[str, Any] = {}
        for name, shape in sites.sites:
            key, k = name, 1
            while key in histories:  # the same scopes and primitive again: numbered in program order
                k += 1
                key = f"{name}#{k}"
            histories[key] = jnp.zeros(shape, jnp.float32)
        return cls(histories)

    def site_state(self) -> SiteState:
        """The `SiteState` that threads these histories through one call of the program."""
        sites = [(_site_name(key), tuple(np.shape(h))) for key, h in self.histories.items()]
        return SiteState(values=list(self.histories.values()), sites=sites)

    def update(self, observed: Fp8State) -> Fp8State:
        """The histories with the step's amaxes `observed` rolled in as the newest column.

        Args:
            observed: the gradient of the loss with respect to this state (or
                several micro-batches' gradients combined by `combine`).

        Raises:
            TypeError: `observed` is not an `Fp8State`.
            ValueError: it holds other sites or shapes than this state.
        """
        self._check_matches(observed, "update")

        def roll(history, seen):
            return jnp.concatenate([seen[..., :1], history[..., :-1]], axis=-1).astype(history.dtype)

        return Fp8State({n: roll(h, observed.histories[n]) for n, h in self.histories.items()})

    def combine(self, other: Fp8State) -> Fp8State:
        """The entrywise maximum of two observations (two micro-batches' gradients with respect to the state).

        Raises:
            TypeError, ValueError: as `update`.
        """
        self._check_matches(other, "combine")
        return Fp8State({n: jnp.maximum(h, other.histories[n]) for n, h in self.histories.items()})

    def amax(self, name: str, algorithm: str = "max") -> Any:
        """The amaxes the next step scales site `name` by: float32 ``[*scan lengths, 3]`` (rows `ROLES`).

        0 where the history holds none yet (the step then takes the live amax).
        """
        history = self.histories[name]
        return jnp.max(history, axis=-1) if algorithm == "max" else history[..., 0]

    def _check_matches(self, other: Any, what: str) -> None:
        if not isinstance(other, Fp8State):
            raise TypeError(
                f"Fp8State.{what} takes an Fp8State (the gradient of the loss with respect to the state), "
                f"got {type(other).__name__}."
            )
        mine = {n: np.shape(h) for n, h in self.histories.items()}
        theirs = {n: np.shape(h) for n, h in other.histories.items()}
        if mine != theirs:
            raise ValueError(
                f"Fp8State.{what}: the two states hold different sites or shapes ({mine} against "
                f"{theirs}); both must come from the same program."
            )


def _site_name(key: str) -> str:
    """A history's site name without the number `Fp8State.from_sites` gave a repeated one."""
    name, _, k = key.rpartition("#")
    return name if name and k.isdigit() else key


def history_scale(
    history_row: Any, x32: Any, fmt: Any, algorithm: str, margin: int, power_of_two: bool, units: Any = None
) -> Any:
    """The scale of `x32` (float32) in `fmt` from its history row (the live amax while the row is empty).

    ``amax * 2**margin / max(fmt)``, amax the row's maximum (``"max"``) or its
    newest entry (``"most_recent"``), as Transformer Engine's ``DelayedScaling``,
    times `units` where `x32` is that many times the values the row holds (a
    loss-scaled cotangent against its true-scale history, `observation`).
    """
    past = lax.reduce_max(history_row, (0,)) if algorithm == "max" else history_row[0]
    if units is not None:
        # This step's loss scale, not the one the amaxes were seen under: a
        # scale that grew since would otherwise saturate the cotangent.
        past = past * units
    # A branch, not a select: once the history holds an amax, the live one is
    # not computed in front of the matmul (nor, on a mesh, all-reduced there).
    # Inside shard_map both branches take the devices the live amax varies over.
    varying = tuple(_compat.varying_axes(past) | _compat.varying_axes(x32))
    amax = lax.cond(
        past > 0,
        lambda: _compat.mark_varying(past, varying),
        lambda: _compat.mark_varying(finite_amax(x32), varying),
    )
    return scale_for_amax(amax * np.float32(2.0**margin), fmt, power_of_two)


def observation(
    forward: Any, g: Any, history_aval: Any, on_one_device_of: Sequence[Any] = (), units: Any = None
) -> Any:
    """A history-shaped cotangent holding the step's amaxes in column 0, zeros elsewhere.

    Args:
        forward: float32 ``[2]``: the left and right operands' amaxes.
        g: the cotangent of the matmul's result.
        history_aval: the type of the site's history (``[3, length]``).
        on_one_device_of: manual mesh axes over which JAX will sum the
            cotangent (`SiteState.cotangents_summed_over`): the amaxes are
            given on their first device, zeros on the others.
        units: the loss scale `g` carries (`SiteState.cotangent_scale`), or
            None: the history holds ``amax(g) / units``, the true-scale amax.
    """
    g_amax = finite_amax(g)
    if units is not None:
        g_amax = g_amax / _compat.mark_varying(units, tuple(_compat.varying_axes(g_amax)))
    column = _largest_on_every_device(lax.concatenate([forward, lax.expand_dims(g_amax, (0,))], 0))
    if on_one_device_of:
        first = functools.reduce(lax.bitwise_and, [lax.axis_index(a) == 0 for a in on_one_device_of])
        column = lax.select(lax.broadcast(first, column.shape), column, lax.full_like(column, 0))
    length = history_aval.shape[-1]
    observed = lax.pad(lax.expand_dims(column, (1,)), np.float32(0), ((0, 0, 0), (0, length - 1, 0)))
    return _compat.mark_varying(observed, tuple(_compat.varying_axes_of_type(history_aval)))


def _largest_on_every_device(x: Any) -> Any:
    """`x`'s maximum over the devices that run it apart (inside `shard_map` or `pmap`), so they hold one history.

    Over the manual axes `x` varies along where types record them
    (``check_vma``), otherwise over every manual axis (a maximum over copies
    of one value is that value).
    """
    manual = _compat.manual_axes()
    if _compat.tracks_varying_axes():
        manual = tuple(a for a in manual if a in _compat.varying_axes(x))
    return lax.pmax(x, manual) if manual else x


def init_fp8_state(amp_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Fp8State:
    """The empty amax histories of an amp'd function under ``Fp8Recipe(scaling="delayed")``.

    Traces ``amp_fn(*args, **kwargs)`` (nothing runs; arguments may be
    `jax.ShapeDtypeStruct` leaves) and makes one history per float8 matmul,
    zeros: the first step scales by the live amaxes. Pass the state to every
    call, ``amp_fn(*args, fp8_state=state, **kwargs)``, and update it from its
    gradient (docs/float8.md, "The delayed recipe"):

        loss = jaxamp.amp(loss_fn, compute_dtype=jaxamp.fp8.Fp8Recipe(scaling="delayed"))
        state = jaxamp.fp8.init_fp8_state(loss, params, batch)

        @jax.jit
        def step(params, opt_state, state, batch):
            value, (grads, observed) = jax.value_and_grad(
                lambda p, s: loss(p, batch, fp8_state=s), argnums=(0, 1)
            )(params, state)
            ...
            return params, opt_state, state.update(observed)

    Args:
        amp_fn: what `amp` returned, with the delayed recipe.
        *args: positional arguments as the step passes them (their shapes
            decide the program, and a scan's length how many histories its
            matmuls get).
        **kwargs: keyword arguments as the step passes them.

    Returns:
        An `Fp8State`.

    Raises:
        TypeError: `amp_fn` is not an amp'd function with the delayed recipe.
    """
    found = getattr(amp_fn, "_jaxamp_amp", None)
    if found is None or found[0].fp8 is None or found[0].fp8.scaling != "delayed":
        raise TypeError(
            "init_fp8_state takes a function made by jaxamp.amp with "
            "compute_dtype=jaxamp.fp8.Fp8Recipe(scaling='delayed'), got "
            f"{getattr(amp_fn, '__name__', type(amp_fn).__name__)!r}"
            + ("" if found is None else f" (an amp'd function whose fp8 recipe is {found[0].fp8!r})")
            + "."
        )
    options, fn = found
    discovered = []
    # `jaxamp.amp` leaves (options, fn) on the function it returns; read by
    # attribute so this layer needs nothing from the entry layer above it.
    # Traced abstractly, so `jax.ShapeDtypeStruct` leaves stand for arrays.
    eqx.filter_eval_shape(lambda a, k: discovered.append(options.discover_sites(fn, a, k)), args, kwargs)
    return Fp8State.from_sites(discovered[0])
