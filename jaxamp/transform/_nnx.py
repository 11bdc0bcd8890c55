"""flax nnx objects among amp's arguments: carry their state updates out of the trace.

(And, while amp traces, name each nnx module's calls with a `jax.named_scope`
of its path, as flax Linen does for its modules: see `module_scopes`.)

flax nnx's idiom is a function that mutates the module it is given: BatchNorm
updates its running statistics, Dropout advances its `nnx.Rngs` counter. amp
traces the function and evaluates the trace, so those mutations would land on
copies that exist only while tracing (nnx objects are pytrees in flax 0.12, and
amp rebuilds its arguments from their leaves) and be lost. As `nnx.jit` does,
amp splits the nnx objects among the arguments into a graph definition (static)
and their state (traced), merges fresh copies inside the trace, returns the
state the function changed as extra outputs, and writes it back into the
caller's objects with `nnx.update` once the trace is evaluated.

flax stays optional: nothing here runs, and flax is never imported, unless the
program has already imported `flax.nnx` (without it no nnx object can exist).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import itertools
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from .. import _compat

__all__ = ["GraphCall", "has_nnx_objects", "lift", "module_scopes"]


has_nnx_objects = _compat.has_nnx_objects


def lift(fn: Callable, args: tuple, kwargs: dict) -> GraphCall | None:
    """Prepare ``fn(*args, **kwargs)`` for amp's trace when flax nnx may take part.

    Args:
        fn: the function amp wraps; an nnx Module (``amp(model)(x)``) or a bound
            method of one (``amp(model.loss)(x)``) counts as an argument too.
        args: its positional arguments.
        kwargs: its keyword arguments.

    Returns:
        None when the program has not imported `flax.nnx`; otherwise the
        `GraphCall` whose ``fn``, ``args`` and ``kwargs`` amp traces instead,
        also when no nnx object is among them: fn may still mutate one it closes
        over (the `GraphCall` explains that error) or return new ones.
    """
    if "flax.nnx" not in sys.modules:
        return None
    return GraphCall(fn, args, kwargs)


@dataclasses.dataclass(frozen=True)
class _Argument:
    """Stands in (a static leaf) for the `index`-th nnx object of the call."""

    index: int


@dataclasses.dataclass(frozen=True)
class _Existing:
    """An output that is an argument's nnx object, or one inside it, at graph `path`."""

    path: tuple


@dataclasses.dataclass(frozen=True)
class _Created:
    """An output that is the `index`-th nnx object `fn` created and returned."""

    index: int


def _is_marker(x: Any) -> bool:
    return isinstance(x, (_Argument, _Existing, _Created))


