"""jaxamp's benchmark suite: float32, hand-cast bf16, amp bf16, amp f16 and amp fp8 side by side.

    python benchmarks/run.py --device-label h100           # on a GPU: < 8 minutes
    python benchmarks/run.py --device-label cpu-2core --quick

For a GPT-2-small-shaped language model and a ResNet-style CNN, and for each
variant in `benchmarks.variants`, it measures

* everywhere (nothing is compiled or run, the models are abstract): the time to
  trace and lower the value-and-grad step relative to float32, the bytes of
  residuals kept for the backward pass, the share of matmul/conv FLOPs in half
  precision (and, in the JSON, in float8) and the number of dtype conversions
  in the lowered step;
* on a GPU only: the median step time of a jitted AdamW training step,
  throughput and peak device memory (each variant in its own process, so that
  peak memory is its own).

It writes ``benchmarks/results/<label>.json`` and ``<label>.png`` and replaces
the ``<label>`` section of ``benchmarks/RESULTS.md``. See docs/benchmarks.md.
"""

from __future__ import annotations

import os

# Lowering in this process must not grab most of the GPU's memory before the
# timing workers (subprocesses) start; the workers measure their own peaks.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from benchmarks import measure, report, trace_overhead  # noqa: E402
from benchmarks.models import (  # noqa: E402
    GPT,
    GPT2_SMALL,
    GPTConfig,
    ResNet,
    ResNetConfig,
    classifier_loss,
    lm_loss,
)
from benchmarks.variants import VARIANTS  # noqa: E402

