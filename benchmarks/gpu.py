"""The GPU preset: does fp8 mode pay? One command for a lent GPU (at most 8 minutes on an H100).

    python -m benchmarks.gpu                 # or: bash benchmarks/gpu.sh
    python -m benchmarks.gpu --size tiny --timings on --no-md   # the same code on a CPU, toy shapes

For GPT-2 small, the ResNet and a Llama-style decoder at d=4096
(`benchmarks.workloads.llama_workload`), and for float32, amp bf16, amp fp8
(each recipe) and flax's fp8 ops (``fp8_scaled_dot_general`` in every dense
layer, bf16 elsewhere by a hand cast):

* static, on any backend: the matmuls fp8 mode quantised (``explain``), the
  converts it adds to the lowered step against amp bf16, and the residual
  bytes each saves for the backward pass;
* on a GPU (or ``--timings on``): AdamW step time and peak memory, each in a
  process of its own; the ``__cublas$lt$matmul$f8`` calls in the compiled step
  (what XLA made float8 GEMMs) against the matmuls quantised; and the default
  fp8 step's slowest ops from a profile.

Writes ``<results-dir>/gpu-<label>.json`` and the ``gpu-<label>`` section of
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxamp
from benchmarks import measure, models, worker
from benchmarks.machine import default_label
from benchmarks.variants import hand_cast
from benchmarks.workloads import SIZES, Workload, llama_workload, workloads

__all__ = ["FP8_VARIANTS", "GPU_VARIANTS", "main", "slowest_ops", "static_figures", "time_variant"]

_HERE = Path(__file__).resolve().parent
_F8_GEMM = re.compile(r"__cublas\$lt\$matmul\$f8")


def _recipe(**fields: Any) -> jaxamp.fp8.Fp8Recipe:
    return jaxamp.fp8.Fp8Recipe(**fields)


FP8_VARIANTS = {
    "amp_fp8": _recipe(),
    "amp_fp8_every_size": _recipe(keep_small_bf16=None),
    "amp_fp8_delayed": _recipe(scaling="delayed", amax_history_length=16, keep_small_bf16=None),
    "amp_fp8_rowwise": _recipe(scaling="rowwise", keep_small_bf16=None),
    "amp_fp8_mxfp8": _recipe(scaling="mxfp8", keep_small_bf16=None),
    "amp_fp8_blockwise": _recipe(scaling="blockwise", keep_small_bf16=None),
}
"""amp's fp8 variants: the default (tensorwise, torchao's size rule: small matmuls in bf16), tensorwise at every
size, and each other recipe (every size)."""


def _flax_matmul(x: Any, weight: Any) -> Any:
    from flax.linen import fp8_ops

    # Fresh scales and a one-step history: flax's ops then scale from the live amax (current scaling).
    one, history = jnp.ones((), jnp.float32), jnp.zeros((1,), jnp.float32)
    return fp8_ops.fp8_scaled_dot_general(
        x, weight.astype(x.dtype), (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=x.dtype,
        lhs_scale=one, rhs_scale=one, grad_scale=one, lhs_amax_history=history, rhs_amax_history=history,
        grad_amax_history=history, quantize_compute_type=x.dtype,
    )  # fmt: skip


def _flax_fp8(loss_fn: Callable) -> Callable:
    cast = hand_cast(loss_fn)

    def loss(*args: Any) -> Any:
        models.MATMUL.append(_flax_matmul)
        try:
            return cast(*args)
        finally:
            models.MATMUL.pop()

    return loss


GPU_VARIANTS: dict[str, Callable[[Callable], Callable]] = {
    "f32": lambda loss: loss,
    "amp_bf16": functools.partial(jaxamp.amp, compute_dtype="bf16"),
    **{key: functools.partial(jaxamp.amp, compute_dtype=recipe) for key, recipe in FP8_VARIANTS.items()},
    "flax_fp8": _flax_fp8,
}
"""Every variant the preset times: ``wrap(loss_fn) -> loss_fn``."""


def _workloads(size: str, llama_layers: int | None) -> dict[str, Workload]:
    return {**workloads(size), "llama": llama_workload(size, llama_layers)}


def _delayed(key: str) -> bool:
    return key in FP8_VARIANTS and FP8_VARIANTS[key].scaling == "delayed"


def _train_step(workload: Workload, key: str, optimizer: Any) -> Callable:
    """``step(params, opt_state, fp8_state, *batch) -> (params, opt_state, fp8_state, loss)``."""
    loss = GPU_VARIANTS[key](workload.loss_fn)

    def step(params, opt_state, fp8_state, *batch):
        if _delayed(key):
            value, (grads, observed) = jax.value_and_grad(lambda p, s: loss(p, *batch, fp8_state=s), argnums=(0, 1))(
                params, fp8_state
            )
            fp8_state = fp8_state.update(observed)
        else:
            value, grads = jax.value_and_grad(loss)(params, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, fp8_state, value

    return step


def _fp8_state(workload: Workload, key: str, args: tuple) -> Any:
    if not _delayed(key):
        return None
    return jaxamp.fp8.init_fp8_state(GPU_VARIANTS[key](workload.loss_fn), *args)


def static_figures(workload: Workload) -> dict[str, dict]:
    """Per variant: residual bytes, lowered converts (and those added to amp bf16's), matmuls quantised."""
    args = workload.abstract_args()
    out: dict[str, dict] = {}
    for key, wrap in GPU_VARIANTS.items():
        if key == "flax_fp8" and workload.key == "resnet":
            continue  # flax's fp8 ops are dense layers'; the ResNet's matmuls are convolutions
        loss = wrap(workload.loss_fn)
        state = _fp8_state(workload, key, args)
        extra = {"fp8_state": state} if state is not None else {}
        res = measure.residuals(functools.partial(loss, **extra), *args)
        text = jax.jit(jax.value_and_grad(functools.partial(loss, **extra))).lower(*args).as_text()
        row = {"residual_bytes": res.saved_bytes, "converts": measure.count_converts(text)}
        if key in FP8_VARIANTS:
            report = jaxamp.explain(workload.loss_fn, compute_dtype=FP8_VARIANTS[key])(*args)
            # Sites, as the compiled step writes its GEMMs (a scan body once), not calls.
            row["quantised_matmuls"] = sum(r.detail.startswith("float8") for r in report.rows)
            row["kept_out"] = len(report.kept_out_of_fp8)
        out[key] = row
    for row in out.values():
        row["converts_added"] = row["converts"] - out["amp_bf16"]["converts"]
    return out


def slowest_ops(compiled: Any, args: tuple, top: int = 8) -> list[tuple[str, float]]:
    """The `top` ops of one run of `compiled(*args)` by total device time (ms), from a profile.

    Device planes (a GPU's) when there are any, else the host's XLA ops.
    """
    # `compiled` is warm and donates its arguments: one call only.
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory):
            jax.block_until_ready(compiled(*args))
        (path,) = Path(directory).rglob("*.xplane.pb")
        data = jax.profiler.ProfileData.from_file(str(path))
    planes = [p for p in data.planes if p.name.startswith("/device:")] or list(data.planes)
    totals: Counter[str] = Counter()
    for plane in planes:
        for line in plane.lines:
            if "XLA Ops" in line.name or not plane.name.startswith("/device:"):
                for event in line.events:
                    totals[event.name] += event.duration_ns / 1e6
    return [(name, round(ms, 3)) for name, ms in totals.most_common(top)]


