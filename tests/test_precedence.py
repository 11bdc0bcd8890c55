"""What the user wrote wins over what amp infers (`jaxamp.transform._scopes.choose_rule`).

An entry of the user's table that differs from `default_amp_policy`'s decides
every equation of its primitive, inside the program's tail (its loss), its
normalisation statistics and its range-bounded exponentials too; only
``amp_stop`` and named scopes come before it. Checked over JAX's op catalogue
(each operation fed half-precision operands and summed into a scalar loss, so
the tail covers it) and over the model zoo.
"""

import collections

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from test_model_zoo import MODELS

import jaxamp
from jaxamp import _compat, default_amp_policy

from jax_catalogue import lax_op_catalogue

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals

F32 = np.dtype(jnp.float32)
CATALOGUE = [op for op in lax_op_catalogue() if F32 in op.dtypes]


class RuleError(Exception):
    pass


def counting(calls, name, rule):
    """A user rule: `rule` (a default one), recording each call under `name`."""

    def user_rule(compute_dtype, original_dtypes, *invars, **params):
        calls[name] += 1
        return rule(compute_dtype, original_dtypes, *invars, **params)

    return user_rule


def raising(name):
    def user_rule(compute_dtype, original_dtypes, *invars, **params):
        raise RuleError(f"user rule for {name}")

    return user_rule


def _through_a_matmul(x):
    # A dot_general with the scalar 1: amp runs it in the compute dtype, so the
    # operation under test is downstream of a matmul and gets half operands.
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return lax.dot_general(x, jnp.float32(1.0), (((), ()), ((), ())))


def catalogue_loss(op):
    """`op` after a matmul, its floating results summed: a scalar loss, all of it tail."""

    def loss(*args):
        outs = jax.tree.leaves(op.fn(*map(_through_a_matmul, args)))
        floats = [jnp.sum(o) for o in outs if jnp.issubdtype(o.dtype, jnp.floating)]
        return sum(floats) if floats else outs

    args = (jnp.asarray(np.linspace(0.55, 0.95, 3, dtype=np.float32)),) * op.nargs
    return loss, args


def zoo_loss(make):
    loss, args = make()
    return loss, args


def first_order_rows(fn, args, table, compute_dtype="f16"):
    return jaxamp.explain(fn, compute_dtype=compute_dtype, amp_policy=table)(*args).rows


def user_table(rows, make_rule):
    """The default table with a user rule for every primitive `rows` ran by a table entry."""
    by_name = _compat.primitives_by_name()
    names = {r.primitive for r in rows if by_name.get(r.primitive) in default_amp_policy}
    return default_amp_policy | {by_name[n]: make_rule(n, default_amp_policy[by_name[n]]) for n in names}, names


def assert_user_rules_decide(fn, args):
    plain = first_order_rows(fn, args, None)
    calls = collections.Counter()
    table, names = user_table(plain, lambda n, rule: counting(calls, n, rule))
    assert names, "no equation ran by a primitive entry"
    calls.clear()
    rows = first_order_rows(fn, args, table)
    decided = collections.Counter(r.decided_by for r in rows)
    stopped = {"amp_stop"} | {d for d in decided if d.startswith("scope:")}
    mine = [r for r in rows if r.primitive in names and r.decided_by not in stopped]
    assert mine and {r.decided_by for r in mine} == {"user"}, decided
    # explain evaluates every equation (a loop body once per trace amp makes
    # of it, to settle its carry's dtypes): at least one call per row.
    expected = collections.Counter(r.primitive for r in mine)
    assert set(calls) == set(expected) and all(calls[p] >= n for p, n in expected.items()), (calls, expected)
    # amp proper rewrites a body shared by several call sites once.
    calls.clear()
    eqx.filter_make_jaxpr(jaxamp.amp(fn, compute_dtype="f16", amp_policy=table))(*args)
    assert set(calls) == {r.primitive for r in mine}
    return plain


@pytest.mark.parametrize("op", CATALOGUE, ids=lambda op: op.name)
def test_a_user_entry_decides_every_equation_of_a_catalogue_operation(op):
    fn, args = catalogue_loss(op)
    assert_user_rules_decide(fn, args)


@pytest.mark.parametrize("make", MODELS, ids=lambda m: m.__name__)
@pytest.mark.newest_only
def test_a_user_entry_decides_every_equation_of_a_zoo_model(make):
    fn, args = zoo_loss(make)
    plain = assert_user_rules_decide(fn, args)
    # The model's own tail and statistics were there to be overridden.
    assert {"tail"} <= {r.decided_by for r in plain}


PROGRAMS = [("catalogue", op) for op in CATALOGUE] + [("zoo", make) for make in MODELS]


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_a_user_rule_that_raises_raises_on_every_call(data):
    kind, which = data.draw(st.sampled_from(PROGRAMS), label="program")
    fn, args = catalogue_loss(which) if kind == "catalogue" else zoo_loss(which)
    plain = first_order_rows(fn, args, None)
    ruled = sorted(
        {r.primitive for r in plain if r.decided_by not in ("amp_stop",) and not r.decided_by.startswith("scope:")}
    )
    by_name = _compat.primitives_by_name()
    ruled = [n for n in ruled if by_name.get(n) in default_amp_policy]
    name = data.draw(st.sampled_from(ruled), label="primitive")
    amp_fn = jaxamp.amp(fn, compute_dtype="f16", amp_policy=default_amp_policy | {by_name[name]: raising(name)})
    for _ in range(2):  # eagerly: a failed trace is not cached
        with pytest.raises(RuleError, match=f"user rule for {name}"):
            amp_fn(*args)
    with pytest.raises(RuleError, match=f"user rule for {name}"):
        eqx.filter_jit(amp_fn)(*args)