HERE = Path(__file__).resolve().parent
BASELINE = "f32"


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model, its loss and the shape of one batch.

    Attributes:
        key: identifier (``"gpt"``, ``"resnet"``).
        title: a human description of the shape.
        make_model: ``make_model(key) -> model``.
        loss_fn: ``loss_fn(model, *batch) -> scalar``.
        batch: `jax.ShapeDtypeStruct` per batch argument.
        unit: what throughput counts (``"tokens"`` or ``"images"``).
        items_per_step: how many of them one step processes.
        int_high: integer batch inputs (tokens, labels) are drawn from
            ``[0, int_high)``.
        make_flat_model: the same model without loops (layers unrolled), so
            that each residual can be traced to the line producing it; None
            when `make_model` has no loops.
    """

    key: str
    title: str
    make_model: Callable[[Any], Any]
    loss_fn: Callable
    batch: tuple[jax.ShapeDtypeStruct, ...]
    unit: str
    items_per_step: int
    int_high: int
    make_flat_model: Callable[[Any], Any] | None = None

    def abstract_args(self) -> tuple:
        """``(model, *batch)`` as shapes only: nothing is allocated."""
        return (eqx.filter_eval_shape(self.make_model, jax.random.key(0)), *self.batch)

    def concrete_args(self) -> tuple:
        """``(model, *batch)`` as arrays on the default device.

        Float inputs are standard normal, integer inputs uniform (`int_high`).
        """
        # One compiled initialiser instead of an eager op (and a compilation)
        # per parameter.
        model = eqx.filter_jit(self.make_model)(jax.random.key(0))
        keys = jax.random.split(jax.random.key(1), len(self.batch))
        batch = [
            jax.random.normal(k, s.shape, s.dtype)
            if jnp.issubdtype(s.dtype, jnp.floating)
            else jax.random.randint(k, s.shape, 0, self.int_high, s.dtype)
            for k, s in zip(keys, self.batch)
        ]
        return (model, *batch)


def _gpt_workload(config: GPTConfig, batch: int) -> Workload:
    c = config
    tokens = jax.ShapeDtypeStruct((batch, c.seq_len), jnp.int32)
    return Workload(
        key="gpt",
        title=(
            f"GPT ({c.n_layers} layers, d={c.d_model}, {c.n_heads} heads, seq {c.seq_len}, "
            f"vocab {c.vocab_size}, batch {batch}, layers under lax.scan)"
        ),
        make_model=lambda key: GPT(c, key=key),
        make_flat_model=lambda key: GPT(dataclasses.replace(c, scan_layers=False), key=key),
        loss_fn=lm_loss,
        batch=(tokens, tokens),
        unit="tokens",
        items_per_step=batch * c.seq_len,
        int_high=c.vocab_size,
    )


def _resnet_workload(config: ResNetConfig, image_size: int, batch: int) -> Workload:
    c = config
    return Workload(
        key="resnet",
        title=(
            f"ResNet ({len(c.widths)} stages of {c.blocks_per_stage} blocks, widths "
            f"{'/'.join(map(str, c.widths))}, GroupNorm, {image_size}x{image_size} images, "
            f"batch {batch})"
        ),
        make_model=lambda key: ResNet(c, key=key),
        loss_fn=classifier_loss,
        batch=(
            jax.ShapeDtypeStruct((batch, c.in_channels, image_size, image_size), jnp.float32),
            jax.ShapeDtypeStruct((batch,), jnp.int32),
        ),
        unit="images",
        items_per_step=batch,
        int_high=c.num_classes,
    )


def workloads(size: str) -> dict[str, Workload]:
    """The benchmark workloads: ``"full"`` (GPT-2 small) or ``"tiny"`` (smoke tests)."""
    if size == "full":
        gpt = _gpt_workload(GPT2_SMALL, batch=8)
        resnet = _resnet_workload(ResNetConfig(), image_size=32, batch=256)
    else:
        tiny = GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_heads=4, n_layers=2)
        gpt = _gpt_workload(tiny, batch=2)
        resnet = _resnet_workload(ResNetConfig(widths=(8, 16), blocks_per_stage=1), 8, batch=4)
    return {w.key: w for w in (gpt, resnet)}


def _guarded(what: str, fn: Callable[[], dict]) -> dict:
    # One failing measurement (say, amp crashing on a model) must not cost the
    # whole run: record the error and go on.
    try:
        return fn()
    except Exception as err:  # noqa: BLE001
        traceback.print_exc()
        print(f"!! {what} failed: {type(err).__name__}: {err}", file=sys.stderr)
        return {"error": f"{type(err).__name__}: {err}"}


def static_metrics(workload: Workload, repeats: int) -> dict[str, dict]:
    """Backend-independent metrics of every variant's value-and-grad step."""
    model, *batch = workload.abstract_args()
    grad_fns = {key: v.value_and_grad(workload.loss_fn) for key, v in VARIANTS.items()}
    step_args = {key: (v.init_scaler(), model, *batch) for key, v in VARIANTS.items()}
    results: dict[str, dict] = {key: {} for key in VARIANTS}

    builders = {
        key: (lambda v=variant: v.value_and_grad(workload.loss_fn), step_args[key])
        for key, variant in VARIANTS.items()
    }
    medians = _guarded(
        f"{workload.key}: lowering", lambda: measure.median_lower_seconds(builders, repeats)
    )
    for key, variant in VARIANTS.items():
        out = results[key]
        if key in medians:
            out["lower_s"] = medians[key]

        def one_variant(key=key, variant=variant):
            res = measure.residuals(variant.wrap(workload.loss_fn), model, *batch)
            flops = measure.matmul_flops(jax.make_jaxpr(grad_fns[key])(*step_args[key]))
            half = sum(n for dtype, n in flops.items() if dtype in ("bfloat16", "float16"))
            fp8 = sum(n for dtype, n in flops.items() if dtype.startswith("float8"))
            lowered = jax.jit(grad_fns[key]).lower(*step_args[key])
            return {
                "residual_bytes": res.saved_bytes,
                "residual_bytes_by_dtype": res.bytes_by_dtype,
                "matmul_flops": sum(flops.values()),
                "half_flop_share": half / max(sum(flops.values()), 1),
                "fp8_flop_share": fp8 / max(sum(flops.values()), 1),
                "converts": measure.count_converts(lowered.as_text()),
            }

        out.update(_guarded(f"{workload.key}/{key}: static metrics", one_variant))
    base = results[BASELINE]
    for out in results.values():
        if "lower_s" in out and "lower_s" in base:
            out["lower_ratio"] = out["lower_s"] / base["lower_s"]
    return results


