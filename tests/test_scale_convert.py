"""`with_loss_scaling_state` / `without_loss_scaling_state`: a checkpoint crosses loss scaling both ways.

A state saved by a run without loss scaling (plain optax) is restored, wrapped
and trained a step under `jaxamp.loss_scaling`; a loss-scaled one is restored
into the plain run's target after the wrapper is taken out. Also: a flax
``TrainState``, the dict form nnx and MaxText's checkpoints write, abstract
restore targets, ``optax.MultiSteps`` around the wrapper, and errors that name
what they were given.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.training import train_state

import jaxamp
from jaxamp.scaling import with_loss_scaling_state, without_loss_scaling_state


def _params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w": jax.random.normal(k1, (4, 3)), "b": jax.random.normal(k2, (3,))}


def _batch():
    k = jax.random.PRNGKey(1)
    return jax.random.normal(k, (8, 4)), jax.random.normal(jax.random.fold_in(k, 1), (8, 3))


def _loss(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def _trained(opt, steps=2):
    params, state = _params(), opt.init(_params())
    for _ in range(steps):
        scaled = isinstance(state, jaxamp.LossScaleState)
        loss = jaxamp.amp(_loss, compute_dtype="f16", loss_scale=state) if scaled else _loss
        grads = jax.grad(loss)(params, *_batch())
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def _save_and_restore(tmp_path, tree, target):
    path = tmp_path / "checkpoint"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, tree)
        checkpointer.wait_until_finished()
        return checkpointer.restore(path, target)


def _same_structure(a, b):
    return jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)


def _assert_equal(a, b):
    assert _same_structure(a, b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_plain_checkpoint_resumes_under_loss_scaling_and_trains(tmp_path):
    opt = optax.adam(1e-2)
    tx = jaxamp.loss_scaling(opt, scaler=2.0**10)
    params, plain = _trained(opt)
    scaled_target = jax.eval_shape(tx.init, params)
    with pytest.raises((TypeError, ValueError)):  # what the conversion is for
        _save_and_restore(tmp_path / "direct", {"opt_state": plain}, {"opt_state": scaled_target})

    restored = _save_and_restore(tmp_path, plain, without_loss_scaling_state(scaled_target))
    state = with_loss_scaling_state(restored, tx)

    assert isinstance(state, jaxamp.LossScaleState) and _same_structure(state, scaled_target)
    _assert_equal(state.inner_state, plain)  # adam's moments and count, bit for bit
    assert float(state.scale) == 2.0**10 and bool(state.last_finite) and bool(state.step_finite)
    assert int(state.scaler_state.total_resets) == 0

    @jax.jit
    def step(params, state):
        grads = jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=state))(params, *_batch())
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    new_params, new_state = step(params, state)
    assert bool(new_state.last_finite) and int(new_state.inner_state[0].count) == 3
    assert not np.allclose(new_params["w"], params["w"])


def test_a_loss_scaled_checkpoint_resumes_without_loss_scaling(tmp_path):
    opt = optax.adam(1e-2)
    tx = jaxamp.loss_scaling(opt)
    params, scaled = _trained(tx)
    restored = _save_and_restore(tmp_path, without_loss_scaling_state(scaled), jax.eval_shape(opt.init, params))

    _assert_equal(restored, scaled.inner_state)
    updates, state = opt.update(jax.grad(_loss)(params, *_batch()), restored, params)
    assert int(state[0].count) == 3


def test_the_round_trip_gives_back_the_state_and_a_fresh_scale():
    opt = optax.adamw(1e-3)
    tx = jaxamp.loss_scaling(opt, scaler=2.0**12, patience=7)
    _, scaled = _trained(tx)
    again = with_loss_scaling_state(without_loss_scaling_state(scaled), tx)
    _assert_equal(again.inner_state, scaled.inner_state)
    _assert_equal(again.scaler_state, jax.device_get(tx.init(_params()).scaler_state))
    assert int(again.scaler_state.patience) == 7


def test_a_flax_train_state_is_converted_at_its_opt_state(tmp_path):
    opt = optax.adam(1e-2)
    tx = jaxamp.loss_scaling(opt)
    plain = train_state.TrainState.create(apply_fn=_loss, params=_params(), tx=opt)
    restored = _save_and_restore(tmp_path, plain, plain)
    scaled = with_loss_scaling_state(restored, tx).replace(tx=tx)
    assert isinstance(scaled.opt_state, jaxamp.LossScaleState)
    assert _same_structure(scaled, train_state.TrainState.create(apply_fn=_loss, params=_params(), tx=tx))

    grads = jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=scaled))(scaled.params, *_batch())
    stepped = scaled.apply_gradients(grads=grads)
    assert int(stepped.step) == 1 and bool(stepped.opt_state.last_finite)

    back = without_loss_scaling_state(stepped).replace(tx=opt)
    assert _same_structure(back, plain)


def test_the_dict_form_of_nnx_and_maxtext_checkpoints():
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    opt = optax.adam(1e-2)
    tx = jaxamp.loss_scaling(opt)
    plain = nnx.to_pure_dict(nnx.state(nnx.Optimizer(model, opt, wrt=nnx.Param)))
    scaled = nnx.to_pure_dict(nnx.state(nnx.Optimizer(model, tx, wrt=nnx.Param)))
    # MaxText's on-disk layout: {"params": ..., "opt_state": ..., "step": ...}.
    converted = with_loss_scaling_state({"model": {"w": 1.0}, "optimizer": plain}, tx)
    assert _same_structure(converted["optimizer"], scaled)
    assert sorted(converted["optimizer"]["opt_state"]) == ["inner_state", "last_finite", "scaler_state", "step_finite"]
    assert float(converted["optimizer"]["opt_state"]["scaler_state"]["scaler"]) == 2.0**15
    _assert_equal(without_loss_scaling_state(converted)["optimizer"], plain)

    # Back into a live nnx.Optimizer.
    live = nnx.Optimizer(model, tx, wrt=nnx.Param)
    nnx.replace_by_pure_dict(nnx.state(live), converted["optimizer"])


def test_abstract_targets_convert_both_ways_and_keep_the_mesh():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    opt = optax.adam(1e-2)
    tx = jaxamp.loss_scaling(opt)
    params = jax.tree_util.tree_map(lambda p: jax.device_put(p, sharded), _params())
    plain = jax.eval_shape(opt.init, params)
    scaled = with_loss_scaling_state(plain, tx)
    assert isinstance(scaled.scale, jax.ShapeDtypeStruct) and scaled.scale.dtype == jnp.float32
    assert _same_structure(scaled, jax.eval_shape(tx.init, params))
    assert _same_structure(without_loss_scaling_state(scaled), plain)

    concrete = with_loss_scaling_state(opt.init(params), tx)
    assert isinstance(concrete.scale.sharding, jax.sharding.NamedSharding)
    assert concrete.scale.sharding.mesh == mesh


def test_the_wrapper_inside_multisteps_goes_at_its_place():
    opt = optax.adam(1e-2)
    tx = optax.MultiSteps(jaxamp.loss_scaling(opt), every_k_schedule=2)
    plain = optax.MultiSteps(opt, every_k_schedule=2).init(_params())
    state = with_loss_scaling_state(plain, tx)
    assert isinstance(state.inner_opt_state, jaxamp.LossScaleState)
    assert _same_structure(state, tx.init(_params()))
    assert _same_structure(without_loss_scaling_state(state), plain)


def test_errors_name_what_they_were_given():
    opt = optax.adam(1e-2)
    tx = jaxamp.loss_scaling(opt)
    plain = opt.init(_params())
    with pytest.raises(ValueError, match="holds no jaxamp.LossScaleState.*got tuple"):
        without_loss_scaling_state(plain)
    with pytest.raises(ValueError, match="already holds a jaxamp.LossScaleState.*got LossScaleState"):
        with_loss_scaling_state(tx.init(_params()), tx)
    with pytest.raises(TypeError, match="exactly one jaxamp.loss_scaling.*holds 0"):
        with_loss_scaling_state(plain, opt)
    with pytest.raises(TypeError, match="tx must be the jaxamp.loss_scaling.*got str 'adam'"):
        with_loss_scaling_state(plain, "adam")
    with pytest.raises(ValueError, match=r"2 opt_state entries \(\['a'\]\['opt_state'\], \['b'\]\['opt_state'\]\)"):
        with_loss_scaling_state({"a": {"opt_state": plain}, "b": {"opt_state": plain}}, tx)
    multi = optax.MultiSteps(jaxamp.loss_scaling(opt), every_k_schedule=2)
    with pytest.raises(ValueError, match=r"\.inner_opt_state of its state, which this optimizer state lacks"):
        with_loss_scaling_state(plain, multi)


def _checkpoint_of(written):
    """A restore function over one written tree that, as Orbax does, refuses a target of another structure."""

    def load_state(step, target, verbose=False):
        if not _same_structure(target, written):
            raise ValueError("restore target does not match the checkpoint's tree structure")
        # What a framework's restore returns: the state, and something beside it.
        return {"items": written}, None

    return load_state


def test_restore_across_loss_scaling_converts_either_way_and_resumes_its_own(caplog):
    opt = optax.adam(1e-2)
    tx = jaxamp.loss_scaling(opt, scaler=2.0**10)
    _, plain = _trained(opt)
    _, scaled = _trained(tx)
    plain_target = {"params": _params(), "opt_state": jax.eval_shape(opt.init, _params())}
    scaled_target = {"params": _params(), "opt_state": jax.eval_shape(tx.init, _params())}

    load_plain = jaxamp.scaling.restore_across_loss_scaling(
        _checkpoint_of({"params": _params(), "opt_state": plain}), tx
    )
    with caplog.at_level("WARNING", logger="jaxamp"):
        (restored, beside) = load_plain(7, target=scaled_target)
    assert beside is None and "written without loss scaling" in caplog.text
    state = restored["items"]["opt_state"]
    assert isinstance(state, jaxamp.LossScaleState) and float(state.scale) == 2.0**10
    _assert_equal(state.inner_state, plain)

    load_scaled = _checkpoint_of({"params": _params(), "opt_state": scaled})
    caplog.clear()
    with caplog.at_level("WARNING", logger="jaxamp"):
        (own, _) = jaxamp.scaling.restore_across_loss_scaling(load_scaled, tx)(7, scaled_target)
        (back, _) = jaxamp.scaling.restore_across_loss_scaling(load_scaled)(7, plain_target)
    _assert_equal(own["items"]["opt_state"], scaled)  # as written: the scale it had, not tx's initial one
    _assert_equal(back["items"]["opt_state"], scaled.inner_state)
    assert len(caplog.records) == 1 and "written with loss scaling" in caplog.text
    assert load_plain.__name__ == "load_state"


def test_restore_across_loss_scaling_takes_a_factory_and_says_what_is_wrong():
    opt = optax.adam(1e-2)
    factory = jaxamp.scaling.loss_scaling_factory(lambda: opt, scaler=2.0**9)
    plain = opt.init(_params())
    assert float(with_loss_scaling_state(plain, factory).scale) == 2.0**9
    (restored, _) = jaxamp.scaling.restore_across_loss_scaling(_checkpoint_of({"opt_state": plain}), factory)(
        0, {"opt_state": jax.eval_shape(factory().init, _params())}
    )
    assert float(restored["items"]["opt_state"].scale) == 2.0**9

    scaled_target = {"opt_state": jax.eval_shape(factory().init, _params())}
    with pytest.raises(TypeError, match="target holds jaxamp.loss_scaling's state.*pass the run's transformation"):
        jaxamp.scaling.restore_across_loss_scaling(_checkpoint_of({"opt_state": plain}))(0, scaled_target)
    with pytest.raises(TypeError, match=r"called with 2 arguments holding an optimizer state \(step, target\)"):
        jaxamp.scaling.restore_across_loss_scaling(_checkpoint_of({"opt_state": plain}))(
            {"opt_state": plain}, {"opt_state": plain}
        )
    # Nothing to convert (parameters alone): passed through, its error as it is.
    with pytest.raises(ValueError, match="does not match"):
        jaxamp.scaling.restore_across_loss_scaling(_checkpoint_of({"opt_state": plain}))(0, {"w": 1.0})
    with pytest.raises(TypeError, match="expects the function that restores a checkpoint, got str"):
        jaxamp.scaling.restore_across_loss_scaling("restore")
    # Neither form fits (another optimizer's checkpoint): the first error, as the restore raised it.
    sgd_state = optax.sgd(1e-2, momentum=0.9).init(_params())
    with pytest.raises(ValueError, match="does not match the checkpoint"):
        jaxamp.scaling.restore_across_loss_scaling(_checkpoint_of({"opt_state": sgd_state}), factory)(0, scaled_target)


def test_an_equinox_training_state_with_its_own_init_is_converted_at_its_opt_state():
    class TrainerState(eqx.Module):  # as Levanter's: fields its __init__ does not take as given
        step: jax.Array
        opt_state: object
        optimizer: object = eqx.field(static=True)

        def __init__(self, opt_state, optimizer, step=0):
            self.step, self.opt_state, self.optimizer = jnp.asarray(step), opt_state, optimizer

    opt = optax.adam(1e-2)
    tx = jaxamp.loss_scaling(opt)
    plain = TrainerState(opt.init(_params()), opt, step=3)
    scaled = with_loss_scaling_state(plain, tx)
    assert isinstance(scaled.opt_state, jaxamp.LossScaleState) and int(scaled.step) == 3
    _assert_equal(scaled.opt_state.inner_state, plain.opt_state)
    assert _same_structure(without_loss_scaling_state(scaled), plain)
