"""What loss scaling and float32 gradient reductions add to a data-parallel step's collectives.

    python -m benchmarks.collectives          # from the repository root

On a 4-device mesh (CPU host devices: the figures count ops and bytes in the
compiled HLO, so any backend gives them), a two-layer MLP's data-parallel
float16 train step is compiled

* under `jax.jit` over a global mesh, and under `jax.shard_map` (per-device
  losses; the replicated parameters' gradients summed by JAX's own transpose),
  each with and without
  `jaxamp.dynamic_scale_value_and_grad`: the scaler's decision must cost at
  most one scalar all-reduce (none under jit, where the arrays are global);
* with and without ``amp(..., float32_gradient_reductions=True)``: the
  all-reduces' operand dtypes and bytes;
* in fp8 mode against bf16 mode (no scaler), under `jit` over an Explicit and
  an Auto mesh and in `shard_map`: what the float8 scales' amaxes add; and
  the same under `jit` for a step of two convolutions.

Each row lists the all-reduces of the compiled program with their operands'
types, their count and their bytes.
"""

from __future__ import annotations

import os
import re

if __name__ == "__main__":  # before JAX starts: four host devices
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp

__all__ = ["all_reduces", "measure", "measure_fp8", "measure_fp8_convolutions", "main"]

D, H, OUT, BATCH, DEVICES = 256, 1024, 256, 64, 4
_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "pred": 1, "f8e4m3fn": 1, "f8e5m2": 1}


def all_reduces(hlo: str, in_branches: bool = False) -> list[tuple[str, int]]:
    """``(operand types, bytes)`` of every all-reduce in a compiled HLO text.

    With `in_branches` False (the default), those inside a conditional's
    branches are left out: they run only when their branch is taken (fp8's
    delayed recipe takes a live amax only while a history is empty); True
    lists only those.
    """
    branches = {name for group in re.findall(r"branch_computations=\{([^}]*)\}", hlo)
                for name in re.findall(r"%([\w.\-]+)", group)}  # fmt: skip
    found, computation = [], None
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            computation = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
        if not re.search(r"\ball-reduce(-start)?\(", line) or (computation in branches) != in_branches:
            continue
        result = line.split("=", 1)[1].split("all-reduce", 1)[0]
        shapes = re.findall(r"(\w+)\[([\d,]*)\]", result)
        size = sum(_BYTES[t] * int(np.prod([int(d) for d in dims.split(",") if d] or [1])) for t, dims in shapes)
        found.append((" ".join(f"{t}[{dims}]" for t, dims in shapes), size))
    return found


def _loss(params, x):
    h = jax.nn.relu(x @ params["w1"])
    return jnp.mean((h @ params["w2"]) ** 2)


def _params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w1": jax.random.normal(k1, (D, H)) / np.sqrt(D), "w2": jax.random.normal(k2, (H, OUT)) / np.sqrt(H)}


# "fp8" at every size: these steps' matmuls are far below the default's size
# rule (keep_small_bf16), and the figures are float8's collectives.
_COMPUTE = {"fp8": jaxamp.fp8.Fp8Recipe(keep_small_bf16=None)}


def _step(mode: str, scaled: bool, float32_reductions: bool, mesh, compute_dtype="f16"):
    dtype = _COMPUTE.get(compute_dtype, compute_dtype)
    loss = jaxamp.amp(_loss, compute_dtype=dtype, float32_gradient_reductions=float32_reductions)
    if scaled:
        grad_fn = jaxamp.dynamic_scale_value_and_grad(loss, filter=False)

        def grads_of(params, x, state):
            state, (value, grads) = grad_fn(params, x, dynamic_scaler_state=state)
            return value, grads, state
    else:

        def grads_of(params, x, state):
            return *jax.value_and_grad(loss)(params, x), state

    if mode == "jit":
        return jax.jit(grads_of)

    def body(params, x, state):
        # The parameters enter replicated, so (check_vma) JAX's transpose
        # already sums their gradients over "dp"; the loss is per device.
        value, grads, state = grads_of(params, x, state)
        return jax.lax.pmean(value, "dp"), grads, state

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("dp"), P()), out_specs=(P(), P(), P())))


def _delayed_step(mode: str, scaled: bool, float32_reductions: bool, mesh, recipe):
    """`_step` (under `jit`, no scaler) for fp8's delayed recipe: the gradient taken with respect to
    the amax histories too (the step's observed amaxes), which start as a constant."""
    assert mode == "jit" and not scaled and not float32_reductions
    loss = jaxamp.amp(_loss, compute_dtype=recipe)
    histories = jaxamp.fp8.init_fp8_state(loss, _params(), jnp.ones((BATCH, D)))

    def grads_of(params, x, state):
        value, (grads, observed) = jax.value_and_grad(lambda p, s: loss(p, x, fp8_state=s), argnums=(0, 1))(
            params, histories
        )
        return value, grads, histories.update(observed)

    return jax.jit(grads_of)


