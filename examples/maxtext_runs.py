"""MaxText under jaxamp, run as docs/porting.md's driver (examples/maxtext_driver.py): every MaxText figure there.

``precisions``: 20 steps in float32 (MaxText's own program), MaxText's own
bfloat16 (``dtype=bfloat16``), amp bf16, amp f16, and amp f16 started at a
loss scale of 2**24 (its first steps overflow); the loss at step 19 of each.

``round_trip``: precision changed across MaxText's own checkpoints, all on one
checkpoint directory, against float32 uninterrupted for steps 0-11:

- float32, steps 0-3, checkpointed;
- float16 with loss scaling, steps 4-7, resumed from that float32 checkpoint;
- float32, steps 8-11, resumed from the float16 checkpoint;
- float16, steps 8-11, resumed from its own checkpoint (no conversion).

Each run is one process: MaxText's command line with a tiny model (its
``decoupled_base_test.yml`` with 2 llama2 layers, width 64, 4 heads,
vocabulary 256, sequence 64, batch 4, adamw at 1e-3, synthetic data, CPU),
its losses read from MaxText's ``metrics_file``.

    python examples/maxtext_runs.py precisions --out /tmp/precisions
    python examples/maxtext_runs.py round_trip --out /tmp/round_trip
"""

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys

DRIVER = pathlib.Path(__file__).resolve().parent / "maxtext_driver.py"
LEG = 4  # round_trip's steps per leg; MaxText checkpoints every LEG steps and at a run's last step
# The driver run as its own __main__, with two settings for tests and the overflow run:
# loss_scaling_factory's initial scale (SCALER) and LossScaleMonitor's window (MONITOR_WINDOW).
LAUNCH = """
import functools, os, runpy, sys
import jaxamp
if "SCALER" in os.environ:
    jaxamp.scaling.loss_scaling_factory = functools.partial(
        jaxamp.scaling.loss_scaling_factory, scaler=float(os.environ["SCALER"]))
if "MONITOR_WINDOW" in os.environ:
    jaxamp.scaling.LossScaleMonitor = functools.partial(
        jaxamp.scaling.LossScaleMonitor, window=int(os.environ["MONITOR_WINDOW"]))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _config() -> str:
    import maxtext

    return os.path.join(os.path.dirname(maxtext.__file__), "configs", "decoupled_base_test.yml")


def run(
    precision: str,
    out: pathlib.Path,
    run_name: str,
    steps: int,
    schedule_steps: int | None = None,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> list[dict]:
    """One MaxText run of the driver at `precision` up to `steps`; its metrics by step, from MaxText's metrics file.

    `schedule_steps`: the learning-rate schedule's length (default `steps`);
    `extra`: more MaxText settings; `env`: ``SCALER``, ``MONITOR_WINDOW``. The
    run's console output is kept beside the metrics, as ``<run>-<precision>-<steps>.log``.
    """
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / f"{run_name}-{precision}-{steps}.jsonl"
    args = [
        _config(), f"run_name={run_name}", f"base_output_directory={out}", "dataset_type=synthetic",
        f"steps={steps}", "per_device_batch_size=4", "max_target_length=64", "base_emb_dim=64",
        "base_num_decoder_layers=2", "base_num_query_heads=4", "base_num_kv_heads=4", "head_dim=16",
        "base_mlp_dim=128", "vocab_size=256", "learning_rate=1e-3",
        f"learning_rate_schedule_steps={schedule_steps or steps}", "log_period=1", "attention=dot_product",
        "weight_dtype=float32", "dtype=float32", "skip_jax_distributed_system=true", f"metrics_file={metrics}",
        *extra,
    ]  # fmt: skip
    environ = {**os.environ, "PRECISION": precision, "DECOUPLE_GCLOUD": "TRUE", **(env or {})}
    done = subprocess.run(
        [sys.executable, "-c", LAUNCH, str(DRIVER), *args], capture_output=True, text=True, env=environ
    )
    (out / f"{run_name}-{precision}-{steps}.log").write_text(done.stdout + done.stderr)  # MaxText's console
    if done.returncode != 0:
        raise RuntimeError(f"the {precision} run {run_name} failed:\n{done.stderr[-4000:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def precisions(out: pathlib.Path, steps: int = 20) -> dict[str, list[dict]]:
    """Each precision's metrics by step, by name."""
    return {
        "MaxText dtype=float32": run("f32", out, "f32", steps),
        "MaxText dtype=bfloat16": run("f32", out, "maxtext_bf16", steps, extra=("dtype=bfloat16",)),
        "amp bf16": run("bf16", out, "bf16", steps),
        "amp f16": run("f16", out, "f16", steps),
        "amp f16, initial scale 2^24": run("f16", out, "f16_2e24", steps, env={"SCALER": str(2.0**24)}),
    }


def round_trip(out: pathlib.Path) -> dict[str, list[dict]]:
    """Every leg's metrics by step, by name."""
    checkpoints = ("enable_checkpointing=true", f"checkpoint_period={LEG}", "async_checkpointing=false")
    steps = 3 * LEG

    def leg(precision: str, run_name: str, until: int) -> list[dict]:
        return run(precision, out, run_name, until, schedule_steps=steps, extra=checkpoints)

    legs = {"f32 uninterrupted": leg("f32", "reference", steps)}
    legs["f32, steps 0-3"] = leg("f32", "trip", LEG)
    legs["f16 from the f32 checkpoint"] = leg("f16", "trip", 2 * LEG)
    shutil.copytree(out / "trip", out / "own")
    legs["f32 from the f16 checkpoint"] = leg("f32", "trip", steps)
    legs["f16 from its own checkpoint"] = leg("f16", "own", steps)
    return legs


def _scale_note(record: dict) -> str:
    if "optim/loss_scale" not in record:
        return ""
    return f", loss scale {record['optim/loss_scale']:g}, {record['optim/skipped_steps']:g} skipped"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["precisions", "round_trip"])
    parser.add_argument("--out", type=pathlib.Path, required=True, help="an empty folder for the runs")
    args = parser.parse_args()
    if args.what == "precisions":
        runs = precisions(args.out)
        reference = runs["MaxText dtype=float32"][-1]["learning/loss"]
        for name, records in runs.items():
            last = records[-1]["learning/loss"]
            print(f"{name:28s} loss at step {int(records[-1]['step'])}: {last:.5f} "
                  f"({last / reference - 1:+.3%} vs float32{_scale_note(records[-1])})")  # fmt: skip
    else:
        runs = round_trip(args.out)
        reference = [r["learning/loss"] for r in runs["f32 uninterrupted"]]
        for name, records in runs.items():
            start, losses = int(records[0]["step"]), [r["learning/loss"] for r in records]
            worst = max(abs(a / b - 1) for a, b in zip(losses, reference[start:]))
            print(f"{name:28s} steps {start}-{start + len(losses) - 1}: {' '.join(f'{x:.5f}' for x in losses)}"
                  f"  (max {worst:.4%} from uninterrupted{_scale_note(records[-1])})")  # fmt: skip
    print("RESULT", json.dumps({name: [r["learning/loss"] for r in records] for name, records in runs.items()}))


if __name__ == "__main__":
    main()