class GraphCall:
    """``fn(*args, **kwargs)`` with the nnx objects among fn and its arguments split out.

    amp traces ``self.fn(*self.args, **self.kwargs)``: its first argument is the
    state of those objects (split together, so objects sharing a Variable keep
    sharing it), and the objects themselves are replaced by static markers. It
    returns ``(out, (updates, created))``: `fn`'s output, the state leaves `fn`
    changed, and what it made anew (the state of nnx objects `fn` created and
    returned, the values of attributes it set). After amp evaluates the trace,
    `finish` writes the updates and attributes into the caller's objects.
    A `GraphCall` serves one amp call: tracing records what `finish` needs.
    """

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, owner: str = "amp(fn)"):
        from flax import errors, nnx

        self._owner = owner  # how error messages name the caller
        parameters = _parameter_names(fn)  # and the arguments: `model.rope`

        self._nnx = nnx
        self._trace_context_error = errors.TraceContextError
        # amp(model)(x) and amp(model.loss)(x): the module is an argument too.
        nodes: list = []
        self._names: list[str] = []
        bound = None
        if _compat.nnx_is_object(fn):
            nodes, self._names, fn = [fn], ["fn"], _call_object
            bound = _Argument(0)
        elif inspect.ismethod(fn) and _compat.nnx_is_object(fn.__self__):
            nodes, self._names, fn = [fn.__self__], ["fn.__self__"], fn.__func__
            bound = _Argument(0)
        self._fn = fn

        leaves, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs), is_leaf=_compat.nnx_is_object)
        marked = []
        for keypath, leaf in leaves:
            if _compat.nnx_is_object(leaf):
                self._names.append(_argument_name(keypath, parameters))
                marked.append(_Argument(len(nodes)))
                nodes.append(leaf)
            else:
                marked.append(leaf)
        args, self.kwargs = jax.tree_util.tree_unflatten(treedef, marked)
        self._nodes = tuple(nodes)
        self._graphdef, state = _compat.nnx_split(self._nodes)
        self.args = (state, *(() if bound is None else (bound,)), *args)
        # Recorded while tracing, for `finish`.
        self._changed_paths: list[tuple] = []
        self._created_graphdef: Any = None
        self._attributes: list[tuple[tuple, str, bool, Callable[[Iterator], Any]]] = []  # _Attribute.recorded()

    def fn(self, state: Any, *args: Any, **kwargs: Any) -> tuple[Any, tuple[list, Any]]:
        """Run `fn` on copies of the nnx objects merged from `state` (inside amp's trace).

        Returns ``(out, (updates, created))``: `fn`'s output, the values of the
        state leaves it changed, and what it made anew (the state of nnx objects
        it created and returned, and the traced values of attributes it set on
        the objects, a `functools.cached_property` filled, say), which callers
        hand to `finish` as they are.

        Raises:
            ValueError: `fn` changed the objects' structure, returned a new
                nnx object that holds parts of its arguments' objects, or set
                an attribute to a value amp cannot carry back.
            flax.errors.TraceContextError: `fn` mutated an nnx object it reached
                other than through its arguments (a closure, say).
        """
        copies = self._nnx.merge(self._graphdef, state)
        args, kwargs = _replace_markers((args, kwargs), lambda m: copies[m.index])
        _, before = _compat.nnx_flatten(copies)
        before_values = [_compat.nnx_raw_value(leaf) for _, leaf in before]
        before_contents = [_contents(value) for value in before_values]
        before_metadata = {path: _compat.nnx_metadata(leaf) for path, leaf in before}
        before_attributes = [
            (path, node, attributes)
            for path, node in _compat.nnx_iter_graph(copies)
            if (attributes := _compat.nnx_attributes(node)) is not None
        ]
        try:
            with module_scopes(copies):
                out = self._fn(*args, **kwargs)
        except self._trace_context_error as err:
            raise type(err)(
                f"{err} -- {self._owner} traces fn, so fn cannot mutate nnx objects that "
                "exist outside the trace, such as a module fn closes over or reaches "
                "through functools.partial or a container that is not a JAX pytree. "
                "Pass the module (and nnx.Rngs) to the amp'd function as an argument "
                "instead: amp(loss)(model, x), not amp(lambda x: loss(model, x))(x). "
                "amp carries the state of nnx objects among its arguments back out."
            ) from err
        carried, bookkeeping, uncarried = self._set_attributes(before_attributes, {path for path, _ in before})
        # The state compared and carried as nnx.jit's is the objects' without the
        # attributes carried apart (and flax's marks of them): put them back as
        # they were on these copies.
        restored = [*carried, *bookkeeping]
        as_left = _compat.nnx_flatten(copies)[1] if restored else None
        for change in restored:
            _restore(change)
        graphdef, after = _compat.nnx_flatten(copies)
        if graphdef != self._graphdef:
            carried_paths = {(*change.path, change.name) for change in carried}
            raise self._structure_error(before, as_left or after, uncarried, before_metadata, carried_paths)
        # A value fn did not replace is the very object merged in (nnx.jit's
        # test), with the same contents where it is a container fn may fill in
        # place (the dicts `nnx.capture` hands `Module.sow`).
        changed = [
            (path, leaf)
            for (path, leaf), old, contents in zip(after, before_values, before_contents)
            if (value := _compat.nnx_raw_value(leaf)) is not old or _contents(value) != contents
        ]
        self._changed_paths = [path for path, _ in changed]
        self._attributes = [change.recorded() for change in carried]
        out, created = self._export(out, copies)
        traced = [leaf for change in carried for leaf in change.traced()]
        return out, ([leaf for _, leaf in changed], (created, traced))

    def _set_attributes(self, before: list, leaf_paths: set) -> tuple[list[_Attribute], list[_Attribute], list[str]]:
        """The attributes `fn` set, replaced or deleted on the copies (not their state's leaves).

        Returns those amp carries back (their values arrays, or hashable
        values, in pytrees), the changes of flax's own bookkeeping (which flax
        makes again on the caller's objects) and the names of those amp cannot
        carry, which hold nnx objects and so change the objects' structure.

        Raises:
            ValueError: an attribute was set to a value amp cannot inspect.
        """
        # Flat state paths end in the key flax gives an attribute: its name,
        # or an int where a node's keys are ints (an nnx.List's).
        leaves = {(path[:-1], str(path[-1])) for path in leaf_paths}
        carried, bookkeeping, uncarried = [], [], []
        for path, node, old in before:
            new = _compat.nnx_attributes(node) or {}
            marked = _compat.nnx_marked(old, new)
            for name in [*old, *(name for name in new if name not in old)]:
                if (name in old and name in new and old[name] is new[name]) or (path, name) in leaves:
                    continue  # unchanged, or a state leaf: carried as an update
                value = new.get(name, _DELETED)
                if _compat.nnx_is_bookkeeping(name):
                    bookkeeping.append(_Attribute(path, name, old.get(name, _DELETED), value, node))
                    continue
                if _holds_nnx_objects(old.get(name)) or _holds_nnx_objects(value):
                    uncarried.append(self._format_path((*path, name)))
                    continue
                change = _Attribute(path, name, old.get(name, _DELETED), value, node, name in marked)
                if not change.carriable():
                    raise ValueError(
                        f"{self._owner}: fn set {self._format_path((*path, name))} to a "
                        f"{type(change.unhashable()).__name__} (a functools.cached_property, say), "
                        "which amp cannot carry back: it runs fn on copies of the flax nnx objects "
                        "passed to it and carries back attributes set to arrays, hashable values or "
                        "pytrees of them, and cannot tell whether this one holds values traced in fn. "
                        "Compute it in __init__, keep its arrays in an nnx.Variable, or make it a "
                        "pytree (a tuple or dict of arrays)."
                    )
                carried.append(change)
        return carried, bookkeeping, uncarried

    def values(self, state: Any) -> dict:
        """The raw value of every leaf of `state` (the objects' state), by graph path.

        A snapshot to take before `fn` runs: merging shares Variables with
        `state`, so `fn`'s mutations show in it afterwards.
        """
        merged = self._nnx.merge(self._graphdef, state)
        return {path: _compat.nnx_raw_value(leaf) for path, leaf in _compat.nnx_flatten(merged)[1]}

    def changes_if(self, keep: Any, updates: list, before: dict) -> list:
        """`fn`'s `updates` where `keep` is true, else the values `before` them.

        A loss scaler that skips a step commits no module state this way.
        Called after `fn` was traced (which records the changed paths). A value
        whose shape fn changed (a dict `Module.sow` filled under
        `nnx.capture`) had nothing of that shape before: it is kept as
        computed, an observation of the forward pass rather than state.
        """
        kept = []
        for path, update in zip(self._changed_paths, updates):
            new, treedef = jax.tree_util.tree_flatten(update)
            old = jax.tree_util.tree_leaves(before[path])
            if [jax.numpy.shape(x) for x in new] != [jax.numpy.shape(x) for x in old]:
                kept.append(update)
                continue
            kept.append(jax.tree_util.tree_unflatten(treedef, [jax.lax.select(keep, n, o) for n, o in zip(new, old)]))
        return kept

    @property
    def holds_no_state(self) -> bool:
        """No nnx object among the arguments, and (once traced) none in the output.

        Such a call has nothing to write back or create, so its traced program
        may be reused (amp's eager cache).
        """
        return not self._nodes and self._created_graphdef is None

    def finish(self, result: tuple[Any, tuple[list, Any]]) -> Any:
        """Write the evaluated updates into the caller's objects; return `fn`'s output.

        Args:
            result: the evaluated ``(out, (updates, created))`` of `fn` (the
                method), its values in the dtypes `fn` itself produced.
                Attributes `fn` set on the objects are set on the caller's.

        Returns:
            `fn`'s output, the nnx objects in it resolved: the caller's own objects
            where `fn` returned (parts of) its arguments, new ones where it
            created them.

        Raises:
            flax.errors.TraceContextError: a changed Variable, or an object fn
                set an attribute of through flax, belongs to an outer JAX trace
                (as calling `fn` itself there would raise).
        """
        out, (updates, (created, traced)) = result
        nnx = self._nnx
        if updates:
            nnx.update(self._nodes, nnx.from_flat_state(list(zip(self._changed_paths, updates))))
        markers = any(_is_marker(leaf) for leaf in jax.tree_util.tree_leaves(out))
        if not markers and not self._attributes:
            return out
        by_path = dict(_compat.nnx_iter_graph(self._nodes))
        traced = iter(traced)
        for path, name, marked, rebuild in self._attributes:
            node, value = by_path[path], rebuild(traced)
            # Through flax where fn went through it (flax then marks it data or
            # static for the value the caller gets, as in a plain call), else
            # into __dict__, as functools.cached_property writes it.
            if marked and value is _DELETED:
                delattr(node, name)
            elif marked:
                setattr(node, name, value)
            elif value is _DELETED:
                vars(node).pop(name, None)
            else:
                vars(node)[name] = value
        if not markers:
            return out
        new = nnx.merge(self._created_graphdef, created) if created is not None else ()
        return _replace_markers(out, lambda m: by_path[m.path] if isinstance(m, _Existing) else new[m.index])

    def _export(self, out: Any, copies: tuple) -> tuple[Any, Any]:
        # nnx objects in fn's output: those of the arguments (or inside them) come
        # back as the caller's own objects; new ones are split so their state
        # crosses the trace boundary, and merged again in `finish`.
        leaves, treedef = jax.tree_util.tree_flatten(out, is_leaf=_compat.nnx_is_object)
        if not any(_compat.nnx_is_object(leaf) for leaf in leaves):
            return out, None
        paths = {id(node): path for path, node in _compat.nnx_iter_graph(copies) if _compat.nnx_is_object(node)}
        created = list(
            {id(leaf): leaf for leaf in leaves if _compat.nnx_is_object(leaf) and id(leaf) not in paths}.values()
        )
        shared = {paths[id(node)] for _, node in _compat.nnx_iter_graph(tuple(created)) if id(node) in paths}
        if shared:
            # Name a shared submodule, not each of its Variables as well.
            outermost = sorted(
                self._format_path(path) for path in shared if not any(path[:k] in shared for k in range(1, len(path)))
            )
            raise ValueError(
                f"{self._owner}: fn returned a new nnx object holding {', '.join(outermost)} of "
                "its arguments; amp can return new nnx objects and the argument objects "
                "themselves, but not new objects that share parts with the arguments. "
                "Return the argument's parts separately and assemble the new object "
                "outside the amp'd function."
            )
        created_state = None
        if created:
            self._created_graphdef, created_state = _compat.nnx_split(tuple(created))
        index = {id(obj): i for i, obj in enumerate(created)}
        marked = [
            leaf
            if not _compat.nnx_is_object(leaf)
            else _Existing(paths[id(leaf)])
            if id(leaf) in paths
            else _Created(index[id(leaf)])
            for leaf in leaves
        ]
        return jax.tree_util.tree_unflatten(treedef, marked), created_state

    def _structure_error(
        self, before: Any, after: Any, uncarried: list[str], metadata: dict, carried: set
    ) -> ValueError:
        """The error for a changed graph definition, naming what changed.

        Leaves added (less those of the `carried` attributes) or removed,
        attributes set to or from nnx objects, Variables whose metadata changed.
        """
        before_set, after_set = set(before.paths), set(after.paths)
        added = [
            self._format_path(p)
            for p in after.paths
            if p not in before_set and not any(p[:k] in carried for k in range(1, len(p) + 1))
        ]
        removed = [self._format_path(p) for p in before.paths if p not in after_set]
        # Attributes holding nnx objects that no added or removed leaf names already.
        named = [*added, *removed]
        replaced = [n for n in uncarried if not any(p == n or p.startswith((f"{n}.", f"{n}[")) for p in named)]
        relabelled = [
            self._format_path(path)
            for path, leaf in after
            if path in metadata and _compat.nnx_metadata(leaf) != metadata[path]
        ]
        what = "; ".join(
            f"{label} {', '.join(paths)}"
            for label, paths in (
                ("added", added),
                ("removed", removed),
                ("set", replaced),
                ("changed the metadata of", relabelled),
            )
            if paths
        )
        return ValueError(
            f"{self._owner}: fn changed the structure of the flax nnx objects passed to it "
            f"({what or 'its graph definition, at no path amp can name'}). amp runs fn on copies "
            "of them inside its trace and carries back the new values of their existing "
            "Variables and array attributes, and attributes fn sets to arrays or hashable "
            "values (a functools.cached_property), but not new nnx objects or Variables, nor "
            "Variables' metadata. Create such attributes before calling the amp'd function (in "
            "__init__, say, with a placeholder value fn then overwrites), or return the new "
            "values from fn instead of attaching them to the module (as Module.sow does)."
        )

    def _format_path(self, path: tuple) -> str:
        # Graph paths start at the index of the object among the call's nnx objects.
        index, *rest = path
        return self._names[index] + "".join(f".{key}" if isinstance(key, str) else f"[{key!r}]" for key in rest)


