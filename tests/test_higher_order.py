"""amp inside higher-order primitives: bodies rewritten, parameters kept, types stable."""

import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxamp import _compat, amp, default_amp_policy

from jaxpr_walk import assert_all_matmuls_in, iter_eqns, scan_num_consts

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals

KEY = jax.random.PRNGKey(0)
W = jax.random.normal(KEY, (8, 8)) / 3
X = jax.random.normal(jax.random.PRNGKey(1), (4, 8))


def _eqns(jaxpr, name):
    return [e for e in iter_eqns(jaxpr) if e.primitive.name == name]


@pytest.mark.newest_only
def test_jit_parameters_are_kept():
    mesh = jax.make_mesh((8,), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    inner = jax.jit(lambda w, x: jnp.tanh(x @ w), donate_argnums=1, out_shardings=sharding, inline=False)

    def f(w, x):
        return inner(w, x)

    x = jnp.ones((8, 8))
    before = _eqns(jax.make_jaxpr(f)(W, x), "jit")[0].params
    jaxpr = jax.make_jaxpr(amp(f, compute_dtype="bf16"))(W, x)
    (after,) = [e.params for e in _eqns(jaxpr, "jit") if e.params["name"] == before["name"]]
    for name in ("donated_invars", "out_shardings", "in_shardings", "name", "inline", "keep_unused"):
        assert after[name] == before[name], name
    assert_all_matmuls_in(jaxpr, jnp.bfloat16)
    out = jax.jit(amp(f, compute_dtype="bf16"))(W, x)
    assert out.sharding.spec == P("d")


@pytest.mark.parametrize("reverse, unroll", [(False, 1), (True, 2)])
@pytest.mark.newest_only
def test_scan_parameters_kept_and_carry_type_stable(reverse, unroll):
    def f(w, x):
        def body(h, xi):
            h = jnp.tanh(h @ w) + xi  # leaves the matmul in compute dtype
            return h, h.sum()

        return jax.lax.scan(body, x[0], x, reverse=reverse, unroll=unroll)

    jaxpr = jax.make_jaxpr(amp(f))(W, X)
    scan = _eqns(jaxpr, "scan")[0]
    assert (scan.params["length"], scan.params["reverse"], scan.params["unroll"]) == (4, reverse, unroll)
    body = scan.params["jaxpr"]
    n = scan_num_consts(scan.params)
    carry_in = [a.dtype for a in body.in_avals[n : n + 1]]
    assert carry_in == [a.dtype for a in body.out_avals[:1]]
    assert_all_matmuls_in(jaxpr, jnp.float16)
    (h, ys), (h0, ys0) = amp(f)(W, X), f(W, X)
    assert h.dtype == ys.dtype == jnp.float32
    np.testing.assert_allclose(h, h0, atol=2e-2)
    np.testing.assert_allclose(ys, ys0, atol=5e-2)


@pytest.mark.newest_only
def test_scan_carry_that_cannot_settle_falls_back_to_original_dtype():
    def body(c, _):
        # The carry alternates: the matmul half-casts it, exp returns float32.
        return jnp.exp(c @ W) * 0 + c, None

    jaxpr = jax.make_jaxpr(amp(lambda x: jax.lax.scan(body, x, None, length=3)[0]))(X)
    scan = _eqns(jaxpr, "scan")[0]
    n = scan_num_consts(scan.params)
    assert scan.params["jaxpr"].in_avals[n].dtype == scan.params["jaxpr"].out_avals[0].dtype


def test_while_loop_carry_type_stable():
    def f(w, x):
        def body(state):
            i, h = state
            return i + 1, jnp.tanh(h @ w) + h

        return jax.lax.while_loop(lambda s: s[0] < 3, body, (0, x))[1]

    jaxpr = jax.make_jaxpr(amp(f))(W, X)
    loop = _eqns(jaxpr, "while")[0]
    body = loop.params["body_jaxpr"]
    n = loop.params["body_nconsts"]
    assert [a.dtype for a in body.in_avals[n:]] == [a.dtype for a in body.out_avals]
    assert_all_matmuls_in(jaxpr, jnp.float16)
    np.testing.assert_allclose(amp(f)(W, X), f(W, X), atol=3e-2)


def test_cond_branches_agree_on_output_types():
    def f(p, w, x):
        # One branch leaves a matmul (compute dtype), the other stays float32.
        return jax.lax.cond(p, lambda x: x @ w, lambda x: x * 2.0, x)

    jaxpr = jax.make_jaxpr(amp(f))(True, W, X)
    cond = _eqns(jaxpr, "cond")[0]
    outs = {tuple(a.dtype for a in b.out_avals) for b in cond.params["branches"]}
    assert len(outs) == 1
    assert_all_matmuls_in(jaxpr, jnp.float16)
    for p in (True, False):
        np.testing.assert_allclose(amp(f)(p, W, X), f(p, W, X), atol=3e-2)


@pytest.mark.newest_only
def test_switch_with_matching_branches_stays_in_compute_dtype():
    def f(i, w, x):
        return jax.lax.switch(i, [lambda x: x @ w, lambda x: (x @ w) * 2, lambda x: -(x @ w)], x)

    cond = _eqns(jax.make_jaxpr(amp(f))(1, W, X), "cond")[0]
    assert all(b.out_avals[0].dtype == jnp.float16 for b in cond.params["branches"])
    for i in range(3):
        np.testing.assert_allclose(amp(f)(i, W, X), f(i, W, X), atol=3e-2)


@pytest.mark.newest_only
def test_remat_policy_and_prevent_cse_kept():
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable

    def f(w, x):
        return jax.checkpoint(lambda x: jnp.sin(x @ w), policy=policy, prevent_cse=False)(x).sum()

    jaxpr = jax.make_jaxpr(amp(f))(W, X)
    # amp's own recompute of the loss (its tail, `sum`) is a second remat; the user's keeps its settings.
    remats = [e for e in iter_eqns(jaxpr) if e.primitive.name in ("remat2", "checkpoint", "remat")]
    (remat,) = [e for e in remats if e.params["policy"] is policy]
    assert remat.params["policy"] is policy and remat.params["prevent_cse"] is False
    grad_jaxpr = jax.make_jaxpr(jax.grad(amp(f)))(W, X)
    assert_all_matmuls_in(grad_jaxpr, jnp.float16, at_least=2)
    np.testing.assert_allclose(jax.grad(amp(f))(W, X), jax.grad(f)(W, X), atol=5e-2)


@jax.custom_jvp
def _scaled_sin(w, x):
    return jnp.sin(x @ w)


@_scaled_sin.defjvp
def _scaled_sin_jvp(primals, tangents):
    w, x = primals
    tw, tx = tangents
    # Deliberately 3x the true derivative: proves the rule, not autodiff, runs.
    return _scaled_sin(w, x), 3.0 * jnp.cos(x @ w) * (x @ tw + tx @ w)


@pytest.mark.newest_only
def test_custom_jvp_rule_stays_in_force_with_compute_dtype_matmuls():
    f = lambda w, x: _scaled_sin(w, x).sum()  # noqa: E731
    g = jax.grad(amp(f))(W, X)
    np.testing.assert_allclose(g, jax.grad(f)(W, X), rtol=3e-2, atol=3e-2)
    np.testing.assert_allclose(g, 3 * jax.grad(lambda w, x: jnp.sin(x @ w).sum())(W, X), rtol=3e-2, atol=3e-2)
    assert g.dtype == jnp.float32
    assert_all_matmuls_in(jax.make_jaxpr(amp(f))(W, X), jnp.float16)
    assert_all_matmuls_in(jax.make_jaxpr(jax.grad(amp(f)))(W, X), jnp.float16, at_least=3)


@jax.custom_vjp
def _odd_tanh(w, x):
    return jnp.tanh(x @ w)


def _odd_tanh_fwd(w, x):
    y = jnp.tanh(x @ w)
    return y, (w, x, y)


def _odd_tanh_bwd(res, g):
    w, x, y = res
    g = -g * (1 - y**2)  # deliberately negated
    return x.T @ g, g @ w.T


_odd_tanh.defvjp(_odd_tanh_fwd, _odd_tanh_bwd)


@pytest.mark.newest_only
def test_custom_vjp_rule_stays_in_force_with_compute_dtype_matmuls():
    f = lambda w, x: _odd_tanh(w, x).sum()  # noqa: E731
    gw, gx = jax.grad(amp(f), argnums=(0, 1))(W, X)
    true_w, true_x = jax.grad(lambda w, x: jnp.tanh(x @ w).sum(), argnums=(0, 1))(W, X)
    np.testing.assert_allclose(gw, -true_w, rtol=3e-2, atol=3e-2)
    np.testing.assert_allclose(gx, -true_x, rtol=3e-2, atol=3e-2)
    assert gw.dtype == gx.dtype == jnp.float32
    # forward matmul and both backward matmuls of the user's bwd rule
    assert_all_matmuls_in(jax.make_jaxpr(jax.grad(amp(f)))(W, X), jnp.float16, at_least=3)


@pytest.mark.newest_only
def test_custom_vjp_under_jit_vmap_and_value_and_grad():
    f = lambda w, x: _odd_tanh(w, x).sum()  # noqa: E731
    v, g = jax.jit(jax.value_and_grad(amp(f)))(W, X)
    assert v.dtype == g.dtype == jnp.float32
    per_example = jax.vmap(jax.grad(amp(f)), in_axes=(None, 0))(W, X[:, None])
    assert per_example.shape == (4, 8, 8) and per_example.dtype == jnp.float32


# Closed-over arrays: JAX traces a custom rule's body with them as constants
# (from JAX 0.12 the traced rule's leading inputs, not constvars).
_LABELS = jnp.linspace(-1.0, 1.0, 32).reshape(4, 8)
_MASK = (jnp.arange(8) % 2).astype(jnp.float32)


@jax.custom_vjp
def _closed_over_loss(w, x):
    return jnp.sum((jnp.tanh(x @ w) - _LABELS) ** 2)


def _closed_over_loss_fwd(w, x):
    y = jnp.tanh(x @ w)
    err = (y - _LABELS) * _MASK + (y - _LABELS) * (1 - _MASK)  # y - labels, via an array only the rule closes over
    return jnp.sum((y - _LABELS) ** 2), (w, x, y, err)


def _closed_over_loss_bwd(res, g):
    w, x, y, err = res
    d = 7.0 * g * 2 * err * (1 - y**2)  # deliberately 7x the true derivative
    return x.T @ d, d @ w.T


_closed_over_loss.defvjp(_closed_over_loss_fwd, _closed_over_loss_bwd)


@jax.custom_jvp
def _closed_over_jvp_loss(w, x):
    return jnp.sum((jnp.tanh(x @ w) - _LABELS) ** 2)


@_closed_over_jvp_loss.defjvp
def _closed_over_jvp_loss_jvp(primals, tangents):
    (w, x), (tw, tx) = primals, tangents
    y = jnp.tanh(x @ w)
    d = 2 * (y - _LABELS) * _MASK + 2 * (y - _LABELS) * (1 - _MASK)  # as in the custom_vjp's fwd
    # Deliberately 7x the true derivative.
    return _closed_over_jvp_loss(w, x), 7.0 * jnp.sum(d * (1 - y**2) * (x @ tw + tx @ w))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("with_value", [True, False], ids=["value_and_grad", "grad"])
@pytest.mark.parametrize("loss", [_closed_over_loss, _closed_over_jvp_loss], ids=["custom_vjp", "custom_jvp"])
@pytest.mark.newest_only
def test_custom_rules_closing_over_arrays(loss, with_value, jit):
    # Regression: the rule's traced constants were passed where amp expected
    # none ("zip() argument 2 is shorter than argument 1" on JAX 0.12).
    f = lambda w, x: loss(w, x * 2.0)  # noqa: E731
    true = lambda w, x: jnp.sum((jnp.tanh(2.0 * x @ w) - _LABELS) ** 2)  # noqa: E731
    transform = jax.value_and_grad if with_value else jax.grad
    run = transform(amp(f), argnums=(0, 1))
    out = (jax.jit(run) if jit else run)(W, X)
    value, (gw, gx) = out if with_value else (None, out)
    want_w, want_x = jax.grad(f, argnums=(0, 1))(W, X)  # float32, the same rule
    true_w, true_x = jax.grad(true, argnums=(0, 1))(W, X)
    # float16 matmuls: within 3e-2 of float32's gradient
    np.testing.assert_allclose(gw, want_w, rtol=3e-2, atol=3e-2)
    np.testing.assert_allclose(gx, want_x, rtol=3e-2, atol=3e-2)
    # The custom rule ran: 7x autodiff's gradient.
    np.testing.assert_allclose(gw, 7 * true_w, rtol=3e-2, atol=3e-2)
    np.testing.assert_allclose(gx, 7 * true_x, rtol=3e-2, atol=3e-2)
    assert gw.dtype == gx.dtype == jnp.float32
    assert_all_matmuls_in(jax.make_jaxpr(run)(W, X), jnp.float16, at_least=3)
    if with_value:
        np.testing.assert_allclose(value, f(W, X), rtol=3e-2)
        assert value.dtype == jnp.float32


@pytest.mark.parametrize(
    "make_mesh",
    [
        lambda: jax.make_mesh((8,), ("d",)),
        lambda: Mesh(np.array(jax.devices()), ("d",)),
    ],
    ids=["make_mesh", "Mesh"],
)
@pytest.mark.newest_only
def test_shard_map_body_in_compute_dtype_with_collectives_untouched(make_mesh):
    mesh = make_mesh()

    @partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())
    def f(w, x):
        return jax.lax.psum((x @ w).sum(axis=0), "d")

    x = jax.device_put(jax.random.normal(KEY, (16, 8)), NamedSharding(mesh, P("d")))
    jaxpr = jax.make_jaxpr(amp(f, compute_dtype="bf16"))(W, x)
    assert_all_matmuls_in(jaxpr, jnp.bfloat16)
    assert _eqns(jaxpr, "psum") or _eqns(jaxpr, "psum2") or _eqns(jaxpr, "psum_invariant")
    sm = _eqns(jaxpr, "shard_map")[0]
    assert sm.params["mesh"] == mesh
    out = jax.jit(amp(f, compute_dtype="bf16"))(W, x)
    np.testing.assert_allclose(out, f(W, x), rtol=3e-2, atol=5e-2)
    with jax.set_mesh(mesh):  # explicit-axis meshes need one for the reduction
        g = jax.grad(lambda w: amp(f, compute_dtype="bf16")(w, x).sum())(W)
        g0 = jax.grad(lambda w: f(w, x).sum())(W)
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, g0, rtol=5e-2, atol=5e-2)