def _compiled_all_reduces(axis_type: AxisType, steps: dict) -> dict:
    """``{key: {"all-reduces", "bytes", "operands"}}`` of each step compiled on a DEVICES-long mesh.

    `steps` maps a key to ``make(mesh) -> step``; every step is compiled for the
    same replicated parameters, batch split along "dp" and scaler state.
    """
    mesh = jax.make_mesh((DEVICES,), ("dp",), axis_types=(axis_type,), devices=jax.devices()[:DEVICES])
    found = {}
    with jax.set_mesh(mesh):
        params = jax.device_put(_params(), NamedSharding(mesh, P()))
        x = jax.device_put(jnp.ones((BATCH, D)), NamedSharding(mesh, P("dp")))
        state = jaxamp.DynamicScalerState()
        for key, make in steps.items():
            found[key] = _summary(make(mesh).lower(params, x, state).compile().as_text())
    return found


def _summary(hlo: str) -> dict:
    reduces = all_reduces(hlo)
    return {
        "all-reduces": len(reduces),
        "bytes": sum(size for _, size in reduces),
        "operands": "; ".join(types for types, _ in reduces),
    }


def measure() -> list[dict]:
    """One row per (mode, scaler, reductions): the compiled step's all-reduces."""
    rows = []
    for mode, axis_type in (("jit", AxisType.Explicit), ("shard_map", AxisType.Auto)):
        steps = {
            (scaled, f32): (lambda mesh, mode=mode, scaled=scaled, f32=f32: _step(mode, scaled, f32, mesh))
            for scaled, f32 in ((False, False), (True, False), (True, True))
        }
        for (scaled, f32), figures in _compiled_all_reduces(axis_type, steps).items():
            rows.append({"mode": mode, "loss scaler": scaled, "float32_gradient_reductions": f32, **figures})
    return rows


def measure_fp8() -> list[dict]:
    """One row per (mode, compute dtype): the compiled data-parallel step's all-reduces."""
    rows = []
    for mode, axis_type in (("jit", AxisType.Explicit), ("jit", AxisType.Auto), ("shard_map", AxisType.Auto)):
        steps = {
            dtype: (lambda mesh, mode=mode, dtype=dtype: _step(mode, False, False, mesh, dtype))
            for dtype in ("bf16", "fp8")
        }
        for dtype, figures in _compiled_all_reduces(axis_type, steps).items():
            rows.append({"mode": f"{mode} ({axis_type.name})", "compute dtype": dtype, **figures})
    return rows


def _conv_loss(params, x):
    dims = ("NHWC", "HWIO", "NHWC")
    h = jax.nn.relu(jax.lax.conv_general_dilated(x, params["k1"], (1, 1), "SAME", dimension_numbers=dims))
    h = jax.lax.conv_general_dilated(h, params["k2"], (1, 1), "SAME", dimension_numbers=dims)
    return jnp.mean(h.astype(jnp.float32) ** 2)


def measure_fp8_convolutions() -> list[dict]:
    """`measure_fp8` for a data-parallel step of two 3x3 convolutions (16 -> 32 -> 32 features, 16x16 images)."""
    k1, k2, kx = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"k1": jax.random.normal(k1, (3, 3, 16, 32)) / 12, "k2": jax.random.normal(k2, (3, 3, 32, 32)) / 17}
    x = jax.random.normal(kx, (BATCH, 16, 16, 16))
    rows = []
    for axis_type in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh((DEVICES,), ("dp",), axis_types=(axis_type,), devices=jax.devices()[:DEVICES])
        with jax.set_mesh(mesh):
            # Placed: JAX's convolution transpose cannot type an unplaced
            # kernel's gradient beside a split batch on an Explicit mesh.
            placed = jax.device_put(params, NamedSharding(mesh, P()))
            batch = jax.device_put(x, NamedSharding(mesh, P("dp")))
            for dtype in ("bf16", "fp8"):
                step = jax.jit(jax.grad(jaxamp.amp(_conv_loss, compute_dtype=_COMPUTE.get(dtype, dtype))))
                figures = _summary(step.lower(placed, batch).compile().as_text())
                rows.append({"mode": f"jit ({axis_type.name}), convolutions", "compute dtype": dtype, **figures})
    return rows


def main() -> list[dict]:
    rows = measure()
    print(f"JAX {jax.__version__}, {DEVICES} devices, f16 MLP {D}x{H}x{OUT}, batch {BATCH}")
    print("| mode | loss scaler | float32 reductions | all-reduces | bytes | operands |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['loss scaler']} | {r['float32_gradient_reductions']} | "
            f"{r['all-reduces']} | {r['bytes']:,} | {r['operands']} |"
        )
    fp8_rows = measure_fp8() + measure_fp8_convolutions()
    print("\n| mode | compute dtype | all-reduces | bytes | operands |")
    print("|---|---|---|---|---|")
    for r in fp8_rows:
        print(f"| {r['mode']} | {r['compute dtype']} | {r['all-reduces']} | {r['bytes']:,} | {r['operands']} |")
    return rows + fp8_rows


if __name__ == "__main__":
    main()