def _contents(value: Any) -> Any:
    """What a container value holds (its structure and the identity of its leaves); None for other values."""
    if not isinstance(value, (dict, list)):
        return None
    leaves, treedef = jax.tree_util.tree_flatten(value)
    return treedef, [id(leaf) for leaf in leaves]


def _call_object(obj: Any, *args: Any, **kwargs: Any) -> Any:
    return obj(*args, **kwargs)


def _argument_name(keypath: tuple, parameters: list[str]) -> str:
    """How an error names the argument at `keypath` of ``(args, kwargs)``: by fn's parameter where it has one."""
    group, *rest = keypath
    if group.idx == 1:  # a keyword argument: by its keyword
        first, *rest = rest
        return f"{first.key}{jax.tree_util.keystr(tuple(rest))}"
    if rest and rest[0].idx < len(parameters):
        first, *rest = rest
        return f"{parameters[first.idx]}{jax.tree_util.keystr(tuple(rest))}"
    return "args" + jax.tree_util.keystr(tuple(rest))


def _parameter_names(fn: Callable) -> list[str]:
    """The names of `fn`'s positional parameters before any ``*args`` (none where it has no signature)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in itertools.takewhile(lambda p: p.kind in positional, parameters)]


class _Deleted:
    def __repr__(self) -> str:
        return "<deleted>"


_DELETED = _Deleted()  # an attribute fn deleted (or one it added, as it was before)


class _Attribute:
    """An attribute `fn` set, replaced or deleted on a copy of a module: `node`, at graph `path`.

    Carried back to the caller's module by `GraphCall.finish`: the leaves
    traced in fn as outputs of amp's trace, the others as they are. `marked`:
    set through flax's ``__setattr__`` (not written into ``__dict__``).
    """

    def __init__(self, path: tuple, name: str, old: Any, new: Any, node: Any, marked: bool = False):
        self.path, self.name, self.old, self.new, self.node, self.marked = path, name, old, new, node, marked
        self._leaves, self._treedef = ([], None) if new is _DELETED else jax.tree_util.tree_flatten(new)

    def unhashable(self) -> Any:
        """A leaf of the new value that is neither an array nor hashable (which amp cannot inspect), or None."""
        for leaf in self._leaves:
            if isinstance(leaf, (jax.Array, np.ndarray)):
                continue
            try:
                hash(leaf)
            except TypeError:
                return leaf
        return None

    def carriable(self) -> bool:
        return self.unhashable() is None

    def traced(self) -> list:
        """The new value's leaves traced in fn: outputs of amp's trace."""
        return [leaf for leaf in self._leaves if isinstance(leaf, jax.core.Tracer)]

    def recorded(self) -> tuple[tuple, str, bool, Callable[[Iterator], Any]]:
        """``(path, name, marked, rebuild)``: ``rebuild(traced)`` is the new value, its traced leaves from `traced`.

        Holds neither the copy nor the traced leaves, which must not outlive the trace.
        """
        if self.new is _DELETED:
            return self.path, self.name, self.marked, lambda traced: _DELETED
        treedef = self._treedef
        kept = [None if isinstance(leaf, jax.core.Tracer) else (leaf,) for leaf in self._leaves]

        def rebuild(traced: Iterator) -> Any:
            return jax.tree_util.tree_unflatten(treedef, [next(traced) if k is None else k[0] for k in kept])

        return self.path, self.name, self.marked, rebuild


def _restore(change: _Attribute) -> None:
    """Put the attribute back on the copy as it was before fn ran."""
    attributes = vars(change.node)
    if change.old is _DELETED:
        attributes.pop(change.name, None)
    else:
        attributes[change.name] = change.old


def _holds_nnx_objects(value: Any) -> bool:
    """Whether `value` is or holds an nnx object (a module, a Variable...), which changes the graph's structure."""
    leaves = jax.tree_util.tree_leaves(value, is_leaf=_compat.nnx_is_object)
    return any(_compat.nnx_is_object(leaf) for leaf in leaves)


