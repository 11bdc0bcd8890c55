"""explain() and find_nonfinite()."""

import inspect
import json
import math
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp import amp, amp_stop, explain, find_nonfinite
from jaxamp.diagnostics._explain import _fold_scope

# Runs on the oldest supported JAX too (.ci/run): it touches JAX internals.
pytestmark = pytest.mark.jax_internals

KEY = jax.random.PRNGKey(0)
D, T, LAYERS = 16, 8, 3


def _scanned_transformer(params, x):
    def block(h, p):
        att = jax.nn.softmax((h @ p["q"]) @ (h @ p["k"]).T / 4.0) @ h
        h = h + att @ p["o"]
        return h + jnp.tanh(h @ p["up"]) @ p["down"], None

    h, _ = jax.lax.scan(jax.checkpoint(block), x, params)
    with amp_stop():
        head = h @ h.T  # deliberately float32
    return head.sum()


def _params():
    keys = jax.random.split(KEY, 5)
    shapes = {"q": (D, D), "k": (D, D), "o": (D, D), "up": (D, 2 * D), "down": (2 * D, D)}
    return {n: jax.random.normal(k, (LAYERS, *s)) / 4 for (n, s), k in zip(shapes.items(), keys)}


def _independent_flops(jaxpr, scale=1):
    """(low-precision, total) dot FLOPs of an amp'd jaxpr, scan lengths multiplied in."""
    low = total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            lhs, rhs = (v.aval.shape for v in eqn.invars)
            free = math.prod(d for i, d in enumerate(rhs) if i not in rc and i not in rb)
            flops = 2 * math.prod(lhs) * free * scale
            total += flops
            if all(v.aval.dtype == jnp.float16 for v in eqn.invars):
                low += flops
        for value in eqn.params.values():
            sub = getattr(value, "jaxpr", value)
            if hasattr(sub, "eqns"):
                factor = eqn.params["length"] if eqn.primitive.name == "scan" else 1
                l, t = _independent_flops(sub, scale * factor)
                low, total = low + l, total + t
    return low, total


@pytest.mark.newest_only
def test_flop_share_matches_an_independent_count_over_the_amp_jaxpr():
    params, x = _params(), jax.random.normal(KEY, (T, D))
    report = explain(_scanned_transformer)(params, x)
    low, total = _independent_flops(jax.make_jaxpr(amp(_scanned_transformer))(params, x).jaxpr)
    assert report.total_matmul_flops == total
    assert report.low_precision_flop_fraction == pytest.approx(low / total)
    assert 0.5 < report.low_precision_flop_fraction < 1.0  # the amp_stop head is float32
    scanned = [r for r in report.rows if r.primitive == "dot_general" and r.trip_count == LAYERS]
    assert len(scanned) == 7  # each scan-body matmul reported once, weighted by length


def test_amp_stop_region_is_reported_as_such():
    params, x = _params(), jax.random.normal(KEY, (T, D))
    report = explain(_scanned_transformer, compute_dtype="bf16")(params, x)
    stopped = [r for r in report.rows if r.decided_by == "amp_stop"]
    assert [r.primitive for r in stopped] == ["transpose", "dot_general"]
    assert stopped[1].dtypes_after == ("f32", "f32") and stopped[1].scope == "amp_stop"
    assert report.kept_full_by_amp_stop == 2
    assert report.compute_dtype == "bf16"
    text = str(report)
    assert "amp_stop" in text and "dot_general" in text and "low precision" in text
    json.dumps(report.to_dict())  # JSON-ready


@pytest.mark.newest_only
def test_rows_record_rule_source_casts_and_source_line():
    def f(w, x):
        with jax.named_scope("proj"):
            return jnp.exp(x @ w)

    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    rows = explain(f, amp_policy=jaxamp.default_amp_policy | {"proj": jaxamp.use_precision("bf16")})(w, x).rows
    dot = next(r for r in rows if r.primitive == "dot_general")
    assert dot.decided_by == "scope:proj" and dot.scope == "proj"
    assert dot.original_dtypes == ("f32", "f32") and dot.dtypes_after == ("bf16", "bf16")
    assert dot.casts == 2 and dot.flops == 2 * 2 * 4 * 4
    assert dot.source and "test_diagnostics.py" in dot.source


def _planted_overflow(w, x):
    h = x @ w  # 300 * 300 * 4 = 360000 > 65504: overflows float16
    return jnp.tanh(h).sum()  # tanh(inf) == 1 hides it


OVERFLOW_LINE = inspect.getsourcelines(_planted_overflow)[1] + 1


def test_find_nonfinite_points_at_the_hidden_f16_overflow():
    w, x = jnp.full((4, 4), 300.0), jnp.full((2, 4), 300.0)
    assert bool(jnp.isfinite(amp(_planted_overflow)(w, x)))  # the symptom is hidden
    found = find_nonfinite(_planted_overflow)(w, x)
    assert found is not None
    assert found.primitive == "dot_general"
    assert found.file.endswith("test_diagnostics.py") and found.line == OVERFLOW_LINE
    assert found.input_dtypes == ("f16", "f16") and found.output_dtypes == ("f16",)
    assert found.input_ranges == ((300.0, 300.0), (300.0, 300.0))
    assert found.output_ranges == (None,)  # nothing finite left
    assert "dot_general" in str(found)


@pytest.mark.newest_only
def test_find_nonfinite_returns_none_in_bf16():
    w, x = jnp.full((4, 4), 300.0), jnp.full((2, 4), 300.0)
    assert find_nonfinite(_planted_overflow, compute_dtype="bf16")(w, x) is None