def residual_excess(workload: Workload, top: int = 6) -> list[dict]:
    """The source lines where amp bf16 and hand-cast bf16 save different residual bytes.

    Measured on the loop-free form of the model, so that residuals are
    attributed to the operations producing them rather than to a scan. A cast
    may be attributed to different lines in the two programs (hand-cast casts
    the weights at the top, amp where they are used), so read the rows together.

    Returns:
        Up to `top` rows ``{"source", "amp_bf16", "hand_bf16", "excess_bytes"}``
        (the two middle ones: dtype name -> bytes; the excess is amp's bytes
        minus hand-cast's), largest absolute difference first.
    """
    make = workload.make_flat_model or workload.make_model
    model = eqx.filter_eval_shape(make, jax.random.key(0))
    by_source = {
        key: measure.residuals(VARIANTS[key].wrap(workload.loss_fn), model, *workload.batch)
        for key in ("amp_bf16", "hand_bf16")
    }
    by_source = {key: res.by_source for key, res in by_source.items()}
    # Differences below 0.1% of the total are rounding, not findings.
    negligible = 1e-3 * sum(sum(d.values()) for d in by_source["hand_bf16"].values())
    rows = []
    for source in by_source["amp_bf16"].keys() | by_source["hand_bf16"].keys():
        amp, hand = (by_source[key].get(source, {}) for key in ("amp_bf16", "hand_bf16"))
        excess = sum(amp.values()) - sum(hand.values())
        if abs(excess) > negligible:
            rows.append(dict(source=source, amp_bf16=amp, hand_bf16=hand, excess_bytes=excess))
    return sorted(rows, key=lambda r: -abs(r["excess_bytes"]))[:top]


def time_training(workload: Workload, variant_key: str, steps: int, warmup: int) -> dict:
    """Time a jitted AdamW step of one variant on the default device (worker side)."""
    variant = VARIANTS[variant_key]
    params, *batch = workload.concrete_args()
    step, optimizer = variant.train_step(workload.loss_fn, optax.adamw(1e-4))
    # Copied leaf by leaf: optimizer states may hold one array in two places
    # (jaxamp.skip_nonfinite_updates' two zero counters), which cannot be donated.
    opt_state = jax.tree_util.tree_map(jnp.copy, optimizer.init(params))
    scaler = variant.init_scaler()
    start = time.perf_counter()
    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, scaler, *batch)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        params, opt_state, scaler, loss = jax.block_until_ready(
            compiled(params, opt_state, scaler, *batch)
        )
        if i >= warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    stats = jax.local_devices()[0].memory_stats() or {}
    result = {
        "compile_s": compile_s,
        "step_s": step_s,
        "throughput": workload.items_per_step / step_s,
        "peak_bytes": stats.get("peak_bytes_in_use"),
        "final_loss": float(loss),
    }
    if scaler is not None:
        result["loss_scale"] = float(scaler.scaler)
        result["nonfinite_steps"] = int(scaler.total_resets)
    return result


_WORKER_TAG = "BENCHMARK-RESULT:"


def _run_worker(spec: dict, timeout_s: float) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f}s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_WORKER_TAG):
            return json.loads(line[len(_WORKER_TAG):])
    return {"error": f"worker exited with {proc.returncode}: {proc.stderr.strip()[-2000:]}"}


def _worker_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    workload = workloads(spec["size"])[spec["workload"]]
    result = _guarded(
        f"{spec['workload']}/{spec['variant']}: timing",
        lambda: time_training(workload, spec["variant"], spec["steps"], spec["warmup"]),
    )
    print(_WORKER_TAG + json.dumps(result), flush=True)


