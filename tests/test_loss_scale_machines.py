"""Random sequences of training calls, two paths that must agree after every one.

`LiveAgainstState`: ``amp(loss, loss_scale=tx)`` (the scale in the
transformation's cells, for loops a framework owns) against
``loss_scale=opt_state`` (the scale read from the state), bit for bit: the
parameters, the inner optimizer state, the scale and the skipped-step count.
Its rules are the sequences the live scale follows its state through: steps
clean or overflowing, the gradient jitted with the update or apart, one
gradient handed to two updates, a gradient discarded (the overflow travels in
the gradient, so a discarded one says nothing), a re-``init``, a checkpoint
round trip of the current state, and a rollback to a saved copy (or a new
process resuming it) through `jaxamp.scaling.restore_across_loss_scaling`,
which sets the cells to the restored state. A rollback by hand (the copy
handed to the update, no restore function) and one transformation for two
states are not among them: there the forward pass reads the cells, which
follow the last state updated, not the one handed to the update
(docs/loss_scaling.md, the live scale's limits; tests/test_live_scale.py
holds what it does there).

`StateAgainstFloat32`: the state path against float32 within float16's
tolerance, where every rule holds: an overflowing step changes nothing, a
discarded gradient changes nothing, a rollback restores both.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import jaxamp

pytestmark = pytest.mark.filterwarnings("error")

D = 8
LR = 0.05


def _batch(seed, overflow):
    x = jax.random.normal(jax.random.PRNGKey(seed), (16, D))
    y = jnp.sin(x) * (1e6 if overflow else 1.0)
    return x, y


def _loss(w, x, y):
    return jnp.mean((jnp.tanh(x @ w) - y) ** 2)


def _w0():
    return jax.random.normal(jax.random.PRNGKey(0), (D, D)) * 0.3


def _tx():
    return jaxamp.loss_scaling(optax.adam(LR), scaler=2.0**8, patience=2)


# One transformation per path for every run (each compiled once): a run's
# `init` resets the live one's cells, as a second run in a process does.
_TX_LIVE, _TX_STATE = _tx(), _tx()


@functools.cache
def _state_path(tx):
    """(together, grad, update) for ``loss_scale=opt_state``, compiled once per transformation."""

    def grad(w, s, x, y):
        return jax.grad(jaxamp.amp(_loss, compute_dtype="f16", loss_scale=s))(w, x, y)

    return _steppers(tx, grad)


@functools.cache
def _live_path(tx):
    loss = jaxamp.amp(_loss, compute_dtype="f16", loss_scale=tx)
    return _steppers(tx, lambda w, s, x, y: jax.grad(loss)(w, x, y))


def _steppers(tx, grad):
    def update(g, s, w):
        updates, s = tx.update(g, s, w)
        return optax.apply_updates(w, updates), s

    together = jax.jit(lambda w, s, x, y: update(grad(w, s, x, y), s, w))
    return together, jax.jit(grad), jax.jit(update)


def _step(path, w, s, batch, jit_together):
    together, grad, update = path
    if jit_together:
        return together(w, s, *batch)
    return update(grad(w, s, *batch), s, w)


def _metrics(s):
    m = jaxamp.scaling.scale_metrics(s)
    return float(m["loss_scale"]), int(m["skipped_steps"])


def _assert_bits_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _round_trip(tree):
    """A checkpoint round trip: every leaf to host bytes and back."""
    return jax.tree.map(lambda x: jnp.asarray(np.frombuffer(np.asarray(x).tobytes(), x.dtype).reshape(x.shape)), tree)


class LiveAgainstState(RuleBasedStateMachine):
    @initialize()
    def start(self):
        self.tx_live, self.tx_state = _TX_LIVE, _TX_STATE
        self.w_live = self.w_state = _w0()
        self.s_live, self.s_state = self.tx_live.init(self.w_live), self.tx_state.init(self.w_state)
        self.seed = 1

    @rule(overflow=st.booleans(), jit_together=st.booleans())
    def step(self, overflow, jit_together):
        batch = _batch(self.seed, overflow)
        self.seed += 1
        self.w_live, self.s_live = _step(_live_path(self.tx_live), self.w_live, self.s_live, batch, jit_together)
        self.w_state, self.s_state = _step(_state_path(self.tx_state), self.w_state, self.s_state, batch, jit_together)

    @rule(overflow=st.booleans())
    def one_gradient_two_updates(self, overflow):
        # The same gradients handed to a second update (both skip an overflow).
        batch = _batch(self.seed, overflow)
        self.seed += 1
        for path, tx in ((_live_path(self.tx_live), "live"), (_state_path(self.tx_state), "state")):
            _, grad, update = path
            w, s = (self.w_live, self.s_live) if tx == "live" else (self.w_state, self.s_state)
            g = grad(w, s, *batch)
            w, s = update(g, s, w)
            w, s = update(g, s, w)
            if tx == "live":
                self.w_live, self.s_live = w, s
            else:
                self.w_state, self.s_state = w, s

    @rule(overflow=st.booleans())
    def discard_a_gradient(self, overflow):
        # A probe (a grad-norm diagnostic): the gradient computed, never applied.
        batch = _batch(self.seed, overflow)
        self.seed += 1
        _live_path(self.tx_live)[1](self.w_live, self.s_live, *batch)
        _state_path(self.tx_state)[1](self.w_state, self.s_state, *batch)

    @rule()
    def init_again(self):
        self.w_live = self.w_state = _w0()
        self.s_live, self.s_state = self.tx_live.init(self.w_live), self.tx_state.init(self.w_state)

    @rule()
    def checkpoint_round_trip(self):
        self.w_live, self.s_live = _round_trip((self.w_live, self.s_live))
        self.w_state, self.s_state = _round_trip((self.w_state, self.s_state))

    @rule()
    def save(self):
        self.saved = _round_trip((self.w_live, self.s_live, self.w_state, self.s_state))

    @precondition(lambda self: hasattr(self, "saved"))
    @rule()
    def restore_through_the_restore_line(self):
        # A rollback to the saved copy, or a new process resuming it: the live
        # path restores through porting.md's line, which sets the cells to it.
        w_live, s_live, w_state, s_state = self.saved
        restore = jaxamp.scaling.restore_across_loss_scaling(
            lambda target: {"w": w_live, "opt_state": s_live}, self.tx_live
        )
        restored = restore({"w": self.w_live, "opt_state": self.s_live})
        self.w_live, self.s_live = restored["w"], restored["opt_state"]
        self.w_state, self.s_state = w_state, s_state

    @invariant()
    def paths_agree(self):
        if not hasattr(self, "s_live"):
            return
        _assert_bits_equal(self.w_live, self.w_state)
        _assert_bits_equal(self.s_live.inner_state, self.s_state.inner_state)
        assert _metrics(self.s_live) == _metrics(self.s_state)


class StateAgainstFloat32(RuleBasedStateMachine):
    @initialize()
    def start(self):
        self.tx = _TX_STATE
        self.tx32 = optax.adam(LR)
        self.w = self.w32 = _w0()
        self.s = self.tx.init(self.w)
        self.s32 = self.tx32.init(self.w32)
        self.saved = None
        self.seed = 1
        self.steps = 0

    @rule(overflow=st.booleans(), jit_together=st.booleans())
    def step(self, overflow, jit_together):
        batch = _batch(self.seed, overflow)
        self.seed += 1
        before = self.w
        scale, skipped = _metrics(self.s)
        self.w, self.s = _step(_state_path(self.tx), self.w, self.s, batch, jit_together)
        if _metrics(self.s)[1] > skipped:
            # Skipped: the parameters' bits as they were, the scale halved (down to its floor).
            _assert_bits_equal(self.w, before)
            assert _metrics(self.s)[0] == max(scale / 2, 1.0)
            return
        assert not overflow, "an overflowing batch was applied"
        updates, self.s32 = self.tx32.update(jax.grad(_loss)(self.w32, *batch), self.s32, self.w32)
        self.w32 = optax.apply_updates(self.w32, updates)
        self.steps += 1

    @rule()
    def discard_a_gradient(self):
        # A probe: the gradient computed, never applied.
        _, grad, _ = _state_path(self.tx)
        grad(self.w, self.s, *_batch(self.seed, overflow=True))

    @rule()
    def save(self):
        self.saved = (*_round_trip((self.w, self.s, self.w32, self.s32)), self.steps)

    @precondition(lambda self: self.saved is not None)
    @rule()
    def roll_back(self):
        self.w, self.s, self.w32, self.s32, self.steps = self.saved

    @invariant()
    def within_float16_tolerance(self):
        if not hasattr(self, "w"):
            return
        # adam moves each weight by at most LR a step; float16's gradients
        # change a step's direction by a few percent at most.
        np.testing.assert_allclose(self.w, self.w32, atol=0.05 * LR * max(self.steps, 1))


_SETTINGS = settings(max_examples=12, stateful_step_count=8, deadline=None)
TestLiveAgainstState = LiveAgainstState.TestCase
TestLiveAgainstState.settings = _SETTINGS
TestStateAgainstFloat32 = StateAgainstFloat32.TestCase
TestStateAgainstFloat32.settings = _SETTINGS
