"""Partition rules, and sharding/gathering pytrees with the resulting specs."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxamp.sharding import (
    create_mesh,
    get_weight_decay_mask,
    make_shard_and_gather_fns,
    match_partition_rules,
    tree_apply,
)

RULES = (
    (r"embed/table$", P("tp", "fsdp")),
    (r"layers/\d+/w$", P("fsdp", "tp")),
    (r"w$", P(None, "fsdp")),  # never reached by layers/*/w: first match wins
    (r"b$", P()),
)


def params():
    return {
        "embed": {"table": np.ones((16, 8), np.float32)},
        "layers": [
            {"w": np.ones((8, 8), np.float32), "b": np.zeros((8,), np.float32)},
            {"w": np.ones((8, 8), np.float32), "b": np.zeros((8,), np.float32)},
        ],
        "head": {"w": np.ones((8, 16), np.float32)},
        "step": np.int32(3),
        "scale": np.ones((1, 1), np.float32),
    }


# match_partition_rules -----------------------------------------------------------


def test_rules_on_a_dict_first_match_wins_and_scalars_replicate():
    specs = match_partition_rules(RULES, params())
    assert specs["embed"]["table"] == P("tp", "fsdp")
    assert specs["layers"][1]["w"] == P("fsdp", "tp")
    assert specs["layers"][1]["b"] == P()
    assert specs["head"]["w"] == P(None, "fsdp")
    # A scalar and a one-element array match no rule, yet are replicated.
    assert specs["step"] == P()
    assert specs["scale"] == P()


def test_rules_on_abstract_shapes():
    abstract = jax.eval_shape(lambda: jax.tree.map(jnp.asarray, params()))
    assert match_partition_rules(RULES, abstract) == match_partition_rules(RULES, params())


def test_rules_on_an_equinox_module():
    mlp = eqx.nn.MLP(4, 2, 8, depth=2, key=jax.random.key(0))
    rules = ((r"layers/2/weight$", P(None, "fsdp")), (r"weight$", P("fsdp")), (r"bias$", P()))
    specs = match_partition_rules(rules, mlp)
    assert specs.layers[0].weight == P("fsdp")
    assert specs.layers[2].weight == P(None, "fsdp")
    assert specs.layers[1].bias == P()
    # The activation functions are pytree leaves too: replicated, not an error.
    assert specs.activation == P()
    assert specs.final_activation == P()


def test_rules_on_an_optax_adamw_state():
    p = jax.tree.map(jnp.asarray, params())
    opt = optax.adamw(1e-3, mask=get_weight_decay_mask([r"b$"]))
    state = opt.init(p)
    specs = match_partition_rules(RULES, state)
    adam = specs[0]
    assert adam.count == P()
    assert adam.mu == match_partition_rules(RULES, p)
    assert adam.nu["layers"][0]["w"] == P("fsdp", "tp")


def test_unmatched_leaf_names_its_path():
    message = r"No partition rule matches the leaf at 'head/w' \(shape \(8, 16\)\)"
    with pytest.raises(ValueError, match=message):
        match_partition_rules(RULES[:2] + RULES[3:], params())


def test_spec_longer_than_the_leaf_is_an_error():
    message = r"gives \w+\('fsdp', 'tp'\) to 'layers/0/b'.*shape \(8,\)"
    with pytest.raises(ValueError, match=message):
        match_partition_rules(((r"layers", P("fsdp", "tp")), (".*", P())), params())


@pytest.mark.parametrize(
    "rules, error, message",
    [
        ([("w", P(), "extra")], TypeError, r"must be a \(regex, PartitionSpec\) pair"),
        ([("w", ("fsdp",))], TypeError, r"maps to \('fsdp',\), expected a .*PartitionSpec"),
        ([("w[", P())], ValueError, r"'w\[' is not a valid regular expression"),
    ],
)
def test_bad_rules(rules, error, message):
    with pytest.raises(error, match=message):
        match_partition_rules(rules, params())


# make_shard_and_gather_fns -------------------------------------------------------


def plain_mesh():
    return Mesh(np.asarray(jax.devices()).reshape(2, 4), ("tp", "fsdp"))


@pytest.mark.parametrize(
    "make_mesh",
    [
        plain_mesh,
        lambda: jax.make_mesh((2, 4), ("tp", "fsdp")),  # Explicit axes
        lambda: create_mesh((1, -1, 2, 1)),
    ],
)
def test_shard_then_gather_round_trip(make_mesh):
    mesh = make_mesh()
    host = params()
    specs = match_partition_rules(RULES, host)
    shard_fns, gather_fns = make_shard_and_gather_fns(specs)
    with jax.set_mesh(mesh):
        sharded = tree_apply(shard_fns, host)
    assert sharded["layers"][0]["w"].sharding == NamedSharding(mesh, P("fsdp", "tp"))
    assert sharded["embed"]["table"].sharding.spec == P("tp", "fsdp")
    assert sharded["head"]["w"].sharding.spec == P(None, "fsdp")
    assert sharded["step"].sharding.spec == P()
    # Each device holds only its block: 8x8 split 4 ways, then 2 ways.
    assert sharded["layers"][0]["w"].addressable_shards[0].data.shape == (2, 4)

    gathered = tree_apply(gather_fns, sharded)
    for got, want in zip(jax.tree.leaves(gathered), jax.tree.leaves(host)):
        assert isinstance(got, np.ndarray)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, "bf16", np.dtype("bfloat16")])
def test_single_dtype_casts_only_floating_leaves(dtype):
    host = {"w": np.ones((8, 4), np.float32), "ids": np.arange(8, dtype=np.int32)}
    specs = {"w": P("fsdp"), "ids": P("fsdp")}
    shard_fns, gather_fns = make_shard_and_gather_fns(specs, dtype, mesh=plain_mesh())
    sharded = tree_apply(shard_fns, host)
    assert sharded["w"].dtype == jnp.bfloat16
    assert sharded["ids"].dtype == jnp.int32
    gathered = tree_apply(gather_fns, sharded)
    assert gathered["w"].dtype == jnp.bfloat16 and gathered["ids"].dtype == np.int32


def test_dtype_pytree_per_leaf_with_none_and_shape_structs():
    host = {"a": np.ones(8, np.float32), "b": np.ones(8, np.float32), "c": np.ones(8, np.float16)}
    specs = {"a": P("fsdp"), "b": P(), "c": P()}
    dtypes = {"a": jnp.bfloat16, "b": None, "c": jax.ShapeDtypeStruct((8,), jnp.float32)}
    shard_fns, gather_fns = make_shard_and_gather_fns(specs, dtypes)
    with jax.set_mesh(plain_mesh()):
        sharded = tree_apply(shard_fns, host)
    assert {k: v.dtype for k, v in sharded.items()} == {"a": jnp.bfloat16, "b": jnp.float32, "c": jnp.float32}


def test_gather_applies_the_dtype_on_the_host():
    _, gather_fns = make_shard_and_gather_fns(P("fsdp"), jnp.float32)
    with jax.set_mesh(plain_mesh()):
        x = jax.device_put(jnp.ones((8, 2), jnp.bfloat16), NamedSharding(plain_mesh(), P("fsdp")))
    out = gather_fns(x)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (8, 2)


def test_non_array_leaves_pass_through_an_equinox_module():
    mlp = eqx.nn.MLP(4, 2, 8, depth=1, key=jax.random.key(0))
    specs = match_partition_rules(((r"weight$", P(None, "fsdp")), (r"bias$", P())), mlp)
    shard_fns, gather_fns = make_shard_and_gather_fns(specs, "bf16")
    with jax.set_mesh(plain_mesh()):
        sharded = tree_apply(shard_fns, mlp)
    assert sharded.layers[0].weight.sharding.spec == P(None, "fsdp")
    assert sharded.layers[0].weight.dtype == jnp.bfloat16
    assert sharded.activation is mlp.activation
    assert tree_apply(gather_fns, sharded).final_activation is mlp.final_activation


def test_shard_without_a_mesh_is_a_clear_error():
    shard_fns, _ = make_shard_and_gather_fns({"w": P("fsdp")})
    with pytest.raises(RuntimeError, match=r"no mesh is active.*jax.set_mesh"):
        tree_apply(shard_fns, {"w": np.ones((8,))})


def test_dtype_tree_with_another_structure_is_rejected():
    with pytest.raises(ValueError, match="the structures differ"):
        make_shard_and_gather_fns({"w": P(), "b": P()}, {"w": jnp.float32})


@pytest.mark.parametrize(
    "dtypes, error, message",
    [
        (jnp.int32, TypeError, r"dtype_specs is int32, expected a floating dtype"),
        ({"w": jnp.int8}, TypeError, r"dtype_specs at 'w' is int8"),
        ("bf17", ValueError, r"Unknown dtype: 'bf17' in dtype_specs"),
    ],
)
def test_bad_dtypes(dtypes, error, message):
    with pytest.raises(error, match=message):
        make_shard_and_gather_fns({"w": P()}, dtypes)


def test_partition_specs_must_hold_specs():
    with pytest.raises(TypeError, match=r"leaf at 'w' is 'fsdp', expected a .*PartitionSpec"):
        make_shard_and_gather_fns({"w": "fsdp"})


# Two processes: the multi-host paths of the shard and gather functions ------------

_TWO_PROCESS_SCRIPT = """
import sys
import jax

