"""A float16 run killed with SIGKILL and resumed ends bit-identical to one never stopped.

`examples/resumable_f16.py` checkpoints its train state with Orbax (async) and
resumes from the latest complete checkpoint. It is killed twice: right as a
checkpoint starts to be written (the save may be cut short; the resumed run
then starts from the one before) and after a skipped step (a NaN batch) that
follows a checkpoint. The final parameters, optimizer state and scaler state
must equal those of an uninterrupted run bit for bit.

The two killed runs are processes of their own; the uninterrupted run and the
last, resumed one, which nobody kills, run in this process (the example's
`main`, from its file): starting a process and importing JAX, Orbax and
scikit-learn costs more than the run itself. Both processes and this one run
the same compiled step (the session's XLA flags and compilation cache).
"""

import contextlib
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

from example_scripts import load_example

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "resumable_f16.py"
STEPS = ["--steps", "30", "--checkpoint-every", "10", "--poison-every", "7", "--batch-size", "32"]
TIMEOUT = 240


def _args(checkpoint_dir, *extra):
    return ["--checkpoint-dir", str(checkpoint_dir), *STEPS, *extra]


def _run_until(checkpoint_dir, stop, *extra):
    """Run the example in a process, SIGKILL it at the first line `stop(line, seen)` accepts."""
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), *_args(checkpoint_dir, *extra)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line.strip())
            if stop(seen[-1], seen):
                os.kill(proc.pid, signal.SIGKILL)
                break
        proc.wait(timeout=TIMEOUT)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL, f"the run ended before it was killed:\n{seen[-5:]}"
    return seen


def _finish(checkpoint_dir, dump, *extra):
    """Run the example to its end in this process; return the lines it printed."""
    # Loaded afresh each time: no function object (nor cache keyed on one) outlives a run.
    example = load_example("resumable_f16")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        example.main(_args(checkpoint_dir, "--dump", str(dump), *extra))
    return printed.getvalue().splitlines()


def _arrays(path):
    with np.load(path) as data:
        return [data[name] for name in sorted(data.files, key=lambda n: int(n.split("_")[1]))]


def test_resume_after_sigkill_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    reference = tmp_path / "reference.npz"
    lines = _finish(tmp_path / "uninterrupted", reference)
    assert sum(line.endswith("skipped") for line in lines) == 30 // 7  # steps 7, 14, 21, 28

    checkpoints = tmp_path / "killed"
    # Killed as the checkpoint after step 20 starts being written.
    _run_until(checkpoints, lambda line, _: line == "checkpoint 20 started")
    # Resumed, then killed after the skipped step 28, which follows checkpoint 20.
    seen = _run_until(checkpoints, lambda line, _: line.startswith("step 28 ") and "skipped" in line, "--resume")
    assert seen[0] in ("resumed from step 10", "resumed from step 20"), seen[0]
    resumed = tmp_path / "resumed.npz"
    lines = _finish(checkpoints, resumed, "--resume")
    # From the latest checkpoint whose (async) save completed before the kill.
    assert lines[0] in ("resumed from step 10", "resumed from step 20"), lines[0]

    ref, got = _arrays(reference), _arrays(resumed)
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
