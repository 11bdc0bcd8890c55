"""Two JAX processes (jax.distributed, gloo CPU collectives) train as one.

Two processes of ``tests/multiprocess_worker.py`` (2 CPU devices each, joined
by `jax.distributed.initialize`) and one single-process reference on 4 devices
run the same data-parallel amp + loss-scaling steps (a NaN in the data of one
process at step 2, a float16 overflow in it at step 4), once per setting in
`RUNS`; each test compares what each process holds at the end of its run.
The processes start once for all the runs the session's tests read (the
`launched` fixture): starting JAX and joining the processes cost more than
most runs.
"""

import fcntl
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

WORKER = Path(__file__).with_name("multiprocess_worker.py")
TIMEOUT = 600  # seconds for all the runs; a hung collective fails the tests
UNAVAILABLE = 77  # the worker's exit code when multi-process CPU collectives are missing

# Every run a test below reads, by name: the worker's options.
RUNS = {
    "bf16-jit": ["--mode", "jit", "--dtype", "bf16"],
    "bf16-shard_map": ["--mode", "shard_map", "--dtype", "bf16"],
    "f16-redo-jit": ["--mode", "jit", "--dtype", "f16", "--redo-on-nan", "3"],
    "f16-redo-shard_map": ["--mode", "shard_map", "--dtype", "f16", "--redo-on-nan", "3"],
    "f16-wrapper-jit": ["--mode", "jit", "--dtype", "f16", "--api", "wrapper"],
    "f16-wrapper-shard_map": ["--mode", "shard_map", "--dtype", "f16", "--api", "wrapper"],
    "f16-live-jit": ["--mode", "jit", "--dtype", "f16", "--api", "live"],
    "f16-float32-reductions": ["--mode", "jit", "--dtype", "f16", "--redo-on-nan", "3", "--float32-reductions"],
    "bf16-low-precision": ["--mode", "jit", "--dtype", "bf16", "--low-precision"],
    "fp8-delayed-jit": ["--mode", "jit", "--dtype", "fp8-delayed"],
    "fp8-delayed-shard_map": ["--mode", "shard_map", "--dtype", "fp8-delayed"],
    "fp8-auto-mesh": ["--mode", "jit", "--dtype", "fp8", "--axis-type", "auto"],
}

pytestmark = pytest.mark.jax_internals
# The oldest-JAX leg of .ci/run does two runs: bf16 under jit, and the scale in
# the optimizer state under shard_map.
NEWEST_ONLY = pytest.mark.newest_only


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(tmp_path, name, num_processes, names):
    """`num_processes` worker processes doing the runs `names`, each run saved per process."""
    port = _free_port()
    procs = []
    for process_id in range(num_processes):
        runs = [[str(tmp_path / f"{run}-{name}-{process_id}.npz"), RUNS[run]] for run in names]
        spec = tmp_path / f"{name}-{process_id}.json"
        spec.write_text(json.dumps(runs))
        cmd = [
            sys.executable,
            str(WORKER),
            "--num-processes",
            str(num_processes),
            "--process-id",
            str(process_id),
            "--port",
            str(port),
            "--runs",
            str(spec),
        ]
        # The worker sets its own device count and keeps the session's other XLA flags.
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def _finish(procs, name):
    for proc in procs:
        try:
            log, _ = proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            pytest.fail(f"{name}: a process did not finish within {TIMEOUT} s (a hung collective?)")
        if proc.returncode == UNAVAILABLE:
            pytest.skip(f"multi-process CPU collectives are unavailable here: {log.strip()[-300:]}")
        assert proc.returncode == 0, f"{name} failed:\n{log[-3000:]}"


