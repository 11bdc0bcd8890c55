"""The benchmark suite's own machinery: converts counters, targets, worker, command line.

These check what the suite computes and reports, never how fast anything is:
timings on a shared CI machine prove nothing.
"""

import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from benchmarks import measure, report, run, step_time, targets, trace_overhead, worker
from benchmarks.variants import VARIANTS

ROOT = Path(__file__).resolve().parents[1]


# Each benchmark collects garbage before every sample it times: over its own objects only.
pytestmark = pytest.mark.usefixtures("earlier_objects_frozen")


# Compiled HLO as this JAX prints it: converts at top level, inside a fusion, of
# a scalar, and look-alikes that are not converts.
_HLO = """\
%fused_computation.1 (param_0.6: f32[8,8]) -> f32[8,8] {
  %param_0.6 = f32[8,8]{1,0} parameter(0)
  %convert_element_type.0 = bf16[8,8]{1,0} convert(%param_0.6), metadata={op_name="jit(f)/convert_element_type" stack_frame_id=4}
  %convert.11 = f32[8,8]{1,0} convert(%convert_element_type.0)
  ROOT %mul.0 = f32[8,8]{1,0} multiply(%convert.11, %convert.11)
}

%wrapped_convert_computation (param_0.7: f32[8,8]) -> f16[8,8] {
  %param_0.7 = f32[8,8]{1,0} parameter(0)
  ROOT %convert_element_type.1 = f16[8,8]{1,0} convert(%param_0.7), metadata={op_name="jit(f)/convert_element_type"}
}

ENTRY %main.1 (a.1: f32[8,8], s.1: f32[]) -> f16[8,8] {
  %a.1 = f32[8,8]{1,0} parameter(0), metadata={op_name="a"}
  %s.1 = f32[] parameter(1)
  %s.2 = bf16[] convert(%s.1)
  %b.1 = s32[8,8]{1,0} bitcast-convert(%a.1)
  %f = f32[8,8]{1,0} fusion(%a.1), kind=kLoop, calls=%fused_computation.1
  ROOT %wrapped_convert = f16[8,8]{1,0} fusion(%f), kind=kLoop, calls=%wrapped_convert_computation
}
"""


def test_compiled_converts_counter_reads_hlo_text():
    # Two in the fusion, one wrapped, one scalar; not bitcast-convert, not the
    # fusion that calls the wrapped convert, not the metadata.
    assert measure.count_compiled_converts(_HLO) == 4


def test_converts_of_a_tiny_function_lowered_and_compiled():
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    lowered = jax.jit(lambda a: a.astype(jnp.float16)).lower(x)
    assert measure.count_converts(lowered.as_text()) == 1
    assert measure.count_compiled_converts(lowered.compile().as_text()) == 1
    # Float32 all the way: nothing to convert, before or after XLA.
    lowered = jax.jit(lambda a: jnp.sin(a) * 2.0).lower(x)
    assert measure.count_converts(lowered.as_text()) == 0
    assert measure.count_compiled_converts(lowered.compile().as_text()) == 0


def _results(size="full", backend="cpu"):
    """A hand-made results dict: some targets met, some missed, the rest absent."""
    return {
        "settings": {"size": size},
        "machine": {"backend": backend},
        "models": {
            "gpt": {
                "hand_bf16": {"residual_bytes": 100, "compiled_converts": 10, "step_s": 1.0},
                "amp_bf16": {"residual_bytes": 90, "compiled_converts": 12, "step_s": 1.01},
                "f32": {"step_s": 1.2},
            },
        },
        "trace_overhead": {
            "unrolled": {
                "warm": {"ratio": 1.15, "ratio_to_hand": 1.05},
                "cold": {"ratio": 1.5},
                "runnable": {"ratio": 0.8, "ratio_to_hand": 0.97},
            },
            "scan": {
                "warm": {"ratio": 1.08, "ratio_to_hand": 1.2},
                "cold": {"error": "timed out after 300s"},
                "runnable": {"ratio": 1.6, "ratio_to_hand": 1.01},
            },
        },
        "eager": {"ratio": 1.2},
    }


