"""Mesh construction, "the current mesh", and constraints that depend on it."""

import contextlib
import warnings
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxamp.sharding import (
    create_mesh,
    get_jax_mesh,
    get_names_from_partition_spec,
    make_shard_and_gather_fns,
    names_in_current_mesh,
    tree_apply,
    with_sharding_constraint,
)

NAMES = ("dp", "fsdp", "tp", "sp")


def test_eight_host_devices():
    assert jax.device_count() == 8


@contextlib.contextmanager
def legacy_mesh(mesh):
    """Enter `mesh` with the deprecated ``with mesh:``; skip where JAX dropped it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            mesh.__enter__()
        except (RuntimeError, AttributeError) as e:
            pytest.skip(f"`with mesh:` is unavailable in this JAX: {e}")
    try:
        yield mesh
    finally:
        mesh.__exit__(None, None, None)


def plain_mesh(shape=(2, 4), names=("dp", "fsdp")):
    return Mesh(np.asarray(jax.devices()).reshape(shape), names)


def explicit_mesh(shape=(2, 4), names=("dp", "fsdp")):
    # jax.make_mesh's own default: Explicit axes in current JAX.
    return jax.make_mesh(shape, names)


# create_mesh ---------------------------------------------------------------------


def test_create_mesh_default_puts_all_devices_on_fsdp():
    mesh = create_mesh()
    assert dict(mesh.shape) == {"dp": 1, "fsdp": 8, "tp": 1, "sp": 1}
    assert mesh.axis_names == NAMES
    assert set(mesh.devices.flat) == set(jax.devices())
    assert all(t == AxisType.Auto for t in mesh.axis_types)


@pytest.mark.parametrize(
    "dims, expected",
    [((2, -1, 1, 1), (2, 4, 1, 1)), ((1, 2, -1, 2), (1, 2, 2, 2)), ((2, 2, 2, 1), (2, 2, 2, 1))],
)
def test_create_mesh_fills_the_minus_one(dims, expected):
    assert create_mesh(dims).devices.shape == expected


def test_create_mesh_custom_names_and_backend():
    mesh = create_mesh((4, 2), ("x", "y"), backend="cpu")
    assert dict(mesh.shape) == {"x": 4, "y": 2}


@pytest.mark.parametrize(
    "dims, names, message",
    [
        ((1, -1, 1), NAMES, r"has 3 entries but axis_names .* has 4"),
        ((-1, -1, 1, 1), NAMES, r"At most one mesh axis size may be -1, got \(-1, -1, 1, 1\)"),
        ((3, -1, 1, 1), NAMES, r"multiply to 3, which does not divide the device count 8"),
        ((2, 2, 1, 1), NAMES, r"Mesh shape \(2, 2, 1, 1\) needs 4 devices but there are 8"),
        ((0, -1, 1, 1), NAMES, r"positive or -1 .* got 0"),
        ((2.0, -1, 1, 1), NAMES, r"must be integers, got 2.0"),
        ((2, -1), ("dp", "dp"), r"must be unique.*repeated: \['dp'\]"),
    ],
)
def test_create_mesh_rejects_bad_shapes(dims, names, message):
    with pytest.raises(ValueError, match=message):
        create_mesh(dims, names)


def test_create_mesh_rejects_a_string_of_names():
    with pytest.raises(TypeError, match="sequence of names"):
        create_mesh((-1,), "dp")


# get_jax_mesh --------------------------------------------------------------------


def test_get_jax_mesh_positional():
    mesh = get_jax_mesh("1,-1,1,1", NAMES)
    assert dict(mesh.shape) == {"dp": 1, "fsdp": 8, "tp": 1, "sp": 1}


def test_get_jax_mesh_named_fills_unmentioned_axes_with_one_in_names_order():
    mesh = get_jax_mesh(" tp:4 , dp:2 ", NAMES)
    assert mesh.axis_names == NAMES
    assert dict(mesh.shape) == {"dp": 2, "fsdp": 1, "tp": 4, "sp": 1}
    assert dict(get_jax_mesh("dp:2,fsdp:-1", NAMES).shape)["fsdp"] == 4


def test_get_jax_mesh_bang_keeps_device_order():
    mesh = get_jax_mesh("!2,4", ("x", "y"))
    assert list(mesh.devices.flat) == jax.devices()
    assert dict(mesh.shape) == {"x": 2, "y": 4}


@pytest.mark.parametrize(
    "spec, message",
    [
        ("dp:2,xx:4", r"names axis 'xx', which is not one of the mesh axis names"),
        ("dp:2,dp:4", r"gives axis 'dp' more than once"),
        ("dp:2,4,1,1", r"mixes positional sizes and name:size pairs"),
        ("1,-1", r"has 2 entries but axis_names .* has 4"),
        ("1,a,1,1", r"Cannot parse 'a' in axis_dims '1,a,1,1' as an integer"),
        ("", r"Cannot parse axis_dims ''"),
        ("1,,1,1", r"Cannot parse axis_dims '1,,1,1'"),
        ("3,-1,1,1", r"does not divide the device count 8"),
    ],
)
def test_get_jax_mesh_rejects_bad_strings(spec, message):
    with pytest.raises(ValueError, match=message):
        get_jax_mesh(spec, NAMES)


def test_get_jax_mesh_wants_a_string():
    with pytest.raises(TypeError, match="use create_mesh"):
        get_jax_mesh((1, -1, 1, 1), NAMES)


# names_in_current_mesh -----------------------------------------------------------


def test_names_without_a_mesh():
    assert not names_in_current_mesh("dp")
    assert names_in_current_mesh()


@pytest.mark.parametrize("make", [plain_mesh, explicit_mesh, lambda: create_mesh((2, -1, 1, 1))])
def test_names_under_set_mesh_outside_and_inside_jit(make):
    seen = {}

    @jax.jit
    def f(x):
        seen["jit"] = names_in_current_mesh("dp", "fsdp"), names_in_current_mesh("model")
        return x

    with jax.set_mesh(make()):
        assert names_in_current_mesh("dp", "fsdp")
        assert not names_in_current_mesh("dp", "model")
        f(jnp.ones(8))
    assert seen["jit"] == (True, False)
    assert not names_in_current_mesh("dp")


def test_names_under_legacy_with_mesh():
    with legacy_mesh(plain_mesh()):
        assert names_in_current_mesh("dp", "fsdp")
        assert jax.jit(lambda x: x + names_in_current_mesh("fsdp"))(0) == 1
    assert not names_in_current_mesh("dp")


def test_names_must_be_separate_strings():
    with pytest.raises(TypeError, match=r"names_in_current_mesh\(\*names\)"):
        names_in_current_mesh(("dp", "fsdp"))


# get_names_from_partition_spec ---------------------------------------------------


def test_names_from_one_spec_in_first_appearance_order():
    spec = P(("tp", "dp"), None, "fsdp", "dp")
    assert get_names_from_partition_spec(spec) == ["tp", "dp", "fsdp"]
    assert get_names_from_partition_spec(P()) == []
    assert get_names_from_partition_spec(P(P.UNCONSTRAINED, "sp")) == ["sp"]


def test_names_from_containers_and_pytrees():
    specs = {"a": P("dp"), "b": [P(None, "tp"), None, (P("sp"),)], "c": "fsdp"}
    assert get_names_from_partition_spec(specs) == ["dp", "tp", "sp", "fsdp"]

    @jax.tree_util.register_dataclass
    @dataclass
    class Holder:
        w: P
        b: P

    assert get_names_from_partition_spec(Holder(P("fsdp", "tp"), P("tp"))) == ["fsdp", "tp"]


def test_names_from_garbage_is_a_type_error():
    with pytest.raises(TypeError, match="got 3 of type int"):
        get_names_from_partition_spec([P("dp"), 3])


# with_sharding_constraint --------------------------------------------------------


def test_constraint_without_a_mesh_returns_x_itself():
    x = jnp.ones((8, 4))
    assert with_sharding_constraint(x, P("fsdp")) is x
    assert jax.jit(lambda y: with_sharding_constraint(y, P("fsdp")))(x).shape == (8, 4)


def test_constraint_on_missing_axis_is_skipped():
    x = jnp.ones((8, 4))
    with jax.set_mesh(create_mesh((1, -1, 1, 1))):
        assert with_sharding_constraint(x, P("model")) is x
        out = jax.jit(lambda y: with_sharding_constraint(y * 2, P("model")))(x)
    np.testing.assert_allclose(out, 2 * np.ones((8, 4)))


@pytest.mark.parametrize("make", [plain_mesh, explicit_mesh])
def test_constraint_applies_in_and_out_of_jit(make):
    mesh = make()
    x = jnp.arange(64.0).reshape(8, 8)
    with jax.set_mesh(mesh):
        eager = with_sharding_constraint(x, P("fsdp", "dp"))
        traced = jax.jit(lambda y: with_sharding_constraint(y * 1.0, P("dp", "fsdp")))(x)
    assert eager.sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp", "dp")), 2)
    assert traced.sharding.is_equivalent_to(NamedSharding(mesh, P("dp", "fsdp")), 2)
    np.testing.assert_array_equal(traced, x)


def test_constraint_under_legacy_with_mesh():
    mesh = plain_mesh()
    with legacy_mesh(mesh):
        out = jax.jit(lambda y: with_sharding_constraint(y + 1, P("fsdp")))(jnp.zeros((8, 2)))
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp")), 2)


def test_constraint_on_a_pytree_with_a_spec_prefix():
    mesh = plain_mesh()
    tree = {"a": jnp.ones((8, 2)), "b": jnp.ones((4,))}
    with jax.set_mesh(mesh):
        out = jax.jit(lambda t: with_sharding_constraint(t, {"a": P("fsdp"), "b": P("fsdp")}))(tree)
    assert out["a"].sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp")), 2)
    assert out["b"].sharding.is_equivalent_to(NamedSharding(mesh, P("fsdp")), 1)


def test_constraint_on_manual_axes_inside_shard_map_is_skipped():
    mesh = plain_mesh()

    def body(block):
        return with_sharding_constraint(block * 2, P("fsdp"))

    with jax.set_mesh(mesh):
        out = jax.jit(jax.shard_map(body, in_specs=P("fsdp"), out_specs=P("fsdp")))(jnp.ones((8, 2)))
    np.testing.assert_array_equal(out, 2 * np.ones((8, 2)))


def test_constraint_rejects_non_spec_leaves():
    with jax.set_mesh(plain_mesh()):
        with pytest.raises(TypeError, match="expects PartitionSpec leaves, got 'fsdp'"):
            with_sharding_constraint(jnp.ones((8,)), ("fsdp",))


# Shard functions find the legacy mesh too ---------------------------------------


def test_shard_fns_use_the_legacy_mesh():
    mesh = plain_mesh()
    shard_fns, _ = make_shard_and_gather_fns({"w": P("fsdp")})
    with legacy_mesh(mesh):
        out = tree_apply(shard_fns, {"w": np.ones((8, 2), np.float32)})
    assert out["w"].sharding == NamedSharding(mesh, P("fsdp"))
