"""Diagnostics: what amp did to every equation, and where an overflow starts.

`explain` traces the amp'd function (nothing runs) and reports one row per
equation, nested bodies included; in fp8 mode it also says how each matmul ran
in float8 or why it did not. `find_nonfinite` runs it eagerly, equation by
equation, and stops at the first output holding an inf or NaN.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .._dtypes import dtype_short_name, is_castable
from .._jaxpr import MATMUL_NAMES, bodies, equation_flops, matmuls_in, source_label
from .._options import AmpOptions
from ..transform._interpreter import EquationEvent, warn_once

__all__ = ["AmpReport", "AmpRow", "NonFiniteReport", "explain", "find_nonfinite"]


def _name(dtype: Any) -> str:
    return "-" if dtype is None else dtype_short_name(dtype) if _is_dtype(dtype) else str(dtype)


def _is_dtype(dtype: Any) -> bool:
    try:
        np.dtype(dtype)
        return True
    except TypeError:
        return False


_HALF = ("f16", "bf16")
_FLOAT8 = ("e4m3", "e5m2")  # as `dtype_short_name` shows fp8 mode's formats


@dataclasses.dataclass(frozen=True)
class AmpRow:
    """One equation as amp ran it.

    Attributes:
        primitive: the primitive's name (``"dot_general"``...).
        scope: the active `jax.named_scope` path, ``"outer/inner"`` (``""`` at top level).
        decided_by: which policy entry chose the rule, in the order amp
            asks them (see `jaxamp.transform._scopes.choose_rule`):
            ``"amp_stop"``, ``"scope:<name>"``, ``"user"`` (the user's entry
            for the primitive, differing from the default table's),
            ``"requested"`` (a matmul whose program asked for a precision:
            ``precision=HIGHEST``, a wider ``preferred_element_type``, or
            operands widened from half precision, ``q.astype(float32)``; see
            `jaxamp.analyses._upcasts`),
            ``"tail"``, ``"statistics"``, ``"range"``, ``"primitive"`` (the
            default table's entry), ``"amp_default"``, or ``"original"`` (no
            entry, or a primitive amp cannot rewrite).
        original_dtypes: operand dtypes in the user's program.
        dtypes_before: operand dtypes as they reached the equation under amp.
        dtypes_after: operand dtypes the primitive ran with.
        output_dtypes: result dtypes.
        casts: operands the rule converted.
        flops: matmul/conv FLOPs per call of the function (scan trip counts
            multiplied in; a while loop counts once); 0 for other primitives.
        trip_count: how many times the equation runs per call.
        source: ``"file.py:line (function)"`` of the user code that emitted it.
        detail: in fp8 mode, for a matmul: its float8 formats and scaling, or
            why it stayed out of float8; for an equation whose body amp does
            not rewrite (a Pallas kernel), the matmuls inside it. ``""`` otherwise.
    """

    primitive: str
    scope: str
    decided_by: str
    original_dtypes: tuple[str, ...]
    dtypes_before: tuple[str, ...]
    dtypes_after: tuple[str, ...]
    output_dtypes: tuple[str, ...]
    casts: int
    flops: int
    trip_count: int
    source: str | None
    detail: str = ""

    @property
    def low_precision(self) -> bool:
        """Whether every floating operand ran in a 16-bit or 8-bit float."""
        floats = [d for d in self.dtypes_after if d in ("f32", *_HALF, *_FLOAT8)]
        return bool(floats) and all(d in (*_HALF, *_FLOAT8) for d in floats)

    @property
    def float8(self) -> bool:
        """Whether every floating operand ran in float8 (fp8 mode's matmuls)."""
        floats = [d for d in self.dtypes_after if d in ("f32", *_HALF, *_FLOAT8)]
        return bool(floats) and all(d in _FLOAT8 for d in floats)

    @property
    def full_precision(self) -> bool:
        """Whether some float operand ran in float32."""
        return "f32" in self.dtypes_after

    @property
    def kept_full_on_purpose(self) -> bool:
        """Whether a rule ran this equation in float32 where amp could have moved it.

        True when an operand reached it in half precision and went up to
        float32, or when an entry that pins float32 decided it (the program's
        tail, normalisation statistics, a scope); not for equations that simply
        stayed float32 (random-number arithmetic, constants, integer work).
        """
        if not self.full_precision or self.decided_by == "amp_stop":
            return False
        pairs = zip(self.dtypes_before, self.dtypes_after)
        cast_up = any(b in _HALF and a == "f32" for b, a in pairs)
        pinned = self.decided_by in ("user", "requested", "tail", "statistics") or self.decided_by.startswith("scope:")
        return cast_up or pinned

    @property
    def moved_to_half(self) -> bool:
        """Whether amp cast a float32 operand of this equation down to 16 or 8 bits."""
        pairs = zip(self.dtypes_before, self.dtypes_after)
        return any(b == "f32" and a in (*_HALF, *_FLOAT8) for b, a in pairs)


def _row(event: EquationEvent, fp8: bool = False) -> AmpRow:
    eqn = event.eqn
    casts = sum(a != b for a, b in zip(event.dtypes_before, event.dtypes_after) if is_castable(a))
    flops = equation_flops(eqn) * event.trip_count
    return AmpRow(
        primitive=eqn.primitive.name,
        scope="/".join(event.scopes),
        decided_by=event.decided_by,
        original_dtypes=tuple(_name(d) for d in event.original_dtypes),
        dtypes_before=tuple(_name(d) for d in event.dtypes_before),
        dtypes_after=tuple(_name(d) for d in event.dtypes_after),
        output_dtypes=tuple(_name(getattr(o, "dtype", None)) for o in event.outputs),
        casts=casts,
        flops=flops,
        trip_count=event.trip_count,
        source=_compat.frame_line(event.user_frame),
        detail=event.detail or (_not_float8(event) if fp8 else ""),
    )


def _not_float8(event: EquationEvent) -> str:
    """Why fp8 mode's rule never saw this matmul (or these, in a body amp does not rewrite)."""
    eqn = event.eqn
    if eqn.primitive.name in MATMUL_NAMES:
        operands = ",".join(_name(d) for d in event.dtypes_after)
        return f"kept {operands}: decided by {event.decided_by}"
    inside = sum(1 for body in bodies(eqn) for _ in matmuls_in(body))
    if inside:
        return (
            f"not float8: {inside} matmul(s) inside a {eqn.primitive.name} body, which amp "
            "does not rewrite (it runs as written)"
        )
    return ""


@dataclasses.dataclass(frozen=True)
class AmpReport:
    """Per-equation record of an amp'd function; see `explain`.

    Attributes:
        rows: one `AmpRow` per equation, in program order, nested bodies inline.
        compute_dtype: amp's compute dtype (``"bf16"`` in fp8 mode).
        fp8_recipe: fp8 mode's `jaxamp.fp8.Fp8Recipe`; None in other modes.
    """

    rows: tuple[AmpRow, ...]
    compute_dtype: str
    fp8_recipe: Any = None

    @property
    def total_matmul_flops(self) -> int:
        return sum(r.flops for r in self.rows)

    @property
    def low_precision_flop_fraction(self) -> float:
        """Share of matmul/conv FLOPs whose operands ran in 16-bit floats (1.0 if none)."""
        total = self.total_matmul_flops
        if total == 0:
            return 1.0
        return sum(r.flops for r in self.rows if r.low_precision) / total

    @property
    def fp8_flop_fraction(self) -> float:
        """Share of matmul/conv FLOPs whose operands ran in float8 (0.0 if none)."""
        total = self.total_matmul_flops
        return sum(r.flops for r in self.rows if r.float8) / total if total else 0.0

    @property
    def kept_out_of_fp8(self) -> tuple[AmpRow, ...]:
        """The matmuls, and bodies holding matmuls, that fp8 mode did not run in float8.

        Each row's `detail` says why. Empty outside fp8 mode.
        """
        if self.fp8_recipe is None:
            return ()
        # In fp8 mode exactly the matmul rows and bodies holding matmuls have a detail.
        return tuple(r for r in self.rows if r.detail and not r.float8)

    @property
    def casts_inserted(self) -> int:
        """Operand conversions amp added (per appearance in the program)."""
        return sum(r.casts for r in self.rows)

    @property
    def kept_full_by_rule(self) -> int:
        """Equations a rule kept in float32 where amp could have moved them.

        See `AmpRow.kept_full_on_purpose`: equations that simply stayed
        float32 (random numbers, constants) are not counted.
        """
        return sum(r.kept_full_on_purpose for r in self.rows)

    @property
    def moved_to_half(self) -> int:
        """Equations whose float32 operands amp moved to the compute dtype (or float8)."""
        return sum(r.moved_to_half for r in self.rows)

    @property
    def kept_full_by_amp_stop(self) -> int:
        """Equations run at original precision inside `amp_stop` regions."""
        return sum(r.decided_by == "amp_stop" for r in self.rows)

    def to_dict(self) -> dict:
        """A JSON-ready dict: summary figures and every row (in fp8 mode also
        ``fp8_recipe`` and ``fp8_flop_fraction``)."""
        out = {
            "compute_dtype": self.compute_dtype,
            "low_precision_flop_fraction": self.low_precision_flop_fraction,
            "total_matmul_flops": self.total_matmul_flops,
            "casts_inserted": self.casts_inserted,
            "kept_full_by_rule": self.kept_full_by_rule,
            "moved_to_half": self.moved_to_half,
            "kept_full_by_amp_stop": self.kept_full_by_amp_stop,
            "rows": [dataclasses.asdict(r) for r in self.rows],
        }
        if self.fp8_recipe is not None:
            out["fp8_recipe"] = dataclasses.asdict(self.fp8_recipe)
            out["fp8_flop_fraction"] = self.fp8_flop_fraction
        return out

    def __str__(self) -> str:
        return self.table()

    def table(self, fold: bool = True) -> str:
        """The report as text: a summary line, then one row per kind of equation.

        Rows group equations with the same scope, primitive, rule, dtypes and
        source line. With `fold`, repeated instances of a layer (scopes that
        differ only in their numbers: ``layer_norm_3`` ... ``layer_norm_12``,
        ``layers/3/mlp``) share one set of rows, the scope's numbers shown as
        ``*`` and the count summed.

        Args:
            fold: group numbered instances of the same layer.
        """
        groups: dict[tuple, list[AmpRow]] = defaultdict(list)
        for row in self.rows:
            scope = _fold_scope(row.scope) if fold else row.scope
            key = (
                scope,
                row.primitive,
                row.decided_by,
                row.dtypes_before,
                row.dtypes_after,
                row.output_dtypes,
                row.detail,
                row.source or "",
            )
            groups[key].append(row)
        header: tuple[str, ...] = (
            "scope",
            "primitive",
            "count",
            "decided by",
            "before",
            "after",
            "out",
            "casts",
            "FLOPs",
            "source",
        )
        notes = any(row.detail for row in self.rows)
        if notes:
            header += ("notes",)
        lines = [header]
        for (scope, prim, decided, before, after, out, detail, source), rows in groups.items():
            flops = sum(r.flops for r in rows)
            lines.append(
                (
                    scope or "-",
                    prim,
                    str(sum(r.trip_count for r in rows)),
                    decided,
                    ",".join(before) or "-",
                    ",".join(after) or "-",
                    ",".join(out),
                    str(sum(r.casts for r in rows)),
                    _si(flops) if flops else "",
                    _short_source(source),
                    *((detail,) if notes else ()),
                )
            )
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        table = "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)
        summary = (
            f"amp report (compute dtype {self.compute_dtype}): "
            f"{self.low_precision_flop_fraction:.1%} of {_si(self.total_matmul_flops)} matmul "
            f"FLOPs in low precision; {self.casts_inserted} casts inserted; "
            f"{self.moved_to_half} equations moved to {self.compute_dtype}, "
            f"{self.kept_full_by_rule} kept in float32 by rule, "
            f"{self.kept_full_by_amp_stop} inside amp_stop."
        )
        if self.fp8_recipe is not None:
            summary += (
                f" float8 (current scaling): {self.fp8_flop_fraction:.1%} of matmul FLOPs; "
                f"{len(self.kept_out_of_fp8)} equation(s) with matmuls kept out of it (see notes)."
            )
        return summary + "\n" + table


# An instance number: digits that make a whole name component, after ``_``
# or ``.`` or alone, before the component's end.
_NUMBERED = re.compile(r"(?:(?<=[_.])|^)\d+(?=$|[_.])")


def _fold_scope(scope: str) -> str:
    """`scope` with its instance numbers as ``*``: ``layers_3/attn`` -> ``layers_*/attn``.

    Linen names instances ``Dense_3``; nnx module paths (see
    `jaxamp.transform._nnx.module_scopes`) read ``blocks.3``; a path component
    ``3`` is one too. Digits inside a name are not (``jnp.einsum``'s scope
    ``bsd,3dkh->bs3kh``, ``conv3x3``).
    """
    return "/".join(_NUMBERED.sub("*", part) for part in scope.split("/"))


def _short_source(source: str) -> str:
    """``file.py:12`` of ``"/path/to/file.py:12 (fn)"``: the column stays narrow."""
    if not source:
        return ""
    location = source.split(" (", 1)[0]
    return location.rsplit("/", 1)[-1]


def _si(value: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}"


def explain(fn: Callable, **amp_options: Any) -> Callable[..., AmpReport]:
    """Report what `amp` does to every equation of `fn`, without running it.

    Args:
        fn: the function, as you would pass it to `amp`.
        **amp_options: `amp`'s keyword arguments (``compute_dtype``,
            ``amp_policy``, ``policy``). With ``compute_dtype="fp8"`` (or an
            `Fp8Recipe`) each matmul row's `AmpRow.detail` gives its float8
            formats and scaling, or why it stayed out of float8, and the
            report its `AmpReport.fp8_flop_fraction`.

    Returns:
        A function taking `fn`'s arguments and returning an `AmpReport`.
    """
    options = AmpOptions.resolve(**amp_options)
    _check_callable(fn, "explain")
    fp8 = options.fp8 is not None

    @functools.wraps(fn)
    def report(*args, **kwargs) -> AmpReport:
        events: list[EquationEvent] = []
        # Filtered: arguments may hold non-arrays (an Equinox module's activation
        # function), which amp treats as static.
        eqx.filter_eval_shape(lambda a, k: options.run(fn, a, k, observer=events.append), args, kwargs)
        rows = tuple(_row(e, fp8) for e in events)
        return AmpReport(rows, dtype_short_name(options.compute_dtype), options.fp8)

    return report


@dataclasses.dataclass(frozen=True)
class NonFiniteReport:
    """The first equation whose output held an inf or NaN; see `find_nonfinite`.

    Attributes:
        primitive: the primitive's name.
        scope: the active named-scope path.
        source: ``"file.py:line (function)"`` of the user code that emitted it.
        file, line: the same, split out (None when unknown).
        input_dtypes, output_dtypes: dtypes the equation ran with.
        input_ranges, output_ranges: ``(min, max)`` of each floating operand /
            result (finite values only; None when it has none).
    """

    primitive: str
    scope: str
    source: str | None
    file: str | None
    line: int | None
    input_dtypes: tuple[str, ...]
    output_dtypes: tuple[str, ...]
    input_ranges: tuple[tuple[float, float] | None, ...]
    output_ranges: tuple[tuple[float, float] | None, ...]

    def __str__(self) -> str:
        return (
            f"first non-finite output: {self.primitive} at {self.source or 'unknown source'}"
            f" (scope {self.scope or '-'})\n"
            f"  inputs  {self.input_dtypes} ranges {self.input_ranges}\n"
            f"  outputs {self.output_dtypes} ranges {self.output_ranges}"
        )


class _FoundNonFinite(Exception):
    def __init__(self, event: EquationEvent):
        self.event = event


def _float_values(xs) -> list:
    return [x for x in xs if jnp.issubdtype(getattr(x, "dtype", np.int32), jnp.inexact)]


def _range(x: Any) -> tuple[float, float] | None:
    values = np.asarray(jnp.asarray(x, jnp.float32)).ravel()
    values = values[np.isfinite(values)]
    return (float(values.min()), float(values.max())) if values.size else None


def _check_event(event: EquationEvent) -> None:
    outputs = _float_values(event.outputs)
    if any(isinstance(x, jax.core.Tracer) for x in outputs):
        _say_body_unchecked(event)
        return
    if any(not bool(jnp.all(jnp.isfinite(x))) for x in outputs):
        raise _FoundNonFinite(event)


def _say_body_unchecked(event: EquationEvent) -> None:
    """Say once per body that its equations run traced (a `shard_map` body, run per device), so are not checked."""
    traced = next((site for site in event.call_sites if site.primitive is _compat.shard_map_p), None)
    where = source_label(traced) if traced is not None else None
    what = f"the shard_map body at {where}" if where else "a body JAX traces rather than runs (a shard_map's)"
    warn_once(
        ("find_nonfinite_traced_body", where or ""),
        f"jaxamp.find_nonfinite: {what} runs traced, once for every device, so its equations are not checked "
        "one by one: a non-finite value made there is reported at the first equation after it whose output is "
        "not finite. Call find_nonfinite on the body's function, with one device's arguments, to look inside.",
        UserWarning,
    )


def find_nonfinite(fn: Callable, **amp_options: Any) -> Callable[..., NonFiniteReport | None]:
    """Find the first equation of the amp'd `fn` that produces an inf or NaN.

    Runs eagerly, equation by equation (bodies of jit, scan, while, cond,
    remat and custom rules included), so an overflow is caught where it starts
    even when a later op hides it (``tanh(inf) == 1``). A `shard_map` body
    runs traced, so its equations are not checked (said once, naming it): a
    non-finite value made there is found at the first equation after it.

    Args:
        fn: the function, as you would pass it to `amp`.
        **amp_options: `amp`'s keyword arguments.

    Returns:
        A function taking `fn`'s arguments (concrete arrays, not tracers) and
        returning a `NonFiniteReport`, or None when every output stays finite.
    """
    options = AmpOptions.resolve(**amp_options)
    _check_callable(fn, "find_nonfinite")

    @functools.wraps(fn)
    def locate(*args, **kwargs) -> NonFiniteReport | None:
        try:
            with jax.disable_jit():
                options.run(fn, args, kwargs, observer=_check_event, inline=True)
        except _FoundNonFinite as found:
            return _nonfinite_report(found.event)
        return None

    return locate


def _nonfinite_report(event: EquationEvent) -> NonFiniteReport:
    row = _row(event)
    frame = event.user_frame
    return NonFiniteReport(
        primitive=row.primitive,
        scope=row.scope,
        source=row.source,
        file=frame.file_name if frame else None,
        line=frame.start_line if frame else None,
        input_dtypes=row.dtypes_after,
        output_dtypes=row.output_dtypes,
        input_ranges=tuple(_range(x) for x in _float_values(event.inputs)),
        output_ranges=tuple(_range(x) for x in _float_values(event.outputs)),
    )


def _check_callable(fn: Any, name: str) -> None:
    if not callable(fn):
        raise TypeError(f"{name} expects a callable, got {type(fn).__name__}: {fn!r:.100}.")