def _by_name(rows):
    return {row["target"]: row for row in rows}


def test_targets_met_missed_and_not_measured():
    rows = targets.evaluate(_results())
    assert [r["target"] for r in rows] == [t.name for t in targets.TARGETS]
    assert len({t.name for t in targets.TARGETS}) == len(targets.TARGETS)
    by_name = _by_name(rows)
    status = {name: row["status"] for name, row in by_name.items()}
    # Warm and time to a runnable step against hand-cast code; cold against plain.
    assert status["trace overhead, warm, GPT-2 small unrolled: amp / hand-cast lowering"] == targets.MET
    assert status["trace overhead, warm, GPT-2 small under lax.scan: amp / hand-cast lowering"] == targets.MISSED
    assert status["time to a runnable step, GPT-2 small unrolled: amp / hand-cast"] == targets.MET
    scan_runnable = by_name["time to a runnable step, GPT-2 small under lax.scan: amp / hand-cast"]
    assert scan_runnable["status"] == targets.MISSED and scan_runnable["value"] == pytest.approx(1.01)
    assert status["trace overhead, cold, GPT-2 small unrolled: amp / plain lowering"] == targets.MISSED
    # A failed figure and one never measured are reported, not dropped.
    cold_scan = by_name["trace overhead, cold, GPT-2 small under lax.scan: amp / plain lowering"]
    assert cold_scan["status"] == targets.NOT_MEASURED and cold_scan["value"] is None
    deep = "trace overhead, warm, 24-layer GPT unrolled: amp / hand-cast lowering"
    assert status[deep] == targets.NOT_MEASURED
    assert status["eager overhead, 8-layer MLP: amp / plain per call"] == targets.MET
    residuals = by_name["GPT-2 small: amp bf16 / hand-cast bf16 residual bytes"]
    assert residuals["status"] == targets.MET and residuals["value"] == pytest.approx(0.9)
    converts = by_name["GPT-2 small: amp bf16 / hand-cast bf16 compiled converts"]
    assert converts["status"] == targets.MISSED and converts["value"] == pytest.approx(1.2)
    assert status["ResNet: amp bf16 / hand-cast bf16 residual bytes"] == targets.NOT_MEASURED
    # Step times count on a GPU only, even when measured elsewhere.
    step = "GPT-2 small: amp bf16 / hand-cast bf16 step time"
    assert status[step] == targets.NOT_MEASURED and "GPU" in by_name[step]["note"]


def test_targets_on_a_gpu_and_on_toy_shapes():
    on_gpu = _by_name(targets.evaluate(_results(backend="gpu")))
    assert on_gpu["GPT-2 small: amp bf16 / hand-cast bf16 step time"]["status"] == targets.MET
    f32 = on_gpu["GPT-2 small: float32 / amp bf16 step time"]  # at least 1.5
    assert f32["status"] == targets.MISSED and not f32["at_most"]
    fp8 = on_gpu["GPT-2 small: amp fp8 / amp bf16 step time"]
    assert fp8["status"] == targets.NOT_MEASURED and fp8["note"] == "figure missing"
    tiny = targets.evaluate(_results(size="tiny"))
    assert {row["status"] for row in tiny} == {targets.NOT_MEASURED}
    residuals = _by_name(tiny)["GPT-2 small: amp bf16 / hand-cast bf16 residual bytes"]
    assert residuals["value"] == pytest.approx(0.9)  # computed, but does not count
    line = targets.format_row(residuals)
    assert "0.900" in line and "<= 1.00" in line and "not measured" in line


def test_worker_round_trip():
    assert worker.task_name(step_time.worker_task) == "benchmarks.step_time:worker_task"
    # Any importable function returning a dict will do: `dict` itself.
    assert worker.run(dict, {"a": 1, "b": [2, "c"]}, timeout_s=60) == {"a": 1, "b": [2, "c"]}
    failed = worker.run(os.getcwd, {}, timeout_s=60)
    assert "returned str, not a dict" in failed["error"]
    assert "timed out" in worker.run(dict, {}, timeout_s=0.001)["error"]


