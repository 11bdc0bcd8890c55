"""`monitor`: a step's outputs and, beside them, its numerics statistics, inside jit."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .._jaxpr import trace_array_leaves
from ._measure import FIELDS, derived, per_site
from ._walk import Site, walk

__all__ = ["MonitorStats", "monitor"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MonitorStats:
    """Statistics of one monitored call: one row per measured site.

    A pytree: return it from a jitted step, keep it on device, hand it to a
    `jaxamp.monitoring.MonitorRecorder`. ``vectors`` is its only array (float32, one row
    per site, one column per `FIELDS` entry); the sites are static.

    Attributes:
        vectors: ``(len(sites), len(FIELDS))`` float32: per site the largest
            finite magnitude (``amax``), for float8 operands the amax of the
            value quantised and its scale, then counts: entries, finite
            nonzero entries, those below the smallest normal of the dtype the
            value is stored in (``underflow``), those above
            ``max(dtype) / 2**headroom_bits`` (``above``), inf/NaN entries
            (``nonfinite``), and the nonzero entries below ``2^-14``,
            ``2^-20``, ``2^-26``, ``2^-32`` (float16's smallest normal, and
            for cotangents the same under loss scales 2^6, 2^12, 2^18). A
            site inside a loop or a `shard_map` body combines its iterations
            and devices. A monitored function under `jax.pmap` or
            `jax.vmap` returns them with leading axes (per device or
            example); `rows()` and `jaxamp.monitoring.MonitorRecorder` combine those too.
        sites: what each row measures (`jaxamp.monitoring.monitor`'s `Site`).
        headroom_bits: the threshold the ``above`` counts used.
    """

    vectors: Any
    sites: tuple[Site, ...] = dataclasses.field(metadata=dict(static=True))
    headroom_bits: float = dataclasses.field(default=4.0, metadata=dict(static=True))

    def field(self, name: str) -> Any:
        """The column `name` of `FIELDS`, one entry per site."""
        return self.vectors[..., FIELDS.index(name)]

    def rows(self) -> list[dict[str, Any]]:
        """One dict per site, on the host: the site's description, its raw
        fields and the figures `jaxamp.monitoring._measure.derived` reads off
        them: ``headroom_bits`` (log2 of the stored dtype's largest finite
        value over amax; inf for an all-zero value), ``underflow_fraction``
        (of nonzero entries), ``above_fraction`` (of entries),
        ``float16_underflow_fraction`` and, for cotangents,
        ``underflow_at_scale`` (the fraction of nonzero entries below
        float16's smallest normal at each loss scale 2^e)."""
        vectors = per_site(jax.device_get(self.vectors), len(self.sites))
        return [_row(site, vector) for site, vector in zip(self.sites, vectors, strict=True)]

    def __repr__(self) -> str:
        return f"MonitorStats({len(self.sites)} sites, headroom_bits={self.headroom_bits})"


def _row(site: Site, vector: np.ndarray) -> dict[str, Any]:
    row: dict[str, Any] = dict(
        direction=site.direction, scope=site.scope, name=site.name, kind=site.kind, dtype=site.dtype, fp8=site.fp8,
        handed_in=site.handed_in, **dict(zip(FIELDS, (float(v) for v in vector))),
    )  # fmt: skip
    return row | derived(row)


def monitor(fn: Callable | None = None, *, headroom_bits: float = 4.0) -> Callable:
    """Make `fn` also return numerics statistics of everything it computes.

    ``jaxamp.monitoring.monitor(fn)(*args)`` returns ``(fn(*args), stats)``, `stats` a
    `MonitorStats`. Monitor the whole step, differentiation included, and jit
    the result::

        step = jax.jit(jaxamp.monitoring.monitor(jax.value_and_grad(jaxamp.amp(loss))))
        (loss_value, grads), stats = step(params, batch)

    `fn` is traced to a jaxpr and re-emitted equation by equation, unchanged,
    with the statistics computed beside: of each operand and result of every
    matmul and convolution that runs in float16, bfloat16 or float8
    (``"dot_general[0].lhs"``...), and of every floating value a
    `jax.named_scope` hands on to code outside it (``"output[0]"``), in the
    forward pass and, for the cotangents, in the backward pass (which JAX's
    transpose leaves marked in the traced program). Sites are grouped by
    named scope path (flax module paths, Equinox layers under amp's module
    scopes), or by user source line outside any scope. Sites inside jit,
    scan, while, cond, remat, custom_jvp/custom_vjp functions and shard_map
    bodies are measured; a loop's iterations and a shard_map's devices
    combine into one row (maxima of magnitudes, sums of counts).

    The function's own equations are re-emitted unchanged; the statistics
    add one fused reduction per measured value (see `benchmarks`, "monitor
    overhead"). XLA may fuse the monitored program differently (the order
    of a sum, where a half-precision intermediate is rounded), so its
    outputs can differ from the unmonitored step's in the last bits. An
    unmonitored function is untouched.

    Args:
        fn: any function of arrays (and static Python values) that JAX can
            trace: typically a loss's ``jax.value_and_grad`` or a whole train
            step, amp'd or hand-cast.
        headroom_bits: the ``above`` counts count entries above
            ``max(dtype) / 2**headroom_bits``.

    Returns:
        ``monitored(*args, **kwargs) -> (outputs, MonitorStats)``.

    Raises:
        TypeError: `fn` is not callable; the monitored function is itself
            being differentiated (monitor the function that differentiates,
            so the backward pass is in the program monitor sees); flax nnx
            Modules or Rngs among the arguments (monitor a function of their
            state, `nnx.split`'s).
        ValueError: `headroom_bits` is negative or not finite.
    """
    if fn is None:
        return functools.partial(monitor, headroom_bits=headroom_bits)
    if not callable(fn):
        raise TypeError(f"jaxamp.monitoring.monitor expects a callable, got {type(fn).__name__}: {fn!r:.100}.")
    if (
        isinstance(headroom_bits, bool)
        or not isinstance(headroom_bits, (int, float))
        or not (0 <= headroom_bits < math.inf)
    ):
        raise ValueError(f"headroom_bits must be a finite number >= 0, got {headroom_bits!r}.")

    @functools.wraps(fn)
    def monitored(*args: Any, **kwargs: Any) -> tuple[Any, MonitorStats]:
        if _compat.has_nnx_objects((fn, args, kwargs), variables=False):
            raise TypeError(
                "jaxamp.monitoring.monitor takes pytrees, not flax nnx objects (Modules, Rngs), whose "
                "state it would not carry: monitor a pure function of their state, e.g. "
                "graphdef, state = nnx.split(model); jaxamp.monitoring.monitor(lambda state, batch: "
                "step(nnx.merge(graphdef, state), batch))(state, batch), returning the new state."
            )
        if any(_compat.is_differentiation_tracer(x) for x in jax.tree_util.tree_leaves((args, kwargs))):
            raise TypeError(
                "a function made by jaxamp.monitoring.monitor is being differentiated: the statistics of its "
                "backward pass would be outside the program monitor sees. Monitor the function "
                "that differentiates instead: jaxamp.monitoring.monitor(jax.value_and_grad(loss)), not "
                "jax.grad(jaxamp.monitoring.monitor(loss))."
            )
        closed, values, _, rebuild = trace_array_leaves(fn, args, kwargs)
        outs, taps = walk(closed.jaxpr, closed.consts, values, headroom_bits)
        vectors = jnp.stack([x for _, x in taps]) if taps else jnp.zeros((0, len(FIELDS)), jnp.float32)
        return rebuild(outs), MonitorStats(vectors, tuple(site for site, _ in taps), float(headroom_bits))

    return monitored
