"""MaxText changes precision across its own checkpoints: float32 -> float16 -> float32, and a float16 resume.

Runs ``examples/maxtext_driver.py`` (docs/porting.md's driver) as MaxText's
command line, one process a leg, all on one checkpoint directory:

- float32, steps 0-3, checkpointed;
- float16 with loss scaling, steps 4-7, resumed from that float32 checkpoint;
- float32, steps 8-11, resumed from the float16 checkpoint;
- float16, steps 8-11, resumed from its own checkpoint (no conversion);

against float32 uninterrupted, steps 0-11. Prints each leg's losses (from
MaxText's ``metrics_file``) and their largest relative difference from the
uninterrupted run's. The model: MaxText's ``decoupled_base_test.yml`` with 2
llama2 layers, width 64, 4 heads, vocabulary 256, sequence 64, batch 4,
adamw at 1e-3 over a 12-step schedule, synthetic data, CPU.

    python examples/maxtext_round_trip.py --out /tmp/round_trip
"""

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys

DRIVER = pathlib.Path(__file__).resolve().parent / "maxtext_driver.py"
STEPS = 12
LEG = 4  # steps per leg; MaxText checkpoints every LEG steps and at a run's last step


def _config() -> str:
    import maxtext

    return os.path.join(os.path.dirname(maxtext.__file__), "configs", "decoupled_base_test.yml")


def run(precision: str, out: pathlib.Path, run_name: str, steps: int) -> list[dict]:
    """One MaxText run of the driver at `precision` up to `steps`; its metrics by step, from MaxText's metrics file."""
    metrics = out / f"{run_name}-{precision}-{steps}.jsonl"
    args = [
        _config(), f"run_name={run_name}", f"base_output_directory={out}", "dataset_type=synthetic",
        f"steps={steps}", "per_device_batch_size=4", "max_target_length=64", "base_emb_dim=64",
        "base_num_decoder_layers=2", "base_num_query_heads=4", "base_num_kv_heads=4", "head_dim=16",
        "base_mlp_dim=128", "vocab_size=256", "learning_rate=1e-3", f"learning_rate_schedule_steps={STEPS}",
        "log_period=1", "attention=dot_product", "weight_dtype=float32", "dtype=float32",
        "enable_checkpointing=true", f"checkpoint_period={LEG}", "async_checkpointing=false",
        "skip_jax_distributed_system=true", f"metrics_file={metrics}",
    ]  # fmt: skip
    env = {**os.environ, "PRECISION": precision, "DECOUPLE_GCLOUD": "TRUE"}
    done = subprocess.run([sys.executable, str(DRIVER), *args], capture_output=True, text=True, env=env)
    (out / f"{run_name}-{precision}-{steps}.log").write_text(done.stdout + done.stderr)  # MaxText's console
    if done.returncode != 0:
        raise RuntimeError(f"the {precision} leg of {run_name} failed:\n{done.stderr[-4000:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def round_trip(out: pathlib.Path) -> dict[str, list[dict]]:
    """Every leg's metrics by step, by name."""
    out.mkdir(parents=True, exist_ok=True)
    legs = {"f32 uninterrupted": run("f32", out, "reference", STEPS)}
    legs["f32, steps 0-3"] = run("f32", out, "trip", LEG)
    legs["f16 from the f32 checkpoint"] = run("f16", out, "trip", 2 * LEG)
    shutil.copytree(out / "trip", out / "own")
    legs["f32 from the f16 checkpoint"] = run("f32", out, "trip", STEPS)
    legs["f16 from its own checkpoint"] = run("f16", out, "own", STEPS)
    return legs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True, help="an empty folder for the runs")
    legs = round_trip(parser.parse_args().out)
    reference = [r["learning/loss"] for r in legs["f32 uninterrupted"]]
    for name, records in legs.items():
        start, losses = int(records[0]["step"]), [r["learning/loss"] for r in records]
        worst = max(abs(a / b - 1) for a, b in zip(losses, reference[start:]))
        scale = f", loss scale {records[-1]['optim/loss_scale']:g}" if "optim/loss_scale" in records[-1] else ""
        skipped = f", {records[-1]['optim/skipped_steps']:g} skipped" if scale else ""
        print(f"{name:28s} steps {start}-{start + len(losses) - 1}: {' '.join(f'{x:.5f}' for x in losses)}"
              f"  (max {worst:.4%} from uninterrupted{scale}{skipped})")  # fmt: skip
    print("RESULT", json.dumps({name: [r["learning/loss"] for r in records] for name, records in legs.items()}))


if __name__ == "__main__":
    main()
