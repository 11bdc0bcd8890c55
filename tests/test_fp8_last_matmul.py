"""fp8 mode keeps the program's last matmul (the head) in bf16, and only it.

The last matmul is found by its place in the program: the matmul whose result
reaches the output with no matmul after it. Layers of the head's shape, a
layer's jit'd body shared with the head, an embedding reused as the head and a
scan over layers all stay in float8. Shares are counted on the amp'd jaxpr
itself (float8 operands or not, times each scan's length), and in `explain`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._jaxpr import equation_flops

from jaxpr_walk import iter_eqns

# Small matmuls: the size rule off, so that only the last-matmul rule decides.
FP8 = jaxamp.fp8.Fp8Recipe(keep_small_bf16=None)
E4M3 = np.dtype(jnp.float8_e4m3fn)
HEAD = "kept bf16: the program's last matmul (keep_last_matmul_bf16)"
WIDTH = 256
KEYS = jax.random.split(jax.random.key(0), 8)
X = jax.random.normal(KEYS[0], (64, WIDTH))
LAYERS = [jax.random.normal(k, (WIDTH, WIDTH)) / 16 for k in KEYS[1:5]]
HEAD_W = jax.random.normal(KEYS[5], (WIDTH, WIDTH)) / 16


def _loss(logits):
    return jax.nn.logsumexp(logits, axis=-1).mean()


def _float8_share(fn, *args) -> float:
    """Share of the amp'd program's dot_general FLOPs with float8 operands (scan lengths counted)."""
    flops = {True: 0, False: 0}

    def walk(jaxpr, times):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                flops[all(v.aval.dtype == E4M3 for v in eqn.invars[:2])] += times * equation_flops(eqn)
            inner = times * eqn.params["length"] if eqn.primitive.name == "scan" else times
            for value in eqn.params.values():
                for body in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(body, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
                        walk(getattr(body, "jaxpr", body), inner)

    walk(jax.make_jaxpr(jaxamp.amp(fn, compute_dtype=FP8))(*args).jaxpr, 1)
    return flops[True] / (flops[True] + flops[False])


def _details(fn, *args):
    report = jaxamp.explain(fn, compute_dtype=FP8)(*args)
    return report, [r.detail for r in report.rows if r.primitive == "dot_general"]


def _assert_only_the_last_kept(details, float8):
    assert details[-1] == HEAD, details
    assert len(details) == float8 + 1 and all(d.startswith("float8 e4m3 x e4m3") for d in details[:-1]), details


def test_an_equal_width_mlp_keeps_only_its_head_in_bf16():
    # Before, every matmul of the head's shape was "the last": 0.0% in float8.
    def mlp(layers, head, x):
        for w in layers:
            x = jax.nn.relu(x @ w)
        return _loss(x @ head)

    assert _float8_share(mlp, LAYERS, HEAD_W, X) == pytest.approx(0.8)
    report, details = _details(mlp, LAYERS, HEAD_W, X)
    assert report.fp8_flop_fraction == pytest.approx(0.8)
    _assert_only_the_last_kept(details, 4)


def test_an_embedding_reused_as_the_head_runs_in_float8_as_the_input_layer():
    # Tied weights: one_hot(tokens) @ emb in, h @ emb.T out. The same weight,
    # the same shapes: only the use that ends the program is the head.
    tokens = jax.random.randint(KEYS[6], (64,), 0, WIDTH)

    def tied(emb, w, tokens):
        h = jax.nn.one_hot(tokens, WIDTH) @ emb
        h = jax.nn.relu(h @ w)
        return _loss(h @ emb.T)

    assert _float8_share(tied, HEAD_W, LAYERS[0], tokens) == pytest.approx(2 / 3)
    _, details = _details(tied, HEAD_W, LAYERS[0], tokens)
    _assert_only_the_last_kept(details, 2)


def test_one_jitted_layer_called_for_every_layer_keeps_the_head_call_only():
    # One jit'd body for all four calls (one equation object): the fourth
    # call computes the head.
    layer = jax.jit(lambda h, w: jax.nn.relu(h @ w))

    def model(layers, x):
        for w in layers:
            x = layer(x, w)
        return _loss(x)

    assert _float8_share(model, LAYERS, X) == pytest.approx(0.75)
    report, details = _details(model, LAYERS, X)
    assert report.fp8_flop_fraction == pytest.approx(0.75)
    _assert_only_the_last_kept(details, 3)
    # The layers whose operands arrive alike still share one amp'd body (JAX's
    # caches keep hitting); the first takes float32 input, the head differs.
    closed = jax.make_jaxpr(jaxamp.amp(model, compute_dtype=FP8))(LAYERS, X)
    calls = [e.params["jaxpr"] for e in closed.jaxpr.eqns if e.primitive.name == "jit"]
    assert len(calls) == 4 and calls[1] is calls[2] and calls[3] is not calls[2]


def test_a_scan_over_layers_runs_in_float8_and_its_head_in_bf16():
    stacked = jnp.stack(LAYERS)

    def model(stacked, head, x):
        x, _ = jax.lax.scan(lambda h, w: (jax.nn.relu(h @ w), None), x, stacked)
        return _loss(x @ head)

    assert _float8_share(model, stacked, HEAD_W, X) == pytest.approx(0.8)
    report, details = _details(model, stacked, HEAD_W, X)
    assert report.fp8_flop_fraction == pytest.approx(0.8)
    _assert_only_the_last_kept(details, 1)  # (one row: the scan's body, 4 iterations)


def test_a_scan_over_layers_with_no_head_after_it_runs_wholly_in_float8():
    # Each iteration's matmul feeds the next one's through the carry: none is last.
    def model(stacked, x):
        x, _ = jax.lax.scan(lambda h, w: (jax.nn.relu(h @ w), None), x, stacked)
        return _loss(x)

    assert _float8_share(model, jnp.stack(LAYERS), X) == 1.0


def test_a_loss_computed_inside_a_scan_keeps_the_head_inside_it():
    # Micro-batches: each iteration runs the model and adds its loss to the carry.
    def model(w, head, xs):
        def step(total, x):
            return total + _loss(jax.nn.relu(x @ w) @ head), None

        return jax.lax.scan(step, 0.0, xs)[0]

    xs = X.reshape(4, 16, WIDTH)
    assert _float8_share(model, LAYERS[0], HEAD_W, xs) == pytest.approx(0.5)
    _, details = _details(model, LAYERS[0], HEAD_W, xs)
    _assert_only_the_last_kept(details, 1)


def test_several_heads_are_each_kept():
    # Two outputs off one trunk: each head's result reaches the loss with no matmul after it.
    def two_heads(layers, head, x):
        h = jax.nn.relu(x @ layers[0])
        return _loss(h @ head) + _loss(h @ layers[1])

    assert _float8_share(two_heads, LAYERS, HEAD_W, X) == pytest.approx(1 / 3)
    _, details = _details(two_heads, LAYERS, HEAD_W, X)
    assert details[1:] == [HEAD, HEAD] and details[0].startswith("float8"), details


def test_the_rule_can_be_turned_off():
    def mlp(layers, head, x):
        for w in layers:
            x = jax.nn.relu(x @ w)
        return _loss(x @ head)

    recipe = jaxamp.fp8.Fp8Recipe(keep_small_bf16=None, keep_last_matmul_bf16=False)
    jaxpr = jax.make_jaxpr(jaxamp.amp(mlp, compute_dtype=recipe))(LAYERS, HEAD_W, X)
    dots = [e for e in iter_eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 5 and all(e.invars[0].aval.dtype == E4M3 for e in dots)


def test_a_head_inside_a_cond_is_kept_in_each_branch():
    # Two heads chosen at run time (a task switch): each branch's matmul ends
    # the program there, the trunk's feeds both.
    def switched(layers, heads, x, task):
        h = jax.nn.relu(x @ layers[0])
        logits = jax.lax.cond(task, lambda h: h @ heads[0], lambda h: h @ heads[1], h)
        return _loss(logits)

    heads = (HEAD_W, LAYERS[1])
    closed = jax.make_jaxpr(jaxamp.amp(switched, compute_dtype=FP8))(LAYERS, heads, X, True)
    (cond,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "cond"]
    for branch in cond.params["branches"]:
        (dot,) = [e for e in iter_eqns(branch) if e.primitive.name == "dot_general"]
        assert dot.invars[0].aval.dtype == jnp.bfloat16, branch
    # The trunk in float8; both branches counted (equal FLOPs each).
    assert _float8_share(switched, LAYERS, heads, X, True) == pytest.approx(1 / 3)


def test_a_cond_between_layers_keeps_its_matmuls_in_float8():
    # A matmul in a branch whose result feeds the head is no last matmul.
    def gated(layers, head, x, deep):
        h = jax.lax.cond(deep, lambda h: jax.nn.relu(h @ layers[0]), lambda h: h, x)
        return _loss(h @ head)

    assert _float8_share(gated, LAYERS, HEAD_W, X, True) == pytest.approx(0.5)
