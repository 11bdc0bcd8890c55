"""The trace cache of eager amp calls.

Inside a transformation (``jit``, ``grad``, ``vmap``) amp's work is part of the
caller's trace, which JAX caches. Called eagerly, ``amp(f)(x)`` would trace ``f``
and rewrite its jaxpr on every call: four times the cost of calling ``f``
eagerly for a small MLP. So, like `jax.jit`, an amp'd function keeps the
rewritten program of each call signature and evaluates it equation by equation
(eager semantics are unchanged: nothing is compiled that ``f`` would not
compile itself).

The key is what `jax.jit` keys its cache on: the structure of the arguments,
the shape, dtype and weak type of each array leaf, the non-array leaves
(static, compared by value and type), and JAX's tracing configuration (x64,
matmul precision...). amp adds its own inputs: the compute and output dtypes,
the policy table's contents (snapshotted per call, so a table changed between
calls misses) and the named scopes around the call. As with `jax.jit`, Python
state that ``f`` reads without taking it as an argument (a global, an attribute
of a closed-over object) is baked in at the first call of a signature.

Not cached: calls with an unhashable static argument, calls made under a JAX
transformation (their trace is cached by the transformation), and calls in
which flax nnx objects take part (amp writes their state back, or creates
them, per call).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax

from . import _compat
from ._casting import as_array

if TYPE_CHECKING:
    from ._options import AmpOptions

__all__ = ["EagerCache"]

DEFAULT_MAXSIZE = 32


class EagerCache:
    """A bounded (least recently used first out) cache of rewritten programs.

    Attributes:
        maxsize: how many call signatures are kept.
        hits: calls answered from the cache.
        misses: calls that traced and rewritten `fn` (cached or not).
    """

    def __init__(self, maxsize: int = DEFAULT_MAXSIZE):
        self.maxsize = maxsize
        self.hits = 0
        self.misses = 0
        self._entries: collections.OrderedDict[Any, tuple[Any, Callable]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Forget every cached program."""
        self._entries.clear()

    def call(self, options: AmpOptions, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """``options.run(fn, args, kwargs)``, from the cache where it may be.

        Args:
            options: the amp'd function's settings.
            fn: the user's function (fixed for one cache).
            args: positional arguments of this call.
            kwargs: keyword arguments of this call.

        Returns:
            What ``amp(fn)(*args, **kwargs)`` returns.
        """
        found = _cache_key(options, args, kwargs)
        if found is None:
            self.misses += 1
            return options.run(fn, args, kwargs)
        key, flat_args = found
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            program, traced_args, rebuild, stateless = options.rewrite(fn, args, kwargs)
            entry = (_EagerProgram(program), rebuild)
            # Reused only if later calls' array leaves are exactly its inputs.
            if stateless and len(traced_args) == len(flat_args) and all(a is b for a, b in zip(traced_args, flat_args)):
                self._entries[key] = entry
                if len(self._entries) > self.maxsize:
                    self._entries.popitem(last=False)
            flat_args = traced_args
        else:
            self.hits += 1
            self._entries.move_to_end(key)
        program, rebuild = entry
        return rebuild(program(flat_args))


def _cache_key(options: AmpOptions, args: tuple, kwargs: dict) -> tuple[Any, list] | None:
    # None: this call must not be cached (see the module docstring).
    trace_context = _compat.eager_trace_context()
    if trace_context is None:
        return None
    # One flatten of everything: array leaves are inputs, keyed by their
    # abstract value; the other leaves are static, keyed by type and value
    # (1, 1.0 and True are equal and hash alike, but trace differently). The
    # array leaves come in the order `AmpOptions.rewrite` flattens them.
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    flat_args = []
    signature = []
    for leaf in leaves:
        if eqx.is_array(leaf):
            if isinstance(leaf, jax.core.Tracer):
                return None
            flat_args.append(leaf)
            signature.append(_compat.abstract_value(leaf))
        else:
            signature.append((type(leaf), leaf))
    key = (
        tree,
        tuple(signature),
        options.compute_dtype,
        options.output_dtype,
        options.fp8,
        options.policy_table(),
        _compat.ambient_scopes(),
        trace_context,
    )
    try:
        hash(key)
    except TypeError:  # an unhashable static argument: traced afresh, as before
        return None
    return key, flat_args


class _EagerProgram:
    """A rewritten program, evaluated equation by equation as eager JAX runs it.

    `jax.core.eval_jaxpr` would bind each call of a ``jax.numpy`` function
    (``jit`` equations: most of them) through `jit`'s Python path, several
    times slower than the compiled fast path the user's own eager call takes.
    So each distinct called jaxpr becomes one `jax.jit`'d function, and every
    other equation is bound as `eval_jaxpr` binds it.
    """

    def __init__(self, program: Any):
        jaxpr = program.jaxpr
        self._consts = list(zip(jaxpr.constvars, program.consts))
        self._invars = jaxpr.invars
        self._outvars = jaxpr.outvars
        called: dict[int, Callable] = {}
        self._steps = []
        # Under a mesh (`jax.set_mesh`), a call's body holds values typed with
        # the shardings JAX gave them where it was traced (a random key
        # resharded onto an Auto view of an Explicit mesh, for one); a fresh
        # `jax.jit` of the body would retrace it in another mesh context and
        # reject them. Its own equation, bound with its recorded context, is
        # what `jax.jit(amp(f))` runs too.
        fast_calls = jax.sharding.get_abstract_mesh().empty
        for eqn in jaxpr.eqns:
            body = eqn.params.get("jaxpr") if eqn.primitive is _compat.jit_p and fast_calls else None
            if body is not None:
                fn = called.get(id(body))
                if fn is None:
                    fn = called[id(body)] = jax.jit(_compat.jaxpr_as_fun(body))
                step = fn
            else:
                step = _bind(eqn.primitive, eqn.primitive.get_bind_params(eqn.params))
            self._steps.append((step, eqn.invars, eqn.outvars))

    def __call__(self, flat_args: list) -> list:
        env: dict[Any, Any] = dict(self._consts)
        env.update(zip(self._invars, flat_args, strict=True))

        def read(v: Any) -> Any:
            return v.val if isinstance(v, _compat.Literal) else env[v]

        for step, invars, outvars in self._steps:
            outs = step(*map(read, invars))
            env.update(zip(outvars, outs))
        return [as_array(read(v), v.aval) for v in self._outvars]


def _bind(primitive: Any, params: dict) -> Callable:
    if primitive.multiple_results:
        return lambda *args: primitive.bind(*args, **params)
    return lambda *args: [primitive.bind(*args, **params)]
