"""Where and with what a benchmark ran, recorded next to its figures.

Wall-clock figures (lowering times, eager calls, step times) only compare
within one machine and one JAX version, so every results file says which.
"""

from __future__ import annotations

import datetime
import os
import platform
import re

import jax
import jaxlib

__all__ = ["default_label", "machine_info"]


def machine_info() -> dict:
    """The accelerator, host, software versions, load and date of this run.

    Returns:
        ``{"backend", "device", "device_count", "cpu", "cpu_count",
        "load_average", "python", "jax", "jaxlib", "date"}``.
    """
    device = jax.devices()[0]
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            found = re.search(r"model name\s*:\s*(.+)", f.read())
            cpu = found.group(1).strip() if found else cpu
    except OSError:
        pass
    return {
        "backend": jax.default_backend(),
        "device": device.device_kind,
        "device_count": jax.device_count(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        # Lowering times are wall-clock: a busy host slows them (ratios less so).
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", None),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def default_label() -> str:
    """The backend and device kind, e.g. ``gpu-nvidia-h100-80gb-hbm3``: names the
    results files and the RESULTS.md section when no label is given."""
    kind = re.sub(r"[^a-z0-9]+", "-", jax.devices()[0].device_kind.lower()).strip("-")
    return f"{jax.default_backend()}-{kind}"
