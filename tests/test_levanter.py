"""`loss_scaling`'s state in Levanter's checkpoints, and Levanter's loop in float16.

Levanter's checkpointer names a file per leaf with `levanter.utils.jax_utils.leaf_key_paths`,
which recognises a NamedTuple by ``type(x).__bases__ == (tuple,)`` and rebuilds it
as ``type(x)(**{field: name})``; anything else that is a tuple becomes a plain
tuple of names. A `DynamicScalerState` that subclassed a NamedTuple became such a
tuple, which `jax.tree.map` then refused against the state ("pytree structure
error"): every Levanter run with `loss_scaling` stopped at its first save. The first tests copy that mechanism in plain JAX and run everywhere;
the others run Levanter itself where it is installed (a pre-release:
``pip install --pre levanter`` with ``jax==0.10.2``).
"""

from __future__ import annotations

import io
import json
import logging
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

from example_scripts import load_example


def _trained_state() -> tuple[Any, Any]:
    """`loss_scaling`'s state after a skipped and a finite step, so no field holds its default."""
    opt = jaxamp.loss_scaling(optax.adam(1e-2), scaler=2.0**10, patience=50)
    params = {"w": jnp.arange(3.0), "b": jnp.float32(0.5)}
    state = opt.init(params)
    for g in (jnp.float32(jnp.inf), jnp.float32(1.0)):
        _, state = opt.update({"w": jnp.full(3, g), "b": g}, state, params)
    assert int(state.scaler_state.total_resets) == 1 and int(state.scaler_state.count) == 1
    return params, state


def _assert_same(a: Any, b: Any) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert jnp.asarray(x).dtype == jnp.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _levanter_key_paths(tree: Any, prefix: str = "") -> Any:
    """The branches of Levanter's `leaf_key_paths` (levanter 1.2.dev1644) that optimizer states reach."""
    join = lambda name: f"{prefix}.{name}" if prefix else name  # noqa: E731
    if tree is None:
        return None
    if isinstance(tree, dict):
        return {k: _levanter_key_paths(v, join(k)) for k, v in tree.items()}
    t = type(tree)
    if t.__bases__ == (tuple,) and isinstance(getattr(t, "_fields", None), tuple):  # its `_isnamedtupleinstance`
        return t(**{k: _levanter_key_paths(v, join(k)) for k, v in tree._asdict().items()})
    if isinstance(tree, list):
        return [_levanter_key_paths(v, join(str(i))) for i, v in enumerate(tree)]
    if isinstance(tree, tuple):  # any other tuple, a NamedTuple's subclass included, becomes a plain tuple
        return tuple(_levanter_key_paths(v, join(str(i))) for i, v in enumerate(tree))
    leaves, treedef = jax.tree.flatten(tree)
    assert len(leaves) <= 1, f"not reached by the states tested here: {tree!r}"
    return jax.tree.unflatten(treedef, [prefix] * len(leaves))


def test_dynamic_scaler_state_is_a_direct_named_tuple():
    state = jaxamp.DynamicScalerState(scaler=2.0**10)
    assert type(state).__bases__ == (tuple,) and state._fields[2] == "scaler"
    # Levanter's rebuild with a name per leaf is accepted, unvalidated ...
    named = type(state)(**{k: f"scaler_state.{k}" for k in state._fields})
    assert named.scaler == "scaler_state.scaler" and isinstance(named, jaxamp.DynamicScalerState)
    # ... while a real state is validated as before.
    with pytest.raises(TypeError):
        jaxamp.DynamicScalerState(scaler="large")
    with pytest.raises(ValueError):
        jaxamp.DynamicScalerState(scaler=-1.0)


def test_state_round_trips_through_levanters_key_paths():
    """What `tree_serialize_leaves_tensorstore` / `tree_deserialize_leaves_tensorstore` do, in plain JAX."""
    params, state = _trained_state()
    tree = {"model": params, "opt_state": state}
    paths = _levanter_key_paths(tree)
    # Save: pair every leaf with its file name (this raised the pytree structure error).
    pairs = jax.tree.map(lambda p, x: [(p, np.asarray(x))], paths, tree)
    files = dict(pair for leaf in jax.tree.leaves(pairs, is_leaf=lambda x: isinstance(x, list)) for pair in leaf)
    assert "opt_state.scaler_state.scaler" in files and "opt_state.scaler_state.total_resets" in files
    # Restore: names from an abstract tree of the same structure, leaves read back by name.
    like = jax.eval_shape(lambda: tree)
    names = jax.tree.leaves(_levanter_key_paths(like))
    restored = jax.tree.unflatten(jax.tree.structure(like), [jnp.asarray(files[n]) for n in names])
    _assert_same(restored, tree)
    assert type(restored["opt_state"].scaler_state) is jaxamp.DynamicScalerState


