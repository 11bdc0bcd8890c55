"""The numerics monitor: statistics of a step inside jit, recorded over steps, reported."""

from ._measure import FIELDS
from ._monitor import MonitorStats, monitor
from ._walk import Site

__all__ = ["FIELDS", "MonitorStats", "Site", "monitor"]
