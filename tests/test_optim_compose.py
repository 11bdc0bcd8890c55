"""jaxamp.optim with amp, skipped steps and loss scalers, sharding and checkpoints."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp.optim import cast_state, low_precision_params
from jaxamp.sharding import create_mesh

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
D = 16


def _optimizer(rounding):
    """AdamW with bf16 parameters (`rounding`) and bf16 state (stochastic)."""
    keys = jax.random.split(jax.random.key(0))
    inner = cast_state(optax.adamw(1e-2), rounding="stochastic", key=keys[0])
    return low_precision_params(inner, rounding=rounding, key=keys[1] if rounding == "stochastic" else None)


def _params():
    k1, k2 = jax.random.split(jax.random.key(1))
    return {
        "w": (jax.random.normal(k1, (D, D)) / 4).astype(jnp.bfloat16),
        "b": jnp.zeros(D, jnp.bfloat16),
        "scale": jnp.ones(D),  # a float32 leaf among them
    }


def _batch(i):
    k1, k2 = jax.random.split(jax.random.fold_in(jax.random.key(2), i))
    return jax.random.normal(k1, (32, D)), jax.random.normal(k2, (32, D))


def _loss(params, x, y, poisoned=False):
    h = jnp.tanh(x @ params["w"] + params["b"]) * params["scale"]
    # A NaN factor (not jnp.where, whose gradient would mask it) poisons the gradients.
    return jnp.mean((h.astype(jnp.float32) - y) ** 2) * jnp.where(poisoned, jnp.nan, 1.0)


def _bits(tree):
    def raw(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x).tobytes()

    return [raw(leaf) for leaf in jax.tree.leaves(tree)]


ROUNDINGS = ["stochastic", "kahan"]


# --- amp ------------------------------------------------------------------------


_amp_loss = jax.jit(jaxamp.amp(_loss, compute_dtype="bf16"))
_amp_grad = jax.jit(jax.grad(jaxamp.amp(_loss, compute_dtype="bf16")))


@pytest.mark.parametrize("rounding", ROUNDINGS + ["nearest"])
def test_amp_gradients_in_bf16_or_float32_give_the_same_step(rounding):
    optimizer = _optimizer(rounding)
    params = _params()
    grads = _amp_grad(params, *_batch(0))
    assert grads["w"].dtype == BF16 and grads["scale"].dtype == F32  # each leaf's own dtype
    grads32 = jax.tree.map(lambda g: g.astype(F32), grads)  # as from a float32 master copy
    update = jax.jit(optimizer.update)
    state = optimizer.init(params)
    from_bf16, state_bf16 = update(grads, state, params)
    from_f32, state_f32 = update(grads32, state, params)
    assert _bits(from_bf16) == _bits(from_f32) and _bits(state_bf16) == _bits(state_f32)
    new = optax.apply_updates(params, from_bf16)
    assert new["w"].dtype == BF16 and new["scale"].dtype == F32
    assert float(_amp_loss(new, *_batch(0))) < float(_amp_loss(params, *_batch(0)))


# --- skipped steps: parameters, compensation buffer and key untouched -----------


def _skipping_step(optimizer):
    grad_fn = jax.grad(_loss)
    wrapped = jaxamp.scaling.skip_nonfinite_updates(optimizer)

    def step(carry, x, y, poisoned):
        params, state = carry
        updates, state = wrapped.update(grad_fn(params, x, y, poisoned), state, params)
        return jaxamp.scaling.apply_if_finite_updates(params, updates, state.last_finite), state

    def init(params):
        return params, wrapped.init(params)

    def inner(carry):
        return carry[1].inner_state

    return init, step, inner


def _dynamic_scaler_step(optimizer):
    grad_fn = jaxamp.dynamic_scale_grad(_loss, filter=False)
    wrapped = jaxamp.scaling.skip_nonfinite_updates(optimizer)

    def step(carry, x, y, poisoned):
        params, state, scaler = carry
        scaler, grads = grad_fn(params, x, y, poisoned, dynamic_scaler_state=scaler)
        updates, state = wrapped.update(grads, state, params)
        return jaxamp.scaling.apply_if_finite_updates(params, updates, state.last_finite), state, scaler

    def init(params):
        return params, wrapped.init(params), jaxamp.DynamicScalerState(scaler=2.0**10)

    return init, step, lambda carry: carry[1].inner_state


def _grad_scaler_step(optimizer):
    def step(carry, x, y, poisoned):
        params, state, scaler = carry
        grads = jax.grad(lambda p: scaler.scale(_loss(p, x, y, poisoned)))(params)
        params, state, scaler = scaler.step(optimizer, grads, state, params)
        return params, state, scaler.update()

    def init(params):
        return params, optimizer.init(params), jaxamp.GradScaler(init_scale=2.0**10)

    return init, step, lambda carry: carry[1]


def _jmp_loss_scale_step(optimizer):
    def step(carry, x, y, poisoned):
        params, state, loss_scale = carry
        grads = jax.grad(lambda p: loss_scale.scale(_loss(p, x, y, poisoned)))(params)
        grads = loss_scale.unscale(grads)
        finite = jaxamp.all_finite(grads)
        updates, new_state = optimizer.update(grads, state, params)
        params = jaxamp.select_tree(finite, optax.apply_updates(params, updates), params)
        state = jaxamp.select_tree(finite, new_state, state)
        return params, state, loss_scale.adjust(finite)

    def init(params):
        return params, optimizer.init(params), jaxamp.DynamicLossScale(jnp.float32(2.0**10))

    return init, step, lambda carry: carry[1]


SCALERS = {
    "skip_nonfinite_updates": _skipping_step,
    "DynamicScalerState": _dynamic_scaler_step,
    "GradScaler": _grad_scaler_step,
    "DynamicLossScale": _jmp_loss_scale_step,
}


# Every scaler with stochastic rounding (the key must not move), and the Kahan
# buffer under the plain skip.
@pytest.mark.parametrize(
    "scaler, rounding", [(s, "stochastic") for s in SCALERS] + [("skip_nonfinite_updates", "kahan")]
)
def test_a_skipped_step_changes_nothing(scaler, rounding):
    init, step, inner_state = SCALERS[scaler](_optimizer(rounding))
    step = jax.jit(step)

    def run(poisoned_steps):
        carry, clean_steps = init(_params()), 0
        for poisoned in poisoned_steps:
            before = carry
            carry = step(carry, *_batch(clean_steps), jnp.array(poisoned))
            clean_steps += not poisoned
            if poisoned:
                assert _bits(carry[0]) == _bits(before[0])  # parameters, bit for bit
                # Compensation buffer, PRNG key and moments, bit for bit.
                assert _bits(inner_state(carry)) == _bits(inner_state(before))
        return carry

    skipped, clean = run([False, True, False]), run([False, False])
    # The skipped step used none of the key's draws: the next step is the same.
    assert _bits(skipped[0]) == _bits(clean[0])
    assert _bits(inner_state(skipped)) == _bits(inner_state(clean))


# --- sharding --------------------------------------------------------------------


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_state_is_sharded_like_the_parameters(rounding):
    optimizer = _optimizer(rounding)
    params = {"w": _params()["w"], "b": _params()["b"]}
    x, y = _batch(0)

    def step(params, state):
        grads = jax.grad(jaxamp.amp(_loss, compute_dtype="bf16"))({**params, "scale": jnp.ones(D)}, x, y)
        grads = {"w": grads["w"], "b": grads["b"]}
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    single = jax.jit(step)(params, optimizer.init(params))

    mesh = create_mesh((1, 8, 1, 1))
    specs = {"w": P("fsdp", None), "b": P()}
    with jax.set_mesh(mesh):
        sharded = jax.tree.map(lambda p, s: jax.device_put(p, NamedSharding(mesh, s)), params, specs)
        state = optimizer.init(sharded)
        new_params, new_state = jax.jit(step)(sharded, state)
    for when, st in (("init", state), ("step", new_state)):
        # Every state array shaped like `w` (moments, buffer) is split like `w`.
        like_w = [leaf for leaf in jax.tree.leaves(st) if leaf.shape == params["w"].shape]
        assert len(like_w) == (3 if rounding == "kahan" else 2), when  # mu, nu (+ buffer)
        for leaf in like_w:
            assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, specs["w"]), 2), when
    assert new_params["w"].sharding.is_equivalent_to(NamedSharding(mesh, specs["w"]), 2)
    # threefry is partitionable: the same random draws as on one device.
    assert _bits((new_params, new_state)) == _bits(single)


# --- checkpoints -------------------------------------------------------------------


@pytest.mark.parametrize("rounding", ROUNDINGS + ["nearest"])
def test_state_survives_a_flatten_unflatten_round_trip(rounding):
    optimizer = _optimizer(rounding)
    update = jax.jit(optimizer.update)
    grad_fn = jax.jit(jax.grad(_loss))

    def train(params, state, steps):
        for i in steps:
            updates, state = update(grad_fn(params, *_batch(i)), state, params)
            params = optax.apply_updates(params, updates)
        return params, state

    params, state = train(_params(), optimizer.init(_params()), range(2))
    # Save: plain numpy arrays (a PRNG key as its raw data) and the tree structure.
    leaves, treedef = jax.tree.flatten(state)
    saved = [np.asarray(jax.random.key_data(x) if _is_key(x) else x) for x in leaves]
    restored = treedef.unflatten(
        [jax.random.wrap_key_data(s) if _is_key(x) else jnp.asarray(s) for s, x in zip(saved, leaves)]
    )
    resumed = train(params, restored, range(2, 4))
    uninterrupted = train(params, state, range(2, 4))
    assert _bits(resumed) == _bits(uninterrupted)


def _is_key(x):
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
