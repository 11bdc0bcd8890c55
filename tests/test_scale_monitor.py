"""`jaxamp.scaling.LossScaleMonitor`: one warning, with the numbers, when a run's scale is unhealthy."""

import warnings

import jax.numpy as jnp
import optax
import pytest

import jaxamp
from jaxamp.scaling import LossScaleMonitor

pytestmark = pytest.mark.filterwarnings("ignore:jaxamp.loss_scaling's update reads a loss scale")

PARAMS = {"w": jnp.array([1.0, -2.0])}
GOOD = {"w": jnp.array([0.5, 0.5])}
BAD = {"w": jnp.array([jnp.inf, 0.5])}


def _feed(monitor, optimizer, opt_state, pattern, **kwargs):
    """Run `pattern` ("g" finite, "b" non-finite) through the optimizer, feeding the monitor each step."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for c in pattern:
            _, opt_state = optimizer.update(GOOD if c == "g" else BAD, opt_state, PARAMS)
            monitor.update(opt_state, **kwargs)
    return opt_state, [str(w.message) for w in caught if "jaxamp loss scaling" in str(w.message)]


def test_a_scale_collapsed_to_its_floor_warns_once():
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1), scaler=4.0, min_scaler=2.0)
    monitor = LossScaleMonitor()
    # 4 -> 2 (the floor) on the first overflow; the second overflows at the floor.
    opt_state, messages = _feed(monitor, optimizer, optimizer.init(PARAMS), "gbgbbg")
    assert messages == [
        "jaxamp loss scaling: the loss scale is at its floor (2.0) and step 4 still overflowed (2 steps "
        "skipped in all): no smaller scale is left, the loss or its gradients leave float16's range "
        "unscaled. Check the data for inf/NaN (jaxamp.find_nonfinite on a failing batch), lower the "
        "learning rate, or train in bfloat16 (compute_dtype='bf16'), whose range needs no loss scale."
    ]
    assert float(opt_state.scale) == 2.0 and int(opt_state.scaler_state.total_resets) == 3


def test_at_the_floor_with_finite_steps_is_no_warning():
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1), scaler=1.0)  # started at the default floor
    _, messages = _feed(LossScaleMonitor(), optimizer, optimizer.init(PARAMS), "gggg")
    assert messages == []


@pytest.mark.parametrize(("pattern", "warned"), [("g" + "bgbgbgbgbb", True), ("g" + "bgbgbgbgbg", False)])
def test_most_recent_steps_skipped_warns_once(pattern, warned):
    optimizer = jaxamp.loss_scaling(optax.sgd(0.1), scaler=2.0**20)  # far above the floor
    monitor = LossScaleMonitor(window=10)
    _, messages = _feed(monitor, optimizer, optimizer.init(PARAMS), pattern + "b" * 5)
    skipped = pattern.count("b")
    expected = (
        f"jaxamp loss scaling: {skipped} of the last 10 steps were skipped (non-finite gradients; "
        f"{skipped} in all, scale {2.0**20 / 2**skipped}): training hardly moves."
    )
    if warned:
        assert len(messages) == 1 and messages[0].startswith(expected)
        assert messages[0].endswith("whose range needs no loss scale.")
    else:
        # 5 of 10 is not most: the warning comes with the later run of skips, once.
        assert len(messages) == 1 and messages[0].startswith("jaxamp loss scaling: 6 of the last 10 steps")


def test_the_window_counts_steps_when_fed_every_few():
    chunks = ["ggggg", "ggggb", "gbbbb", "bbbgg", "ggggg"]  # steps 11..20: 7 of 10 skipped

    def run(monitor, with_step):
        optimizer = jaxamp.loss_scaling(optax.sgd(0.1), scaler=2.0**20)
        opt_state, messages = optimizer.init(PARAMS), []
        for step, chunk in zip(range(5, 30, 5), chunks):
            for c in chunk:
                _, opt_state = optimizer.update(GOOD if c == "g" else BAD, opt_state, PARAMS)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                monitor.update(opt_state, step=step if with_step else None)
            messages += [str(w.message) for w in caught]
        return messages

    messages = run(LossScaleMonitor(window=10), with_step=True)
    assert len(messages) == 1 and messages[0].startswith("jaxamp loss scaling: 7 of the last 10 steps were skipped")
    assert run(LossScaleMonitor(window=10), with_step=False) == []  # 5 calls: no window of 10 yet


def test_fed_the_metrics_dict_and_returns_python_numbers():
    monitor = LossScaleMonitor()
    metrics = {"loss_scale": jnp.float32(1.0), "skipped_steps": jnp.int32(5), "last_step_finite": jnp.bool_(False)}
    monitor.update(metrics | {"skipped_steps": jnp.int32(4)})
    with pytest.warns(UserWarning, match=r"at its floor \(1.0\) and step 2 still overflowed \(5 steps"):
        values = monitor.update(metrics)
    assert values == {"loss_scale": 1.0, "skipped_steps": 5, "last_step_finite": False}
    above = LossScaleMonitor(min_scale=0.5)  # 1.0 is above that floor: silent
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [above.update(metrics), above.update(metrics)] == [values, values]


def test_a_bare_scaler_state_overflowing_at_its_floor():
    monitor = LossScaleMonitor()
    monitor.update(jaxamp.DynamicScalerState(scaler=1.0, total_resets=1))
    with pytest.warns(UserWarning, match=r"step 2 still overflowed \(2 steps skipped"):
        monitor.update(jaxamp.DynamicScalerState(scaler=1.0, total_resets=2))  # one more skip: overflowed


@pytest.mark.parametrize("kwargs", [{"window": 0}, {"window": 2.5}, {"max_skipped_fraction": 1.0}])
def test_bad_settings(kwargs):
    with pytest.raises(ValueError, match="LossScaleMonitor"):
        LossScaleMonitor(**kwargs)