@pytest.mark.newest_only
def test_closed_call_body_is_rewritten():
    from jax.extend.core import ClosedJaxpr
    from jax.extend.core.primitives import closed_call_p

    inner = jax.make_jaxpr(lambda w, x: x @ w)(W, X)

    def f(w, x):
        params = closed_call_p.get_bind_params({"call_jaxpr": ClosedJaxpr(inner.jaxpr, inner.consts)})
        return closed_call_p.bind(w, x, **params)[0]

    assert_all_matmuls_in(jax.make_jaxpr(amp(f))(W, X), jnp.float16)
    np.testing.assert_allclose(amp(f)(W, X), X @ W, atol=3e-2)


def test_handler_broken_by_a_jax_upgrade_falls_back_to_original_precision(monkeypatch):
    from jaxamp import _compat
    from jaxamp.transform import _interpreter

    def broken(ctx, eqn, invals):
        # What a `_compat` accessor raises when an internal it reads has moved.
        raise _compat.JaxInternalsChanged("scan_layout: KeyError: 'num_consts'")

    monkeypatch.setitem(_interpreter.HANDLERS, _compat.scan_p, broken)

    def f(w, x):
        return jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=2)[0]

    with pytest.warns(RuntimeWarning, match="could not rewrite 'scan'.*original precision"):
        jaxpr = jax.make_jaxpr(amp(f))(W, X)
    assert_all_matmuls_in(jaxpr, jnp.float32)
    np.testing.assert_allclose(amp(f)(W, X), f(W, X), rtol=1e-6)