def test_trace_overhead_warm_cold_and_runnable():
    results = trace_overhead.measure(size="tiny", repeats=1, cold_runs=1, models=["scan"], runnable_rounds=1)
    assert set(results) == {"scan"}
    warm, cold, runnable = (results["scan"][s] for s in ("warm", "cold", "runnable"))
    for figures in (warm, cold, runnable):
        assert all(figures[f"{name}_s"] > 0 for name in ("plain", "hand", "amp"))
        assert figures["ratio"] == pytest.approx(figures["amp_s"] / figures["plain_s"])
        assert figures["ratio_to_hand"] == pytest.approx(figures["amp_s"] / figures["hand_s"])
    # One fresh process each for plain, hand-cast and amp.
    assert len(cold["plain_runs"]) == len(cold["hand_runs"]) == len(cold["amp_runs"]) == 1
    text = trace_overhead.format_results(results)
    assert all(f"scan           {setting}" in text for setting in ("warm", "cold", "runnable"))


def test_markdown_shows_overheads_and_targets(tmp_path):
    results = _results()
    results.update(
        label="m",
        machine={
            "backend": "cpu",
            "device": "cpu",
            "device_count": 1,
            "cpu": "x",
            "cpu_count": 2,
            "jax": "0",
            "jaxlib": "0",
            "python": "3",
            "date": "today",
        },
        elapsed_s=1.0,
        command="python -m benchmarks.run",
        workloads={"gpt": "GPT"},
    )
    for r in results["trace_overhead"].values():
        r["title"] = "a GPT"
        for figures in r.values():
            if isinstance(figures, dict) and "ratio" in figures:
                figures.update(plain_s=1.0, hand_s=0.5, amp_s=figures["ratio"])
                figures.update(ratio_to_hand=figures["amp_s"] / figures["hand_s"])
    results["eager"].update(title="an MLP", plain_s=0.01, amp_s=0.012, calls=5)
    results["targets"] = targets.evaluate(results)
    md = tmp_path / "RESULTS.md"
    report.update_markdown(md, results, tmp_path / "m.json", None)
    text = md.read_text()
    assert "| `unrolled` | warm | 1,000 | 500 | 1,150 | 1.15x | 2.30x |" in text
    assert "| `unrolled` | runnable | 1,000 | 500 | 800 | 0.80x | 1.60x |" in text
    assert "| `scan` | cold | - | - | - | not measured: timed out after 300s | - |" in text
    assert "an MLP: plain 10.00 ms, amp 12.00 ms per call, amp / plain 1.20" in text
    missed = "trace overhead, cold, GPT-2 small unrolled: amp / plain lowering"
    assert f"| {missed} | 1.500 | <= 1.25 | **MISSED** |" in text
    assert all(f"| {t.name} |" in text for t in targets.TARGETS)