# --- the cases ---------------------------------------------------------------------------------------


@pytest.mark.newest_only
def test_a_user_rule_in_the_tail_is_called_and_explain_says_so():
    calls = collections.Counter()
    table = default_amp_policy | {lax.tanh_p: counting(calls, "tanh", jaxamp.use_current_precision)}
    fn = lambda x: jnp.sum(jnp.tanh(x @ x))  # noqa: E731
    x = jnp.ones((3, 3))
    jax.jit(jaxamp.amp(fn, amp_policy=table))(x)
    assert calls["tanh"] == 1
    rows = jaxamp.explain(fn, amp_policy=table)(x).rows
    (tanh,) = [r for r in rows if r.primitive == "tanh"]
    assert tanh.decided_by == "user" and tanh.dtypes_after == ("f16",)
    # Without the user's entry, the tail keeps it in float32.
    (tanh,) = [r for r in jaxamp.explain(fn)(x).rows if r.primitive == "tanh"]
    assert tanh.decided_by == "tail" and tanh.dtypes_after == ("f32",)


def test_a_user_entry_wins_over_the_statistics_region():
    def fn(x, w):
        h = x @ w
        return jnp.sum(jax.nn.standardize(h, axis=-1) @ w.T)

    x = jax.random.normal(jax.random.PRNGKey(0), (4, 8))
    w = jax.random.normal(jax.random.PRNGKey(1), (8, 8))
    plain = jaxamp.explain(fn, compute_dtype="bf16")(x, w).rows
    stats = [k for k, r in enumerate(plain) if r.decided_by == "statistics"]
    assert stats, plain
    # The default rule of these primitives, written by the user (another object).
    follow = counting(collections.Counter(), "statistics", jaxamp.use_current_precision)
    table = default_amp_policy | {p: follow for p in (lax.sub_p, lax.mul_p, lax.div_p, lax.square_p)}
    rows = jaxamp.explain(fn, compute_dtype="bf16", amp_policy=table)(x, w).rows
    assert [r.primitive for r in rows] == [r.primitive for r in plain]
    assert not [r for r in rows if r.decided_by == "statistics"]
    # What the statistics pass kept in float32 now follows its bf16 operand.
    assert all(rows[k].decided_by == "user" and rows[k].dtypes_after[0] == "bf16" for k in stats), rows


@pytest.mark.newest_only
def test_scopes_and_amp_stop_come_before_a_user_entry():
    calls = collections.Counter()
    table = default_amp_policy | {
        lax.tanh_p: counting(calls, "tanh", jaxamp.use_current_precision),
        "head": jaxamp.use_original_precision,
    }

    def fn(x):
        h = x @ x
        with jax.named_scope("head"):
            a = jnp.tanh(h)
        with jaxamp.amp_stop():
            b = jnp.tanh(h)
        return jnp.sum(jnp.tanh(h) + a + b)

    rows = jaxamp.explain(fn, amp_policy=table)(jnp.ones((3, 3))).rows
    tanhs = sorted(r.decided_by for r in rows if r.primitive == "tanh")
    assert tanhs == ["amp_stop", "scope:head", "user"]


@pytest.mark.newest_only
def test_an_entry_equal_to_the_default_is_not_the_users():
    # Writing the default rule again leaves amp's inferences in charge.
    table = default_amp_policy | {lax.tanh_p: default_amp_policy[lax.tanh_p]}
    (tanh,) = [
        r
        for r in jaxamp.explain(lambda x: jnp.sum(jnp.tanh(x @ x)), amp_policy=table)(jnp.ones((3, 3))).rows
        if r.primitive == "tanh"
    ]
    assert tanh.decided_by == "tail"


@pytest.mark.parametrize("compute_dtype", ["bf16", "f16", "fp8"])
@pytest.mark.newest_only
def test_amp_modes_entries_are_not_the_users(compute_dtype):
    x = jnp.ones((16, 16))
    rows = jaxamp.explain(lambda x: jnp.sum(x @ x), compute_dtype=compute_dtype)(x).rows
    (dot,) = [r for r in rows if r.primitive == "dot_general"]
    assert dot.decided_by == "primitive"
    rows = jaxamp.explain(lambda x: jnp.sum(x @ x), float32_gradient_reductions=True)(x).rows
    (dot,) = [r for r in rows if r.primitive == "dot_general"]
    assert dot.decided_by == "primitive"


@pytest.mark.newest_only
def test_optax_loss_under_a_user_log_entry():
    # A user's pin inside the loss decides; the rest of the loss is still tail.
    labels = jnp.arange(4)
    table = default_amp_policy | {lax.log_p: jaxamp.use_compute_precision}

    def fn(x, w):
        return optax.softmax_cross_entropy_with_integer_labels(x @ w, labels).mean()

    x, w = jnp.ones((4, 8)), jnp.ones((8, 4)) / 8
    rows = jaxamp.explain(fn, compute_dtype="bf16", amp_policy=table)(x, w).rows
    logs = [r for r in rows if r.primitive == "log"]
    assert logs and all(r.decided_by == "user" and r.dtypes_after == ("bf16",) for r in logs)
    assert any(r.decided_by == "tail" for r in rows)


def test_an_entry_for_a_higher_order_primitive_is_refused():
    # amp interprets a scan's body; a rule for scan itself would never run.
    with pytest.raises(ValueError, match="'scan', a higher-order primitive.*jax.named_scope"):
        jaxamp.amp(lambda x: x, amp_policy=default_amp_policy | {lax.scan_p: jaxamp.use_original_precision})
