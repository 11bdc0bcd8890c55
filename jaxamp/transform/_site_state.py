"""State that rules read per site, threaded through every body amp rewrites.

A rule that needs a value per equation it rewrites, carried between steps (the
amax history of fp8's delayed recipe, `jaxamp.fp8._state`), asks `active()`
for the program's `SiteState` and `take`s its site's value there. Sites are
numbered in program order, as amp interprets the program:

* a site inside a ``scan`` body gets one value per iteration: the state holds
  it stacked along the scan's length (outermost loop first), and `take`
  indexes it with the iteration the body runs (the scan handler passes
  ``arange(length)`` as an extra input), so a scan over layers keeps one value
  per layer, as unrolled layers would;
* a ``while`` body's sites have one value for every iteration (the trip count
  is not known when tracing);
* a cond's branches each have their own sites, in branch order (`lax.cond`'s
  false branch first);
* a ``shard_map`` body cannot close over the caller's values (JAX refuses
  one sharded on an Explicit mesh): it takes them, replicated, as inputs
  (`passed`, `entering`), and a rule whose value comes back through its
  cotangent counts it once although every device holds the input
  (`cotangents_summed_over`);
* a program whose backward pass is loss-scaled carries the scale
  (`cotangent_scale`) to every body as it carries the values, so a rule that
  keeps statistics of cotangents across steps keeps them in true units;
* inside a body amp cannot thread a value into (a custom derivative rule,
  which JAX traces apart from the program), `take` returns None and the rule
  says why (`paused`).

The handlers of `_higher_order` re-trace some bodies more than once (a loop
whose carry types settle, `_settle_carry`): they `rewind` to where the body
started before each trace, so a body's sites are numbered once.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import jax.numpy as jnp
from jax import lax

__all__ = ["SiteState", "active", "pause_reason", "paused", "threading"]

_ACTIVE: contextvars.ContextVar[SiteState | None] = contextvars.ContextVar("jaxamp_site_state", default=None)
_PAUSES: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("jaxamp_site_state_pauses", default=())


@dataclasses.dataclass(eq=False)
class SiteState:
    """The per-site values of one amp'd program, and where the interpretation is.

    Attributes:
        values: the values given for this call, in site order, or None to
            discover the sites (each `take` then returns zeros: what a state
            made by `jaxamp.fp8.init_fp8_state` holds; fp8's delayed recipe is
            the one user, whom `take`'s errors name).
        sites: ``(name, shape)`` of each site found so far, in order; `shape`
            includes the enclosing scans' lengths, outermost first. With
            `values` given, the sites the state was made for.
        position: how many sites the interpretation has passed.
        loops: ``(iteration index, length)`` of each enclosing scan, outermost first.
        scopes: the named scopes of the equation being rewritten (its site's name).
        cotangents_summed_over: manual mesh axes over which JAX sums the
            cotangents of the values this body takes: a ``shard_map`` with
            ``check_vma=False`` sums a replicated input's cotangent over its
            devices, so a rule returning a value through its cotangent (fp8's
            observed amaxes) gives it on one device of them and zeros on the others.
        cotangent_scale: the float32 scalar the backward pass multiplies this
            program's cotangents by (a loss scale, `AmpOptions.run`), or None
            (1). Rules that keep cotangent statistics across steps (fp8's
            delayed histories) divide by it, so the statistics stay valid when
            the scale changes between steps.
    """

    values: Sequence[Any] | None = None
    sites: list[tuple[str, tuple[int, ...]]] = dataclasses.field(default_factory=list)
    position: int = 0
    loops: list[tuple[Any, int]] = dataclasses.field(default_factory=list)
    scopes: tuple[str, ...] = ()
    cotangents_summed_over: tuple[Any, ...] = ()
    cotangent_scale: Any = None

    @property
    def paused(self) -> str:
        """Why values cannot be threaded into the current body, or ``""`` (see `paused`)."""
        return pause_reason()

    def take(self, kind: str, shape: Sequence[int]) -> Any:
        """The value of the next site, of `shape` per iteration, as the current body sees it.

        Args:
            kind: what the site is (a primitive's name); its name is the
                current named scopes and `kind`.
            shape: the value's shape for one iteration of the enclosing scans.

        Returns:
            The site's value (a float32 array of `shape`), or None where the
            state is `paused`.

        Raises:
            ValueError: the given values were made for another program (a site
                of another name or shape here, or more sites than it has).
        """
        if self.paused:
            return None
        name = "/".join((*self.scopes, kind))
        full = (*(length for _, length in self.loops), *map(int, shape))
        if self.position < len(self.sites):
            expected = self.sites[self.position]
            if expected != (name, full):
                raise ValueError(
                    f"the fp8_state does not fit this program: its site {self.position} is "
                    f"{expected[0]!r} of shape {expected[1]}, but the program's is {name!r} of shape "
                    f"{full}. Make the state with jaxamp.fp8.init_fp8_state for this function, with "
                    "arguments of the shapes you call it with."
                )
        elif self.values is None:
            self.sites.append((name, full))
        else:
            raise ValueError(
                f"the fp8_state does not fit this program: it has {len(self.sites)} sites, and the "
                f"program has more ({name!r} of shape {full} is site {self.position}). Make the state "
                "with jaxamp.fp8.init_fp8_state for this function, with arguments of the shapes you call it with."
            )
        value = jnp.zeros(full, jnp.float32) if self.values is None else self.values[self.position]
        self.position += 1
        for index, _ in self.loops:
            value = lax.dynamic_index_in_dim(value, index, keepdims=False)
        return value

    def passed(self) -> list:
        """What a body that cannot close over the caller's values takes as inputs (see `entering`).

        The enclosing scans' iteration indices, the `cotangent_scale` if any,
        then the values of the sites from `position` on (which of them the
        body reaches is known only once it is traced); no values while
        discovering sites.
        """
        values = [] if self.values is None else list(self.values[self.position :])
        scale = [] if self.cotangent_scale is None else [self.cotangent_scale]
        return [index for index, _ in self.loops] + scale + values

    def entering(self, passed: Sequence[Any], cotangents_summed_over: Sequence[Any] = ()) -> SiteState:
        """This state as a body sees it that took `passed` (the body's tracers of `passed()`) as inputs.

        The new state numbers its sites on from this one's `position` and adds
        the sites it discovers to the same list: set this one's `position` to
        the new one's once the body is traced.
        """
        indices, values = passed[: len(self.loops)], passed[len(self.loops) :]
        scale = None
        if self.cotangent_scale is not None:
            scale, values = values[0], values[1:]
        return SiteState(
            values=None if self.values is None else [None] * self.position + list(values),
            sites=self.sites,
            position=self.position,
            loops=[(index, length) for index, (_, length) in zip(indices, self.loops)],
            scopes=self.scopes,
            cotangents_summed_over=(*self.cotangents_summed_over, *cotangents_summed_over),
            cotangent_scale=scale,
        )

    def rewind(self, position: int) -> None:
        """Go back to site `position` (a body about to be traced again)."""
        self.position = position

    @contextlib.contextmanager
    def loop(self, index: Any, length: int) -> Iterator[None]:
        """Within: a scan body running iteration `index` (a traced int) of `length`."""
        self.loops.append((index, length))
        try:
            yield
        finally:
            self.loops.pop()


def active() -> SiteState | None:
    """The `SiteState` of the program being rewritten, or None."""
    return _ACTIVE.get()


@contextlib.contextmanager
def threading(state: SiteState | None) -> Iterator[SiteState | None]:
    """Make `state` `active` within (None: no state)."""
    token = _ACTIVE.set(state)
    try:
        yield state
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def paused(reason: str) -> Iterator[None]:
    """Within: a body that takes no values (`SiteState.take` returns None), `reason` saying why.

    Also without an active state: a custom_vjp's backward rule runs after
    the program's rewrite has returned, and its rule still asks why.
    """
    token = _PAUSES.set((*_PAUSES.get(), reason))
    try:
        yield
    finally:
        _PAUSES.reset(token)


def pause_reason() -> str:
    """Why the body being rewritten takes no site values (the innermost `paused`), or ``""``."""
    pauses = _PAUSES.get()
    return pauses[-1] if pauses else ""
