"""amp's settings, validated, and the trace of the user's function that each call starts with.

`AmpOptions` is shared by `jaxamp.amp`, its eager cache and the diagnostics
(`explain`, `find_nonfinite`): each resolves the same keyword arguments and
runs the same trace-then-rewrite.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _compat
from ._casting import as_array, cast_value
from ._dtypes import canonical_compute_dtype
from ._jaxpr import trace_array_leaves
from .fp8._matmul import with_fp8_matmuls
from .fp8._recipe import FP8_NAMES, Fp8Recipe, as_recipe
from .transform import _higher_order, _nnx, _site_state  # noqa: F401  (_higher_order registers the handlers)
from .transform._accumulation import with_float32_accumulation
from .transform._interpreter import HANDLERS, AmpContext, interpret
from .transform._rules import PolicyTable, default_amp_policy, freeze

__all__ = ["UNSET", "AmpOptions"]

UNSET: Any = object()
"""The default of `amp`'s ``compute_dtype``: distinguishes "not given" from None."""
_PRIMITIVE_NAMES = frozenset(getattr(key, "name", None) for key in default_amp_policy if not isinstance(key, str))


@dataclasses.dataclass(frozen=True)
class AmpOptions:
    """amp's validated settings; `amp`, `explain` and `find_nonfinite` share them."""

    compute_dtype: np.dtype
    table: Mapping[Any, Callable]
    output_dtype: np.dtype | None = None
    fp8: Fp8Recipe | None = None  # fp8 mode's recipe: its matmul rules join the table per call
    float32_accumulation: bool = False  # matmuls accumulate in float32 (`jaxamp.transform._accumulation`)

    @classmethod
    def resolve(
        cls,
        *,
        compute_dtype: Any = UNSET,
        amp_policy: Any = None,
        policy: Any = None,
        float32_gradient_reductions: Any = False,
    ) -> AmpOptions:
        """Validate `amp`'s keyword arguments (see `amp`)."""
        compute, output_dtype, fp8 = _resolve_dtypes(compute_dtype, policy)
        table = _check_policy_table(default_amp_policy if amp_policy is None else amp_policy)
        if not isinstance(float32_gradient_reductions, bool):
            raise TypeError(f"float32_gradient_reductions must be a bool, got {float32_gradient_reductions!r}.")
        return cls(compute, table, output_dtype, fp8, float32_gradient_reductions)

    def policy_table(self) -> PolicyTable:
        """A snapshot of the table for one call (with fp8 mode's matmul rules).

        Taken per call, not once in `resolve`: a table the user changes between
        calls is seen afresh.
        """
        table = freeze(self.table) if self.fp8 is None else with_fp8_matmuls(self.table, self.fp8)
        return with_float32_accumulation(table) if self.float32_accumulation else table

    def run(
        self,
        fn: Callable,
        args: tuple,
        kwargs: dict,
        *,
        observer=None,
        inline=False,
        site_state=None,
        wrap_inputs: Callable[[list, list], tuple[list, list]] | None = None,
        wrap_outputs: Callable[[list], list] | None = None,
        keep_state: Callable[[Any, list], Any] | None = None,
        around_custom_vjp: Any = None,
        cotangent_scale: Any = None,
        check_program: Callable[[Any], None] | None = None,
    ) -> Any:
        """Trace ``fn(*args, **kwargs)`` and evaluate it under amp.

        `site_state`: the values rules take per site (the delayed fp8 recipe's
        histories, `jaxamp.transform._site_state`); None with the delayed
        recipe makes zeros (its first step), as the diagnostics run it.

        `wrap_inputs` / `wrap_outputs`: applied to the program's flat inputs
        (the array leaves of the arguments, or of nnx objects' state) and the
        values it closes over (``wrap_inputs(args, consts) -> (args, consts)``)
        before it runs, and to `fn`'s own flat outputs after (not to the nnx
        state it writes back); each returns the same values. Loss scaling
        inside `jax.grad` puts its identities with a scaling backward there
        (`amp`'s ``loss_scale``): outside the rewritten program, so amp's
        rules never see them.

        `keep_state`: ``keep_state(out, updates)``, a boolean scalar; where it
        is false, the state `fn` changed in flax nnx objects among its
        arguments is written back as it was before the call (loss scaling
        commits no module state from a non-finite forward pass).

        `around_custom_vjp`: see `AmpContext.around_custom_vjp`.

        `cotangent_scale`: the scalar the backward pass multiplies the
        program's cotangents by (a loss scale applied around this call), or
        None; rules read it from the site state (`SiteState.cotangent_scale`).

        `check_program`: called with the traced program (a closed jaxpr) before
        it is evaluated; loss scaling warns there about what it cannot scale.
        """
        with _collection_paused():
            closed, flat_args, num_outs, rebuild, _ = _trace(fn, args, kwargs, keep_state)
            if check_program is not None:
                check_program(closed)
            if wrap_inputs is not None:
                flat_args, consts = wrap_inputs(list(flat_args), list(closed.consts))
                closed = _compat.ClosedJaxpr(closed.jaxpr, consts)
            ctx = self._context(observer=observer, inline=inline)
            if around_custom_vjp is not None:
                ctx = dataclasses.replace(ctx, around_custom_vjp=around_custom_vjp)
            # Re-emitted straight into the caller's trace (grad, vmap, an outer
            # jit), like the user's own code: calls keep their jaxprs (see
            # `_compat.trace_keeping_calls`), so JAX differentiates each
            # distinct body once and source lines stay the user's.
            with _site_state.threading(self._site_state(site_state, inline, cotangent_scale)):
                outs = self._evaluate(closed, flat_args, num_outs, ctx)
            if wrap_outputs is not None:
                outs[:num_outs] = wrap_outputs(outs[:num_outs])
        return rebuild(outs)

    def discover_sites(self, fn: Callable, args: tuple, kwargs: dict) -> _site_state.SiteState:
        """The sites of ``fn(*args, **kwargs)`` whose rules take a value (traced, nothing run)."""
        found = _site_state.SiteState()
        with _collection_paused():
            closed, flat_args, num_outs, _, _ = _trace(fn, args, kwargs)
            ctx = self._context()
            with _site_state.threading(found):
                _compat.trace_to_closed_jaxpr(
                    lambda *flat: self._evaluate(closed, flat, num_outs, ctx),
                    [_compat.abstract_value(x) for x in flat_args],
                )
        return found

    def _site_state(self, given: Any, inline: bool, cotangent_scale: Any = None) -> _site_state.SiteState | None:
        if self.fp8 is None or self.fp8.scaling != "delayed" or inline:
            # `inline` evaluates loop bodies per iteration, where stacked
            # values have no place: its matmuls say they run from live values.
            return None
        state = _site_state.SiteState() if given is None else given
        if cotangent_scale is None:
            return state
        # Not differentiated: a factor of the backward pass, not an input of the loss.
        return dataclasses.replace(state, cotangent_scale=lax.stop_gradient(jnp.asarray(cotangent_scale, jnp.float32)))

    def rewrite(self, fn: Callable, args: tuple, kwargs: dict) -> tuple[Any, list, Callable, bool]:
        """amp's program for ``fn(*args, **kwargs)`` as a jaxpr (what eager calls cache).

        Returns:
            ``(program, flat_args, rebuild, stateless)``: a closed jaxpr; its
            inputs for this call (the array leaves of the arguments, or, when
            flax nnx objects take part, of their state and the other
            arguments); ``rebuild(outs)``, building `fn`'s output from the
            program's outputs; and whether no nnx object takes part (else
            their state is written back, or new ones created, per call).
        """
        with _collection_paused():
            closed, flat_args, num_outs, rebuild, reusable = _trace(fn, args, kwargs)
            # An eager call is never differentiated (under `jax.grad` its
            # arguments are tracers and it takes `run`): no recomputation.
            ctx = self._context(recompute=False)
            program = _compat.trace_keeping_calls(
                lambda *flat: self._evaluate(closed, flat, num_outs, ctx),
                [_compat.abstract_value(x) for x in flat_args],
            )
        return program, flat_args, rebuild, reusable

    def _context(self, observer=None, inline=False, recompute=True) -> AmpContext:
        return AmpContext(
            compute_dtype=self.compute_dtype,
            policy=self.policy_table(),
            scopes=_compat.ambient_scopes(),
            observer=observer,
            inline=inline,
            recompute=recompute,
        )

    def _evaluate(self, closed: Any, flat_args: Any, num_outs: int, ctx: AmpContext) -> list:
        outs = interpret(closed.jaxpr, closed.consts, flat_args, ctx)
        outs = [as_array(cast_value(x, a.dtype), a) for x, a in zip(outs, closed.out_avals)]
        if self.output_dtype is not None:
            # fn's own outputs only: state written back into flax nnx arguments
            # keeps its dtypes.
            outs[:num_outs] = [cast_value(x, self.output_dtype) for x in outs[:num_outs]]
        return outs


