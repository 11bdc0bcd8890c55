"""MaxText's own training loop in float16 with docs/porting.md's driver (examples/maxtext_driver.py).

Runs where MaxText is installed (its package declares no dependencies: its
``decoupled-requirements.txt`` subset for CPU, ``DECOUPLE_GCLOUD=TRUE``); CI
does not install it, so there this module skips. Each run is a subprocess:
MaxText's ``train.main`` parses absl flags and owns the process.

A tiny config (2 llama2 layers, width 64, vocabulary 256, sequence 64) on
synthetic data; float32 against amp float16 started at a scale of 2**24, where
the first steps overflow: they must be skipped, the scale must fall, and the
run must then follow float32's losses, late by the skipped steps. Tolerance:
0.2% of the loss (measured 0.004% at step 19 with no step skipped). With
MaxText's spike rule on, its ``optim/step_skipped`` (through docs/porting.md's
metrics wrapper under float16) marks exactly the overflowed steps, whose
gradient norms read NaN.

Across checkpoints: examples/maxtext_runs.py's float32 -> float16 ->
float32 legs and a float16 resume of its own checkpoint, each within 0.05% of
the uninterrupted float32 run's losses (measured at most 0.013%).
"""

import math
import pathlib
import sys

import numpy as np
import pytest

pytest.importorskip("maxtext")

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import maxtext_runs  # noqa: E402

STEPS = 12


def _run(mode, tmp_path):
    """The driver, MaxText's spike rule on; float16 from 2**24, with a monitor over a window of 2 steps."""
    env = {"SCALER": str(2.0**24), "MONITOR_WINDOW": "2"} if mode == "f16" else {}
    records = maxtext_runs.run(mode, tmp_path, f"tiny_{mode}", STEPS, extra=("skip_step_on_spikes=true",), env=env)
    last = records[-1]
    return {
        "losses": [r["learning/loss"] for r in records],
        "loss_scale": last.get("optim/loss_scale"),
        "skipped_steps": last.get("optim/skipped_steps"),
        "step_skipped": [r["optim/step_skipped"] for r in records],
        "grad_norms": [r["learning/raw_grad_norm"] for r in records],
        "console": (tmp_path / f"tiny_{mode}-{mode}-{STEPS}.log").read_text(),
    }


def test_maxtext_float16_two_driver_lines_skip_overflows_and_follow_float32(tmp_path):
    f32, f16 = _run("f32", tmp_path), _run("f16", tmp_path)
    skipped = int(f16["skipped_steps"])
    assert 1 <= skipped < STEPS // 2, f16
    assert f16["loss_scale"] == 2.0 ** (24 - skipped)
    # A skipped step leaves the parameters: the loss repeats until the first applied step.
    assert f16["losses"][: skipped + 1] == [f16["losses"][0]] * (skipped + 1)
    for late, want in zip(f16["losses"][skipped:], f32["losses"]):
        assert abs(late / want - 1) < 2e-3, (f16["losses"], f32["losses"])
    # MaxText's own skip metric (its spike rule, which skips nothing this early) and the overflows.
    assert f32["step_skipped"] == [0.0] * STEPS
    assert f16["step_skipped"] == [1.0] * skipped + [0.0] * (STEPS - skipped)
    assert all(math.isnan(n) for n in f16["grad_norms"][:skipped]), f16["grad_norms"]
    for late, want in zip(f16["grad_norms"][skipped:], f32["grad_norms"]):
        assert abs(late / want - 1) < 2e-2, (f16["grad_norms"], f32["grad_norms"])
    # The driver's monitor (a window of 2 steps here) warns from inside MaxText's jitted step.
    assert "of the last 2 steps were skipped" in f16["console"]
    assert "steps were skipped" not in f32["console"]


def test_maxtext_changes_precision_across_its_checkpoints_and_resumes_its_own(tmp_path):
    legs = maxtext_runs.round_trip(tmp_path)
    reference = [r["learning/loss"] for r in legs["f32 uninterrupted"]]
    starts = {name: int(records[0]["step"]) for name, records in legs.items()}
    assert starts == {
        "f32 uninterrupted": 0,
        "f32, steps 0-3": 0,
        "f16 from the f32 checkpoint": 4,
        "f32 from the f16 checkpoint": 8,
        "f16 from its own checkpoint": 8,
    }
    for name, records in legs.items():
        losses = [r["learning/loss"] for r in records]
        want = reference[starts[name] : starts[name] + len(losses)]
        assert len(losses) == 4 or name == "f32 uninterrupted"
        np.testing.assert_allclose(losses, want, rtol=5e-4, err_msg=name)
    # The float16 legs: the scale converted in at 2**15 and kept, no step skipped.
    for name in ("f16 from the f32 checkpoint", "f16 from its own checkpoint"):
        assert legs[name][-1]["optim/loss_scale"] == 2.0**15 and legs[name][-1]["optim/skipped_steps"] == 0
    # Each conversion said once; MaxText's per-step console lines kept (app.run).
    logs = {p.name: p.read_text() for p in tmp_path.glob("*.log")}
    assert "written without loss scaling" in logs["trip-f16-8.log"]
    assert "written with loss scaling" in logs["trip-f32-12.log"]
    assert "restored a checkpoint written" not in logs["own-f16-12.log"]
    assert logs["reference-f32-12.log"].count("completed step:") == 12
