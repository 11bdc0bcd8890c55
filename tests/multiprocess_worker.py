"""One process of a data-parallel amp + loss-scaling run (tests/test_multiprocess.py).

Run as ``python tests/multiprocess_worker.py --num-processes 2 --process-id 0
--port P --runs RUNS.json`` (with 2 CPU devices per process), or with
``--num-processes 1`` on 4 devices for the single-process reference. RUNS.json
lists the runs, ``[[out, [option, ...]], ...]``; each is done in turn in the
same processes (one start and one `jax.distributed.initialize` for all), with
the options below. Every
process feeds its slice of the same global batches, so the runs compute the
same thing. A NaN in the data lands in one process's shard at step
`NAN_STEP`, and a float16-overflowing row at `OVERFLOW_STEP`. Each run
writes what the process holds at its end (parameters, optimizer and scaler state,
per-step losses, scales and skips) to its ``out`` as an ``.npz``.

Modes:

* ``jit``: `jax.jit` over a global mesh (Explicit axes, `jax.make_mesh`'s
  default); the batch is sharded, the parameters replicated.
* ``shard_map``: the step is a `shard_map` over the devices (FSDP / ZeRO-3):
  parameters and optimizer state live sharded, each step gathers the
  parameters, each device differentiates its own loss with
  ``axis_name="dp"``, the gradients are reduce-scattered, and each device
  updates its shard with ``skip_nonfinite_updates(axis_name="dp")``.
* ``--dtype fp8-delayed``: fp8's delayed recipe, its amax histories threaded
  through the step (replicated; in ``shard_map`` each device observes the
  global amaxes).
* ``--low-precision``: bfloat16 parameters updated with stochastic rounding
  (`jaxamp.optim.low_precision_params`), keyed from the step number.
* ``--api wrapper``: the loss scale lives in the optimizer state
  (`jaxamp.loss_scaling`, with ``axis_name="dp"`` in ``shard_map``) and amp
  scales inside the gradient (``amp(..., loss_scale=opt_state)``); the
  "scaler" saved is the state's `DynamicScalerState`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--runs", required=True)
    return parser.parse_args()


def _parse_run(out: str, options: list[str]) -> argparse.Namespace:
    """One run's settings, with this process's."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["jit", "shard_map"], default="jit")
    parser.add_argument("--dtype", choices=["bf16", "f16", "fp8", "fp8-delayed"], default="bf16")
    parser.add_argument("--axis-type", choices=["explicit", "auto"], default="explicit")
    parser.add_argument("--redo-on-nan", type=int, default=0)
    parser.add_argument("--api", choices=["explicit", "wrapper", "live"], default="explicit")
    parser.add_argument("--low-precision", action="store_true")
    parser.add_argument("--float32-reductions", action="store_true")
    parser.add_argument("--steps", type=int, default=8)
    run = parser.parse_args(options)
    run.out, run.num_processes = out, PROCESS.num_processes
    return run


PROCESS = _parse()
DEVICES = 4
# This process's own device count; the test session's other flags (its compile settings) kept.
_INHERITED = [flag for flag in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in flag]
os.environ["XLA_FLAGS"] = " ".join(
    [*_INHERITED, f"--xla_force_host_platform_device_count={DEVICES // PROCESS.num_processes}"]
)

import jax  # noqa: E402  (after XLA_FLAGS)

if PROCESS.num_processes > 1:
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError) as err:  # a jaxlib built without gloo
        print(f"no gloo CPU collectives in this jaxlib: {err}")
        sys.exit(77)
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{PROCESS.port}",
        num_processes=PROCESS.num_processes,
        process_id=PROCESS.process_id,
        initialization_timeout=120,
    )

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxamp  # noqa: E402

D, H, OUT, BATCH = 16, 32, 4, 32
NAN_STEP, OVERFLOW_STEP = 2, 4


def init_params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {
        "w1": jax.random.normal(k1, (D, H)) / np.sqrt(D),
        "b1": jnp.zeros(H),
        "w2": jax.random.normal(k2, (H, OUT)) / np.sqrt(H),
    }