def test_find_nonfinite_looks_inside_scan_and_jit_bodies():
    @jax.jit
    def layer(h, w):
        with jax.named_scope("inner"):
            return jnp.tanh(h @ w)

    def f(w, x):
        return jax.lax.scan(lambda h, _: (layer(h * 300.0, w), None), x, None, length=3)[0].sum()

    found = find_nonfinite(f)(jnp.full((4, 4), 300.0), jnp.full((2, 4), 1.0))
    assert found is not None and found.primitive == "dot_general" and found.scope == "inner"


def _per_device_tanh(x, w):
    return jnp.tanh(x @ w)


def test_find_nonfinite_says_it_cannot_look_inside_a_shard_map_body(fresh_warnings):
    # A shard_map body runs traced (per device), so its equations' values
    # cannot be checked one by one: find_nonfinite says so once, naming the
    # shard_map, and finds an overflow at the first equation after the body
    # (it used to fail with JAX's TracerBoolConversionError).
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:4])

    def f(w, x):
        h = jax.shard_map(_per_device_tanh, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))(x, w)
        return jnp.sum(h @ w)

    lines, first = inspect.getsourcelines(f)
    shard_map_line, matmul_line = first + 1, first + 2
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.full((8, 4), 300.0), jax.sharding.NamedSharding(mesh, P("data")))
        with pytest.warns(UserWarning, match=rf"shard_map body at test_diagnostics.py:{shard_map_line} .*not checked"):
            assert find_nonfinite(f)(jnp.full((4, 4), 300.0), x) is None  # tanh hides the overflow inside
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = find_nonfinite(f)(jnp.full((4, 4), 3e4), x)  # 4 * 3e4 overflows float16 after the body
    assert not [w for w in caught if "shard_map body" in str(w.message)]  # said once
    assert found is not None and found.primitive == "dot_general" and found.line == matmul_line


def test_diagnostics_validate_their_input():
    with pytest.raises(TypeError, match="explain expects a callable"):
        explain(3)
    with pytest.raises(TypeError, match="find_nonfinite expects a callable"):
        find_nonfinite("f")
    with pytest.raises(ValueError, match="f17"):
        explain(_planted_overflow, compute_dtype="f17")
    with pytest.raises(TypeError, match="unexpected keyword"):
        explain(_planted_overflow, compute="bf16")


def _numbered_layers(params, x):
    for i, w in enumerate(params):
        with jax.named_scope(f"layer_norm_{i + 3}"):
            x = jnp.tanh(x @ w)
    return jnp.sum(x @ params[0])


@pytest.mark.newest_only
def test_printed_table_folds_repeated_layers_and_shows_source_lines():
    params = [jnp.full((8, 8), 0.1)] * 10
    report = jaxamp.explain(_numbered_layers, compute_dtype="bf16")(params, jnp.ones((4, 8)))
    folded, unfolded = report.table().splitlines(), report.table(fold=False).splitlines()
    assert "source" in folded[1].split()
    layer_rows = [line for line in folded if line.startswith("layer_norm_*")]
    # Ten instances, one set of rows, counts summed: the first layer's matmul
    # (a float32 input) apart from the other nine's (bfloat16 from the tanh).
    assert sorted(line.split()[1:3] for line in layer_rows) == [
        ["dot_general", "1"],
        ["dot_general", "9"],
        ["tanh", "10"],
    ]
    assert all("test_diagnostics.py:" in line for line in layer_rows)
    assert sum(line.startswith("layer_norm_") for line in unfolded) == 20
    assert str(report) == report.table()


@pytest.mark.newest_only
def test_printed_table_shows_operand_dtypes_before_and_after():
    params = [jnp.full((8, 8), 0.1)] * 2
    report = jaxamp.explain(_numbered_layers, compute_dtype="bf16")(params, jnp.ones((4, 8)))
    header, *lines = report.table().splitlines()[1:]
    columns = header.split()  # "decided by" is two words
    assert columns[5:8] == ["before", "after", "out"]
    dot = next(line.split() for line in lines if line.split()[1] == "dot_general")
    assert dot[4:7] == ["f32,f32", "bf16,bf16", "bf16"]
    tanh = next(line.split() for line in lines if line.split()[1] == "tanh")
    assert tanh[4:7] == ["bf16", "bf16", "bf16"]


@pytest.mark.parametrize(
    "scope, folded",
    [
        ("layers_3/attn", "layers_*/attn"),
        ("Dense_12", "Dense_*"),
        ("blocks.3.mlp", "blocks.*.mlp"),
        ("layers/3/mlp", "layers/*/mlp"),
        ("bsd,3dkh->bs3kh", "bsd,3dkh->bs3kh"),
        ("conv3x3_1", "conv3x3_*"),
        ("h2o", "h2o"),
    ],
)
@pytest.mark.newest_only
def test_folding_replaces_instance_numbers_only(scope, folded):
    assert _fold_scope(scope) == folded


def test_headline_counts_decisions_not_equations_that_stayed_float32():
    def fn(w, x, key):
        noise = jax.random.normal(key, x.shape)  # float32 arithmetic, no decision
        return jax.nn.logsumexp((x + noise) @ w, axis=-1).mean()

    report = jaxamp.explain(fn, compute_dtype="bf16")(jnp.eye(8), jnp.ones((4, 8)), jax.random.key(0))
    stayed = [r for r in report.rows if r.full_precision and not r.kept_full_on_purpose]
    assert stayed  # the random-number arithmetic, not counted
    kept = [r for r in report.rows if r.kept_full_on_purpose]
    assert kept and all(r.decided_by == "tail" for r in kept)  # the loss
    assert report.kept_full_by_rule == len(kept)
    assert f"{len(kept)} kept in float32 by rule" in str(report).splitlines()[0]
    assert report.moved_to_half >= 1  # the matmul's operands