def test_compat_accessor_reports_moved_internals_as_such():
    from jaxamp import _compat

    with pytest.raises(_compat.JaxInternalsChanged, match="scan_layout: KeyError"):
        _compat.scan_layout({})


class RuleError(KeyError):
    pass


def _raising_rule(compute_dtype, original_dtypes, *invars, **params):
    raise RuleError("the user's rule failed")


@pytest.mark.parametrize(
    "wrap",
    [
        pytest.param(jax.jit, id="jit"),
        pytest.param(
            lambda f: lambda w, x: jax.lax.scan(lambda c, _: (f(w, c), None), x, None, length=2)[0], id="scan"
        ),
        pytest.param(jax.checkpoint, id="remat"),
    ],
)
def test_errors_in_rules_inside_bodies_propagate_on_every_call(wrap):
    # A rule raising KeyError (or any error) inside a jit'd or scanned body is
    # the user's error: it must surface unchanged, not be reported as a JAX
    # upgrade problem and then silently run the body in float32.
    def layer(w, x):
        return jnp.tanh(x @ w)

    table = default_amp_policy | {jax.lax.tanh_p: _raising_rule}
    f = amp(wrap(layer), amp_policy=table)
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # and no "could not rewrite" warning either
            with pytest.raises(RuleError, match="the user's rule failed"):
                jax.make_jaxpr(f)(W, X)