jax.distributed.initialize(
    f"localhost:{sys.argv[1]}", num_processes=2, process_id=int(sys.argv[2])
)

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxamp.sharding import create_mesh, make_shard_and_gather_fns, tree_apply

mesh = create_mesh((2, -1), ("dp", "fsdp"))
host = {"w": np.arange(64, dtype=np.float32).reshape(16, 4), "n": np.arange(8, dtype=np.int32)}
shard_fns, gather_fns = make_shard_and_gather_fns({"w": P("fsdp", "dp"), "n": P("fsdp")}, "bf16")
with jax.set_mesh(mesh):
    sharded = tree_apply(shard_fns, host)
assert not sharded["w"].is_fully_addressable
assert sharded["w"].sharding.spec == P("fsdp", "dp") and sharded["w"].dtype == jnp.bfloat16
gathered = tree_apply(gather_fns, sharded)
np.testing.assert_array_equal(gathered["w"].astype(np.float32), host["w"])
np.testing.assert_array_equal(gathered["n"], host["n"])
jax.distributed.shutdown()
print("OK", jax.process_count())
"""


REPO_ROOT = Path(__file__).resolve().parents[1]


def test_shard_and_gather_across_two_processes(tmp_path):
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    script = tmp_path / "two_process.py"
    script.write_text(_TWO_PROCESS_SCRIPT)
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
        PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(port), str(pid)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in range(2)
    ]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-3000:]
        assert "OK 2" in out