def targets(results: dict) -> list[dict]:
    """The acceptance targets, each with the measured value and whether it is met.

    The GPT targets are stated for GPT-2 small; step-time targets only count on
    a GPU.
    """
    out = []

    def check(name, value, limit, at_most=True):
        met = value <= limit if at_most else value >= limit
        out.append({"target": name, "value": value, "limit": limit, "at_most": at_most, "met": met})

    gpt = results["models"].get("gpt") if results["settings"]["size"] == "full" else None
    if gpt:
        amp, hand, f32 = gpt["amp_bf16"], gpt["hand_bf16"], gpt["f32"]
        if "residual_bytes" in amp and "residual_bytes" in hand:
            ratio = amp["residual_bytes"] / hand["residual_bytes"]
            check("gpt: amp bf16 residual bytes / hand-cast bf16", ratio, 1.10)
        on_gpu = results["machine"]["backend"] == "gpu"
        if on_gpu and all("step_s" in r for r in (amp, hand, f32)):
            check("gpt: amp bf16 step time / hand-cast bf16", amp["step_s"] / hand["step_s"], 1.03)
            check("gpt: float32 step time / amp bf16", f32["step_s"] / amp["step_s"], 1.5, False)
    for layout, r in results.get("trace_overhead", {}).items():
        if isinstance(r, dict) and "ratio" in r:
            check(f"trace_overhead ({layout}): amp / plain lowering", r["ratio"], r["target"])
    return out


def machine_info() -> dict:
    """Where and with what the benchmark ran."""
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
        "jaxlib": _jaxlib_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _jaxlib_version() -> str | None:
    try:
        import jaxlib

        return jaxlib.__version__
    except (ImportError, AttributeError):
        return None