@pytest.fixture(scope="session")
def launched(request, tmp_path_factory):
    """Every run this session's selected tests read: two processes, and one on all 4 devices, at once.

    Done once per session: under pytest-xdist the first worker to get here
    starts the processes and the others wait for its results (a module-scoped
    fixture would start them again on each worker, and again whenever a
    worker runs another module's test in between).

    Returns ``run name -> (per-process results of the two-process run, [the
    single-process result])``.
    """
    names = sorted(
        {
            item.callspec.params["run"]
            for item in request.session.items
            if item.path == Path(__file__) and hasattr(item, "callspec") and "run" in item.callspec.params
        }
    )
    session_dir = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        session_dir = session_dir.parent  # the workers' common folder
    tmp_path = session_dir / "multiprocess"
    tmp_path.mkdir(exist_ok=True)
    with open(session_dir / "multiprocess.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = tmp_path / "done"
        if not done.exists():
            two, one = _start(tmp_path, "two", 2, names), _start(tmp_path, "one", 1, names)
            _finish(two, "the two-process runs")
            _finish(one, "the single-process runs")
            done.touch()

    def load(run, name, num_processes):
        return [dict(np.load(tmp_path / f"{run}-{name}-{p}.npz")) for p in range(num_processes)]

    return {run: (load(run, "two", 2), load(run, "one", 1)) for run in names}


def _assert_processes_identical(runs, run):
    first, *others = runs
    # Under shard_map the parameters and optimizer state are sharded: each
    # process holds its own shards, and the gathered parameters are compared.
    keys = ("params_f32", "scaler", "losses", "scales", "finite")
    keys += ("params", "opt_state") if "shard_map" not in RUNS[run] else ()
    for other in others:
        for key in keys:
            np.testing.assert_array_equal(first[key], other[key], err_msg=key)


@pytest.mark.parametrize("run", ["bf16-jit", pytest.param("bf16-shard_map", marks=NEWEST_ONLY)])
def test_multiprocess_bf16_training_matches_one_process_bit_for_bit(launched, run):
    two, (one,) = launched[run]
    _assert_processes_identical(two, run)
    # The NaN in one process's data skipped step 2 on every process.
    assert two[0]["finite"].tolist() == [True, True, False] + [True] * 5
    for key in ("params_f32", "scaler", "scales", "finite"):
        np.testing.assert_array_equal(two[0][key], one[key], err_msg=key)
    # The logged loss is a float32 mean over the global batch, summed across
    # processes in another order than on one: equal to float32 rounding.
    np.testing.assert_allclose(two[0]["losses"], one["losses"], rtol=1e-6)


@pytest.mark.parametrize(
    "run", [pytest.param("f16-redo-jit", marks=NEWEST_ONLY), pytest.param("f16-redo-shard_map", marks=NEWEST_ONLY)]
)
def test_multiprocess_f16_redo_agrees_on_every_process(launched, run):
    two, (one,) = launched[run]
    _assert_processes_identical(two, run)
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


@pytest.mark.parametrize(
    "run",
    [
        pytest.param("f16-wrapper-jit", marks=NEWEST_ONLY),
        "f16-wrapper-shard_map",
        pytest.param("f16-live-jit", marks=NEWEST_ONLY),
    ],
)
def test_multiprocess_f16_with_the_scale_in_the_optimizer_state_agrees_on_every_process(launched, run):
    # jaxamp.loss_scaling + amp(loss_scale=opt_state), or amp(loss_scale=tx)
    # reading the transformation's cells (replicated over the processes'
    # mesh): the NaN in one process's data (step 2) and the float16 overflow
    # in its rows (step 4) skip the step on every process, which all keep the
    # same scale, as one process does.
    two, (one,) = launched[run]
    _assert_processes_identical(two, run)
    np.testing.assert_array_equal(two[0]["finite"], one["finite"])
    np.testing.assert_array_equal(two[0]["scales"], one["scales"])
    assert not one["finite"][2] and not one["finite"][4]
    assert one["scales"][2] == 2.0**14 and one["scales"][4] == 2.0**13
    np.testing.assert_allclose(two[0]["params_f32"], one["params_f32"], rtol=2e-3, atol=2e-4)


@pytest.mark.parametrize("run", [pytest.param("f16-float32-reductions", marks=NEWEST_ONLY)])
def test_multiprocess_f16_with_float32_gradient_reductions(launched, run):
    # Measured (8 steps, JAX 0.12): the largest parameter difference from one
    # process is 4.1e-5 with float16 gradient sums and 1.4e-5 with float32
    # ones (the float16 matmuls themselves still round differently).
    two, (one,) = launched[run]
    _assert_processes_identical(two, run)
    for key in ("scaler", "scales", "finite"):
        np.testing.assert_array_equal(two[0][key], one[key], err_msg=key)
    np.testing.assert_allclose(two[0]["params_f32"], one["params_f32"], rtol=0, atol=5e-5)


@pytest.mark.parametrize("run", [pytest.param("bf16-low-precision", marks=NEWEST_ONLY)])
def test_multiprocess_low_precision_params_stay_identical(launched, run):
    # bfloat16 parameters with stochastic rounding: the random bits must be the
    # same on every process, or the replicas drift apart.
    two, (one,) = launched[run]
    _assert_processes_identical(two, run)
    np.testing.assert_array_equal(two[0]["params"], one["params"])


@pytest.mark.parametrize(
    "run",
    [pytest.param("fp8-delayed-jit", marks=NEWEST_ONLY), pytest.param("fp8-delayed-shard_map", marks=NEWEST_ONLY)],
)
def test_multiprocess_fp8_delayed_histories_agree_on_every_process(launched, run):
    # fp8's delayed recipe: the amax histories each process rolls in are the
    # global amaxes, so every process holds the same state, and the loss
    # scaler leaves the observed amaxes unscaled (the histories equal one
    # process's, which it would divide by 2**15 otherwise). In shard_map each
    # device differentiates its own loss: amp takes each amax's maximum over
    # the devices, across processes too.
    two, (one,) = launched[run]
    _assert_processes_identical(two, run)
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


@pytest.mark.parametrize("run", [pytest.param("fp8-auto-mesh", marks=NEWEST_ONLY)])
def test_multiprocess_fp8_on_an_auto_mesh_scales_each_device_apart(launched, run):
    # fp8 tensorwise on an Auto mesh: each device scales its own shard of the
    # batch when XLA partitions the step (a custom_partitioning op per
    # product), across processes as within one; the weight gradients' sums
    # are the step's only collectives. Four shards either way, so the scales
    # are the same.
    two, (one,) = launched[run]
    _assert_processes_identical(two, run)
    assert two[0]["finite"].tolist() == [True, True, False] + [True] * 5
    np.testing.assert_array_equal(two[0]["scales"], one["scales"])
    np.testing.assert_allclose(two[0]["params_f32"], one["params_f32"], rtol=0, atol=1e-6)  # measured: 3e-8
