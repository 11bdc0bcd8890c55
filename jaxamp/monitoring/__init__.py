"""The numerics monitor: statistics of a step inside jit, recorded over steps, reported."""

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
