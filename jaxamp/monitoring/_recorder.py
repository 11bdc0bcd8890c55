"""`MonitorRecorder`: statistics and loss-scale events over a training run, read from the device in batches."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ._measure import FIELDS, derived, per_site
from ._monitor import MonitorStats

__all__ = ["MonitorRecorder", "load_records"]


class MonitorRecorder:
    """Keep a run's `MonitorStats` and loss scales on device; write them out in batches.

    ``record`` is called every step and never reads from the device: it keeps
    the step's arrays (statistics every `every` steps, the loss scale and
    finiteness every step) and reads them all at once every `flush_every`
    recorded statistics, at ``flush()``, or when the recorder is closed (it is
    a context manager). Each flush appends to ``records``, writes one JSON
    line per record to `path` and, with `tensorboard_dir`, scalars to
    TensorBoard (``tensorboardX``, imported only then).

    Records are dicts: ``{"kind": "stats", "step", "headroom_bits", "sites":
    [{"direction", "scope", "name", "dtype", "fp8", "handed_in", <FIELDS>...}]}``, and
    loss-scale events ``{"kind": "loss_scale", "step", "loss_scale",
    "skipped", "event"}`` (``event``: ``"skip"`` for a step whose gradients
    were not finite, ``"change"`` when the scale moved, ``"start"`` for the
    first). `jaxamp.monitoring.monitor_report` and `jaxamp.monitoring.suggest_policy` read them.

    Args:
        every: keep the statistics of steps divisible by `every`.
        path: a JSON-lines file to append records to, or None.
        tensorboard_dir: a TensorBoard log directory, or None.
        flush_every: read the device after this many kept statistics.

    Raises:
        ValueError: `every` or `flush_every` is not a positive integer.
    """

    def __init__(
        self,
        every: int = 1,
        path: str | os.PathLike | None = None,
        tensorboard_dir: str | os.PathLike | None = None,
        flush_every: int = 100,
    ):
        for name, value in (("every", every), ("flush_every", flush_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        self.every, self.flush_every = every, flush_every
        self.path = None if path is None else os.fspath(path)
        self.records: list[dict[str, Any]] = []
        self._pending_stats: list[tuple[int, MonitorStats]] = []
        self._pending_scales: list[tuple[int, Any, Any]] = []
        self._last_scale: float | None = None
        self._writer: Any = None  # a tensorboardX SummaryWriter (untyped)
        if tensorboard_dir is not None:
            try:
                from tensorboardX import SummaryWriter
            except ImportError as err:
                raise ImportError(
                    "MonitorRecorder(tensorboard_dir=...) writes with tensorboardX: "
                    "pip install tensorboardX (or jaxamp[monitor])."
                ) from err
            self._writer = SummaryWriter(os.fspath(tensorboard_dir))

    def record(
        self, step: int, stats: MonitorStats | None = None, *, loss_scale: Any = None, finite: Any = None
    ) -> None:
        """Keep step `step`'s statistics (when `step` is a multiple of `every`) and loss scale.

        Args:
            step: the training step (a Python int).
            stats: the step's `MonitorStats`, or None.
            loss_scale: the scale the step ran with: a scalar array, or a
                scaler holding one (`jaxamp.DynamicScalerState`, a jmp-style
                `DynamicLossScale`, `jaxamp.GradScaler`).
            finite: whether the step's gradients were finite (a boolean
                scalar array); a False step is recorded as a skip.
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise TypeError(f"step must be a Python int, got {type(step).__name__}: {step!r:.50}.")
        if stats is not None and not isinstance(stats, MonitorStats):
            raise TypeError(
                f"stats must be the MonitorStats jaxamp.monitoring.monitor returns, got {type(stats).__name__}."
            )
        if loss_scale is not None or finite is not None:
            self._pending_scales.append((int(step), _scale_array(loss_scale), finite))
        if stats is not None and step % self.every == 0:
            self._pending_stats.append((int(step), stats))
            if len(self._pending_stats) >= self.flush_every:
                self.flush()

    def flush(self) -> list[dict[str, Any]]:
        """Read everything kept from the device, append it to ``records`` and write it out.

        Returns:
            The records this flush added, in step order.
        """
        stats, scales = self._pending_stats, self._pending_scales
        self._pending_stats, self._pending_scales = [], []
        host_stats, host_scales = jax.device_get(([s.vectors for _, s in stats], [(x, f) for _, x, f in scales]))
        new: list[dict[str, Any]] = []
        for (step, s), vectors in zip(stats, host_stats):
            sites = [
                dict(direction=site.direction, scope=site.scope, name=site.name, dtype=site.dtype, fp8=site.fp8,
                     handed_in=site.handed_in, **dict(zip(FIELDS, (float(v) for v in row))))
                for site, row in zip(s.sites, per_site(vectors, len(s.sites)), strict=True)
            ]  # fmt: skip
            new.append(dict(kind="stats", step=step, headroom_bits=s.headroom_bits, sites=sites))
        for (step, _, _), (scale, finite) in zip(scales, host_scales):
            value = None if scale is None else float(scale)
            skipped = finite is not None and not bool(finite)
            event = "skip" if skipped else None
            if value is not None and value != self._last_scale:
                event = event or ("start" if self._last_scale is None else "change")
                self._last_scale = value
            if event is not None:
                new.append(dict(kind="loss_scale", step=step, loss_scale=value, skipped=skipped, event=event))
        new.sort(key=lambda r: (r["step"], r["kind"]))
        self.records += new
        if self.path is not None and new:
            with open(self.path, "a") as f:
                for record in new:
                    f.write(json.dumps(record) + "\n")
        if self._writer is not None:
            self._write_tensorboard(new)
        return new

    def _write_tensorboard(self, records: Sequence[dict]) -> None:
        for record in records:
            if record["kind"] == "loss_scale":
                if record["loss_scale"] is not None:
                    self._writer.add_scalar("loss_scale", record["loss_scale"], record["step"])
                continue
            for site in record["sites"]:
                # TensorBoard tags take no brackets: dot_general[0].out -> dot_general_0.out
                name = site["name"].replace("[", "_").replace("]", "")
                tag = f"monitor/{site['direction']}/{site['scope']}/{name}"
                figures = derived(site)  # the report's figures (a float8 value's headroom is its source's)
                if math.isfinite(figures["headroom_bits"]):
                    self._writer.add_scalar(f"{tag}/headroom_bits", figures["headroom_bits"], record["step"])
                if site["nonzero"]:
                    self._writer.add_scalar(f"{tag}/underflow", figures["underflow_fraction"], record["step"])
        self._writer.flush()

    def close(self) -> None:
        """Flush, and close the TensorBoard writer."""
        self.flush()
        if self._writer is not None:
            self._writer.close()

    def __enter__(self) -> MonitorRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _scale_array(loss_scale: Any) -> Any:
    """The scale array of `loss_scale` (a scaler or the array itself)."""
    if loss_scale is None:
        return None
    for attribute in ("loss_scale", "scaler", "_scale"):  # jmp, DynamicScalerState, GradScaler
        if hasattr(loss_scale, attribute):
            return getattr(loss_scale, attribute)
    return loss_scale


def load_records(source: Any) -> list[dict[str, Any]]:
    """Records from a `MonitorRecorder`, its ``records`` list, or a JSON-lines path it wrote."""
    if isinstance(source, MonitorRecorder):
        source.flush()
        return list(source.records)
    if isinstance(source, (str, os.PathLike)):
        with open(source) as f:
            return [json.loads(line) for line in f if line.strip()]
    records = list(source)
    if not all(isinstance(r, dict) and "kind" in r for r in records):
        raise TypeError("records must be a MonitorRecorder, its .records, or the path of the JSON lines it wrote.")
    return records