def global_batch(step):
    """The whole step's batch, the same in every process; each feeds its rows."""
    rng = np.random.default_rng(step)
    x = rng.normal(size=(BATCH, D)).astype(np.float32)
    y = rng.normal(size=(BATCH, OUT)).astype(np.float32)
    last_process_row = BATCH - 1  # a row of the last process's shard
    if step == NAN_STEP:
        x[last_process_row, 3] = np.nan
    if step == OVERFLOW_STEP:
        x[last_process_row] = 60.0  # overflows float16 gradients at scales above 2**12
    return x, y


def loss_fn(params, x, y):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def make_optimizer():
    adam = optax.adam(1e-2)
    if ARGS.low_precision:
        return jaxamp.optim.low_precision_params(adam, rounding="stochastic", key=jax.random.key(7))
    return adam


def to_storage(params):
    if ARGS.low_precision:
        return jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), params)
    return params


def _gathered(leaf):
    """The whole of a (possibly sharded over processes) array, on this host."""
    if leaf.sharding.is_fully_replicated:
        return leaf.addressable_data(0)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(leaf, tiled=True)


def main():
    axis_type = jax.sharding.AxisType.Explicit if ARGS.axis_type == "explicit" else jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((DEVICES,), ("dp",), axis_types=(axis_type,))  # Explicit: JAX's default
    assert len(mesh.devices.ravel()) == DEVICES
    delayed = ARGS.dtype == "fp8-delayed"
    compute_dtype = ARGS.dtype
    if ARGS.dtype.startswith("fp8"):  # both matmuls in float8; delayed: scaled from amax histories
        compute_dtype = jaxamp.fp8.Fp8Recipe(
            scaling="delayed" if delayed else "tensorwise",
            amax_history_length=4,
            keep_last_matmul_bf16=False,
            gemm_multiple=1,
            min_contraction=1,
            keep_small_bf16=None,
        )
    amp_loss = jaxamp.amp(loss_fn, compute_dtype=compute_dtype, float32_gradient_reductions=ARGS.float32_reductions)
    batch_sharding = NamedSharding(mesh, P("dp"))
    replicated = NamedSharding(mesh, P())

    def put_batch(step):
        x, y = global_batch(step)
        rows = BATCH // jax.process_count()
        start = jax.process_index() * rows
        return tuple(jax.make_array_from_process_local_data(batch_sharding, a[start : start + rows]) for a in (x, y))

    with jax.set_mesh(mesh):
        params = jax.device_put(to_storage(init_params()), replicated)
        fp8_state = None
        if ARGS.mode == "jit" and delayed:
            optimizer = jaxamp.scaling.skip_nonfinite_updates(make_optimizer())
            # The state's gradient (the observed amaxes) passes the loss
            # scaler unscaled, and every process rolls in the same amaxes.
            grad_fn = jaxamp.dynamic_scale_value_and_grad(
                lambda p, s, x, y: amp_loss(p, x, y, fp8_state=s),
                filter=False,
                redo_on_nan=ARGS.redo_on_nan,
                argnums=(0, 1),
            )
            fp8_state = jax.device_put(jaxamp.fp8.init_fp8_state(amp_loss, params, *put_batch(0)), replicated)

            @jax.jit
            def step(params, opt_state, scaler, fp8_state, x, y):
                scaler, (loss, (grads, observed)) = grad_fn(params, fp8_state, x, y, dynamic_scaler_state=scaler)
                updates, opt_state = optimizer.update(grads, opt_state, params)
                params = jaxamp.scaling.apply_if_finite_updates(params, updates, opt_state.last_finite)
                return params, opt_state, scaler, fp8_state.update(observed), loss, opt_state.last_finite

            opt_state = optimizer.init(params)
        elif ARGS.api in ("wrapper", "live"):
            # The scale in the optimizer state; amp scales inside the gradient,
            # reading it from the state (wrapper) or the transformation (live).
            optimizer = jaxamp.loss_scaling(
                make_optimizer(), scaler=2.0**15, patience=3, axis_name="dp" if ARGS.mode == "shard_map" else None
            )

            def grads_of(params, opt_state, x, y):
                loss = jaxamp.amp(
                    loss_fn,
                    compute_dtype=compute_dtype,
                    loss_scale=optimizer if ARGS.api == "live" else opt_state,
                    float32_gradient_reductions=ARGS.float32_reductions,
                )
                return jax.value_and_grad(loss)(params, x, y)

            if ARGS.mode == "jit":

                @jax.jit
                def step(params, opt_state, scaler, x, y):
                    loss, grads = grads_of(params, opt_state, x, y)
                    updates, opt_state = optimizer.update(grads, opt_state, params)
                    params = jaxamp.scaling.apply_if_finite_updates(params, updates, opt_state.last_finite)
                    return params, opt_state, opt_state.scaler_state, loss, opt_state.last_finite

                opt_state = optimizer.init(params)
            else:

                def body(shards, opt_state, scaler, x, y):
                    params = jax.tree_util.tree_map(lambda a: jax.lax.all_gather(a, "dp", axis=0, tiled=True), shards)
                    loss, grads = grads_of(params, opt_state, x, y)
                    grads = jax.tree_util.tree_map(
                        lambda g: jax.lax.psum_scatter(g, "dp", scatter_dimension=0, tiled=True) / DEVICES,
                        grads,
                    )
                    updates, opt_state = optimizer.update(grads, opt_state, shards)
                    shards = jaxamp.scaling.apply_if_finite_updates(shards, updates, opt_state.last_finite)
                    return shards, opt_state, opt_state.scaler_state, jax.lax.pmean(loss, "dp"), opt_state.last_finite

                def specs(tree):
                    return jax.tree_util.tree_map(lambda leaf: P("dp") if leaf.ndim else P(), tree)

                param_spec = specs(params)
                params = jax.device_put(params, jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), param_spec))
                state_spec = specs(jax.eval_shape(optimizer.init, params))
                step = jax.jit(
                    jax.shard_map(
                        body,
                        mesh=mesh,
                        in_specs=(param_spec, state_spec, P(), P("dp"), P("dp")),
                        out_specs=(param_spec, state_spec, P(), P(), P()),
                        check_vma=False,  # as pmap: the wrapper decides over its axis_name
                    )
                )
                opt_state = jax.jit(
                    jax.shard_map(optimizer.init, mesh=mesh, in_specs=(param_spec,), out_specs=state_spec)
                )(params)
        elif ARGS.mode == "jit":
            optimizer = jaxamp.scaling.skip_nonfinite_updates(make_optimizer())
            grad_fn = jaxamp.dynamic_scale_value_and_grad(amp_loss, filter=False, redo_on_nan=ARGS.redo_on_nan)

            @jax.jit
            def step(params, opt_state, scaler, x, y):
                scaler, (loss, grads) = grad_fn(params, x, y, dynamic_scaler_state=scaler)
                updates, opt_state = optimizer.update(grads, opt_state, params)
                params = jaxamp.scaling.apply_if_finite_updates(params, updates, opt_state.last_finite)
                return params, opt_state, scaler, loss, opt_state.last_finite

            opt_state = optimizer.init(params)
        else:
            optimizer = jaxamp.scaling.skip_nonfinite_updates(make_optimizer(), axis_name="dp")
            # The delayed recipe's state enters every device replicated; each
            # device's observed amaxes are the global ones (amp takes their
            # maximum over "dp"), so every device rolls in the same.
            grad_fn = jaxamp.dynamic_scale_value_and_grad(
                (lambda p, s, x, y: amp_loss(p, x, y, fp8_state=s)) if delayed else amp_loss,
                filter=False,
                redo_on_nan=ARGS.redo_on_nan,
                axis_name="dp",
                argnums=(0, 1) if delayed else 0,
            )
            if delayed:
                fp8_state = jax.device_put(jaxamp.fp8.init_fp8_state(amp_loss, params, *put_batch(0)), replicated)

            # FSDP / ZeRO-3: parameters and optimizer state live sharded along
            # their first axis; each step gathers the parameters, and
            # reduce-scatters the gradients back to the shards.
            def body(shards, opt_state, scaler, *state_and_batch):
                *fp8_state, x, y = state_and_batch
                params = jax.tree_util.tree_map(lambda a: jax.lax.all_gather(a, "dp", axis=0, tiled=True), shards)
                if delayed:
                    scaler, (loss, (grads, observed)) = grad_fn(params, *fp8_state, x, y, dynamic_scaler_state=scaler)
                    fp8_state = [fp8_state[0].update(observed)]
                else:
                    scaler, (loss, grads) = grad_fn(params, x, y, dynamic_scaler_state=scaler)
                grads = jax.tree_util.tree_map(
                    lambda g: jax.lax.psum_scatter(g, "dp", scatter_dimension=0, tiled=True) / DEVICES,
                    grads,
                )
                updates, opt_state = optimizer.update(grads, opt_state, shards)
                shards = jaxamp.scaling.apply_if_finite_updates(shards, updates, opt_state.last_finite)
                return shards, opt_state, scaler, *fp8_state, jax.lax.pmean(loss, "dp"), opt_state.last_finite

            def specs(tree):
                # Arrays are sharded along their first axis; counters are shared.
                return jax.tree_util.tree_map(lambda leaf: P("dp") if leaf.ndim else P(), tree)

            param_spec = specs(params)
            params = jax.device_put(params, jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), param_spec))
            state_spec = specs(jax.eval_shape(optimizer.init, params))
            fp8_spec = (P(),) if delayed else ()
            step = jax.jit(
                jax.shard_map(
                    body,
                    mesh=mesh,
                    in_specs=(param_spec, state_spec, P(), *fp8_spec, P("dp"), P("dp")),
                    out_specs=(param_spec, state_spec, P(), *fp8_spec, P(), P()),
                )
            )
            opt_state = jax.jit(jax.shard_map(optimizer.init, mesh=mesh, in_specs=(param_spec,), out_specs=state_spec))(
                params
            )

        scaler = jaxamp.DynamicScalerState(scaler=2.0**15, patience=3)
        losses, scales, finite = [], [], []
        for i in range(ARGS.steps):
            if fp8_state is not None:
                params, opt_state, scaler, fp8_state, loss, last_finite = step(
                    params, opt_state, scaler, fp8_state, *put_batch(i)
                )
            else:
                params, opt_state, scaler, loss, last_finite = step(params, opt_state, scaler, *put_batch(i))
            losses.append(float(loss))
            scales.append(float(scaler.scaler))
            finite.append(bool(last_finite))

    def host(tree):
        # Replicated values: this process's first copy. Sharded ones: its shards.
        tree = jax.tree_util.tree_map(
            lambda leaf: jax.random.key_data(leaf) if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) else leaf,
            tree,
        )
        return [
            np.concatenate([np.asarray(s.data).reshape(-1).view(np.uint8) for s in leaf.addressable_shards])
            if not leaf.sharding.is_fully_replicated
            else np.asarray(leaf.addressable_data(0)).reshape(-1).view(np.uint8)
            for leaf in jax.tree_util.tree_leaves(tree)
        ]

    np.savez(
        ARGS.out,
        params=np.concatenate(host(params)),
        scaler=np.concatenate(host(scaler)),
        opt_state=np.concatenate(host(opt_state)) if ARGS.mode == "jit" else np.zeros(0, np.uint8),
        params_f32=np.concatenate(
            [
                np.asarray(jax.device_get(_gathered(leaf)), np.float32).ravel()
                for leaf in jax.tree_util.tree_leaves(params)
            ]
        ),
        fp8_state=np.concatenate(host(fp8_state)) if fp8_state is not None else np.zeros(0, np.uint8),
        fp8_histories=np.concatenate(
            [np.asarray(h).ravel() for h in jax.tree_util.tree_leaves(jax.device_get(fp8_state))]
        )
        if fp8_state is not None
        else np.zeros(0, np.float32),
        losses=np.array(losses),
        scales=np.array(scales),
        finite=np.array(finite),
    )


if __name__ == "__main__":
    with open(PROCESS.runs) as runs:
        for out, options in json.load(runs):
            ARGS = _parse_run(out, options)
            main()
    if PROCESS.num_processes > 1:
        jax.distributed.shutdown()