def test_state_round_trips_through_equinox_serialisation():
    params, state = _trained_state()
    buffer = io.BytesIO()
    eqx.tree_serialise_leaves(buffer, state)
    buffer.seek(0)
    like = jaxamp.loss_scaling(optax.adam(1e-2)).init(params)  # defaults: every value must come from the file
    _assert_same(eqx.tree_deserialise_leaves(buffer, like), state)


# --- Levanter itself -------------------------------------------------------------------------


def test_levanter_checkpointer_saves_and_restores_loss_scaling_state(tmp_path):
    pytest.importorskip("levanter")
    from levanter.checkpoint import load_checkpoint, save_checkpoint

    params, state = _trained_state()
    tree = {"model": params, "opt_state": state}
    save_checkpoint(tree, step=3, checkpoint_path=str(tmp_path / "step-3"))
    like = {"model": params, "opt_state": jaxamp.loss_scaling(optax.adam(1e-2)).init(params)}
    restored = load_checkpoint(like, str(tmp_path), discover_latest=True)
    _assert_same(restored, tree)


def _example():
    """examples/levanter_train_lm.py, imported as a module."""
    return load_example("levanter_train_lm")


def _bool_loss_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Levanter 1.2.dev1644's loss averages with a float mask, which JAX 0.10 refuses: the example's cast."""
    import haliax.nn.loss as hax_loss

    replacement = _example().bool_mask_reduce()
    if replacement is not None:
        monkeypatch.setattr(hax_loss, "maybe_reduce_loss", replacement)


def _train_tiny_llama(
    tmp_path,
    amp: str | None,
    steps: int,
    total: int | None = None,
    resume: Any = None,
    nan_at: int | None = None,
    crash_on_nan: bool = True,
    overflow: bool = False,
    first_scale: float = 2.0**15,
) -> tuple[list[float], Any]:
    """`steps` steps of Levanter's Trainer on a tiny Llama, with porting.md's lines for `amp`.

    `total`: the run's length (its schedule), where it stops early to be resumed;
    `resume`: a checkpoint folder it resumes from, through porting.md's restore line;
    `nan_at`: the step given a bad batch (all tokens 0, as marked), whose loss and gradients are NaN;
    `crash_on_nan`: Levanter's ``crash_on_nan`` and ``crash_on_inf``;
    `overflow`: the loss times 1e30, finite in float32, whose float16 backward pass overflows at every scale;
    `first_scale`: `loss_scaling`'s first scale (its default: 2**15).
    """
    total = total or steps
    import functools
    from datetime import timedelta

    import haliax as hax
    from levanter.checkpoint import CheckpointerConfig
    from levanter.models.llama import LlamaConfig
    from levanter.models.lm_model import LmExample, compute_next_token_loss
    from levanter.optim import AdamConfig
    from levanter.tracker.json_logger import JsonLoggerConfig
    from levanter.trainer import Trainer, TrainerConfig

    config = TrainerConfig(
        id=f"jaxamp-{amp or 'f32'}",
        seed=0,
        num_train_steps=total,
        train_batch_size=4,
        load_checkpoint_path=None if resume is None else str(resume),
        crash_on_nan=crash_on_nan,
        crash_on_inf=crash_on_nan,
        tracker=JsonLoggerConfig(),
        require_accelerator=False,
        log_jaxprs=False,
        log_xla_hlo=False,
        log_dir=tmp_path / "logs",
        checkpointer=CheckpointerConfig(base_path=str(tmp_path / "ckpt"), save_interval=timedelta(minutes=30)),
    )
    model_config = LlamaConfig(
        seq_len=16, hidden_dim=32, intermediate_dim=64, num_layers=1, num_heads=2, num_kv_heads=2
    )
    optimizer = AdamConfig(learning_rate=1e-2, weight_decay=0.0, warmup=0.0).build(total)
    loss_function = functools.partial(compute_next_token_loss, logsumexp_weight=0.0)
    if nan_at is not None:
        next_token_loss = loss_function

        def loss_function(model, example, **kwargs):  # bad data: NaN, gradients too
            bad = jnp.all(example.tokens.array == 0)
            return next_token_loss(model, example, **kwargs) * jnp.where(bad, jnp.nan, 1.0)

    if overflow:
        unscaled_loss = loss_function

        def loss_function(model, example, **kwargs):
            return 1e30 * unscaled_loss(model, example, **kwargs)

    if amp == "f16":  # docs/porting.md's two lines
        optimizer = jaxamp.loss_scaling(optimizer, scaler=first_scale)
        loss_function = jaxamp.amp(loss_function, compute_dtype="f16", loss_scale=optimizer)

    if resume is not None:  # docs/porting.md's line: a checkpoint of either precision resumes
        import levanter.checkpoint

        levanter.checkpoint.load_checkpoint = jaxamp.scaling.restore_across_loss_scaling(
            levanter.checkpoint.load_checkpoint, optimizer if amp == "f16" else None
        )

    Vocab = hax.Axis("vocab", 64)
    Batch, Pos = config.TrainBatch, model_config.Pos
    tokens = hax.random.randint(jax.random.PRNGKey(1), (Batch, Pos), 0, Vocab.size)
    example = hax.vmap(LmExample.causal, Batch)(tokens)
    bad = hax.vmap(LmExample.causal, Batch)(hax.zeros_like(tokens))
    losses = []
    with Trainer(config, optimizer, loss_function) as trainer:
        if amp == "f16":  # docs/porting.md's hook: the scale in Levanter's tracker, and the monitor's warnings
            import levanter

            monitor = jaxamp.scaling.LossScaleMonitor()
            trainer.add_hook(
                lambda info: levanter.tracker.log(monitor.update(info.opt_state, info.step), step=info.step), every=1
            )
        state = trainer.initial_state(
            jax.random.PRNGKey(0), model_init=lambda: model_config.build(Vocab, key=jax.random.PRNGKey(2))
        )
        for i in range(steps):
            info = trainer.train_step(state, bad if i == nan_at else example)
            state = info.state
            losses.append(float(info.loss))
        # The whole TrainerState through Levanter's checkpointer, as its save hook writes it.
        from levanter.checkpoint import load_checkpoint, save_checkpoint

        step = int(state.step)
        save_checkpoint(state, step=step, checkpoint_path=str(tmp_path / "save" / f"step-{step}"))
        mesh, mapping = trainer.device_mesh, trainer.parameter_axis_mapping
        restored = load_checkpoint(state, str(tmp_path / "save"), axis_mapping=mapping, mesh=mesh)
        _assert_same(restored, state)
    return losses, state


def test_levanter_trains_in_float16_as_porting_md_says(tmp_path, monkeypatch, caplog):
    pytest.importorskip("levanter")
    _bool_loss_masks(monkeypatch)
    steps = 4
    f32, _ = _train_tiny_llama(tmp_path / "f32", None, steps)
    with caplog.at_level(logging.INFO, logger="levanter.json_logger"):
        f16, state = _train_tiny_llama(tmp_path / "f16", "f16", steps)
    # The hook's metrics, one record a step, in Levanter's tracker.
    logged = [json.loads(r.getMessage()) for r in caplog.records if r.name == "levanter.json_logger"]
    scales = [(r["step"], r["metrics"]["loss_scale"]) for r in logged if "loss_scale" in r.get("metrics", {})]
    assert scales == [(step, 2.0**15) for step in range(steps)]
    scale = state.opt_state.scaler_state  # Levanter's TrainerState holds loss_scaling's state as is
    assert int(scale.total_resets) == 0 and float(scale.scaler) == 2.0**15
    # One batch memorised: the loss falls, and f16's stays within 0.5% of float32's
    # (seen: 5e-4 at most; float16 rounds to 11 bits, 4.9e-4 relative).
    assert f32[-1] < f32[0] - 1.0
    np.testing.assert_allclose(f16, f32, rtol=5e-3)


def test_a_collapsing_scale_is_warned_through_levanters_hook(tmp_path, monkeypatch):
    """porting.md's tracker hook alone: at the scale's floor every step overflows, and the monitor says so."""
    pytest.importorskip("levanter")
    _bool_loss_masks(monkeypatch)
    with pytest.warns(UserWarning, match="the loss scale is at its floor"):
        losses, state = _train_tiny_llama(tmp_path, "f16", 2, overflow=True, first_scale=1.0)
    assert np.all(np.isfinite(losses))  # the loss itself is finite: Levanter's crash_on_nan/inf stay quiet
    scale = state.opt_state.scaler_state
    assert int(scale.total_resets) == 2 and float(scale.scaler) == 1.0


def test_the_port_is_porting_md_lines():
    """examples/levanter_train_lm.py edits Levanter's train_lm by exactly the lines docs/porting.md gives."""
    pytest.importorskip("levanter")
    import difflib
    import inspect

    import levanter.main.train_lm as train_lm

    example = _example()
    original = inspect.getsource(train_lm).splitlines()
    changed = {}
    for amp in ("bf16", "f16"):
        diff = list(difflib.unified_diff(original, example.edited_source(amp).splitlines(), lineterm="", n=0))
        changed[amp] = sorted(line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---"))
    assert changed["bf16"] == sorted(
        ["+import jaxamp", '+    loss_function = jaxamp.amp(loss_function, compute_dtype="bf16")']
    )
    assert changed["f16"] == sorted(
        [
            "+import jaxamp",
            "-    optimizer = config.optimizer.build(config.trainer.num_train_steps)",
            "+    optimizer = jaxamp.loss_scaling(config.optimizer.build(config.trainer.num_train_steps))",
            '+    loss_function = jaxamp.amp(loss_function, compute_dtype="f16", loss_scale=optimizer)',
        ]
    )


def test_levanter_resumes_float32_checkpoints_in_float16_and_back(tmp_path, monkeypatch, caplog):
    pytest.importorskip("levanter")
    import levanter.checkpoint

    _bool_loss_masks(monkeypatch)
    monkeypatch.setattr(levanter.checkpoint, "load_checkpoint", levanter.checkpoint.load_checkpoint)
    uninterrupted, _ = _train_tiny_llama(tmp_path / "all", None, 6)
    first, _ = _train_tiny_llama(tmp_path / "f32", None, 2, total=6)
    with caplog.at_level(logging.WARNING, logger="jaxamp"):
        second, state = _train_tiny_llama(tmp_path / "f16", "f16", 2, total=6, resume=tmp_path / "f32" / "save")
        assert int(state.step) == 4 and isinstance(state.opt_state, jaxamp.LossScaleState)
        third, state = _train_tiny_llama(tmp_path / "back", None, 2, total=6, resume=tmp_path / "f16" / "save")
    assert int(state.step) == 6 and not isinstance(state.opt_state, jaxamp.LossScaleState)
    said = [r.getMessage() for r in caplog.records if r.name == "jaxamp"]
    assert len(said) == 2 and "written without" in said[0] and "written with loss" in said[1]
    print("uninterrupted", uninterrupted, "legs", first + second + third)
    np.testing.assert_array_equal(first, uninterrupted[:2])
    np.testing.assert_allclose(second + third, uninterrupted[2:], rtol=5e-3)


def test_a_nan_batch_stops_levanter_unless_crash_on_nan_is_off_then_loss_scaling_skips_it(tmp_path, monkeypatch):
    pytest.importorskip("levanter")
    _bool_loss_masks(monkeypatch)
    with pytest.raises(RuntimeError, match="Loss is NaN"):  # Levanter's default: the run stops
        _train_tiny_llama(tmp_path / "crash", "f16", 3, nan_at=1)
    f32, _ = _train_tiny_llama(tmp_path / "f32", None, 2, total=3)
    losses, state = _train_tiny_llama(tmp_path / "skip", "f16", 3, nan_at=1, crash_on_nan=False)
    # The NaN step skipped (the scale halved, counted), then training goes on where it was.
    assert np.isnan(losses[1]) and int(state.opt_state.scaler_state.total_resets) == 1
    assert float(state.opt_state.scaler_state.scaler) == 2.0**14
    print("float32", f32, "float16 with a NaN batch at step 1", losses)
    np.testing.assert_allclose([losses[0], losses[2]], f32, rtol=5e-3)
