"""Running one measurement in a fresh Python process.

Some figures are only right in a process of their own: a training step's peak
device memory (the process's allocator has seen nothing else) and the first,
cold lowering of a function (no JAX cache has seen it; `jax.clear_caches`
clears jit's caches but not those of `jax.numpy`'s functions, of the
linearization rules or of Python's imports). `run` starts::

    python -m benchmarks.worker '{"task": "benchmarks.step_time:worker_task", "kwargs": {...}}'

from the repository root; the worker imports the task's module, calls
``task(**kwargs)`` and prints the dict it returns as one line of JSON tagged
with `TAG`, which `run` picks out of whatever else the process printed. A task
that raises, a process that dies and one that runs past its time limit all
come back as ``{"error": ...}``.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.guard import guarded

__all__ = ["TAG", "main", "run", "task_name"]

TAG = "BENCHMARK-RESULT:"
"""Prefix of the line carrying a worker's result."""

_ROOT = Path(__file__).resolve().parents[1]


def task_name(task: Callable[..., dict]) -> str:
    """``"module:qualname"`` of a module-level function, as the worker imports it.

    A function of a module run as ``python -m benchmarks.x`` is named after
    ``benchmarks.x``, not ``__main__``.
    """
    module = task.__module__
    if module == "__main__":
        spec = getattr(sys.modules["__main__"], "__spec__", None)
        if spec is None:
            raise ValueError(
                f"{task.__qualname__} is defined in a script: run it with `python -m`, so "
                "that a worker process can import it."
            )
        module = spec.name
    return f"{module}:{task.__qualname__}"


def run(task: Callable[..., dict], kwargs: dict[str, Any], timeout_s: float) -> dict:
    """Call ``task(**kwargs)`` in a new Python process and return its result.

    Args:
        task: a module-level function returning a JSON-serialisable dict.
        kwargs: its keyword arguments (JSON-serialisable).
        timeout_s: the process is killed after this many seconds.

    Returns:
        The task's dict, or ``{"error": "..."}`` if it raised, the process
        failed or it timed out.
    """
    spec = json.dumps({"task": task_name(task), "kwargs": kwargs})
    command = [sys.executable, "-m", "benchmarks.worker", spec]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=_ROOT, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f}s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(TAG):
            return json.loads(line[len(TAG) :])
    return {"error": f"worker exited with {proc.returncode}: {proc.stderr.strip()[-2000:]}"}


def _call(spec: dict) -> dict:
    module, _, qualname = spec["task"].partition(":")
    task: Any = importlib.import_module(module)
    for attr in qualname.split("."):
        task = getattr(task, attr)
    result = task(**spec["kwargs"])
    if not isinstance(result, dict):
        raise TypeError(f"task {spec['task']} returned {type(result).__name__}, not a dict")
    return result


def main(argv: list[str] | None = None) -> None:
    """Worker entry point: run the task of the JSON spec in ``argv[0]`` and print its
    result on one line prefixed with `TAG`."""
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0])
    result = guarded(spec.get("task", "task"), lambda: _call(spec))
    print(TAG + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