def _default_label() -> str:
    kind = re.sub(r"[^a-z0-9]+", "-", jax.devices()[0].device_kind.lower()).strip("-")
    return f"{jax.default_backend()}-{kind}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=(
            "Benchmark float32, hand-cast bf16, amp bf16 and amp f16 + dynamic loss scaling "
            "on a GPT-2-small-shaped LM and a ResNet-style CNN. Writes "
            "benchmarks/results/<label>.json and .png and updates benchmarks/RESULTS.md."
        ),
        epilog="Step time, throughput and peak memory are only measured on a GPU.",
    )
    parser.add_argument(
        "--device-label",
        help="name of this machine in RESULTS.md and the result files "
        "(default: backend and device kind, e.g. gpu-nvidia-h100-80gb-hbm3)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer repeats and timed steps (3 lowerings instead of 7, 10 steps instead of 30)",
    )
    parser.add_argument(
        "--size",
        choices=("full", "tiny"),
        default="full",
        help="'full': GPT-2 small and a CIFAR-sized ResNet (default); "
        "'tiny': toy shapes, for testing this script",
    )
    parser.add_argument(
        "--models", default="gpt,resnet", help="comma-separated workloads (default: gpt,resnet)"
    )
    parser.add_argument(
        "--timings",
        choices=("auto", "on", "off"),
        default="auto",
        help="measure step time and memory: 'auto' on GPUs only (default); 'on' forces it "
        "(CPU figures are not meaningful, this is for testing the script)",
    )
    parser.add_argument(
        "--no-trace-overhead",
        action="store_true",
        help="skip benchmarks/trace_overhead.py (unrolled vs scanned 12-layer GPT)",
    )
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=HERE / "results",
        help="where <label>.json and <label>.png go (default: benchmarks/results)",
    )
    parser.add_argument(
        "--results-md",
        type=Path,
        default=HERE / "RESULTS.md",
        help="markdown file whose <label> section is replaced (default: benchmarks/RESULTS.md)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=450.0,
        help="seconds after which remaining timing runs are skipped (default: 450)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _time_all(results: dict, selected: dict[str, Workload], args, steps, warmup, deadline):
    """Fill in step time, throughput and peak memory, one worker process per run."""
    for wkey in selected:
        for vkey, variant in VARIANTS.items():
            left = deadline - time.perf_counter()
            if left < 30:
                # Better a partial table than a run the caller has to kill.
                results["models"][wkey][vkey]["timing_error"] = "skipped: time budget spent"
                continue
            spec = dict(size=args.size, workload=wkey, variant=vkey, steps=steps, warmup=warmup)
            print(f"   timing {wkey} / {variant.label} ...", flush=True)
            timing = _run_worker(spec, timeout_s=min(300.0, left))
            if "error" in timing:
                timing["timing_error"] = timing.pop("error")
                print(f"   !! {timing['timing_error']}", flush=True)
            results["models"][wkey][vkey].update(timing)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmarks; returns everything written to the JSON file."""
    args = parse_args(argv)
    if args.worker:
        _worker_main(args.worker)
        return {}
    started = time.perf_counter()
    repeats, steps, warmup = (3, 10, 2) if args.quick else (7, 30, 3)
    label = args.device_label or _default_label()
    timed = args.timings == "on" or (args.timings == "auto" and jax.default_backend() == "gpu")
    available = workloads(args.size)
    selected = {k: available[k] for k in args.models.split(",")}
    command = argv if argv is not None else sys.argv[1:]
    results: dict[str, Any] = {
        "label": label,
        "machine": machine_info(),
        "command": " ".join(["python benchmarks/run.py", *command]),
        "settings": {"size": args.size, "lower_repeats": repeats, "steps": steps, "warmup": warmup},
        "workloads": {k: w.title for k, w in selected.items()},
        "variants": {k: v.label for k, v in VARIANTS.items()},
        "models": {},
    }
    for wkey, workload in selected.items():
        print(f"== {workload.title}: lowering, residuals, FLOPs, converts", flush=True)
        # amp warns when it cannot rewrite something (e.g. a primitive changed in
        # a new JAX) and runs it at original precision: the figures then say
        # less than they seem to, so the warnings go into the results too.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results["models"][wkey] = static_metrics(workload, repeats)
            what = f"{wkey}: residual sources"
            excess = _guarded(what, lambda: {"rows": residual_excess(workload)})
        results.setdefault("residual_excess", {})[wkey] = excess.get("rows", excess)
        messages = sorted({str(w.message) for w in caught if "jaxamp" in str(w.message)})
        results.setdefault("warnings", {})[wkey] = messages
        for message in messages:
            print(f"!! warning: {message}", flush=True)
    if not args.no_trace_overhead:
        print("== trace overhead (12-layer GPT, unrolled and scanned)", flush=True)
        overhead = _guarded("trace overhead", lambda: trace_overhead.measure(repeats))
        if "error" not in overhead:
            for r in overhead.values():
                r["target"] = trace_overhead.TARGET_RATIO
            print(trace_overhead.format_results(overhead), flush=True)
        results["trace_overhead"] = overhead
    if timed:
        print("== step time and peak memory (one process per run)", flush=True)
        _time_all(results, selected, args, steps, warmup, started + args.budget)
    else:
        results["timings_note"] = (
            f"step time, throughput and peak memory not measured: backend is "
            f"{jax.default_backend()}, they are only meaningful on a GPU"
        )
    for wkey, workload in selected.items():
        print(f"\n{workload.title}\n" + report.text_table(results["models"][wkey], workload.unit))
    results["targets"] = targets(results)
    results["elapsed_s"] = time.perf_counter() - started

    args.results_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.results_dir / f"{label}.json"
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    png_path = report.plot(results, args.results_dir / f"{label}.png")
    report.update_markdown(args.results_md, results, json_path, png_path)
    for t in results["targets"]:
        print(f"target {t['target']}: {t['value']:.3f} ({'met' if t['met'] else 'MISSED'})")
    print(f"wrote {json_path}, {png_path} and the '{label}' section of {args.results_md}")
    print(f"took {results['elapsed_s']:.0f}s")
    return results


if __name__ == "__main__":
    main()
