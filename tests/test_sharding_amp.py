"""amp on sharded programs: an FSDP train step on 8 devices against one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp.sharding import (
    create_mesh,
    make_shard_and_gather_fns,
    match_partition_rules,
    tree_apply,
    with_sharding_constraint,
)

from jaxpr_walk import assert_all_matmuls_in, iter_eqns

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals

RULES = ((r"w$", P("fsdp", None)), (r".*", P()))
D, BATCH = 64, 32


def _params():
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    return {f"l{i}": {"w": jax.random.normal(k, (D, D)) / 8, "b": jnp.zeros(D)} for i, k in enumerate(keys)}


def _loss(params, x, y):
    h = x
    for layer in params.values():
        h = jnp.tanh(h @ layer["w"] + layer["b"])
        h = with_sharding_constraint(h, P("fsdp", None))
    return jnp.mean((h - y) ** 2)


def _make_step(optimizer):
    grad_fn = jaxamp.dynamic_scale_value_and_grad(jaxamp.amp(_loss, compute_dtype="bf16"), filter=False)

    def step(params, opt_state, scaler, x, y):
        scaler, (loss, grads) = grad_fn(params, x, y, dynamic_scaler_state=scaler)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, scaler, loss, grads

    return step


def test_fsdp_step_with_amp_and_loss_scaling_matches_one_device():
    optimizer = optax.adam(1e-2)
    params = _params()
    x = jax.random.normal(jax.random.PRNGKey(1), (BATCH, D))
    y = jax.random.normal(jax.random.PRNGKey(2), (BATCH, D))
    step = _make_step(optimizer)

    # Single device reference (no mesh: the sharding constraint is a no-op).
    single = (params, optimizer.init(params), jaxamp.DynamicScalerState())
    single_out = jax.jit(step)(*single, x, y)

    mesh = create_mesh((1, 8, 1, 1))
    with jax.set_mesh(mesh):
        specs = match_partition_rules(RULES, params)
        shard_fns, _ = make_shard_and_gather_fns(specs)
        sharded_params = tree_apply(shard_fns, params)
        opt_state = optimizer.init(sharded_params)
        batch = NamedSharding(mesh, P("fsdp", None))
        xs, ys = jax.device_put(x, batch), jax.device_put(y, batch)
        param_shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
        sharded_step = jax.jit(step, out_shardings=(param_shardings, None, None, None, param_shardings))
        new_params, _, scaler, loss, grads = sharded_step(
            sharded_params, opt_state, jaxamp.DynamicScalerState(), xs, ys
        )
        jaxpr = jax.make_jaxpr(step)(sharded_params, opt_state, jaxamp.DynamicScalerState(), xs, ys)

    # bf16 tolerance: 8 mantissa bits, a few layers deep.
    np.testing.assert_allclose(loss, single_out[3], rtol=2e-2)
    for g, g1 in zip(jax.tree.leaves(grads), jax.tree.leaves(single_out[4])):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(g, g1, rtol=5e-2, atol=5e-3)
    # Gradients and updated parameters sharded like the parameters.
    for g, p, spec in zip(jax.tree.leaves(grads), jax.tree.leaves(new_params), jax.tree.leaves(specs)):
        assert g.sharding.spec == spec and p.sharding.spec == spec
    assert int(scaler.count) == 1
    assert_all_matmuls_in(jaxpr, jnp.bfloat16, at_least=8)  # 3 forward, 3 weight and 2 input grads
    constraints = [e for e in iter_eqns(jaxpr) if e.primitive.name == "sharding_constraint"]
    assert len(constraints) >= 3


@pytest.mark.parametrize("explicit", [False, True], ids=["Mesh", "make_mesh-explicit"])
@pytest.mark.newest_only
def test_jit_shardings_survive_amp(explicit):
    mesh = jax.make_mesh((8,), ("d",)) if explicit else create_mesh((8,), ("d",))
    sharding = NamedSharding(mesh, P("d", None))
    f = jax.jit(lambda w, x: jnp.tanh(x @ w), in_shardings=(None, sharding), out_shardings=sharding)
    x = jax.device_put(jnp.ones((16, 8)), sharding)
    w = jnp.ones((8, 8)) / 8
    with jax.set_mesh(mesh):
        out = jax.jit(jaxamp.amp(f, compute_dtype="bf16"))(w, x)
    assert out.sharding.is_equivalent_to(sharding, out.ndim) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, f(w, x), rtol=1e-2)
