"""`jaxamp.compare`: error against float32 per scope, blamed where it starts.

SQNR figures are in dB. float16 keeps 11 significant bits (about 66 dB for a
rounded value), bfloat16 8 (about 48 dB); values below float16's smallest
normal (6.1e-5) lose bits: at 1e-6 the spacing of 6e-8 leaves about 30 dB.
The thresholds below sit between these.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp

WIDTH = 64


def _params():
    keys = jax.random.split(jax.random.key(0), 4)
    params = tuple(jax.random.normal(keys[i], (WIDTH, WIDTH)) / 8 for i in range(3))
    return params, jax.random.normal(keys[3], (32, WIDTH))


def _badly_scaled(params, x):
    w1, w2, w3 = params
    with jax.named_scope("first"):
        h = jnp.tanh(x @ w1)
    with jax.named_scope("bad"):
        h = (h * 1e-6) @ w2  # about 1e-6: below float16's normal range
    with jax.named_scope("after"):
        h = jnp.tanh(((h * 1000.0) * 1000.0) @ w3)  # back to about 1, exactly in float16
    return jnp.mean(h**2)


def test_the_badly_scaled_layer_is_named_first_and_the_layer_after_it_is_not_blamed():
    params, x = _params()
    report = jaxamp.compare(_badly_scaled, compute_dtype="f16")(params, x)
    by_scope = {s.scope: s for s in report.scopes}
    assert report.scopes[0].scope == "bad", str(report)
    assert by_scope["bad"].local_db < 40 < by_scope["first"].local_db, str(report)
    # The layer after it adds little of its own, but carries the damage.
    assert by_scope["after"].local_db > by_scope["bad"].local_db + 20, str(report)
    assert by_scope["after"].accumulated_db < by_scope["bad"].local_db + 3, str(report)
    assert by_scope["bad"].dtypes == ("f16",)
    assert str(report).splitlines()[2].startswith("bad"), str(report)


def test_figures_equal_a_direct_computation():
    params, x = _params()
    w1, _, _ = params
    report = jaxamp.compare(_badly_scaled, compute_dtype="bf16")(params, x)
    first = next(s for s in report.scopes if s.scope == "first")

    def sqnr(ref, got):
        ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
        return 10 * math.log10(np.sum(ref**2) / np.sum((got - ref) ** 2))

    # "first" is the first layer: its inputs are the arguments, so local and
    # accumulated agree, and equal bf16's tanh(x @ w1) handed on in bf16.
    reference = jnp.tanh(x @ w1)
    amp_value = jnp.tanh(x.astype(jnp.bfloat16) @ w1.astype(jnp.bfloat16))
    np.testing.assert_allclose(first.local_db, sqnr(reference, amp_value.astype(jnp.float32)), atol=1e-6)
    np.testing.assert_allclose(first.accumulated_db, first.local_db, atol=1e-6)
    # The output and the gradients, against jax.grad of both.
    amp_loss = jaxamp.amp(_badly_scaled, compute_dtype="bf16")
    np.testing.assert_allclose(report.output_db, sqnr(_badly_scaled(params, x), amp_loss(params, x)), atol=1e-6)
    want = jax.grad(_badly_scaled)(params, x)[1]  # w2's gradient: argument path [0][1]
    got = jax.grad(amp_loss)(params, x)[1]
    np.testing.assert_allclose(
        next(g.sqnr_db for g in report.gradients if g.path == "[0][1]"), sqnr(want, got), atol=1e-3
    )
    assert {g.path for g in report.gradients} == {"[0][0]", "[0][1]", "[0][2]", "[1]"}
    assert [g.sqnr_db for g in report.gradients] == sorted(g.sqnr_db for g in report.gradients)


@pytest.mark.parametrize(
    "options",
    [
        {"compute_dtype": jaxamp.fp8.Fp8Recipe(keep_small_bf16=None)},
        {"policy": "p=f32,c=bf16,o=f32"},
        {"policy": "p=f32,c=f16,o=f32"},
    ],
    ids=["fp8", "policy-bf16", "policy-f16"],
)
def test_fp8_and_policy_strings(options):
    params, x = _params()
    report = jaxamp.compare(_badly_scaled, **options)(params, x)
    assert {s.scope for s in report.scopes} >= {"first", "bad", "after"}
    if "compute_dtype" in options:
        # float8's 3 mantissa bits: far below bfloat16's figures (about 48 dB).
        bf16 = jaxamp.compare(_badly_scaled, compute_dtype="bf16")(params, x)
        first = lambda r: next(s for s in r.scopes if s.scope == "first")  # noqa: E731
        assert first(report).local_db < first(bf16).local_db - 10, str(report)
        assert report.compute_dtype == "e4m3"


def test_unscoped_equations_are_grouped_by_source_line_and_the_float32_tail_is_exact():
    params, x = _params()

    def loss(params, x):
        w1, w2, _ = params
        h = jnp.tanh(x @ w1)
        out = h @ w2
        return jnp.mean(out**2)

    report = jaxamp.compare(loss, compute_dtype="bf16")(params, x)
    scopes = [s.scope for s in report.scopes]
    assert len(scopes) == 3 and all(s.startswith("test_compare.py:") for s in scopes), scopes
    # The loss (the program's tail) runs in float32 on what reaches it: it adds nothing.
    tail = next(s for s in report.scopes if s.dtypes == ("f32",))
    assert tail.local_db == math.inf and "exact" in str(report)
    # What it hands on is the loss, not the values nothing reads.
    assert tail.accumulated_db == report.output_db


def test_values_nothing_reads_are_not_what_a_scope_hands_on():
    params, x = _params()

    def loss(params, x):
        logits = x @ params[0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1))  # computes a sign it never reads

    report = jaxamp.compare(loss, compute_dtype="f16")(params, x)
    tail = next(s for s in report.scopes if s.dtypes == ("f32",))
    assert tail.accumulated_db == report.output_db, str(report)


def test_inside_scan_and_with_equinox_modules():
    mlp = eqx.nn.MLP(WIDTH, WIDTH, WIDTH, depth=2, key=jax.random.key(1))
    _, x = _params()
    ws = jax.random.normal(jax.random.key(2), (3, WIDTH, WIDTH)) / 8

    def loss(model, ws, x):
        def layer(h, w):
            with jax.named_scope("layer"):
                return jnp.tanh(h @ w), None

        h, _ = jax.lax.scan(layer, x, ws)
        with jax.named_scope("mlp"):
            out = jax.vmap(model)(h)
        return jnp.mean(out**2)

    report = jaxamp.compare(loss, compute_dtype="bf16")(mlp, ws, x)
    by_scope = {s.scope: s for s in report.scopes}
    assert {"layer", "mlp/eqx.nn.MLP/eqx.nn.Linear"} <= set(by_scope), str(report)
    assert 35 < by_scope["layer"].local_db < 70, str(report)
    assert any(g.path.startswith("[0]") for g in report.gradients)


def test_a_non_scalar_function_has_no_gradients():
    params, x = _params()
    report = jaxamp.compare(lambda p, x: jnp.tanh(x @ p[0]), compute_dtype="bf16")(params, x)
    assert report.gradients == () and report.scopes


def test_bad_input():
    with pytest.raises(TypeError, match="compare expects a callable"):
        jaxamp.compare(3)
    with pytest.raises(ValueError, match="f17"):
        jaxamp.compare(_badly_scaled, compute_dtype="f17")
    params, x = _params()
    with pytest.raises(TypeError, match="needs concrete arrays"):
        jax.jit(jaxamp.compare(_badly_scaled))(params, x)


def test_nans_where_float32_has_them_too_are_not_amp_errors():
    params, x = _params()

    def log_of(params, x):
        with jax.named_scope("log"):
            return jnp.tanh(x @ params[0]) + jnp.log(x[:, :1])  # NaN rows where x[:, 0] < 0, in both runs

    report = jaxamp.compare(log_of, compute_dtype="bf16")(params, x)
    assert 30 < report.output_db < math.inf, str(report)
    # amp going non-finite where float32 does not is reported as such.
    overflowing = lambda p, x: jnp.tanh((x * 3e4) @ (p[0] * 3e4))  # noqa: E731
    assert "nonfinite" in str(jaxamp.compare(overflowing, compute_dtype="f16")(params, x))