def test_errors_in_user_code_inside_custom_vjp_bwd_propagate():
    @jax.custom_vjp
    def g(x):
        return x * 2

    def fwd(x):
        return g(x), None

    def bwd(_, ct):
        raise AttributeError("bug in the user's bwd")

    g.defvjp(fwd, bwd)

    def loss(w, x):
        return jnp.sum(g(x @ w))

    with pytest.raises(AttributeError, match="bug in the user's bwd"):
        jax.grad(amp(loss))(W, X)


# --- calls of inline jit'd functions (most of jax.numpy) -----------------------


def _inline_layer(w, x):
    return jnp.tanh(x @ w)


# How jax.numpy marks the functions whose bodies JAX inlines while tracing:
# ``inline=True`` on JAX 0.10; on 0.11 that means inlined at lowering, and
# tracing-time inlining is ``jax.Inline.JAX_EARLY``.
INLINED_WHILE_TRACING = jax.Inline.JAX_EARLY if hasattr(jax, "Inline") else True
INLINE_LAYER = jax.jit(_inline_layer, inline=INLINED_WHILE_TRACING)


def _four_inline_layers(w, x):
    for _ in range(4):
        x = INLINE_LAYER(w, x)
    return jnp.sum(x**2)


@pytest.mark.newest_only
def test_each_distinct_inline_call_is_rewritten_once():
    # A rule that counts its calls: amp rewrites the shared body once per
    # operand dtypes, not once per call site, so JAX's per-jaxpr caches
    # (linearize, transpose) hit as they do without amp. The first call gets a
    # float32 x, the other three the float16 output of the one before.
    calls = []

    def counting(compute_dtype, original_dtypes, *invars, **params):
        calls.append(original_dtypes)
        return invars, params

    table = default_amp_policy | {jax.lax.tanh_p: counting}
    jaxpr = jax.make_jaxpr(jax.grad(amp(_four_inline_layers, amp_policy=table)))(W, X)
    # The last call's tanh is part of the loss (the tail), as it would be
    # inline: a third rewrite.
    assert len(calls) == 3
    # 4 forward, 4 for the weight gradient, 3 carrying it back through x.
    assert_all_matmuls_in(jaxpr, jnp.float16, at_least=11)


