"""Recording a failed measurement instead of losing the whole run to it.

A benchmark run takes minutes and measures dozens of figures; one of them
failing (amp crashing on a model after a JAX upgrade, a worker running out of
memory) should leave a note in the results next to the figures that did come
out, not a traceback in place of all of them.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

__all__ = ["guarded"]


def guarded(what: str, fn: Callable[[], dict]) -> dict:
    """``fn()``, or ``{"error": "Type: message"}`` if it raises.

    The traceback and a one-line summary go to stderr.

    Args:
        what: names the measurement in the summary line.
        fn: takes no arguments and returns a dict of figures.

    Returns:
        What `fn` returned, or the error record.
    """
    try:
        return fn()
    except Exception as err:  # noqa: BLE001  (any failure is recorded, not raised)
        traceback.print_exc()
        print(f"!! {what} failed: {type(err).__name__}: {err}", file=sys.stderr)
        return {"error": f"{type(err).__name__}: {err}"}
