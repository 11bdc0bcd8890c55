"""`import jaxamp` changes nothing in JAX: its rule tables are as they were.

JAX keeps each primitive's lowering, batching, differentiation and
partial-evaluation rules in process-wide tables, so a library that patches one
changes every program in the process. Each check runs in a fresh process:
it first imports every other module `import jaxamp` brings in (JAX modules
fill the tables for their own primitives when imported), snapshots the tables
(the ids of their rules), imports jaxamp, and snapshots them again.

fp8 mode installs rules for jaxamp's own primitives (and a batching rule for
`linear_call`, which JAX 0.10-0.12 lack) when it first traces a float8
product: never one that another library's operations go through.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Every dict keyed by primitives (or set of primitives) in the modules holding
# JAX's rule tables, and the names of the configuration options with their values.
_SNAPSHOT = """
import importlib, json, sys
import jax
from jax._src import core, dispatch, source_info_util
from jax._src.interpreters import ad, batching, mlir, partial_eval, pxla

def snapshot():
    tables = {}
    for module in (ad, batching, mlir, partial_eval, pxla, dispatch, core):
        for name, table in vars(module).items():
            label = f"{module.__name__}.{name}"
            if isinstance(table, dict) and any(isinstance(k, core.Primitive) for k in table):
                tables[label] = {f"{k}@{id(k)}": id(v) for k, v in table.items()}
            elif isinstance(table, set) and any(isinstance(k, core.Primitive) for k in table):
                tables[label] = {f"{k}@{id(k)}": 0 for k in table}
    for platform, table in mlir._platform_specific_lowerings.items():
        tables[f"lowerings on {platform}"] = {f"{k}@{id(k)}": id(v) for k, v in table.items()}
    tables["config"] = {name: repr(value) for name, value in jax.config.values.items()}
    tables["source_info_util._exclude_paths"] = {path: 0 for path in source_info_util._exclude_paths}
    return tables

def changed(before, after):
    # {table: {"replaced": [...], "added": [...], "removed": [...]}} for the tables that differ.
    found = {}
    for label in sorted(set(before) | set(after)):
        old, new = before.get(label, {}), after.get(label, {})
        diff = {
            "replaced": sorted(k for k in set(old) & set(new) if old[k] != new[k]),
            "added": sorted(set(new) - set(old)),
            "removed": sorted(set(old) - set(new)),
        }
        if any(diff.values()):
            found[label] = {kind: keys for kind, keys in diff.items() if keys}
    return found

def known(tables):
    return sorted({key for table in tables.values() for key in table})
"""


def _run(script: str, devices: int = 1) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    out = subprocess.run(
        [sys.executable, "-c", _SNAPSHOT + textwrap.dedent(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _other_modules() -> list[str]:
    """The modules other than jaxamp's that `import jaxamp` imports."""
    return _run("""
        before = set(sys.modules)
        import jaxamp
        print(json.dumps(sorted(m for m in set(sys.modules) - before if m.split(".")[0] != "jaxamp")))
    """)


def _import_jaxamp_and(then: str) -> dict:
    """What importing jaxamp, and then running `then`, changed in the tables: ``{table: [keys]}``."""
    modules = _other_modules()
    return _run(
        f"""
        for name in {modules!r}:
            importlib.import_module(name)
        before = snapshot()
        import jaxamp
        imported = snapshot()
        {then}
        print(json.dumps({{"import": changed(before, imported), "then": changed(imported, snapshot()),
                          "known": known(imported)}}))
    """,
        devices=4,
    )


def test_importing_jaxamp_leaves_jaxs_tables_as_they_were():
    changes = _import_jaxamp_and("pass")
    # The one exception: jaxamp's own files are not the user's code in the
    # source lines JAX records (as flax and JAX's own packages register).
    jaxamp_dir = str(ROOT / "jaxamp") + os.sep
    assert changes["import"] == {"source_info_util._exclude_paths": {"added": [jaxamp_dir]}}


def test_fp8_on_a_mesh_installs_rules_for_jaxamps_own_operations_only():
    # A vmap of a gradient on an Auto mesh: the per-device float8 products
    # (jaxamp's primitives) batched, lowered and partitioned, and linear_call
    # (fp8's derivative) batched.
    changes = _import_jaxamp_and("""
        import jax, jax.numpy as jnp
        from jax.sharding import PartitionSpec as P
        recipe = jaxamp.fp8.Fp8Recipe(keep_small_bf16=None, min_contraction=1, gemm_multiple=1, keep_last_matmul_bf16=False)
        mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        loss = jaxamp.amp(lambda w, x: jnp.sum((x @ w).astype(jnp.float32) ** 2), compute_dtype=recipe)
        with jax.set_mesh(mesh):
            xs = jax.device_put(jnp.ones((4, 8, 16)), jax.NamedSharding(mesh, P(None, "data")))
            jax.block_until_ready(jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(jnp.ones((16, 16)), xs))
    """)
    assert changes["import"] == {"source_info_util._exclude_paths": {"added": [str(ROOT / "jaxamp") + os.sep]}}
    then = changes["then"]
    assert not any("replaced" in diff or "removed" in diff for diff in then.values()), then
    # New entries: for jaxamp's own primitives, for linear_call (JAX has no
    # batching rule for it), and for primitives JAX made while tracing; none
    # for another primitive that had rules (custom_partitioning's included).
    known = set(changes["known"])
    added = {key for diff in then.values() for key in diff.get("added", ())}
    assert {key.split("@")[0] for key in added if key in known} <= {"linear_call"}, then
    assert any(key.startswith("jaxamp_per_shard_dot@") for key in added), then