# runpy's note that this module imported benchmarks.run already: `-m` runs it afresh all the same.
@pytest.mark.filterwarnings("ignore:'benchmarks.run' found in sys.modules:RuntimeWarning")
def test_command_line_is_a_module(monkeypatch, capsys):
    # `python -m benchmarks.run --help`, run as `-m` runs it, in this process: a
    # process of its own would spend its 15 s importing JAX.
    import runpy

    monkeypatch.setattr(sys, "argv", ["benchmarks.run", "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("benchmarks.run", run_name="__main__", alter_sys=True)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--skip" in out and "--device-label" in out


def test_tiny_run_writes_every_target(tmp_path):
    # Compiling and the trace overhead take most of a run's time; they have
    # their own tests above. Of the rest, most is lowering every variant's step
    # (twice each with one timed repeat: the untimed round, then the timed one).
    argv = [
        "--size", "tiny", "--quick", "--repeats", "1", "--models", "gpt", "--skip", "compiled,trace",
        "--device-label", "test", "--results-dir", str(tmp_path),
        "--results-md", str(tmp_path / "RESULTS.md"),
    ]  # fmt: skip
    returned = run.main(argv)
    results = json.loads((tmp_path / "test.json").read_text())
    assert results["label"] == "test" and set(results["models"]) == {"gpt"}
    assert results["settings"]["lower_repeats"] == 1 and results["settings"]["steps"] == 10  # --quick's
    assert all(figures["lower_s"] > 0 for figures in results["models"]["gpt"].values())
    assert results["models"]["gpt"].keys() == returned["models"]["gpt"].keys()
    assert list(results["models"]["gpt"]) == list(VARIANTS)
    amp_fp8 = results["models"]["gpt"]["amp_fp8"]
    assert amp_fp8["fp8_flop_share"] > 0.5 and amp_fp8["residual_bytes"] > 0
    assert "compiled_converts" not in results["models"]["gpt"]["amp_bf16"]  # skipped
    assert "trace_overhead" not in results and results["eager"]["ratio"] > 0
    assert [t["target"] for t in results["targets"]] == [t.name for t in targets.TARGETS]
    # Toy shapes: values are shown where measured, none counts.
    assert {t["status"] for t in results["targets"]} == {targets.NOT_MEASURED}
    md = (tmp_path / "RESULTS.md").read_text()
    for heading in ("## test", "### Eager overhead", "### Targets", "| amp fp8 |"):
        assert heading in md
    assert all(f"| {t.name} |" in md for t in targets.TARGETS)
    # The float8 column (issue 14): the amp fp8 row shows its float8 FLOP share.
    header = next(line for line in md.splitlines() if line.startswith("| variant |"))
    fp8_column = [c.strip() for c in header.split("|")].index("float8 FLOPs")
    fp8_row = next(line for line in md.splitlines() if line.startswith("| amp fp8 |"))
    assert fp8_row.split("|")[fp8_column].strip() == f"{100 * amp_fp8['fp8_flop_share']:.1f}%"


def test_collectives_the_loss_scaler_adds_one_scalar_all_reduce_at_most():
    from benchmarks import collectives

    rows = {(r["mode"], r["loss scaler"], r["float32_gradient_reductions"]): r for r in collectives.measure()}
    # Under jit over a global mesh the arrays are global: no collective for the decision.
    assert rows["jit", True, False]["all-reduces"] == rows["jit", False, False]["all-reduces"]
    # Under shard_map: one, of the finite flag (4 bytes).
    extra = rows["shard_map", True, False]
    assert extra["all-reduces"] == rows["shard_map", False, False]["all-reduces"] + 1
    assert extra["bytes"] - rows["shard_map", False, False]["bytes"] == 4
    # float32 gradient reductions: the float16 gradient all-reduce becomes float32.
    assert "f16" in rows["jit", True, False]["operands"]
    assert "f16" not in rows["jit", True, True]["operands"]


def test_collectives_fp8_adds_no_all_reduce_on_any_mesh():
    # Per-shard scales: while tracing on an Explicit mesh, when XLA partitions
    # the step on an Auto one (before: 3 against 1), per device in shard_map.
    # Convolutions: each product a shard_map on an Explicit mesh (before: 5
    # against 1), custom_partitioning on an Auto one.
    from benchmarks import collectives

    measured = collectives.measure_fp8() + collectives.measure_fp8_convolutions()
    rows = {(r["mode"], r["compute dtype"]): r["all-reduces"] for r in measured}
    modes = ("jit (Explicit)", "jit (Auto)", "shard_map (Auto)")
    for mode in (*modes, "jit (Explicit), convolutions", "jit (Auto), convolutions"):
        assert rows[mode, "fp8"] == rows[mode, "bf16"] == 1, rows


def test_fp8_recipes_meet_torchaos_accuracy_bar_on_a_linear_layer():
    # torchao's float8 linear tests: output >= 18 dB and weight gradient >= 17 dB
    # against bf16. Measured (2048x1024x1024): 28.5 dB output for every recipe;
    # weight gradient 24.6 dB with e5m2 cotangents, 28.5 dB with the block
    # recipes' e4m3 ones, exact with rowwise_with_gw_hp's bf16 weight gradient.
    from benchmarks import fp8_recipes

    rows = fp8_recipes.linear_layer()
    for name, row in rows.items():
        if name != "bf16":
            assert row["output dB vs bf16"] >= 18 and row["weight grad dB vs bf16"] >= 17, (name, row)
    assert rows["mxfp8"]["weight grad dB vs f32"] > rows["tensorwise"]["weight grad dB vs f32"] + 2


def test_fp8_recipes_all_reduces_on_an_explicit_data_parallel_step():
    # Per-shard scales (tensorwise) and the block recipes (which fall back to
    # them on a split operand) add no all-reduce; rowwise scales the weight
    # gradient's operands along the batch, which data parallelism splits: one more.
    from benchmarks import fp8_recipes

    counts = fp8_recipes.all_reduces()
    for name in ("tensorwise", "rowwise_with_gw_hp", "mxfp8", "blockwise"):
        assert counts[name] == counts["bf16"], counts
    assert counts["rowwise"] == counts["bf16"] + 1, counts
    # The delayed recipe's scales need none (a history still empty takes the
    # live amax in a conditional branch, the first step only); the observed
    # amaxes of the batch-sharded input and cotangent, which only the next
    # step reads, go in one combined all-reduce, on an Auto mesh too.
    assert counts["delayed"] == counts["bf16"] + 1, counts
    from jax.sharding import AxisType

    from benchmarks.collectives import _compiled_all_reduces, _delayed_step

    delayed = fp8_recipes.RECIPES["delayed"]
    auto = _compiled_all_reduces(
        AxisType.Auto, {"delayed": lambda mesh: _delayed_step("jit", False, False, mesh, delayed)}
    )
    assert auto["delayed"]["all-reduces"] == counts["bf16"] + 1, auto


def test_monitor_overhead_times_a_monitored_step_against_the_plain_one():
    from benchmarks import monitor_overhead

    result = monitor_overhead.overhead("tiny", "amp_f16_scaled", steps=2, warmup=1)
    assert result["sites"] > 20  # forward and backward sites of a 2-layer GPT
    assert result["plain_s"] > 0 and result["monitored_s"] > 0
    assert result["ratio"] == result["monitored_s"] / result["plain_s"]


def test_the_tiny_llama_trains_under_amp_and_keeps_only_its_head_out_of_float8():
    import math

    import jaxamp
    from benchmarks.workloads import llama_workload

    workload = llama_workload("tiny")
    value, grads = jax.jit(jax.value_and_grad(jaxamp.amp(workload.loss_fn)))(*workload.concrete_args())
    # Random init over a 256-token vocabulary: about log(256) per token.
    assert abs(float(value) - math.log(256)) < 1.0
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    # Its layers run under lax.scan: at every size, only the logits head (and attention) stay out of float8.
    every_size = jaxamp.fp8.Fp8Recipe(keep_small_bf16=None)
    report = jaxamp.explain(workload.loss_fn, compute_dtype=every_size)(*workload.abstract_args())
    kept = [r.detail for r in report.kept_out_of_fp8]
    assert kept.count("kept bf16: the program's last matmul (keep_last_matmul_bf16)") == 1, kept
    assert all("last matmul" in d or "batched matmul" in d for d in kept), kept
    assert report.fp8_flop_fraction > 0.3


def test_the_gpu_presets_static_figures_on_the_tiny_llama():
    # What `bash benchmarks/gpu.sh` measures on any backend (the timings need a GPU).
    from benchmarks import gpu
    from benchmarks.workloads import llama_workload

    figures = gpu.static_figures(llama_workload("tiny"))
    assert set(figures) == set(gpu.GPU_VARIANTS)
    bf16, default, every_size = figures["amp_bf16"], figures["amp_fp8"], figures["amp_fp8_every_size"]
    # Every tiny matmul is too small to gain: the default fp8 step is the bf16 step.
    assert default["quantised_matmuls"] == 0 and default["kept_out"] > 0
    assert default["converts_added"] == 0 and default["residual_bytes"] == bf16["residual_bytes"]
    # At every size the layers' matmuls quantise and save float8 residuals.
    assert every_size["quantised_matmuls"] > 0 and every_size["residual_bytes"] < bf16["residual_bytes"]
    assert all(
        figures[k]["quantised_matmuls"] == every_size["quantised_matmuls"] for k in gpu.FP8_VARIANTS if k != "amp_fp8"
    )
