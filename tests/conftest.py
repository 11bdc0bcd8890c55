"""Test-session setup.

Compiling is most of the suite's time: it runs thousands of tiny programs, and
no test measures speed. So, before JAX is first imported (subprocesses the
tests start inherit all of it):

* eight host (CPU) devices, so the sharding tests build real meshes anywhere;
* XLA's CPU backend compiles without LLVM's expensive passes (40% off the suite);
* one persistent compilation cache for the session, shared by the xdist
  workers, for the programs several tests (and both workers) compile alike
  (13% off), in a temporary folder removed at the end unless
  ``JAX_COMPILATION_CACHE_DIR`` names one already.
"""

import os
import shutil
import tempfile

_FLAGS = (
    "--xla_force_host_platform_device_count=8",
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
)
for _flag in _FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

# Made by the process pytest starts (before it starts the workers, which inherit it).
_SESSION_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _SESSION_CACHE = tempfile.mkdtemp(prefix="jaxamp-tests-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _SESSION_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


import gc  # noqa: E402

import pytest  # noqa: E402  (after the XLA flag above)


def pytest_collection_modifyitems(config, items):
    """Deselect the tests listed, a test id a line ('#': a comment), in the file ``JAXAMP_TESTS_DESELECT`` names.

    .ci/run's oldest-JAX leg names .ci/oldest_deselected.txt (an environment
    variable: pytest reads a conftest's options only where it is given the
    conftest's folder).
    """
    path = os.environ.get("JAXAMP_TESTS_DESELECT")
    if not path:
        return
    with open(path) as f:
        listed = {line.strip() for line in f if line.strip() and not line.startswith("#")}
    deselected = [item for item in items if item.nodeid in listed]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item.nodeid not in listed]


def pytest_unconfigure(config):
    if _SESSION_CACHE is not None and not hasattr(config, "workerinput"):
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


@pytest.fixture
def earlier_objects_frozen():
    """The objects from before the test out of the cyclic garbage collector's reach while it runs.

    For tests whose code calls ``gc.collect()`` (Tunix, as it builds an RL
    cluster, reshards a model or makes a learner; the benchmarks, before each
    sample they time): a full collection walks every object the process holds,
    JAX's caches and every earlier test's leftovers, 0.3 to 0.8 s of CPU each
    in a worker that has run a hundred tests. Frozen, the earlier objects are
    skipped (not freed: they are unfrozen after the test); what the test makes
    is collected as before. Use it with
    ``pytestmark = pytest.mark.usefixtures("earlier_objects_frozen")``.
    """
    frozen_before = gc.get_freeze_count()  # a freeze made elsewhere stays
    gc.freeze()
    yield
    if not frozen_before:
        gc.unfreeze()


@pytest.fixture
def fresh_warnings(monkeypatch):
    """amp warns once per primitive per process: each test hears its own.

    amp's caches of rewritten bodies are emptied too: a body served from them
    is not rewritten again, so its warnings would not be said again.
    """
    import weakref

    from jaxamp.transform import _higher_order, _interpreter

    monkeypatch.setattr(_interpreter, "_warned", set())
    monkeypatch.setattr(_interpreter, "_RECOMPUTED", {})
    monkeypatch.setattr(_higher_order, "_AMP_BODIES", weakref.WeakKeyDictionary())
