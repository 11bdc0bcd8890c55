"""Diagnostics: what an amp'd function runs in which dtype, where it overflows, what it loses.

- `explain` reports, per equation, which table entry decided its precision, the
  operand dtypes before and after, FLOPs and the source line: an `AmpReport`,
  whose rows are `AmpRow` records.
- `find_nonfinite` runs the amp'd function equation by equation and returns the
  first whose output holds an inf or NaN (a `NonFiniteReport`), or None.
- `compare` runs the function in float32 and under amp and reports the error
  each scope adds and accumulates: a `ComparisonReport`, with a `ScopeError`
  per scope and a `GradientError` per floating argument leaf.

`explain`, `find_nonfinite` and `compare` are also at the top level
(`jaxamp.explain`...). The guide is docs/diagnostics.md.
"""

from ._compare import ComparisonReport, GradientError, ScopeError, compare
from ._explain import AmpReport, AmpRow, NonFiniteReport, explain, find_nonfinite

__all__ = [
    "AmpReport",
    "AmpRow",
    "ComparisonReport",
    "GradientError",
    "NonFiniteReport",
    "ScopeError",
    "compare",
    "explain",
    "find_nonfinite",
]