def _replace_markers(tree: Any, resolve: Callable[[Any], Any]) -> Any:
    return jax.tree_util.tree_map(lambda leaf: resolve(leaf) if _is_marker(leaf) else leaf, tree, is_leaf=_is_marker)


# --- module paths as named scopes ------------------------------------------------
#
# flax Linen runs every module method under `jax.named_scope` (its ``flax_profile``
# setting), so amp's policy keys and `explain` see ``Block_0/Dense_0``; nnx does
# not. While amp traces, `module_scopes` gives nnx modules the same: each
# `__call__` of a module among the call's objects runs under a scope named by
# its graph path relative to the module that called it (``blocks.0``, then
# ``attn``), the outermost one by its class name. The classes' `__call__` is
# wrapped only while some trace needs it (counted, under a lock); which
# instances get a scope is per context, so threads tracing at once, and calls
# of the same classes outside amp, see only their own.

_SCOPE_PATHS: contextvars.ContextVar[dict[int, tuple]] = contextvars.ContextVar(
    "jaxamp_nnx_scope_paths",
    default={},  # noqa: B039 (never mutated: `module_scopes` sets a new dict)
)
# The innermost scoped module being called: (its id, its graph path).
_ENCLOSING: contextvars.ContextVar[tuple[int, tuple] | None] = contextvars.ContextVar(
    "jaxamp_nnx_enclosing", default=None
)
_WRAPPED: dict[type, list] = {}  # class -> [its own __call__ or _ABSENT, users]
_WRAPPED_LOCK = threading.Lock()
_ABSENT = object()


