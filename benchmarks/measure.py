"""Measurements of a training step that do not run it.

* `median_lower_seconds`: how long tracing and lowering a function to StableHLO
  takes (what amp adds on top of plain JAX happens entirely here);
* `residuals`: the bytes reverse-mode autodiff keeps alive between the forward
  and the backward pass, the main term of activation memory;
* `matmul_flops`: floating-point operations of matmuls and convolutions by
  operand dtype, read off the jaxpr, so one can tell what share runs in half
  precision;
* `count_converts`: dtype conversions in the lowered program (StableHLO, what
  JAX hands to XLA), and `count_compiled_converts`: those left after XLA's
  optimisations (the compiled HLO, what runs).

All of them work from `jax.ShapeDtypeStruct` arguments, so a GPT-2-sized model
can be measured on a laptop without allocating its parameters. All but
`count_compiled_converts` are also backend-independent: compiling is where the
backend comes in.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import math
import re
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxamp import _compat
from jaxamp._jaxpr import equation_flops

__all__ = [
    "Residuals",
    "count_compiled_converts",
    "count_converts",
    "matmul_flops",
    "median_lower_seconds",
    "residuals",
    "runnable_seconds",
]


def runnable_seconds(step: Callable, *args: Any) -> tuple[float, float]:
    """``(lowering, compiling)`` seconds of ``step.lower(*args).compile()``, JAX's caches cleared first.

    Time to a runnable step, as a user's first call of a jit'd step waits for
    it (`step` is a `jax.jit`'d function; `jax.ShapeDtypeStruct` leaves are fine).
    """
    jax.clear_caches()
    gc.collect()
    start = time.perf_counter()
    lowered = step.lower(*args)
    lowered_at = time.perf_counter()
    lowered.compile()
    return lowered_at - start, time.perf_counter() - lowered_at


def median_lower_seconds(
    builders: Mapping[str, tuple[Callable[[], Callable], Sequence[Any]]], repeats: int
) -> dict[str, float]:
    """Median wall time of ``jax.jit(build()).lower(*args)`` for each builder.

    Each repeat calls ``build()`` afresh, so JAX's tracing caches (keyed on the
    function object) never answer for a previous repeat. The builders take turns
    within each repeat, so slow drifts of the machine hit all of them alike, and
    one untimed round first pays one-off costs (imports, JAX's own caches).

    Args:
        builders: name -> ``(build, args)``: ``build()`` returns a new function
            to lower at ``args`` (`jax.ShapeDtypeStruct` leaves are fine).
        repeats: timed rounds (at least 1).

    Returns:
        name -> median seconds.
    """
    times: dict[str, list[float]] = {name: [] for name in builders}
    for round_ in range(repeats + 1):
        for name, (build, args) in builders.items():
            gc.collect()
            # A collection pause inside one sample is noise, not tracing cost.
            gc.disable()
            try:
                start = time.perf_counter()
                jax.jit(build()).lower(*args)
                elapsed = time.perf_counter() - start
            finally:
                gc.enable()
            if round_:
                times[name].append(elapsed)
    return {name: statistics.median(samples) for name, samples in times.items()}


def _nbytes(aval: Any) -> int:
    return math.prod(aval.shape) * np.dtype(aval.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Residuals:
    """What the forward pass of a function saves for its backward pass.

    Attributes:
        saved_bytes: bytes of residuals other than the function's own arguments
            (those are alive anyway): the memory the backward pass costs.
        argument_bytes: bytes of arguments that are also residuals.
        bytes_by_dtype: `saved_bytes` split by dtype name.
        by_source: `saved_bytes` split by the source line that produced the
            residual (``"file.py:12 (function)"``, or the primitive's name when
            no user frame is known) and then by dtype name. Residuals of a
            loop are attributed to the loop's line.
    """

    saved_bytes: int
    argument_bytes: int
    bytes_by_dtype: dict[str, int]
    by_source: dict[str, dict[str, int]]


# The tail of a description such as "output of exp from /x/models.py:101:41 (causal_attention)".
_SOURCE = re.compile(r"output of (?P<what>.+?)(?: from (?P<file>.+?):(?P<line>\d+):\d+ \((?P<fn>.+)\))?$")


def _source_key(description: str) -> str:
    found = _SOURCE.match(description)
    if found is None:
        return description
    if found["file"] is None:
        return found["what"]
    return f"{Path(found['file']).name}:{found['line']} ({found['fn']})"


def residuals(fn: Callable, *args: Any) -> Residuals:
    """Sum up the residuals of ``jax.vjp(fn, *args)``.

    Args:
        fn: a function of array pytrees returning a scalar (or any array).
        *args: its arguments (arrays or `jax.ShapeDtypeStruct`s).

    Returns:
        A `Residuals` summary.
    """
    saved, from_args = 0, 0
    by_dtype: collections.Counter[str] = collections.Counter()
    by_source: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for aval, description in _compat.saved_residuals(fn, *args):
        if not hasattr(aval, "shape"):
            continue
        size = _nbytes(aval)
        if description.startswith("from the argument"):
            from_args += size
            continue
        dtype = np.dtype(aval.dtype).name
        saved += size
        by_dtype[dtype] += size
        by_source[_source_key(description)][dtype] += size
    sources = {key: dict(counts) for key, counts in by_source.items()}
    return Residuals(saved, from_args, dict(by_dtype), sources)


_MATMULS = ("dot_general", "conv_general_dilated")


def _sub_jaxprs(params: Mapping[str, Any]) -> Iterator[Any]:
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, (_compat.Jaxpr, _compat.ClosedJaxpr)):
                yield item


def _add_flops(jaxpr: Any, times: int, out: collections.Counter) -> None:
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        name = eqn.primitive.name
        if name in _MATMULS:
            out[np.dtype(eqn.invars[0].aval.dtype).name] += times * equation_flops(eqn)
        elif name == "cond":
            # One branch runs: count the most expensive.
            per_branch = [matmul_flops(branch) for branch in eqn.params["branches"]]
            costliest = max(per_branch, key=lambda c: sum(c.values()), default={})
            for dtype, flops in costliest.items():
                out[dtype] += times * flops
        else:
            # A scan body runs `length` times; a while body an unknown number
            # of times, counted once.
            inner = times * eqn.params["length"] if name == "scan" else times
            for sub in _sub_jaxprs(eqn.params):
                _add_flops(sub, inner, out)


def matmul_flops(jaxpr: Any) -> collections.Counter[str]:
    """FLOPs of every matmul and convolution in `jaxpr`, by operand dtype name.

    Walks nested jaxprs (jit, remat, custom derivative bodies, loops), with scan
    bodies counted ``length`` times. A dot_general costs
    ``2 * batch * M * N * K``; a convolution ``2 * output size * kernel window *
    input features per group``.

    Args:
        jaxpr: a `ClosedJaxpr` or `Jaxpr`, e.g. from `jax.make_jaxpr`.

    Returns:
        dtype name (of the left operand) -> FLOPs.
    """
    out: collections.Counter[str] = collections.Counter()
    _add_flops(jaxpr, 1, out)
    return out


_CONVERT = re.compile(r"\bstablehlo\.convert\b")


def count_converts(lowered_text: str) -> int:
    """Number of ``stablehlo.convert`` ops in a lowered program's text.

    Loop bodies are counted once, as they are written, not once per iteration.
    """
    return len(_CONVERT.findall(lowered_text))


# An HLO instruction such as "%convert.3 = bf16[8,128]{1,0} convert(%p.1)", at
# top level or inside a fused computation; a scalar's shape is "f32[]".
_COMPILED_CONVERT = re.compile(r"=\s*[a-z][a-z0-9]*\[[^\]]*\](?:\{[^}]*\})?\s+convert\(")


def count_compiled_converts(compiled_text: str) -> int:
    """Number of ``convert`` instructions in a compiled program's HLO text.

    Counts those at top level and inside fusions and other called computations
    (``jax.jit(f).lower(...).compile().as_text()``), each computation once as
    written, not once per call or per loop iteration. Unlike `count_converts`,
    this depends on the backend: XLA:CPU, for one, computes most bfloat16
    elementwise operations in float32, with converts around them.
    """
    return len(_COMPILED_CONVERT.findall(compiled_text))
