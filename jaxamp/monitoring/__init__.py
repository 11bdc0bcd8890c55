"""The numerics monitor: each layer's range statistics inside the jitted step, over a run.

`monitor` wraps a train step (forward and backward) so that it also returns a
`MonitorStats`: per named scope, the largest magnitude, underflow and
overflow-risk counts and inf/NaN counts of every low-precision matmul's
operands and result and of every value a scope hands on. `MonitorRecorder`
keeps them on device over steps (`load_records` reads a saved run back),
`monitor_report` draws them (`summarize` gives a `ScopeSummary` per scope) and
`suggest_policy` reads a `PolicySuggestion` off them. The guide is
docs/monitoring.md.
"""

from ._measure import FIELDS
from ._monitor import MonitorStats, monitor
from ._recorder import MonitorRecorder, load_records
from ._report import ScopeSummary, monitor_report, summarize
from ._suggest import PolicySuggestion, Suggestion, suggest_policy
from ._walk import Site

__all__ = [
    "FIELDS",
    "MonitorRecorder",
    "MonitorStats",
    "PolicySuggestion",
    "ScopeSummary",
    "Site",
    "Suggestion",
    "load_records",
    "monitor",
    "monitor_report",
    "suggest_policy",
    "summarize",
]