@contextlib.contextmanager
def module_scopes(nodes: tuple) -> Iterator[None]:
    """nnx modules in `nodes` call ``__call__`` under a `jax.named_scope` of their path."""
    nnx = sys.modules["flax.nnx"]
    paths: dict[int, tuple] = {}
    classes: set[type] = set()
    for node in nodes:
        for path, value in _compat.nnx_iter_graph(node):
            if isinstance(value, nnx.Module) and id(value) not in paths:
                paths[id(value)] = path
                if callable(value):
                    classes.add(type(value))
    if not paths or not classes:
        yield
        return
    _wrap(classes)
    token = _SCOPE_PATHS.set({**_SCOPE_PATHS.get(), **paths})
    try:
        yield
    finally:
        _SCOPE_PATHS.reset(token)
        _unwrap(classes)


def _wrap(classes: set[type]) -> None:
    with _WRAPPED_LOCK:
        for cls in classes:
            if cls in _WRAPPED:
                _WRAPPED[cls][1] += 1
                continue
            _WRAPPED[cls] = [cls.__dict__.get("__call__", _ABSENT), 1]
            cls.__call__ = _scoped(cls.__call__)  # type: ignore[method-assign]  # undone by _unwrap


def _unwrap(classes: set[type]) -> None:
    with _WRAPPED_LOCK:
        for cls in classes:
            entry = _WRAPPED[cls]
            entry[1] -= 1
            if entry[1]:
                continue
            del _WRAPPED[cls]
            if entry[0] is _ABSENT:
                del cls.__call__
            else:
                cls.__call__ = entry[0]  # type: ignore[method-assign]


def _scoped(call: Callable) -> Callable:
    @functools.wraps(call)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        path = _SCOPE_PATHS.get().get(id(self))
        enclosing = _ENCLOSING.get()
        # Not a module of this trace, or a subclass's wrapper already opened its scope.
        if path is None or (enclosing is not None and enclosing[0] == id(self)):
            return call(self, *args, **kwargs)
        token = _ENCLOSING.set((id(self), path))
        try:
            with jax.named_scope(_scope_name(self, path, enclosing)):
                return call(self, *args, **kwargs)
        finally:
            _ENCLOSING.reset(token)

    return __call__


def _scope_name(module: Any, path: tuple, enclosing: tuple[int, tuple] | None) -> str:
    if not path:
        return type(module).__name__
    outer = () if enclosing is None else enclosing[1]
    relative = path[len(outer) :] if path[: len(outer)] == outer else path
    return ".".join(str(key) for key in relative)