@pytest.mark.newest_only
def test_inline_calls_are_inlined_as_without_amp():
    # amp keeps the call while it rewrites, and JAX inlines it when amp binds it,
    # so the rewritten program has the structure JAX gives the original.
    plain = jax.make_jaxpr(_four_inline_layers)(W, X)
    mixed = jax.make_jaxpr(amp(_four_inline_layers))(W, X)
    assert not _eqns(plain, "jit") and not _eqns(mixed, "jit")
    assert len(_eqns(mixed, "dot_general")) == len(_eqns(plain, "dot_general")) == 4
    g, g0 = jax.grad(amp(_four_inline_layers))(W, X), jax.grad(_four_inline_layers)(W, X)
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, g0, rtol=2e-2, atol=2e-2)


@pytest.mark.newest_only
def test_rewritten_equations_keep_the_users_source_lines():
    def f(w, x):
        return jnp.where(x > 0, x @ w, 0.0).sum()  # every op here sits in a jnp jit

    line = f.__code__.co_firstlineno + 1
    for fn in (amp(f), jax.grad(amp(f))):
        jaxpr = jax.make_jaxpr(fn)(W, X)
        dots = _eqns(jaxpr, "dot_general")
        frames = [_compat.eqn_user_frame(e) for e in dots]
        assert dots and all(fr is not None and fr.file_name == __file__ and fr.start_line == line for fr in frames), [
            _compat.frame_line(fr) for fr in frames
        ]
