"""amp(): the contract of jaxamp's own test suite, call forms, scopes, composition."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp import (
    _compat,
    amp,
    amp_stop,
    default_amp_policy,
    use_compute_precision,
    use_original_precision,
    use_precision,
    use_widest_precision,
)

from jaxpr_walk import assert_all_matmuls_in, iter_eqns, matmul_operand_dtypes

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals

KEY = jax.random.PRNGKey(0)


def _cast_arrays(tree, dtype):
    return jax.tree.map(lambda a: a.astype(dtype) if eqx.is_array(a) else a, tree)


# --- the reference package's own tests ------------------------------------------


@pytest.mark.newest_only
def test_linear_equals_half_cast_linear():
    # The reference package's test, with its table: the bias add after the
    # matmul in float16 too. (jaxamp's default runs the program's tail, what
    # comes after its last matmul, in float32: the next test.)
    linear = eqx.nn.Linear(5, 3, key=KEY)
    x = jax.random.normal(jax.random.PRNGKey(1), (5,))
    expected = _cast_arrays(linear, jnp.float16)(x.astype(jnp.float16)).astype(jnp.float32)
    without_tail = {k: v for k, v in default_amp_policy.items() if k != "amp_tail"}
    out = amp(linear, amp_policy=without_tail)(x)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, expected)


@pytest.mark.newest_only
def test_a_bare_linear_equals_the_half_precision_linear():
    # jaxamp 0.0.4's test_linear_amp: a layer's activations are no loss, so
    # there is no tail; every op runs by its table entry, as in hand-cast f16.
    linear = eqx.nn.Linear(2, 10, key=KEY)
    x = jnp.ones(2)
    half = _cast_arrays(linear, jnp.float16)
    np.testing.assert_array_equal(amp(linear)(x), half(x.astype(jnp.float16)).astype(jnp.float32))
    assert jnp.allclose(amp(linear)(x), half(x.astype(jnp.float16)))


@pytest.mark.newest_only
def test_a_linears_scalar_loss_adds_its_bias_in_float32_as_the_tail():
    linear = eqx.nn.Linear(5, 3, key=KEY)
    x = jax.random.normal(jax.random.PRNGKey(1), (5,))
    half = _cast_arrays(linear, jnp.float16)
    logits = (half.weight @ x.astype(jnp.float16)).astype(jnp.float32) + linear.bias
    expected = jnp.sum(logits**2)
    np.testing.assert_array_equal(amp(lambda x: jnp.sum(linear(x) ** 2))(x), expected)


@pytest.mark.newest_only
def test_amp_stop_decorator_gives_float32():
    linear = eqx.nn.Linear(5, 3, key=KEY)
    x = jax.random.normal(jax.random.PRNGKey(1), (5,))
    np.testing.assert_array_equal(amp(amp_stop(linear))(x), linear(x))


class StopBiasLinear(eqx.nn.Linear):
    def __call__(self, x):
        x = self.weight @ x
        with amp_stop():
            x = x + self.bias
        return x


@pytest.mark.newest_only
def test_amp_stop_context_keeps_bias_add_in_float32():
    linear = StopBiasLinear(5, 3, key=KEY)
    x = jax.random.normal(jax.random.PRNGKey(1), (5,))
    matmul = (linear.weight.astype(jnp.float16) @ x.astype(jnp.float16)).astype(jnp.float32)
    np.testing.assert_array_equal(amp(linear)(x), matmul + linear.bias)
    jaxpr = jax.make_jaxpr(amp(linear))(x)
    adds = [e for e in iter_eqns(jaxpr) if e.primitive.name == "add"]
    assert [tuple(v.aval.dtype for v in e.invars) for e in adds] == [(jnp.float32, jnp.float32)]


@pytest.mark.newest_only
def test_policy_entry_for_equinox_scope():
    linear = eqx.nn.Linear(5, 3, key=KEY)
    x = jax.random.normal(jax.random.PRNGKey(1), (5,))
    policy = default_amp_policy | {"eqx.nn.Linear": use_original_precision}
    np.testing.assert_array_equal(amp(linear, amp_policy=policy)(x), linear(x))


def test_default_policy_is_a_read_only_mapping_of_rules():
    from collections.abc import Mapping

    assert isinstance(default_amp_policy, Mapping)
    assert default_amp_policy[jax.lax.dot_general_p] is use_compute_precision
    assert default_amp_policy["amp_stop"] is use_original_precision
    assert all(callable(rule) for rule in default_amp_policy.values())
    extended = default_amp_policy | {jax.lax.tanh_p: use_original_precision}
    assert type(extended) is dict and extended[jax.lax.tanh_p] is use_original_precision
    assert default_amp_policy[jax.lax.tanh_p] is not use_original_precision
    assert ({"x": use_original_precision} | default_amp_policy)["x"] is use_original_precision


@pytest.mark.parametrize(
    "edit",
    [
        lambda t: t.__setitem__(jax.lax.dot_general_p, use_original_precision),
        lambda t: t.__delitem__(jax.lax.dot_general_p),
        lambda t: t.update({jax.lax.dot_general_p: use_original_precision}),
        lambda t: t.pop(jax.lax.dot_general_p),
        lambda t: t.setdefault("scope", use_original_precision),
        lambda t: t.clear(),
    ],
)
def test_editing_the_default_table_in_place_raises(edit):
    # It used to be a plain dict: an in-place edit was silently ignored once
    # amp had cached a body rewritten under the old entries.
    with pytest.raises(TypeError, match=r"read-only.*default_amp_policy \| \{"):
        edit(default_amp_policy)
    assert default_amp_policy[jax.lax.dot_general_p] is use_compute_precision


def _dot_dtypes(jaxpr):
    return [e.invars[0].aval.dtype for e in iter_eqns(jaxpr) if e.primitive.name == "dot_general"]


@pytest.mark.newest_only
def test_a_table_mutated_between_calls_is_seen_by_cached_bodies():
    # The body of the inner jit is cached per table; the cache must key on the
    # table's contents, not on the dict object.
    @jax.jit
    def inner(w, x):
        return jnp.tanh(x @ w)

    def f(w, x):
        return inner(w, x).sum()

    def traced_dot_dtypes(table):
        # A fresh amp'd function per call: JAX's own trace cache keys on the
        # function object, and the point here is amp's cache of inner bodies.
        return _dot_dtypes(jax.make_jaxpr(amp(f, amp_policy=table))(W, X))

    table = dict(default_amp_policy)
    assert traced_dot_dtypes(table) == [jnp.float16]
    table[jax.lax.dot_general_p] = use_original_precision
    assert traced_dot_dtypes(table) == [jnp.float32]
    table[jax.lax.dot_general_p] = use_compute_precision
    assert traced_dot_dtypes(table) == [jnp.float16]


@pytest.mark.newest_only
def test_batchnorm_under_vmap_with_axis_name():
    bn, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, axis_name="batch")
    x = jax.random.normal(KEY, (8, 4))
    plain = jax.vmap(bn, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    mixed = jax.vmap(amp(bn), axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    (y0, s0), (y1, s1) = plain(x, state), mixed(x, state)
    np.testing.assert_allclose(y1, y0, rtol=1e-6, atol=1e-6)
    assert y1.dtype == jnp.float32
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), s0, s1)


# --- call forms and dtypes ----------------------------------------------------------


def _mlp(w, x):
    return jnp.tanh(x @ w).sum()


W = jax.random.normal(KEY, (6, 4))
X = jax.random.normal(jax.random.PRNGKey(2), (3, 6))


@pytest.mark.parametrize(
    "make, dtype",
    [
        (lambda f: amp(f), jnp.float16),
        (lambda f: amp(f, compute_dtype=jnp.bfloat16), jnp.bfloat16),
        (lambda f: amp(compute_dtype="bf16")(f), jnp.bfloat16),
        (lambda f: amp()(f), jnp.float16),
        (lambda f: amp(f, compute_dtype="f16"), jnp.float16),
        (lambda f: amp(f, compute_dtype=" BFloat16 "), jnp.bfloat16),
        (lambda f: amp(f, compute_dtype="half"), jnp.float16),  # CPU: half is float16
        (lambda f: amp(f, compute_dtype=np.dtype("float32")), jnp.float32),
    ],
)
def test_call_forms_and_compute_dtype(make, dtype):
    f = make(_mlp)
    assert_all_matmuls_in(jax.make_jaxpr(f)(W, X), dtype)
    assert f(W, X).dtype == jnp.float32


@pytest.mark.newest_only
def test_decorator_forms():
    @amp
    def a(w, x):
        return x @ w

    @amp(compute_dtype=jnp.bfloat16)
    def b(w, x):
        return x @ w

    assert_all_matmuls_in(jax.make_jaxpr(a)(W, X), jnp.float16)
    assert_all_matmuls_in(jax.make_jaxpr(b)(W, X), jnp.bfloat16)
    assert a.__name__ == "a"


@pytest.mark.newest_only
def test_outputs_restored_to_the_functions_own_dtypes():
    def f(w, x):
        y = x @ w
        return {"f32": y, "f16": y.astype(jnp.float16), "int": jnp.argmax(y, -1), "none": None, "s": "tag", "n": 3}

    out = amp(f, compute_dtype="bf16")(W, X)
    assert out["f32"].dtype == jnp.float32
    assert out["f16"].dtype == jnp.float16
    assert out["int"].dtype == jnp.int32
    assert out["none"] is None and out["s"] == "tag" and out["n"] == 3


@pytest.mark.newest_only
def test_static_arguments_and_kwargs():
    def f(x, scale, *, activation, name):
        assert isinstance(scale, float) and isinstance(name, str)
        return activation(x @ W) * scale

    out = amp(f)(X, 2.0, activation=jnp.tanh, name="layer")
    np.testing.assert_allclose(out, f(X, 2.0, activation=jnp.tanh, name="layer"), atol=2e-2)


@pytest.mark.newest_only
def test_equinox_static_fields_are_static():
    class Scaled(eqx.Module):
        w: jax.Array
        mode: str = eqx.field(static=True)

        def __call__(self, x):
            assert self.mode == "tanh"
            return jnp.tanh(x @ self.w)

    model = Scaled(W, "tanh")
    out = amp(lambda m, x: m(x))(model, X)
    np.testing.assert_allclose(out, model(X), atol=2e-2)


@pytest.mark.newest_only
def test_numerics_close_to_float32():
    w = jax.random.normal(KEY, (64, 64)) / 8
    x = jax.random.normal(jax.random.PRNGKey(3), (16, 64))

    def f(w, x):
        for _ in range(3):
            x = jax.nn.gelu(x @ w)
        return jax.nn.logsumexp(x, axis=-1)

    # bf16 keeps 8 mantissa bits: relative error ~ 2**-8 per op, a few ops deep.
    np.testing.assert_allclose(amp(f, compute_dtype="bf16")(w, x), f(w, x), rtol=3e-2, atol=3e-2)
    # f16 keeps 11 bits.
    np.testing.assert_allclose(amp(f)(w, x), f(w, x), rtol=5e-3, atol=5e-3)


# --- policy table semantics ----------------------------------------------------------


@pytest.mark.newest_only
def test_outermost_matching_scope_wins():
    def f(w, x):
        with jax.named_scope("outer"):
            with jax.named_scope("inner"):
                return x @ w

    both = default_amp_policy | {"outer": use_precision(jnp.bfloat16), "inner": use_original_precision}
    assert_all_matmuls_in(jax.make_jaxpr(amp(f, amp_policy=both))(W, X), jnp.bfloat16)
    inner_only = default_amp_policy | {"inner": use_original_precision}
    assert_all_matmuls_in(jax.make_jaxpr(amp(f, amp_policy=inner_only))(W, X), jnp.float32)


@pytest.mark.newest_only
def test_scope_opened_around_the_amp_call_counts():
    mixed = amp(_mlp, amp_policy=default_amp_policy | {"keep": use_original_precision})

    def caller(w, x):
        with jax.named_scope("keep"):
            return mixed(w, x)

    assert_all_matmuls_in(jax.make_jaxpr(caller)(W, X), jnp.float32)


def test_primitive_entry_and_amp_default():
    def f(x):
        return jnp.sin(x) + 1.0

    policy = {jax.lax.sin_p: use_precision("bf16"), "amp_default": use_original_precision}
    with pytest.warns(UserWarning, match="no entry for primitive 'add'"):
        jaxpr = jax.make_jaxpr(amp(f, amp_policy=policy))(X)
    sins = [e for e in iter_eqns(jaxpr) if e.primitive is jax.lax.sin_p]
    assert sins[0].invars[0].aval.dtype == jnp.bfloat16
    adds = [e for e in iter_eqns(jaxpr) if e.primitive is jax.lax.add_p]
    assert adds[0].invars[0].aval.dtype == jnp.float32  # amp_default: original
    # An empty table leaves everything at original precision.
    assert_all_matmuls_in(jax.make_jaxpr(amp(_mlp, amp_policy={}))(W, X), jnp.float32)


@pytest.mark.newest_only
def test_user_written_rule_receives_the_seed_signature():
    calls = []

    def record(compute_dtype, original_dtypes, *invars, **bind_params):
        calls.append((compute_dtype, tuple(original_dtypes), len(invars), sorted(bind_params)))
        return use_compute_precision(compute_dtype, original_dtypes, *invars, **bind_params)

    with pytest.warns(UserWarning, match="no entry for primitive 'tanh'"):
        amp(_mlp, amp_policy={jax.lax.dot_general_p: record}, compute_dtype="bf16")(W, X)
    assert calls == [
        (jnp.bfloat16, (jnp.float32, jnp.float32), 2, sorted(jax.make_jaxpr(lambda a, b: a @ b)(X, W).eqns[0].params))
    ]


def test_widest_precision_rule():
    def f(a, b):
        return a @ b

    policy = {jax.lax.dot_general_p: use_widest_precision}
    a16, b32 = X.astype(jnp.float16), W
    # jnp promotes f16 @ f32 to f32 before the dot; widest of (f32, f32) is f32.
    assert_all_matmuls_in(jax.make_jaxpr(amp(f, amp_policy=policy))(a16, b32), jnp.float32)
    assert_all_matmuls_in(jax.make_jaxpr(amp(f, amp_policy=policy))(a16, b32.astype(jnp.float16)), jnp.float16)


@pytest.mark.newest_only
def test_explicit_user_cast_is_respected():
    def f(w, x):
        y = (x @ w).astype(jnp.float32)
        return y, jnp.exp(y)

    jaxpr = jax.make_jaxpr(amp(f))(W, X)
    exps = [e for e in iter_eqns(jaxpr) if e.primitive is jax.lax.exp_p]
    assert exps[0].invars[0].aval.dtype == jnp.float32


@pytest.mark.newest_only
def test_unknown_primitive_runs_at_original_precision():
    def f(w, x):
        y = x @ w
        host = jax.pure_callback(lambda a: np.asarray(a) * 2, jax.ShapeDtypeStruct(y.shape, y.dtype), y)
        return host

    jaxpr = jax.make_jaxpr(amp(f))(W, X)
    callbacks = [e for e in iter_eqns(jaxpr) if "callback" in e.primitive.name]
    assert callbacks and all(v.aval.dtype == jnp.float32 for v in callbacks[0].invars)
    np.testing.assert_allclose(amp(f)(W, X), f(W, X), rtol=1e-2, atol=1e-2)


def _tanh_after_matmul(w, x):
    # The tanh feeds another matmul: not the program's tail (which runs in
    # float32 by its own entry), so the table's entry for tanh decides.
    return jnp.tanh(x @ w) @ w.T


@pytest.mark.newest_only
def test_amp_default_moving_operands_back_warns_once_naming_the_fix(fresh_warnings):
    # Without an entry for tanh, amp_default sends the bf16 matmul output back
    # to float32: a precision change the user did not ask for.
    table = {k: v for k, v in default_amp_policy.items() if k is not jax.lax.tanh_p}
    f = amp(_tanh_after_matmul, amp_policy=table, compute_dtype="bf16")
    with pytest.warns(UserWarning) as record:
        jaxpr = jax.make_jaxpr(f)(W, X)
    messages = [str(w.message) for w in record if "amp policy table" in str(w.message)]
    assert len(messages) == 1
    assert "no entry for primitive 'tanh'" in messages[0]
    assert "bfloat16" in messages[0] and "float32" in messages[0]
    assert "{jax.lax.tanh_p: jaxamp.use_current_precision}" in messages[0]
    tanhs = [e for e in iter_eqns(jaxpr) if e.primitive is jax.lax.tanh_p]
    assert tanhs[0].invars[0].aval.dtype == jnp.float32
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the second trace says nothing
        jax.make_jaxpr(amp(_tanh_after_matmul, amp_policy=table, compute_dtype="bf16"))(W, X)


@pytest.mark.newest_only
def test_amp_default_on_unmoved_operands_is_silent(fresh_warnings):
    # Operands that arrive in float32 and stay float32: no precision changed.
    table = {k: v for k, v in default_amp_policy.items() if k is not jax.lax.sin_p}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp(lambda x: jnp.sin(x) + 1.0, amp_policy=table)(X)


@pytest.mark.newest_only
def test_ints_bools_and_float64_are_never_cast():
    def f(i, b, x):
        return i * 2, jnp.logical_not(b), x @ x.T

    with jax.enable_x64(True):
        x64 = jnp.ones((3, 3), jnp.float64)
        jaxpr = jax.make_jaxpr(amp(f))(jnp.arange(3), jnp.array([True]), x64)
        assert_all_matmuls_in(jaxpr, jnp.float64)
        assert not [e for e in iter_eqns(jaxpr) if e.primitive.name == "convert_element_type"]


# --- amp_stop reaches nested bodies ---------------------------------------------------


@pytest.mark.newest_only
def test_amp_stop_reaches_jit_scan_and_remat_called_from_the_region():
    @jax.jit
    def jitted(w, x):
        return x @ w

    def scanned(w, x):
        return jax.lax.scan(lambda c, _: (c @ w[:4, :4], None), x[:, :4], None, length=2)[0]

    def f(w, x):
        with amp_stop():
            a = jitted(w, x)
            b = scanned(w, x)
            c = jax.checkpoint(lambda x: x @ w)(x)
        return a, b, c, x @ w

    dots = matmul_operand_dtypes(jax.make_jaxpr(amp(f))(W, X))
    assert [d[1][0] for d in dots] == [jnp.float32] * 3 + [jnp.float16]


# --- composition ----------------------------------------------------------------------


@pytest.mark.newest_only
def test_grad_of_float32_params_is_float32():
    grads = jax.grad(amp(_mlp), argnums=(0, 1))(W, X)
    assert all(g.dtype == jnp.float32 for g in grads)
    np.testing.assert_allclose(grads[0], jax.grad(_mlp)(W, X), rtol=2e-2, atol=2e-2)
    assert_all_matmuls_in(jax.make_jaxpr(jax.grad(amp(_mlp)))(W, X), jnp.float16, at_least=2)


@pytest.mark.newest_only
def test_inside_and_around_jit_and_vmap():
    f = amp(_mlp, compute_dtype="bf16")
    expected = f(W, X)
    # XLA may fuse a compiled bf16 program differently from op-by-op execution.
    np.testing.assert_allclose(jax.jit(f)(W, X), expected, rtol=1e-2)
    np.testing.assert_allclose(amp(jax.jit(_mlp), compute_dtype="bf16")(W, X), expected, rtol=1e-2)
    assert_all_matmuls_in(jax.make_jaxpr(amp(jax.jit(_mlp), compute_dtype="bf16"))(W, X), jnp.bfloat16)
    batched = jax.vmap(f, in_axes=(None, 0))(W, X[:, None, :])
    np.testing.assert_allclose(batched, jnp.stack([f(W, x[None]) for x in X]), rtol=1e-2)


@pytest.mark.newest_only
def test_retrace_reads_python_state_afresh_unless_fn_is_jitted():
    # Under a transformation amp is a transformation like grad: every re-trace
    # of the caller runs fn's Python again, so state fn reads (a schedule's
    # value in a global) is current. amp(jax.jit(fn)) opts into jit's trace
    # cache, with jit's semantics: fn's Python runs once per signature.
    state = {"beta": 1.0, "runs": 0}

    def loss(w, x):
        state["runs"] += 1
        return state["beta"] * jnp.sum(jnp.tanh(x @ w))

    def loss_grad(fn):
        return jax.grad(amp(fn, compute_dtype="bf16"))(W, X)

    first = loss_grad(loss)
    state["beta"] = 2.0
    np.testing.assert_allclose(loss_grad(loss), 2 * first, rtol=1e-2)
    assert state["runs"] == 2

    jitted = jax.jit(loss)
    state["runs"] = 0
    for _ in range(3):
        loss_grad(jitted)
    assert state["runs"] == 1
    jaxpr = jax.make_jaxpr(jax.grad(amp(jitted, compute_dtype="bf16")))(W, X)
    assert_all_matmuls_in(jaxpr, jnp.bfloat16, at_least=2)
    assert state["runs"] == 1


@pytest.mark.newest_only
def test_with_equinox_filtered_transforms():
    model = eqx.nn.MLP(6, 2, 8, 2, key=KEY)

    def loss(m, x):
        return jnp.mean(jax.vmap(m)(x) ** 2)

    grads = eqx.filter_jit(eqx.filter_grad(amp(loss, compute_dtype="bf16")))(model, X)
    leaves = jax.tree.leaves(eqx.filter(grads, eqx.is_array))
    assert leaves and all(g.dtype == jnp.float32 for g in leaves)
    out = eqx.filter_vmap(amp(model))(X)
    assert out.shape == (3, 2) and out.dtype == jnp.float32


@pytest.mark.newest_only
def test_nested_amp_behaves_as_amp():
    np.testing.assert_array_equal(amp(amp(_mlp))(W, X), amp(_mlp)(W, X))
    assert_all_matmuls_in(jax.make_jaxpr(amp(amp(_mlp)))(W, X), jnp.float16)


@pytest.mark.newest_only
def test_closures_over_arrays_and_traced_values():
    def outer(w, x):
        return amp(lambda x: x @ w)(x)  # w is a tracer of the outer grad

    g = jax.grad(lambda w: outer(w, X).sum())(W)
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, jax.grad(lambda w: (X @ w).sum())(W), rtol=1e-2)


@pytest.mark.newest_only
def test_function_returning_none_and_tuples():
    assert amp(lambda x: None)(X) is None
    a, (b,) = amp(lambda x: (x, (x * 2,)))(X)
    assert a.dtype == b.dtype == jnp.float32


# --- bad input ------------------------------------------------------------------------


def test_non_callable_is_a_type_error():
    with pytest.raises(TypeError, match="amp expects a callable.*int"):
        amp(3)


@pytest.mark.parametrize(
    "dtype, error, match",
    [
        (jnp.int32, TypeError, "int32"),
        ("f17", ValueError, "f17"),
        (jnp.float64, TypeError, "float64"),
        (object(), TypeError, "compute_dtype"),
    ],
)
def test_bad_compute_dtype(dtype, error, match):
    with pytest.raises(error, match=match):
        amp(_mlp, compute_dtype=dtype)


def test_bad_policy_tables():
    with pytest.raises(TypeError, match="amp_policy must be a dict"):
        amp(_mlp, amp_policy=[use_compute_precision])
    with pytest.raises(TypeError, match="keys must be primitives"):
        amp(_mlp, amp_policy={3: use_compute_precision})
    with pytest.raises(TypeError, match=r"amp_policy\['x'\] must be a rule"):
        amp(_mlp, amp_policy={"x": "bf16"})


def test_rule_returning_wrong_operand_count_names_the_rule():
    def drop_one(compute_dtype, original_dtypes, *invars, **params):
        return invars[:1], params

    with pytest.raises(ValueError, match="drop_one.*returned 1 operands.*takes 2"):
        amp(_mlp, amp_policy={jax.lax.dot_general_p: drop_one})(W, X)

    def not_a_pair(compute_dtype, original_dtypes, *invars, **params):
        return invars

    with pytest.raises(TypeError, match="not_a_pair.*must return \\(invars, bind_params\\)"):
        amp(_mlp, amp_policy={jax.lax.dot_general_p: not_a_pair})(W, X)


def test_amp_stop_rejects_non_callables():
    with pytest.raises(TypeError, match="amp_stop expects a function"):
        amp_stop(3)


def test_exports():
    for name in [
        "amp",
        "amp_stop",
        "default_amp_policy",
        "use_compute_precision",
        "use_original_precision",
        "use_precision",
        "use_widest_precision",
    ]:
        assert name in jaxamp.__all__


# --- policies -------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["p=f32,c=bf16,o=f32", jaxamp.Policy(jnp.float32, jnp.bfloat16, jnp.float32)])
def test_policy_sets_compute_dtype(policy):
    f = amp(_mlp, policy=policy)
    assert_all_matmuls_in(jax.make_jaxpr(f)(W, X), jnp.bfloat16)
    assert f(W, X).dtype == jnp.float32


@pytest.mark.newest_only
def test_policy_output_dtype_casts_floating_outputs_only():
    out = amp(lambda w, x: (x @ w, jnp.argmax(x, -1)), policy="c=bf16")(W, X)  # o follows c
    assert out[0].dtype == jnp.bfloat16 and out[1].dtype == jnp.int32
    out = amp(lambda w, x: x @ w, policy="p=f32,c=f16,o=f32")(W, X)
    assert out.dtype == jnp.float32


def test_policy_and_compute_dtype_must_agree():
    assert amp(_mlp, policy="c=bf16", compute_dtype="bf16")(W, X).dtype == jnp.bfloat16  # o follows c
    with pytest.raises(ValueError, match="disagree"):
        amp(_mlp, policy="c=bf16", compute_dtype="f16")
    with pytest.raises(ValueError, match="f17"):
        amp(_mlp, policy="c=f17")
    with pytest.raises(TypeError):
        amp(_mlp, policy=3)


# --- values beyond the half range -------------------------------------------------------


@pytest.mark.newest_only
def test_mask_constants_saturate_instead_of_becoming_inf():
    def masked_softmax(x, w, keep):
        return jax.nn.softmax(jnp.where(keep, x @ w, -1e9))  # -1e9 is -inf in float16

    x = jnp.array([[1.0, 2, 3], [4, 5, 6]])
    keep = jnp.array([[1, 1, 0], [0, 0, 0]], bool)  # second row fully masked
    out = amp(masked_softmax)(x, jnp.eye(3), keep)
    assert bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_allclose(out, masked_softmax(x, jnp.eye(3), keep), atol=2e-3)


@pytest.mark.parametrize("fill", ["literal", "computed"])
def test_a_bfloat16_mask_fill_saturates_to_float16s_range(fill):
    # A bfloat16 model under float16 (Tunix's Gemma keeps bfloat16 parameters):
    # 65504 rounds to 65536 in bfloat16, which is inf in float16, so a clamp
    # to it turned a fully masked (left-padded) row's -1e9 into -inf and its
    # softmax into NaN. The bound is bfloat16's largest value below: 65280.
    def masked_softmax(x, w, keep, big):
        fill_value = jnp.asarray(-1e9, jnp.bfloat16) if fill == "literal" else -big
        return jax.nn.softmax(jnp.where(keep, x @ w, fill_value).astype(jnp.bfloat16) @ w.T)

    x = jnp.array([[1.0, 2, 3], [4, 5, 6]], jnp.bfloat16)
    w = jnp.eye(3, dtype=jnp.bfloat16)
    keep = jnp.array([[1, 1, 0], [0, 0, 0]], bool)  # second row fully masked
    big = jnp.asarray(1e9, jnp.bfloat16)
    out = amp(masked_softmax, compute_dtype="f16")(x, w, keep, big)
    assert bool(jnp.all(jnp.isfinite(out))), out
    np.testing.assert_allclose(out.astype(np.float32), masked_softmax(x, w, keep, big).astype(np.float32), atol=1e-2)


@pytest.mark.newest_only
def test_unrepresentable_constants_saturate_to_the_half_maximum():
    # posinf = finfo(float32).max; the result feeds a matmul, so it is not the
    # program's tail (which runs in float32) and stays float16.
    g = lambda x, w: jnp.nan_to_num((x @ w) / 0.0) @ w  # noqa: E731
    out = amp(g)(jnp.ones((1, 2)), jnp.eye(2))
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, float(jnp.finfo(jnp.float16).max))


@pytest.mark.newest_only
def test_a_saturating_cast_saves_nothing_for_the_backward_pass():
    # haiku's Linear broadcasts its float32 bias to the output's shape before
    # adding it to the float16 matmul: the saturating cast of that bias saved
    # it in float32 and two boolean masks, all activation-sized. Its gradient
    # is the plain cast's: straight through.
    def linear(w, b, x):
        out = x @ w
        return out + jnp.broadcast_to(b, out.shape)

    def loss(w, b, x):
        return jnp.sum(linear(w, b, x) @ w)

    w, b, x = jnp.eye(8), jnp.full(8, 70000.0), jnp.ones((16, 8))
    amp_loss = amp(loss, compute_dtype="f16")
    saved = [(aval.dtype, aval.shape) for aval, _ in _compat.saved_residuals(amp_loss, w, b, x)]
    assert not [s for s in saved if s[1] == (16, 8) and s[0] != jnp.float16], saved
    # 70000 saturates to 65504 in the forward pass (the loss's matmul by the
    # identity sees it); the bias's gradient is the plain cast's: each of the
    # 16 rows adds the bias once.
    hidden = amp(lambda w, b, x: linear(w, b, x) @ w, compute_dtype="f16")(w, b, x)
    np.testing.assert_array_equal(hidden, 65504.0)
    np.testing.assert_array_equal(jax.grad(amp_loss, argnums=1)(w, b, x), jnp.full(8, 16.0))


@pytest.mark.newest_only
def test_prng_keys_pass_through():
    f = lambda k, x: jax.random.normal(k, x.shape) * (x @ x.T)  # noqa: E731
    for key in (jax.random.key(0), jax.random.PRNGKey(0)):
        np.testing.assert_allclose(amp(f)(key, jnp.ones((3, 3))), f(key, jnp.ones((3, 3))), rtol=1e-2)


def test_primitive_name_as_string_key_warns():
    with pytest.warns(UserWarning, match="'dot_general' is matched against jax.named_scope names"):
        amp(_mlp, amp_policy={"dot_general": use_original_precision})