def time_variant(size: str, workload_key: str, key: str, steps: int, warmup: int, llama_layers: int | None) -> dict:
    """Step time, peak memory, float8 GEMMs (and for ``amp_fp8`` a profile) of one variant, in this process."""
    workload = _workloads(size, llama_layers)[workload_key]
    params, *batch = workload.concrete_args()
    optimizer = optax.adamw(1e-4)
    opt_state = jax.tree_util.tree_map(jnp.copy, optimizer.init(params))
    state = _fp8_state(workload, key, (params, *batch))
    step_args = (params, opt_state, state, *batch)
    start = time.perf_counter()
    compiled = jax.jit(_train_step(workload, key, optimizer), donate_argnums=(0, 1)).lower(*step_args).compile()
    compile_s = time.perf_counter() - start
    result: dict[str, Any] = {"compile_s": compile_s, "f8_gemms": len(_F8_GEMM.findall(compiled.as_text()))}
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        params, opt_state, state, loss = jax.block_until_ready(compiled(params, opt_state, state, *batch))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    result["step_s"] = statistics.median(times)
    result["peak_bytes"] = (jax.local_devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    result["final_loss"] = float(loss)
    if key == "amp_fp8":
        result["slowest_ops"] = slowest_ops(compiled, (params, opt_state, state, *batch))
    return result


def _markdown(results: dict) -> list[str]:
    lines = [f"Machine: {results['machine']}; `{results['command']}`.", ""]
    for per in results["models"].values():
        lines += [f"### {per['title']}", ""]
        lines += [
            "| variant | step ms | peak GB | float8 GEMMs / matmuls quantised | converts added to amp bf16 "
            "| residual MB |",
            "|---|---|---|---|---|---|",
        ]
        for key, row in per["variants"].items():
            t = row.get("timing", {})
            step = f"{t['step_s'] * 1e3:.1f}" if "step_s" in t else t.get("error", "-")
            peak = f"{t['peak_bytes'] / 1e9:.2f}" if t.get("peak_bytes") else "-"
            gemms = f"{t.get('f8_gemms', '-')} / {row.get('quantised_matmuls', '-')}"
            converts, res = row.get("converts_added", "-"), row.get("residual_bytes")
            lines.append(f"| {key} | {step} | {peak} | {gemms} | {converts} | {res / 1e6:.1f} |" if res else
                         f"| {key} | {step} | {peak} | {gemms} | {converts} | - |")  # fmt: skip
        profile = per["variants"].get("amp_fp8", {}).get("timing", {}).get("slowest_ops")
        if profile:
            lines += ["", "amp fp8's slowest ops (one step, ms): " + "; ".join(f"`{n}` {ms}" for n, ms in profile)]
        lines.append("")
    return lines


def _update_markdown(md_path: Path, label: str, lines: list[str]) -> None:
    """Replace (or append) the ``label`` section of `md_path`, as `benchmarks.report` does for its own."""
    begin, end = f"<!-- begin: {label} -->", f"<!-- end: {label} -->"
    body = "\n".join([begin, f"## {label} (`python -m benchmarks.gpu`)", "", *lines, end])
    text = md_path.read_text()
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    text = pattern.sub(lambda _: body, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + body
    md_path.write_text(text.rstrip("\n") + "\n")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=SIZES, default="full")
    parser.add_argument("--device-label", help="the RESULTS.md section is gpu-<label> (default: the device)")
    parser.add_argument("--timings", choices=("auto", "on", "off"), default="auto", help="'auto': on GPUs only")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--llama-layers", type=int, help="decoder blocks of the Llama workload (default 4; tiny 2)")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds after which timings are skipped")
    parser.add_argument("--results-dir", type=Path, default=_HERE / "results")
    parser.add_argument("--results-md", type=Path, default=_HERE / "RESULTS.md")
    parser.add_argument("--no-md", action="store_true", help="leave RESULTS.md alone")
    args = parser.parse_args(argv)
    deadline = time.perf_counter() + args.budget
    timed = args.timings == "on" or (args.timings == "auto" and jax.default_backend() == "gpu")
    label = f"gpu-{args.device_label or default_label()}"
    results: dict[str, Any] = {
        "label": label,
        "machine": f"{jax.devices()[0].device_kind}, JAX {jax.__version__}",
        "command": "python -m benchmarks.gpu " + " ".join(argv if argv is not None else sys.argv[1:]),
        "models": {},
    }
    for wkey, workload in _workloads(args.size, args.llama_layers).items():
        print(f"== {workload.title}", flush=True)
        per = {"title": workload.title, "variants": static_figures(workload)}
        results["models"][wkey] = per
        for key, row in per["variants"].items():
            if not timed:
                continue
            left = deadline - time.perf_counter()
            if left < 20:
                row["timing"] = {"error": "skipped: budget spent"}
                continue
            kwargs = dict(size=args.size, workload_key=wkey, key=key, steps=args.steps, warmup=2,
                          llama_layers=args.llama_layers)  # fmt: skip
            row["timing"] = worker.run(time_variant, kwargs, timeout_s=min(240.0, left))
            print(f"   {key}: {row['timing']}", flush=True)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / f"{label}.json").write_text(json.dumps(results, indent=1, default=str))
    if not args.no_md:
        _update_markdown(args.results_md, label, _markdown(results))
    print("\n".join(_markdown(results)))
    return results


if __name__ == "__main__":
    main()
