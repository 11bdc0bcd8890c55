"""Two JAX processes (jax.distributed, gloo CPU collectives) train as one.

Each test starts two processes of ``tests/multiprocess_worker.py`` (2 CPU
devices each, joined by `jax.distributed.initialize`) and one single-process
reference on 4 devices, runs the same data-parallel amp + loss-scaling steps
in all of them (a NaN in the data of one process at step 2, a float16
overflow in it at step 4), and compares what each process holds at the end.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals

WORKER = Path(__file__).with_name("multiprocess_worker.py")
TIMEOUT = 300  # seconds for a whole run; a hung collective fails the test
UNAVAILABLE = 77  # the worker's exit code when multi-process CPU collectives are missing


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(tmp_path, name, num_processes, options):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    port = _free_port()
    procs = []
    for process_id in range(num_processes):
        out = tmp_path / f"{name}-{process_id}.npz"
        cmd = [
            sys.executable,
            str(WORKER),
            "--num-processes",
            str(num_processes),
            "--process-id",
            str(process_id),
            "--port",
            str(port),
            "--out",
            str(out),
            *options,
        ]
        procs.append((subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out))
    results = []
    for proc, out in procs:
        try:
            log, _ = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for other, _ in procs:
                other.kill()
            pytest.fail(f"{name}: a process did not finish within {TIMEOUT} s (a hung collective?)")
        if proc.returncode == UNAVAILABLE:
            pytest.skip(f"multi-process CPU collectives are unavailable here: {log.strip()[-300:]}")
        assert proc.returncode == 0, f"{name} failed:\n{log[-3000:]}"
        results.append(dict(np.load(out)))
    return results


def _launch_both(tmp_path, options):
    """The two-process run and its single-process reference, started together."""
    return _run(tmp_path, "two", 2, options), _run(tmp_path, "one", 1, options)


def _assert_processes_identical(runs, mode="jit"):
    first, *others = runs
    # Under shard_map the parameters and optimizer state are sharded: each
    # process holds its own shards, and the gathered parameters are compared.
    keys = ("params_f32", "scaler", "losses", "scales", "finite")
    keys += ("params", "opt_state") if mode == "jit" else ()
    for other in others:
        for key in keys:
            np.testing.assert_array_equal(first[key], other[key], err_msg=key)


@pytest.mark.parametrize("mode", ["jit", "shard_map"])
def test_multiprocess_bf16_training_matches_one_process_bit_for_bit(tmp_path, mode):
    two, (one,) = _launch_both(tmp_path, ["--mode", mode, "--dtype", "bf16"])
    _assert_processes_identical(two, mode)
    # The NaN in one process's data skipped step 2 on every process.
    assert two[0]["finite"].tolist() == [True, True, False] + [True] * 5
    for key in ("params_f32", "scaler", "scales", "finite"):
        np.testing.assert_array_equal(two[0][key], one[key], err_msg=key)
    # The logged loss is a float32 mean over the global batch, summed across
    # processes in another order than on one: equal to float32 rounding.
    np.testing.assert_allclose(two[0]["losses"], one["losses"], rtol=1e-6)


@pytest.mark.parametrize("mode", ["jit", "shard_map"])
def test_multiprocess_f16_redo_agrees_on_every_process(tmp_path, mode):
    two, (one,) = _launch_both(tmp_path, ["--mode", mode, "--dtype", "f16", "--redo-on-nan", "3"])
    _assert_processes_identical(two, mode)
    ref = one
    # Step 2 (NaN data): skipped with one shrink. Step 4 (overflow in one
    # process's rows): redone at smaller scales on both processes alike.
    np.testing.assert_array_equal(two[0]["finite"], ref["finite"])
    np.testing.assert_array_equal(two[0]["scales"], ref["scales"])
    assert ref["scales"][2] == 2.0**14 and ref["scales"][4] < 2.0**14
    # Float16 partial sums are added in another order across 2 processes than
    # on one: equal to float16 rounding.
    np.testing.assert_allclose(two[0]["params_f32"], ref["params_f32"], rtol=2e-3, atol=2e-4)
    finite_losses = np.isfinite(ref["losses"])
    np.testing.assert_allclose(two[0]["losses"][finite_losses], ref["losses"][finite_losses], rtol=2e-3)


@pytest.mark.parametrize("mode", ["jit", "shard_map"])
def test_multiprocess_f16_with_the_scale_in_the_optimizer_state_agrees_on_every_process(tmp_path, mode):
    # jaxamp.loss_scaling + amp(loss_scale=opt_state): the NaN in one
    # process's data (step 2) and the float16 overflow in its rows (step 4)
    # skip the step on every process, which all keep the same scale, as one
    # process does.
    two, (one,) = _launch_both(tmp_path, ["--mode", mode, "--dtype", "f16", "--api", "wrapper"])
    _assert_processes_identical(two, mode)
    np.testing.assert_array_equal(two[0]["finite"], one["finite"])
    np.testing.assert_array_equal(two[0]["scales"], one["scales"])
    assert not one["finite"][2] and not one["finite"][4]
    assert one["scales"][2] == 2.0**14 and one["scales"][4] == 2.0**13
    np.testing.assert_allclose(two[0]["params_f32"], one["params_f32"], rtol=2e-3, atol=2e-4)


def test_multiprocess_f16_with_float32_gradient_reductions(tmp_path):
    # Measured (8 steps, JAX 0.12): the largest parameter difference from one
    # process is 4.1e-5 with float16 gradient sums and 1.4e-5 with float32
    # ones (the float16 matmuls themselves still round differently).
    options = ["--mode", "jit", "--dtype", "f16", "--redo-on-nan", "3", "--float32-reductions"]
    two, (one,) = _launch_both(tmp_path, options)
    _assert_processes_identical(two)
    for key in ("scaler", "scales", "finite"):
        np.testing.assert_array_equal(two[0][key], one[key], err_msg=key)
    np.testing.assert_allclose(two[0]["params_f32"], one["params_f32"], rtol=0, atol=5e-5)


def test_multiprocess_low_precision_params_stay_identical(tmp_path):
    # bfloat16 parameters with stochastic rounding: the random bits must be the
    # same on every process, or the replicas drift apart.
    two, (one,) = _launch_both(tmp_path, ["--mode", "jit", "--dtype", "bf16", "--low-precision"])
    _assert_processes_identical(two)
    np.testing.assert_array_equal(two[0]["params"], one["params"])


@pytest.mark.parametrize("mode", ["jit", "shard_map"])
def test_multiprocess_fp8_delayed_histories_agree_on_every_process(tmp_path, mode):
    # fp8's delayed recipe: the amax histories each process rolls in are the
    # global amaxes, so every process holds the same state, and the loss
    # scaler leaves the observed amaxes unscaled (the histories equal one
    # process's, which it would divide by 2**15 otherwise). In shard_map each
    # device differentiates its own loss: amp takes each amax's maximum over
    # the devices, across processes too.
    two, (one,) = _launch_both(tmp_path, ["--mode", mode, "--dtype", "fp8-delayed"])
    _assert_processes_identical(two, mode)
    np.testing.assert_array_equal(two[0]["fp8_state"], two[1]["fp8_state"])
    assert two[0]["finite"].tolist() == [True, True, False] + [True] * 5
    histories, want = two[0]["fp8_histories"], one["fp8_histories"]
    # Two matmuls' [3 rows (lhs, rhs, cotangent), 4 steps] histories. The
    # forward amaxes are the data's, weights' and activations' (0.1 to 60),
    # not 2**-15 of them.
    forward = histories.reshape(2, 3, 4)[:, :2]
    assert 0.1 < forward.min() and forward.max() <= 60.0, forward
    # bfloat16 values rounded in another order across processes: amaxes within bf16's rounding.
    np.testing.assert_allclose(histories, want, rtol=1e-2)


def test_multiprocess_fp8_on_an_auto_mesh_scales_each_device_apart(tmp_path):
    # fp8 tensorwise on an Auto mesh: each device scales its own shard of the
    # batch when XLA partitions the step (a custom_partitioning op per
    # product), across processes as within one; the weight gradients' sums
    # are the step's only collectives. Four shards either way, so the scales
    # are the same.
    two, (one,) = _launch_both(tmp_path, ["--mode", "jit", "--dtype", "fp8", "--axis-type", "auto"])
    _assert_processes_identical(two)
    assert two[0]["finite"].tolist() == [True, True, False] + [True] * 5
    np.testing.assert_array_equal(two[0]["scales"], one["scales"])
    np.testing.assert_allclose(two[0]["params_f32"], one["params_f32"], rtol=0, atol=1e-6)  # measured: 3e-8