@contextlib.contextmanager
def _collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while amp traces and rewrites.

    Tracing allocates many short-lived objects, and amp traces the program
    twice (the user's function, then the rewritten one): enough, on a 12-layer
    GPT, to trigger a full collection that plain tracing does not reach, a
    tenth of a second on the first call. Objects are still freed as soon as
    nothing refers to them; only cyclic garbage waits for the end of the
    block. Left as it is when it is already off (nested amp, or the user's
    choice).
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _resolve_dtypes(compute_dtype: Any, policy: Any) -> tuple[np.dtype, np.dtype | None, Fp8Recipe | None]:
    """``(compute dtype, output dtype or None, fp8 recipe or None)`` of `amp`'s arguments.

    fp8 mode (``compute_dtype="fp8"`` or an `Fp8Recipe`) computes in bfloat16
    with float8 matmuls: a `policy` beside it must compute in bfloat16.
    """
    fp8 = None if compute_dtype is UNSET else as_recipe(compute_dtype)
    compute: np.dtype | None  # None: the policy's
    if fp8 is not None:
        compute = np.dtype(jnp.bfloat16)
    elif compute_dtype is UNSET:
        compute = np.dtype(jnp.float16) if policy is None else None
    else:
        compute = _canonical_or_fp8_hint(compute_dtype)
    if policy is None:
        assert compute is not None  # only a policy leaves it to be read from the policy
        return compute, None, fp8
    from .policies._policy import get_policy

    resolved = get_policy(policy)
    if compute is not None and compute != np.dtype(resolved.compute_dtype):
        raise ValueError(
            f"amp got compute_dtype={compute_dtype!r} and policy={str(resolved)!r}, "
            "which disagree: pass one of them" + (" (fp8 mode computes in bf16)." if fp8 is not None else ".")
        )
    return np.dtype(resolved.compute_dtype), np.dtype(resolved.output_dtype), fp8


_FP8_HINT = f"For float8 matmuls pass compute_dtype={FP8_NAMES[0]!r} (or {FP8_NAMES[1]!r}, or a jaxamp.fp8.Fp8Recipe)."


def _canonical_or_fp8_hint(compute_dtype: Any) -> np.dtype:
    try:
        return canonical_compute_dtype(compute_dtype)
    except ValueError as err:  # an unknown name: fp8 mode's names are valid too
        raise ValueError(f"{err} {_FP8_HINT}") from None
    except TypeError as err:
        # A float8 dtype is no compute dtype (only matmul operands go to
        # float8, and only in fp8 mode): point at the mode.
        if not _is_float8(compute_dtype):
            raise
        raise TypeError(f"{err} {_FP8_HINT}") from None


def _is_float8(value: Any) -> bool:
    try:
        return value is not None and np.dtype(value).name.startswith("float8")
    except TypeError:
        return False


def _check_policy_table(table: Any) -> Mapping[Any, Callable]:
    if not isinstance(table, Mapping):
        raise TypeError(
            f"amp_policy must be a dict mapping primitives or scope names to rules, got {type(table).__name__}."
        )
    for key, rule in table.items():
        if not isinstance(key, (str, _compat.Primitive)):
            raise TypeError(
                f"amp_policy keys must be primitives (e.g. jax.lax.add_p) or "
                f"jax.named_scope names, got {key!r} ({type(key).__name__})."
            )
        if isinstance(key, str) and key in _PRIMITIVE_NAMES:
            warnings.warn(
                f"amp_policy key {key!r} is matched against jax.named_scope names, "
                f"not primitives; to key the primitive, use its object "
                f"(e.g. jax.lax.{key}_p).",
                UserWarning,
                stacklevel=3,
            )
        if not callable(rule):
            raise TypeError(
                f"amp_policy[{key!r}] must be a rule function "
                f"rule(compute_dtype, original_dtypes, *invars, **bind_params), got {rule!r}."
            )
        if key in HANDLERS and rule is not default_amp_policy.get(key):
            # amp rewrites such a primitive's body equation by equation: a rule
            # for the primitive itself would never be called.
            raise ValueError(
                f"amp_policy has an entry for {key.name!r}, a higher-order primitive whose body amp "
                "rewrites equation by equation, so no rule is ever called for it. To choose the "
                f"precision of everything inside, open a jax.named_scope around the {key.name} and "
                "key your rule by the scope's name."
            )
    return table


def _trace(fn: Callable, args: tuple, kwargs: dict, keep_state: Callable[[Any, list], Any] | None = None):
    """Trace `fn` with the array leaves of its arguments as inputs.

    Returns:
        ``(closed, flat_args, num_outs, rebuild, stateless)``: the jaxpr; its
        inputs; how many of its leading outputs are `fn`'s own (the rest are
        the state that `fn` changed in flax nnx objects among its arguments,
        see `_nnx`); ``rebuild(outs)``, which builds `fn`'s output from the
        evaluated outputs and writes that state back into the caller's
        objects; and whether no nnx object takes part.
    """
    nnx_call = _nnx.lift(fn, args, kwargs)
    if nnx_call is not None:
        fn, args, kwargs = nnx_call.fn, nnx_call.args, nnx_call.kwargs
        if keep_state is not None:
            fn = _keeping_state(nnx_call, keep_state)
    closed, flat_args, out_tree, rebuild_out = trace_array_leaves(fn, args, kwargs, _compat.trace_keeping_calls)
    # The nnx call returns ``(out, state updates)``: out's leaves come first.
    num_outs = out_tree.num_leaves if nnx_call is None else out_tree.children()[0].num_leaves

    def rebuild(outs):
        out = rebuild_out(outs)
        return out if nnx_call is None else nnx_call.finish(out)

    stateless = nnx_call is None or nnx_call.holds_no_state
    return closed, flat_args, num_outs, rebuild, stateless


def _keeping_state(nnx_call: Any, keep_state: Callable[[Any, list], Any]) -> Callable:
    """`nnx_call.fn` whose state updates are the old values where ``keep_state(out, updates)`` is false."""

    def fn(state: Any, *args: Any, **kwargs: Any) -> Any:
        before = nnx_call.values(state)
        out, (updates, created) = nnx_call.fn(state, *args, **kwargs)
        if updates:
            updates = nnx_call.changes_if(keep_state(out, updates), updates, before)
        return out, (updates, created)

    return fn
